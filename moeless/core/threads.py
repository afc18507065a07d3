"""How many CPU threads torch uses, for one block of work."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the block with torch on `threads` CPU threads, then restore the previous count.

    Predictors train and run on one thread: their matmuls are tiny, and on a busy machine a
    multi-thread pool stalls each one at its barrier (30 ms instead of 0.01 ms for one gate,
    and 75x slower fine-tuning, measured on the shared 2-core machine).
    """
    if threads < 1:
        raise ValueError(f"--threads must be at least 1, got {threads}")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
