"""What `moeless bench planner` prints: the cost profile, planning time, and the twin's tables.

Quality tables, one per prefetch distance d: per planner and forecast, the mean MoE-layer time
with exposed cold starts (serial model) as a ratio to static EP in prefill, in decode and over
all iterations by time; exposed and hidden cold-start time per layer; resident replicas per layer
(time-weighted) as a ratio to static EP's; loads and evictions per layer and iteration. Then the
issue's targets, checked on the predictor's rows.
"""

from __future__ import annotations

from moeless.placement.profile import CostProfile

TARGETS = {"prefill": 0.80, "decode": 1.00, "memory": 1.5}  # moeless / static EP, with the predictor's forecast


def print_profile(profile: CostProfile) -> None:
    print(f"cost profile ({profile.source}):")
    print(f"  alpha          {profile.alpha * 1e9:9.1f} ns/token   (expert_forward slope)")
    print(f"  call overhead  {profile.call_overhead * 1e6:9.1f} us/call    (intercept of the same fit)")
    print(f"  beta           {profile.beta * 1e9:9.2f} ns/token   (serialise + copy one hidden vector)")
    print(f"  load, disk     {profile.load_s['disk'] * 1e3:9.3f} ms/expert  (read + sha256 + parse + copy, {profile.expert_bytes} bytes)")
    print(f"  load, host     {profile.load_s['host'] * 1e3:9.3f} ms/expert  (copy from the host memory tier)")
    print(f"  non-expert     {profile.non_expert_bytes / 1e6:9.1f} MB")
    print(f"  re-level       {profile.relevel_s * 1e6:9.1f} us/layer   (the data plane's shares on the actual loads, split experts)")
    print(f"  re-level check {profile.check_s * 1e6:9.1f} us/layer   (whether it pays, else planned or static EP shares)")


def print_timing(rows: list[dict], repeats: int) -> None:
    names = [k for k in rows[0] if k not in ("E", "G")]
    print(f"\nplanning time per layer, ms ({repeats} skewed loads each; EPLB at moeless's replica budget;"
          f" wall median / p99 (thread CPU median)):")
    print(f"  {'E':>4} {'G':>3} | " + " | ".join(f"{n:^26}" for n in names) + " | EPLB/moeless")
    for r in rows:
        cells = [f"{r[n]['median_ms']:7.3f} / {r[n]['p99_ms']:7.3f} ({r[n]['cpu_median_ms']:6.3f})" for n in names]
        print(f"  {r['E']:>4} {r['G']:>3} | {' | '.join(cells)} | {r['eplb']['median_ms'] / r['moeless']['median_ms']:6.2f}x")


def print_quality(quality: dict) -> None:
    summary, config = quality["summary"], quality["config"]
    static = next(v for k, v in summary.items() if k.startswith("static|"))
    print(f"\nstatic EP: {static['prefill']['serial_cold_s'] * 1e6:.1f} us per prefill layer, "
          f"{static['decode']['serial_cold_s'] * 1e6:.1f} us per decode layer (serial model), "
          f"{static['all']['resident_time_weighted']:.1f} replicas per layer")
    if quality.get("predictor_load_accuracy"):
        print("predictor load accuracy on the replayed iterations: "
              + ", ".join(f"{d}: {a:.3f}" for d, a in quality["predictor_load_accuracy"].items()))
    for d in config["distances"]:
        print(f"\nprefetch distance d = {d}; ratios to static EP (serial model, exposed cold starts included):")
        print(f"  {'planner':<22} {'forecast':<10} {'prefill':>7} {'decode':>7} {'all':>6} {'exposed/hidden us':>18} "
              f"{'memory':>6} {'loads':>6} {'evict':>6}")
        for key, row in summary.items():
            planner, forecast, dist = key.split("|")
            if dist != f"d={d}":
                continue
            cells = [f"{row[p]['serial_cold_s_vs_static']:7.2f}" if p in row else f"{'-':>7}" for p in ("prefill", "decode")]
            a = row["all"]
            print(f"  {planner:<22} {forecast:<10} {' '.join(cells)} {a['total_serial_cold_s_vs_static']:6.2f} "
                  f"{a['exposed_s'] * 1e6:8.1f}/{a['hidden_s'] * 1e6:<9.1f} {a['resident_time_weighted_vs_static']:6.2f} "
                  f"{a['loads']:6.2f} {a['evictions']:6.2f}")
    for line in check_targets(summary, config["distances"]):
        print(line)


def check_targets(summary: dict, distances: list[int]) -> list[str]:
    """The issue's targets on moeless's predictor rows: one line per distance, each target met or not."""
    lines = []
    for d in distances:
        ours, window = summary.get(f"moeless|predictor|d={d}"), summary.get(f"eplb-window|previous|d={d}")
        if ours is None or window is None or "prefill" not in ours or "decode" not in ours:
            continue
        pre, dec = ours["prefill"]["serial_cold_s_vs_static"], ours["decode"]["serial_cold_s_vs_static"]
        mem = ours["all"]["resident_time_weighted_vs_static"]
        checks = [
            (f"prefill {pre:.2f} <= {TARGETS['prefill']:.2f}", pre <= TARGETS["prefill"]),
            (f"decode {dec:.2f} <= {TARGETS['decode']:.2f}", dec <= TARGETS["decode"]),
            (f"below EPLB-window ({window['prefill']['serial_cold_s_vs_static']:.2f} / {window['decode']['serial_cold_s_vs_static']:.2f})",
             pre < window["prefill"]["serial_cold_s_vs_static"] and dec < window["decode"]["serial_cold_s_vs_static"]),
            (f"memory {mem:.2f} <= {TARGETS['memory']:.2f}", mem <= TARGETS["memory"]),
        ]
        lines.append(f"targets, moeless with the predictor at d = {d}: "
                     + "; ".join(f"{text} {'met' if ok else 'NOT met'}" for text, ok in checks))
    return lines


def print_roofline(roofline: dict) -> None:
    """The roofline's prediction of the measured profile: predicted / measured per field (None: the
    field was not measured, the roofline's value stood in)."""
    ratios = roofline["ratios"]
    cells = ", ".join(f"{name} {'n/a (the roofline stood in)' if ratio is None else f'{ratio:.2f}'}"
                      for name, ratio in ratios.items())
    print(f"roofline ({roofline['device']}) / measured: {cells}")
