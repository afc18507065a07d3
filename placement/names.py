"""Names the placement layer answers to, without its compiled kernels (numba): the knobs, the operator
and `--help` check and read them here, so that none of them loads the planners to know their names.
planner.py's registry answers to exactly these (tests/placement/test_planner_names.py keeps them equal)."""

DEFAULT_PLANNER = "moeless"  # the knob's default everywhere (controller/knobs.py, `moeless plan`); planner.PLANNERS' first

# Every planner's name: planner.PLANNERS' keys in their order (grouped there), then STATEFUL_PLANNERS'.
PLANNER_NAMES = (
    DEFAULT_PLANNER, "paper", "static", "eplb", "eplb-global", "oracle",
    "moeless-no-scaler", "moeless-no-placer", "moeless-no-scaler-no-placer", "moeless-cold", "moeless-free-memory",
    "moeless-no-moves",
    "moeless-fill", "moeless-fill-no-scaler", "moeless-fill-cold", "moeless-greedy",
    "paper-no-scaler", "paper-no-placer", "paper-no-scaler-no-placer", "moeless-sets", "full-replication",
    "eplb-window", "eplb-production",
)
