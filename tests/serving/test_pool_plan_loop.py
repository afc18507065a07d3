"""The planning loop follows the pool (controller/planning/actor.py over controller/pool/sources.py): it plans
over the ready hosts only, a host that joins is planned for without a restart, one that is not
ready any more is planned around.

The loop's class runs in this process (no Ray actor: with predictor "off" it publishes nothing),
over real expert-host processes and a pool file, as `moeless serve`'s supervisor writes it.
"""

from pathlib import Path

from moeless.expert_fn.client.client import ExpertHostClient
from moeless.controller.knobs import Knobs
from moeless.controller.pool.members import Member
from moeless.controller.planning.actor import PlanLoop
from moeless.controller.planning.settings import LoopSettings
from moeless.controller.planning.knob_sources import FileKnobs
from moeless.controller.pool.sources import FileSource, write_members
from moeless.placement.profile import CostProfile

from host_waits import empty, resident, wait_until

PROFILE = CostProfile(alpha=2e-5, beta=1e-8, call_overhead=1e-6, load_s={"disk": 1e-4, "host": 1e-6},
                      expert_bytes=9216, non_expert_bytes=100_000, relevel_s=1e-5, source="test")


def _keep_alive(address):
    with ExpertHostClient(address, timeout_s=10) as client:
        return client.status()["keep_alive_s"]


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
        wait_until(lambda: loop.state()["passes"] >= 2, "the first passes")
        assert loop.state()["hosts_live"] == [True, True, False] and resident(c) == 0
        write_members(path, 3, [Member(0, a), Member(1, b), Member(2, c)])  # scale-out
        wait_until(lambda: loop.state()["hosts_live"] == [True, True, True], "host 2 planned for")
        write_members(path, 3, [Member(0, a), Member(1, b, ready=False), Member(2, c)])  # host 1 draining
        wait_until(lambda: loop.state()["hosts_live"] == [True, False, True], "host 1 planned around")
        assert loop.state()["errors"] == 0
    finally:
        loop.stop()


def test_a_pool_that_grows_its_slots_while_serving_is_planned_over_them_and_shrinks_back(tiny_store, hosts, tmp_path):
    """maxHosts raised while serving: the pool file says 3 slots where it said 2; the next passes plan
    over 3 hosts and load host 2's home replicas there, no restart; back to 2, host 2 is not planned for."""
    model, _ = tiny_store
    a, b, c = hosts.addresses
    path = tmp_path / "pool.json"
    write_members(path, 2, [Member(0, a), Member(1, b), Member(2, c)])  # pod 2 exists, beyond the 2 slots
    settings = LoopSettings(pool=FileSource.open(str(path)), num_layers=model.spec.num_layers,
                            num_experts=model.spec.num_experts, knobs=Knobs(predictor="off", distance=1),
                            profile=PROFILE, board="unused", period_s=0.05, idle_s=0.1, pool_period_s=0.05)
    loop = PlanLoop.__ray_metadata__.modified_class(settings)
    try:
        wait_until(lambda: loop.state()["passes"] >= 2, "the first passes")
        empty(c)  # what earlier tests left on host 2
        assert loop.state()["hosts_live"] == [True, True]
        write_members(path, 3, [Member(0, a), Member(1, b), Member(2, c)])  # maxHosts 2 -> 3
        wait_until(lambda: loop.state()["hosts_live"] == [True, True, True], "the third slot planned for")
        wait_until(lambda: resident(c) > 0, "host 2's home replicas loaded")
        assert loop.metrics()["expert_gb_s"] >= 0 and len(loop.host_figures.meters) == 3
        write_members(path, 2, [Member(0, a), Member(1, b), Member(2, c)])  # and back
        wait_until(lambda: loop.state()["hosts_live"] == [True, True], "back to two slots")
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
        wait_until(lambda: loop.state()["passes"] >= 3, "passes at zero")
        state = loop.state()
        assert state["hosts_live"] == [False] * 3 and state["loads_sent"] == 0 and not state["stalled"]
        write_members(path, 3, [Member(0, a)])  # woken
        wait_until(lambda: loop.state()["hosts_live"] == [True, False, False] and loop.state()["loads_sent"] > 0,
              "host 0 planned for")
        assert loop.state()["errors"] == 0
    finally:
        loop.stop()


