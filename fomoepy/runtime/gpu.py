"""The GPU backend: CpuBackend's ops as kernels from hip_kernels/, on CUDA or HIP through one shim.

Weights stay in their GGUF form on the device (a `DeviceWeight` holds a matrix's quantised rows;
1-D tensors and the conv filter are float32); activations are `DeviceArray`s. Every op accepts
numpy inputs too (uploaded), so the unchanged model code runs here, and the numpy reference is one
flag away. All kernels run in order on one compute stream; the host waits only where it reads a
result back (routing decisions, logits), and that is also where the kernels' error flags are checked.
The routing decisions and their read-back are fomoepy.runtime.gpu_routing's (DeviceRouting, this class's base).
"""

from __future__ import annotations

import ctypes
import math
import numbers
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fomoepy import quants
from fomoepy.errors import FomoeError
from fomoepy.model.gguf_file import GGUFFile, TensorInfo
from fomoepy.runtime import kernels
from fomoepy.runtime.gpu_arrays import (
    EW_OPS,
    REVERSED,
    BufferPool,
    DeviceArray,
    DeviceBuffer,
    broadcast_shape,
    broadcast_strides,
    contiguous_strides,
    dims4,
)
from fomoepy.runtime.gpu_routing import READBACK_AT, READBACK_BYTES, DeviceRouting
from fomoepy.runtime.shim import (
    DriverShim,
    PackedParams,
    open_runtime,
    param_block,
)

F32 = np.float32
I32 = np.int32

# 2-D tensors that are not matmul weights: kept as float32 arrays
FLOAT_TENSOR_SUFFIXES = ("ssm_conv1d.weight",)
# the kernel of each routing variant computed on the device (GATING_FUNCTIONS names)
ERROR_MESSAGES = {
    1: "a KV position past the context the cache was allocated for",
    2: "a token id or index outside its table",
    4: "a dimension larger than the kernels support (head dim <= 256, state size <= 128, conv kernel <= 8)",
}


@dataclass
class DeviceWeight:
    """A weight matrix in its GGUF form on the device: N rows of K elements, row_bytes apart."""

    buf: Any  # keeps the memory alive (a DeviceBuffer or the DeviceArray it views)
    ptr: int
    qtype: int
    shape: tuple[int, int]
    row_bytes: int
    name: str = ""

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes


class _Direct:
    """Owner of exact-size allocations (weights, KV caches): freed, not pooled, when dropped."""

    def __init__(self, rt: DriverShim):
        self.rt = rt

    def release(self, ptr: int, size: int) -> None:
        try:
            self.rt.free(ptr)
        except Exception:  # at interpreter exit the driver may be gone already
            pass


def _free_pinned(rt: DriverShim, ptr: int) -> None:
    try:
        rt.host_free(ptr)
    except Exception:  # at interpreter exit the driver may be gone already
        pass


