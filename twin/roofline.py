"""Cost profiles by roofline: the twin's CostProfile for a model geometry on a GPU, from datasheets.

Public API (what `moeless eval --geometry/--gpu` and reports use):

    from moeless.twin.geometry import load_geometry        # name, "default" or a config.json path
    from moeless.hardware.gpus import gpu_spec, parse_gpu_arg  # "H100", "A6000x8"
    from moeless.twin.roofline import roofline_profile, resolve_profile, efficiency, load_efficiency

    geometry = load_geometry("mixtral-8x7b")
    gpu, count = parse_gpu_arg("H100x8")
    profile = roofline_profile(geometry, gpu, count)                 # a CostProfile (source says "roofline")
    profile = roofline_profile(geometry, gpu, count, compute=0.5)    # any Efficiency field overridden
    profile = resolve_profile("cost-profile.json", geometry, gpu, count)  # a real profile file wins

A profile's fields (seconds, bytes), for H hidden, F expert FFN, b bytes per weight, B = 3*H*F*b:
  1. alpha          = 6*H*F / (peak FLOP/s * compute)         three GEMMs of 2*H*F FLOPs per token
  2. call_overhead  = B / (memory bw * memory) + launch_s      one read of the expert's weights
  3. beta           = H*b / (all-to-all bw(count) * link)      one token's hidden state, one way (0 on 1 GPU)
  4. load_s.host    = B / (PCIe bw * pcie) + launch_s          host memory tier -> device (three tensor copies,
                                                               launched as a call's kernels are)
  5. load_s.disk    = B / disk_bw + B / hash_bw + B / host_copy_bw + load_s.host
                      the expert host's path: read, sha256, parse into host memory, copy to the device;
     load_s.peer    = B / (peer copy bw(count) * link) + peer_copy_s: copied from a GPU that holds the
                      expert (NVLink inside a node of 8, the 400 Gb/s network between nodes, PCIe
                      without NVLink: hardware/gpus.py), plus the expert host's fixed cost of a copy
                      as serving makes one (measured on a GPU: PEER_COPY_S)
  6. expert_bytes = B, non_expert_bytes = the geometry's non-expert parameters * b
  7. relevel_s      = relevel_fixed_s + relevel_per_expert_s * E: the serving replica's re-level of a
                      layer on its CPU (not a GPU quantity; measured on this project's CPU) with a copy
                      of its G busiest experts, relevel_per_replica_s what each replica more adds, and
     relevel_check_s the check whether that re-level pays, through the gate in front of it, and
     relevel_skip_s a call whose check the gate skips (same CPU)
Efficiency factors (`Efficiency`, below) are the fractions of datasheet peaks that real kernels
reach, each with its reason; override them by keyword, `efficiency(**kw)` or a JSON file.

The same formulas with this CPU's measured peaks (`cpu_roofline_profile` over hardware/cpu_peaks.py)
predict the profile `moeless bench planner` measures here; `compare_profiles` gives the ratios
(docs/planner.md, "Profiles by roofline").
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from moeless.hardware.cpu_peaks import CpuPeaks
from moeless.hardware.gpus import GpuSpec
from moeless.placement.profile import CostProfile
from moeless.twin.geometry import Geometry

# Efficiency factors: what fraction of a datasheet peak the expert host's kernels reach.
COMPUTE_EFF = 0.6  # grouped/batched bf16 expert GEMMs at hundreds of tokens reach ~50-70% of dense peak
MEMORY_EFF = 0.8  # a streaming weight read reaches ~80-90% of HBM/GDDR peak (STREAM-like)
LINK_EFF = 0.7  # NCCL all-to-all bus bandwidth at MB-size messages: ~70-80% of NVLink/PCIe peak
PCIE_EFF = 0.8  # pinned host->device copies: ~25 of 32 GB/s (Gen4), ~50 of 64 (Gen5)
LAUNCH_S = 5e-6  # a replica call: ~3 GEMMs + an activation, ~1-2 us of kernel launch each
DISK_BW = 2e9  # a datacenter NVMe SSD's sequential read (2-7 GB/s): the slow end
HASH_BW = 1.5e9  # sha256 on one x86 core with SHA extensions (the weight store verifies every read)
HOST_COPY_BW = 10e9  # one core's memcpy: parsing the file into (pinned) host memory
# The serving replica's pairing of one layer's tokens with its replicas (dispatch.pair_tokens) runs on
# its CPU, not the GPU: measured here (`measure_relevel_s`, this project's CPU, G = 8, the fastest of
# 300, 2026-11-27, other work on the machine: load 20) 6.2, 7.0, 9.4, 14.3 us at E = 8, 16, 64, 128
# (12.1 and 13.8 us at E = 64 on 16 and 32 GPUs, 42 us at E = 256 on 64), the check 3.4 us. Since
# 2026-11-28 each layer's index is made once per published layer and a home-first plan skips the
# plan's own start: the pairing took 0.79x, 0.72x, 0.65x the time at E = 8, 64, 128 on 8 GPUs and
# 0.56x at E = 256 on 64 (one idle run timing both, the fastest of 3 x 500; this machine's speed
# drifts by up to 1.5x between runs, so the earlier constants are scaled by those ratios, beside
# the check's unchanged 3.4 us, rather than replaced by one run's absolute times).
RELEVEL_FIXED_S, RELEVEL_PER_EXPERT_S = 4.5e-6, 0.038e-6
# Since 2026-11-28 the check runs behind a gate (placement/check_gate.py): its records take 1.2-1.3x
# the check's time and a skipped call 0.22-0.28x (E = 8, 64 on 8 GPUs, the fastest of 3 x 500, timed
# in one run with the bare check; a loaded machine), so 3.4 us x 1.25 and x 0.25, rounded up.
RELEVEL_CHECK_S = 4.3e-6
RELEVEL_SKIP_S = 0.9e-6
# Each replica past those E + G adds to the pairing (it walks every replica): measured 2026-11-28 (the
# fastest of 300, an idle run) on full replication against E + G replicas: 6.5 -> 13.2 us at E = 64,
# G = 8 (512 replicas), 7.5 -> 22.9 at E = 128, 7.5 -> 39.9 at E = 64, G = 32, 13.1 -> 292.5 at
# E = 256, G = 64 (16,384 replicas): 0.015-0.017 us a replica.
RELEVEL_PER_REPLICA_S = 0.017e-6
# An expert host's copy of one replica from a peer's GPU, beside its bytes on the link: the ask over
# gRPC, the holder's copy into its region, the WRITE's and the clone's waits, the checks (peer_copy.py,
# one ask a replica). Measured 2026-11-30 on an H200 between two host processes on its one GPU
# (`moeless bench peer-copy --device cuda`, docs/benchmarks.md): 2.12 ms over NIXL and 2.19 ms over CUDA
# IPC at a 0.33 MB expert, where the bytes take microseconds; 2.43 ms at 34.6 MB.
PEER_COPY_S = 2.1e-3


@dataclass(frozen=True)
class Efficiency:
    """Efficiency factors (fractions of peak) and the fixed costs the datasheets do not give."""

    compute: float = COMPUTE_EFF
    memory: float = MEMORY_EFF
    link: float = LINK_EFF
    pcie: float = PCIE_EFF
    launch_s: float = LAUNCH_S
    disk_bw: float = DISK_BW
    hash_bw: float = HASH_BW
    host_copy_bw: float = HOST_COPY_BW
    relevel_fixed_s: float = RELEVEL_FIXED_S
    relevel_per_expert_s: float = RELEVEL_PER_EXPERT_S
    relevel_check_s: float = RELEVEL_CHECK_S
    relevel_per_replica_s: float = RELEVEL_PER_REPLICA_S
    relevel_skip_s: float = RELEVEL_SKIP_S
    peer_copy_s: float = PEER_COPY_S

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"efficiency {f.name} must be a number >= 0, got {value!r}")
        for name in ("compute", "memory", "link", "pcie", "disk_bw", "hash_bw", "host_copy_bw"):
            if getattr(self, name) <= 0:
                raise ValueError(f"efficiency {name} must be > 0, got {getattr(self, name)!r}")


def efficiency(base: Efficiency | None = None, **overrides: float) -> Efficiency:
    """`base` (default: the named constants) with fields overridden; unknown names are an error."""
    known = [f.name for f in fields(Efficiency)]
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise ValueError(f"unknown efficiency field(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return replace(base or Efficiency(), **{k: float(v) for k, v in overrides.items()})


def load_efficiency(path: str | Path) -> Efficiency:
    """Efficiency factors from a JSON object of overrides ({"compute": 0.5, ...})."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot read efficiency overrides ({err})") from err
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: efficiency overrides are a JSON object of field: number")
    return efficiency(**doc)


