"""The serving side of an expert host: ExpertHostClient (control over gRPC, routed calls over the
local channel, the TCP channel or gRPC) and one-shot control calls."""
