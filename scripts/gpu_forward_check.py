"""Which expert forward a GPU expert host should run, measured: grouped (the stacked, padded bmm
of expert_fn/host/executor.py) or sequential (one expert after another), in float32 or bfloat16, at
Mixtral-8x7B's expert shape (H=4096, F=14336: 1, 2 and 4 experts of one call) and the default
model's (H=576, F=48: 2, 8 and 16 experts), 4, 16 and 256 rows each. Prints median microseconds
and the weight bandwidth each reaches (a decode-sized call reads every weight once: bandwidth-bound);
writes JSON to argv[1] if given.

Run by scripts/gpu_checks.sh on a lent GPU machine; exits 2 without CUDA.
"""

from __future__ import annotations

import json
import sys

import torch

from moeless.core.timing import timed_calls
from moeless.expert_fn.host.executor import grouped_forward, sequential_forward

SHAPES = {"mixtral-8x7b": (4096, 14336, (1, 2, 4)), "default": (576, 48, (2, 8, 16))}  # H, F, experts per call
FORWARDS = {"sequential": sequential_forward, "grouped": grouped_forward}


def median_us(run, repeats: int = 20) -> float:
    """Median microseconds of run() with its kernels finished (bench transport's timing loop)."""
    return 1e6 * timed_calls(lambda: (run(), torch.cuda.synchronize()), repeats)["p50"]


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_forward_check: no CUDA device; run it on a GPU machine", file=sys.stderr)
        return 2
    rows_out = []
    for (shape, (H, F, counts)), dtype in [(s, d) for s in SHAPES.items() for d in (torch.float32, torch.bfloat16)]:
        gen = torch.Generator(device="cuda").manual_seed(0)
        shapes = {"gate": (F, H), "up": (F, H), "down": (H, F)}
        weights = [{n: (0.02 * torch.randn(s, device="cuda", generator=gen)).to(dtype) for n, s in shapes.items()}
                   for _ in range(max(counts))]
        for experts in counts:
            for rows in (4, 16, 256):
                xs = [torch.randn(rows, H, device="cuda", generator=gen).to(dtype) for _ in range(experts)]
                row = {"shape": shape, "dtype": str(dtype).removeprefix("torch."), "experts": experts, "rows": rows}
                for name, forward in FORWARDS.items():
                    us = median_us(lambda f=forward: f(weights[:experts], xs, "silu"))
                    row[f"{name}_us"] = us
                    row[f"{name}_weight_tb_s"] = experts * 3 * H * F * dtype.itemsize / us / 1e6
                rows_out.append(row)
                print(f"{shape:>12} {row['dtype']:>8} {experts:>2} experts x {rows:>3} rows: sequential {row['sequential_us']:8.1f} us "
                      f"({row['sequential_weight_tb_s']:.2f} TB/s)  grouped {row['grouped_us']:8.1f} us "
                      f"({row['grouped_weight_tb_s']:.2f} TB/s)", flush=True)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "rows": rows_out}
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
