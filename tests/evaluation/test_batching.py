"""Batching of requests into iterations (the paper's per-second batches, continuous batching), the
workload spec, output lengths from the trace, and the history-window forecast."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from moeless.twin.iterations import Iteration
from moeless.twin import arrivals as arr
from moeless.twin.batching import compose, per_second
from moeless.twin.forecasts import history_forecasts
from moeless.evaluation.workload import WorkloadError, _per_arrival, parse_workload

L, E = 2, 4


@dataclass(frozen=True)
class Req:
    prefill: np.ndarray
    decode: np.ndarray
    prompt_tokens: int = 1


def request(i: int, steps: int) -> Req:
    """Distinct loads per request (prefill of request i: i + 1 tokens on expert i % E)."""
    prefill = np.zeros((L, E), np.int64)
    prefill[:, i % E] = i + 1
    decode = np.zeros((steps, L, E), np.int64)
    decode[:, :, (i + 1) % E] = 1
    return Req(prefill, decode)


def test_requests_of_one_second_form_one_batch_that_decodes_to_its_last_request():
    reqs = [request(0, 3), request(1, 1), request(2, 2)]
    its = per_second(reqs, np.array([0.1, 0.9, 1.2]), step_s=0.05, max_batch=8, max_iterations=100)
    assert [(it.phase, it.batch) for it in its] == [("prefill", 2), ("decode", 2), ("decode", 1), ("decode", 1),
                                                   ("prefill", 1), ("decode", 1), ("decode", 1)]
    # Batch 0 starts when its second closes (t = 1.1: one second after the first arrival); batch 1
    # waits for batch 0 to finish (4 iterations later), not only for its own second (2.1).
    assert its[0].time_s == pytest.approx(1.1) and its[4].time_s == pytest.approx(2.1)
    assert its[1].rows == ((0, 0), (1, 0)) and its[2].rows == ((0, 1),)
    assert its[0].load.tolist() == (reqs[0].prefill + reqs[1].prefill).tolist()


def test_a_full_second_splits_into_batches_of_max_batch():
    reqs = [request(i, 0) for i in range(5)]
    its = per_second(reqs, np.zeros(5), step_s=0.05, max_batch=2, max_iterations=100)
    assert [it.batch for it in its] == [2, 2, 1] and all(it.phase == "prefill" for it in its)


@pytest.mark.parametrize("mode", ["continuous", "per-second"])
def test_every_prefill_and_decode_row_is_served_exactly_once(mode):
    rng = np.random.default_rng(0)
    reqs = [request(i, int(rng.integers(0, 6))) for i in range(30)]
    times = np.sort(rng.uniform(0, 4, 30))
    its = compose(mode, reqs, times, 0.05, 4, 10_000)
    rows = sorted(r for it in its for r in it.rows)
    assert rows == sorted([(i, -1) for i in range(30)] + [(i, s) for i in range(30) for s in range(len(reqs[i].decode))])
    total = sum(it.load for it in its)
    assert total.tolist() == sum(r.prefill + r.decode.sum(0) for r in reqs).tolist()
    assert all(b.time_s >= a.time_s for a, b in zip(its, its[1:]))
    assert max(it.batch for it in its) <= 4


def test_workload_specs():
    assert parse_workload("azure-code:humaneval") == parse_workload("azure-code=azure-code:humaneval")
    spec = parse_workload("chat=/data/my.trace.csv")
    assert (spec.name, spec.trace, spec.prompts) == ("chat", "/data/my.trace.csv", "sharegpt")
    assert parse_workload("generated").trace is None
    with pytest.raises(WorkloadError, match="unknown prompts 'poems'"):
        parse_workload("x=generated:poems")


def test_a_request_decodes_the_traces_output_length_capped_at_what_was_traced():
    loads = [request(0, 5), request(1, 5)]
    trace = arr.Arrivals(np.array([0.0, 1.0, 2.0]), np.array([3, 100, 0]), "a test")
    per, _ = _per_arrival(loads, None, trace)
    assert [len(r.decode) for r in per] == [2, 5, 0]  # G tokens: the prefill makes the first, G - 1 decode steps
    assert per[2].prefill is loads[0].prefill  # arrival i replays prompt i mod P


def test_the_history_window_forecasts_the_mean_share_of_past_iterations_times_todays_tokens():
    a = np.array([[4, 0, 0, 0], [0, 4, 0, 0]])  # two layers, k = 1 here
    b = np.array([[0, 4, 0, 0], [0, 0, 0, 4]])
    its = [Iteration("decode", w, 1) for w in (a, b, 2 * a)]
    got = history_forecasts(its, top_k=1, window=16)
    assert got[0].tolist() == [[1, 1, 1, 1]] * 2  # nothing seen yet: uniform
    assert got[1].tolist() == a.tolist()
    assert got[2].tolist() == [[4, 4, 0, 0], [0, 4, 0, 4]]  # mean of a's and b's shares x 8 tokens
