"""RDNA code generation in CI: every hip_kernels/ module compiled to ISA for RDNA4 (gfx1200, gfx1201),
RDNA3 (gfx1100) and RDNA2 (gfx1030) by clang's AMDGPU back end, and each kernel's code object checked:
its argument layout against KERNEL_SIGNATURES (what the launch packs), wave32, no register spills, and an
occupancy floor per kernel family.

Occupancy floors (waves per SIMD; RDNA's hardware limit is 16). The kernels stream weights from memory,
so waves in flight are what hides DRAM latency:
  decode kernels (matvec and expert t1, down, embeddings, norms, RoPE, attention, router, elementwise)
      >= 12 on RDNA3/4, >= 8 on RDNA2 (half the registers per SIMD lane of a wave32 at the same occupancy)
  prefill tiles (*_t8: 8 tokens' accumulators per thread, traded for reading the weights once)
      >= 8 on RDNA3/4, >= 6 on RDNA2
Scratch: a spill is a failure everywhere. Private memory that is not a spill is allowed only where listed
below with its reason.

clang-19 and the HIP headers come from tools/setup_kernel_compilers.sh (Debian's packages); the tests skip,
saying why, only where they cannot be had.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fomoepy.devtools import amdgpu_codegen as ag
from fomoepy.errors import FomoeError
from fomoepy.runtime import kernels
from fomoepy.runtime.shim import PARAM_TYPES

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # compiles 8 modules for 4 targets (cached on disk after the first run)

RDNA2 = "gfx1030"
DECODE_FLOOR = {RDNA2: 8}  # default 12
PREFILL_FLOOR = {RDNA2: 6}  # default 8
PRIVATE_MEMORY_ALLOWED = {
    # sincos(double) returns its two results through pointers, i.e. 16 B of stack, while the device
    # library's sincos stays an external call (no device libraries here: -nogpulib)
    "rope_neox_f32": 16,
}


@pytest.fixture(scope="session")
def clang() -> str:
    if shutil.which("clang-19") is None and os.geteuid() == 0:
        subprocess.run(["bash", str(ROOT / "tools" / "setup_kernel_compilers.sh")], capture_output=True, timeout=900)
    try:
        clang = ag.find_clang()
        ag.hip_include_root()
    except FomoeError as e:
        pytest.skip(str(e))
    return clang


@pytest.fixture(scope="session")
def resources(clang) -> dict[str, list[ag.KernelResources]]:
    """{target: every kernel's resources}, all modules compiled once (cached on disk across runs)."""
    cache = kernels.cache_root().parent / "amdgpu-asm"
    sources = kernels.load_sources()
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        jobs = {(t, s.name): pool.submit(ag.cached_assembly, s, t, clang, cache) for t in ag.TARGETS for s in sources}
    return {t: [k for s in sources for k in ag.parse_resources(jobs[t, s.name].result())] for t in ag.TARGETS}


@pytest.mark.parametrize("target", ag.TARGETS)
def test_every_kernel_is_generated_for_the_target(resources, target):
    names = [k.name for k in resources[target]]
    assert sorted(names) == sorted(kernels.KERNEL_SIGNATURES), set(names) ^ set(kernels.KERNEL_SIGNATURES)
    assert {k.target for k in resources[target]} == {target}


@pytest.mark.parametrize("target", ag.TARGETS)
def test_argument_layout_is_what_the_launch_packs(resources, target):
    import ctypes

    for k in resources[target]:
        signature = kernels.KERNEL_SIGNATURES[k.name]
        want = [ag.KernelArg(ctypes.sizeof(PARAM_TYPES[c]), "global_buffer" if c == "p" else "by_value") for c in signature]
        assert list(k.args) == want, f"{k.name} ({target}): code object takes {k.args}, launch packs {signature}"


@pytest.mark.parametrize("target", ag.TARGETS)
def test_wave32_and_no_spills(resources, target):
    for k in resources[target]:
        assert k.wavefront == 32, f"{k.name} ({target}) compiled for wave{k.wavefront}"
        assert not k.spills, f"{k.name} ({target}) spills {k.vgpr_spills} VGPRs, {k.sgpr_spills} SGPRs"
        allowed = PRIVATE_MEMORY_ALLOWED.get(k.name, 0)
        assert k.scratch_bytes <= allowed, f"{k.name} ({target}) uses {k.scratch_bytes} B of scratch per lane"


@pytest.mark.parametrize("target", ag.TARGETS)
def test_occupancy_floors(resources, target):
    for k in resources[target]:
        prefill = k.name.endswith("_t8")
        floor = (PREFILL_FLOOR if prefill else DECODE_FLOOR).get(target, 8 if prefill else 12)
        assert k.occupancy >= floor, f"{k.name} ({target}): occupancy {k.occupancy} < {floor} waves per SIMD"


def test_parse_reads_a_spill_and_a_lost_argument(resources):
    """The checks above read real fields: a spill count and a missing argument in the metadata are seen."""
    asm = ag.compile_to_assembly("norm", "gfx1201")
    spilled = asm.replace(".vgpr_spill_count: 0", ".vgpr_spill_count: 3", 1)
    assert any(k.spills for k in ag.parse_resources(spilled))
    first = next(k for k in ag.parse_resources(asm))
    assert len(first.args) == len(kernels.KERNEL_SIGNATURES[first.name])
