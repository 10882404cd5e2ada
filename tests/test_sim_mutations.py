"""The ops tests must catch a broken kernel: copies of hip_kernels/ with one defect each are built
for the simulated device, and the very test functions of test_gpu_ops.py must fail on them.

    a warp sum that skips its last exchange step: each row's dot product misses half its lanes
    a Q6_K decoder whose high-bit shift is wrong: every second group of 32 elements decodes wrong
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import test_gpu_ops
from gguf import GGMLQuantizationType as T_

from fomoepy.runtime import kernels
from fomoepy.runtime.gpu import GpuBackend

MUTATIONS = {
    "warp sum without its last step": (
        "compat.h",
        "for (int m = WARP / 2; m > 0; m >>= 1) v += SHFL_XOR(v, m);",
        "for (int m = WARP / 2; m > 1; m >>= 1) v += SHFL_XOR(v, m);",
    ),
    "Q6_K high bits shifted wrong": ("dequant.h", "hs = 2 * (r >> 5);", "hs = 2 * (r >> 6);"),
}


def mutant_backend(tmp_path, monkeypatch, file: str, before: str, after: str) -> GpuBackend:
    shutil.copytree(kernels.kernel_dir(), tmp_path / "kernels")
    path = tmp_path / "kernels" / file
    text = path.read_text()
    assert text.count(before) == 1, f"the mutation site moved: {before!r} in {file}"
    path.write_text(text.replace(before, after))
    monkeypatch.setenv("FOMOEPY_KERNEL_DIR", str(tmp_path / "kernels"))
    dev = GpuBackend("sim")
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
