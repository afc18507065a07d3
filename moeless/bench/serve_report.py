"""`moeless bench serve`'s report: its figures (serve.run_bench) as lines of text."""

from __future__ import annotations

import os
from typing import Any


def _cells(result: dict[str, Any], prefix: str, name: str) -> str:
    """A path's MoE-layer ms and ratios per phase, p50 / p90, from the paired ("") or alone ("alone_") figures."""
    ms = result[f"{prefix}moe_layer_ms"][name]
    ratios, high = result[f"{prefix}ratio_to_best_in_process"][name], result[f"{prefix}ratio_to_best_in_process_p90"][name]
    return "  ".join(f"{phase} {ms[phase]['median']:.3f} ({ratios[phase]:.2f}x) / {ms[phase]['p90']:.3f} "
                     f"({high[phase]:.2f}x)" for phase in ("prefill", "decode") if phase in ms)


def print_report(result: dict[str, Any]) -> None:
    fit = result["latency_model"]
    print(f"model {result['model']} (E={result['experts']}, k={result['top_k']}, F={result['expert_ffn']}): "
          f"{result['prompts']} prompts x {result['max_tokens']} new tokens, batch "
          f"{result['batch']}, {result['hosts']} expert hosts x {result['threads_per_host']} thread(s); load average "
          f"{result['load_average_1m']:.1f} on {os.cpu_count()} cores")
    if result["nixl"] != "measured":
        print(f"nixl not measured: {result['nixl']}")
    print(f"{result['layer_calls']} MoE-layer calls; 'differ': calls whose output is not bit-identical to the 1-thread "
          f"in-process one (for the wide baseline: generations that differ; 2 threads round differently)")
    print(f"{'path':26s} {'tokens/s':>8s} {'differ':>6s}   MoE layer ms: p50 (ratio to the faster in-process) / "
          f"p90 (ratio)")
    for name in result["moe_layer_ms"]:
        print(f"{name:26s} {result['tokens_per_s'][name]:8.1f} {result['mismatches'][name]:6d}   {_cells(result, '', name)}")
    print("each path alone, as serving runs it (hosts idle only during the model's other layers; 'differ': "
          "generations unlike the paired run's):")
    for name in result["alone_moe_layer_ms"]:
        print(f"{name:26s} {'':8s} {result['alone_generations_differing'][name]:6d}   {_cells(result, 'alone_', name)}")
    wire = result["wire_per_layer_call"]
    print(f"on the wire per layer call ({wire['dtype']}): {wire['rows_sent']:.1f} token rows out, {wire['rows_received']:.1f} "
          f"back for {wire['pairs']:.1f} (token, expert) pairs; {(wire['bytes_sent'] + wire['bytes_received']) / 1e3:.1f} KB, "
          f"{wire['ratio_to_one_row_per_pair']:.2f}x one float32 row per pair each way "
          f"({wire['bytes_one_row_per_pair_float32'] / 1e3:.1f} KB)")
    for name, row in result["round_trip_us"].items():
        print(f"{name} (us p50 / p90): " + "  ".join(f"{t} {v['p50']:.0f} / {v['p90']:.0f}" for t, v in row.items()))
    for transport, pp in result["pingpong"].items():
        print(f"ping-pong over {transport}, 2 micro-batches, modelled (twin/overlap.py on this run's figures, the replica and "
              f"the hosts on cores of their own): "
              f"{pp['serial_ms_per_layer']:.3f} -> {pp['pingpong_ms_per_layer']:.3f} ms per layer (forward and MoE), "
              f"{pp['hidden_fraction']:.0%} of the transfer hidden (each call pays {pp['call_ms']:.3f} ms again)")
    run = result["pingpong_run"]
    engines = run["engines"]
    print(f"ping-pong run (continuous batching's forwards as `moeless serve` runs them, forecasts included, p50 ms per "
          f"forward; a forward splits in 2 where each part has >= {run['micro_batch_tokens']} tokens): in-process prefill {engines['in_process']['prefill']['ms']:.1f}, "
          f"decode {engines['in_process']['decode']['ms']:.1f}")
    for transport, effect in run["effect"].items():
        one, two = engines[f"{transport}_1"], engines[f"{transport}_2"]
        print(f"  over {transport}: " + "; ".join(
            f"{phase} {one[phase]['ms']:.1f} -> {two[phase]['ms']:.1f} ({e['ratio']:.2f}x, {e['hidden_fraction']:+.0%} of "
            f"{one[phase]['transfer_ms']:.1f} ms transfer hidden)" for phase, e in effect.items())
            + f"; generations differing from in-process {one['generations_differing']} / {two['generations_differing']}; "
              f"forecasting {one['forecast_ms_per_report']:.2f} / {two['forecast_ms_per_report']:.2f} ms per report "
              f"({one['reports']} / {two['reports']} reports)")
    for transport, br in result["breakdown_ms_per_layer"].items():
        print(f"breakdown over {transport} (ms per layer call): " + ", ".join(f"{k} {v:.3f}" for k, v in br.items()))
    pairing = result["pairing"]
    d = pairing["dispatch"]
    print(f"dispatch-time pairing (expert_functions_local_paired: every expert on every host, each call's tokens paired "
          f"on its own loads): {d['us_per_layer_median']:.1f} us per layer call p50 ({d['us_per_layer_p90']:.1f} p90; "
          f"a pairing costs {1e6 * d['relevel_s']:.1f} us, a check {1e6 * d['check_s']:.1f} us), {d['checked_calls']} of "
          f"{d['calls']} calls checked (the others skipped: placement/check_gate.py), {d['paired_calls']} paired, "
          f"{'experts split past the knee' if d['splits'] else 'whole experts only (the hosts are not split-exact)'}; MoE layer / "
          f"static EP's on the same channel: " + ", ".join(
              f"{p} {r:.2f}x p50 / {pairing['ratio_to_static_local_p90'][p]:.2f}x p90"
              for p, r in pairing["ratio_to_static_local"].items()))
    print(f"latency model ({fit['transport']}): alpha {fit['alpha_s_per_token'] * 1e6:.2f} us/token (expert compute), "
          f"beta {fit['beta_s_per_token'] * 1e6:.3f} us/token moved (each way), call overhead "
          f"{fit['call_overhead_s'] * 1e3:.3f} ms")
