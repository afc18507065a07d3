"""The chunked-prefill scheduler: a golden example by hand, loads from routing, load scaling, decode
formed from a prompt-only log."""

from __future__ import annotations

import numpy as np
import pytest

from moeless.twin.chunked import Step, scale_to_load, schedule, split_counts, step_loads
from moeless.traces.routing_file import Routing


def test_golden_schedule():
    # Budget 6 tokens, 2 slots, 0.1 s per iteration. Request 0: prompt 5, output 2 (one decode);
    # request 1: prompt 3, output 1 (none); request 2 arrives at 0.25: prompt 2, output 3 (two decodes).
    steps = schedule(np.array([0.0, 0.0, 0.25]), np.array([5, 3, 2]), np.array([2, 1, 3]), 6, 2, 0.1)
    assert [(s.phase, s.chunks) for s in steps] == [
        ("prefill", ((0, 0, 5), (1, 0, 1))),  # admission: r0's whole prompt, r1's first token
        ("prefill", ((0, 5, 1), (1, 1, 2))),  # r0 decodes first, then r1's last chunk
        ("prefill", ((2, 0, 2),)),  # idle until r2 arrives
        ("decode", ((2, 2, 1),)),
        ("decode", ((2, 3, 1),)),
    ]
    assert [s.time_s for s in steps] == pytest.approx([0.0, 0.1, 0.25, 0.35, 0.45])
    # max_seqs bounds the running requests; token_s stretches the clock.
    one = schedule(np.zeros(2), np.array([2, 2]), np.array([2, 1]), 8, 1, 0.1, token_s=0.05)
    assert [s.chunks for s in one] == [((0, 0, 2),), ((0, 2, 1),), ((1, 0, 2),)]
    assert [s.time_s for s in one] == pytest.approx([0.0, 0.2, 0.35])


def test_loads_from_routing_and_scaling():
    # One routed request: prompt tokens to experts 0, 1, 2, then decode tokens to 3, 3 (L = 1, k = 1, E = 4).
    counts = split_counts(Routing(np.array([0, 1, 2, 3, 3]).reshape(5, 1, 1), np.array([5]), np.array([3]), 4, "test"))
    # Workload requests of prompt 4 and 2 tokens both replay it: prompt tokens cycle over 0, 1, 2; decodes over 3, 3.
    steps = [Step(0.0, "prefill", ((0, 0, 4), (1, 1, 1))), Step(0.1, "decode", ((0, 4, 1), (1, 2, 1)))]
    its = step_loads(steps, np.array([4, 2]), counts)
    assert its[0].load.tolist() == [[2, 2, 1, 0]] and its[0].batch == 2
    assert its[1].load.tolist() == [[0, 0, 0, 2]] and its[1].phase == "decode"
    # 11 arrivals over 10 s at 100 tokens each: 110 tokens/s offered; capacity 1000 / 0.1 = 10,000 tokens/s.
    scaled = scale_to_load(np.linspace(0, 10, 11), np.full(11, 60), np.full(11, 40), 0.5, 1000, 0.1)
    assert scaled[-1] == pytest.approx(10 * 100 / 5000) and scaled[0] == 0


def test_decode_from_a_prompt_only_log_replays_the_prompts_routing():
    # docs/deployments.md, "Routing logs": a log without decode tokens (FLAME's) makes a request's decode
    # step s replay its routing request's token s mod T, from the start of the prompt's routing.
    topk = np.array([0, 1, 2, 3, 0, 1]).reshape(6, 1, 1)  # routing requests of 4 and 2 tokens, all prompt
    counts = split_counts(Routing(topk, np.array([4, 2]), np.array([4, 2]), 4, "test"))
    prompts = np.array([3, 3, 5])  # workload request 2 replays routing request 0 again (2 mod 2)
    steps = [Step(0.0, "decode", ((0, 3 + s, 1),)) for s in range(5)] + [Step(0.0, "decode", ((1, 3, 1), (2, 5, 1)))]
    loads = [it.load[0].tolist() for it in step_loads(steps, prompts, counts)]
    assert loads[:5] == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1], [1, 0, 0, 0]]  # tokens 0, 1, 2, 3, 0
    # Step 0 of request 1 replays routing request 1's token 0 (expert 0), step 0 of request 2 routing request 0's
    # token 0 (expert 0): requests that share a routing request and a step route alike in one batch.
    assert loads[5] == [2, 0, 0, 0]
