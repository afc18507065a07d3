"""Convert FLAME-MoE-290M's recorded routing into the gzipped JSONL logs shipped in traces/logs/.

Why a script: the shipped logs are derived data, and anyone must be able to re-derive them byte
for byte from the original files (traces/logs/PROVENANCE.md says where those come from). Tests do
not run it: it needs a local clone of Akash-N-Pai/DynaNDE-Simulator, which the suite has not.

The source (commit f274466b9095e0b417f701a3ef3a14a6639b6aed, folder "Sample routing traces/"):
- Encoder_Batch_0-32/Layer_L/*encoder_32seqs_2048tokens.pt: {samples [2048] input token ids,
  indices [2048, 6] routed expert ids, scores [2048, 6] router softmax probabilities, sorted
  descending}: the first 2,048 tokens of FLAME-MoE's capture shard 0-0, i.e. 4 consecutive
  512-token windows (the files' "32 seqs x 64" metadata is wrong: token 512 is window 1's first
  token in the Decoder files, checked below);
- Decoder_Batch_0-64/{1st..10th}/Layer_L/*firstTokens_64x512.pt: position p (0..9) of 64 windows;
- only Layer_2..Layer_9 are real (FLAME-MoE-290M's 8 MoE layers); Layer_10..26 are byte-identical
  copies the simulator's authors tiled to emulate a deeper model, and are ignored.

Outputs, one record per (token, MoE layer), layer = the model's own index 2..9 (the importer maps
it to 0..7), phase "prefill" (teacher-forced windows: one forward each, like a prefill):
- flame-moe-290m.jsonl.gz: windows 0-3, 512 tokens each (2,048 tokens);
- flame-moe-290m-heldout.jsonl.gz: windows 4-63, their first 10 tokens each (600 tokens).
Gate weights keep 4 significant digits (the routing file stores float16: 3.3 digits). The gzip
header has no name and mtime 0, so a rerun writes identical bytes.

Run (needs torch to read the .pt files; the project's .venv has it):
    .venv/bin/python scripts/convert_flame_routing.py --repo /path/to/DynaNDE-Simulator
where --repo is a clone (work tree or bare); the files are read with `git show COMMIT:PATH`, so
the clone needs that commit, not a checkout of it.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import subprocess
from pathlib import Path
from typing import Any, Iterator

import torch

COMMIT = "f274466b9095e0b417f701a3ef3a14a6639b6aed"
ROOT = "Sample routing traces"
LAYERS = range(2, 10)  # FLAME-MoE-290M's MoE layers
POSITIONS = ("1st", "2nd", "3rd", "4th", "5th", "6th", "7th", "8th", "9th", "10th")
WINDOW = 512
WINDOWS = 64  # in the Decoder files
OUT = Path(__file__).resolve().parents[1] / "traces" / "logs"


def git_show(repo: Path, path: str) -> bytes:
    """The bytes of `path` at COMMIT in the clone `repo`."""
    return subprocess.run(["git", "-C", str(repo), "show", f"{COMMIT}:{path}"], check=True, capture_output=True).stdout


def load_one(repo: Path, folder: str) -> dict[str, Any]:
    """The one routing .pt file in `folder` (the folders also hold CSV/TXT copies and stats)."""
    names = subprocess.run(["git", "-C", str(repo), "ls-tree", "-r", "--name-only", COMMIT, f"{ROOT}/{folder}/"],
                           check=True, capture_output=True, text=True).stdout.split("\n")
    (path,) = [n for n in names if n.endswith(".pt") and "_stats" not in n]
    return torch.load(io.BytesIO(git_show(repo, path)), map_location="cpu", weights_only=False)


def record(request: str, token: int, layer: int, ids: torch.Tensor, scores: torch.Tensor, vocab: int) -> str:
    """One JSONL line (vocab_id: the input token's id, kept for checks against the upstream; the
    importer ignores it, and it is not named token_id, which the importer reads as the index)."""
    return json.dumps({"req_id": request, "token_idx": token, "layer": layer, "topk_ids": [int(i) for i in ids],
                       "topk_weights": [float(f"{float(w):.4g}") for w in scores], "phase": "prefill",
                       "vocab_id": int(vocab)}, separators=(",", ":"))


def main_lines(encoder: dict[int, dict]) -> Iterator[str]:
    """Windows 0-3, every token, every layer."""
    samples = encoder[LAYERS[0]]["samples"]
    for w in range(len(samples) // WINDOW):
        for t in range(WINDOW):
            g = w * WINDOW + t
            for layer in LAYERS:
                d = encoder[layer]
                yield record(f"flame290m-shard0-0-win{w}", t, layer, d["indices"][g], d["scores"][g], samples[g])


def heldout_lines(decoder: dict[tuple[int, int], dict], first: int) -> Iterator[str]:
    """Windows first..63, positions 0-9, every layer."""
    for w in range(first, WINDOWS):
        for p in range(len(POSITIONS)):
            for layer in LAYERS:
                d = decoder[p, layer]
                yield record(f"flame290m-win{w}-prefix10", p, layer, d["indices"][w], d["scores"][w], d["samples"][w])


def write_gz(path: Path, lines: Iterator[str]) -> int:
    """Write the lines gzipped with a fixed header (no name, mtime 0); returns the line count."""
    n = 0
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz:
        for line in lines:
            gz.write((line + "\n").encode())
            n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description="Convert FLAME-MoE-290M's routing samples (DynaNDE-Simulator) "
                                                 "into traces/logs/*.jsonl.gz")
    parser.add_argument("--repo", type=Path, required=True, help="a clone of Akash-N-Pai/DynaNDE-Simulator holding "
                                                                 f"commit {COMMIT[:12]} (work tree or bare)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"output folder (default {OUT})")
    args = parser.parse_args()
    encoder = {layer: load_one(args.repo, f"Encoder_Batch_0-32/Layer_{layer}") for layer in LAYERS}
    for layer, d in encoder.items():
        assert d["layer"] == layer and d["model"] == "flame-moe-290m" and d["indices"].shape == (2048, 6), layer
        assert torch.equal(d["samples"], encoder[LAYERS[0]]["samples"]), f"token ids differ at layer {layer}"
    decoder = {(p, layer): load_one(args.repo, f"Decoder_Batch_0-64/{name}/Layer_{layer}")
               for p, name in enumerate(POSITIONS) for layer in LAYERS}
    windows = len(encoder[LAYERS[0]]["samples"]) // WINDOW
    for (p, layer), d in decoder.items():  # the Decoder files' windows 0-3 are the Encoder file's
        assert d["layer"] == layer and d["token_position"] == p and d["indices"].shape == (WINDOWS, 6), (p, layer)
        for w in range(windows):
            assert int(d["samples"][w]) == int(encoder[layer]["samples"][w * WINDOW + p]), (p, layer, w)
            assert torch.equal(d["indices"][w], encoder[layer]["indices"][w * WINDOW + p]), (p, layer, w)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, lines in (("flame-moe-290m.jsonl.gz", main_lines(encoder)),
                        ("flame-moe-290m-heldout.jsonl.gz", heldout_lines(decoder, windows))):
        n = write_gz(args.out / name, lines)
        print(f"wrote {args.out / name}: {n} records, {(args.out / name).stat().st_size} bytes")


if __name__ == "__main__":
    main()
