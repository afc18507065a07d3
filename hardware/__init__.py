"""moeless.hardware: what the hardware costs, measured: the cost profile on this machine's CPU
(cpu_profile), on a GPU (cuda_profile) and on a running expert host (host_profile: the one fitter
of a host's per-call cost), this CPU's peaks (cpu_peaks) and the GPUs' datasheets (gpus)."""
