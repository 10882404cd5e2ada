"""A decode step's routed experts on the CPU with each expert's weights decoded once for all the rows that
picked it (fomoepy/runtime/_batched_experts.c, whose header gives the arithmetic and the measure behind it).

The cpu backend's experts (fomoepy.runtime.ggml_experts) hand a decode step's picks here where the layer's
three expert matrices are of a type the kernel has (Q4_K, Q6_K) and the CPU runs its AVX-512 form; every
pick is computed from wherever its expert's store-form bytes lie (a tier slot, a read's buffer), so which
experts were resident changes a step's time, never its bits, and a row's bits are its own whatever the
batch (the kernel's per-row sums do not depend on other rows). Elsewhere ggml's products serve.
"""

from __future__ import annotations

import ctypes

import numpy as np
from gguf import GGMLQuantizationType

from fomoepy.runtime.pinned import contiguous_address
from fomoepy.timing import MATMUL  # (the products' seconds: ggml's and this kernel's)

try:  # optional (setup.py)
    from fomoepy.runtime import _batched_experts as _kernel
except ImportError:
    _kernel = None

F32 = np.float32
_F = 4  # bytes of a float32
MAX_PICKS = _kernel.MAX_PICKS if _kernel is not None else 0  # a call's (a graph node's) picks at most: rows × experts each
KERNEL_TYPES = frozenset({int(GGMLQuantizationType.Q4_K), int(GGMLQuantizationType.Q6_K)})
_QK = 256


PORTABLE, AVX2, AVX512 = 0, 1, 2  # the kernel's forms (one arithmetic; their float sums differ in order)


def best_form() -> int:
    """The fastest form of the kernel this CPU runs (PORTABLE where it is not built)."""
    return _kernel.isa() if _kernel is not None else PORTABLE


def vector_kernel() -> bool:
    """Whether the kernel is built and this CPU runs a vector form of it (AVX2 or AVX-512: the engine's
    condition for using it)."""
    return best_form() >= AVX2


def handles(types: tuple[int, int, int], n_embd: int, n_ff: int) -> bool:
    """Whether the kernel has a layer's expert matrices (gate, up, down types; rows of whole superblocks)."""
    return _kernel is not None and set(map(int, types)) <= KERNEL_TYPES and n_embd % _QK == 0 and n_ff % _QK == 0 and n_embd > 0 and n_ff > 0


def serves(layers, form: int = AVX2) -> bool:
    """Whether the kernel can compute the decode steps of these layers' experts (LayerExperts) on this CPU in
    `form` or a faster one."""
    return best_form() >= max(form, AVX2) and all(handles(tuple(p.qtype for p in layer.parts), int(layer.parts[0].shape[1]), int(layer.parts[0].shape[0]))
                                   for layer in layers)  # fmt: skip


def pick_outputs(h: np.ndarray, rows: np.ndarray, experts: np.ndarray, addresses: np.ndarray, types: tuple[int, int, int],
                 n_ff: int, threads: int, out: np.ndarray | None = None, form: int | None = None) -> np.ndarray:  # fmt: skip
    """out[p] = down_e(silu(gate_e · h[rows[p]]) ⊙ (up_e · h[rows[p]])) for each pick p, e = experts[p]:
    `addresses` [E, 3] uint64 the store-form bytes of each expert's gate, up and down (kept alive by the
    caller), h [T, n_embd] float32. form: PORTABLE, AVX2 or AVX512 (tests); None, the best this CPU runs."""
    h = np.ascontiguousarray(h, dtype=F32)
    rows = np.ascontiguousarray(rows, dtype=np.int32)
    experts = np.ascontiguousarray(experts, dtype=np.int32)
    addresses = np.ascontiguousarray(addresses, dtype=np.uint64)
    if h.ndim != 2 or rows.ndim != 1 or experts.shape != rows.shape:  # (the C reads P of each: a shorter one is read past its end)
        raise ValueError(f"pick_outputs: h must be [T, n_embd], rows and experts [P] each, got {h.shape}, {rows.shape}, {experts.shape}")
    P, n_embd = rows.shape[0], h.shape[1]
    if out is None:
        out = np.empty((P, n_embd), F32)
    if out.dtype != F32 or not out.flags.c_contiguous or out.shape != (P, n_embd):
        raise ValueError(f"pick_outputs: out must be float32 C-contiguous [{P}, {n_embd}]")
    if addresses.ndim != 2 or addresses.shape[1] != 3:
        raise ValueError("pick_outputs: addresses must be [experts, 3] (gate, up, down)")
    MATMUL.call(_kernel.picks, contiguous_address(h), h.shape[0], n_embd, n_ff, contiguous_address(rows) if P else 0,
                  contiguous_address(experts) if P else 0, P, contiguous_address(addresses) if addresses.size else 0,
                  addresses.shape[0], tuple(int(t) for t in types), contiguous_address(out) if P else 1, threads, -1 if form is None else int(form))  # fmt: skip
    return out


