"""Continuous batching on the tiny models, in-process experts: outputs equal sequential greedy
decoding whatever joins and leaves; caps, queue bound, cancel, drain and abort."""

import queue
import threading
import time

import pytest
import torch

from moeless.model.tiny import tiny_model
from moeless.serving.api import ApiError, GenerationRequest
from moeless.serving.engine import Engine
from moeless.serving.kv_slots import KVSlots
from moeless.serving.scheduler import BatchLimits, Scheduler, admit


def test_admit_first_come_first_served_within_rows_and_token_budget():
    limits = BatchLimits(max_running=4, max_tokens_per_iteration=20, max_waiting=8)
    assert admit([5, 5, 5, 5, 5], running=0, limits=limits) == 4  # rows
    assert admit([8, 8, 8], running=0, limits=limits) == 2  # tokens: 16 <= 20 < 24
    assert admit([8, 8], running=3, limits=limits) == 1  # one row left
    assert admit([3, 30, 1], running=0, limits=limits) == 1  # FCFS: the 30 blocks the 1 behind it
    assert admit([30, 1], running=2, limits=limits) == 1  # a prompt over the budget goes alone, not starved
    assert admit([5], running=4, limits=limits) == 0 and admit([], running=0, limits=limits) == 0
    with pytest.raises(ValueError, match="max_running"):
        BatchLimits(max_running=0)


ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "deepseek_v2", "deepseek_v3")


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_model("qwen2_moe", 0)  # shared experts and a dense layer among the MoE ones


def _reference(model, prompt, n):
    ids = torch.tensor([[ord(c) for c in prompt]])
    return "".join(chr(t) for t in model.generate(ids, n)[0, ids.shape[1]:].tolist())


class _Client:
    """A request's sink: collects its events."""

    def __init__(self):
        self.events = []

    def __call__(self, events):
        self.events += events

    @property
    def text(self):
        return "".join(e.get("text", "") for e in self.events)

    @property
    def done(self):
        return any("finish" in e or "error" in e for e in self.events)


def _run(scheduler, arrivals, max_steps=500):
    """Step the scheduler; arrivals: step -> [(prompt, max_tokens)]; returns clients in arrival order
    and the running counts seen."""
    clients, seen = [], []
    for step in range(max_steps):
        for prompt, n in arrivals.get(step, []):
            client = _Client()
            scheduler.submit(GenerationRequest("m", n, False, prompt=prompt), client)
            clients.append(client)
        if step > max(arrivals) and all(c.done for c in clients):
            return clients, seen
        scheduler.step()
        seen.append(len(scheduler.slots))
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_outputs_under_continuous_batching_equal_sequential_ones(arch):
    # small KV storage and few rows: rows join, leave, move, and the columns are re-laid out
    torch.set_num_threads(1)
    model = tiny_model(arch, 0)  # every architecture (DeepSeek's MLA keys and values differ in width)
    scheduler = Scheduler(Engine(model), BatchLimits(max_running=3, max_tokens_per_iteration=24, max_waiting=20))
    scheduler.slots = KVSlots(scheduler.slots.num_layers, 3, min_capacity=8)
    arrivals = {0: [("hello", 9), ("The cat sat on the mat", 4)], 1: [("a", 14)],
                3: [("xyz " * 5, 3), ("Once upon", 11)], 9: [("Q", 1)], 10: [("late one", 6), ("b" * 30, 5)]}
    started = time.perf_counter()
    clients, seen = _run(scheduler, arrivals)
    assert 0 < scheduler.stats.busy_s <= time.perf_counter() - started  # wall time of the steps only
    requests = [r for step in sorted(arrivals) for r in arrivals[step]]
    for (prompt, n), client in zip(requests, clients):
        assert client.events[-1]["finish"] == "length" and client.events[-1]["completion_tokens"] == n
        assert client.text == _reference(model, prompt, n), prompt
    assert max(seen) == 3 and scheduler.slots.capacity > 8  # rows were capped; storage grew
    assert len(scheduler.slots) == 0 and scheduler.counts() == {"running": 0, "waiting": 0}


