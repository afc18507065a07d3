"""The digital twin: resident set and keep-alive, prefetch timing, billing, and the cost profile."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moeless.twin.iterations import Iteration
from moeless.placement.planner import Planner, PlannerConfig, get_planner
from moeless.placement.profile import CostProfile, ProfileError
from moeless.twin.twin import TwinSettings, replay
from moeless.placement.cluster import Cluster
from moeless.placement.types import LayerPlacement, Placement

PROFILE = CostProfile(alpha=1e-6, beta=0.0, call_overhead=0.0, load_s={"disk": 1e-3, "host": 1e-4},
                      expert_bytes=10**9, non_expert_bytes=2 * 10**9, relevel_s=0.0, source="a test")
L, E, G = 3, 4, 2


def iterations(loads: list[np.ndarray], step: float = 0.1, phase: str = "decode") -> list[Iteration]:
    return [Iteration(phase, np.asarray(w, dtype=np.int64), 1, (), i * step) for i, w in enumerate(loads)]


def cluster() -> Cluster:
    return Cluster.uniform(G, 3 * L, expert_bytes=PROFILE.expert_bytes, layer_cap_replicas=2 * E)


_CALLS: list = []


def extra_replica_once(forecast, cluster, previous, config):
    """A test planner: static EP, plus on its first call a replica of expert 0 on GPU 1 in every layer."""
    _CALLS.append(previous)
    static = Placement.static(forecast.shape[0], forecast.shape[1], cluster.num_gpus)
    if len(_CALLS) > 1:
        return static
    layer = LayerPlacement(np.array([0, 1, 2, 3, 0]), np.array([0, 0, 1, 1, 1]), np.array([0.5, 1, 1, 1, 0.5]))
    return Placement(tuple(layer for _ in range(forecast.shape[0])), forecast.shape[1], cluster.num_gpus)


def test_static_ep_never_loads_and_pays_all_experts_memory_for_the_whole_run():
    its = iterations([np.full((L, E), 3)] * 5)
    record = replay(get_planner("static"), its, np.stack([i.load for i in its]), cluster(), PROFILE)
    assert record.loads.sum() == 0 and record.evictions.sum() == 0 and (record.exposed_s == 0).all()
    run_s = record.window_s.sum()
    assert run_s == pytest.approx(0.5)
    assert record.gb_s("resident").sum() == pytest.approx(L * E * 1.0 * run_s)  # 1 GB per expert, held all run
    assert record.non_expert_gb_s == pytest.approx(2.0 * run_s)
    assert record.gb_s("per-layer").sum() == pytest.approx((record.serial_s * E * 1.0).sum())


def test_an_unplanned_replica_stays_for_keep_alive_then_is_evicted_and_billed_until_then():
    _CALLS.clear()
    its = iterations([np.full((L, E), 2)] * 12, step=0.1)
    settings = TwinSettings(keep_alive_s=0.35, distance=0)
    record = replay(get_planner(f"{__name__}:extra_replica_once"), its, np.stack([i.load for i in its]),
                    cluster(), PROFILE, settings)
    assert record.loads[0].tolist() == [1] * L and record.loads[1:].sum() == 0
    assert _CALLS[1].layers[0].num_replicas == 5  # the planner saw the extra replica as resident
    assert record.resident[:, 0].tolist() == [5, 5, 5, 5, 4, 4, 4, 4, 4, 4, 4, 4]
    assert record.evictions[4].tolist() == [1] * L and record.evictions.sum() == L  # last used at 0.0, gone at 0.4
    # Layer 0's memory: 4 GB all run, plus the extra one from 0.0 until the hosts' keep-alive check
    # evicts it: the first check after 0.35 s idle, at 0.4 (expert_fn's replica table, twin/hosts.py).
    assert record.gb_s_resident[:, 0].sum() == pytest.approx(4 * 1.2 + 0.4)


@pytest.mark.parametrize("distance, exposed", [(0, [5e-6] * 3), (1, [5e-6, 0, 0]), (2, [5e-6, 0, 0])])
def test_a_cold_load_started_d_layers_ahead_hides_their_time(distance, exposed):
    _CALLS.clear()
    its = iterations([np.full((L, E), 4)])
    profile = CostProfile(**{**vars(PROFILE), "load_s": {"disk": 1e-3, "host": 5e-6}})
    record = replay(get_planner(f"{__name__}:extra_replica_once"), its, np.stack([i.load for i in its]),
                    cluster(), profile, TwinSettings(distance=distance))
    # Every layer loads one replica on GPU 1 (5 us) and takes 10 us (GPU 1: 4 + 4 + 2 tokens). A load
    # starts when layer max(l - d, 0) starts: with d = 0 each waits its whole load; with d >= 1 only
    # layer 0's load is exposed (there is no earlier layer to hide it behind).
    assert record.serial_s[0].tolist() == pytest.approx([10e-6] * L)
    assert record.cold_s[0].tolist() == pytest.approx([5e-6] * L)
    assert record.exposed_s[0].tolist() == pytest.approx(exposed, abs=1e-15)
    assert record.hidden_s[0].tolist() == pytest.approx([5e-6 - x for x in exposed], abs=1e-15)
    assert record.layer_time("serial")[0].tolist() == pytest.approx([10e-6 + x for x in exposed])


def test_cold_loads_queue_on_their_gpu():
    _CALLS.clear()
    its = iterations([np.full((L, E), 4)])
    record = replay(get_planner(f"{__name__}:extra_replica_once"), its, np.stack([i.load for i in its]),
                    cluster(), PROFILE, TwinSettings(distance=2))
    # 100 us loads, all issued when layer 0 starts, one after another on GPU 1: done at 100, 200, 300 us;
    # layers start at 0, 110, 210 us.
    assert record.exposed_s[0].tolist() == pytest.approx([100e-6, 90e-6, 90e-6])


def test_perfectly_predicted_uniform_loads_give_every_lossless_planner_the_same_layer_time_and_oracle_is_a_bound():
    its = iterations([np.full((L, E), 16)] * 4, phase="prefill")
    forecasts = np.stack([i.load for i in its])
    config = PlannerConfig(model=PROFILE.latency_model(), eplb_replicas=E)
    times = {}
    for name in ("static", "moeless", "moeless-fill", "eplb", "eplb-window", "paper"):
        record = replay(get_planner(name, config), its, forecasts, cluster(), PROFILE, TwinSettings(distance=1))
        times[name] = record.layer_time("serial", cold=False).mean()
    assert len({round(t, 15) for t in times.values()}) == 1, times
    skewed = iterations([np.array([[30, 2, 0, 0]] * L)] * 3, phase="prefill")
    oracle = replay(get_planner("oracle", config), skewed, np.stack([i.load for i in skewed]), cluster(), PROFILE)
    ours = replay(get_planner("moeless", config), skewed, np.stack([i.load for i in skewed]), cluster(), PROFILE)
    assert oracle.layer_time().mean() <= ours.layer_time().mean()


def split_expert_zero(forecast, cluster, previous, config):
    """A test planner: static EP plus a replica of expert 0 on GPU 1, shares fixed at 0.9 / 0.1."""
    layer = LayerPlacement(np.array([0, 1, 2, 3, 0]), np.array([0, 0, 1, 1, 1]), np.array([0.9, 1, 1, 1, 0.1]))
    return Placement(tuple(layer for _ in range(forecast.shape[0])), forecast.shape[1], cluster.num_gpus)


def test_moeless_shares_are_relevelled_on_the_actual_loads_and_pay_the_relevel_others_keep_theirs():
    its = iterations([np.array([[20, 4, 4, 4]] * L)] * 2 + [np.array([[2, 20, 4, 4]] * L)], phase="prefill")
    profile = CostProfile(**{**vars(PROFILE), "relevel_s": 3e-6, "relevel_check_s": 1e-6})
    config = PlannerConfig(model=profile.latency_model())
    times = {}
    for name in ("fixed-shares", "moeless-fixed-shares"):
        planner = Planner(name, split_expert_zero, config)
        times[name] = replay(planner, its, np.stack([i.load for i in its]), cluster(), profile).serial_s
    # Iteration 0: the copies are loading; moeless's calls route static EP's split (24 tokens on GPU 0).
    assert times["moeless-fixed-shares"][0].tolist() == pytest.approx([24e-6] * L)
    # Fixed shares: GPU 0 runs 0.9 x 20 + 4 = 22 tokens. Re-levelled: 8 of expert 0's tokens on GPU 1,
    # 16 tokens a GPU, plus the re-level (3 us) and the check that it pays (1 us).
    assert times["fixed-shares"][1].tolist() == pytest.approx([22e-6] * L)
    assert times["moeless-fixed-shares"][1].tolist() == pytest.approx([16e-6 + 3e-6 + 1e-6] * L)
    # Iteration 2: GPU 0 runs expert 0's 2 tokens (0.9 x 2, whole) beside expert 1's 20; a re-level
    # can save at most those 2 us, less than its 3 us, so the shares stay and only the check is paid.
    assert times["fixed-shares"][2].tolist() == pytest.approx([22e-6] * L)
    assert times["moeless-fixed-shares"][2].tolist() == pytest.approx([22e-6 + 1e-6] * L)


def test_a_relevel_costs_more_on_a_layer_of_more_replicas(tmp_path):
    """relevel_s is timed on the E homes and G copies; each replica more adds relevel_per_replica_s
    (full replication of E = 64 on 8 GPUs: 440 more). An older profile file has none: 0."""
    p = CostProfile(**{**vars(PROFILE), "relevel_s": 5e-6, "relevel_per_replica_s": 0.02e-6})
    assert p.relevel_for(64 + 8, 64, 8) == p.relevel_for(64, 64, 8) == 5e-6
    assert p.relevel_for(512, 64, 8) == pytest.approx(5e-6 + 440 * 0.02e-6)
    assert CostProfile.from_json(p.to_json(tmp_path / "r.json")) == p
    assert PROFILE.relevel_per_replica_s == 0.0 and PROFILE.relevel_for(10**6, 4, 2) == PROFILE.relevel_s
    doc = json.loads(p.to_json(tmp_path / "bad.json").read_text())
    doc["relevel_per_replica_s"] = -1
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match="relevel_per_replica_s: expected a finite number >= 0"):
        CostProfile.from_json(tmp_path / "bad.json")


def test_replay_checks_its_inputs():
    its = iterations([np.full((L, E), 1)] * 2)
    with pytest.raises(ValueError, match="one forecast"):
        replay(get_planner("static"), its, np.ones((3, L, E)), cluster(), PROFILE)
    with pytest.raises(ValueError, match="tier"):
        TwinSettings(tier="ssd")


def test_cost_profile_round_trips_and_names_a_missing_field(tmp_path):
    path = PROFILE.to_json(tmp_path / "p.json")
    assert CostProfile.from_json(path) == PROFILE
    assert PROFILE.relevel_check_s is None and PROFILE.check_s == PROFILE.relevel_s  # an older file: the check costs a re-level
    checked = CostProfile(**{**vars(PROFILE), "relevel_check_s": 2e-6})
    assert CostProfile.from_json(checked.to_json(tmp_path / "c.json")).check_s == 2e-6
    assert checked.skip_s == 2e-6  # no skip measured: a skipped call costs the check
    gated = CostProfile.from_json(CostProfile(**{**vars(checked), "relevel_skip_s": 5e-7}).to_json(tmp_path / "g.json"))
    assert (gated.check_s, gated.skip_s) == (2e-6, 5e-7)
    bad = json.loads((tmp_path / "g.json").read_text())
    bad["relevel_skip_s"] = -1
    (tmp_path / "g.json").write_text(json.dumps(bad))
    with pytest.raises(ProfileError, match=r"g\.json: relevel_skip_s: expected a finite number >= 0"):
        CostProfile.from_json(tmp_path / "g.json")
    doc = json.loads(path.read_text())
    del doc["alpha"]
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=r"p\.json: cost profile lacks 'alpha' \(seconds per token"):
        CostProfile.from_json(path)
    doc["alpha"], doc["load_s"] = 1e-6, {"disk": 1e-3}
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match="every tier"):
        CostProfile.from_json(path)
    with pytest.raises(ProfileError, match="no such cost profile"):
        CostProfile.from_json(tmp_path / "missing.json")


def heavy_expert_zero_copied(forecast, cluster, previous, config):
    """A test planner: static EP plus a replica of expert 0 on GPU 1 in every layer, shares 0.5 / 0.5."""
    layer = LayerPlacement(np.array([0, 1, 2, 3, 0]), np.array([0, 0, 1, 1, 1]), np.array([0.5, 1, 1, 1, 0.5]))
    return Placement(tuple(layer for _ in range(forecast.shape[0])), forecast.shape[1], cluster.num_gpus)


@pytest.mark.parametrize("name", ["copies-waited-for", "moeless-copies"])
def test_a_routed_planner_never_waits_for_a_load_and_uses_a_copy_once_it_has_landed(name):
    its = iterations([np.array([[8, 0, 0, 0]] * L)], phase="prefill")
    profile = CostProfile(**{**vars(PROFILE), "load_s": {"disk": 1e-3, "host": 5e-6}})
    record = replay(Planner(name, heavy_expert_zero_copied, PlannerConfig(model=profile.latency_model())), its,
                    np.stack([i.load for i in its]), cluster(), profile, TwinSettings(distance=1))
    # Static EP: GPU 0 runs expert 0's 8 tokens (8 us); with the copy 4 + 4. The copies load one after
    # another on GPU 1 (5 us each), layer l's issued when layer max(l - 1, 0) starts.
    if name == "copies-waited-for":  # the paper's model: each layer waits for its copy
        assert record.exposed_s[0].tolist() == pytest.approx([5e-6, 1e-6, 1e-6])  # done at 5, 10, 15; starts 0, 9, 14
        assert record.serial_s[0].tolist() == pytest.approx([4e-6] * L)
    else:  # moeless serve's routed call: layers 0 and 1 start (0, 8 us) before their copies land (5... 10 us)
        assert record.exposed_s[0].tolist() == [0.0] * L
        assert record.serial_s[0].tolist() == pytest.approx([8e-6, 8e-6, 4e-6])  # layer 2's landed at 15 <= 16
    assert record.loads[0].tolist() == [1] * L and record.resident[0].tolist() == [E + 1] * L


def test_a_moeless_home_move_waits_for_no_load_and_releases_the_old_home_at_once():
    """Experts 0 and 1 hot in GPU 0's static block: moeless moves a home after 3 plans (its gates'
    loads learnt). The new home loads behind serving (no exposed time), the old one serves until it
    has landed, is then evicted at once (keep-alive is a minute) and the layer runs faster after."""
    hot = np.array([[40, 40, 1, 1]] * L)
    its = iterations([hot] * 10, step=0.1)
    config = PlannerConfig(model=PROFILE.latency_model(), home_moves_first=3, gb_s_price=1e9)  # no copies
    record = replay(get_planner("moeless", config), its, np.stack([i.load for i in its]).astype(float), cluster(),
                    PROFILE, TwinSettings(keep_alive_s=60.0, distance=1))
    assert (record.exposed_s == 0).all()
    assert record.loads[:3].sum() == 0 and record.loads[3].tolist() == [2] * L  # two experts swap homes
    assert record.evictions[4:].sum(axis=0).tolist() == [2] * L  # the old homes, once the new ones landed
    assert record.resident[-1].tolist() == [E] * L  # not E + 2 for keep-alive's minute
    assert record.serial_s[-1].max() < record.serial_s[0].min()  # 41 tokens a GPU, not 80
