"""The step scaler's admission gate (serving/step_gate.py) on a fake clock and a fake loop, and the
scheduler holding newcomers behind it while the running requests go on (tiny model, in-process
experts: the answers stay the sequential ones)."""

import logging
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from moeless.model.tiny import tiny_model
from moeless.serving.api import GenerationRequest
from moeless.serving.engine import Engine
from moeless.serving.scheduler import BatchLimits, Scheduler
from moeless.controller.planning.step_scaler import step_expert_s
from moeless.placement.profile import CostProfile
from moeless.serving.step_gate import FittedPrice, StepGate


class FakeLoop:
    """widen(hosts) -> a Future answered by `answer(hosts, version, placement)`; the board version the replica runs."""

    def __init__(self):
        self.asked, self.pending, self.seen = [], [], 0

    def widen(self, hosts):
        future = Future()
        self.asked.append(hosts)
        self.pending.append(future)
        return future

    def answer(self, hosts, version, placement=None):
        self.pending.pop(0).set_result((hosts, version, placement))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def gate_for(loop, clock, ready=3, hurried=None, **options):
    # 1 ms of expert work per token: 10 tokens a host within the 10 ms SLO
    return StepGate(lambda tokens: tokens * 1e-3, 10e-3, lambda: ready, loop.widen, lambda: loop.seen,
                    hurry=(hurried.append if hurried is not None else None), clock=clock, **options)


def widened_gate(loop, clock, **options):
    """A gate the loop has widened to 3 hosts at board version 1, which this replica runs; clock at 0."""
    gate = gate_for(loop, clock, **options)
    gate.admit(25, 3)
    loop.answer(3, version=1)
    loop.seen = 1
    return gate


def test_a_step_that_fits_one_host_is_admitted_without_asking_the_loop():
    loop, clock = FakeLoop(), Clock()
    gate = gate_for(loop, clock)
    assert gate.admit(10, 2) and loop.asked == []
    assert gate.figures()["holds"] == 0


def test_newcomers_wait_for_the_widened_placement_then_go_in():
    loop, clock, hurried = FakeLoop(), Clock(), []
    gate = gate_for(loop, clock, hurried=hurried)
    assert not gate.admit(25, 3)  # 25 ms of work: 3 hosts
    assert loop.asked == [3] and hurried == [2.0]  # the board followed closely meanwhile
    clock.now = 0.01
    assert not gate.admit(25, 3)  # not answered yet
    loop.answer(3, version=7)
    clock.now = 0.02
    assert not gate.admit(25, 3)  # answered; this replica does not run version 7 yet
    loop.seen, clock.now = 7, 0.03
    assert gate.admit(25, 3)
    figures = gate.figures()
    assert figures["holds"] == 1 and figures["held_requests"] == 3 and figures["timeouts"] == 0
    assert figures["waits_s"] == [0.03] and figures["granted"] == 3 and len(loop.asked) == 1


def test_admitted_now_newcomers_go_in_while_the_loop_widens_and_nobody_is_held():
    loop, clock, hurried = FakeLoop(), Clock(), []
    gate = gate_for(loop, clock, hurried=hurried, hold_newcomers=False)
    assert gate.admit(25, 3) and loop.asked == [3] and hurried == []  # the widening asked, the newcomers in
    clock.now = 0.01
    assert gate.admit(26, 1) and loop.asked == [3]  # still widening: asked once
    loop.answer(3, version=7)
    assert gate.admit(26, 1) and gate.figures()["granted"] == 3
    assert gate.figures()["holds"] == 0 and gate.figures()["widenings"] == 1


def test_a_need_the_loop_already_holds_is_renewed_without_holding_anyone():
    loop, clock = FakeLoop(), Clock()
    gate = widened_gate(loop, clock, hold_s=2.0)
    assert gate.admit(25, 3)
    clock.now = 0.6  # past hold_s / 4: asked again, so the loop keeps the width
    assert gate.admit(22, 1) and loop.asked == [3, 3]
    loop.answer(3, version=1)
    clock.now = 0.7
    assert gate.admit(22, 1) and gate.figures()["holds"] == 1


def test_after_the_hold_a_need_waits_again_for_the_loop_to_widen():
    loop, clock = FakeLoop(), Clock()
    gate = widened_gate(loop, clock, hold_s=2.0)
    gate.admit(25, 3)
    clock.now = 10.0  # the loop has narrowed to its floor since: the next burst is held again
    assert not gate.admit(25, 3) and loop.asked == [3, 3]
    clock.now = 10.01
    assert not gate.admit(25, 3)  # until the loop answers (what it granted before is no answer)
    loop.answer(3, version=2)
    loop.seen, clock.now = 2, 10.05
    assert gate.admit(25, 3) and gate.figures()["holds"] == 2


