"""A home move in the running loop: the planning loop (its class, in this process) over real expert
hosts with production EPLB (N = 0, its first rebalance after 3 iterations) and with moeless (its
homes moved, placement/home_moves.py, a chance every 5 plans after 3), fed by a serving executor's reports
while it generates; each load the loop sends lands LOAD_S late. A move takes experts off their
hosts: the new host loads them behind serving, the old layout serves until then, the placement
that drops an old replica is published only once every replica it routes to is resident, the old
host releases it only after that (evicted by the loop, well before its keep-alive of a minute:
Placement.release, on a pass that plans or not: no report comes after the move is published), and
every generation equals the in-process model's.

The board is the one seam: the loop's publish goes straight to the executor's PlacementSource
(the Ray actor that carries it to serving replicas is tested in test_live_loop.py)."""

import contextlib
import dataclasses
import threading
import time

import pytest
import torch

from moeless.controller.knobs import Knobs
from moeless.controller.planning import actor
from moeless.controller.planning.settings import LoopSettings
from moeless.controller.pool.members import Member
from moeless.controller.pool.sources import FileSource, write_members
from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.errors import ExpertHostUnavailable
from moeless.placement.profile import CostProfile
from moeless.serving.executor import RemoteExecutor
from moeless.serving.live_executor import LiveExecutor
from moeless.serving.placement_source import PlacementSource

PROFILE = CostProfile(alpha=2e-5, beta=1e-8, call_overhead=1e-6, load_s={"disk": 1e-4, "host": 1e-6},
                      expert_bytes=9216, non_expert_bytes=100_000, relevel_s=1e-5, source="test")
KEEP_ALIVE_S = 60.0  # the old replica must go well before this: the loop evicts it
RELEASED_S = 12.0  # once no published placement routes to it
LOAD_S = 0.5  # each prefetch the loop sends lands this late (tiny experts load in microseconds)
RESIDENT = ("warm", "idle")


def _held(clients) -> set[tuple[int, int, int]]:
    """(layer, expert, host) of every resident replica, read from the hosts."""
    return {(r["layer"], r["expert"], h) for h, c in enumerate(clients) for r in c.status()["replicas"]
            if r["state"] in RESIDENT}


def _replicas(placement) -> set[tuple[int, int, int]]:
    return {(l, e, g) for l, lp in enumerate(placement.layers) for e, g in zip(lp.expert.tolist(), lp.gpu.tolist())}


@pytest.mark.parametrize("planner, extra", [
    ("eplb-production", {"eplb_redundant": 0, "eplb_first_rebalance": 3}),
    ("moeless", {"home_moves_first": 3, "home_moves_every": 5}),  # a chance to move every 5 plans: one pays
])
def test_a_home_move_loads_behind_serving_and_releases_the_old_home_after(planner, extra, tiny_store,
                                                                          hosts, tmp_path, monkeypatch):
    model, _ = tiny_store
    spec = model.spec
    path = tmp_path / "pool.json"
    write_members(path, 3, [Member(i, a) for i, a in enumerate(hosts.addresses)])
    clients = [ExpertHostClient(a, timeout_s=30) for a in hosts.addresses]
    for h, c in enumerate(clients):  # what earlier tests of the module left: the hosts start empty
        for r in c.status()["replicas"]:
            c.evict(r["layer"], r["expert"])
    source = PlacementSource.static(spec.num_layers, spec.num_experts, 3)
    published = []  # (when, placement, what the hosts held then)
    quiet = threading.Event()  # set once a move is published: no report after it (traffic may stop there)

    def publish(placement, board):
        if published and _replicas(published[-1][1]) - _replicas(placement):
            quiet.set()
        published.append((time.monotonic(), placement, _held(clients)))
        source.set(placement)
        return len(published)

    monkeypatch.setattr(actor, "publish_placement", publish)
    load = ExpertHostClient.load

    sent = []  # (layer, expert, host) of every load the loops send
    sources = {}  # (layer, expert, host) -> the peer each load was told to copy from ("": its store)
    landing: list[threading.Timer] = []  # the slow loads still to land (waited for before the clients close)

    def slow_load(client, layer, expert, wait=False, source=""):  # a load that takes LOAD_S, as a large expert's does
        sent.append((layer, expert, hosts.addresses.index(client.address)))
        sources[sent[-1]] = source
        if wait:
            return load(client, layer, expert, wait=True, source=source)
        def land():
            # the loop stopped and closed its client first (a closed or cancelled channel): the test is over
            with contextlib.suppress(ValueError, ExpertHostUnavailable):
                load(client, layer, expert, source=source)
        landing.append(timer := threading.Timer(LOAD_S, land))
        timer.start()
        return "loading"

    monkeypatch.setattr(ExpertHostClient, "load", slow_load)  # the loop's prefetches
    knobs = Knobs(planner=planner, predictor="history", distance=1, keep_alive_s=KEEP_ALIVE_S)
    settings = LoopSettings(pool=FileSource.open(str(path)), num_layers=spec.num_layers, num_experts=spec.num_experts,
                            knobs=knobs, profile=PROFILE, board="unused", period_s=0.05, idle_s=0.1, pool_period_s=0.05,
                            planner_extra=extra)
    loop = actor.PlanLoop.__ray_metadata__.modified_class(settings)
    live = LiveExecutor(RemoteExecutor(clients, source), spec.num_layers, spec.num_experts, replica="test",
                        sink=lambda report: quiet.is_set() or loop.report(report))
    g = torch.Generator().manual_seed(7)
    try:
        for _ in range(3):  # a placement after the move may route every home it left again: then the next move
            moved = _a_move_releases_its_old_homes(loop, live, published, sources, hosts, clients, model, g)
            if any(r not in _replicas(published[-1][1]) for _, r in moved):
                break
            quiet.clear()  # reports again, until the next placement that drops a replica
        else:
            raise AssertionError(f"three moves' old homes were all routed again ({len(published)} published)")
    finally:  # the loop runs on while old homes are released (moeless evicts them from it)
        loop.stop()
    try:
        still = {"moeless": ({"home_moves_first": 1000}, "where the hosts held them"),  # no move of its own meanwhile
                 "eplb-production": ({**extra, "eplb_first_rebalance": 1000}, "took up the layout resident")}[planner]
        _a_restarted_loop_keeps_the_moved_homes(settings, source, clients, published, sent, moved, model, g, *still)
    finally:
        for timer in list(landing):  # a slow load due after the clients close would fail on a closed channel
            timer.join()
        for c in clients:
            c.close()


