"""Backend selection by name: `--backend cpu|reference|cuda|hip|sim|auto` (auto = a GPU if one works,
else the CPU). `cpu` is ggml on the quantized bytes; `reference` is the exact numpy engine; `sim` is the
simulated device, which runs hip_kernels/ on the CPU for debugging and CI (auto never picks it)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from fomoepy.errors import FomoeError
from fomoepy.runtime.names import BACKEND_NAMES

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


def open_backends(options, spec) -> list:
    """One ops object per device of `options` (fomoepy.options.EngineOptions): its backend, on
    `threads` CPU threads (default: cpu_threads)."""
    threads = cpu_threads(spec, options.threads)
    # no -t given: a decode row's products on 1 or all of those threads, as each measures faster (row_threads)
    tune = options.threads is None
    return [make_backend(options.backend, threads, d, tune) for d in range(options.devices)]


def cpu_threads(spec, requested: int | None, runnable=None) -> int:
    """One thread for small models (thread hand-offs cost more than they save on small matrices),
    the cores other processes leave free for larger ones. On the 2-core bench machine, idle, two
    threads decode the mid-size model at 22.9 tok/s and one at 15.3; but with another process busy on
    one core two threads fall to 5 tok/s (threads that lose their core while the others wait for them)
    where one keeps 16.4; beside other work (load 6), even with ggml's OpenMP threads sleeping while
    they wait, 2 threads decoded at 40-50 tok/s where 1 kept 62-67 (fomoepy.runtime.ggml_threads).
    So the default leaves out the cores found busy when the engine starts (and a decode row's products
    then use 1 or all of them as measured: row_threads); `-t` overrides it."""
    if requested is not None:
        if requested < 1:
            raise FomoeError(f"--threads must be >= 1, got {requested}")
        return requested
    if spec.n_embd * spec.moe.expert_ff < 1 << 19:
        return 1
    return max(1, free_cores(runnable))


def busy_cores(runnable, samples: int = 5, interval_s: float = 0.01) -> int:
    """Cores other processes keep busy: the fewest runnable threads seen over a few samples, less this
    one (a core busy only for an instant is not counted; one busy throughout is)."""
    fewest = None
    for i in range(samples):
        if i:
            time.sleep(interval_s)
        n = runnable()
        fewest = n if fewest is None else min(fewest, n)
    return max(0, (fewest or 1) - 1)


def _runnable(proc: str = "/proc") -> int:
    """Runnable threads of other processes now, plus this one (/proc/loadavg: "1.0 0.9 0.8 R/T pid",
    less this process's own runnable threads: numpy's BLAS threads spin a while after a product, and they
    are not another process's load); 1 (none but this) where the files are not there."""
    try:
        with open(f"{proc}/loadavg") as f:
            everyone = int(f.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return 1
    return max(1, everyone - _own_runnable(proc) + 1)


def _own_runnable(proc: str) -> int:
    """This process's threads the kernel counts as running (state R in /proc/self/task/*/stat)."""
    n = 0
    for task in Path(f"{proc}/self/task").glob("*/stat"):
        try:
            stat = task.read_text()
        except OSError:  # the thread ended while it was looked at
            continue
        n += stat[stat.rindex(")") + 2 : stat.rindex(")") + 3] == "R"  # the state follows the name in parentheses
    return n


def make_backend(name: str, threads: int | None = None, device: int = 0, tune_rows: bool = False):
    """The ops object for a --backend value (threads: ggml's or BLAS's if it is the CPU; device: which
    GPU, for placements over several)."""
    if name not in BACKEND_NAMES:
        raise FomoeError(f"backend {name!r} is not available (available: {', '.join(BACKEND_NAMES)})")
    if name == "reference":
        from fomoepy.runtime.cpu import CpuBackend

        return CpuBackend(threads)
    if name == "cpu":
        return _ggml_backend(threads, tune_rows)
    if name == "auto":
        try:
            return open_gpu("auto", device)
        except FomoeError as e:
            log.warning("backend auto: using the CPU (%s)", e)
            return _ggml_backend(threads, tune_rows)
    return open_gpu(name, device)


def _ggml_backend(threads: int | None, tune_rows: bool):
    """The cpu backend, its OpenMP threads told first whether to spin (fomoepy.runtime.ggml_threads).
    tune_rows is the engine's "no -t": its thread count is then the free cores just sampled
    (cpu_threads), at most, and they are not sampled again."""
    from fomoepy.runtime import ggml_threads

    ggml_threads.choose(threads or 1, (lambda: threads or 1) if tune_rows else free_cores)
    from fomoepy.runtime.ggml_cpu import GgmlBackend

    return GgmlBackend(threads, tune_rows)


def free_cores(runnable=None) -> int:
    """The cores other processes leave free now (busy_cores)."""
    return (os.cpu_count() or 1) - busy_cores(runnable or _runnable)


def make_expert_device(ops, layers, routers=None, devices=None, device_of_layer=None, keep_raw: bool = False,
                       slots: tuple[int, int, int, bool, bool] = (0, 0, 1, False, False)):  # fmt: skip
    """The routed-expert device that matches `ops` (fomoepy.experts.device.ExpertDevice): GgmlExperts,
    CpuExperts or GpuExperts; on GPUs, `devices` and `device_of_layer` place each layer's expert slots
    with the layer. keep_raw: the reference backend's compute-ready experts keep their store bytes, so a
    demoting policy can move them down. slots: the cpu backend's (experts per layer, tier bytes, staging
    slots, whether they are repacked: --repack-experts, whether fomoepy's batched kernel computes its
    decode steps: --expert-kernel), which make its slot tensors."""
    if ops.experts_kind == "ggml":
        from fomoepy.runtime.ggml_experts import GgmlExperts

        n_expert, tier_bytes, n_staging, repack, kernel = slots
        return GgmlExperts(layers, ops, routers, n_expert, tier_bytes, n_staging, repack, kernel)
    if ops.experts_kind == "gpu":
        from fomoepy.runtime.gpu_experts import GpuExperts

        return GpuExperts(layers, devices or [ops], routers, device_of_layer)
    from fomoepy.runtime.cpu_experts import CpuExperts

    return CpuExperts(layers, routers, keep_raw)
