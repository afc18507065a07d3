"""The step scaler end to end (real Ray Serve, the planning loop actor, three real expert-host
processes, the tiny model): the loop plans over one host, the others are warm spares; a request
whose step the gate prices above the SLO on one host is held until the loop has widened onto the
spares and this replica runs that placement, then answered exactly as the in-process model; the
width falls back to one host after the hold, and the next widening, the spares still holding their
part, is answered by publishing that placement again; /metrics shows the width and the holds. The loop's
side alone (PlanLoop in this process over the real hosts): a widening is answered once the spares
hold what the plan gave them."""

import httpx
import ray
from ray import serve

from moeless.controller.knobs import Knobs
from moeless.controller.planning.actor import PlanLoop
from moeless.controller.planning.names import NAMESPACE
from moeless.controller.planning.settings import LoopSettings
from moeless.controller.planning.step_scaler import step_expert_s
from moeless.controller.pool.sources import StaticSource
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.placement.profile import CostProfile
from moeless.serving.loadgen import replay

from host_waits import empty, resident, wait_until

MODEL, LOOP, BOARD = "tiny-mixtral", "test-step-loop", "test-step-board"
PROFILE = CostProfile(alpha=2e-5, beta=1e-8, call_overhead=1e-6, load_s={"disk": 1e-4, "host": 1e-6},
                      expert_bytes=9216, non_expert_bytes=100_000, relevel_s=1e-5, source="test: compute-bound")
HOLD_S = 1.0
PROMPTS = ["Once upon a time a small model routed its tokens", "to experts far away and waited for them to come",
           "back with answers, as every MoE layer does."]


def test_a_widening_is_answered_once_the_spares_hold_their_part(tiny_store, hosts):
    model, _ = tiny_store
    settings = LoopSettings(pool=StaticSource(tuple(hosts.addresses)), num_layers=model.spec.num_layers,
                            num_experts=model.spec.num_experts, knobs=Knobs(predictor="off", distance=1),
                            profile=PROFILE, board="unused", period_s=0.05, idle_s=0.1, pool_period_s=0.05,
                            width_floor=1, width_hold_s=HOLD_S)
    for address in hosts.addresses:  # the module's hosts may hold another test's replicas
        empty(address)
    loop = PlanLoop.__ray_metadata__.modified_class(settings)  # the actor's class, in this process
    try:
        wait_until(lambda: loop.state()["passes"] >= 2, "the first passes", timeout=30.0)
        a, b, c = hosts.addresses
        assert loop.state()["hosts_live"] == [True, False, False] and loop.state()["width"] == 1
        assert resident(a) > 0 and resident(b) == resident(c) == 0  # spares: ready, empty
        assert loop.widen(3) == (3, 0, None)  # predictor off: the homes move, nothing is published
        assert loop.state()["hosts_live"] == [True, True, True] and resident(b) > 0 and resident(c) > 0
        assert loop.widenings.as_dict()["settled"] == 1
        assert loop.widen(2) == (3, 0, None) and loop.widenings.as_dict()["asked"] == 1  # held already: no pass
        wait_until(lambda: loop.state()["hosts_live"] == [True, False, False], "the width back at one host after the hold",
                   timeout=30.0)
        assert loop.state()["width"] == 1 and loop.state()["errors"] == 0
    finally:
        loop.stop()


