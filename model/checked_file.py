"""One safetensors file read whole and checked before it is trusted: the weight store's experts, a
fine-tune's replaced experts and a LoRA store's factors are all read this way, each caller naming
in its own error what the file is and what to do (a damaged file is always one line)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import load as parse_safetensors


class CheckedFileError(ValueError):
    """What was wrong with the file, worded to follow '<path>: ' in the caller's own message."""


def read_checked(path: Path, sha256: str | None, what: str, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of safetensors file `path` (`what` it holds, e.g. "expert weight file"), in one
    read; with sha256 the bytes are checked before parsing; with names exactly those tensors.
    Raises CheckedFileError: missing, unreadable, checksum mismatch, unparseable or a tensor absent."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckedFileError(f"{what} is missing") from None
    except OSError as err:
        raise CheckedFileError(f"cannot read the {what} ({err.strerror})") from None
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise CheckedFileError("checksum mismatch, the file is corrupt")
    try:
        tensors = parse_safetensors(data)
        return dict(tensors) if names is None else {n: tensors[n] for n in names}
    except Exception as err:  # safetensors raises several types for damaged files; KeyError for a missing tensor
        raise CheckedFileError(f"cannot parse the {what} ({err})") from None
