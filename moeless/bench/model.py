"""The default model's benchmarks: speed (tokens/s) and quality (perplexity, load skew), each
against the dense SmolLM2 measured in the same run."""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

import torch
from tqdm import tqdm

from moeless.bench import BENCHES
from moeless.bench.common import add_bench_flags, write_result
from moeless.model.batching import left_pad
from moeless.model.cli import _add_model_flags, _config, _usage_error
from moeless.model.datasets import sharegpt_prompts
from moeless.model.gguf_source import load_dense
from moeless.model.shape import DEFAULT_EXPERTS, DEFAULT_SHARED, DEFAULT_TOP_K, SOURCE_FFN

if TYPE_CHECKING:
    from moeless.model.default import BuildConfig

# Held-out prompts: (count, tokens per prompt, new tokens) for the full run and for --quick.
SPEED_RUN = {False: (8, 128, 32), True: (2, 64, 8)}
QUALITY_RUN = {False: (64, 128), True: (12, 64)}
# Decode: a batch of DECODE_BATCH held-out prompts (their first DECODE_PROMPT_TOKENS tokens),
# DECODE_STEPS greedy steps; the demo answer gets DEMO_TOKENS.
DECODE_BATCH, DECODE_PROMPT_TOKENS, DECODE_STEPS, DEMO_TOKENS = 8, 32, {False: 32, True: 8}, 24
CANDIDATE = re.compile(r"e(\d+)-sh(\d+)-k(\d+)")

# forward(ids [1, S], cache) -> (logits [1, S, V], cache)
StepFn = Callable[[torch.Tensor, object], tuple[torch.Tensor, object]]


# The shapes `moeless bench model-quality` compares by default (docs/model.md): the previous
# default (E=8, k=4, no shared expert), then shared experts with finer routed experts.
DEFAULT_CANDIDATES = (
    "e8-sh0-k4", "e8-sh0-k6", "e16-sh384-k8", "e16-sh768-k4", "e16-sh768-k6", "e16-sh768-k8", "e32-sh768-k16", "e16-sh1024-k8",
)


def register(benches: argparse._SubParsersAction) -> None:
    """Add `moeless bench model` and `moeless bench model-quality`."""
    speed = benches.add_parser(
        "model",
        help=BENCHES["model"].help,
        description="Greedy generation on held-out ShareGPT prompts, one request at a time, with the "
        "dense SmolLM2 (baseline) and the default MoE model; prints tokens/s and the MoE/dense ratio.",
    )
    _add_model_flags(speed)
    speed.add_argument("--threads", type=int, default=None, metavar="N",
                       help="torch threads for both models (default: torch's). 1 on a shared machine: under other "
                       "processes' load a thread pool's barrier waits slow the MoE's many small matmuls far more "
                       "than the dense model's few large ones")
    add_bench_flags(speed)
    speed.set_defaults(func=_bench_speed)

    quality = benches.add_parser(
        "model-quality",
        help=BENCHES["model-quality"].help,
        description="For each candidate shape (E routed experts, S shared neurons, k per token): perplexity on "
        "held-out ShareGPT prompts against the dense model's (baseline, same run), per-layer routed-expert load "
        "skew (max/mean tokens per expert), idle routed experts per decode iteration, and the demo answer.",
    )
    quality.add_argument("--candidates", default=None, metavar="LIST",
                         help=f"comma-separated shapes like e16-sh768-k8 (default: {','.join(DEFAULT_CANDIDATES)}; "
                         "--quick: the default model only)")
    quality.add_argument("--seed", type=int, default=0, help="conversion seed (default 0)")
    add_bench_flags(quality)
    quality.set_defaults(func=_bench_quality)


def _bench_speed(args: argparse.Namespace) -> int:
    speed_bench(_config(args), quick=args.quick, out=args.out, threads=args.threads)
    return 0


def _bench_quality(args: argparse.Namespace) -> int:
    default = [f"e{DEFAULT_EXPERTS}-sh{DEFAULT_SHARED}-k{DEFAULT_TOP_K}"] if args.quick else list(DEFAULT_CANDIDATES)
    candidates = default if args.candidates is None else [c for c in args.candidates.split(",") if c.strip()]
    try:
        for c in candidates:
            parse_candidate(c)
    except ValueError as err:
        _usage_error(f"--candidates: {err}")
    if not candidates:
        _usage_error("--candidates: give at least one shape like e16-sh768-k8")
    quality_bench(candidates, args.seed, quick=args.quick, out=args.out)
    return 0


