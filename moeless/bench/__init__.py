"""moeless.bench: every `moeless bench X`, each a thin shell over the code it measures; each one
prints its figures against a baseline measured in the same run, --quick, --out DIR.

The benches import torch and the rest at their top, so `moeless bench --help` lists them from
this table alone, and `moeless bench X` imports X's module only (moeless/cli.py)."""

from __future__ import annotations

from typing import NamedTuple


class Bench(NamedTuple):
    module: str  # has `register(benches)`, which adds this bench (and any other it names here)
    help: str  # the line `moeless bench --help` shows


# In the order `moeless bench --help` lists them.
BENCHES = {
    "model": Bench("moeless.bench.model", "prefill and decode tokens/s of the MoE model against the dense model"),
    "model-quality": Bench("moeless.bench.model", "held-out perplexity of candidate MoE shapes against the dense "
                                                  "model, load skew, idle experts"),
    "predictor": Bench("moeless.bench.predictor", "every predictor's accuracy against distance d = 1..5, memory and "
                                                  "latency"),
    "planner": Bench("moeless.bench.planner", "plan quality with every cost counted (cold starts after prefetch, "
                                              "keep-alive, GB·s, real forecasts) and planning time: moeless vs static "
                                              "EP, EPLB, the paper, Oracle"),
    "expert-invoke": Bench("moeless.bench.expert_invoke", "gRPC invoke round trip and per-token time vs the same "
                                                          "experts in-process"),
    "serve": Bench("moeless.bench.serve", "tokens/s and MoE-layer time through expert functions vs in-process "
                                          "experts; alpha and beta"),
    "load": Bench("moeless.bench.load", "static vs continuous batching: N concurrent clients on ShareGPT prompts over "
                                        "HTTP (loopback)"),
    "finetunes": Bench("moeless.bench.finetunes", "a base and its fine-tunes on the same expert hosts (each expert "
                                                  "held once) vs the base alone: memory, per-model GB·s, throughput, "
                                                  "exactness, in one engine and in one per model"),
    "step-scaler": Bench("moeless.bench.step_scaler", "the step scaler's lag on a real pool: how long a burst's "
                                                      "newcomers wait for the placement to widen onto spare hosts, "
                                                      "against a whole model's expert load"),
    "peer-copy": Bench("moeless.bench.peer_copy", "an expert loaded on a fresh host from a peer host holding it vs from "
                                                  "its own weight store and host tier"),
    "live": Bench("moeless.bench.live", "the running system with its planning loop vs static EP and EPLB: replayed "
                                        "trace arrivals over HTTP"),
    "transport": Bench("moeless.bench.transport", "one expert call over shared memory, the TCP channel, gRPC and "
                                                  "(--ray) Ray compiled graphs, side by side, against the same call "
                                                  "in-process"),
}
