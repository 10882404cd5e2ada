"""ggml-python's ctypes bindings describe the ggml library they load: the structs and enumerations the cpu
backend reaches through them read and write what the library does.

The installed library may be ggml-python's own ggml or llama.cpp's, built under the same bindings by
tools/build_ggml.sh; the bindings were written for the first. Their headers differ in places fomoepy does
not reach (new ops and types appended or inserted after the ones used here, a parameter of
`ggml_ssm_scan`); these checks fail if a difference reaches the parts it does."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from float32_bounds import U

from fomoepy.runtime import ggml_threads

ggml_threads.choose(1, lambda: 1)
import ggml  # noqa: E402  (after the thread policy: the OpenMP runtime reads it once)


@pytest.fixture
def ctx():
    c = ggml.ggml_init(ggml.ggml_init_params(mem_size=16 * ggml.ggml_tensor_overhead() + 4096, mem_buffer=None, no_alloc=True))
    yield c
    ggml.ggml_free(c)


def test_the_tensor_struct_is_the_librarys(ctx):
    # fields the backend reads (ne, nb, data, src) agree with the library's own accessors
    t = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_Q4_K, 512, 3)
    c = t.contents
    assert (c.type, c.ne[0], c.ne[1], c.ne[2], c.ne[3]) == (ggml.GGML_TYPE_Q4_K, 512, 3, 1, 1)
    assert c.nb[1] == ggml.ggml_row_size(ggml.GGML_TYPE_Q4_K, 512) and ggml.ggml_nbytes(t) == 3 * c.nb[1]
    buf = np.zeros(ggml.ggml_nbytes(t), np.uint8)
    c.data = buf.ctypes.data
    assert ggml.ggml_get_data(t) == buf.ctypes.data
    x = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, 512, 2)
    y = ggml.ggml_mul_mat(ctx, t, x)
    src = y.contents.src
    assert ctypes.addressof(src[0].contents) == ctypes.addressof(c) and ctypes.addressof(src[1].contents) == ctypes.addressof(x.contents)
    assert (y.contents.ne[0], y.contents.ne[1]) == (3, 2)


def test_the_types_the_backend_names_are_the_librarys():
    names = {ggml.GGML_TYPE_F32: b"f32", ggml.GGML_TYPE_I32: b"i32", ggml.GGML_TYPE_Q8_0: b"q8_0", ggml.GGML_TYPE_Q4_K: b"q4_K",
             ggml.GGML_TYPE_Q5_K: b"q5_K", ggml.GGML_TYPE_Q6_K: b"q6_K"}  # fmt: skip
    assert {t: ggml.ggml_type_name(t) for t in names} == names


def test_a_graph_computes_through_the_plan_struct(ctx):
    # ggml_graph_plan returns a struct by value and ggml_graph_compute reads it: its layout must match
    big = ggml.ggml_init(ggml.ggml_init_params(mem_size=1 << 20, mem_buffer=None, no_alloc=False))
    try:
        a = ggml.ggml_new_tensor_2d(big, ggml.GGML_TYPE_F32, 4, 3)
        b = ggml.ggml_new_tensor_2d(big, ggml.GGML_TYPE_F32, 4, 2)
        av, bv = np.arange(12, dtype=np.float32).reshape(3, 4), np.ones((2, 4), np.float32)
        ctypes.memmove(ggml.ggml_get_data(a), av.ctypes.data, av.nbytes)
        ctypes.memmove(ggml.ggml_get_data(b), bv.ctypes.data, bv.nbytes)
        y = ggml.ggml_soft_max_ext(big, ggml.ggml_mul_mat(big, a, b), None, 0.5, 0.0)
        gf = ggml.ggml_new_graph(big)
        ggml.ggml_build_forward_expand(gf, y)
        plan = ggml.ggml_graph_plan(gf, 2, None)
        work = np.zeros(max(plan.work_size, 1), np.uint8)
        plan.work_data = ctypes.cast(work.ctypes.data, ctypes.POINTER(ctypes.c_uint8))
        assert plan.n_threads == 2
        assert ggml.ggml_graph_compute(gf, ctypes.byref(plan)) == 0
        got = np.ctypeslib.as_array(ctypes.cast(ggml.ggml_get_data(y), ctypes.POINTER(ctypes.c_float)), shape=(2, 3))
        z = 0.5 * (av @ bv.T).T
        want = np.exp(z - z.max(axis=1, keepdims=True))
        want /= want.sum(axis=1, keepdims=True)
        # the products and the scaled, max-shifted scores are small integers and halves: exact in float32;
        # ggml's exp is within 2 ulp (4u), its sum of the three is in double, and 1/sum and the product
        # each round once (u each): each probability within 6u of the exact one, relatively
        assert np.allclose(got, want, rtol=6 * U, atol=0)
    finally:
        ggml.ggml_free(big)