def timed_greedy(step: StepFn, ids: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """Seconds for the prefill of ids [1, S] and for new_tokens - 1 greedy decode steps after it."""
    start = time.perf_counter()
    logits, cache = step(ids, None)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        logits, cache = step(logits[:, -1:].argmax(-1), cache)
    return prefill, time.perf_counter() - start


def speed_bench(cfg: "BuildConfig", quick: bool, out: str | None, threads: int | None = None) -> dict:
    """Prefill and decode tokens/s, one request at a time, of the dense model and the MoE.

    threads: torch threads for both models (None: torch's default).
    """
    # heavy (the torch model code): kept off --help's start-up path
    from moeless.model.default import build, encode_prompts
    from moeless.model.hf_loader import load_moe_model

    n, prompt_tokens, new_tokens = SPEED_RUN[quick]
    if threads is not None:
        torch.set_num_threads(threads)
    moe = load_moe_model(build(cfg, progress=True))
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
    result: dict = {"prompts": n, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "model": candidate_name(cfg),
                    "torch_threads": torch.get_num_threads()}
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


def parse_candidate(text: str) -> BuildConfig:
    """"e16-sh768-k8" -> BuildConfig(num_experts=16, shared_neurons=768, top_k=8); a clear error otherwise."""
    # heavy (the torch model code): kept off --help's start-up path
    from moeless.model.default import BuildConfig

    match = CANDIDATE.fullmatch(text.strip())
    if not match:
        raise ValueError(f"candidate {text!r} is not like e16-sh768-k8 (E routed experts, S shared neurons, k per token)")
    experts, shared, k = (int(g) for g in match.groups())
    return BuildConfig(num_experts=experts, top_k=k, shared_neurons=shared)


def candidate_name(cfg: "BuildConfig") -> str:
    return f"e{cfg.num_experts}-sh{cfg.shared_neurons}-k{cfg.top_k}"


def idle_in_decode(loads: torch.Tensor) -> torch.Tensor:
    """Mean number of routed experts of a layer that get no token, per decode iteration.

    loads: [I, L, E] token counts of I decode iterations -> [L].
    """
    return (loads == 0).double().sum(dim=-1).mean(dim=0)


def demo_answer(moe, tokenizer, question: str, new_tokens: int) -> str:
    """The MoE's greedy answer to one chat turn (the `moeless serve --demo` question)."""
    chat = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = moe.generate(prompt, new_tokens, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True).strip()


def quality_bench(candidates: list[str], seed: int, quick: bool, out: str | None) -> dict:
    """Per candidate model: held-out perplexity against the dense model's (same prompts, same run),
    routed-expert load skew per layer (prefill), idle routed experts per decode iteration (a batch
    of DECODE_BATCH requests), the demo answer and the build time."""
    # heavy (the torch model code; ray, transformers): kept off --help's start-up path
    from moeless.model.default import build, encode_prompts
    from moeless.model.hf_loader import load_moe_model
    from moeless.model.quality import load_skew, perplexity
    from moeless.serving.embedded import DEMO_QUESTION

    configs = [replace(parse_candidate(c), seed=seed) for c in candidates]
    n, prompt_tokens = QUALITY_RUN[quick]
    decode_steps = DECODE_STEPS[quick]
    dense, tokenizer = load_dense()
    seqs = encode_prompts(tokenizer, sharegpt_prompts(n, "test"), prompt_tokens)
    dense_ppl = perplexity(lambda ids, mask: dense(input_ids=ids, attention_mask=mask).logits, seqs)
    dense_answer = demo_answer(_DenseGenerator(dense), tokenizer, DEMO_QUESTION, DEMO_TOKENS)
    del dense
    batch = left_pad([s[:DECODE_PROMPT_TOKENS].tolist() for s in seqs[:DECODE_BATCH]])
    result: dict = {
        "prompts": n, "tokens": sum(len(s) for s in seqs), "seed": seed, "dense_ppl": dense_ppl, "dense_answer": dense_answer,
        "decode_batch": DECODE_BATCH, "decode_steps": decode_steps, "candidates": {},
    }
    print(f"dense perplexity {dense_ppl:.3f} on {n} held-out ShareGPT prompts ({result['tokens']} tokens); demo: {dense_answer!r}")
    for cfg in configs:
        start = time.perf_counter()
        moe = load_moe_model(build(cfg, progress=True))
        build_s = time.perf_counter() - start
        loads = torch.zeros(moe.spec.num_layers, cfg.num_experts, dtype=torch.long)

        def logits_of(ids, mask):
            with moe.capture() as cap:
                logits = moe.forward(ids, mask).logits
            loads.add_(cap.loads().sum(dim=0))
            return logits

        ppl = perplexity(logits_of, seqs)
        with moe.capture() as cap:
            moe.generate(batch[0], decode_steps + 1, attention_mask=batch[1])
        idle = idle_in_decode(cap.loads()[1:])  # iteration 0 is the prefill
        skew = load_skew(loads)
        name = candidate_name(cfg)
        result["candidates"][name] = {
            "num_experts": cfg.num_experts, "shared_neurons": cfg.shared_neurons, "top_k": cfg.top_k,
            "expert_ffn": cfg.expert_ffn, "active_fraction": (cfg.shared_neurons + cfg.top_k * cfg.expert_ffn) / SOURCE_FFN,
            "ppl": ppl, "ppl_ratio": ppl / dense_ppl, "layer_skew": skew, "idle_decode": idle, "loads": loads,
            "answer": demo_answer(moe, tokenizer, DEMO_QUESTION, DEMO_TOKENS), "build_or_load_s": build_s,
        }
        del moe
    print(f"{'candidate':>14} {'active':>7} {'ppl':>8} {'/dense':>7} {'skew mean':>9} {'skew max':>8} {'idle/E decode':>13}  demo answer")
    for name, c in result["candidates"].items():
        active = f"{c['active_fraction']:.0%}"
        idle = f"{float(c['idle_decode'].mean()):.1f}/{c['num_experts']}"
        print(f"{name:>14} {active:>7} {c['ppl']:8.2f} {c['ppl_ratio']:7.2f} {float(c['layer_skew'].mean()):9.2f} "
              f"{float(c['layer_skew'].max()):8.2f} {idle:>13}  {c['answer'][:60]!r}")
    for name, c in result["candidates"].items():
        print(f"{name} per-layer routed skew (max/mean tokens per expert):", " ".join(f"{v:.2f}" for v in c["layer_skew"].tolist()))
    write_result(out, "model-quality", result)
    return result


class _DenseGenerator:
    """The dense transformers model behind demo_answer's greedy-generation call."""

    def __init__(self, hf):
        self.hf = hf

    def generate(self, ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None) -> torch.Tensor:
        return self.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=eos_token_id, pad_token_id=eos_token_id)
