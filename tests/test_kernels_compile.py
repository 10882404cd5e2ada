"""Every kernel source compiles with both run-time compilers, with no GPU: NVRTC for sm_90 (NVIDIA)
and hiprtc for gfx1030 (AMD RDNA, wave32). A construct of one vendor only fails here.

The compilers come from tools/setup_kernel_compilers.sh (pip's nvidia-cuda-nvrtc; Debian's ROCm
hiprtc unpacked into a cache directory); a test skips only when its compiler cannot be had at all.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fomoepy import quants
from fomoepy.errors import FomoeError, UnsupportedQuantType
from fomoepy.runtime import kernels

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "tools" / "setup_kernel_compilers.sh"
SOURCES = kernels.load_sources()
CUDA_ARCH = "sm_90"
HIP_ARCH = "gfx1030"  # RDNA2, wave32; the newest gfx target Debian's ROCm 5.2 device libraries know


@pytest.fixture(scope="session")
def compilers() -> dict[str, kernels.Compiler | str]:
    """{"cuda": compiler or why not, "hip": compiler or why not}."""
    found: dict[str, kernels.Compiler | str] = {}
    lib_dir = os.environ.get("FOMOEPY_HIPRTC_DIR")
    if lib_dir is None:
        run = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=900)
        lines = dict(line.split(": ", 1) for line in run.stdout.splitlines() if ": " in line)
        lib_dir = lines.get("hiprtc")
        if run.returncode != 0:
            print(run.stderr, file=sys.stderr)
    try:
        found["cuda"] = kernels.NvrtcCompiler()
    except FomoeError as e:
        found["cuda"] = f"NVRTC unavailable: {e}"
    try:
        found["hip"] = kernels.ctypes_hiprtc(lib_dir) if lib_dir else "hiprtc unavailable: setup script failed"
    except FomoeError as e:
        found["hip"] = f"hiprtc unavailable: {e}"
    return found


@pytest.fixture(scope="session")
def binaries(compilers) -> dict[tuple[str, str], bytes | Exception]:
    """Every (vendor, source) compiled once, both compilers at a time (they release the GIL)."""
    jobs = {}
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        for vendor, arch in (("cuda", CUDA_ARCH), ("hip", HIP_ARCH)):
            compiler = compilers[vendor]
            if isinstance(compiler, str):
                continue
            for src in SOURCES:
                jobs[(vendor, src.name)] = pool.submit(compiler.compile, src, arch)
        results: dict[tuple[str, str], bytes | Exception] = {}
        for key, future in jobs.items():
            try:
                results[key] = future.result()
            except Exception as e:  # reported by the test of that source
                results[key] = e
    return results


def _binary(compilers, binaries, vendor: str, name: str) -> bytes:
    if isinstance(compilers[vendor], str):
        pytest.skip(compilers[vendor])
    result = binaries[(vendor, name)]
    if isinstance(result, Exception):
        raise result
    return result


def _declared_kernels() -> dict[str, str]:
    """Kernel name -> parameter letters, read from the KERNEL declarations (macros expanded per type)."""
    letters = {"i64": "l", "int": "i", "float": "f", "double": "d", "Dims4": "D"}

    def signature(params: str) -> str:
        out = ""
        for p in params.split(","):
            p = p.replace("\\", " ").strip()
            out += "p" if "*" in p else letters[p.rsplit(None, 1)[0].replace("const ", "").strip()]
        return out

    found = {}
    decl = re.compile(r"KERNEL void\s+(?:LAUNCH_BOUNDS\([^)]*\)\s*)?([\w#]+)\s*\(([^)]*)\)", re.DOTALL)
    for src in SOURCES:
        for name, params in decl.findall(src.text.replace("\\\n", " ")):
            sig = signature(params)
            if "##name" in name:
                for suffix in kernels.KERNEL_TYPE_NAMES.values():
                    found[name.replace("##name##", suffix).replace("##name", suffix)] = sig
            else:
                found[name] = sig
    return found


@pytest.mark.parametrize("name", [s.name for s in SOURCES])
def test_compiles_with_nvrtc_for_sm90(compilers, binaries, name):
    assert _binary(compilers, binaries, "cuda", name)


@pytest.mark.parametrize("name", [s.name for s in SOURCES])
def test_compiles_with_hiprtc_for_wave32_rdna(compilers, binaries, name):
    assert _binary(compilers, binaries, "hip", name)


@pytest.mark.parametrize("name", [s.name for s in SOURCES])
def test_no_kernel_keeps_a_table_in_constant_memory(compilers, binaries, name):
    """A __constant__ array lands in the CUBIN's bank-3 section. NVIDIA serves a warp's reads of it one
    address at a time, so a lookup by each lane's own index stalls: MXFP4's code table did, and held its
    kernels to 0.03-0.04 of an H200's copy bandwidth (bench/gpu_kernels.py). Tables live in registers
    (dequant.h's mxfp4_value)."""
    assert b".nv.constant3" not in _binary(compilers, binaries, "cuda", name)


# ptxas -v's account of each function (a kernel, or a library function it calls): its name's line, then
# its stack frame and spills
_ENTRY = re.compile(r"Function properties for (\w+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
# rope computes each angle in double (pow, sincos: library calls with a frame of their own), by design
_FRAMED = {"rope_neox_f32"}


@pytest.fixture(scope="session")
def sm90_frames(compilers) -> dict[str, tuple[int, int, int]]:
    """Function name -> (stack frame, spill stores, spill loads) bytes on sm_90, from ptxas -v."""
    if isinstance(compilers["cuda"], str):
        pytest.skip(compilers["cuda"])
    frames: dict[str, tuple[int, int, int]] = {}
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        for log in pool.map(lambda src: compilers["cuda"].resource_report(src, CUDA_ARCH), SOURCES):
            entry = None
            for line in log.splitlines():
                if m := _ENTRY.search(line):
                    entry = m.group(1)
                elif (m := _FRAME.search(line)) and entry:
                    frames[entry] = (int(m[1]), int(m[2]), int(m[3]))
                    entry = None
    return frames


def test_no_kernel_works_in_local_memory_on_sm90(sm90_frames):
    """A stack frame or a spill lives in local memory: loads and stores beside a kernel's own, where ncu
    found the expert kernels bound by the L1's instruction queue. Their work item, copied whole so that a
    lane's pair count could index it, took 64 bytes there until each pair was chosen between two fixed
    indices (the same pair, so the same bits). Only rope's double-precision angle keeps a frame."""
    assert set(kernels.KERNEL_SIGNATURES) <= set(sm90_frames), "ptxas's report names every kernel"
    kernels_framed = {name for name in kernels.KERNEL_SIGNATURES if any(sm90_frames[name])}
    assert kernels_framed == _FRAMED


@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_every_kernel_of_the_launch_table_is_in_a_binary(compilers, binaries, vendor):
    blobs = [_binary(compilers, binaries, vendor, s.name) for s in SOURCES]
    missing = [k for k in kernels.KERNEL_SIGNATURES if not any(k.encode() + b"\0" in b for b in blobs)]
    assert not missing, f"{vendor}: kernels missing from the compiled modules: {missing}"


def test_launch_table_matches_the_kernel_declarations():
    declared = _declared_kernels()
    assert declared == kernels.KERNEL_SIGNATURES


def test_a_wave64_target_is_refused(compilers):
    if isinstance(compilers["hip"], str):
        pytest.skip(compilers["hip"])
    with pytest.raises(kernels.KernelCompileError, match="wave32"):
        compilers["hip"].compile(next(s for s in SOURCES if s.name == "norm"), "gfx906")


@pytest.mark.parametrize("vendor,construct", [
    ("hip", "__shfl_xor_sync(0xffffffffu, x[0], 1, 32)"),  # CUDA only
    ("cuda", "__shfl_xor(x[0], 1, 32)"),  # HIP only
])  # fmt: skip
def test_a_one_vendor_construct_fails_to_compile(compilers, vendor, construct):
    if isinstance(compilers[vendor], str):
        pytest.skip(compilers[vendor])
    src = kernels.KernelSource("probe", f'#include "compat.h"\nKERNEL void k(float* x) {{ x[0] = {construct}; }}\n', SOURCES[0].headers)
    with pytest.raises(kernels.KernelCompileError):
        compilers[vendor].compile(src, CUDA_ARCH if vendor == "cuda" else HIP_ARCH)


def test_every_supported_tensor_type_has_kernels_and_others_are_refused():
    assert set(kernels.KERNEL_TYPE_NAMES) == set(quants.SUPPORTED)
    assert kernels.kernel_name("mv", quants.GGMLQuantizationType.Q4_K) == "mv_q4_k"
    with pytest.raises(UnsupportedQuantType, match="blk.0.ffn_down_exps.weight has type Q2_K, which fomoepy does not support"):
        kernels.kernel_name("mv", quants.GGMLQuantizationType.Q2_K, "blk.0.ffn_down_exps.weight")


def test_the_kernel_formats_are_the_quant_table():
    """FOR_EACH_FORMAT in dequant.h and each Fmt struct's BLOCK and BYTES against quants.FORMATS."""
    text = (kernels.kernel_dir() / "dequant.h").read_text()
    listed = dict(re.findall(r"X\((\w+), (Fmt\w+)\)", text))
    assert sorted(listed) == sorted(f.kernel_suffix for f in quants.FORMATS.values())
    for fmt in quants.FORMATS.values():
        struct = re.search(rf"struct {listed[fmt.kernel_suffix]} {{\s*static constexpr int BLOCK = (\d+), BYTES = (\d+);", text)
        assert struct, fmt.name
        assert (int(struct[1]), int(struct[2])) == (fmt.block_size, fmt.type_size), fmt.name


class _CountingCompiler:
    vendor, version = "cuda", "test-1"

    def __init__(self):
        self.calls = 0

    def options(self, arch):
        return [f"--arch={arch}"]

    def compile(self, source, arch):
        self.calls += 1
        return f"{source.name}:{arch}".encode()


def test_binaries_are_cached_by_source_arch_and_compiler(tmp_path):
    c = _CountingCompiler()
    src = SOURCES[0]
    assert kernels.compile_cached(c, src, "sm_90", tmp_path) == f"{src.name}:sm_90".encode()
    kernels.compile_cached(c, src, "sm_90", tmp_path)
    assert c.calls == 1
    kernels.compile_cached(c, src, "sm_89", tmp_path)
    changed = kernels.KernelSource(src.name, src.text + "\n// edited\n", src.headers)
    kernels.compile_cached(c, changed, "sm_90", tmp_path)
    c.version = "test-2"
    kernels.compile_cached(c, src, "sm_90", tmp_path)
    assert c.calls == 4
    assert len(list(tmp_path.rglob("*.bin"))) == 4
