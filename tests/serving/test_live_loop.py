"""The live loop end to end (real Ray Serve with two serving replicas on one planning loop, real
expert-host processes, the tiny model; forwards of 4 tokens or more split into two micro-batches in
flight, as `moeless serve --micro-batches 2` does): greedy outputs over a replayed trace with placements
changing equal the in-process model's; a host killed mid-replay loses no request and re-joins; a
stalled planning loop shows in /healthz and /metrics within 5 s; an evicted replica that is still
routed to is re-loaded on demand (an exposed cold start, counted)."""

import os
import signal
import threading
import time

import httpx
import numpy as np
import pytest
import ray
import torch

from moeless.twin.arrivals import arrival_times
from moeless.placement.profile import CostProfile
from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.controller.knobs import Knobs
from moeless.model.interface import Routing
from moeless.placement.types import LayerPlacement, Placement
from moeless.serving.executor import RemoteExecutor
from moeless.serving.loadgen import replay
from moeless.serving.placement_source import PlacementSource
from moeless.controller.planning.names import NAMESPACE

MODEL = "tiny-mixtral"
LOOP, BOARD = "test-live-loop", "test-live-board"
# A cost profile where expert compute dominates the call overhead (as on a GPU for large batches), so
# the planner adds replicas for the tiny model's skew and placements change during the replay.
PROFILE = CostProfile(alpha=2e-5, beta=1e-8, call_overhead=1e-6, load_s={"disk": 1e-4, "host": 1e-6},
                      expert_bytes=9216, non_expert_bytes=100_000, relevel_s=1e-5, source="test: compute-bound")


@pytest.fixture(scope="module")
def live(tiny_store, ray_serve, deploy_tiny):
    _, root = tiny_store
    with launch_local_hosts(3, root, keep_alive_s=60, metrics=False) as group:
        knobs = Knobs(planner="moeless", predictor="gate", distance=1, keep_alive_s=60, memory_price=0.0)
        deploy_tiny(group.addresses, MODEL, num_replicas=2, placement_board=BOARD, plan_loop=LOOP, knobs=knobs,
                    profile=PROFILE, loop=(("stall_s", 1.5),),  # two ModelServers, one loop: one plan for all
                    micro_batches=2, micro_batch_tokens=2)
        loop = ray.get_actor(LOOP, namespace=NAMESPACE)
        yield ray_serve, group, loop
        ray.get(loop.stop.remote())
        ray.kill(loop)


def _prompts(n):
    text = "Once upon a time a small model routed its tokens to experts far away and waited for them. "
    return [text[(7 * i) % 40:][: 24 + (13 * i) % 60] for i in range(n)]


def _replay(url, prompts, max_tokens, span_s):
    arrivals, _ = arrival_times(len(prompts))  # the Azure trace's arrivals, or a Poisson process
    arrivals = arrivals * span_s / max(arrivals[-1], 1e-9)
    return replay(url, MODEL, prompts, arrivals, max_tokens, timeout_s=120)


def _stats():
    from ray import serve

    return serve.get_deployment_handle("ModelServer", "moeless").stats.remote().result()


def _largest(read, tries: int = 20) -> float:
    """The largest of `tries` readings of a one-replica figure: Serve sends each ask to one of the two
    ModelServers, and only one of them may have run a split forward (the replay's requests are few)."""
    return max(read() for _ in range(tries))