def test_a_knobs_file_changed_while_the_loop_runs_is_applied_and_a_bad_one_refused(tiny_store, hosts, tmp_path):

    model, _ = tiny_store
    pool = tmp_path / "pool.json"
    write_members(pool, 3, [Member(i, a) for i, a in enumerate(hosts.addresses)])
    knobs = tmp_path / "knobs.yaml"
    knobs.write_text("predictor: \"off\"\ndistance: 1\n")
    settings = LoopSettings(pool=FileSource.open(str(pool)), num_layers=model.spec.num_layers,
                            num_experts=model.spec.num_experts, knobs=Knobs(predictor="off", distance=1),
                            profile=PROFILE, board="unused", period_s=0.05, idle_s=0.1, pool_period_s=0.05,
                            knob_source=FileKnobs(str(knobs)), knob_period_s=0.05)
    loop = PlanLoop.__ray_metadata__.modified_class(settings)
    try:
        wait_until(lambda: loop.state()["generation"] == 1, "the file as started")
        neutral = loop.state()["memory_price"]
        knobs.write_text("predictor: \"off\"\ndistance: 1\nmemoryPrice: 0.25\nscaler: false\n")  # an ablation, live
        wait_until(lambda: loop.state()["generation"] == 2, "the change applied")
        state = loop.state()
        assert state["memory_price"] == 0.25 != neutral and state["planner"] == "moeless-no-scaler"
        assert state["knob_error"] == "" and state["restart_pending"] == []
        knobs.write_text("predictor: \"off\"\ndistance: 1\nplanner: static\nscaler: false\n")  # static has no scaler
        wait_until(lambda: loop.state()["knob_error"], "the refusal")
        state = loop.state()
        assert "generation 3 refused" in state["knob_error"] and "scaler/placer" in state["knob_error"]
        assert state["generation"] == 2 and state["planner"] == "moeless-no-scaler"  # the running knobs stay
        knobs.write_text("predictor: gate\ndistance: 1\n")  # built into the replicas' forward: a restart applies it
        wait_until(lambda: loop.state()["generation"] == 4, "the next change")
        state = loop.state()
        assert state["restart_pending"] == ["predictor"] and state["predictor"] == "off" and state["planner"] == "moeless"
        # The default distance reaches past this tiny model's layers: shortened, as at start-up, not refused.
        assert Knobs().distance >= model.spec.num_layers
        knobs.write_text("predictor: \"off\"\nkeepAliveSeconds: 30\n")
        wait_until(lambda: loop.state()["generation"] == 5, "a change that keeps the default distance")
        assert loop.state()["restart_pending"] == [] and loop.state()["knob_error"] == ""
        # The keep-alive reaches the hosts live (Configure), each of them, without a restart.
        pids = [hosts.pid(i) for i in range(len(hosts))]
        wait_until(lambda: all(_keep_alive(a) == 30.0 for a in hosts.addresses), "the hosts' keep-alive set live")
        assert [hosts.pid(i) for i in range(len(hosts))] == pids
        knobs.write_text("planner: [not, a, name")
        wait_until(lambda: "not YAML" in loop.state()["knob_error"], "a file that is not YAML")
        assert loop.state()["errors"] == 0 and loop.state()["generation"] == 5
    finally:
        loop.stop()


def test_a_knobs_file_read_while_it_is_rewritten_is_not_a_generation(tmp_path, monkeypatch):
    """A file rewritten in place reads empty for a moment, and an empty file is every default: a new
    content counts only once two reads settle_s apart agree."""
    path = tmp_path / "knobs.yaml"
    source = FileKnobs(str(path), settle_s=0.0)
    reads = iter([b"scaler: false\n", b"scaler: false\n", b"", b"scaler: true\n", b"scaler: true\n", b"scaler: true\n"])
    monkeypatch.setattr(Path, "read_bytes", lambda self: next(reads))
    assert source.read() == (1, "scaler: false\n")
    assert source.read() == (1, "scaler: false\n")  # empty, then changed again: still being written
    assert source.read() == (2, "scaler: true\n")


def test_an_emptied_knobs_file_must_stay_empty_longer_before_it_counts(tmp_path, monkeypatch):
    """A busy machine can read a truncated file twice before the writer writes: an empty file (every
    default) counts only once it reads empty over empty_settle_s."""
    path = tmp_path / "knobs.yaml"
    path.write_text("scaler: false\n")
    source = FileKnobs(str(path), settle_s=0.01, empty_settle_s=0.5)
    waits: list[float] = []
    monkeypatch.setattr("moeless.controller.planning.knob_sources.time.sleep", waits.append)
    assert source.read() == (1, "scaler: false\n")
    path.write_text("")
    assert source.read() == (2, "")
    assert waits == [0.01, 0.5]
