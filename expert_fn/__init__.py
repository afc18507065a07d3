"""moeless.expert_fn: the expert function runtime: one expert host per GPU holding replicas of
(layer, expert) FFNs, loaded from the weight store, kept warm or evicted, called over shared
memory, TCP (NIXL moving the rows where installed) or gRPC.

One folder per job:
- wire/: what both sides speak: the routed call and its frame (routed), the gRPC API
  (expert_host.proto, generated expert_host_pb2*.py; regenerate: `python -m
  moeless.expert_fn.wire.gen_proto`), tensors on the wire (codec), the NIXL link, CUDA IPC
  handles, busy-polling.
- client/: what the serving path calls: ExpertHostClient (load / evict / status over gRPC,
  routed calls over the local channel, the TCP channel or gRPC) and one-shot control calls.
- host/: one host process (main, also `moeless expert-host`; `python -m moeless.expert_fn.host`):
  the gRPC servicer, the TCP and local-channel servers, the runtime (replica table: lifecycle,
  shares, meters; compute: executor, run_routed) and its /metrics, /healthz, /readyz.
- stores/: where a host's weights come from: tiers (disk -> host memory -> device) and several
  models' weight stores in one layer space.
Beside them: errors (shared by host and client), options (flag names, no torch), launcher (real
host processes on loopback for tests, benches and the embedded default), cli.
"""