class _OpInfo(ctypes.Structure):
    """The graph nodes' userdata (OpInfo in _batched_experts.c): the slots' address table, the matrices'
    types and sizes, and where a ggml_tensor keeps its data, sources and sizes (the bindings' struct)."""

    _fields_ = [("addrs", ctypes.c_void_p), ("types", ctypes.c_int32 * 3), ("K", ctypes.c_int32), ("F", ctypes.c_int32),
                ("k", ctypes.c_int32), ("n_slots", ctypes.c_int32), ("data_offset", ctypes.c_int64), ("src_offset", ctypes.c_int64),
                ("ne_offset", ctypes.c_int64)]  # fmt: skip


class GraphExperts:
    """A layer's experts as a decode graph computes them with this kernel (GgmlExperts.graph_inputs on a layer
    the kernel serves): `nodes` adds the three custom nodes (the rows' Q8_K, gate/up/SiLU, down) to a graph;
    each pick's output is pick_outputs' for it, bit for bit. `table`: the slots' addresses [n_slots, 3],
    read by the nodes at every run (kept alive here)."""

    def __init__(self, table: np.ndarray, qtypes: tuple[int, int, int], n_embd: int, n_ff: int):
        import ggml

        self.table, self.qtypes, self.n_embd, self.n_ff = table, tuple(int(t) for t in qtypes), n_embd, n_ff
        self._ggml = ggml
        self._ops = [ggml.ggml_custom_op_t(address) for address in _kernel.graph_ops()]
        self._infos: dict[int, _OpInfo] = {}  # one per k (the nodes' userdata, alive as long as this; shared by every graph of that k)

    def node_bytes(self, B: int, k: int) -> int:
        """Room for the nodes' outputs in a graph's context for B rows of k picks each."""
        quantized, activations = _kernel.op_bytes(B, self.n_embd, B * k, self.n_ff)
        return quantized + activations + _F * self.n_embd * k * B + 3 * 256

    def nodes(self, ctx, h, slots, B: int, k: int):
        """h [n_embd, B] float32, slots [k, B] int32 (each pick's slot) → y [n_embd, k, B] float32 (pick p = b·k + j),
        B·k ≤ MAX_PICKS (more: ggml_decode takes the rows in parts)."""
        ggml, T = self._ggml, self._ggml.ggml_tensor
        if B * k > MAX_PICKS:
            raise ValueError(f"the batched kernel's nodes take at most {MAX_PICKS} picks, got {B} rows of {k}")
        info = self._infos.get(k)
        if info is None:  # (one a k, not one a graph built: a server builds graphs as its batches' spans move, for good)
            info = self._infos[k] = _OpInfo(self.table.ctypes.data, (ctypes.c_int32 * 3)(*self.qtypes), self.n_embd, self.n_ff, k,
                                            self.table.shape[0], T.data.offset, T.src.offset, T.ne.offset)  # fmt: skip
        if not ggml.ggml_is_contiguous(h):
            h = ggml.ggml_cont(ctx, h)
        quantized, activations = _kernel.op_bytes(B, self.n_embd, B * k, self.n_ff)
        tasks, data = ggml.GGML_N_TASKS_MAX, ctypes.cast(ctypes.pointer(info), ctypes.c_void_p)

        def node(qtype, ne, args, op):
            array = (ctypes.POINTER(T) * len(args))(*args)
            return ggml.ggml_custom_4d(ctx, qtype, *ne, array, len(args), op, tasks, data)

        rows = node(ggml.GGML_TYPE_I8, (quantized, 1, 1, 1), [h], self._ops[0])
        acts = node(ggml.GGML_TYPE_I8, (activations, 1, 1, 1), [rows, slots], self._ops[1])
        return node(ggml.GGML_TYPE_F32, (self.n_embd, k, B, 1), [acts, slots], self._ops[2])
