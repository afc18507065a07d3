"""Ping-pong (serving/pingpong.py): how rows split, one micro-batch computing at a time, the other
running while one waits; and on real expert hosts, generations with micro-batches equal to the
unmodified model's, over the TCP channel and shared memory, with and without the live loop."""

import threading
import time

import numpy as np
import pytest
import torch

from moeless.expert_fn.client.client import ExpertHostClient
from moeless.serving.api import GenerationRequest
from moeless.serving.engine import Engine
from moeless.serving.executor import RemoteExecutor
from moeless.predictor.gate_replica import all_pairs, gate_reuse
from moeless.predictor.history import HistoryPredictor
from moeless.predictor.runtime import PredictionRuntime
from moeless.serving.live_engine import LiveEngine
from moeless.serving.live_executor import LiveExecutor
from moeless.serving.pingpong import micro_batch, run_micro_batches, split_by_weight, split_rows, waiting
from moeless.serving.placement_source import PlacementSource
from moeless.serving.scheduler import BatchLimits, Scheduler


def test_rows_split_into_near_equal_consecutive_ranges():
    assert split_rows(5) == [range(0, 2), range(2, 5)]
    assert split_rows(4, 3) == [range(0, 1), range(1, 2), range(2, 4)]
    assert split_rows(1) == [range(0, 1)] and split_rows(3, 1) == [range(0, 3)]


def test_prompts_split_where_the_tokens_are_half_done():
    assert split_by_weight([10, 10, 10, 10]) == [range(0, 2), range(2, 4)]
    assert split_by_weight([100, 1, 1]) == [range(0, 1), range(1, 3)]
    assert split_by_weight([1, 1, 100]) == [range(0, 2), range(2, 3)]  # never an empty part
    assert split_by_weight([7]) == [range(0, 1)]
    assert split_by_weight([3, 3, 3, 3, 3, 3], 3) == [range(0, 2), range(2, 4), range(4, 6)]


def test_one_micro_batch_computes_at_a_time_and_a_waiting_one_lets_the_other_run():
    computing, most, order = [0], [0], []
    other_ran = threading.Event()

    def compute(name):
        computing[0] += 1
        most[0] = max(most[0], computing[0])
        order.append(name)
        time.sleep(0.01)  # drops the GIL: without the baton the other would compute now
        computing[0] -= 1

    def first():
        compute("a1")
        with waiting() as handed_over:  # its expert calls are out: the other micro-batch runs meanwhile
            assert handed_over
            assert other_ran.wait(10), "the other micro-batch never ran while this one waited"
        compute("a2")
        return "a"

    def second():
        compute("b1")
        other_ran.set()
        return "b"

    started = time.perf_counter()
    assert run_micro_batches([first, second]) == ["a", "b"]
    assert most[0] == 1  # never two computing at once
    assert time.perf_counter() - started < 5
    assert set(order) == {"a1", "a2", "b1"}
    with waiting() as handed_over:  # outside micro-batches: nothing to hand over
        assert not handed_over


def test_a_micro_batch_failure_reaches_the_caller_after_both_ended():
    done = []

    def fails():
        raise ValueError("host said no")

    def goes_on():
        time.sleep(0.01)
        done.append(True)
        return 1

    with pytest.raises(ValueError, match="host said no"):
        run_micro_batches([fails, goes_on])
    assert done == [True]
    assert run_micro_batches([lambda: 7]) == [7]  # one: in this thread


def test_each_thread_knows_its_micro_batch():
    assert micro_batch() == 0  # outside micro-batches
    assert run_micro_batches([micro_batch, micro_batch, micro_batch]) == [0, 1, 2]
    assert micro_batch() == 0


def test_micro_batches_keep_no_grad_and_torch_threads():
    torch.set_num_threads(1)
    with torch.no_grad():
        seen = run_micro_batches([lambda: (torch.is_grad_enabled(), torch.get_num_threads())] * 2)
    assert seen == [(False, 1), (False, 1)]


def test_forwards_in_two_threads_equal_forwards_one_after_another(tiny_store):
    model, _ = tiny_store
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, 120, (2, 9), generator=g) for _ in range(2)]
    serial = [model.forward(i).logits for i in ids]
    blocks = [layer.mlp for layer in model.hf.model.layers]
    together = run_micro_batches([lambda i=i: model.forward(i).logits for i in ids])
    for a, b in zip(serial, together):
        assert torch.equal(a, b)
    assert [layer.mlp for layer in model.hf.model.layers] == blocks  # between forwards: the model as loaded


def test_engine_refuses_a_split_rule_below_one(tiny_store):
    model, _ = tiny_store
    with pytest.raises(ValueError, match="micro_batches"):
        Engine(model, micro_batches=0)
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        Engine(model, micro_batches=2, micro_batch_tokens=0)


