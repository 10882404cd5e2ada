"""The ggml CPU device's buffer types, reached through the backend registry.

- `repacking_buffer_type()`: the CPU device's "extra" buffer type (llama.cpp's weights use it unless
  --no-repack). A weight set into a buffer of it is rearranged for the CPU's interleaved GEMM/GEMV
  kernels (Q4_K as 8×8 blocks on AVX2, …); a product reading it runs those kernels. ggml-python wraps
  the registry calls but not `ggml_backend_dev_get_extra_bufts`, which the device hands out by name
  (`ggml_backend_reg_get_proc_address`): it is called through ctypes.
- `repacks(qtype, n_cols, n_rows)`: llama.cpp's own test of whether the CPU has repacked kernels for a
  weight: a product reading it from a buffer of that type is one the device supports. Types without
  (Q6_K on AVX2, F32, …) must stay in a plain CPU buffer: the repacking buffer would fail to set them.

No thread pool here: ggml-python's ggml is built with OpenMP, whose team stays up between graphs, and
there `ggml_threadpool_new` starts no threads (fomoepy.runtime.ggml_threads).

ggml-python 0.0.45 declares some of these functions' pointer results with a Python NewType, which
ctypes reads as a C int (a buffer type's address comes back cut to 32 bits); every call here goes
through the prototypes in `_C`, declared from ggml's headers against the libraries ggml-python loaded.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from pathlib import Path

import fomoepy.runtime.ggml_threads  # noqa: F401  (before ggml: OpenMP's wait policy)

# isort: split
import ggml

from fomoepy.errors import FomoeError

_EXTRA_BUFTS = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)  # NULL-terminated array
_P, _SIZE = ctypes.c_void_p, ctypes.c_size_t


class _C:
    """The registry and buffer functions, prototyped from ggml-backend.h / ggml-cpu.h."""

    _lib_dir = Path(ggml.__file__).parent / "lib"
    _base = ctypes.CDLL(str(_lib_dir / "libggml-base.so"))  # already loaded by ggml-python: the same handle
    _cpu = ctypes.CDLL(str(_lib_dir / "libggml-cpu.so"))

    @staticmethod
    def _fn(lib, name, restype, *argtypes):
        f = getattr(lib, name)
        f.restype, f.argtypes = restype, list(argtypes)
        return f

    cpu_reg = _fn(_cpu, "ggml_backend_cpu_reg", _P)
    cpu_buffer_type = _fn(_cpu, "ggml_backend_cpu_buffer_type", _P)
    reg_dev_count = _fn(_base, "ggml_backend_reg_dev_count", _SIZE, _P)
    reg_dev_get = _fn(_base, "ggml_backend_reg_dev_get", _P, _P, _SIZE)
    reg_get_proc_address = _fn(_base, "ggml_backend_reg_get_proc_address", _P, _P, ctypes.c_char_p)
    buft_name = _fn(_base, "ggml_backend_buft_name", ctypes.c_char_p, _P)
    alloc_ctx_tensors_from_buft = _fn(_base, "ggml_backend_alloc_ctx_tensors_from_buft", _P, _P, _P)
    buffer_free = _fn(_base, "ggml_backend_buffer_free", None, _P)
    buffer_get_type = _fn(_base, "ggml_backend_buffer_get_type", _P, _P)
    buffer_get_base = _fn(_base, "ggml_backend_buffer_get_base", _P, _P)
    buffer_get_size = _fn(_base, "ggml_backend_buffer_get_size", _SIZE, _P)
    dev_supports_op = _fn(_base, "ggml_backend_dev_supports_op", ctypes.c_bool, _P, _P)
    tensor_set = _fn(_base, "ggml_backend_tensor_set", None, _P, _P, _SIZE, _SIZE)
    version = _fn(_base, "ggml_version", ctypes.c_char_p)


def library_version() -> str:
    """The ggml library's own version (ggml-python's 0.15.3, or llama.cpp's under its bindings:
    tools/build_ggml.sh): benchmarks name the one they ran on."""
    return _C.version().decode()


@functools.cache
def quiet_debug_log() -> None:
    """ggml's log less its debug messages (the repacking buffer reports every tensor it repacks: a
    model's worth of slots is thousands of lines); ggml's default log writes every level to stderr."""
    last = [0]

    @ggml.ggml_log_callback
    def log(level, text, _user):
        if level == ggml.GGML_LOG_LEVEL_CONT:  # the rest of the previous message, at its level
            level = last[0]
        last[0] = level
        if level > ggml.GGML_LOG_LEVEL_DEBUG and text:
            sys.stderr.write(text.decode("utf-8", "replace"))

    _LOG_CALLBACK.append(log)  # ggml keeps the pointer: the callback must outlive every call
    ggml.ggml_log_set(log, None)


_LOG_CALLBACK: list = []


@functools.lru_cache(maxsize=1)
def cpu_device() -> int:
    reg = _C.cpu_reg()
    if not reg or _C.reg_dev_count(reg) < 1:
        raise FomoeError("ggml has no CPU device")
    return _C.reg_dev_get(reg, 0)


@functools.lru_cache(maxsize=1)
def repacking_buffer_type() -> int | None:
    """The CPU device's repacking buffer type, or None where this ggml has none."""
    address = _C.reg_get_proc_address(_C.cpu_reg(), b"ggml_backend_dev_get_extra_bufts")
    if not address:
        return None
    bufts = _EXTRA_BUFTS(address)(cpu_device())
    for i in range(8):  # the CPU device has at most a handful (repack, AMX, KleidiAI, …), NULL after the last
        if not bufts[i]:
            return None
        if _C.buft_name(bufts[i]) == b"CPU_REPACK":
            return bufts[i]
    return None


