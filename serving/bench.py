"""`moeless bench serve`: the cost of going serverless, measured in one run.

1. The same model generates the same real prompts (ShareGPT, held-out split) twice with the same
   engine: experts in-process (the baseline, LocalExecutor) and through expert functions on
   local expert-host processes (RemoteExecutor). Outputs must be identical.
2. Reported: generation tokens/s of both and their ratio; MoE time per layer call of both (mean
   and median; all calls, prefill and decode apart) and the ratio of medians; the serverless
   layer's mean time (all calls) broken into gate, scatter, invoke (of which the slowest host's
   expert compute; the rest is transfer and RPC) and gather.
3. The latency model's constants, fitted on single-expert invokes of T tokens:
   host compute = alpha * T (alpha: seconds per token of expert compute), and
   round trip - compute = overhead + 2 * beta * T (beta: seconds per token moved, each way).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch

from moeless.model.interface import ExpertExecutor, Routing

FIT_TOKENS = (1, 8, 32, 128, 512)


class TimedExecutor:
    """Wraps an executor and records (tokens, seconds) of each run_layer call."""

    def __init__(self, inner: ExpertExecutor):
        self.inner, self.samples = inner, []

    def run_layer(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        start = time.perf_counter()
        out = self.inner.run_layer(layer, x, routing)
        self.samples.append((x.shape[0], time.perf_counter() - start))
        return out

    def summary_ms(self, batch: int) -> dict[str, dict[str, float]]:
        """Mean and median ms per layer call, for all calls, prefill and decode apart (the median
        resists a busy machine's stalls). A decode step carries one row per sequence (<= batch)."""
        phases = {"all": [s for _, s in self.samples], "prefill": [s for t, s in self.samples if t > batch],
                  "decode": [s for t, s in self.samples if t <= batch]}
        return {name: {"mean": 1e3 * float(np.mean(v)), "median": 1e3 * float(np.median(v)), "calls": len(v)}
                for name, v in phases.items() if v}


def bench_prompts(engine, count: int, prompt_tokens: int) -> list[list[int]]:
    """Token ids of `count` held-out ShareGPT prompts, each cut to prompt_tokens tokens."""
    from moeless.model.datasets import sharegpt_prompts
    from moeless.serving.codec import CharCodec

    prompts = sharegpt_prompts(count, "test")
    if isinstance(engine.codec, CharCodec):  # test models read only their small alphabet
        prompts = ["".join(c for c in p if ord(c) < engine.codec.vocab_size) or "?" for p in prompts]
    return [engine.codec.encode(p)[:prompt_tokens] for p in prompts]


def generate_all(engine, prompts: list[list[int]], max_tokens: int, batch: int) -> tuple[list[list[int]], float]:
    """Greedy generations of every prompt in batches; returns (tokens per prompt, seconds)."""
    from tqdm import tqdm

    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in tqdm(range(0, len(prompts), batch), desc="batches", leave=False):
        chunk = prompts[i:i + batch]
        rows: list[list[int]] = [[] for _ in chunk]
        for step in engine.token_steps(chunk, [max_tokens] * len(chunk)):
            for r, token in enumerate(step):
                if token is not None:
                    rows[r].append(token)
        outputs.extend(rows)
    return outputs, time.perf_counter() - start


def fit_alpha_beta(client, hidden: int, repeats: int = 7) -> dict[str, float]:
    """Fit alpha, beta and the per-call overhead from invokes of expert (0, 0) on T tokens
    (least squares over the median of `repeats` calls per T)."""
    compute, transfer = [], []
    client.load(0, 0, wait=True)
    for tokens in FIT_TOKENS:
        x = torch.randn(tokens, hidden)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            result = client.invoke_detailed(0, {0: x})
            samples.append((result.compute_s, time.perf_counter() - start - result.compute_s))
        median = np.median(np.array(samples), axis=0)  # robust to a busy machine's outliers
        compute.append(median[0])
        transfer.append(median[1])
    alpha, _ = np.polyfit(FIT_TOKENS, compute, 1)
    slope, overhead = np.polyfit(FIT_TOKENS, transfer, 1)
    return {"alpha_s_per_token": float(alpha), "beta_s_per_token": float(slope / 2),
            "call_overhead_s": float(overhead), "fit_tokens": list(FIT_TOKENS), "repeats": repeats}


def run_bench(model: str = "default", *, hosts: int = 2, prompts: int = 8, prompt_tokens: int = 64,
              max_tokens: int = 16, batch: int = 4, threads: int = 1) -> dict[str, Any]:
    """Measure both paths on the same prompts (see the module docstring); returns the figures."""
    from moeless.expert_fn.client import ExpertHostClient
    from moeless.expert_fn.launcher import launch_local_hosts
    from moeless.serving.embedded import choose_model, export_store
    from moeless.serving.engine import Engine
    from moeless.serving.executor import RemoteExecutor
    from moeless.serving.placement_source import PlacementSource

    torch.set_num_threads(threads)
    choice = choose_model(model)
    moe = choice.loader()
    spec = moe.spec
    store = export_store(moe, choice.name)
    local = TimedExecutor(moe.local_executor())
    ids = bench_prompts(Engine(moe), prompts, prompt_tokens)
    with launch_local_hosts(hosts, store, keep_alive_s=600, threads=threads, metrics=False) as group:
        clients = [ExpertHostClient(a, timeout_s=120) for a in group.addresses]
        remote = RemoteExecutor(clients, PlacementSource.static(spec.num_layers, spec.num_experts, hosts))
        timed_remote = TimedExecutor(remote)
        # 1. Warm both paths (replica loads, allocator), then measure.
        for executor in (local, timed_remote):
            generate_all(Engine(moe, executor), ids[:batch], 2, batch)
        local.samples, timed_remote.samples = [], []
        remote.times = type(remote.times)()
        ref, local_s = generate_all(Engine(moe, local), ids, max_tokens, batch)
        with moe.capture() as capture:
            got, remote_s = generate_all(Engine(moe, timed_remote), ids, max_tokens, batch)
        fit = fit_alpha_beta(clients[0], spec.hidden_size)
        remote.close()
        for c in clients:
            c.close()
    # 2. The gate's own time, on the gate inputs the remote run routed.
    gate_s = _gate_seconds(moe, capture)
    generated = sum(len(r) for r in ref)
    t = remote.times

    def per_call(seconds: float) -> float:  # ms per MoE-layer call
        return 1e3 * seconds / max(t.layers, 1)

    return {
        "model": choice.name, "hosts": hosts, "prompts": len(ids), "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens, "batch": batch, "threads": threads,
        "load_average_1m": os.getloadavg()[0],  # a busy machine inflates every time below
        "identical_outputs": ref == got,
        "tokens_per_s": {"in_process": generated / local_s, "expert_functions": generated / remote_s,
                         "ratio": (generated / remote_s) / (generated / local_s)},
        "moe_layer_ms": _compare(local.summary_ms(batch), timed_remote.summary_ms(batch)),
        "breakdown_ms_per_layer": {"gate": 1e3 * gate_s / max(t.layers, 1), "scatter": per_call(t.scatter_s),
                                   "invoke": per_call(t.invoke_s), "expert_compute": per_call(t.compute_s),
                                   "transfer_and_rpc": per_call(t.invoke_s - t.compute_s),
                                   "gather": per_call(t.gather_s)},
        "tokens_moved_per_layer": t.tokens_moved / max(t.layers, 1),
        "latency_model": fit,
    }


def _compare(local: dict, remote: dict) -> dict:
    """Per phase: both paths' ms per layer call and the ratio of their medians."""
    return {phase: {"in_process": local[phase], "expert_functions": remote[phase],
                    "ratio_of_medians": remote[phase]["median"] / local[phase]["median"]} for phase in local}


def _gate_seconds(moe, capture) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        for iteration in capture.iterations:
            for layer, record in enumerate(iteration):
                moe.route(layer, record.gate_input)
    return time.perf_counter() - start


def print_report(result: dict[str, Any]) -> None:
    tps, moe, br, fit = result["tokens_per_s"], result["moe_layer_ms"], result["breakdown_ms_per_layer"], \
        result["latency_model"]
    print(f"model {result['model']}: {result['prompts']} prompts x {result['max_tokens']} new tokens, batch "
          f"{result['batch']}, {result['hosts']} expert hosts; outputs identical: {result['identical_outputs']}; "
          f"load average {result['load_average_1m']:.1f} on {os.cpu_count()} cores")
    print(f"tokens/s        in-process {tps['in_process']:8.1f}   expert functions {tps['expert_functions']:8.1f}"
          f"   ratio {tps['ratio']:.3f}")
    for phase, row in moe.items():
        local, remote = row["in_process"], row["expert_functions"]
        print(f"MoE layer {phase:8s}(ms, median/mean)  in-process {local['median']:.3f}/{local['mean']:.3f}   "
              f"expert functions {remote['median']:.3f}/{remote['mean']:.3f}   ratio of medians "
              f"{row['ratio_of_medians']:.2f}")
    print("breakdown (ms per layer call): " + ", ".join(f"{k} {v:.3f}" for k, v in br.items()))
    print(f"latency model: alpha {fit['alpha_s_per_token'] * 1e6:.2f} us/token (expert compute), beta "
          f"{fit['beta_s_per_token'] * 1e6:.3f} us/token moved (each way), call overhead "
          f"{fit['call_overhead_s'] * 1e3:.3f} ms")
