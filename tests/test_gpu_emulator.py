"""An emulated GPU for CI: the driver shim's calls on host memory, and every kernel's contract in numpy.

Launches arrive exactly as a device would see them — a kernel name and a `void* params[]` block
decoded through kernels.KERNEL_SIGNATURES — and each kernel is emulated from pointers, strides and
shapes with the CPU reference ops. So CI checks everything on the Python side of the GPU backend
(DeviceArray views, launch arguments, expert work tables, read-backs, error flags) without a GPU;
the kernels themselves are checked on a device by the gpu-marked tests.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from fomoepy import quants
from fomoepy.experts.routing import softmax_route
from fomoepy.runtime import kernels
from fomoepy.runtime.cpu import CpuBackend
from fomoepy.runtime.gpu import GpuBackend
from fomoepy.runtime.gpu_experts import EXPERT_WORK_DTYPE, PAIR_DTYPE
from fomoepy.runtime.shim import PARAM_TYPES, Dims4

F32 = np.float32
CPU = CpuBackend()
TYPE_OF_SUFFIX = {v: k for k, v in kernels.KERNEL_TYPE_NAMES.items()}


def mem(ptr: int, n: int, dtype=np.uint8) -> np.ndarray:
    """n elements of dtype at address ptr, as a writable numpy view."""
    dtype = np.dtype(dtype)
    return np.frombuffer((ctypes.c_uint8 * (n * dtype.itemsize)).from_address(ptr), dtype)


def strided(ptr: int, shape, strides, dtype=F32) -> np.ndarray:
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides) if n > 0)
    base = mem(ptr, extent, dtype)
    return np.lib.stride_tricks.as_strided(base, shape, [s * base.itemsize for s in strides])


def rows(ptr: int, n_rows: int, n: int, stride: int) -> np.ndarray:
    return strided(ptr, (n_rows, n), (stride, 1))


def weights(ptr: int, suffix: str, n_rows: int, n_cols: int, row_bytes: int) -> np.ndarray:
    qtype = TYPE_OF_SUFFIX[suffix]
    raw = strided(ptr, (n_rows, row_bytes), (row_bytes, 1), np.uint8)
    return quants.dequantize(np.ascontiguousarray(raw), qtype, (n_rows, n_cols))


def flag(err: int, code: int) -> None:
    mem(err, 1, np.int32)[0] |= code


class EmulatedRuntime:
    """DriverShim's interface over host memory; launches run the numpy emulation of the kernel."""

    vendor = "emulated"
    arch = "numpy"
    device_name = "emulated device (numpy)"
    total_memory = 1 << 34

    def __init__(self):
        self.allocations: dict[int, np.ndarray] = {}
        self.launches: list[str] = []

    def malloc(self, nbytes: int) -> int:
        a = np.zeros(max(nbytes, 1) + 16, np.uint8)
        ptr = (a.ctypes.data + 15) // 16 * 16
        self.allocations[ptr] = a
        return ptr

    def free(self, ptr: int) -> None:
        del self.allocations[ptr]

    host_alloc, host_free = malloc, free

    def host_register(self, ptr, n):
        pass

    def host_unregister(self, ptr):
        pass

    def stream(self):
        return object()

    def event(self, timing=False):
        return object()

    def sync(self, stream):
        pass

    def record(self, event, stream):
        pass

    def wait(self, stream, event):
        pass

    def event_sync(self, event):
        pass

    def htod(self, dst, src, n, stream):
        ctypes.memmove(dst, src, n)

    dtoh = dtod = htod

    def memset32(self, dst, value, count, stream):
        mem(dst, count, np.uint32)[:] = value & 0xFFFFFFFF

    def mem_info(self):
        return self.total_memory, self.total_memory

    def load_module(self, binary):
        return "module"

    def function(self, module, name):
        return name

    def launch(self, fn, grid, block, shared, stream, params):
        sig = kernels.KERNEL_SIGNATURES[fn]
        slots = (ctypes.c_void_p * len(sig)).from_address(params)
        args = []
        for code, addr in zip(sig, slots):
            value = PARAM_TYPES[code].from_address(addr)
            args.append(Dims4.from_buffer_copy(value) if code == "D" else value.value or 0)
        self.launches.append(fn)
        family, suffix = split_kernel_name(fn)
        EMULATED[family](*args, grid=list(grid) + [1, 1], suffix=suffix)


