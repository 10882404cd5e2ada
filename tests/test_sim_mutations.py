"""The ops tests must catch a broken kernel: copies of hip_kernels/ with one defect each are built
for the simulated device, and the very test functions of test_gpu_ops.py must fail on them.

    a warp sum that skips its last exchange step: each row's dot product misses half its lanes
    a Q6_K decoder whose high-bit shift is wrong: every second group of 32 elements decodes wrong
    block_sum without its first barrier: a warp writes its partial sum into `scratch` while another
        warp may still read the maximum block_max left there (softmax_f32 and route_softmax_topk call
        the two in turn). The race detector names it; without the detector, a seeded warp order
        (one warp runs ahead to the next barrier) changes the router's choice.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import test_gpu_ops
import test_sim_races
from gguf import GGMLQuantizationType as T_

from fomoepy.runtime import kernels
from fomoepy.runtime.gpu import GpuBackend
from fomoepy.runtime.shim import GpuError
from fomoepy.runtime.sim.shim import configure

MUTATIONS = {
    "warp sum without its last step": (
        "compat.h",
        "for (int m = WARP / 2; m > 0; m >>= 1) v += SHFL_XOR(v, m);",
        "for (int m = WARP / 2; m > 1; m >>= 1) v += SHFL_XOR(v, m);",
    ),
    "Q6_K high bits shifted wrong": ("dequant.h", "hs = 2 * (r >> 5);", "hs = 2 * (r >> 6);"),
    "first barrier of block_sum removed": (
        "compat.h",
        "v = warp_sum(v);\n    __syncthreads();\n    if (lane == 0) scratch[warp] = v;\n    __syncthreads();\n    v = lane < n_warps ? scratch[lane] : 0.0f;",
        "v = warp_sum(v);\n    if (lane == 0) scratch[warp] = v;\n    __syncthreads();\n    v = lane < n_warps ? scratch[lane] : 0.0f;",
    ),
}


def mutant_backend(tmp_path, monkeypatch, file: str, before: str, after: str, modules: tuple[str, ...] = ()) -> GpuBackend:
    return backend(mutant_binaries(tmp_path, monkeypatch, file, before, after, modules))


def mutant_binaries(tmp_path, monkeypatch, file: str, before: str, after: str, modules: tuple[str, ...] = ()) -> dict[str, bytes]:
    """The simulator's builds of a mutated copy of hip_kernels/; `modules`: only these (a header's
    mutation changes every module, and each costs a compile)."""
    shutil.copytree(kernels.kernel_dir(), tmp_path / "kernels")
    path = tmp_path / "kernels" / file
    text = path.read_text()
    assert text.count(before) == 1, f"the mutation site moved: {before!r} in {file}"
    path.write_text(text.replace(before, after))
    monkeypatch.setenv("FOMOEPY_KERNEL_DIR", str(tmp_path / "kernels"))
    compiler = kernels.compiler_for("sim")
    return {s.name: kernels.compile_cached(compiler, s, "sim") for s in kernels.load_sources() if not modules or s.name in modules}


def backend(binaries: dict[str, bytes]) -> GpuBackend:
    dev = GpuBackend("sim", binaries=binaries)
    dev.poison = test_gpu_ops.NAN
    return dev


def test_a_warp_sum_missing_a_step_fails_the_ops_tests(tmp_path, monkeypatch):
    dev = mutant_backend(tmp_path, monkeypatch, *MUTATIONS["warp sum without its last step"])
    for qtype in (T_.F32, T_.Q4_K):
        with pytest.raises(AssertionError):
            test_gpu_ops.test_linear_equals_dequantised_matmul(dev, qtype, 1)
    with pytest.raises(AssertionError):
        test_gpu_ops.test_rms_norm_l2_norm_softmax_rows(dev)


def test_a_wrong_q6_k_shift_fails_the_ops_tests(tmp_path, monkeypatch):
    dev = mutant_backend(tmp_path, monkeypatch, *MUTATIONS["Q6_K high bits shifted wrong"])
    with pytest.raises(AssertionError):
        test_gpu_ops.test_linear_equals_dequantised_matmul(dev, T_.Q6_K, 3)
    with pytest.raises(AssertionError):
        test_gpu_ops.test_embedding_rows_are_decoded_exactly(dev, T_.Q6_K)
    test_gpu_ops.test_linear_equals_dequantised_matmul(dev, T_.Q4_K, 3)  # the other formats are untouched


def test_the_unmutated_copy_passes(tmp_path, monkeypatch):
    """The control: the same copy without a change passes the same tests."""
    dev = mutant_backend(tmp_path, monkeypatch, "dequant.h", "hs = 2 * (r >> 5);", "hs = 2 * (r >> 5);")
    test_gpu_ops.test_linear_equals_dequantised_matmul(dev, T_.Q6_K, 3)
    test_gpu_ops.test_embedding_rows_are_decoded_exactly(dev, T_.Q6_K)
    assert np.isfinite(np.asarray(dev.linear(np.ones((1, 256), np.float32), np.ones((2, 256), np.float32)))).all()


BARRIER_MODULES = ("norm", "router", "attention")  # test_sim_races.barrier_ops' kernels
RACE = r"shared-memory race at shared address 0x[0-9a-f]+ \({} \+ \d+\): thread \d+ writes it and thread \d+ read it"


def test_a_dropped_block_sum_barrier_is_a_race_in_softmax_and_the_router(tmp_path, monkeypatch):
    built = mutant_binaries(tmp_path, monkeypatch, *MUTATIONS["first barrier of block_sum removed"], modules=BARRIER_MODULES)
    dev = backend(built)
    with pytest.raises(GpuError, match=r"kernel softmax_f32, block \(\d+,0,0\).*" + RACE.format("scratch")):
        test_gpu_ops.test_rms_norm_l2_norm_softmax_rows(dev)
    dev = backend(built)  # the same mutant, on streams not failed yet
    with pytest.raises(GpuError, match=r"kernel route_softmax_topk, block \(0,0,0\).*" + RACE.format("sv")):
        test_gpu_ops.test_router_softmax_topk_renormalised(dev, 1, 512, 10)


def test_without_the_race_detector_a_seeded_warp_order_shows_the_dropped_barrier(tmp_path, monkeypatch):
    monkeypatch.setenv("FOMOEPY_SIM_RACECHECK", "0")
    dev = mutant_backend(tmp_path, monkeypatch, *MUTATIONS["first barrier of block_sum removed"], modules=BARRIER_MODULES)
    test_gpu_ops.test_router_softmax_topk_renormalised(dev, 1, 512, 10)  # index order hides it, as the issue found
    before = configure()
    try:
        with pytest.raises(AssertionError, match="differs under warp order"):
            test_sim_races.assert_order_independent(dev, lambda seed: configure(order_seed=seed))
    finally:
        configure(**before)
