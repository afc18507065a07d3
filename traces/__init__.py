"""moeless.traces: recorded routing, the workloads the twin replays: a model's per-request loads
(request_loads) and forecasts (request_forecasts), where they come from (sources), the routing
file (routing_file) from logs (routing_import) or a model run (recording), and `moeless trace`."""
