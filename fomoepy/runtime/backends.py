"""Backend selection by name: `--backend cpu|reference|cuda|hip|sim|auto` (auto = a GPU if one works,
else the CPU). `cpu` is ggml on the quantized bytes; `reference` is the exact numpy engine; `sim` is the
simulated device, which runs hip_kernels/ on the CPU for debugging and CI (auto never picks it)."""

from __future__ import annotations

import logging

from fomoepy.errors import FomoeError

BACKEND_NAMES = ("cpu", "reference", "cuda", "hip", "sim", "auto")
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
        except Exception as e:  # whatever fails while opening a device: auto falls back, an explicit vendor says why
            reasons.append(f"{v}: {e}")
    raise FomoeError("no GPU backend could start: " + "; ".join(reasons))


def make_backend(name: str, cpu_threads: int | None = None, device: int = 0):
    """The ops object for a --backend value (cpu_threads: BLAS threads if it is the CPU; device: which
    GPU, for placements over several)."""
    if name not in BACKEND_NAMES:
        raise FomoeError(f"backend {name!r} is not available (available: {', '.join(BACKEND_NAMES)})")
    if name == "reference":
        from fomoepy.runtime.cpu import CpuBackend

        return CpuBackend(cpu_threads)
    if name == "cpu":
        from fomoepy.runtime.ggml_cpu import GgmlBackend

        return GgmlBackend(cpu_threads)
    if name == "auto":
        try:
            return open_gpu("auto", device)
        except FomoeError as e:
            log.warning("backend auto: using the CPU (%s)", e)
            from fomoepy.runtime.ggml_cpu import GgmlBackend

            return GgmlBackend(cpu_threads)
    return open_gpu(name, device)


def make_experts(ops, streamer, routers=None, devices=None, device_of_layer=None, timer=None):
    """The routed-expert executor that matches `ops` (GgmlExperts, CpuExperts or GpuExperts); on GPUs,
    `devices` and `device_of_layer` place each layer's expert slots with the layer. `timer` (host time
    per phase, --profile-timing) is kept by the CPU executors; the GPU one records none yet."""
    from fomoepy.runtime.ggml_cpu import GgmlBackend
    from fomoepy.runtime.gpu import GpuBackend

    if isinstance(ops, GgmlBackend):
        from fomoepy.runtime.ggml_experts import GgmlExperts

        return GgmlExperts(streamer, ops, routers, timer)
    if isinstance(ops, GpuBackend):
        from fomoepy.runtime.gpu_experts import GpuExperts

        return GpuExperts(streamer, devices or [ops], routers, device_of_layer)
    from fomoepy.runtime.cpu_experts import CpuExperts

    return CpuExperts(streamer, routers, timer)


def device_expert_nbytes(ops, layout, demotes: bool = False) -> int:
    """Bytes of one expert in the device tier of `ops` (reference: compute-ready float32, plus the store
    bytes with a demoting policy; GPU: a slot of store bytes; ggml CPU: store bytes, though that backend
    has no device tier)."""
    from fomoepy.runtime.ggml_cpu import GgmlBackend
    from fomoepy.runtime.gpu import GpuBackend

    if isinstance(ops, GgmlBackend):
        from fomoepy.runtime.ggml_experts import store_expert_nbytes

        return store_expert_nbytes(layout)
    if isinstance(ops, GpuBackend):
        from fomoepy.runtime.gpu_experts import gpu_expert_nbytes

        return gpu_expert_nbytes(layout)
    from fomoepy.runtime.cpu_experts import ready_expert_nbytes

    return ready_expert_nbytes(layout, demotes)
