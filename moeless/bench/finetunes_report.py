"""`moeless bench finetunes`' measurements on the hosts and its report: every expert loaded first,
the memory held and each model's GB·s (read at one time from each host), the ratios, the printout."""

from __future__ import annotations

from typing import Any, Sequence

from moeless.expert_fn.client.client import ExpertHostClient


def prewarm(addresses: Sequence[str], models: Sequence[tuple[str | None, Any]]) -> None:
    """Load every expert of every model (name: the name the hosts serve it by, None: their only one;
    its MoESpec) on the host static EP places it on, and wait: the memory held is then all of it."""
    clients = {}
    try:
        for name, spec in models:
            for i, address in enumerate(addresses):
                clients[(name, i)] = ExpertHostClient(address, timeout_s=120, model=name)
            for layer in range(spec.num_layers):
                for expert in range(spec.num_experts):
                    clients[(name, expert * len(addresses) // spec.num_experts)].load(layer, expert, wait=True)
    finally:
        for client in clients.values():
            client.close()


def memory_held(addresses: Sequence[str]) -> dict:
    """The hosts' replica bytes held now, GB·s, shared replicas, and each model's part (summed over
    the hosts, each host's parts read with its totals: parts_add_up says whether they do)."""
    held = {"bytes_held": 0, "replicas": 0, "shared_replicas": 0, "gb_s": 0.0, "models": {}}
    adds_up = True
    for address in addresses:
        with ExpertHostClient(address) as host:
            status = host.status()
        meters = status["meters"]
        held["bytes_held"] += meters["bytes_held"]
        held["replicas"] += sum(1 for r in status["replicas"] if r["bytes"])
        held["shared_replicas"] += meters["shared_replicas"]
        held["gb_s"] += meters["gb_s"]
        parts = status.get("models", {})
        if len(parts) > 1:
            adds_up &= abs(sum(p["gb_s"] for p in parts.values()) - meters["gb_s"]) <= 1e-9 * max(meters["gb_s"], 1.0)
            adds_up &= sum(p["bytes_held"] for p in parts.values()) == meters["bytes_held"]
        for name, part in parts.items():
            mine = held["models"].setdefault(name, {"gb_s": 0.0, "bytes_held": 0, "own_replicas": 0, "shared_replicas": 0})
            for key in mine:
                mine[key] += part[key]
    held["parts_add_up"] = adds_up
    return held


def ratios(runs: dict, whole: dict[str, int], names: Sequence[str]) -> dict:
    """The base and fine-tunes (in one engine, and in one engine per model) against the base alone:
    memory, throughput, latency."""
    alone = runs["base_alone"]

    def ratio(a, b):
        return a / b if a is not None and b else None

    together = {run: r for run, r in runs.items() if run != "base_alone"}
    return {
        "memory_ratio": ratio(runs["one_engine"]["memory"]["bytes_held"], alone["memory"]["bytes_held"]),
        "whole_models_memory_ratio": ratio(sum(whole.values()), whole[names[0]]),
        "throughput_ratio": {run: ratio(r["tokens_per_s"], alone["tokens_per_s"]) for run, r in together.items()},
        "latency_ratios": {run: {f"{what}_{p}": ratio(r[f"{what}_s"][p], alone[f"{what}_s"][p])
                                 for what in ("ttft", "tpot") for p in ("p50", "p99")} for run, r in together.items()},
    }


def print_report(result: dict) -> None:
    kind = "stand-ins (experts perturbed, not trained)" if result["stand_ins"] else "fine-tunes"
    print(f"base {result['base']} and {len(result['finetunes'])} {kind}: {', '.join(result['finetunes'])}; "
          f"{result['hosts']} expert hosts; {result['requests']} requests of {result['max_tokens']} tokens at "
          f"{result['rate_per_s']:g}/s in all; load average {result['load_average_1m']:.1f}")
    for name, run in result["runs"].items():
        mem = run["memory"]
        print(f"  {name:16s} {run['tokens_per_s']:7.2f} tokens/s, TTFT p50/p99 {_s(run['ttft_s'], 'p50')}/"
              f"{_s(run['ttft_s'], 'p99')} s, TPOT p50/p99 {_s(run['tpot_s'], 'p50')}/{_s(run['tpot_s'], 'p99')} s, "
              f"{run['failed']} failed, {run['identical_to_merged_alone']}/{run['checked']} as the merged model alone; "
              f"experts held {mem['bytes_held'] / 1e6:.1f} MB in {mem['replicas']} replicas ({mem['shared_replicas']} "
              f"shared); per-model GB·s add up: {mem['parts_add_up']}")
    for model, part in result["runs"]["one_engine"]["memory"]["models"].items():
        print(f"    {model}: {part['gb_s']:.4g} GB·s, {part['own_replicas']} own and {part['shared_replicas']} shared "
              f"replicas")
    print(f"expert memory {_x(result['memory_ratio'])} the base alone's (whole models: "
          f"{_x(result['whole_models_memory_ratio'])})")
    for run, lat in result["latency_ratios"].items():
        print(f"{run}: throughput {_x(result['throughput_ratio'][run])} the base alone's; TTFT p50/p99 "
              f"{_x(lat['ttft_p50'])}/{_x(lat['ttft_p99'])}, TPOT p50/p99 {_x(lat['tpot_p50'])}/{_x(lat['tpot_p99'])}")


def _s(figures: dict, key: str) -> str:
    return "-" if figures[key] is None else f"{figures[key]:.2f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"