def parse_efficiency_args(items: list[str]) -> dict[str, float]:
    """A CLI's --efficiency items -> overrides for `efficiency`: KEY=NUMBER, or a JSON file of them
    (later items win): ["eff.json", "compute=0.5"]."""
    out: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep and item.endswith(".json"):
            out.update(asdict(load_efficiency(item)))  # the file's fields over the defaults
            continue
        try:
            out[key.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"--efficiency: expected KEY=NUMBER or a .json file, got {item!r}")
    efficiency(**out)  # names checked now, with the known ones listed
    return out


def roofline_profile(geometry: Geometry, gpu: GpuSpec, count: int = 1, eff: Efficiency | None = None,
                     source: str = "", **overrides: float) -> CostProfile:
    """The CostProfile of `geometry`'s experts on `count` x `gpu` by roofline (module docstring's
    steps 1-7); `eff` and keyword overrides set the efficiency factors."""
    e = efficiency(eff, **overrides)
    h, f, b = geometry.hidden, geometry.expert_ffn, geometry.dtype_bytes
    expert = geometry.expert_bytes
    alpha = 6 * h * f / (gpu.peak_flops * e.compute)  # 1.
    call = expert / (gpu.mem_bw * e.memory) + e.launch_s  # 2.
    beta = 0.0 if count == 1 else h * b / (gpu.all_to_all_bw(count) * e.link)  # 3.
    host = expert / (gpu.pcie_bw * e.pcie) + e.launch_s  # 4.
    disk = expert / e.disk_bw + expert / e.hash_bw + expert / e.host_copy_bw + host  # 5.
    peer = expert / (gpu.peer_copy_bw(count) * e.link) + e.peer_copy_s  # 5.
    note = source or (f"roofline estimate (not measured): {geometry.name} ({geometry.dtype}) on {count} x {gpu.name}, "
                      f"datasheet peaks x efficiency {_short(e)}")
    relevel = e.relevel_fixed_s + e.relevel_per_expert_s * geometry.num_experts  # 7.
    return CostProfile(alpha=alpha, beta=beta, call_overhead=call, load_s={"disk": disk, "host": host, "peer": peer},
                       expert_bytes=expert, non_expert_bytes=geometry.non_expert_bytes, relevel_s=relevel, source=note,
                       relevel_check_s=e.relevel_check_s, relevel_per_replica_s=e.relevel_per_replica_s,
                       relevel_skip_s=e.relevel_skip_s)


