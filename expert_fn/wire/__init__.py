"""What a serving replica and an expert host both speak: the routed call's frame, the gRPC API
(expert_host.proto and its generated modules), tensors on the wire, the NIXL link, CUDA IPC
handles and the busy-poll before a blocking read."""
