"""Serving's options by name: no torch, so that `moeless serve`'s flags (serving/cli.py) and the app's
config (serving/config.py) read the same tuples without the command line importing the app."""

DEVICES = ("cpu", "cuda")  # where a serving replica runs the non-expert layers (ServeConfig.device)
BATCHING = ("continuous", "static")  # continuous batching, or static batches (the baseline; ServeConfig.batching)
STEP_ADMIT = ("wait", "now")  # the step scaler's newcomers: wait for a widening, or go in at once (ServeConfig.step_admit)
