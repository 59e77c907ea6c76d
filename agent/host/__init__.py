"""The host itself: GPUs through NVML, the local control socket."""