def test_an_answer_collected_after_the_hold_is_no_grant():
    loop, clock = FakeLoop(), Clock()
    gate = widened_gate(loop, clock, hold_s=2.0)
    clock.now = 0.6
    assert gate.admit(25, 1) and loop.asked == [3, 3]  # a renewal, answered but not read before the burst ends
    loop.answer(3, version=1)
    clock.now = 10.0  # the loop narrowed long since: that answer grants nothing now
    assert not gate.admit(25, 2) and loop.asked == [3, 3, 3]


def test_a_loop_that_never_answers_costs_at_most_the_max_wait():
    loop, clock = FakeLoop(), Clock()
    gate = gate_for(loop, clock, max_wait_s=0.5)
    assert not gate.admit(25, 2)
    clock.now = 0.49
    assert not gate.admit(25, 2)
    clock.now = 0.5
    assert gate.admit(25, 2)
    assert gate.figures()["timeouts"] == 1 and gate.figures()["wait_max_s"] == 0.5


def test_a_failed_answer_keeps_serving_on_what_was_granted():
    loop, clock = FakeLoop(), Clock()
    gate = gate_for(loop, clock)
    gate.admit(25, 1)
    loop.pending.pop(0).set_exception(RuntimeError("the loop actor died"))
    clock.now = 0.01
    assert gate.admit(25, 1) and loop.asked == [3]  # served on the placement there is, nothing to wait for
    clock.now = 0.6
    assert gate.admit(25, 1) and loop.asked == [3, 3]  # asked again a renewal later, not at every step


def test_the_scheduler_holds_newcomers_while_running_requests_step_and_answers_stay_exact():
    torch.set_num_threads(1)
    model = tiny_model("mixtral", 0)
    loop, clock = FakeLoop(), Clock()
    gate = StepGate(lambda tokens: tokens * 1e-3, 20e-3, lambda: 3, loop.widen, lambda: loop.seen, clock=clock)
    scheduler = Scheduler(Engine(model), BatchLimits(max_running=8), gate=gate)
    texts = {}

    def submit(prompt, n):
        events = []
        scheduler.submit(GenerationRequest("m", n, False, prompt=prompt), events.extend)
        texts[prompt] = (events, n)

    submit("hi", 12)  # 2 tokens: one host
    scheduler.step()
    assert scheduler.counts() == {"running": 1, "waiting": 0}
    for prompt in ("a burst of one", "and another one"):
        submit(prompt, 3)  # 1 + 14 + 15 tokens: 30 ms, 2 hosts
    decoded = scheduler.stats.decode_tokens
    scheduler.step()
    scheduler.step()
    assert loop.asked == [2] and scheduler.counts() == {"running": 1, "waiting": 2}  # held out of the batch
    assert scheduler.stats.decode_tokens == decoded + 2  # the running request went on
    loop.answer(2, version=1)
    loop.seen = 1
    clock.now = 0.05
    for _ in range(20):
        scheduler.step()
    for prompt, (events, n) in texts.items():
        ids = torch.tensor([[ord(c) for c in prompt]])
        expected = "".join(chr(t) for t in model.generate(ids, n)[0, ids.shape[1]:].tolist())
        assert "".join(e.get("text", "") for e in events) == expected and events[-1]["finish"] == "length"
    assert gate.figures()["holds"] == 1 and gate.figures()["waits_s"] == [0.05]


def test_a_fine_tunes_own_step_slo_binds_every_batch_it_is_in():
    loop, clock = FakeLoop(), Clock()
    gate = gate_for(loop, clock, slos={"code": 5e-3, "chat": 20e-3})
    assert gate.slo_for([]) == gate.slo_for(["base"]) == 10e-3 and gate.slo_for(["chat"]) == 20e-3
    assert gate.slo_for(["chat", "code", "chat"]) == 5e-3  # the least of the batch's
    assert gate.admit(15, 1, ["chat"]) and loop.asked == []  # 15 ms within chat's 20
    assert not gate.admit(15, 1, ["chat", "code"]) and loop.asked == [3]  # 15 ms against code's 5: 3 hosts
    assert gate.figures()["slos_s"] == {"code": 5e-3, "chat": 20e-3}
    for bad in ({"code": 0.0}, {"code": -1.0}):
        with pytest.raises(ValueError, match="step SLOs > 0 s"):
            gate_for(loop, clock, slos=bad)


