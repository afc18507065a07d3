"""A serving replica on a device (`moeless serve --device cuda`), its experts on local expert hosts
reached over every transport, checked against the same model in this process on that device.

Runs without Ray (the GPU machines lent to sessions have none): the replica's own parts, the
Engine with a RemoteExecutor, as a ModelServer runs them. Per transport (local: CUDA IPC on a
GPU, shared memory on a CPU; tcp: rows staged through host memory; nixl, where installed: the
rows written from GPU memory; grpc):
1. every MoE-layer call runs in process and over the transport on the same input (the order
   rotating call by call), and must be bit-identical (serving/path_timing.PairedExecutor), each call
   timed to its end (a CUDA sync before and after: a GPU runs kernels after the call returns);
2. continuous batching's generation over the transport alone (prefill packed, decode over
   KVSlots) must equal the in-process one token for token, and so must the live path's (a
   LiveEngine forecasting every layer with gate copies on the device, as a ModelServer runs it);
3. the remote forward's logits must match the unmodified transformers model's (float rounding:
   the MoE sums run in another order) with the same greedy tokens.
Prints the MoE layer's p50 over each transport / in process per phase and writes JSON to --out.
Exit 1 when an output differs. On a CPU it checks the same path (tests/serving/test_device.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from moeless.controller.knobs import Knobs
from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.errors import ExpertHostError
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.expert_fn.wire.nixl_link import unavailable as nixl_unavailable
from moeless.model.tiny import TINY_ARCHS, tiny_model
from moeless.model.weight_store import export_store
from moeless.predictor.build import build_predictor
from moeless.serving.engine import Engine
from moeless.serving.executor import RemoteExecutor
from moeless.serving.live_engine import LiveEngine
from moeless.serving.live_executor import LiveExecutor
from moeless.serving.path_timing import PairedExecutor, TimedExecutor, generate_batch, generate_continuous
from moeless.serving.placement_source import PlacementSource


class Synced:
    """An executor whose run_layer returns once the device has finished it (timing, not serving)."""

    def __init__(self, inner, device: torch.device):
        self.inner, self.cuda = inner, device.type == "cuda"

    def run_layer(self, layer, x, routing):
        if self.cuda:
            torch.cuda.synchronize(x.device)
        out = self.inner.run_layer(layer, x, routing)
        if self.cuda:
            torch.cuda.synchronize(x.device)
        return out


def check(device: str, arch: str = "mixtral", hosts: int = 2, prompts: int = 4, prompt_tokens: int = 48,
          max_tokens: int = 8) -> dict:
    """The figures of every transport (see the module docstring); "ok": every output as promised."""
    moe = tiny_model(arch, 0)
    store = export_store(moe, f"tiny-{arch}")  # from host memory, before the move
    knobs = Knobs()
    runtime = build_predictor(moe, knobs.predictor, knobs.distance)  # before the move, as a ModelServer does
    moe.to(device)
    runtime.primary.to(device)
    dev, spec = moe.device, moe.spec
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, spec.vocab_size, (prompts, prompt_tokens), generator=generator).tolist()
    local = moe.local_executor()
    reference_rows, _ = generate_continuous(Engine(moe, local), ids, max_tokens)
    with torch.no_grad():
        reference = moe.hf(input_ids=torch.tensor(ids, device=dev)).logits  # the unmodified model
    transports = [t for t in ("local", "tcp", "nixl", "grpc") if t != "nixl" or nixl_unavailable() is None]
    result = {"device": str(dev), "arch": arch, "hosts": hosts, "prompts": prompts, "prompt_tokens": prompt_tokens,
              "max_tokens": max_tokens, "transports": {}}
    with launch_local_hosts(hosts, store, keep_alive_s=600, metrics=False, cpu=device == "cpu") as group:
        for transport in transports:
            clients = [ExpertHostClient(a, timeout_s=120, transport=transport) for a in group.addresses]
            remote = RemoteExecutor(clients, PlacementSource.static(spec.num_layers, spec.num_experts, hosts))
            paths = {"in_process": TimedExecutor(Synced(local, dev)), transport: TimedExecutor(Synced(remote, dev))}
            paired = PairedExecutor({name: (executor, torch.get_num_threads()) for name, executor in paths.items()},
                                    torch.get_num_threads())
            try:
                generate_batch(Engine(moe, paired), ids, 2)  # warm: replica loads, channels, the allocator
            except ExpertHostError as err:
                if transport != "nixl":
                    raise
                result["nixl_not_measured"] = str(err)  # e.g. a NIXL whose UCX cannot reach GPU memory here
                for client in clients:
                    client.close()
                continue
            for executor in paths.values():
                executor.samples.clear()
            paired.mismatches = dict.fromkeys(paired.mismatches, 0)
            started = time.perf_counter()
            generate_batch(Engine(moe, paired), ids, max_tokens)
            rows, _ = generate_continuous(Engine(moe, remote), ids, max_tokens)
            reports: list = []
            live = LiveExecutor(remote, spec.num_layers, spec.num_experts, replica="check", sink=reports.append,
                                runtime=runtime, distance=knobs.distance)
            live_rows, _ = generate_continuous(LiveEngine(moe, live), ids, max_tokens)
            with torch.no_grad():
                logits = moe.forward(torch.tensor(ids), executor=remote).logits
            base, path = (paths[name].summary_ms(prompts) for name in ("in_process", transport))
            result["transports"][transport] = {
                "host_devices": sorted({c.status()["device"] for c in clients}),
                "paths": sorted({c.path for c in clients}),
                "layer_calls": paired._calls, "mismatched_calls": paired.mismatches[transport],
                "tokens_equal": rows == reference_rows,
                "live_tokens_equal": live_rows == reference_rows, "live_reports": len(reports),
                "max_logit_diff_vs_transformers": float((logits - reference).abs().max()),
                "greedy_equal_to_transformers": bool(torch.equal(logits.argmax(-1), reference.argmax(-1))),
                "p50_ms": {phase: {"in_process": base[phase]["median"], transport: path[phase]["median"],
                                   "ratio": path[phase]["median"] / base[phase]["median"]}
                           for phase in ("prefill", "decode") if phase in base and phase in path},
                "seconds": time.perf_counter() - started}
            for client in clients:
                client.close()
    result["ok"] = all(r["mismatched_calls"] == 0 and r["tokens_equal"] and r["live_tokens_equal"] and r["live_reports"]
                       and r["greedy_equal_to_transformers"]
                       and r["max_logit_diff_vs_transformers"] < 1e-3 for r in result["transports"].values())
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="where the replica runs: cuda (default) or cpu")
    parser.add_argument("--arch", choices=TINY_ARCHS, default="mixtral", help="the tiny random model's architecture")
    parser.add_argument("--max-tokens", type=int, default=8, help="new tokens per prompt (default 8)")
    parser.add_argument("--out", metavar="DIR", help="write serving-DEVICE.json there")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_serving_check: torch sees no CUDA GPU; run it on a GPU machine or with --device cpu", file=sys.stderr)
        return 2
    result = check(args.device, args.arch, max_tokens=args.max_tokens)
    for transport, r in result["transports"].items():
        ratios = ", ".join(f"{phase} {p[transport]:.2f} / {p['in_process']:.2f} ms = {p['ratio']:.2f}x"
                           for phase, p in r["p50_ms"].items())
        print(f"{transport:5s} paths {','.join(r['paths'])} hosts on {','.join(r['host_devices'])}: "
              f"{r['mismatched_calls']} of {r['layer_calls']} calls differ, tokens equal {r['tokens_equal']} "
              f"(live path {r['live_tokens_equal']}, {r['live_reports']} reports), "
              f"vs transformers max |logit diff| {r['max_logit_diff_vs_transformers']:.1e} greedy equal "
              f"{r['greedy_equal_to_transformers']}; MoE layer p50 {ratios}")
    if "nixl_not_measured" in result:
        print(f"nixl  not measured: {result['nixl_not_measured']}")
    print("every output as promised" if result["ok"] else "OUTPUTS DIFFER", f"(replica on {result['device']})")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"serving-{args.device.split(':')[0]}.json").write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