def resolve_profile(profile_path: str | Path | None, geometry: Geometry, gpu: GpuSpec, count: int = 1,
                    eff: Efficiency | None = None, **overrides: float) -> CostProfile:
    """A real profile file when given (it always wins), else the roofline's."""
    if profile_path:
        return CostProfile.from_json(profile_path)
    return roofline_profile(geometry, gpu, count, eff, **overrides)


def _short(e: Efficiency) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in asdict(e).items())


PROFILE_FIELDS = ("alpha", "call_overhead", "beta", "load_s.host", "load_s.disk", "expert_bytes", "non_expert_bytes")


def _field(profile: CostProfile, name: str) -> float:
    if name.startswith("load_s."):
        return profile.load_s[name.split(".", 1)[1]]
    return float(getattr(profile, name))


def compare_profiles(predicted: CostProfile, measured: CostProfile) -> dict[str, float]:
    """predicted / measured per field of PROFILE_FIELDS (nan where the measured one is 0)."""
    return {n: _field(predicted, n) / _field(measured, n) if _field(measured, n) else float("nan") for n in PROFILE_FIELDS}


# ---- This CPU as a roofline device ---------------------------------------------------------------

CPU_OPS_PER_CALL = 7  # expert_forward: three matmuls, two transposes, silu, a product (each dispatched)


def cpu_roofline_profile(peaks: CpuPeaks, geometry: Geometry, num_gpus: int) -> CostProfile:
    """The roofline's profile of this CPU running `geometry`'s experts as bench planner does.

    The device is the CPU: its measured peaks are what its kernels reach (efficiencies 1); memory
    moves at the bandwidth of the level the expert's bytes live in (`CpuPeaks.copy_bw`); a call's
    fixed cost is its ops' dispatch; a "transfer" is bench planner's serialise + copy (two copies:
    link bw = copy bw / 2); the host tier's load is one copy (PCIe bw = copy bw); the disk tier
    reads the file from the page cache (a copy), hashes it and parses it (a copy)."""
    bw = peaks.copy_bw(geometry.expert_bytes)
    cpu = GpuSpec("CPU", peaks.flops, bw, 0.0, "nvswitch", bw / 2, bw, "measured by moeless.hardware.cpu_peaks.measure_cpu_peaks")
    eff = Efficiency(compute=1.0, memory=1.0, link=1.0, pcie=1.0, launch_s=CPU_OPS_PER_CALL * peaks.op_s,
                     disk_bw=bw, hash_bw=peaks.hash_bw, host_copy_bw=bw)
    return roofline_profile(geometry, cpu, max(num_gpus, 2), eff,
                            source=f"roofline of this CPU ({peaks.threads} thread(s)): {peaks.flops / 1e9:.1f} GFLOP/s, "
                                   f"copy {peaks.cache_bw / 1e9:.1f} GB/s in cache, {peaks.dram_bw / 1e9:.1f} GB/s "
                                   f"from memory, op {peaks.op_s * 1e6:.2f} us, sha256 {peaks.hash_bw / 1e9:.2f} GB/s")