def split_kernel_name(fn: str) -> tuple[str, str]:
    """("mv", "q4_k") for mv_q4_k_t8; (name, "") for a kernel of one type."""
    for family in ("mv", "embed", "moe_gate_up", "moe_down_sum", "moe_down"):
        for s in TYPE_OF_SUFFIX:
            if fn == f"{family}_{s}" or fn.startswith(f"{family}_{s}_t"):
                return family, s
    return fn, ""


# -- the kernels' contracts -------------------------------------------------------------------------


def mv(W, row_bytes, X, x_stride, Y, y_stride, N, K, T, grid, suffix):
    w = weights(W, suffix, N, K, row_bytes)
    rows(Y, T, N, y_stride)[:] = rows(X, T, K, x_stride) @ w.T


def embed(table, row_bytes, tokens, T, n_vocab, D, out, err, grid, suffix):
    tok = mem(tokens, T, np.int32)
    if ((tok < 0) | (tok >= n_vocab)).any():
        return flag(err, 2)
    rows(out, T, D, D)[:] = weights(table, suffix, n_vocab, D, row_bytes)[tok]


def moe_gate_up(work, X, D, F, k, row_bytes, act, grid, suffix):
    for w in mem(work, grid[1] * EXPERT_WORK_DTYPE.itemsize).view(EXPERT_WORK_DTYPE):
        gate = weights(int(w["gate"]), suffix, F, D, row_bytes)
        up = weights(int(w["up"]), suffix, F, D, row_bytes)
        for p in w["pair"][: w["n_pairs"]]:
            x = mem(X + 4 * D * (int(p) // k), D, F32)
            mem(act + 4 * F * int(p), F, F32)[:] = CPU.silu(x @ gate.T) * (x @ up.T)


def moe_down_sum(pairs, act, D, F, k, row_bytes, out, grid, suffix):
    T = grid[1]
    info = mem(pairs, T * k * PAIR_DTYPE.itemsize).view(PAIR_DTYPE)
    for t in range(T):
        acc = np.zeros(D, F32)
        for j in range(k):
            p = t * k + j
            down = weights(int(info[p]["down"]), suffix, D, F, row_bytes)
            acc += (down @ mem(act + 4 * F * p, F, F32)) * info[p]["weight"]
        mem(out + 4 * D * t, D, F32)[:] = acc


def moe_down(work, act, D, F, row_bytes, part, grid, suffix):
    for w in mem(work, grid[1] * EXPERT_WORK_DTYPE.itemsize).view(EXPERT_WORK_DTYPE):
        down = weights(int(w["down"]), suffix, D, F, row_bytes)
        for p in w["pair"][: w["n_pairs"]]:
            mem(part + 4 * D * int(p), D, F32)[:] = down @ mem(act + 4 * F * int(p), F, F32)


def moe_combine(pairs, part, T, D, k, out, grid, suffix):
    info = mem(pairs, T * k * PAIR_DTYPE.itemsize).view(PAIR_DTYPE)
    acc = np.zeros((T, D), F32)
    for j in range(k):
        p = np.arange(T) * k + j
        acc += rows(part, T * k, D, D)[p] * info["weight"][p][:, None]
    rows(out, T, D, D)[:] = acc


def rms_norm(x, x_stride, w, y, n_rows, n, eps, grid, suffix):
    rows(y, n_rows, n, n)[:] = CPU.rms_norm(rows(x, n_rows, n, x_stride), mem(w, n, F32), eps)


def l2_norm(x, x_stride, y, n_rows, n, eps, grid, suffix):
    rows(y, n_rows, n, n)[:] = CPU.l2_norm(rows(x, n_rows, n, x_stride), eps)


def softmax(x, x_stride, y, n_rows, n, grid, suffix):
    rows(y, n_rows, n, n)[:] = CPU.softmax(rows(x, n_rows, n, x_stride))


def rope_neox(x, xt, xh, out, T, H, hd, rotary_dim, positions, n_past, base, grid, suffix):
    pos = mem(positions, T, np.int32).astype(np.int64) if positions else np.arange(n_past, n_past + T)
    src = strided(x, (T, H, hd), (xt, xh, 1))
    strided(out, (T, H, hd), (H * hd, hd, 1))[:] = CPU.rope_neox(np.ascontiguousarray(src), pos, rotary_dim, base)


def attention(q, qt, qh, k, v, out, T, H, Hkv, hd, n_past, n_ctx, scale, err, grid, suffix):
    if n_past + T > n_ctx:
        return flag(err, 1)
    kc, vc = strided(k, (n_ctx, Hkv, hd), (Hkv * hd, hd, 1)), strided(v, (n_ctx, Hkv, hd), (Hkv * hd, hd, 1))
    qv = np.ascontiguousarray(strided(q, (T, H, hd), (qt, qh, 1)))
    strided(out, (T, H, hd), (H * hd, hd, 1))[:] = CPU.attention(qv, kc, vc, n_past)


def sigmoid_gate(a, gate, out, n, grid, suffix):
    mem(out, n, F32)[:] = mem(a, n, F32) * CPU.sigmoid(mem(gate, n, F32))


def causal_conv1d(x, state, w, out, T, C, K, err, grid, suffix):
    st = rows(state, K - 1, C, C)
    o, new = CPU.causal_conv1d(rows(x, T, C, C), st.copy(), rows(w, C, K, K))
    rows(out, T, C, C)[:] = o
    st[:] = new


def delta_rule(q, k, v, g, beta, S, o, T, Hv, dk, dv, err, grid, suffix):
    st = strided(S, (Hv, dk, dv), (dk * dv, dv, 1))
    qk = lambda p, d: strided(p, (T, Hv, d), (Hv * d, d, 1))
    out, new = CPU.delta_rule(qk(q, dk), qk(k, dk), qk(v, dv), rows(g, T, Hv, Hv), rows(beta, T, Hv, Hv), st.copy())
    qk(o, dv)[:] = out
    st[:] = new


def route_softmax_topk(logits, T, E, k, probs, ids, weights_, err, grid, suffix):
    r = softmax_route(rows(logits, T, E, E), k)
    rows(probs, T, E, E)[:] = r.probs
    strided(ids, (T, k), (k, 1), np.int32)[:] = r.ids
    rows(weights_, T, k, k)[:] = r.weights


def argmax(x, n_rows, n, ids, grid, suffix):
    mem(ids, n_rows, np.int32)[:] = rows(x, n_rows, n, n).argmax(-1)


EW = {
    0: lambda a, b: a, 1: np.add, 2: np.subtract, 3: np.multiply, 4: np.divide,
    5: lambda a, b: CPU.silu(a), 6: lambda a, b: CPU.sigmoid(a), 7: lambda a, b: CPU.softplus(a),
    8: lambda a, b: np.exp(a), 9: lambda a, b: -a, 10: lambda a, b: a * CPU.sigmoid(b),
    11: lambda a, b: CPU.silu(a) * b, 12: lambda a, b: b - a, 13: lambda a, b: b / a,
}  # fmt: skip


def ew(op, a, b, s, out, d, grid, suffix):
    shape = tuple(d.n)
    av = strided(a, shape, tuple(d.sa))
    bv = strided(b, shape, tuple(d.sb)) if b else F32(s)
    strided(out, shape, tuple(d.so))[:] = EW[op](av, bv)


def copy_b32(a, out, d, grid, suffix):
    shape = tuple(d.n)
    strided(out, shape, tuple(d.so), np.uint32)[:] = strided(a, shape, tuple(d.sa), np.uint32)


def gather(src, idx, out, outer, axis_len, n_idx, inner, err, grid, suffix):
    index = mem(idx, n_idx, np.int32)
    if ((index < 0) | (index >= axis_len)).any():
        return flag(err, 2)
    s = strided(src, (outer, axis_len, inner), (axis_len * inner, inner, 1))
    strided(out, (outer, n_idx, inner), (n_idx * inner, inner, 1))[:] = s[:, index]


EMULATED = {
    "mv": mv, "embed": embed, "moe_gate_up": moe_gate_up, "moe_down_sum": moe_down_sum, "moe_down": moe_down,
    "moe_combine": moe_combine, "rms_norm_f32": rms_norm, "l2_norm_f32": l2_norm, "softmax_f32": softmax,
    "rope_neox_f32": rope_neox, "attention_f32": attention, "sigmoid_gate_f32": sigmoid_gate,
    "causal_conv1d_f32": causal_conv1d, "delta_rule_f32": delta_rule, "route_softmax_topk": route_softmax_topk,
    "argmax_f32": argmax, "ew_f32": ew, "copy_b32": copy_b32, "gather_f32": gather,
}  # fmt: skip


def emulated_backend() -> GpuBackend:
    return GpuBackend(rt=EmulatedRuntime(), binaries={"emulated": b""})  # type: ignore[arg-type]


# -- the emulator itself -----------------------------------------------------------------------------


def test_every_kernel_of_the_launch_table_is_emulated():
    for name in kernels.KERNEL_SIGNATURES:
        assert split_kernel_name(name)[0] in EMULATED, name


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_device_arrays_round_trip(dtype):
    dev = emulated_backend()
    x = np.arange(24, dtype=dtype).reshape(2, 3, 4)
    assert np.array_equal(np.asarray(dev.upload(x)), x)
