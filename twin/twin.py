"""The digital twin: serving iterations replayed through a planner on a cluster, every cost counted.

Pure (numpy; no Ray, gRPC or Kubernetes). In: iterations (timestamps, phases, actual loads
[L, E]), the forecasts the planner sees ([I, L, E]), a planner, a cluster (replica slots per GPU,
expert bytes) and a measured cost profile; settings: keep-alive, prefetch distance d, the tier
cold loads come from, the cadence of planning. Out: per-iteration, per-layer records
(`TwinRecord`, twin/record.py). `moeless bench planner` and `moeless eval` are built on it.

The model, per iteration (docs/design.md, "What a plan costs" and "The paper's model"):
1. Hosts (twin/hosts.py): each GPU's replicas in expert_fn's replica table, so keep-alive and
   eviction are the hosts' own rules. The deployment's initial layout (static EP's, or the
   planner's fixed one: full replication, production EPLB's first) is resident from the start
   (pre-warmed, not counted as loads). Before each iteration, loads that are done land and
   replicas idle for keep_alive_s are evicted; a load evicts idle replicas to make room.
2. Plan, at one of two cadences (`TwinSettings.cadence`):
   - "iteration": the planner gets this iteration's forecast [L, E] and what is resident, and its
     plan is what the iteration runs on. Its replicas are in use until the next plan (no
     keep-alive expiry in between; their last use is the iteration's time); those not resident
     are cold loads: layer t's are issued when layer max(t - d, 0)
     starts (a forecast made d layers ahead), each GPU loads one after another (load_s each),
     and layer t waits for the last of its loads: exposed_t = max(0, done - start_t). Planners
     whose calls the data plane routes (placement.planner.relevels: moeless's) never wait: as in
     `moeless serve`, whose routed call uses only replicas that have landed, layer t runs on the
     plan's replicas whose loads are done by start_t, each expert's shares scaled back over them
     (`shares.landed`), and a copy still loading joins a later call.
   - "loop": the live planning loop, mirrored with its own rules (controller/planning/rules.py,
     twin/loop_mirror.py): a pass every period_s plans each phase's forecast merged over the
     reports of the last window_s (their union resident), sends the loads, and publishes the
     plan's loaded replicas; every iteration runs on what is published, so a load is never
     waited for (a replica is used once it has landed). A replica's last use is a call with tokens.
3. Time, layer by layer: `serial` and `paper` layer times on the actual loads (the Oracle's on
   its lossy loads). moeless's planners leave each call's shares to the data plane, as `moeless
   serve` runs them (`actual_shares`): where a layer has copies, the batch is paired with them
   (placement/dispatch.py) where the most that can save beats relevel_s, paying relevel_s for
   it, and otherwise keeps the better of its planned shares and static EP's split; every such
   call pays the profile's check_s, or its skip_s where the gate skips the check
   (placement/check_gate.py: per layer and phase, recent checks that did not pay). The baselines
   keep their shares. Layer t + 1 starts when
   layer t ends (serial time + exposed).
4. Memory, two billing models: `resident`, every replica's bytes for the seconds it holds them
   (from its load's start to its eviction, or the end; per iteration, what is held after its
   loads began, for the iteration's window); `per-layer` (the paper's C), a layer's replicas'
   bytes for its time. Non-expert weights are held the whole run under both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from moeless.placement.check_gate import CheckGate
from moeless.placement.cluster import Cluster
from moeless.placement.planner import Planner, initial_placement
from moeless.placement.profile import CostProfile
from moeless.placement.shares import landed, with_stand_ins
from moeless.twin.hosts import TwinClock, TwinHosts, pairs_of
from moeless.twin.iterations import Iteration
from moeless.twin.loop_mirror import LoopMirror
from moeless.twin.record import GB, TwinRecord

CADENCES = ("iteration", "loop")
BEHIND_PLANNERS = frozenset({"eplb-production"})  # move weights behind serving (eplb_production.py, step 5)
SAMPLES = 16  # a sample planner's batches at cadence "iteration": the phase's last ones and the forecast


@dataclass(frozen=True)
class TwinSettings:
    """keep_alive_s: seconds an unused replica stays resident; distance: d, layers a forecast (and
    so a load) starts ahead; tier: where cold loads come from ("host" memory, "disk", or "peer": a
    GPU that holds the expert, where the profile prices it); cadence:
    "iteration" or "loop" (module docstring); period_s, window_s: the loop's seconds between passes
    and the reports a pass merges (controller/planning/settings.LoopSettings' defaults)."""

    keep_alive_s: float = 1.0
    distance: int = 1
    tier: str = "host"
    cadence: str = "iteration"
    period_s: float = 0.25
    window_s: float = 2.0

    def __post_init__(self) -> None:
        if self.keep_alive_s < 0 or self.distance < 0:
            raise ValueError(f"keep_alive_s and distance must be >= 0, got {self.keep_alive_s}, {self.distance}")
        if self.tier not in ("host", "disk", "peer"):
            raise ValueError(f"tier must be 'host', 'disk' or 'peer', got {self.tier!r}")
        if self.cadence not in CADENCES:
            raise ValueError(f"cadence must be one of {CADENCES}, got {self.cadence!r}")
        if self.period_s <= 0 or self.window_s <= 0:
            raise ValueError(f"period_s and window_s must be > 0, got {self.period_s}, {self.window_s}")


def replay(planner: Planner, iterations: Sequence[Iteration], forecasts: np.ndarray, cluster: Cluster,
           profile: CostProfile, settings: TwinSettings = TwinSettings(), progress=None) -> TwinRecord:
    """Replay `iterations` with `planner` seeing `forecasts` [I, L, E]; see the module docstring."""
    num_iter = len(iterations)
    forecasts = np.asarray(forecasts, dtype=np.float64)
    if num_iter == 0 or forecasts.shape[0] != num_iter:
        raise ValueError(f"need one forecast [L, E] per iteration: {num_iter} iterations, forecasts {forecasts.shape}")
    num_layers, num_experts = forecasts.shape[1:]
    num_gpus = cluster.num_gpus
    model = profile.latency_model(settings.tier)
    times = np.array([it.time_s for it in iterations], dtype=np.float64)
    gaps = np.diff(times)
    window = np.append(gaps, np.median(gaps) if gaps.size else 0.0)
    shape = (num_iter, num_layers)
    rec = TwinRecord(times, window, np.array([it.phase for it in iterations]), *(np.zeros(shape) for _ in range(4)),
                     *(np.zeros(shape, dtype=np.int64) for _ in range(4)), np.zeros(shape), np.zeros(shape),
                     settings={"keep_alive_s": settings.keep_alive_s, "distance": settings.distance, "tier": settings.tier,
                               "cadence": settings.cadence, "load_s": model.cold_start, "planner": planner.name,
                               "num_experts": num_experts})
    clock = TwinClock(float(times[0]))
    initial = initial_placement(planner, cluster, num_layers, num_experts)
    hosts = TwinHosts(cluster, num_layers, num_experts, settings.keep_alive_s, model.cold_start, clock, initial)
    loop = LoopMirror(planner, cluster, hosts, forecasts, rec.phase, times, settings) if settings.cadence == "loop" else None
    behind = Behind(hosts, initial) if loop is None and planner.name in BEHIND_PLANNERS else None
    bytes_gb = cluster.expert_bytes / GB
    gate = CheckGate(profile.check_s)
    previous = hosts.hold(pairs_of(initial) if loop is None else np.zeros((0, 3), np.int64))
    for i, it in enumerate(iterations):
        now = clock.now = float(times[i])
        # 1. Loads that are done land; keep-alive.
        hosts.land(now)
        rec.evictions[i] += hosts.expire()
        # 2. The placement this iteration runs on; its replicas in use meanwhile ("iteration").
        if behind is not None:
            sent, evicted = behind.step(planner(forecasts[i], cluster, hosts.placement()), now)
            rec.evictions[i] += evicted
            plan = behind.served
        elif loop is None:
            plan = planner(_samples(iterations, forecasts, i) if planner.samples else forecasts[i], cluster, hosts.placement())
        else:
            sent, evicted = loop.step(i, now)
            rec.evictions[i] += evicted
            plan = loop.published()
        in_use, dropped = hosts.hand_over(previous, pairs_of(plan) if loop is None else np.zeros((0, 3), np.int64))
        # the previous plan (at first static EP's, which the deployment starts on) stayed in use until
        # this one: no expiry in between; its last use was its own time
        clock.now = float(times[max(i - 1, 0)])
        rec.evictions[i] += hosts.release(dropped)
        clock.now = now
        if loop is None:  # what the plan let go of, once its expert's new replica serves (Placement.release)
            rec.evictions[i] += hosts.evict(np.array(plan.releasable(hosts.resident), np.int64).reshape(-1, 3))
        previous = in_use
        actual = planner.lossy_load(it.load) if planner.lossy_load else it.load
        # 3. Loads (queued per GPU) and time, layer by layer.
        start, starts, used = 0.0, np.zeros(num_layers), []
        for l, lp in enumerate(plan.layers):
            starts[l] = start
            cold = np.unique(np.stack([lp.expert, lp.gpu], axis=1)[~(hosts.resident[l, lp.expert, lp.gpu]
                                                                      | hosts.loading[l, lp.expert, lp.gpu])], axis=0)
            issued = now + starts[max(l - settings.distance, 0)]
            done = now
            for e, g in cold.tolist():
                finish, evicted = hosts.load(l, e, g, issued)
                rec.evictions[i] += evicted
                done = max(done, finish)
            pending = hosts.loading[l, lp.expert, lp.gpu]  # loads this layer waits for, its own or earlier
            if pending.any():
                done = max(done, float(max(hosts.queue[g] for g in np.unique(lp.gpu[pending]))))
            per_gpu = np.bincount(cold[:, 1], minlength=num_gpus) if cold.size else np.zeros(num_gpus, np.int64)
            rec.loads[i, l] = int(per_gpu.sum()) + (int(sent[l]) if loop is not None or behind is not None else 0)
            rec.cold_s[i, l] = float(per_gpu.max()) * model.cold_start
            waits = bool(cold.size or pending.any())
            if waits and planner.relevels and loop is None:  # the data plane routes over what has landed
                usable = hosts.resident[l, lp.expert, lp.gpu] | (hosts.loading[l, lp.expert, lp.gpu]
                                                                 & (hosts.ready[l, lp.expert, lp.gpu] <= now + start))
                lp, usable = with_stand_ins(lp, usable, hosts.resident[l])  # serving's rule (rules.publishable)
                if np.bincount(lp.expert[usable], minlength=num_experts).all():
                    lp, waits = landed(lp, usable, num_experts), False
            rec.exposed_s[i, l] = max(done - (now + start), 0.0) if waits else 0.0
            dispatch = 0.0
            if planner.relevels and lp.num_replicas > num_experts:
                relevel_s = profile.relevel_for(lp.num_replicas, num_experts, num_gpus)
                routed = gate.route(l, it.phase, np.rint(actual[l]).astype(np.int64), lp, model, num_gpus, relevel_s)
                lp = routed.layer
                dispatch = (profile.check_s if routed.checked else profile.skip_s) + (relevel_s if routed.paired else 0.0)
            rec.serial_s[i, l] = model.layer_time(actual[l], lp, num_gpus, "serial") + dispatch
            rec.paper_s[i, l] = model.layer_time(actual[l], lp, num_gpus, "paper") + dispatch
            start += rec.serial_s[i, l] + rec.exposed_s[i, l]
            rec.planned[i, l] = lp.num_replicas
            rec.gb_s_per_layer[i, l] = (rec.serial_s[i, l] + rec.exposed_s[i, l]) * lp.num_replicas * bytes_gb
            if loop is not None:  # a replica's last use is a call with tokens
                tokens = lp.replica_tokens(np.rint(actual[l]).astype(np.int64))
                used.append(np.stack([np.full(int((tokens > 0).sum()), l), lp.expert[tokens > 0], lp.gpu[tokens > 0]], axis=1))
        # 4. Memory held after the loads began, for the iteration's window; a call's last use.
        if used:
            hosts.release(hosts.hold(np.concatenate(used).astype(np.int64)))
        planner.learn(it.load)  # its gates' report
        rec.resident[i] = hosts.held()
        rec.gb_s_resident[i] = rec.resident[i] * window[i] * bytes_gb
        if progress is not None:
            progress.update(1)
    hosts.release(previous)
    rec.non_expert_gb_s = profile.non_expert_bytes / GB * float(window.sum())
    return rec


def _samples(iterations: Sequence[Iteration], forecasts: np.ndarray, i: int) -> np.ndarray:
    """[B, L, E] for a planner that plans on samples at iteration i: the actual loads of the last
    SAMPLES - 1 iterations of i's phase (what the gates reported) and the forecast for i."""
    phase = iterations[i].phase
    past = [j for j in range(i - 1, -1, -1) if iterations[j].phase == phase][:SAMPLES - 1]
    return np.stack([*(iterations[j].load.astype(np.float64) for j in reversed(past)), forecasts[i]])


class Behind:
    """A planner whose layout changes load behind serving (production EPLB): the layout served
    stays until every replica of the new one has landed, then the new one is served and the
    replicas it dropped are evicted at once (their buffers freed). Its loads are never waited for."""

    def __init__(self, hosts: TwinHosts, initial) -> None:
        self.hosts, self.served, self.target = hosts, initial, initial

    def step(self, plan, now: float) -> tuple[np.ndarray, np.ndarray]:
        """(loads sent, evictions made), each per layer [L]."""
        hosts = self.hosts
        sent = np.zeros(hosts.resident.shape[0], dtype=np.int64)
        evicted = sent.copy()
        if plan is not self.target and plan is not self.served:
            self.target = plan
            new = np.unique(pairs_of(plan), axis=0)
            for l, e, g in new[~(hosts.resident[new[:, 0], new[:, 1], new[:, 2]] | hosts.loading[new[:, 0], new[:, 1], new[:, 2]])].tolist():
                evicted += hosts.load(l, e, g, now)[1]
                sent[l] += 1
        if self.target is not self.served:
            wanted = pairs_of(self.target)
            if hosts.resident[wanted[:, 0], wanted[:, 1], wanted[:, 2]].all():
                keep = {tuple(p) for p in wanted.tolist()}
                dropped = np.array([p for p in pairs_of(self.served).tolist() if tuple(p) not in keep], np.int64).reshape(-1, 3)
                self.served = self.target
                evicted += hosts.evict(dropped)
        return sent, evicted
