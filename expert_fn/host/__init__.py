"""One expert host: the process (main, `python -m moeless.expert_fn.host`), its runtime (replica
table, meters, compute) and the servers of each transport (gRPC, TCP, the local channel)."""
