"""AMD GPU code generation without an AMD GPU: hip_kernels/ compiled to ISA for a gfx target by clang, and
each kernel's resources read back from the code object's metadata.

Why clang and not hiprtc: the run-time compiler a user gets is hiprtc from their ROCm (>= 6.4 for RDNA4);
the only hiprtc CI can have is Debian's ROCm 5.2, which aborts the process for gfx1100 and gfx1201.
Debian's clang-19 (the LLVM AMDGPU back end RDNA4 support landed in) with ROCm 5.2's HIP headers
compiles every module for gfx1200/gfx1201: the same front end and back end hiprtc drives. The device
libraries are linked as hiprtc links them (amdgpu_device_libs.py): without them threadIdx and blockDim
are calls, and every figure would describe call-laden code no run-time compiler produces. What remains
different from a user's ROCm is the device libraries' version (Debian's 5.2). Output is assembly (`-S`).

The assembly carries, per kernel, the AMDHSA metadata (YAML between .amdgpu_metadata markers): argument
layout, register counts, spill counts, scratch and LDS sizes, wavefront size; and the back end's own
`; Occupancy:` comment (waves per SIMD).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from fomoepy.devtools import amdgpu_device_libs as devlibs
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


def compile_command(clang: str, arch: str, source: Path, kernel_dir: Path, libraries: list[Path]) -> list[str]:
    """The clang command line: -nogpulib keeps the driver from looking for its own device libraries (it
    finds none for gfx11/gfx12 in Debian's set); `libraries` are linked explicitly instead."""
    # contraction off as on every other path: an fma here would be a different function from numpy's
    return [clang, "-x", "hip", f"--offload-arch={arch}", "--cuda-device-only", "-nogpulib",
            f"--rocm-path={hip_include_root()}", f"-mcode-object-version={devlibs.CODE_OBJECT_VERSION}",
            *devlibs.link_flags(libraries), "-include", "hip/hip_runtime.h", "-O3", "-std=c++17",
            "-ffp-contract=off", "-I", str(kernel_dir), "-S", "-o", "-", str(source)]  # fmt: skip


def compile_to_assembly(
    module: str, arch: str, clang: str | None = None, kernel_dir: Path | None = None, libraries: list[Path] | None = None
) -> str:
    """AMDGPU assembly of hip_kernels/<module>.hip for `arch`, the device libraries linked (`libraries`,
    default: devlibs.libraries(arch)); a compile error is a KernelCompileError."""
    d = kernel_dir or kernels.kernel_dir()
    clang = clang or find_clang()
    libs = devlibs.libraries(arch, clang) if libraries is None else libraries
    cmd = compile_command(clang, arch, d / f"{module}.hip", d, libs)
    run = subprocess.run(cmd, capture_output=True, text=True, check=False)
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
    calls: int = 0  # s_swappc_b64 in the kernel's body: calls to functions not inlined
    library_calls: tuple[str, ...] = ()  # device-library functions (__ockl_*, __ocml_*) the body names
    flat_accesses: int = 0  # flat_* loads and stores: memory reached through a generic address

    @property
    def spills(self) -> bool:
        return self.vgpr_spills > 0 or self.sgpr_spills > 0


_METADATA = re.compile(r"^\s*\.amdgpu_metadata\n(.*?)^\s*\.end_amdgpu_metadata", re.DOTALL | re.MULTILINE)
_FUNCTION = re.compile(r"^(\w+):\s*(?:;.*)?$", re.MULTILINE)
_OCCUPANCY = re.compile(r";\s*Occupancy:\s*(\d+)")
_CALL = re.compile(r"^\s*s_swappc_b64\b", re.MULTILINE)
_LIBRARY_SYMBOL = re.compile(r"\b__o(?:ckl|cml)_\w+")
_FLAT_ACCESS = re.compile(r"^\s*flat_(?:load|store|atomic)\w*", re.MULTILINE)


def _bodies(asm: str) -> dict[str, str]:
    """Each function's text, from its label to the next function's, keyed by function: the back end's
    `; Occupancy: N` comment follows the body it describes."""
    starts = [(m.start(), m.group(1)) for m in _FUNCTION.finditer(asm)]
    return {name: asm[start:end] for (start, name), (end, _) in zip(starts, starts[1:] + [(len(asm), "")])}


def _occupancy(body: str) -> int:
    m = _OCCUPANCY.search(body)
    return int(m.group(1)) if m else 0


def parse_resources(asm: str) -> list[KernelResources]:
    """Every kernel of one module's assembly, with its resources and explicit argument layout."""
    m = _METADATA.search(asm)
    if not m:
        raise FomoeError("no .amdgpu_metadata block in the assembly (not an amdhsa target?)")
    meta = yaml.safe_load(m.group(1))
    target = str(meta["amdhsa.target"]).rsplit("-", 1)[-1]
    bodies = _bodies(asm)
    out = []
    for k in meta["amdhsa.kernels"]:
        body = bodies.get(str(k[".name"]), "")
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
                occupancy=_occupancy(body),
                args=args,
                calls=len(_CALL.findall(body)),
                library_calls=tuple(sorted(set(_LIBRARY_SYMBOL.findall(body)))),
                flat_accesses=len(_FLAT_ACCESS.findall(body)),
            )
        )
    return out


def clang_version(clang: str) -> str:
    run = subprocess.run([clang, "--version"], capture_output=True, text=True, check=True)
    return run.stdout.splitlines()[0].strip()


def cached_assembly(source: kernels.KernelSource, arch: str, clang: str, cache_dir: Path) -> str:
    """compile_to_assembly, kept on disk keyed by the source digest (headers included), target, clang,
    the command line and the linked libraries' contents."""
    libs = devlibs.libraries(arch, clang)
    flags = hashlib.sha256(
        "\0".join([*compile_command("clang", arch, Path("x"), Path("k"), libs), devlibs.digest(libs)]).encode()
    ).hexdigest()[:12]
    key = f"{source.name}-{arch}-{source.digest[:16]}-{flags}-{re.sub(r'[^0-9A-Za-z.]+', '_', clang_version(clang))}.s"
    path = cache_dir / key
    if path.is_file():
        return path.read_text()
    asm = compile_to_assembly(source.name, arch, clang, libraries=libs)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    tmp.write_text(asm)
    tmp.replace(path)
    return asm