def test_the_scheduler_prices_a_batch_against_the_slo_of_the_models_in_it():
    torch.set_num_threads(1)
    loop, clock = FakeLoop(), Clock()
    gate = StepGate(lambda tokens: tokens * 1e-3, 20e-3, lambda: 3, loop.widen, lambda: loop.seen, clock=clock,
                    slos={"tight": 1e-3})
    scheduler = Scheduler(Engine(tiny_model("mixtral", 0)), BatchLimits(max_running=8), gate=gate)
    scheduler.submit(GenerationRequest("m", 4, False, prompt="hi"), lambda events: None)
    scheduler.step()  # 2 tokens: 2 ms within 20
    assert loop.asked == [] and scheduler.counts() == {"running": 1, "waiting": 0}
    scheduler.submit(GenerationRequest("tight", 4, False, prompt="yo"), lambda events: None)
    scheduler.step()  # 1 running + 2 prompt tokens: 3 ms against the newcomer's 1 ms
    assert loop.asked == [3] and scheduler.counts() == {"running": 1, "waiting": 1}


def test_a_fitted_price_follows_the_loops_refit_off_the_step_thread(caplog):
    profile = CostProfile(alpha=1e-3, beta=0.0, call_overhead=0.5e-3, load_s={"host": 1e-4}, expert_bytes=1000,
                          non_expert_bytes=1000, relevel_s=1e-5, source="test")
    spec = tiny_model("mixtral", 0).spec
    calibrated = step_expert_s(40, profile, spec.num_layers, spec.top_k, spec.num_experts)
    answers = [1.5, RuntimeError("the loop is gone"), RuntimeError("still gone"), 1.25, RuntimeError("gone again")]

    def fetch():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    price = FittedPrice(profile, spec, fetch, start=False)
    assert price(40) == calibrated  # the calibration until the loop's first answer
    price.refresh()
    assert price(40) == 1.5 * calibrated
    with caplog.at_level(logging.WARNING, logger="moeless.serving.step_gate"):
        price.refresh()
        assert price(40) == 1.5 * calibrated  # a failed ask keeps the scale it had
        price.refresh()  # failing still: not warned of again
        price.refresh()  # an answer
        price.refresh()  # failing after an answer: warned of again
    assert [r.getMessage().split(": ")[-1] for r in caplog.records] == ["the loop is gone", "gone again"]
    assert price(40) == 1.25 * calibrated
    assert StepGate(price, 10e-3, lambda: 3, FakeLoop().widen, lambda: 0).figures()["price_scale"] == 1.25
    asked = threading.Event()
    live = FittedPrice(profile, spec, lambda: asked.set() or 2.0, refresh_s=60.0)  # its thread asks at once
    try:
        assert asked.wait(10.0)
        deadline = time.monotonic() + 10.0
        while live.scale != 2.0:
            assert time.monotonic() < deadline, "the thread's answer never reached the price"
            time.sleep(0.01)
        assert live(40) == 2.0 * calibrated
    finally:
        live.close()


def test_a_standby_placement_is_switched_to_at_once_and_nobody_is_held():
    loop, clock, switched = FakeLoop(), Clock(), []
    gate = gate_for(loop, clock, switch=lambda hosts, for_s: switched.append((hosts, for_s)) or True, max_wait_s=2.0)
    assert gate.admit(25, 3)  # 25 ms of work: 3 hosts, on standby
    assert switched == [(3, 2.0)] and loop.asked == [3]  # the loop is still asked: it holds the width
    figures = gate.figures()
    assert figures["holds"] == 0 and figures["switches"] == 1 and figures["granted"] == 3
    loop.answer(3, version=5)  # the loop's publish of the same placement: the replica need not wait for it
    clock.now = 0.1
    assert gate.admit(25, 1) and gate.figures()["holds"] == 0
    assert len(switched) == 1  # granted: no second switch


def test_without_a_standby_placement_the_gate_holds_as_before():
    loop, clock, tried = FakeLoop(), Clock(), []
    gate = gate_for(loop, clock, switch=lambda hosts, for_s: tried.append(hosts) and False)
    assert not gate.admit(25, 3) and tried == [3] and loop.asked == [3]
    loop.answer(3, version=1)
    assert not gate.admit(25, 3)  # the board's version 1 not run yet
    loop.seen = 1
    assert gate.admit(25, 3)
    assert gate.figures()["switches"] == 0 and gate.figures()["holds"] == 1


def test_a_placement_the_loops_answer_carries_is_run_at_once_without_waiting_for_the_board():
    loop, clock, adopted = FakeLoop(), Clock(), []
    gate = gate_for(loop, clock, adopt=lambda placement, for_s: adopted.append((placement, for_s)) or True)
    assert not gate.admit(25, 3)  # nothing on standby: held for the loop's answer
    loop.answer(3, version=7, placement="the widened placement")
    clock.now = 0.05
    assert gate.admit(25, 3)  # the board's version 7 not followed yet: the replica runs the answer's placement
    assert adopted == [("the widened placement", 2.0)]
    assert gate.figures()["holds"] == 1 and gate.figures()["wait_max_s"] == 0.05
