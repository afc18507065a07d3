"""`moeless model finetune`: make a fine-tune of a base, measure it, write its artefact.

One call: the task's training blocks (model/finetune_data.py); ESFT (score and select the
experts on the base's routing, train them: model/esft.py) or LoRA (train a peft adapter:
model/lora.py); held-out perplexity of base and fine-tune on every task's test split and on the
generic set, so a fine-tune shows both what it gained and what it cost elsewhere; the artefact
(model/finetune.py) with those figures in finetune.json.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from moeless.model.esft import TrainConfig, expert_scores, select_experts, train_experts
from moeless.model.finetune import base_record, save_esft
from moeless.model.finetune_data import held_out, train_blocks
from moeless.model.quality import perplexity

if TYPE_CHECKING:
    from moeless.model.moe_model import MoEModel

SCORE_TOKENS = 4096  # ESFT's n_sample_tokens (8,192 for 64 experts): 2,000 choices per expert of 16 at k = 8
DEFAULT_LR = {"esft": 1e-3, "lora": 2e-3}  # AdamW, for the default step count (docs/model.md, "Fine-tunes")


@dataclass(frozen=True)
class FinetuneSpec:
    """What to make. lora None: ESFT with `share` of each layer's experts chosen by `score`
    ("token" or "gate"), optionally ESFT's cumulative `threshold`; else a LoRA of `rank` on
    `lora` ("attention", "experts" or "both"). block: tokens per training row."""

    name: str
    task: str
    share: float = 0.125
    score: str = "token"
    threshold: float | None = None
    lora: str | None = None
    rank: int = 8
    block: int = 128
    train: TrainConfig = field(default_factory=TrainConfig)


def held_out_perplexity(model: "MoEModel", sets: dict[str, list]) -> dict[str, float]:
    """{set name: perplexity} through MoEModel.forward (the serving path's computation)."""
    return {name: round(perplexity(lambda ids, mask: model.forward(ids, mask).logits, seqs), 3)
            for name, seqs in sets.items()}


def make_finetune(base: "MoEModel", base_name: str, spec: FinetuneSpec, out: str | Path, base_path: str | Path | None = None,
                  progress: bool = False, log: Callable[[str], None] = print) -> dict:
    """Make, measure and write the fine-tune `spec` of base into directory `out`; returns its
    finetune.json contents. base_name / base_path: how its artefact names the base."""
    if base.tokenizer is None:
        raise ValueError(f"base {base_name} has no tokenizer; fine-tunes need one for their task's text")
    start, cpu = time.perf_counter(), time.process_time()
    blocks = train_blocks(spec.task, base.tokenizer, spec.block)
    log(f"task {spec.task}: {len(blocks)} training blocks of {spec.block} tokens")
    manifest = {"name": spec.name, "base": base_record(base, base_name, base_path),
                "task": {"data": spec.task, "train_blocks": len(blocks), "block": spec.block},
                "training": asdict(spec.train)}
    if spec.lora is None:
        scores = expert_scores(base, blocks[: max(1, SCORE_TOKENS // spec.block)], spec.score)
        selected = select_experts(scores, spec.share, spec.threshold)
        replaced = [(layer, e) for layer, experts in enumerate(selected) for e in experts]
        log(f"ESFT-{spec.score}: {len(replaced)} of {scores.numel()} experts selected "
            f"(share {spec.share}, threshold {spec.threshold}); layer 0: {selected[0]}")
        tuned, stats = train_experts(base, selected, blocks, spec.train, progress=progress)
        manifest["selection"] = {"score": spec.score, "share": spec.share, "threshold": spec.threshold,
                                 "score_tokens": int(min(len(blocks), SCORE_TOKENS // spec.block) * spec.block),
                                 "scores": [[round(s, 5) for s in row] for row in scores.tolist()]}
    else:
        from moeless.model.lora import merged_model, train_lora  # peft: only for LoRA fine-tunes

        peft_model, stats = train_lora(base, spec.lora, spec.rank, blocks, spec.train, progress=progress)
        tuned = merged_model(peft_model, base.tokenizer)
        manifest["lora"] = {"targets": spec.lora, "rank": spec.rank, "parameters": stats.pop("parameters")}
    manifest["training"].update(stats)
    log(f"trained in {stats['seconds']} s ({stats['cpu_seconds']} s CPU): "
        f"mean loss of the first / last quarter of the steps {stats['loss_start']:.3f} -> {stats['loss_end']:.3f}")
    sets = held_out(base.tokenizer, spec.block)
    before, after = held_out_perplexity(base, sets), held_out_perplexity(tuned, sets)
    manifest["perplexity"] = {name: {"base": before[name], "finetune": after[name], "tokens": sum(len(s) for s in seqs)}
                              for name, seqs in sets.items()}
    manifest["seconds"] = round(time.perf_counter() - start, 1)
    manifest["cpu_seconds"] = round(time.process_time() - cpu, 1)  # the wall time counts other processes' load too
    if spec.lora is None:
        save_esft(out, tuned, replaced, manifest)
    else:
        from moeless.model.lora import save_lora

        save_lora(out, peft_model, manifest)
    return manifest


def report(manifest: dict) -> str:
    """The perplexity table of a made fine-tune, for the terminal."""
    lines = [f"{'held-out perplexity':<22} {'base':>9} {manifest['name']:>9} {'change':>8}"]
    for name, row in manifest["perplexity"].items():
        lines.append(f"{name:<22} {row['base']:>9.3f} {row['finetune']:>9.3f} {row['finetune'] / row['base'] - 1:>+8.1%}")
    return "\n".join(lines)
