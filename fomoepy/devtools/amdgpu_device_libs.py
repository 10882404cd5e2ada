"""The AMD device libraries (ROCm-Device-Libs bitcode) a HIP compile links, chosen as clang's driver and
hiprtc choose them, so that generated code is the code a user's run-time compiler produces.

With HIP's headers, threadIdx, blockDim, gridDim and the math functions are calls into ockl/ocml. Left
unlinked (`-nogpulib`), each is a real call (`s_swappc_b64`): the callee's registers are unknown, so the
back end reserves the ABI's worst case and marks every kernel `.uses_dynamic_stack`. Linked as builtin
bitcode, they are inlined and internalized like the kernel's own code.

The library set and order are those of clang's ROCm toolchain (RocmInstallationDetector::
getCommonBitcodeLibs, HIP defaults): hip.bc, ocml.bc, ockl.bc, then the control libraries
oclc_daz_opt_off (HIP keeps f32 denormals on RDNA), oclc_unsafe_math_off, oclc_finite_only_off,
oclc_correctly_rounded_sqrt_on (HIP's default), oclc_wavefrontsize64_off (wave32), oclc_isa_version_<gfx>
and oclc_abi_version_500 (code object v5). tests/test_kernels_amdgpu.py checks this list against the
driver's own choice.

Debian's rocm-device-libs (ROCm 5.2) predates RDNA3/4: it has no oclc_isa_version_1100/1200/1201. Such a
file only defines the constant `__oclc_ISA_version` (major*1000 + minor*100 + stepping) that ocml/ockl
branch on; a missing one is written here, in the exact form of Debian's own files (checked against
oclc_isa_version_1030.bc), and kept in a cache directory.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import threading
from functools import cache
from pathlib import Path

from fomoepy.errors import FomoeError
from fomoepy.runtime import kernels

# ROCm 6's default. Named on the command line: left out, clang-19's driver picks the ABI library of code
# object 4 while its back end emits 5 (the module's own __oclc_ABI_version, 500, then wins anyway)
CODE_OBJECT_VERSION = 5
# clang's HIP defaults: f32 denormals kept, no unsafe or finite-only math, correctly rounded f32 sqrt/div
CONTROL_LIBRARIES = (
    "oclc_daz_opt_off.bc",
    "oclc_unsafe_math_off.bc",
    "oclc_finite_only_off.bc",
    "oclc_correctly_rounded_sqrt_on.bc",
    "oclc_wavefrontsize64_off.bc",  # every target here runs wave32 (the tests assert it per kernel)
)
# Debian's rocm-device-libs, then ROCm's own layout
SEARCH = ("/usr/lib/*/amdgcn/bitcode", "/usr/lib/amdgcn/bitcode", "/opt/rocm/amdgcn/bitcode")

_ISA_MODULE = """target triple = "amdgcn-amd-amdhsa"
@__oclc_ISA_version = linkonce_odr protected local_unnamed_addr addrspace(4) constant i32 {version}, align 4
"""


def library_dir() -> Path:
    """The directory holding ocml.bc and ockl.bc, or FomoeError saying how to get one."""
    for pattern in SEARCH:
        for d in sorted(Path("/").glob(pattern.lstrip("/"))):
            if (d / "ocml.bc").is_file() and (d / "ockl.bc").is_file():
                return d
    raise FomoeError("AMD device libraries (ocml.bc, ockl.bc) not found (apt-get install rocm-device-libs)")


def isa_version(arch: str) -> int:
    """gfx1201 -> 12001, gfx90a -> 9010: the value of __oclc_ISA_version for a gfx target."""
    m = re.fullmatch(r"gfx(\d{1,2})([0-9a-f])([0-9a-f])", arch)
    if not m:
        raise FomoeError(f"not a gfx target name: {arch!r}")
    return int(m[1]) * 1000 + int(m[2], 16) * 100 + int(m[3], 16)


def isa_version_library(arch: str, clang: str, cache_dir: Path) -> Path:
    """Debian's oclc_isa_version_<n>.bc for `arch`, or one written into cache_dir where Debian has none."""
    name = f"oclc_isa_version_{arch.removeprefix('gfx')}.bc"
    shipped = library_dir() / name
    if shipped.is_file():
        return shipped
    path = cache_dir / name
    if not path.is_file():
        write_isa_version_library(arch, clang, path)
    return path


def write_isa_version_library(arch: str, clang: str, path: Path) -> None:
    """oclc_isa_version_<n>.bc for `arch` at `path` (atomically: concurrent compiles may ask at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
    cmd = [clang, "-target", "amdgcn-amd-amdhsa", "-nogpulib", "-c", "-emit-llvm", "-x", "ir", "-", "-o", str(tmp)]
    module = _ISA_MODULE.format(version=isa_version(arch))
    run = subprocess.run(cmd, input=module, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise FomoeError(f"writing {path.name} failed: {run.stderr.strip()}")
    tmp.replace(path)


def default_cache_dir() -> Path:
    return kernels.cache_root().parent / "amdgpu-device-libs"


def libraries(arch: str, clang: str, cache_dir: Path | None = None) -> list[Path]:
    """The bitcode files a HIP compile for `arch` links, in the driver's order."""
    d = library_dir()
    common = [d / "ocml.bc", d / "ockl.bc", *(d / name for name in CONTROL_LIBRARIES)]
    abi = d / f"oclc_abi_version_{CODE_OBJECT_VERSION}00.bc"
    missing = [p.name for p in common if not p.is_file()]
    if missing:
        raise FomoeError(f"{d} lacks {', '.join(missing)} (apt-get install rocm-device-libs)")
    hip = [d / "hip.bc"] if (d / "hip.bc").is_file() else []  # newer ROCm releases no longer ship it
    isa = isa_version_library(arch, clang, cache_dir or default_cache_dir())
    return [*hip, *common, isa, *([abi] if abi.is_file() else [])]


@cache
def _digest(path: Path, size: int, mtime_ns: int) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def digest(paths: list[Path]) -> str:
    """One digest of the libraries' names and contents: a compile cache key that changes with them."""
    h = hashlib.sha256()
    for p in paths:
        st = p.stat()
        h.update(f"{p.name}\0{_digest(p, st.st_size, st.st_mtime_ns)}\0".encode())
    return h.hexdigest()


def link_flags(paths: list[Path]) -> list[str]:
    """`-Xclang -mlink-builtin-bitcode -Xclang <file>` for each library: what the driver passes to cc1."""
    return [flag for p in paths for flag in ("-Xclang", "-mlink-builtin-bitcode", "-Xclang", str(p))]


def package_version() -> str:
    """'rocm-device-libs 5.2.3-2' where Debian's package is installed, else the library directory."""
    try:
        cmd = ["dpkg-query", "-W", "-f", "${Version}", "rocm-device-libs"]
        run = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError:  # not a Debian system
        return str(library_dir())
    if run.returncode == 0 and run.stdout.strip():
        return f"rocm-device-libs {run.stdout.strip()}"
    return str(library_dir())
