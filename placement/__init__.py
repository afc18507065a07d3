"""moeless.placement: where a plan is made: the one planner interface and its registry (planner.py),
the scaler, the placers and their compiled kernels, the cost profile and latency model. Pure."""
