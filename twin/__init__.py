"""moeless.twin: the one simulator: serving iterations (real arrivals, batching, forecasts) replayed
through any planner on a modelled cluster, every cost counted; `moeless plan`."""
