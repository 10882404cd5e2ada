"""AMD GPU code generation without an AMD GPU: hip_kernels/ compiled to ISA for a gfx target by clang, and
each kernel's resources read back from the code object's metadata.

Why clang and not hiprtc: the run-time compiler a user gets is hiprtc from their ROCm (>= 6.4 for RDNA4);
the only hiprtc CI can have is Debian's ROCm 5.2, which aborts the process for gfx1100 and gfx1201.
Debian's clang-19 (the LLVM AMDGPU back end RDNA4 support landed in) with ROCm 5.2's HIP headers
compiles every module for gfx1200/gfx1201: the same front end and back end hiprtc drives, so register
counts, spills and occupancy are those a user's card would see, short of ROCm's newer device libraries
(`-nogpulib`: the kernels call none of them). Output is assembly (`-S`): linking a code object would need
gfx12 device libraries, which Debian does not ship.

The assembly carries, per kernel, the AMDHSA metadata (YAML between .amdgpu_metadata markers): argument
layout, register counts, spill counts, scratch and LDS sizes, wavefront size; and the back end's own
`; Occupancy:` comment (waves per SIMD).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from fomoepy.errors import FomoeError
from fomoepy.runtime import kernels

CLANG_NAMES = ("clang-19", "clang-20", "clang-21")
TARGETS = ("gfx1200", "gfx1201", "gfx1100", "gfx1030")  # RDNA4 (both dies), RDNA3, RDNA2


def find_clang() -> str:
    """A clang whose AMDGPU back end knows gfx12, or FomoeError saying how to get one."""
    for name in CLANG_NAMES:
        path = shutil.which(name)
        if path:
            return path
    raise FomoeError("no clang with gfx12 support found (needs clang >= 19: apt-get install clang-19 libamdhip64-dev)")


def hip_include_root() -> Path:
    """The --rocm-path whose include/hip/hip_runtime.h clang's HIP mode reads (Debian: /usr)."""
    for root in (Path("/usr"), Path("/opt/rocm")):
        if (root / "include" / "hip" / "hip_runtime.h").is_file():
            return root
    raise FomoeError("HIP headers not found (apt-get install libamdhip64-dev)")


def compile_command(clang: str, arch: str, source: Path, kernel_dir: Path) -> list[str]:
    # contraction off as on every other path: an fma here would be a different function from numpy's
    return [clang, "-x", "hip", f"--offload-arch={arch}", "--cuda-device-only", "-nogpulib",
            f"--rocm-path={hip_include_root()}", "-include", "hip/hip_runtime.h", "-O3", "-std=c++17",
            "-ffp-contract=off", "-I", str(kernel_dir), "-S", "-o", "-", str(source)]  # fmt: skip


def compile_to_assembly(module: str, arch: str, clang: str | None = None, kernel_dir: Path | None = None) -> str:
    """AMDGPU assembly of hip_kernels/<module>.hip for `arch`; a compile error is a KernelCompileError."""
    d = kernel_dir or kernels.kernel_dir()
    cmd = compile_command(clang or find_clang(), arch, d / f"{module}.hip", d)
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise kernels.KernelCompileError(f"{module}.hip for {arch}: clang failed:\n{run.stderr.strip()}")
    return run.stdout


@dataclass(frozen=True)
class KernelArg:
    size: int
    kind: str  # "global_buffer" (a pointer) or "by_value"


@dataclass(frozen=True)
class KernelResources:
    name: str
    target: str
    vgprs: int
    sgprs: int
    vgpr_spills: int
    sgpr_spills: int
    scratch_bytes: int  # private segment per work-item
    dynamic_stack: bool
    lds_bytes: int  # static LDS per work-group (dynamic shared memory comes on top, at launch)
    wavefront: int
    max_block: int
    occupancy: int  # waves per SIMD, from the back end
    args: tuple[KernelArg, ...]  # the explicit arguments, in order (hidden ones dropped)

    @property
    def spills(self) -> bool:
        return self.vgpr_spills > 0 or self.sgpr_spills > 0


_METADATA = re.compile(r"^\s*\.amdgpu_metadata\n(.*?)^\s*\.end_amdgpu_metadata", re.DOTALL | re.MULTILINE)
_FUNCTION = re.compile(r"^(\w+):\s*(?:;.*)?$", re.MULTILINE)
_OCCUPANCY = re.compile(r";\s*Occupancy:\s*(\d+)")


def _occupancy_by_kernel(asm: str) -> dict[str, int]:
    """The `; Occupancy: N` comment the back end writes after each function's body, keyed by function."""
    found: dict[str, int] = {}
    starts = [(m.start(), m.group(1)) for m in _FUNCTION.finditer(asm)]
    for (start, name), (end, _) in zip(starts, starts[1:] + [(len(asm), "")]):
        m = _OCCUPANCY.search(asm, start, end)
        if m:
            found[name] = int(m.group(1))
    return found


def parse_resources(asm: str) -> list[KernelResources]:
    """Every kernel of one module's assembly, with its resources and explicit argument layout."""
    m = _METADATA.search(asm)
    if not m:
        raise FomoeError("no .amdgpu_metadata block in the assembly (not an amdhsa target?)")
    meta = yaml.safe_load(m.group(1))
    target = str(meta["amdhsa.target"]).rsplit("-", 1)[-1]
    occupancy = _occupancy_by_kernel(asm)
    out = []
    for k in meta["amdhsa.kernels"]:
        args = tuple(
            KernelArg(int(a[".size"]), str(a[".value_kind"]))
            for a in k.get(".args", [])
            if not str(a[".value_kind"]).startswith("hidden_")
        )
        out.append(
            KernelResources(
                name=str(k[".name"]),
                target=target,
                vgprs=int(k[".vgpr_count"]),
                sgprs=int(k[".sgpr_count"]),
                vgpr_spills=int(k.get(".vgpr_spill_count", 0)),
                sgpr_spills=int(k.get(".sgpr_spill_count", 0)),
                scratch_bytes=int(k[".private_segment_fixed_size"]),
                dynamic_stack=bool(k.get(".uses_dynamic_stack", False)),
                lds_bytes=int(k[".group_segment_fixed_size"]),
                wavefront=int(k[".wavefront_size"]),
                max_block=int(k[".max_flat_workgroup_size"]),
                occupancy=occupancy.get(str(k[".name"]), 0),
                args=args,
            )
        )
    return out


def clang_version(clang: str) -> str:
    run = subprocess.run([clang, "--version"], capture_output=True, text=True, check=True)
    return run.stdout.splitlines()[0].strip()


def cached_assembly(source: kernels.KernelSource, arch: str, clang: str, cache_dir: Path) -> str:
    """compile_to_assembly, kept on disk keyed by the source digest (headers included), target and clang."""
    key = f"{source.name}-{arch}-{source.digest[:16]}-{re.sub(r'[^0-9A-Za-z.]+', '_', clang_version(clang))}.s"
    path = cache_dir / key
    if path.is_file():
        return path.read_text()
    asm = compile_to_assembly(source.name, arch, clang)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    tmp.write_text(asm)
    tmp.replace(path)
    return asm
