"""Where `moeless bench planner` gets real per-request routing loads (moeless.model.traces).

'default': the default model on ShareGPT test prompts, traced once and cached as .npz under the
moeless cache; 'tiny': a tiny random moeless-sliced model on random token ids (wiring only, no
tokenizer); anything else: a .npz file written by moeless.model.traces.save_request_loads.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def request_loads_from(source: str, requests: int, new_tokens: int) -> tuple[list, str]:
    """(list of RequestLoads, a line saying where they came from)."""
    from moeless.model.traces import load_request_loads, request_loads, save_request_loads
    from moeless.paths import cache_dir

    if requests <= 0 or new_tokens < 0:
        raise ValueError(f"need requests > 0 and new_tokens >= 0, got {requests}, {new_tokens}")
    if source == "tiny":
        from moeless.model.tiny import tiny_model

        rng = np.random.default_rng(0)
        model = tiny_model("moeless-sliced")
        vocab = model.spec.vocab_size
        prompts = [rng.integers(0, vocab, size=int(rng.integers(8, 64))).tolist() for _ in range(requests)]
        loads = request_loads(model, prompts, new_tokens, progress=True)
        return loads, f"tiny random moeless-sliced model, {requests} random-token prompts (wiring check, not real loads)"
    if source == "default":
        from moeless.model.datasets import sharegpt_prompts
        from moeless.model.default import BuildConfig, default_model, model_path

        # Keyed by the default model's own cache name (E, k, seed, code version): loads of another build never leak in.
        cached = cache_dir() / f"planner-loads-{model_path(BuildConfig()).name}-n{requests}-t{new_tokens}.npz"
        if not cached.is_file():

            loads = request_loads(default_model(), sharegpt_prompts(requests, split="test"), new_tokens, progress=True)
            save_request_loads(cached, loads)
        return load_request_loads(cached), f"default model on {requests} ShareGPT test prompts, {new_tokens} decode tokens ({cached})"
    path = Path(source)
    return load_request_loads(path), f"routing trace {path}"