def test_replayed_trace_with_changing_placements_equals_the_reference(live, tiny_store, reference_text):
    url, _, loop = live
    model, _ = tiny_store
    prompts = _prompts(24)
    outcomes = _replay(url, prompts, 8, span_s=3.0)
    for o in outcomes:
        assert o.status == 200 and o.error is None, o.error
        assert o.text == reference_text(model, prompts[o.index], 8)
    metrics = ray.get(loop.metrics.remote())
    assert metrics["publishes"] >= 2 and metrics["loads_sent"] > 0  # placements changed while serving
    assert metrics["resident_replicas"] > model.spec.num_layers * model.spec.num_experts  # more than static EP's
    assert _stats()["placement_version"] >= 2
    # Ping-pong needs forwards of two prompts or four rows at once; the replay's arrivals may not give one on a
    # slow machine, so a burst of eight requests at once (each replica then prefills several prompts together).
    burst = _prompts(8)
    for o in replay(url, MODEL, burst, np.zeros(len(burst)), 8, timeout_s=120):
        assert o.status == 200 and o.text == reference_text(model, burst[o.index], 8)
    assert _largest(lambda: _stats()["baton_s"]) > 0  # micro-batches took turns on a replica
    assert len(metrics["stats"]["replicas"]) == 2  # both ModelServers' iterations were planned for
    decode = metrics["stats"]["phases"]["decode"]
    assert decode["iterations"] > 0 and decode["layer_calls"] > 0 and np.isfinite(metrics["stats"]["accuracy"])
    fit = metrics["latency_fit"]  # the latency model was refitted on the calls served
    assert fit["fitted"] and fit["calls"] >= decode["layer_calls"] and fit["a"] > 0 and fit["b_s"] >= 0
    # The online model predicts each call before it sees it: the calls served after the refit are predicted by
    # the refitted model (on a busy machine the whole replay above can reach the loop before its first refit).
    for o in _replay(url, _prompts(4), 8, span_s=0.5):
        assert o.status == 200 and o.text == reference_text(model, _prompts(4)[o.index], 8)

    def refitted_predictions() -> bool:  # the reports reach the loop asynchronously
        d = ray.get(loop.metrics.remote())["stats"]["phases"]["decode"]
        return sum(d["sum_model_online_s"]) > 0 and sum(d["sum_model_online_s"]) != sum(d["sum_model_s"])

    _wait(refitted_predictions, "decode calls predicted by the refitted latency model")


def test_metrics_and_healthz_show_the_loop(live):
    from prometheus_client.parser import text_string_to_metric_families

    url, _, _ = live
    health = httpx.get(url + "/healthz", timeout=30).json()
    assert health["status"] == "ok" and health["plan_loop"]["state"] == "running"
    assert health["plan_loop"]["planner"] == "moeless" and health["plan_loop"]["passes"] > 0
    text = httpx.get(url + "/metrics", timeout=30).text
    for name in ("moeless_moe_layer_seconds_bucket{le=\"+Inf\",phase=\"prefill\"}", "moeless_moe_layer_seconds_count{phase=\"decode\"}",
                 "moeless_layer_load_max_over_mean{layer=\"1\"}", "moeless_layer_load_cv{layer=\"0\"}",
                 "moeless_expert_replicas_resident", "moeless_cold_start_hidden_seconds_total",
                 "moeless_cold_start_exposed_seconds_total", "moeless_predictor_online_accuracy", "moeless_plan_seconds_total",
                 "moeless_plan_last_seconds", "moeless_memory_price 0.0", "moeless_latency_model_scale", "moeless_latency_model_call_seconds",
                 "moeless_latency_model_error_ratio{model=\"online\",phase=\"decode\"}",
                 "moeless_expert_gb_seconds_total", "moeless_non_expert_gb_seconds_total",
                 "moeless_plan_loop_heartbeat_age_seconds", "moeless_plan_loop_stalled 0.0"):
        assert name in text, name
    def gauge(name: str) -> float:  # a scrape's ping-pong gauges are one replica's (their help says so)
        scraped = httpx.get(url + "/metrics", timeout=30).text
        return next(s.value for f in text_string_to_metric_families(scraped) for s in f.samples if s.name == name)

    assert _largest(lambda: gauge("moeless_split_forwards"), 10) > 0  # ping-pong on
    assert _largest(lambda: gauge("moeless_micro_batch_wait_seconds"), 10) > 0
    names = [family.name for family in text_string_to_metric_families(text)]
    assert len(names) == len(set(names))  # one family per name: Prometheus refuses duplicates