def test_a_newcomer_joins_at_the_next_iteration_and_a_short_request_leaves_early(model):
    scheduler = Scheduler(Engine(model), BatchLimits(max_running=4))
    long, short = _Client(), _Client()
    scheduler.submit(GenerationRequest("m", 30, False, prompt="long request"), long)
    for _ in range(5):
        scheduler.step()
    scheduler.submit(GenerationRequest("m", 3, False, prompt="short"), short)
    scheduler.step()  # the short request is prefilled while the long one decodes
    assert short.events and short.events[0] == {"batch": 2}
    scheduler.step()
    scheduler.step()
    assert short.done and not long.done  # it did not wait for the long one
    assert len(scheduler.slots) == 1


def test_queue_bound_gives_429_and_drain_and_abort_say_503(model):
    scheduler = Scheduler(Engine(model), BatchLimits(max_running=1, max_waiting=1))
    first, second = _Client(), _Client()
    scheduler.submit(GenerationRequest("m", 50, False, prompt="first"), first)
    scheduler.step()  # first runs
    scheduler.submit(GenerationRequest("m", 5, False, prompt="second"), second)  # waits
    with pytest.raises(ApiError) as busy:
        scheduler.submit(GenerationRequest("m", 5, False, prompt="third"), _Client())
    assert busy.value.status == 429 and busy.value.code == "server_busy"
    scheduler.drain()
    assert second.events[-1]["error"]["status"] == 503 and "shutting down" in second.events[-1]["error"]["message"]
    with pytest.raises(ApiError) as closed:
        scheduler.submit(GenerationRequest("m", 5, False, prompt="fourth"), _Client())
    assert closed.value.status == 503
    scheduler.step()
    assert not first.done  # running requests go on while draining
    scheduler.abort("deadline passed")
    scheduler.step()
    assert first.events[-1]["error"] == {"status": 503, "message": "deadline passed", "code": "shutting_down",
                                         "param": None}
    assert len(scheduler.slots) == 0


def test_cancel_frees_the_row_and_a_bad_prompt_is_refused_at_submit(model):
    scheduler = Scheduler(Engine(model), BatchLimits(max_running=2))
    client = _Client()
    rid = scheduler.submit(GenerationRequest("m", 40, False, prompt="cancel me"), client)
    scheduler.step()
    scheduler.cancel(rid)
    scheduler.step()
    assert len(scheduler.slots) == 0 and not client.done
    with pytest.raises(ApiError, match="context limit"):
        scheduler.submit(GenerationRequest("m", 10, False, prompt="x" * 250), _Client())


def test_loop_thread_serves_concurrent_submitters(model):
    from moeless.serving.scheduler import SchedulerLoop

    scheduler = Scheduler(Engine(model), BatchLimits(max_running=4))
    loop = SchedulerLoop(scheduler)
    prompts = [(f"thread {i}", 3 + i % 4) for i in range(8)]
    inboxes = [queue.Queue() for _ in prompts]

    def send(i):
        scheduler.submit(GenerationRequest("m", prompts[i][1], False, prompt=prompts[i][0]), inboxes[i].put)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (prompt, n), inbox in zip(prompts, inboxes):
        events = []
        while not any("finish" in e for e in events):
            events += inbox.get(timeout=30)
        assert "".join(e.get("text", "") for e in events) == _reference(model, prompt, n)
    loop.stop()


def test_a_failing_step_fails_its_requests_instead_of_hanging_them(model):
    from moeless.serving.scheduler import SchedulerLoop

    scheduler = Scheduler(Engine(model), BatchLimits(max_running=2))
    client = _Client()
    scheduler.submit(GenerationRequest("m", 30, False, prompt="doomed"), client)
    scheduler.step()
    def bug():
        raise RuntimeError("a bug outside any forward")

    scheduler._drop_cancelled = bug  # the next step raises before any forward
    loop = SchedulerLoop(scheduler)
    deadline = time.monotonic() + 10
    while not client.done:
        assert time.monotonic() < deadline, "the request hung"
        time.sleep(0.01)
    loop.stop()
    assert client.events[-1]["error"]["status"] == 500 and "a bug outside any forward" in client.events[-1]["error"]["message"]
    assert len(scheduler.slots) == 0


def test_an_engine_leaves_the_models_fingerprint_as_it_was():
    # the predictor file is found by model_hash; the LM head's position cut must not change it
    from moeless.predictor.fingerprint import model_hash

    model = tiny_model("mixtral", 0)
    before = model_hash(model)
    Engine(model)
    Engine(model)  # installed once
    assert model_hash(model) == before and len(model.hf.lm_head._forward_pre_hooks) == 1