def _reference(model, prompt, n):
    ids = torch.tensor([[ord(c) for c in prompt]])
    return "".join(chr(t) for t in model.generate(ids, n)[0, ids.shape[1]:].tolist())


PROMPTS = [("the cat sat", 9), ("a", 6), ("hello there world", 11), ("xyz", 4), ("moe", 8)]


def _serve(engine, prompts=PROMPTS) -> list[str]:
    """Continuous batching of `prompts` through `engine` to the end: each one's text (no errors)."""
    scheduler = Scheduler(engine, BatchLimits(max_running=4, max_tokens_per_iteration=256, max_waiting=16))
    sinks = []
    for prompt, n in prompts:
        events = []
        scheduler.submit(GenerationRequest("m", n, False, prompt=prompt), events.extend)
        sinks.append(events)
    for _ in range(200):
        if all(any("finish" in e or "error" in e for e in s) for s in sinks):
            break
        scheduler.step()
    assert not [e for s in sinks for e in s if "error" in e]
    return ["".join(e.get("text", "") for e in s) for s in sinks]


@pytest.mark.parametrize("transport", ["tcp", "nixl", "local"])
def test_continuous_batching_with_micro_batches_on_real_hosts_equals_the_model(tiny_store, hosts, transport):
    # Every forward splits (one token per micro-batch is enough): prefills in two packed groups,
    # decode steps in two ranges of rows, both micro-batches' calls on the same hosts' channels.
    model, _ = tiny_store
    clients = [ExpertHostClient(a, timeout_s=30, transport=transport) for a in hosts.addresses]
    try:
        executor = _LayerOrder(RemoteExecutor(clients, PlacementSource.static(model.spec.num_layers,
                                                                             model.spec.num_experts, 3)))
        texts = _serve(Engine(model, executor, micro_batches=2, micro_batch_tokens=1))
        assert texts == [_reference(model, p, n) for p, n in PROMPTS]
        # The micro-batches took turns layer by layer: each layer's two calls back to back (0, 0, 1, 1),
        # not one forward after the other (0, 1, 0, 1).
        assert executor.layers[:4] == [0, 0, 1, 1]
        assert executor.inner.times.baton_s > 0
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_the_live_loop_with_micro_batches_forecasts_and_reports_each_one(tiny_store, hosts, transport):
    # The serving path (LiveEngine, LiveExecutor with a predictor) with every forward split: texts
    # equal the model's, and each micro-batch is an iteration of its own, its forecasts made from
    # its own hidden states and its loads its own (micro-batches of unequal sizes would show a mix).
    model, _ = tiny_store
    spec = model.spec
    reports = {1: [], 2: []}
    clients = [ExpertHostClient(a, timeout_s=30, transport=transport) for a in hosts.addresses]
    try:
        for parts in (1, 2):
            runtime = PredictionRuntime(gate_reuse(model, all_pairs(spec.num_layers, [1])),
                                        HistoryPredictor(spec.num_layers, spec.num_experts, spec.top_k))
            remote = RemoteExecutor(clients, PlacementSource.static(spec.num_layers, spec.num_experts, 3))
            live = LiveExecutor(remote, spec.num_layers, spec.num_experts, replica="r", sink=reports[parts].append,
                                runtime=runtime, distance=1)
            engine = LiveEngine(model, live, micro_batches=parts, micro_batch_tokens=1)
            assert _serve(engine) == [_reference(model, p, n) for p, n in PROMPTS]
            assert live.iterations == len(reports[parts])
            splits = engine.split_forwards
            assert (remote.times.baton_s > 0) == (parts == 2)  # answers waited for the other micro-batch: split only
            runtime.close()
    finally:
        for c in clients:
            c.close()
    split, whole = reports[2], reports[1]
    assert len(split) == len(whole) + splits and splits > 0  # a forward of 2+ rows: two reports
    assert sum(r.tokens for r in split) == sum(r.tokens for r in whole)  # the same tokens, counted once
    assert {r.phase for r in split} == {"prefill", "decode"}
    assert len({r.tokens for r in split}) > 1  # micro-batches of different sizes
    for r in split:
        routed = r.tokens * spec.top_k
        assert (r.actual.sum(axis=1) == routed).all(), "a micro-batch's loads mixed with the other's"
        # Layer 0 from the history window (scaled to its tokens), layer 1 from its own gate input.
        np.testing.assert_allclose(r.forecast.sum(axis=1), routed)
        assert (r.layers.host_calls > 0).all() and (r.layers.wall_s > 0).all()


class _LayerOrder:
    """An executor that records the layer of each call as it begins, then runs it on `inner`."""

    def __init__(self, inner):
        self.inner, self.layers = inner, []

    def run_layer(self, layer, x, routing):
        self.layers.append(layer)
        return self.inner.run_layer(layer, x, routing)
