"""What a bfloat16 weight store costs the default model's outputs: its experts rounded to bfloat16,
served by two local expert hosts with --compute-dtype store (static EP), against the unmodified
float32 model in-process. Prints, per prompt, the largest logit difference (beside the largest
logit) and whether 16 greedy tokens are the same, with both texts.

    .venv/bin/python scripts/store_dtype_check.py

Why `hosts.computeDtype: store` is off by default (docs/serving.md, "On a GPU").
"""

from __future__ import annotations

import tempfile

import torch

from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.model.default import default_model
from moeless.model.weight_store import export_experts
from moeless.placement.types import Placement
from moeless.serving.executor import RemoteExecutor
from moeless.serving.placement_source import PlacementSource

PROMPTS = ("The quick brown fox jumps over the lazy dog. " * 3, "What is the capital of France?", "def fib(n):")
NEW_TOKENS = 16


def main() -> None:
    torch.set_num_threads(1)
    model = default_model()
    spec = model.spec
    with tempfile.TemporaryDirectory() as root:
        narrow = ((layer, expert, {n: t.to(torch.bfloat16) for n, t in weights.items()})
                  for layer, expert, weights in model.iter_experts())
        export_experts(narrow, root, model="default-bfloat16", num_layers=spec.num_layers,
                       num_experts=spec.num_experts, act=spec.act)
        with launch_local_hosts(2, root, metrics=False, compute_dtype="store") as group:
            executor = RemoteExecutor([ExpertHostClient(a) for a in group.addresses],
                                      PlacementSource(Placement.static(spec.num_layers, spec.num_experts, 2)))
            for prompt in PROMPTS:
                ids = torch.tensor([model.tokenizer.encode(prompt)])
                ref, got = model.forward(ids).logits, model.forward(ids, executor=executor).logits
                want, have = model.generate(ids, NEW_TOKENS), model.generate(ids, NEW_TOKENS, executor=executor)
                print(f"{prompt[:24]!r}: max |logit difference| {(ref - got).abs().max().item():.3g} "
                      f"(largest logit {ref.abs().max().item():.3g}); same {NEW_TOKENS} greedy tokens: "
                      f"{torch.equal(want, have)}")
                for label, out in (("float32", want), ("bfloat16 experts", have)):
                    print(f"   {label}: {model.tokenizer.decode(out[0, ids.shape[1]:])!r}")
            executor.close()


if __name__ == "__main__":
    main()
