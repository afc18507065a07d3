"""The one fitter of a host's per-call cost (hardware/host_profile.py), which the planning loop's
calibration, `moeless bench live` and `bench serve`'s latency model all use: on made-up calls
whose costs are known, and through a fake host whose compute follows the model exactly."""

from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest

from moeless.hardware.host_profile import CALL_EXPERTS, CALL_TOKENS, fit_costs, fit_host_calls

HOST_S, CALL_S, ALPHA = 2e-5, 3e-6, 1e-7  # compute = host_s + call_overhead x m + alpha x T


class FakeHost:
    """An expert host's client whose compute is the model's, exactly, on its own clock."""

    path = "fake"

    def __init__(self):
        self.loaded, self.calls = [], []

    def load(self, layer, expert, wait=False):
        self.loaded.append((layer, expert))

    def submit(self, call, x):
        assert x.shape[0] == sum(call.counts) and call.tokens.numel() == x.shape[0]
        self.calls.append((call.layer, list(call.experts), list(call.counts)))
        done = Future()
        done.set_result(SimpleNamespace(compute_s=HOST_S + CALL_S * len(call.experts) + ALPHA * x.shape[0]))
        return done


def test_fit_costs_recovers_known_costs_and_clips_noise_at_zero():
    shapes = [(m, m * n) for m in (1, 2, 4) for n in (1, 8, 64)]
    compute = [HOST_S + CALL_S * m + ALPHA * t for m, t in shapes]
    transfer = [5e-5 + 2 * 4e-9 * t for _, t in shapes]
    fit = fit_costs(shapes, compute, transfer)
    assert fit == pytest.approx({"host_s": HOST_S, "call_overhead": CALL_S, "alpha": ALPHA, "c0": 5e-5, "beta": 4e-9},
                                rel=1e-6)
    falling = fit_costs(shapes, compute, [1e-4 - 1e-7 * t for _, t in shapes])  # a transfer that falls: noise
    assert falling["beta"] == 0.0 and falling["c0"] > 0


def test_one_expert_size_fits_alpha_and_the_calls_fixed_cost_together():
    """bench serve's latency model fits single-expert calls: alpha stands, and host_s + call_overhead
    is the one fixed compute cost (split evenly: least squares' smallest solution)."""
    shapes = [(1, t) for t in (1, 8, 32, 128, 512)]
    fit = fit_costs(shapes, [HOST_S + CALL_S + ALPHA * t for _, t in shapes], [1e-5 + 2e-8 * t for _, t in shapes])
    assert fit["alpha"] == pytest.approx(ALPHA, rel=1e-6) and fit["beta"] == pytest.approx(1e-8, rel=1e-6)
    assert fit["host_s"] + fit["call_overhead"] == pytest.approx(HOST_S + CALL_S, rel=1e-6)
    assert fit["c0"] == pytest.approx(1e-5, rel=1e-6)
    np.testing.assert_allclose(np.polyfit([t for _, t in shapes], [HOST_S + CALL_S + ALPHA * t for _, t in shapes], 1)[0],
                               fit["alpha"], rtol=1e-6)  # what bench serve's own fit gave before


def test_fit_host_calls_loads_the_experts_and_times_every_shape():
    host = FakeHost()
    fit = fit_host_calls(host, hidden=8, repeats=3, layer=1)
    assert host.loaded == [(1, e) for e in range(max(CALL_EXPERTS))]
    assert len(host.calls) == 3 * len(CALL_EXPERTS) * len(CALL_TOKENS)
    assert fit["shapes"] == [(m, m * n) for m in CALL_EXPERTS for n in CALL_TOKENS]
    assert (fit["host_s"], fit["call_overhead"], fit["alpha"]) == pytest.approx((HOST_S, CALL_S, ALPHA), rel=1e-6)
    assert fit["c0"] >= 0 and fit["beta"] >= 0 and len(fit["transfer_s"]) == len(fit["shapes"])


def test_bench_serve_reports_the_fitters_single_expert_fit():
    from moeless.bench.serve import FIT_TOKENS, fit_alpha_beta

    host = FakeHost()
    fit = fit_alpha_beta(host, hidden=8, repeats=2)
    assert host.loaded == [(0, 0)] and {tuple(c[1]) for c in host.calls} == {(0,)}
    assert sorted({c[2][0] for c in host.calls}) == sorted(FIT_TOKENS)
    assert fit["alpha_s_per_token"] == pytest.approx(ALPHA, rel=1e-6)
    assert fit["call_overhead_s"] >= 0 and fit["beta_s_per_token"] >= 0 and fit["transport"] == "fake"


@pytest.mark.parametrize("hidden, ffn", [(32, 16), (576, 48)])
def test_split_exact_on_a_real_host_agrees_with_the_same_kernel_in_process(tmp_path, hidden, ffn):
    """A real host's answer for the tiny test models' experts (split-exact here) and the default
    model's (48 neurons: most row counts round differently here), against the same check made in
    this process with the canonical expert on one thread, as the host computes."""
    import torch

    from moeless.expert_fn.client.client import ExpertHostClient
    from moeless.expert_fn.launcher import launch_local_hosts
    from moeless.hardware.host_profile import SPLIT_PROBE_ROWS, split_exact
    from moeless.model.experts import expert_forward
    from moeless.model.weight_store import export_experts

    g = torch.Generator().manual_seed(1)
    weights = {"gate": torch.randn(ffn, hidden, generator=g) * 0.05, "up": torch.randn(ffn, hidden, generator=g) * 0.05,
               "down": torch.randn(hidden, ffn, generator=g) * 0.05}
    export_experts([(0, 0, weights)], tmp_path, model="probe", num_layers=1, num_experts=1, act="silu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = True
        for rows, first in SPLIT_PROBE_ROWS:
            x = torch.randn(rows, hidden, generator=g)
            whole = expert_forward(weights, x)
            local &= torch.equal(expert_forward(weights, x[:first]), whole[:first])
            local &= torch.equal(expert_forward(weights, x[first:]), whole[first:])
    finally:
        torch.set_num_threads(threads)
    with launch_local_hosts(1, tmp_path, metrics=False, threads=1) as hosts, \
            ExpertHostClient(hosts.addresses[0]) as client:
        assert split_exact(client, hidden) == local  # here: True at 16 neurons, False at 48 (BLAS's choice per CPU)
