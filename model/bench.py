"""The default model's benchmarks: speed (tokens/s) and quality (perplexity, load skew), each
against the dense SmolLM2 measured in the same run."""

from __future__ import annotations

import time
from typing import Callable

import torch

from moeless.benchio import write_result

# Held-out prompts: (count, tokens per prompt, new tokens) for the full run and for --quick.
SPEED_RUN = {False: (8, 128, 32), True: (2, 64, 8)}
QUALITY_RUN = {False: (64, 128), True: (12, 64)}

# forward(ids [1, S], cache) -> (logits [1, S, V], cache)
StepFn = Callable[[torch.Tensor, object], tuple[torch.Tensor, object]]


def timed_greedy(step: StepFn, ids: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """Seconds for the prefill of ids [1, S] and for new_tokens - 1 greedy decode steps after it."""
    start = time.perf_counter()
    logits, cache = step(ids, None)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        logits, cache = step(logits[:, -1:].argmax(-1), cache)
    return prefill, time.perf_counter() - start


def speed_bench(num_experts: int, top_k: int, seed: int, quick: bool, out: str | None) -> dict:
    """Prefill and decode tokens/s, one request at a time, of the dense model and the MoE."""
    from tqdm import tqdm

    from moeless.model.datasets import sharegpt_prompts
    from moeless.model.default import default_model, encode_prompts
    from moeless.model.gguf_source import load_dense

    n, prompt_tokens, new_tokens = SPEED_RUN[quick]
    moe = default_model(num_experts, top_k, seed, progress=True)
    dense, tokenizer = load_dense()
    seqs = encode_prompts(tokenizer, sharegpt_prompts(n, "test", min_chars=400), prompt_tokens)

    def dense_step(ids, cache):
        o = dense(input_ids=ids, past_key_values=cache, use_cache=True)
        return o.logits, o.past_key_values

    def moe_step(ids, cache):
        o = moe.forward(ids, past_key_values=cache, use_cache=True)
        return o.logits, o.past_key_values

    steps = {"dense": dense_step, "moe": moe_step}
    seconds = {name: [0.0, 0.0] for name in steps}  # [prefill, decode]
    with torch.inference_mode():
        for step in steps.values():
            timed_greedy(step, seqs[0][None, :8], 2)  # warm-up
        # Models alternate per prompt, so that load from other processes hits both alike.
        for s in tqdm(seqs, desc="generation (dense, moe)"):
            for name, step in steps.items():
                p, d = timed_greedy(step, s[None], new_tokens)
                seconds[name][0] += p
                seconds[name][1] += d
    result: dict = {"prompts": n, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "num_experts": num_experts, "top_k": top_k}
    for name, (prefill, decode) in seconds.items():
        result[name] = {"prefill_tok_s": sum(len(s) for s in seqs) / prefill, "decode_tok_s": n * (new_tokens - 1) / decode}
    for phase in ("prefill_tok_s", "decode_tok_s"):
        result[f"{phase}_ratio"] = result["moe"][phase] / result["dense"][phase]
    print(f"{'':>8} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for name in ("dense", "moe"):
        print(f"{name:>8} {result[name]['prefill_tok_s']:14.1f} {result[name]['decode_tok_s']:13.1f}")
    print(f"{'moe/dense':>8} {result['prefill_tok_s_ratio']:14.2f} {result['decode_tok_s_ratio']:13.2f}")
    write_result(out, "model", result)
    return result


def quality_bench(num_experts: int, ks: list[int], seed: int, quick: bool, out: str | None) -> dict:
    """Held-out perplexity of the dense model and of the MoE for each k, and per-layer load skew."""
    from moeless.model.datasets import sharegpt_prompts
    from moeless.model.default import default_model, encode_prompts
    from moeless.model.gguf_source import load_dense
    from moeless.model.quality import load_skew, perplexity

    n, prompt_tokens = QUALITY_RUN[quick]
    dense, tokenizer = load_dense()
    seqs = encode_prompts(tokenizer, sharegpt_prompts(n, "test"), prompt_tokens)
    dense_ppl = perplexity(lambda ids, mask: dense(input_ids=ids, attention_mask=mask).logits, seqs)
    del dense
    result: dict = {"prompts": n, "tokens": sum(len(s) for s in seqs), "num_experts": num_experts, "dense_ppl": dense_ppl, "k": {}}
    print(f"dense perplexity {dense_ppl:.3f} on {n} held-out ShareGPT prompts ({result['tokens']} tokens)")
    print(f"{'k':>3} {'ppl':>8} {'ppl/dense':>10} {'skew mean':>10} {'skew max':>9}")
    for k in ks:
        moe = default_model(num_experts, k, seed, progress=True)
        loads = torch.zeros(moe.spec.num_layers, num_experts, dtype=torch.long)

        def logits_of(ids, mask):
            with moe.capture() as cap:
                logits = moe.forward(ids, mask).logits
            loads.add_(cap.loads().sum(dim=0))
            return logits

        ppl = perplexity(logits_of, seqs)
        skew = load_skew(loads)
        result["k"][k] = {"ppl": ppl, "ppl_ratio": ppl / dense_ppl, "layer_skew": skew, "loads": loads}
        print(f"{k:>3} {ppl:8.3f} {ppl / dense_ppl:10.3f} {float(skew.mean()):10.2f} {float(skew.max()):9.2f}")
    for k in ks:
        print(f"k={k} per-layer skew (max/mean tokens per expert):", " ".join(f"{v:.2f}" for v in result["k"][k]["layer_skew"].tolist()))
    write_result(out, "model-quality", result)
    return result