def _is_scalar(x: Any) -> bool:
    return isinstance(x, numbers.Number) or (isinstance(x, np.ndarray) and x.ndim == 0)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GpuBackend(DeviceRouting):
    experts_kind = "gpu"  # backends.make_expert_device: GpuExperts computes on it

    def __init__(self, vendor: str = "cuda", device: int = 0, rt: DriverShim | None = None, binaries: dict[str, bytes] | None = None):
        """`rt` and `binaries` replace the driver and the compiled modules (tests: a stand-in driver)."""
        self.rt = rt or open_runtime(vendor, device)
        if self.rt.warp_size != kernels.WARP_SIZE:  # a wave64 card (GCN, CDNA) would sum half-warps: refuse it
            raise FomoeError(
                f"{self.rt.device_name} runs warps of {self.rt.warp_size} lanes; fomoepy's kernels are built for "
                f"{kernels.WARP_SIZE} (NVIDIA, and AMD RDNA in wave32)"
            )
        self.name = self.rt.vendor
        if binaries is None:
            binaries = kernels.compile_all(kernels.compiler_for(self.rt.vendor), self.rt.arch)
        self.modules = {name: self.rt.load_module(b) for name, b in binaries.items()}
        self._functions: dict[str, Any] = {}
        self._launchers: dict[str, tuple] = {}  # per kernel: its function, reusable parameter block, signature
        # per kernel, where the binding's C functions are in use: its compiled launcher (shim.launcher)
        self._compiled: dict[str, Any] = {}
        self._decode_routes: dict[tuple[int, int], Any] = {}  # DeviceRouting's: (E, k) -> a decode step's DecodeRoute (False: none)
        self._mv_names: dict[tuple[int, str, int], str] = {}  # (qtype, weight, tile) -> its matvec kernel
        self._kinds: dict[tuple, tuple] = {}  # (shape, dtype) as empty was given them -> _kind's
        self.stream = self.rt.stream()  # compute
        self.copy_stream = self.rt.stream()  # expert uploads (gpu_experts.py)
        # demoted experts' copies down: a GPU's copy engines move the two directions at once, so they need
        # not queue ahead of the copies up (gpu_experts.py)
        self.down_stream = self.rt.stream()
        self.pool = BufferPool(self.rt, self.stream)
        self._direct = _Direct(self.rt)
        self._keepalive: list[Any] = []  # host arrays of copies queued since the last sync
        self.poison: int | None = None  # tests: fill every new array with this 32-bit pattern
        # the kernels' error flag heads a small area that results read back often (the routing of a step)
        # are written into, so that one copy brings both: a binding call costs microseconds
        self._readback = self.zeros((READBACK_BYTES // 4,), I32)
        self.err = self._readback.view((1,), (1,), 0)
        self._err_host = self.rt.host_alloc(READBACK_BYTES)
        weakref.finalize(self, _free_pinned, self.rt, self._err_host)
        # the host's copy of that area as arrays, made once (a view over pinned memory costs microseconds)
        self._readback_host = np.frombuffer((ctypes.c_char * READBACK_BYTES).from_address(self._err_host), np.float32)
        self._err_code = self._readback_host[:1].view(I32)

    # -- launching ----------------------------------------------------------------------------------
    def function(self, name: str) -> Any:
        fn = self._functions.get(name)
        if fn is None:
            module = self.modules.get(kernels.module_of(name))
            if module is None:
                raise FomoeError(f"kernel {name}: module {kernels.module_of(name)} was not loaded")
            fn = self._functions[name] = self.rt.function(module, name)
        return fn

    def launch(self, name: str, grid: Sequence[int], block: int, *args: Any, shared: int = 0) -> None:
        fast = self._compiled.get(name)
        if fast is not None and self.rt.direct is not None:  # packed and launched in one C call
            fast.launch(grid, block, shared, args)
            return
        launcher = self._launchers.get(name)
        if launcher is None:  # first launch of this kernel
            launcher = self._first_launch(name)
            compiled = self._compiled.get(name)
            if compiled is not None and len(args) == len(launcher[3]):
                compiled.launch(grid, block, shared, args)
                return
        fn, params, n_args, signature = launcher
        if params is None or len(args) != n_args:  # a struct argument (or a wrong count: PackedParams says so)
            packed = PackedParams(signature, args)
            self.rt.launch(fn, grid, (block,), shared, self.stream, packed.address)
        else:
            self.rt.launch(fn, grid, (block,), shared, self.stream, params.pack(args))

    def _first_launch(self, name: str) -> tuple:
        """Kernel `name`'s function and reusable parameter block, and its compiled launcher where the direct
        calls are in use (_compiled)."""
        signature = kernels.KERNEL_SIGNATURES[name]
        launcher = self._launchers[name] = (self.function(name), param_block(signature), len(signature), signature)
        compiled = self.rt.launcher(launcher[0], self.stream, signature)
        if compiled is not None:
            self._compiled[name] = compiled
        return launcher

    def compiled_launcher(self, name: str) -> Any:
        """Kernel `name`'s compiled launcher (_driver_calls.Launcher, made at its first use), or None where its
        launches go through Python (the direct calls off, or an argument a Launcher does not pack)."""
        if self.rt.direct is None:
            return None
        if name not in self._launchers:
            self._first_launch(name)
        return self._compiled.get(name)

    # -- memory and transfers -----------------------------------------------------------------------
    def empty(self, shape, dtype=F32) -> DeviceArray:
        try:  # (a shape and dtype seen before: most of a step's arrays)
            size, shape, strides, dtype = self._kinds[shape, dtype]
        except (KeyError, TypeError):  # a new one, or a shape that is no tuple
            size, shape, strides, dtype = self._kind(shape, dtype)
        buf = self.pool.get_class(size)
        out = object.__new__(DeviceArray)  # (__init__'s result without its conversions: a step makes a few)
        out.dev, out.buf, out.shape, out.strides, out.offset, out.dtype, out.ptr = self, buf, shape, strides, 0, dtype, buf.ptr
        if self.poison is not None:
            self.rt.memset32(out.ptr, self.poison, _cdiv(size, 4), self.stream)
        return out

    def _kind(self, shape, dtype) -> tuple[int, tuple[int, ...], tuple[int, ...], np.dtype]:
        """An array's pool size class, shape and strides as tuples of ints and np.dtype, for empty: worked out
        once per (shape, dtype) (a decode step makes the same few dozen arrays, each conversion a call)."""
        key = (shape, dtype)
        shape = tuple(map(int, shape))
        dtype = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize  # (np.prod of a tuple costs microseconds)
        kind = (BufferPool.size_class(nbytes), shape, contiguous_strides(shape), dtype)
        if type(key[0]) is tuple and len(self._kinds) < 4096:
            self._kinds[key] = kind
        return kind

    def zeros(self, shape, dtype=F32) -> DeviceArray:
        """Zero-filled, an exact allocation (KV caches, recurrent states: long-lived)."""
        shape = tuple(int(n) for n in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        buf = DeviceBuffer(self._direct, self.rt.malloc(nbytes), nbytes)
        self.rt.memset32(buf.ptr, 0, _cdiv(nbytes, 4), self.stream)
        return DeviceArray(self, buf, shape, dtype)

    def upload(self, x: np.ndarray, dtype=None, exact: bool = False) -> DeviceArray:
        host = np.ascontiguousarray(x, dtype=dtype or x.dtype)
        if exact:
            buf = DeviceBuffer(self._direct, self.rt.malloc(host.nbytes), host.nbytes)
            out = DeviceArray(self, buf, host.shape, host.dtype)
        else:
            out = self.empty(host.shape, host.dtype)
        self._keepalive.append(host)
        self.rt.htod(out.ptr, host.ctypes.data, host.nbytes, self.stream)
        return out

    def asdevice(self, x: Any, dtype=F32) -> DeviceArray:
        if isinstance(x, DeviceArray):
            return x
        return self.upload(np.asarray(x, dtype=dtype))

    def to_host(self, *arrays: DeviceArray) -> Any:
        """Download (one synchronisation for all), then raise if any kernel flagged an error."""
        outs = []
        for a in arrays:
            a = a.contiguous()
            out = np.empty(a.shape, a.dtype)
            self.rt.dtoh(out.ctypes.data, a.ptr, out.nbytes, self.stream)
            outs.append(out)
        self.synchronize()
        return outs[0] if len(outs) == 1 else outs

    def synchronize(self, readback: int = 0) -> None:
        """Wait for the stream, then raise if any kernel flagged an error. `readback`: bytes of the
        read-back area after the flag (READBACK_AT on) to bring to the host in the same copy."""
        self.rt.dtoh(self._err_host, self.err.ptr, READBACK_AT + readback if readback else 4, self.stream)
        self.rt.sync(self.stream)
        self._keepalive.clear()
        self._check_flag()

    def _check_flag(self) -> None:
        """Raise if a kernel flagged an error (the flag read back by the last wait), the flag cleared first."""
        code = int(self._err_code[0])
        if code:
            self.rt.memset32(self.err.ptr, 0, 1, self.stream)
            what = "; ".join(msg for bit, msg in ERROR_MESSAGES.items() if code & bit) or f"code {code}"
            raise FomoeError(f"a GPU kernel refused its input: {what}")

    def copy_into(self, dst: DeviceArray, src: DeviceArray) -> None:
        """dst[...] = src (broadcast), both views."""
        strides = broadcast_strides(src.shape, src.strides, dst.shape)
        d = dims4(dst.shape, dst.strides, strides)
        if dst.dtype == F32 and src.dtype == F32:
            self._ew("copy", src.ptr, 0, 0.0, dst.ptr, d, dst.size)
        elif dst.dtype.itemsize == 4 and src.dtype == dst.dtype:
            self.launch("copy_b32", (min(_cdiv(dst.size, 256), 65535),), 256, src.ptr, dst.ptr, d)
        else:
            raise TypeError(f"cannot copy {src.dtype} into {dst.dtype} on the device")

    # -- elementwise --------------------------------------------------------------------------------
    def _ew(self, op: str, a: int, b: int, s: float, out: int, d, total: int) -> None:
        if total:
            self.launch("ew_f32", (min(_cdiv(total, 256), 65535),), 256, EW_OPS[op], a, b, s, out, d)

    def unary(self, op: str, x: Any) -> DeviceArray:
        x = self.asdevice(x)
        out = self.empty(x.shape)
        self._ew(op, x.ptr, 0, 0.0, out.ptr, dims4(x.shape, out.strides, x.strides), x.size)
        return out

    def binary(self, op: str, a: Any, b: Any) -> DeviceArray:
        if _is_scalar(a):
            a, b, op = b, a, REVERSED[op]
        a = self.asdevice(a)
        if _is_scalar(b):
            out = self.empty(a.shape)
            self._ew(op, a.ptr, 0, float(b), out.ptr, dims4(a.shape, out.strides, a.strides), a.size)
            return out
        b = self.asdevice(b)
        shape = broadcast_shape(a.shape, b.shape)
        out = self.empty(shape)
        d = dims4(shape, out.strides, broadcast_strides(a.shape, a.strides, shape), broadcast_strides(b.shape, b.strides, shape))
        self._ew(op, a.ptr, b.ptr, 0.0, out.ptr, d, out.size)
        return out

    def gather(self, x: DeviceArray, axis: int, idx: np.ndarray) -> DeviceArray:
        """x.take(idx, axis) for a 1-D integer index."""
        x = x.contiguous()
        idx = np.asarray(idx).reshape(-1)
        outer = int(np.prod(x.shape[:axis], dtype=np.int64))
        inner = int(np.prod(x.shape[axis + 1 :], dtype=np.int64))
        out = self.empty(x.shape[:axis] + (len(idx),) + x.shape[axis + 1 :])
        dev_idx = self.upload(idx, I32)
        self.launch("gather_f32", (min(_cdiv(out.size, 256), 65535) or 1,), 256,
                    x.ptr, dev_idx.ptr, out.ptr, outer, x.shape[axis], len(idx), inner, self.err.ptr)  # fmt: skip
        return out

    @staticmethod
    def _rows(x: DeviceArray) -> tuple[DeviceArray, int, int, int]:
        """(array, n_rows, row length, row stride) with rows evenly spaced; copies only if they are not."""
        shape = x.shape
        n = shape[-1] if shape else 1
        if x.strides == contiguous_strides(shape):  # the common case, answered without the general walk
            return x, math.prod(shape) // max(n, 1), n, n
        lead = [(m, s) for m, s in zip(x.shape[:-1], x.strides[:-1]) if m != 1]
        even = (x.ndim == 0 or x.strides[-1] == 1 or n == 1) and all(
            s == s2 * m2 for (_, s), (m2, s2) in zip(lead, lead[1:])
        )
        if not even:
            x = x.contiguous()
            lead = [(m, s) for m, s in zip(x.shape[:-1], x.strides[:-1]) if m != 1]
        stride = lead[-1][1] if lead else n
        return x, x.size // max(n, 1), n, stride

    # -- the ops of CpuBackend ----------------------------------------------------------------------
    def load_weight(self, gf: GGUFFile, info: TensorInfo) -> DeviceWeight | DeviceArray:
        if len(info.shape) == 2 and not info.name.endswith(FLOAT_TENSOR_SUFFIXES):
            return self.weight_from_bytes(gf.raw(info), info.qtype, info.shape, info.name)
        return self.upload(quants.dequantize(gf.raw(info), info.qtype, info.shape, tensor_name=info.name), F32, exact=True)

    def weight_from_bytes(self, raw: np.ndarray, qtype: int, shape: Sequence[int], name: str = "") -> DeviceWeight:
        kernels.kernel_name("mv", qtype, name)  # a type without a kernel is refused here, at load
        n_rows, n_cols = int(shape[0]), int(shape[1])
        row_bytes = quants.row_nbytes(qtype, n_cols, name)
        data = self.upload(np.frombuffer(np.ascontiguousarray(raw), np.uint8), exact=True)
        return DeviceWeight(data.buf, data.ptr, int(qtype), (n_rows, n_cols), row_bytes, name)

    def _matrix(self, w: Any) -> DeviceWeight:
        if isinstance(w, DeviceWeight):
            return w
        w = self.asdevice(w)
        if w.ndim != 2 or w.dtype != F32:
            raise ValueError(f"expected a 2-D float32 weight, got {w.dtype} {w.shape}")
        if w.strides[1] != 1 or (w.shape[0] > 1 and w.strides[0] < w.shape[1]):
            w = w.contiguous()
        row_bytes = (w.strides[0] if w.shape[0] > 1 else w.shape[1]) * 4  # a single row may have stride 0
        return DeviceWeight(w, w.ptr, int(quants.GGMLQuantizationType.F32), w.shape, row_bytes)  # type: ignore[arg-type]

    def linear(self, x: Any, w: Any, out: DeviceArray | None = None) -> DeviceArray:
        """x [..., K] · wᵀ for w [N, K] in any supported GGUF type → [..., N]; into `out` where given (a
        contiguous float32 array of that shape, reused step after step: fomoepy.runtime.gpu_sides)."""
        W = self._matrix(w)
        x, T, K, x_stride = self._rows(self.asdevice(x))
        N = W.shape[0]
        if K != W.shape[1]:
            raise ValueError(f"linear {W.name}: expected inputs of {W.shape[1]}, got {K}")
        if out is None:
            y = self.empty(x.shape[:-1] + (N,))
        elif out.shape != x.shape[:-1] + (N,) or out.dtype != F32 or not out.is_contiguous:
            raise ValueError(f"linear {W.name}: its output is {x.shape[:-1] + (N,)} float32, contiguous; got {out.dtype} {out.shape}")
        else:
            y = out
        if T:
            tile = 1 if T == 1 else 8
            name = self._mv_names.get((W.qtype, W.name, tile))
            if name is None:
                name = self._mv_names[W.qtype, W.name, tile] = f"{kernels.kernel_name('mv', W.qtype, W.name)}_t{tile}"
            self.launch(name, (_cdiv(N, 4), _cdiv(T, tile)), 128, W.ptr, W.row_bytes, x.ptr, x_stride, y.ptr, N, N, K, T)
        return y

    def linear_rows(self, x: Any, w: Any) -> DeviceArray:
        """linear, which gives each row the bits it gets alone (fomoepy.model.rows): the kernels' tile of
        rows shares each decoded weight group, and every row's dot product is summed in the same order
        whatever the tile (row_dot in hip_kernels/dequant.h), so a batch reads the weights once."""
        return self.linear(x, w)

    def concat_rows(self, parts: Sequence[Any]) -> DeviceArray:
        """The parts [n_i, ...] one after another along the first axis, on the device."""
        parts = [self.asdevice(p) for p in parts]
        if len(parts) == 1:
            return parts[0]
        out = self.empty((sum(p.shape[0] for p in parts),) + parts[0].shape[1:], parts[0].dtype)
        at = 0
        for p in parts:
            out[at : at + p.shape[0]] = p
            at += p.shape[0]
        return out

    def rms_norm(self, x: Any, w: Any, eps: float) -> DeviceArray:
        x, n_rows, n, stride = self._rows(self.asdevice(x))
        w = self.asdevice(w)
        y = self.empty(x.shape)
        if n_rows:
            self.launch("rms_norm_f32", (n_rows,), 256, x.ptr, stride, w.ptr, y.ptr, n_rows, n, float(eps))
        return y

    def l2_norm(self, x: Any, eps: float) -> DeviceArray:
        x, n_rows, n, stride = self._rows(self.asdevice(x))
        y = self.empty(x.shape)
        if n_rows:
            self.launch("l2_norm_f32", (n_rows,), 256, x.ptr, stride, y.ptr, n_rows, n, float(eps))
        return y

    def silu(self, x: Any) -> DeviceArray:
        return self.unary("silu", x)

    def sigmoid(self, x: Any) -> DeviceArray:
        return self.unary("sigmoid", x)

    def softplus(self, x: Any) -> DeviceArray:
        return self.unary("softplus", x)

    def softmax(self, x: Any) -> DeviceArray:
        x, n_rows, n, stride = self._rows(self.asdevice(x))
        y = self.empty(x.shape)
        if n_rows:
            self.launch("softmax_f32", (n_rows,), 256, x.ptr, stride, y.ptr, n_rows, n)
        return y

    def sigmoid_gate(self, a: Any, gate: Any) -> DeviceArray:
        """a * sigmoid(gate) in one kernel (qwen35moe's gated attention output)."""
        a, gate = self.asdevice(a).contiguous(), self.asdevice(gate).contiguous()
        out = self.empty(a.shape)
        self.launch("sigmoid_gate_f32", (_cdiv(a.size, 256) or 1,), 256, a.ptr, gate.ptr, out.ptr, a.size)
        return out

    def swiglu_ffn(self, x: Any, gate: Any, up: Any, down: Any) -> DeviceArray:
        return self.linear(self.binary("silu_mul", self.linear(x, gate), self.linear(x, up)), down)

    def embed(self, table: Any, tokens: Any) -> DeviceArray:
        """Rows of a (quantised) table: table [n_vocab, D] as a DeviceWeight, tokens [T]."""
        W = self._matrix(table)
        tok = self.upload(np.asarray(tokens).reshape(-1), I32)
        T, D = tok.size, W.shape[1]
        out = self.empty((T, D))
        name = kernels.kernel_name("embed", W.qtype, W.name)
        if T:
            self.launch(name, (T, _cdiv(_cdiv(D, 8), 128)), 128, W.ptr, W.row_bytes, tok.ptr, T, W.shape[0], D, out.ptr, self.err.ptr)
        return out

    def rope_neox(self, x: Any, positions: np.ndarray, rotary_dim: int, base: float) -> DeviceArray:
        x = self.asdevice(x)
        if x.strides[-1] != 1:
            x = x.contiguous()
        T, H, hd = x.shape
        positions = np.asarray(positions).reshape(-1)
        out = self.empty((T, H, hd))
        consecutive = T == 0 or np.array_equal(positions, np.arange(positions[0], positions[0] + T))
        pos_dev = None if consecutive else self.upload(positions, I32)
        n_past = int(positions[0]) if T and consecutive else 0
        half = rotary_dim // 2
        if T:
            self.launch("rope_neox_f32", (T, _cdiv(max(half, hd - rotary_dim, 1), 64)), 64, x.ptr, x.strides[0], x.strides[1],
                        out.ptr, T, H, hd, int(rotary_dim), pos_dev.ptr if pos_dev else 0, n_past, float(base))  # fmt: skip
        return out

    def attention(self, q: Any, k_cache: Any, v_cache: Any, n_past: int) -> DeviceArray:
        q = self.asdevice(q)
        if q.strides[-1] != 1:
            q = q.contiguous()
        k, v = self.asdevice(k_cache).contiguous(), self.asdevice(v_cache).contiguous()
        T, H, hd = q.shape
        n_ctx, Hkv, _ = k.shape
        out = self.empty((T, H, hd))
        scale = float(F32(1.0 / np.sqrt(hd)))
        if T:
            self.launch("attention_f32", (H, T), 128, q.ptr, q.strides[0], q.strides[1], k.ptr, v.ptr, out.ptr,
                        T, H, Hkv, hd, int(n_past), n_ctx, scale, self.err.ptr)  # fmt: skip
        return out

    def attend_rows(self, q: Any, k: Any, v: Any, caches: Sequence[Any], positions: np.ndarray) -> DeviceArray:
        """A batched decode step's attention, one row of each sequence: row b's key and value into caches[b]
        at positions[b], then its query over that cache, for every row in two launches (one table of the
        caches' addresses, positions and sizes goes up). q [B, H, hd], k [B, Hkv, hd] normed and rotated,
        v [B, Hkv, hd] → [B, H, hd]; each row gets the bits the copies into its cache and `attention` give it
        alone (attention.hip: both kernels run the same block arithmetic)."""
        q = self.asdevice(q)
        if q.strides[-1] != 1:
            q = q.contiguous()
        k, v = self.asdevice(k).contiguous(), self.asdevice(v).contiguous()
        B, H, hd = q.shape
        Hkv = k.shape[1]
        ks = [self.asdevice(c.k) for c in caches]
        vs = [self.asdevice(c.v) for c in caches]
        if any(not (a.is_contiguous and a.shape[1:] == (Hkv, hd)) for a in ks + vs):
            raise ValueError(f"attend_rows: every cache is [n_ctx, {Hkv}, {hd}] float32, contiguous")
        table, (caches_k, caches_v, rows) = self._row_tables([a.ptr for a in ks], [a.ptr for a in vs],
                                                             [*np.asarray(positions).reshape(-1), *(a.shape[0] for a in ks)])  # fmt: skip
        out = self.empty((B, H, hd))  # (while `table` is held: its buffer is not handed out again before the launches)
        if B:
            n = Hkv * hd
            self.launch("kv_append_rows_f32", (_cdiv(n, 256), B), 256, k.ptr, v.ptr, caches_k, caches_v, rows, B, n, self.err.ptr)
            scale = float(F32(1.0 / np.sqrt(hd)))
            self.launch("attention_rows_f32", (H, B), 128, q.ptr, q.strides[0], q.strides[1], caches_k, caches_v, rows,
                        out.ptr, B, H, Hkv, hd, scale, self.err.ptr)  # fmt: skip
        return out

    def _row_tables(self, *tables: Sequence[int]) -> tuple[DeviceArray, list[int]]:
        """Int64 tables a batched step's kernel reads per row (the sequences' state addresses, positions...),
        up in one copy: that array, which the caller holds until its launches are queued (dropped, its buffer
        could be the next `empty`'s, written before the kernels read the tables), and each table's address."""
        up = self.upload(np.concatenate([np.asarray(t, np.int64) for t in tables]))
        starts = np.cumsum([0] + [len(t) for t in tables[:-1]])
        return up, [up.ptr + 8 * int(at) for at in starts]

    def _row_states(self, states: Sequence[Any], shape: tuple[int, ...], what: str) -> list[int]:
        """The device addresses of sequences' states, each a contiguous float32 device array of `shape`."""
        if any(not (isinstance(a, DeviceArray) and a.is_contiguous and a.dtype == F32 and a.shape == shape) for a in states):
            raise ValueError(f"{what}: every state is a contiguous float32 device array of shape {shape}")
        return [a.ptr for a in states]

    def causal_conv1d_rows(self, x: Any, conv_states: Sequence[Any], w: Any) -> DeviceArray:
        """A batched decode step's convolution, one row of each sequence: row b of x [B, C] through the
        convolution whose state is conv_states[b] (updated in place) → [B, C], every row in one launch, each
        with the bits causal_conv1d gives it alone (deltanet.hip: both kernels run conv_channel)."""
        x, w = self.asdevice(x).contiguous(), self.asdevice(w).contiguous()
        B, C = x.shape
        K = w.shape[1]
        table, (states,) = self._row_tables(self._row_states(conv_states, (K - 1, C), "causal_conv1d_rows"))
        out = self.empty((B, C))  # (while `table` is held: _row_tables)
        if B:
            self.launch("causal_conv1d_rows_f32", (_cdiv(C, 256), B), 256, x.ptr, states, w.ptr, out.ptr, B, C, K, self.err.ptr)
        return out

    def delta_rule_rows(self, q, k, v, g, beta, ssm_states: Sequence[Any]) -> DeviceArray:
        """A batched decode step's delta rule, one row of each sequence: q, k [B, Hv, dk], v [B, Hv, dv], g and
        beta [B, Hv], row b through ssm_states[b] (updated in place) → o [B, Hv, dv], every row in one launch,
        each with the bits delta_rule gives it alone (deltanet.hip: both kernels run delta_column)."""
        q, k, v = (self.asdevice(a).contiguous() for a in (q, k, v))
        g, beta = self.asdevice(g).contiguous(), self.asdevice(beta).contiguous()
        B, Hv, dk = q.shape
        dv = v.shape[2]
        table, (states,) = self._row_tables(self._row_states(ssm_states, (Hv, dk, dv), "delta_rule_rows"))
        o = self.empty((B, Hv, dv))  # (while `table` is held: _row_tables)
        if B:
            self.launch("delta_rule_rows_f32", (_cdiv(dv, 32), Hv, B), 128, q.ptr, k.ptr, v.ptr, g.ptr, beta.ptr, states, o.ptr,
                        B, Hv, dk, dv, self.err.ptr)  # fmt: skip
        return o

    def causal_conv1d(self, x: Any, conv_state: Any, w: Any) -> tuple[DeviceArray, DeviceArray]:
        """As CpuBackend.causal_conv1d; the state is updated in place (a numpy state is uploaded first)."""
        x = self.asdevice(x).contiguous()
        state = self.asdevice(conv_state).contiguous() if isinstance(conv_state, DeviceArray) else self.upload(conv_state, F32, exact=True)
        w = self.asdevice(w).contiguous()
        T, C = x.shape
        out = self.empty((T, C))
        self.launch("causal_conv1d_f32", (_cdiv(C, 256),), 256, x.ptr, state.ptr, w.ptr, out.ptr, T, C, w.shape[1], self.err.ptr)
        return out, state

    def delta_rule(self, q, k, v, g, beta, state) -> tuple[DeviceArray, DeviceArray]:
        """As CpuBackend.delta_rule; the state is updated in place (a numpy state is uploaded first)."""
        q, k, v = (self.asdevice(a).contiguous() for a in (q, k, v))
        g, beta = self.asdevice(g).contiguous(), self.asdevice(beta).contiguous()
        S = state.contiguous() if isinstance(state, DeviceArray) else self.upload(state, F32, exact=True)
        T, Hv, dk = q.shape
        dv = v.shape[2]
        o = self.empty((T, Hv, dv))
        self.launch("delta_rule_f32", (_cdiv(dv, 32), Hv), 128, q.ptr, k.ptr, v.ptr, g.ptr, beta.ptr, S.ptr, o.ptr,
                    T, Hv, dk, dv, self.err.ptr)  # fmt: skip
        return o, S

    def argmax(self, x: Any) -> np.ndarray:
        """First index of the maximum of each row (greedy sampling without reading logits back)."""
        x, n_rows, n, _ = self._rows(self.asdevice(x).contiguous())
        ids = self.empty((n_rows,), I32)
        if n_rows:
            self.launch("argmax_f32", (n_rows,), 256, x.ptr, n_rows, n, ids.ptr)
        return self.to_host(ids).astype(np.int64)

