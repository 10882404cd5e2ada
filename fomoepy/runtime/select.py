"""Backend selection by name: `--backend cpu|cuda|hip|auto` (auto = a GPU if one works, else the CPU)."""

from __future__ import annotations

import logging

from fomoepy.errors import FomoeError

BACKEND_NAMES = ("cpu", "cuda", "hip", "auto")
log = logging.getLogger(__name__)


def open_gpu(vendor: str = "auto", device: int = 0):
    """A GpuBackend on `vendor`, or with "auto" the first of CUDA, HIP that works; one FomoeError
    naming every reason otherwise."""
    from fomoepy.runtime.gpu import GpuBackend

    vendors = ("cuda", "hip") if vendor == "auto" else (vendor,)
    reasons = []
    for v in vendors:
        try:
            return GpuBackend(v, device)
        except FomoeError as e:
            reasons.append(f"{v}: {e}")
    raise FomoeError("no GPU backend could start: " + "; ".join(reasons))


def make_backend(name: str, cpu_threads: int | None = None):
    """The ops object for a --backend value (cpu_threads: BLAS threads if it is the CPU)."""
    if name not in BACKEND_NAMES:
        raise FomoeError(f"backend {name!r} is not available (available: {', '.join(BACKEND_NAMES)})")
    if name == "cpu":
        from fomoepy.runtime.cpu import CpuBackend

        return CpuBackend(cpu_threads)
    if name == "auto":
        try:
            return open_gpu("auto")
        except FomoeError as e:
            log.info("backend auto: using the CPU (%s)", e)
            from fomoepy.runtime.cpu import CpuBackend

            return CpuBackend(cpu_threads)
    return open_gpu(name)


def make_experts(ops, streamer, routers=None):
    """The routed-expert executor that matches `ops` (CpuExperts or GpuExperts)."""
    from fomoepy.runtime.gpu import GpuBackend

    if isinstance(ops, GpuBackend):
        from fomoepy.runtime.gpu_experts import GpuExperts

        return GpuExperts(streamer, ops, routers)
    from fomoepy.runtime.cpu_experts import CpuExperts

    return CpuExperts(streamer, routers)


def device_expert_nbytes(ops, layout) -> int:
    """Bytes of one expert in the device tier of `ops` (CPU: compute-ready float32; GPU: a slot of store bytes)."""
    from fomoepy.runtime.gpu import GpuBackend

    if isinstance(ops, GpuBackend):
        from fomoepy.runtime.gpu_experts import gpu_expert_nbytes

        return gpu_expert_nbytes(layout)
    from fomoepy.runtime.cpu_experts import ready_expert_nbytes

    return ready_expert_nbytes(layout)
