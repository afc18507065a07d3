"""moeless.expert_fn: the expert function runtime: one expert host per GPU holding replicas of
(layer, expert) FFNs, loaded from the weight store, kept warm or evicted, called over gRPC or shared memory.

What the serving path uses:
- client.ExpertHostClient: load / evict / invoke (one RPC per host per layer) / status / health.
- launcher.launch_local_hosts: real host processes on loopback (kill, restart, graceful close).
- errors: ExpertHostUnavailable (re-route), ReplicaLoadError (names the file), ...

Inside a host: host (process main, also `moeless expert-host`), servicer (gRPC <-> runtime),
runtime (thread-safe engine), lifecycle (replica states, pure, on a clock), meters (GB·s and
counters), metrics + http_endpoints (/metrics, /healthz, /readyz), executor (expert compute),
gpu (NVML or configuration), codec (raw float32 tensors). expert_host.proto defines the API;
expert_host_pb2*.py are generated and committed (regenerate: `python -m moeless.expert_fn.gen_proto`).
"""
