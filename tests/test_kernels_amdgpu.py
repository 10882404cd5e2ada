"""RDNA code generation in CI: every hip_kernels/ module compiled to ISA for RDNA4 (gfx1200, gfx1201),
RDNA3 (gfx1100) and RDNA2 (gfx1030) by clang's AMDGPU back end, the AMD device libraries linked as
hiprtc links them, and each kernel's code object checked: no call left (threadIdx, blockDim and the math
functions are device-library code that must be inlined, or every figure describes code no run-time
compiler produces) and no dynamic stack; its argument layout against KERNEL_SIGNATURES (what the launch
packs); wave32; no register spills or scratch; no flat (generic-address) memory access; and an occupancy
floor.

Occupancy floor (waves per SIMD32), one per target, from Little's law. Every kernel here streams from
DRAM: decode kernels (t1, norms, RoPE, attention, router, elementwise) read each byte once, and the
prefill tiles (*_t8) do about 32 f32 operations per Q4_K weight byte (8 tokens x 2 flops x 1.78 weights
per byte = 28, plus decoding), near each card's single-issue f32 operations per DRAM byte (28 to 40 for
the cards below): neither is limited by arithmetic alone, so both must hide DRAM latency. To keep DRAM
busy, each SIMD must hold (bandwidth / SIMDs) x latency bytes in flight; a wave waiting on its weights
holds at least one 16-byte load per lane (512 B), and one that keeps more in flight needs fewer waves,
so the floor takes the least:
    floor = ceil(bandwidth / SIMDs x LOADED_LATENCY / 512 B)
for the card of each target with the most bandwidth per SIMD (SIMDs = 2 per CU; it needs the most
waves), and LOADED_LATENCY = 1 us, an assumption: a DRAM read on RDNA2-4 takes about 0.5-0.7 us
unloaded (published pointer-chase measurements, not measured here), and queueing near full bandwidth adds
about as much again. That gives 12 waves on gfx1201 (RX 9070: 5.8 GB/s per SIMD), 10 on gfx1200 and
gfx1100 (about 5 GB/s) and 9 on gfx1030 (RX 6800: 4.3 GB/s). The hardware's own limit is 16; occupancy
is set by VGPRs (RDNA3/4 have 1536 per SIMD lane, allocated in blocks of 24: <= 120 VGPRs for 12 waves,
<= 144 for 10; RDNA2 has 1024 in blocks of 16: <= 112 for 9) and by static LDS (128 KB per WGP of 4
SIMDs).

clang-19, the HIP headers and Debian's device libraries come from tools/setup_kernel_compilers.sh
(Debian's packages); the tests skip, saying why, only where they cannot be had.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fomoepy.devtools import amdgpu_codegen as ag
from fomoepy.devtools import amdgpu_device_libs as devlibs
from fomoepy.errors import FomoeError
from fomoepy.runtime import kernels
from fomoepy.runtime.shim import PARAM_TYPES

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # compiles 8 modules for 4 targets (cached on disk after the first run)

# target: (its card with the most DRAM bandwidth per SIMD, GB/s, SIMD32s = 2 per CU), from the vendor's
# specifications; e.g. the RX 9070 has the 9070 XT's memory for 56 CUs instead of 64
CARDS = {
    "gfx1201": ("RX 9070", 644.6, 2 * 56),
    "gfx1200": ("RX 9060 XT", 322.3, 2 * 32),
    "gfx1100": ("RX 7900 XTX", 960.0, 2 * 96),
    "gfx1030": ("RX 6800", 512.0, 2 * 60),
}
LOADED_LATENCY_S = 1e-6
WAVE_BYTES_IN_FLIGHT = 32 * 16  # one global_load_b128 per lane of a wave32


def occupancy_floor(target: str) -> int:
    """Waves per SIMD that keep (bandwidth / SIMDs) x latency bytes in flight (Little's law, see above)."""
    _, gb_per_s, simds = CARDS[target]
    return math.ceil(gb_per_s * 1e9 / simds * LOADED_LATENCY_S / WAVE_BYTES_IN_FLIGHT)


def _toolchain() -> str:
    clang = ag.find_clang()
    ag.hip_include_root()
    devlibs.library_dir()
    return clang


def test_floors_are_the_stated_derivation():
    assert {t: occupancy_floor(t) for t in ag.TARGETS} == {"gfx1200": 10, "gfx1201": 12, "gfx1100": 10, "gfx1030": 9}


@pytest.fixture(scope="session")
def clang() -> str:
    try:
        return _toolchain()
    except FomoeError:
        if os.geteuid() == 0:
            subprocess.run(["bash", str(ROOT / "tools" / "setup_kernel_compilers.sh")], capture_output=True, timeout=900, check=False)
    try:
        return _toolchain()
    except FomoeError as e:
        pytest.skip(str(e))


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
def test_no_calls_and_no_dynamic_stack(resources, target):
    """Linked device libraries leave nothing to call: an unlinked __ockl_get_local_id is an s_swappc_b64
    with the ABI's worst-case registers and a dynamic stack, which no run-time compiler produces."""
    for k in resources[target]:
        assert k.calls == 0 and not k.library_calls, f"{k.name} ({target}) makes {k.calls} calls: {k.library_calls}"
        assert not k.dynamic_stack, f"{k.name} ({target}) uses a dynamic stack"


@pytest.mark.parametrize("target", ag.TARGETS)
def test_every_access_is_to_global_memory_by_name(resources, target):
    """No flat (generic-address) load or store: each also waits on the LDS and scalar counter and takes no
    scalar base. The expert kernels read their matrices, and the batched kernels each row's cache or
    state, at addresses from device memory; made global pointers (compat.h's global_ptr), the RDNA4 expert
    kernels went from flat to global loads, about half as many (gate/up Q4_K: 52 -> 28)."""
    for k in resources[target]:
        assert k.flat_accesses == 0, f"{k.name} ({target}) makes {k.flat_accesses} flat accesses"


@pytest.mark.parametrize("target", ag.TARGETS)
def test_wave32_and_no_spills(resources, target):
    for k in resources[target]:
        assert k.wavefront == 32, f"{k.name} ({target}) compiled for wave{k.wavefront}"
        assert not k.spills, f"{k.name} ({target}) spills {k.vgpr_spills} VGPRs, {k.sgpr_spills} SGPRs"
        assert k.scratch_bytes == 0, f"{k.name} ({target}) uses {k.scratch_bytes} B of scratch per lane"


@pytest.mark.parametrize("target", ag.TARGETS)
def test_occupancy_floors(resources, target):
    floor = occupancy_floor(target)
    for k in resources[target]:
        assert k.occupancy >= floor, f"{k.name} ({target}): occupancy {k.occupancy} < {floor} waves per SIMD"


def test_parse_reads_a_spill_a_call_and_a_lost_argument(clang):
    """The checks above read real fields: a spill count, the calls and dynamic stack of an unlinked
    compile, and a missing argument in the metadata are seen."""
    asm = ag.compile_to_assembly("norm", "gfx1201", clang)
    spilled = asm.replace(".vgpr_spill_count: 0", ".vgpr_spill_count: 3", 1)
    assert any(k.spills for k in ag.parse_resources(spilled))
    first = next(k for k in ag.parse_resources(asm))
    assert len(first.args) == len(kernels.KERNEL_SIGNATURES[first.name])
    unlinked = ag.parse_resources(ag.compile_to_assembly("norm", "gfx1201", clang, libraries=[]))
    assert all(k.calls > 0 and "__ockl_get_local_id" in k.library_calls and k.dynamic_stack for k in unlinked)


def _driver_libraries(clang: str, arch: str) -> list[str]:
    """The bitcode clang's own driver links for a HIP compile with the device libraries at hand."""
    cmd = [clang, "-###", "-x", "hip", f"--offload-arch={arch}", "--cuda-device-only",
           f"--rocm-device-lib-path={devlibs.library_dir()}", f"--rocm-path={ag.hip_include_root()}",
           f"-mcode-object-version={devlibs.CODE_OBJECT_VERSION}", "-S", "-o", "-",
           str(kernels.kernel_dir() / "norm.hip")]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return re.findall(r'"-mlink-builtin-bitcode" "([^"]+)"', run.stderr)


def test_linked_libraries_are_the_drivers_choice(clang):
    """For gfx1030, whose control libraries Debian ships, the list is exactly what clang's driver links;
    for the others it differs only by the oclc_isa_version file."""
    want = _driver_libraries(clang, "gfx1030")
    assert [str(p) for p in devlibs.libraries("gfx1030", clang)] == want
    for arch in ag.TARGETS:
        got = [p.name for p in devlibs.libraries(arch, clang)]
        assert got == [Path(w).name.replace("1030", arch.removeprefix("gfx")) for w in want], arch


def _isa_constant(clang: str, bitcode: Path) -> str:
    cmd = [clang, "-nogpulib", "-target", "amdgcn-amd-amdhsa", "-x", "ir", "-S", "-emit-llvm", "-o", "-", str(bitcode)]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return next(line for line in text.splitlines() if line.startswith("@__oclc_ISA_version"))


def test_written_isa_version_is_debians_form(clang, tmp_path):
    """The oclc_isa_version written for gfx11/gfx12 is, for gfx1030, Debian's own file line for line, and
    isa_version() gives the constant of every target Debian ships one for."""
    written = tmp_path / "oclc_isa_version_1030.bc"
    devlibs.write_isa_version_library("gfx1030", clang, written)
    assert _isa_constant(clang, written) == _isa_constant(clang, devlibs.library_dir() / written.name)
    shipped = sorted(devlibs.library_dir().glob("oclc_isa_version_*.bc"))
    assert len(shipped) > 10
    for path in shipped:
        arch = "gfx" + path.stem.removeprefix("oclc_isa_version_")
        assert f"i32 {devlibs.isa_version(arch)}," in _isa_constant(clang, path), arch
