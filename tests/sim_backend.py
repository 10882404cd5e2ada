"""The simulated device for the GPU tests: hip_kernels/ built by the host C++ compiler and run as
fibers on the CPU (fomoepy/runtime/sim/). One backend per device per test process, since building
and loading the modules takes a few seconds; tests that need a fresh or differently configured
simulator make their own."""

from __future__ import annotations

from functools import cache

from fomoepy.runtime.gpu import GpuBackend


@cache
def sim_backend(device: int = 0) -> GpuBackend:
    return GpuBackend("sim", device)
