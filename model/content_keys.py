"""Experts addressed by content: the key of an expert file is its dtype, its shape and the sha256 of
its bytes, "<dtype>-<F>x<H>-<sha256 hex>" (e.g. "float32-48x576-9f2c...").

Why this suffices for two different experts never to share a key silently: an expert file is a
safetensors file, whose header (JSON, hashed with the rest) names each tensor ("gate", "up",
"down") with its dtype, shape and byte range. Two files with one sha256 are the same bytes (a
collision of SHA-256 is not known to be findable), so the same tensors, names, dtypes and shapes,
hence the same function. Shape and dtype are in the key besides, readable, so that a fine-tune
whose expert is 64x576 where its base's is 48x576 is refused by comparing keys (weight_store.py),
and so that a key stays unambiguous were it ever derived from the tensors' bytes alone.

The converse is not promised: the same tensors written with another header (another safetensors
version's layout, metadata) get another key. That costs a second copy in memory, never a wrong
answer. moeless writes every store with one serialiser (`safetensors.torch.save`), so a fine-tune's
unchanged experts hash to their base's keys.

Pure: bytes and headers in, strings out.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

# safetensors' dtype codes -> torch's names (the key reads like the store's "dtype")
DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
               "F8_E5M2": "float8_e5m2", "I8": "int8", "U8": "uint8"}
HEADER_LEN = struct.Struct("<Q")


class NotAnExpertFile(ValueError):
    """An expert file whose header cannot give a key (not a safetensors expert file)."""


def make_key(dtype: str, ffn: int, hidden: int, sha256: str) -> str:
    return f"{dtype}-{ffn}x{hidden}-{sha256}"


def key_from_header(header: dict, sha256: str, where: str) -> str:
    """The key of an expert file from its parsed safetensors header and its sha256; NotAnExpertFile
    names `where` when the header has no "gate" tensor of two dimensions."""
    gate = header.get("gate")
    if not isinstance(gate, dict) or len(gate.get("shape", ())) != 2:
        raise NotAnExpertFile(f"{where}: no 2-D 'gate' tensor in the safetensors header; not an expert file")
    ffn, hidden = gate["shape"]
    return make_key(DTYPE_NAMES.get(gate.get("dtype"), str(gate.get("dtype")).lower()), ffn, hidden, sha256)


def header_of(data: bytes | memoryview, where: str) -> dict:
    """The JSON header at the start of safetensors bytes (the first 8 bytes: its length)."""
    if len(data) < HEADER_LEN.size:
        raise NotAnExpertFile(f"{where}: {len(data)} bytes, too short for a safetensors file")
    (n,) = HEADER_LEN.unpack_from(data)
    try:
        return json.loads(bytes(data[HEADER_LEN.size:HEADER_LEN.size + n]))
    except (ValueError, UnicodeDecodeError) as err:
        raise NotAnExpertFile(f"{where}: unreadable safetensors header ({err})") from None


def content_key(data: bytes) -> str:
    """The key of an expert file's bytes (what a store writes, hashed before it is written)."""
    return key_from_header(header_of(data, "expert bytes"), hashlib.sha256(data).hexdigest(), "expert bytes")


def file_key(path: Path, sha256: str) -> str:
    """The key of an expert file whose sha256 is known (a store's index records it): only the
    header is read (a store written before keys existed gets them at open, cheaply)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_LEN.size)
            data = head + f.read(HEADER_LEN.unpack(head)[0]) if len(head) == HEADER_LEN.size else head
    except OSError as err:
        raise NotAnExpertFile(f"{path}: cannot read the expert file ({err.strerror})") from None
    return key_from_header(header_of(data, str(path)), sha256, str(path))


def parse_key(key: str) -> tuple[str, int, int]:
    """make_key's inverse: a key's (dtype, ffn, hidden); ValueError for what is not a key."""
    try:
        dtype, shape, sha = key.split("-", 2)
        ffn, hidden = (int(d) for d in shape.split("x"))
    except ValueError:
        raise ValueError(f"{key!r} is not an expert's content key (<dtype>-<F>x<H>-<sha256>)") from None
    if not sha:
        raise ValueError(f"{key!r} is not an expert's content key (<dtype>-<F>x<H>-<sha256>)")
    return dtype, ffn, hidden


def key_shape(key: str) -> str:
    """A key's dtype and shape for messages: "float32 48x576"."""
    dtype, ffn, hidden = parse_key(key)
    return f"{dtype} {ffn}x{hidden}"