def test_host_killed_mid_replay_loses_no_request_and_rejoins(live, tiny_store, reference_text):
    url, group, loop = live
    model, _ = tiny_store
    prompts = _prompts(16)
    killer = threading.Timer(0.8, group.kill, args=(2,))
    killer.start()
    outcomes = _replay(url, prompts, 8, span_s=2.0)
    killer.join()
    for o in outcomes:
        assert o.status == 200 and o.error is None, o.error
        assert o.text == reference_text(model, prompts[o.index], 8)
    _wait(lambda: ray.get(loop.state.remote())["hosts_live"] == [True, True, False], "the loop saw host 2 die")
    group.restart(2)
    _wait(lambda: ray.get(loop.state.remote())["hosts_live"] == [True, True, True], "host 2 re-joined")
    client = ExpertHostClient(group.addresses[2])
    _wait(lambda: any(r["state"] in ("idle", "warm") for r in client.status()["replicas"]),
          "the loop loaded host 2's replicas again")
    client.close()
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "back again", "max_tokens": 5}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference_text(model, "back again", 5)


def test_a_stalled_planning_loop_is_reported_within_5_s(live):
    url, _, loop = live
    pid = ray.get(loop.pid.remote())
    os.kill(pid, signal.SIGSTOP)  # the loop's process freezes: no pass, no answer
    try:
        started = time.monotonic()
        while True:
            health = httpx.get(url + "/healthz", timeout=30).json()
            if "planning loop stalled" in health.get("detail", ""):
                break
            assert time.monotonic() - started < 5.0, health
            time.sleep(0.2)
        assert health["status"] == "degraded" and health["plan_loop"]["state"].startswith("degraded: planning loop stalled for")
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert "moeless_plan_loop_stalled 1.0" in metrics
        age = float(next(l for l in metrics.splitlines() if l.startswith("moeless_plan_loop_heartbeat_age_seconds")).split()[1])
        assert age > 1.5
    finally:
        os.kill(pid, signal.SIGCONT)
    _wait(lambda: httpx.get(url + "/healthz", timeout=30).json()["status"] == "ok", "the loop runs again")


def test_an_evicted_replica_still_routed_to_is_reloaded_on_demand(live, tiny_store):
    """Between a host's keep-alive eviction and the loop's next publish, a serving replica may route
    tokens to a replica that is gone: the host loads it on demand (an exposed cold start, counted by
    the host and returned with the call); the outputs are unchanged."""
    _, group, _ = live
    model, _ = tiny_store
    spec = model.spec
    clients = [ExpertHostClient(a, timeout_s=30) for a in group.addresses]
    # Expert 0 of layer 0 on host 2 only (not its home), with half its tokens.
    layer = LayerPlacement(np.array([0, 0, 1, 2, 3]), np.array([0, 2, 0, 1, 2]), np.array([0.5, 0.5, 1, 1, 1]))
    placement = Placement((layer, Placement.static(1, spec.num_experts, 3).layers[0]), spec.num_experts, 3)
    executor = RemoteExecutor(clients, PlacementSource(placement))
    x = torch.randn(12, spec.hidden_size)
    routing = model.route(0, x)
    routing = Routing(idx=torch.zeros_like(routing.idx).index_fill_(1, torch.tensor([1]), 1), weight=routing.weight,
                      logits=routing.logits)  # every token to experts 0 and 1
    executor.run_layer(0, x, routing)  # expert 0 resident on host 2 now
    _wait(lambda: clients[2].evict(0, 0), "evicted (it may still be finishing a call)")
    before = clients[2].status()["meters"]
    out = executor.run_layer(0, x, routing)
    after = clients[2].status()["meters"]
    torch.testing.assert_close(out, model.local_executor().run_layer(0, x, routing), rtol=0, atol=1e-5)
    assert executor.last_call.cold_starts == 1 and after["cold_starts"] == before["cold_starts"] + 1
    assert after["cold_exposed_s"] > before["cold_exposed_s"]
    for c in clients:
        c.close()


def _wait(check, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting: {what}"
        time.sleep(0.1)