def test_a_request_needing_the_spares_waits_for_them_and_answers_exactly(tiny_store, ray_serve, deploy_tiny,
                                                                        reference_text):
    model, root = tiny_store
    spec = model.spec
    shortest = min(len(p) for p in PROMPTS)  # the character codec: a token a character
    slo_s = step_expert_s(shortest, PROFILE, spec.num_layers, spec.top_k, spec.num_experts) / 3  # each needs 3 hosts
    with launch_local_hosts(3, root, keep_alive_s=60, metrics=False) as group:
        knobs = Knobs(planner="moeless", predictor="gate", distance=1, keep_alive_s=60, memory_price=0.0)
        deploy_tiny(group.addresses, MODEL, placement_board=BOARD, plan_loop=LOOP, knobs=knobs, profile=PROFILE,
                    step_slo_s=slo_s, step_hosts=1, step_hold_s=HOLD_S)
        loop = ray.get_actor(LOOP, namespace=NAMESPACE)
        try:
            wait_until(lambda: ray.get(loop.state.remote())["hosts_live"] == [True, False, False], "one host planned over",
                       timeout=30.0)
            url = ray_serve
            outcomes = replay(url, MODEL, PROMPTS, [0.0, 0.05, 0.1], 6, timeout_s=120)
            assert [o.text for o in outcomes] == [reference_text(model, p, 6) for p in PROMPTS]
            gate = _stats()["step_gate"]
            assert gate["holds"] >= 1 and gate["timeouts"] == 0 and gate["granted"] == 3
            widenings = ray.get(loop.metrics.remote())["widenings"]
            assert widenings["settled"] >= 1 and len(widenings["settle_s"]) >= 1
            assert all(resident(a) > 0 for a in group.addresses)  # the spares took their part
            metrics = httpx.get(f"{url}/metrics", timeout=30).text
            assert 'moeless_step_width_hosts{model="tiny-mixtral"}' in metrics or "moeless_step_width_hosts " in metrics
            assert "moeless_step_gate_holds" in metrics and 'moeless_step_gate_wait_seconds{quantile="p99"}' in metrics
            wait_until(lambda: ray.get(loop.state.remote())["width"] == 1, "the width back at one host after the hold",
                       timeout=30.0)
            # a narrow loop again, the spares still holding their part (keep-alive 60 s): the replica runs
            # the loop's standby placement over them at once, nobody held; widen republishes it, no pass
            again = replay(url, MODEL, PROMPTS[:1], [0.0], 6, timeout_s=120)
            now = _stats()["step_gate"]
            assert again[0].text == outcomes[0].text
            assert now["switches"] > gate["switches"] and now["holds"] == gate["holds"] and now["timeouts"] == 0
            wait_until(lambda: ray.get(loop.metrics.remote())["widenings"]["settled"] > widenings["settled"],
                       "the loop's own answer to the switched widening", timeout=30.0)
            assert ray.get(loop.metrics.remote())["widenings"]["warm"] >= 1
            metrics = httpx.get(f"{url}/metrics", timeout=30).text
            assert "moeless_step_widenings_warm" in metrics and "moeless_step_widenings_cold" in metrics
            assert "moeless_step_gate_switches" in metrics
        finally:
            ray.get(loop.stop.remote())
            ray.kill(loop)


def _stats():
    return serve.get_deployment_handle("ModelServer", "moeless").stats.remote().result()


def test_admitted_now_a_request_needing_the_spares_goes_in_while_the_loop_widens(tiny_store, ray_serve, deploy_tiny,
                                                                                 reference_text):
    model, root = tiny_store
    spec = model.spec
    slo_s = step_expert_s(min(len(p) for p in PROMPTS), PROFILE, spec.num_layers, spec.top_k, spec.num_experts) / 3
    with launch_local_hosts(3, root, keep_alive_s=60, metrics=False) as group:
        knobs = Knobs(planner="moeless", predictor="gate", distance=1, keep_alive_s=60, memory_price=0.0)
        deploy_tiny(group.addresses, MODEL, placement_board=BOARD, plan_loop=LOOP, knobs=knobs, profile=PROFILE,
                    step_slo_s=60.0, step_slos_s=((MODEL, slo_s),), step_hosts=1, step_hold_s=HOLD_S, step_admit="now")
        loop = ray.get_actor(LOOP, namespace=NAMESPACE)
        try:
            wait_until(lambda: ray.get(loop.state.remote())["hosts_live"] == [True, False, False], "one host planned over",
                       timeout=30.0)
            outcomes = replay(ray_serve, MODEL, PROMPTS, [0.0, 0.05, 0.1], 6, timeout_s=120)
            assert [o.text for o in outcomes] == [reference_text(model, p, 6) for p in PROMPTS]
            gate = _stats()["step_gate"]
            assert gate["holds"] == 0 and gate["widenings"] >= 1  # asked for the spares, held nobody
            assert gate["slos_s"] == {MODEL: slo_s}  # the model's own SLO binds (the engine's 60 s never would)
            # priced with the loop's refit of its cost profile, as its planner is (asked, never waited for)
            assert ray.get(loop.cost_scale.remote()) == ray.get(loop.metrics.remote())["latency_fit"]["a"] > 0
            assert gate["price_scale"] > 0
            metrics = httpx.get(f"{ray_serve}/metrics", timeout=30).text
            assert 'moeless_step_slo_seconds{model="*"} 60.0' in metrics and f'moeless_step_slo_seconds{{model="{MODEL}"}}' in metrics
            wait_until(lambda: ray.get(loop.metrics.remote())["widenings"]["settled"] >= 1,
                       "the loop's widening onto the spares settled", timeout=30.0)
        finally:
            ray.get(loop.stop.remote())
            ray.kill(loop)
