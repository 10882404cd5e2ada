"""A decode batch's products with Q8_0 dense weights (attention's, the output head's), each weight block read
once for all the batch's rows and each row's result bit for bit its lone one-row product's
(fomoepy/runtime/_dense_rows.c, whose header gives the arithmetic and the measure behind it).

ggml_dense.product takes a product of several sequences' rows here where the weights are Q8_0 and this
CPU runs the kernel (its AVX-512 or AVX2 form) and agrees with ggml (`agrees`, asked of ggml itself once);
elsewhere the rows are one-row products of ggml's own, as before. Either way a row gets the bits it gets
alone.
"""

from __future__ import annotations

import ctypes
import functools

import fomoepy.runtime.ggml_threads  # noqa: F401  (before ggml: OpenMP's wait policy)

# isort: split
import ggml
import numpy as np

try:  # optional (setup.py)
    from fomoepy.runtime import _dense_rows as _kernel
except ImportError:
    _kernel = None

Q8_0 = ggml.GGML_TYPE_Q8_0
_QK8_0 = 32


NONE, AVX2, AVX512 = 0, 1, 2  # the kernel's forms (each gives ggml's one-row bits)


class _OpInfo(ctypes.Structure):
    """The node's userdata (OpInfo in _dense_rows.c): where a ggml_tensor keeps its data, sources and sizes,
    and the form the node runs."""

    _fields_ = [("data_offset", ctypes.c_int64), ("src_offset", ctypes.c_int64), ("ne_offset", ctypes.c_int64), ("form", ctypes.c_int64)]


_T = ggml.ggml_tensor
_INFOS = {form: _OpInfo(_T.data.offset, _T.src.offset, _T.ne.offset, form) for form in (AVX2, AVX512)}  # (alive for the process)
_OP = ggml.ggml_custom_op_t(_kernel.graph_op()) if _kernel is not None else None


def best_form() -> int:
    """The fastest form of the kernel this CPU runs (NONE where it is not built or the CPU lacks AVX2)."""
    return _kernel.form() if _kernel is not None else NONE


def runs() -> bool:
    """Whether the kernel is built and this CPU runs a form of it."""
    return best_form() != NONE


def handles(w) -> bool:
    """Whether the kernel takes products with w (a QuantMatrix: Q8_0, rows of whole blocks) here."""
    return getattr(w, "qtype", None) == Q8_0 and w.n_cols % _QK8_0 == 0 and agrees()


def node(ctx, weight, x, B: int, form: int | None = None):
    """weight (a Q8_0 [K, N] leaf) · x ([K, B] float32) → [N, B] float32: x quantized by ggml (a copy to
    Q8_0: the function ggml's own products quantize with), then the kernel's node on every graph thread, in
    `form` (None: the best this CPU runs)."""
    form = best_form() if form is None else form
    if not AVX2 <= form <= best_form():
        raise ValueError(f"dense_rows: form {form} does not run here (the best here: {best_form()})")
    K, N = int(weight.contents.ne[0]), int(weight.contents.ne[1])
    quantized = ggml.ggml_cpy(ctx, x, ggml.ggml_new_tensor_2d(ctx, Q8_0, K, B))
    args = (ctypes.POINTER(_T) * 2)(weight, quantized)
    info = ctypes.cast(ctypes.pointer(_INFOS[form]), ctypes.c_void_p)
    return ggml.ggml_custom_4d(ctx, ggml.GGML_TYPE_F32, N, B, 1, 1, args, 2, _OP, ggml.GGML_N_TASKS_MAX, info)


@functools.cache
def agrees() -> bool:
    """Whether the kernel runs here and gives each row of a probe (a Q8_0 [63, 256] weight: a last group of
    three weight rows; 5 rows: a last pair of one) the bits ggml's one-row product gives it, asked of ggml
    itself: a CPU or build whose one-row product sums otherwise keeps ggml's."""
    if not runs():
        return False
    from fomoepy.runtime.ggml_matmul import QuantMatrix, fresh_mul_mat, probe_inputs

    raw, x = probe_inputs(Q8_0)
    w = QuantMatrix.of(raw[: 63 * ggml.ggml_row_size(Q8_0, 256)], Q8_0, (63, 256))
    got = products(w, x[:5], threads=2)
    return all(np.array_equal(got[i], fresh_mul_mat(x[i : i + 1], w, 1)[0]) for i in range(5))


def products(w, x: np.ndarray, threads: int, form: int | None = None) -> np.ndarray:
    """x [B, K] · wᵀ → [B, N] through the kernel's node in a graph of its own (the probe's, and tests')."""
    from fomoepy.runtime.ggml_dense import Graph, apart_bytes

    x = np.ascontiguousarray(x, dtype=np.float32)
    B = x.shape[0]
    g = Graph(8, apart_bytes(w, B) + 4096, threads)
    y = node(g.ctx, g.weight(w), g.input(w.n_cols, B), B, form)
    g.finish([(y, (B, w.n_rows))])
    return g.run(x, last=True)[0]
