"""compat.h's vendor branches are code that runs: the simulator defines both vendors' intrinsics and is
built once with CUDA's spellings (what every other simulated test runs) and once with HIP's (the
FOMOE_HIP branch: __shfl_xor and __shfl, without a mask). Both builds must give the same bits, op by
op, on every kernel that shuffles. Through the real bindings, the HIP stand-in runs the HIP-spelled
build and the CUDA stand-in the CUDA-spelled one (test_standin_bindings.py).

What has one spelling for every compiler has no branch: the float16 decoder is integer arithmetic
(NVRTC has no _Float16), checked on all 65536 patterns in test_gpu_ops.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T_
from sim_backend import sim_backend
from test_sim_device import Device, build
from test_sim_races import barrier_ops

from fomoepy import quants
from fomoepy.runtime import kernels
from fomoepy.runtime.gpu import GpuBackend
from fomoepy.runtime.sim.build import SimCompiler

F32 = np.float32


@pytest.fixture(scope="module")
def hip_spelled() -> GpuBackend:
    return GpuBackend("sim", binaries=kernels.compile_all(SimCompiler(spelling="hip"), "sim"))


def shuffling_ops(dev) -> list[np.ndarray]:
    """Warp sums and maxima in every shape the kernels use them: matvec rows, block reductions, the
    router's argmax, attention's per-warp scores, the delta rule's dot products."""
    rng = np.random.default_rng(21)
    outs = barrier_ops(dev)
    x = rng.standard_normal((3, 512)).astype(F32)
    for qtype in (T_.F32, T_.F16, T_.Q8_0, T_.Q4_K):
        raw = quants.quantize(rng.standard_normal((70, 512)).astype(F32) * 0.05, qtype)
        outs.append(np.asarray(dev.linear(x, dev.weight_from_bytes(raw, qtype, (70, 512), "w"))))
    T, Hv, d = 2, 4, 128
    q, k = (rng.standard_normal((T, Hv, d)).astype(F32) * 0.1 for _ in range(2))
    v, g, beta = rng.standard_normal((T, Hv, d)).astype(F32), -np.abs(rng.standard_normal((T, Hv)).astype(F32)), np.full((T, Hv), 0.5, F32)
    o, S = dev.delta_rule(q, k, v, g, beta, rng.standard_normal((Hv, d, d)).astype(F32) * 0.1)
    return [*outs, np.asarray(o), np.asarray(S)]


def test_hips_spellings_compute_the_same_bits_as_cudas(hip_spelled):
    for i, (a, b) in enumerate(zip(shuffling_ops(sim_backend()), shuffling_ops(hip_spelled), strict=True)):
        assert np.array_equal(a, b, equal_nan=True), f"op {i} differs between the CUDA- and HIP-spelled builds"


def test_hips_broadcast_shuffle_too():
    """SHFL (a broadcast; no hip_kernels/ kernel uses it yet) through the test kernel that does."""
    x = np.arange(128, dtype=F32) / 7
    results = []
    for spelling in ("cuda", "hip"):
        d = Device(build(spelling=spelling))
        out, other = d.empty(128), d.empty(128)
        d.launch("warp_rounds", (1,), (128,), d.upload(x), out, other)
        results.append((d.download(out, 128), d.download(other, 128)))
        d.close()
    for a, b in zip(*results):
        assert np.array_equal(a, b)
