"""Routing logs as people record them -> the routing file (traces/routing_file.py).

Reads:
- JSONL (gzipped when the name ends in .gz), one record per (token, layer): a request id (req_id, request_id, problem_id, rid), the
  token's index (token_idx, token_pos, token_index, token_id, position), the layer (layer,
  layer_id, layer_idx) and its top-k expert ids (topk_ids, experts, expert_ids, selected_experts,
  topk); optional gate weights (topk_weights, weights, expert_weights, gate_weights) and phase
  ("prefill"/"decode": the prompt's length, else every token counts as prompt);
- the project's own capture (traces/request_loads.py's .npz: per-request loads), whose decode rows are
  per token and whose prefill tokens get picks dealt from the request's counts (said in the label);
- a routing file (returned as is).
Layer ids are mapped, in sorted order, to 0..L-1 (a log may name only the MoE layers). Every
error is one line naming the file, the line and the field.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from pathlib import Path
from typing import IO, Iterator

import numpy as np

from moeless.traces.routing_file import Routing, RoutingError, load_routing

KEYS = {
    "request": ("req_id", "request_id", "problem_id", "rid"),
    "token": ("token_idx", "token_pos", "token_index", "token_id", "position"),
    "layer": ("layer", "layer_id", "layer_idx"),
    "experts": ("topk_ids", "experts", "expert_ids", "selected_experts", "topk"),
}
WEIGHT_KEYS = ("topk_weights", "weights", "expert_weights", "gate_weights")
GZIP_MAGIC = b"\x1f\x8b"


def import_routing(path: str | Path, num_experts: int | None = None) -> Routing:
    """The routing in `path` (JSONL log, the project's .npz capture or a routing file). num_experts:
    E (ids must be below it); None infers max id + 1."""
    path = Path(path)
    if not path.is_file():
        raise RoutingError(f"{path}: no such file")
    if path.suffix == ".npz":
        with np.load(path) as f:
            keys = set(f.files)
        return load_routing(path) if "meta" in keys else _from_capture(path, num_experts)
    return _from_jsonl(path, num_experts)


def _field(rec: dict, role: str, where: str) -> tuple[str, object]:
    """(key, value) of the first of the role's key names in rec: loggers spell the same field differently."""
    for key in KEYS[role]:
        if key in rec:
            return key, rec[key]
    raise RoutingError(f"{where}: no {role} field; expected one of {', '.join(KEYS[role])}")


def _integer(value: object, where: str, key: str) -> int:
    """An integer, or one written as a string of digits (some loggers quote ids); never a float or bool."""
    if isinstance(value, bool) or not isinstance(value, (int, str)) or (isinstance(value, str) and not value.lstrip("-").isdigit()):
        raise RoutingError(f"{where}: field {key!r} must be an integer, got {value!r}")
    return int(value)


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of a JSONL file, gunzipped when its name ends in .gz (or its bytes start as
    gzip's do); a .gz that is not gzip, or a line that is not UTF-8, is one RoutingError naming the file
    (and the line)."""
    with open(path, "rb") as head:
        zipped = path.suffix == ".gz" or head.read(2) == GZIP_MAGIC
    try:
        f: IO[bytes]
        with (gzip.open(path, "rb") if zipped else open(path, "rb")) as f:
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise RoutingError(f"{path}:line {n}: not UTF-8 text") from None
                yield n, line
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise RoutingError(f"{path}: not a gzip file, or a truncated one ({err}); a name ending in .gz is read as gzipped JSONL") from None


def _weights(rec: dict, k: int, weighted: bool, where: str) -> list[float] | None:
    """The record's k gate weights (finite numbers), or None in a log without weights; a log
    that has them on its first line must have them on every line."""
    wkey = next((w for w in WEIGHT_KEYS if w in rec), None)
    if not weighted:
        return None
    weights = rec.get(wkey) if wkey else None
    if not isinstance(weights, list) or len(weights) != k:
        raise RoutingError(f"{where}: field {wkey or WEIGHT_KEYS[0]!r} must be a list of {k} gate weights "
                           "(earlier lines have weights)")
    if any(isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) for w in weights):
        raise RoutingError(f"{where}: field {wkey!r} must hold finite numbers, got {weights}")
    return weights


def _record(line: str, where: str, k: int | None, num_experts: int | None) -> tuple[str, int, str, int, list[int], dict]:
    """One line checked on its own: (request, token, layer key, layer, expert ids, the record)."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as err:
        raise RoutingError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(rec, dict):
        raise RoutingError(f"{where}: a record is a JSON object, got {type(rec).__name__}")
    req = str(_field(rec, "request", where)[1])
    tkey, tok = _field(rec, "token", where)
    lkey, layer = _field(rec, "layer", where)
    ekey, ids = _field(rec, "experts", where)
    if not isinstance(ids, list) or not ids:
        raise RoutingError(f"{where}: field {ekey!r} must be a non-empty list of expert ids, got {ids!r}")
    ids = [_integer(i, where, ekey) for i in ids]
    if k is not None and len(ids) != k:
        raise RoutingError(f"{where}: field {ekey!r} has {len(ids)} experts, earlier lines have {k} (k inconsistent)")
    if len(set(ids)) != len(ids) or min(ids) < 0:
        raise RoutingError(f"{where}: field {ekey!r} must hold {len(ids)} distinct expert ids >= 0, got {ids}")
    if num_experts is not None and max(ids) >= num_experts:
        raise RoutingError(f"{where}: field {ekey!r}: expert id {max(ids)} out of range 0..{num_experts - 1} "
                           f"(--experts {num_experts})")
    if rec.get("phase", "prefill") not in ("prefill", "decode"):
        raise RoutingError(f"{where}: field 'phase' must be \"prefill\" or \"decode\", got {rec['phase']!r}")
    return req, _integer(tok, where, tkey), lkey, _integer(layer, where, lkey), ids, rec


def _from_jsonl(path: Path, num_experts: int | None) -> Routing:
    """Parse and validate a JSONL log (numbered steps: read, check per line, check per token, pack)."""
    tokens: dict[tuple, dict] = {}  # (request, token) -> {"line": first line, "layers": {layer: (ids, weights, line)}}
    order: dict = {}  # request -> first appearance
    k: int | None = None
    weighted: bool | None = None
    top = -1
    # 1. Read and check every line on its own, then against the lines before it.
    for n, line in _lines(path):
        if not line.strip():
            continue
        where = f"{path}:line {n}"
        req, tok, lkey, layer, ids, rec = _record(line, where, k, num_experts)
        k = len(ids)
        top = max(top, max(ids))
        if weighted is None:
            weighted = any(w in rec for w in WEIGHT_KEYS)
        weights = _weights(rec, k, weighted, where)
        decode = rec.get("phase") == "decode"
        entry = tokens.setdefault((req, tok), {"line": n, "layers": {}, "decode": decode})
        if entry["decode"] != decode:
            raise RoutingError(f"{where}: field 'phase': request {req} token {tok} is {rec['phase']} here, not at line {entry['line']}")
        if layer in entry["layers"]:
            raise RoutingError(f"{where}: field {lkey!r}: request {req} token {tok} has layer {layer} twice "
                               f"(first at line {entry['layers'][layer][2]})")
        entry["layers"][layer] = (ids, weights, n)
        order.setdefault(req, len(order))
    if not tokens:
        raise RoutingError(f"{path}: empty file: no routing records (one JSON object per token and layer)")
    # 2. Every token has every layer the file names, and a request's prompt tokens come before its decode tokens.
    layers = sorted({l for t in tokens.values() for l in t["layers"]})
    keys = sorted(tokens, key=lambda rt: (order[rt[0]], rt[1]))
    for i, (req, tok) in enumerate(keys):
        t = tokens[req, tok]
        if len(t["layers"]) != len(layers):
            missing = sorted(set(layers) - set(t["layers"]))
            raise RoutingError(f"{path}:line {t['line']}: field 'layer': request {req} token {tok} lacks layers {missing[:8]} "
                               f"(the file names {len(layers)} layers; layer count inconsistent)")
        if i and keys[i - 1][0] == req and tokens[keys[i - 1]]["decode"] and not t["decode"]:
            raise RoutingError(f"{path}:line {t['line']}: field 'phase': request {req} token {tok} is prefill after "
                               f"decode token {keys[i - 1][1]} (a request's prompt tokens come first)")
    # 3. Pack, requests in order of appearance, tokens by index.
    topk = np.array([[tokens[key]["layers"][l][0] for l in layers] for key in keys], dtype=np.int64)
    weights = np.array([[tokens[key]["layers"][l][1] for l in layers] for key in keys], dtype=np.float32) if weighted else None
    lengths, prompt = np.zeros(len(order), np.int64), np.zeros(len(order), np.int64)
    for req, tok in keys:
        lengths[order[req]] += 1
        prompt[order[req]] += not tokens[req, tok]["decode"]
    experts = num_experts or top + 1
    return Routing(topk, lengths, prompt, experts, f"recorded routing from {path.name} (E={experts}, k={k}, {len(layers)} layers)", weights)


def _from_capture(path: Path, num_experts: int | None) -> Routing:
    """traces/request_loads.py's per-request loads as per-token routing: decode rows are one token each;
    a prompt of P tokens gets its counts dealt so that token j takes the j-th, (P + j)-th, ... pick."""
    # heavy (torch, the capture's tracing code): kept off the JSONL path, which shipped logs take on first use
    from moeless.traces.request_loads import TraceError, load_request_loads

    try:
        requests = load_request_loads(path)
    except TraceError as err:
        raise RoutingError(str(err)) from None
    E = requests[0].prefill.shape[-1]
    if num_experts is not None and num_experts != E:
        raise RoutingError(f"{path}: the capture has {E} experts, --experts says {num_experts}")
    rows, lengths, prompt = [], [], []
    for r in requests:
        P = r.prompt_tokens
        k = int(r.prefill[0].sum()) // max(P, 1)
        picks = [np.repeat(np.arange(E), r.prefill[l]) for l in range(r.prefill.shape[0])]  # [P * k] sorted per layer
        dealt = np.stack([p.reshape(k, P).T for p in picks], axis=1)  # [P, L, k]: token j takes picks j, P + j, ...
        decode = np.array([[np.flatnonzero(row[l]) for l in range(row.shape[0])] for row in r.decode], dtype=np.int64)
        rows.append(np.concatenate([dealt, decode.reshape(-1, *dealt.shape[1:])]))
        lengths.append(P + len(r.decode))
        prompt.append(P)
    topk = np.concatenate(rows)
    return Routing(topk, np.array(lengths), np.array(prompt), E,
                   f"the project's capture {path.name} (prompt tokens' picks dealt from per-request counts)")
