"""Names the placement layer answers to, without its compiled kernels (numba): the knobs and `--help` read them."""

DEFAULT_PLANNER = "moeless"  # the knob's default everywhere (controller/knobs.py, `moeless plan`); planner.PLANNERS' first