def plain_buffer_type() -> int:
    return _C.cpu_buffer_type()


def alloc_tensors(ctx, buft: int) -> int:
    """One buffer of `buft` holding every tensor of the (no_alloc) context `ctx` (views placed in it), its
    memory advised to transparent huge pages (advise_huge_pages) before anything is set into it."""
    buffer = _C.alloc_ctx_tensors_from_buft(ctx, buft)
    if not buffer:
        raise FomoeError(f"ggml could not allocate a {_C.buft_name(buft).decode()} buffer")
    advise_huge_pages(_C.buffer_get_base(buffer), _C.buffer_get_size(buffer))
    return buffer


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """Ask the kernel to back the whole 2 MiB pages inside [address, address + nbytes) with transparent
    huge pages as they are first touched (madvise MADV_HUGEPAGE; the default policy, "madvise", grants
    them only where asked). Why: an expert's product streams its matrix once, and on 4 KiB pages the
    hardware prefetcher stops at every page's end and the TLB misses: the bench model's Q6_K down
    products took ~6 % longer from ggml's buffers (4 KiB pages) than llama.cpp's took from the mapped
    file, and its decode ran 225 → 232 tok/s with its slots advised (AMD EPYC, 2 threads, by hand).
    numpy advises its own large arrays already. Advice only: False where nothing was advised (a small
    range, no transparent huge pages on this system)."""
    if _MADV_HUGEPAGE is None:
        return False
    start = -(-address // _HUGE_PAGE) * _HUGE_PAGE
    end = (address + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    return end > start and _libc.madvise(start, end - start, _MADV_HUGEPAGE) == 0


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)  # (Linux's)
_libc = ctypes.CDLL(None, use_errno=True)  # the process's C library (madvise)
_libc.madvise.restype, _libc.madvise.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def free_buffer(buffer: int) -> None:
    _C.buffer_free(buffer)


def buffer_type(buffer: int) -> int:
    return _C.buffer_get_type(buffer)


def is_repacked(tensor) -> bool:
    """Whether a tensor (allocated) is held in the CPU device's repacking buffer."""
    buffer = tensor.contents.buffer
    return bool(buffer) and repacking_buffer_type() is not None and buffer_type(buffer) == repacking_buffer_type()


def set_tensor(tensor, data: int, nbytes: int) -> None:
    """Copy nbytes at address `data` into the whole of `tensor` (a buffer's own copy: repacks there)."""
    _C.tensor_set(ctypes.cast(tensor, _P), data, 0, nbytes)


@functools.cache
def repacks(qtype: int, n_cols: int, n_rows: int) -> bool:
    """Whether the CPU computes a product from a [n_rows, n_cols] `qtype` weight held repacked."""
    buft = repacking_buffer_type()
    if buft is None:
        return False
    quiet_debug_log()
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=4 * ggml.ggml_tensor_overhead() + 1024, mem_buffer=None, no_alloc=True))
    try:
        w = ggml.ggml_new_tensor_2d(ctx, qtype, n_cols, n_rows)
        buffer = alloc_tensors(ctx, buft)  # its tensors initialised only: nothing is set into it
        try:
            x = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, n_cols, 1)
            return bool(_C.dev_supports_op(cpu_device(), ctypes.cast(ggml.ggml_mul_mat(ctx, w, x), _P)))
        finally:
            free_buffer(buffer)
    finally:
        ggml.ggml_free(ctx)
