"""moeless.bench: every `moeless bench X`, each a thin shell over the code it measures; each one
prints its figures against a baseline measured in the same run, --quick, --out DIR."""

# Modules with `register(benches)`, in the order `moeless bench --help` lists them.
BENCH_MODULES = (
    "moeless.bench.model",  # model, model-quality
    "moeless.bench.predictor",
    "moeless.bench.planner",
    "moeless.bench.expert_invoke",
    "moeless.bench.serve",
    "moeless.bench.load",
    "moeless.bench.live",
    "moeless.bench.transport",
)