def _a_move_releases_its_old_homes(loop, live, published, sources, hosts, clients, model, g):
    """Generates until a published placement drops a replica (the test's first part), checks that move,
    waits for its old homes to be released; returns [(k, (layer, expert, old host))] dropped at published[k]."""
    start, moved, deadline = len(published), [], time.monotonic() + 60
    while time.monotonic() < deadline:
        ids = torch.randint(0, 128, (2, 6), generator=g)
        assert torch.equal(model.generate(ids, 4, executor=live), model.generate(ids, 4))  # nothing changed
        moved = [(k, r) for k in range(max(1, start), len(published))
                 for r in _replicas(published[k - 1][1]) - _replicas(published[k][1])]
        if moved:
            break
    assert moved, f"no published placement dropped a replica in 60 s ({len(published)} published)"
    assert loop.state()["errors"] == 0
    for k, (l, e, old) in moved:
        when, placement, held = published[k]
        routed = {r for r in _replicas(placement) if r[:2] == (l, e)}
        assert routed and routed <= held, f"expert {(l, e)} published on {routed} before all were resident ({held})"
        assert (l, e, old) in held  # the old home still held when the layout that drops it took over
        # the new home copied it from a host holding it (expert_fn/host/peer_copy.py), the old home or another
        new = [r for r in routed if r[2] != old and r in sources]
        assert new and all(sources[r] in hosts.addresses for r in new), {r: sources.get(r) for r in routed}
    # Released by the loop (the keep-alive is a minute) once no call reaches it (the executor
    # routes by the last placement only), with no report since the move was published.
    deadline = time.monotonic() + RELEASED_S
    while time.monotonic() < deadline and any((l, e, old) in _held(clients) for _, (l, e, old) in moved
                                              if (l, e, old) not in _replicas(published[-1][1])):
        ids = torch.randint(0, 128, (1, 4), generator=g)
        assert torch.equal(model.generate(ids, 2, executor=live.inner), model.generate(ids, 2))
        time.sleep(0.2)
    last = _replicas(published[-1][1])
    assert not {r for _, r in moved if r not in last} & _held(clients)
    return moved


def _a_restarted_loop_keeps_the_moved_homes(settings, source, clients, published, sent, moved, model, g, extra, says):
    """The loop made again over the same hosts (a restarted controller): it adopts the homes (moeless)
    or the layout (production EPLB) they hold, so it loads none of the old homes back and routes each
    moved expert where it was moved; its planner says so (`says` in its first line)."""
    sent.clear()
    old = {r for _, r in moved if r not in _replicas(published[-1][1])}
    assert old and not old & _held(clients)
    count = len(published)
    settings = dataclasses.replace(settings, planner_extra=extra)
    loop = actor.PlanLoop.__ray_metadata__.modified_class(settings)
    live = LiveExecutor(RemoteExecutor(clients, source), settings.num_layers, settings.num_experts, replica="test",
                        sink=loop.report)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (len(published) < count + 1 or loop.state()["plans"] < 5):
            ids = torch.randint(0, 128, (2, 6), generator=g)
            assert torch.equal(model.generate(ids, 4, executor=live), model.generate(ids, 4))
        assert len(published) > count and loop.state()["plans"] >= 5 and loop.state()["errors"] == 0
        assert not set(sent) & old, f"the restarted loop loaded old homes back: {sorted(set(sent) & old)}"
        assert not old & _replicas(published[-1][1]) and not old & _held(clients)
        assert says in loop._planner.describe()[0], loop._planner.describe()
    finally:
        loop.stop()
