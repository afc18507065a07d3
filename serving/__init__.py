"""moeless.serving: the data plane and the Ray Serve app: HTTP API, continuous batching, the
non-expert layers, scatter/gather of each MoE layer to the expert hosts, the embedded `moeless serve`."""
