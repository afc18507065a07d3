"""The planning loop follows the pool (controller/planning/actor.py over controller/pool/sources.py): it plans
over the ready hosts only, a host that joins is planned for without a restart, one that is not
ready any more is planned around.

The loop's class runs in this process (no Ray actor: with predictor "off" it publishes nothing),
over real expert-host processes and a pool file, as `moeless serve`'s supervisor writes it.
"""

import time

from moeless.expert_fn.client import ExpertHostClient
from moeless.controller.knobs import Knobs
from moeless.controller.pool.members import Member
from moeless.controller.planning.actor import LoopSettings, PlanLoop
from moeless.controller.pool.sources import FileSource, write_members
from moeless.placement.profile import CostProfile

PROFILE = CostProfile(alpha=2e-5, beta=1e-8, call_overhead=1e-6, load_s={"disk": 1e-4, "host": 1e-6},
                      expert_bytes=9216, non_expert_bytes=100_000, relevel_s=1e-5, source="test")


def _wait(check, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _resident(address):
    with ExpertHostClient(address, timeout_s=10) as client:
        return sum(r["state"] in ("warm", "idle", "loading") for r in client.status()["replicas"])


def test_the_loop_plans_over_ready_hosts_and_follows_hosts_joining_and_leaving(tiny_store, hosts, tmp_path):
    model, _ = tiny_store
    a, b, c = hosts.addresses
    path = tmp_path / "pool.json"
    write_members(path, 3, [Member(0, a), Member(1, b)])  # slot 2 empty (its host not started yet)
    settings = LoopSettings(pool=FileSource.open(str(path)), num_layers=model.spec.num_layers,
                            num_experts=model.spec.num_experts, knobs=Knobs(predictor="off", distance=1),
                            profile=PROFILE, board="unused", period_s=0.05, idle_s=0.1, pool_period_s=0.05)
    loop = PlanLoop.__ray_metadata__.modified_class(settings)  # the actor's class, in this process
    try:
        _wait(lambda: loop.state()["passes"] >= 2, "the first passes")
        assert loop.state()["hosts_live"] == [True, True, False] and _resident(c) == 0
        write_members(path, 3, [Member(0, a), Member(1, b), Member(2, c)])  # scale-out
        _wait(lambda: loop.state()["hosts_live"] == [True, True, True], "host 2 planned for")
        write_members(path, 3, [Member(0, a), Member(1, b, ready=False), Member(2, c)])  # host 1 draining
        _wait(lambda: loop.state()["hosts_live"] == [True, False, True], "host 1 planned around")
        assert loop.state()["errors"] == 0
    finally:
        loop.stop()


def test_a_loop_started_on_a_pool_at_zero_runs_and_plans_once_a_host_appears(tiny_store, hosts, tmp_path):
    model, _ = tiny_store
    a = hosts.addresses[0]
    path = tmp_path / "pool.json"
    write_members(path, 3, [])  # scaled to zero
    settings = LoopSettings(pool=FileSource.open(str(path)), num_layers=model.spec.num_layers,
                            num_experts=model.spec.num_experts, knobs=Knobs(predictor="off", distance=1),
                            profile=PROFILE, board="unused", period_s=0.05, idle_s=0.1, pool_period_s=0.05)
    loop = PlanLoop.__ray_metadata__.modified_class(settings)  # with a profile it needs no host to start
    try:
        _wait(lambda: loop.state()["passes"] >= 3, "passes at zero")
        state = loop.state()
        assert state["hosts_live"] == [False] * 3 and state["loads_sent"] == 0 and not state["stalled"]
        write_members(path, 3, [Member(0, a)])  # woken
        _wait(lambda: loop.state()["hosts_live"] == [True, False, False] and loop.state()["loads_sent"] > 0,
              "host 0 planned for")
        assert loop.state()["errors"] == 0
    finally:
        loop.stop()
