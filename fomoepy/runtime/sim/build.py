"""Builds for the simulated device: each hip_kernels/ module compiled by the host C++ compiler into a
shared library (the simulator's "code object"), and the driver library itself.

The kernel source is compiled as it is, with FOMOE_SIM defined: compat.h then includes
sim_device.h, which gives CUDA's spellings (threadIdx, __syncthreads, __shfl_xor_sync, ...) their
simulated meaning. Each kernel gets an entry that unpacks the driver's parameter block into the
kernel's own C types; the kernels and their launch bounds are found by preprocessing the module once
with FOMOE_SIM_SCAN, where KERNEL and LAUNCH_BOUNDS become markers.

Race detection (on unless FOMOEPY_SIM_RACECHECK=0): a module that declares shared memory is compiled
with the compiler's thread-sanitizer instrumentation and linked without its runtime; sim_shared.h
defines the calls the instrumentation makes and checks each shared-memory access against the barrier
intervals. A module that declares none cannot reach shared memory (a block's shared memory is only
named by its own declarations), so it is built without the instrumentation and runs at full speed.

Floating point: contraction is off (a*b+c is never fused, as __fmul_rn promises on a GPU) and no
-march=native, so a module computes the same bits on every x86-64 or ARM machine CI runs on.
Binaries go through kernels.compile_cached like NVRTC's and hiprtc's, keyed by the source digest and
the compiler's version (which covers the simulator's headers, and the options).
"""

from __future__ import annotations

import ast
import hashlib
import operator
import os
import re
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from fomoepy.errors import FomoeError
from fomoepy.runtime.kernels import KernelCompileError, KernelSource, cache_root

SIM_DIR = Path(__file__).resolve().parent
DEVICE_HEADERS = (SIM_DIR / "sim_device.h", SIM_DIR / "sim_shared.h", SIM_DIR / "sim_intrinsics.h")
DRIVER_SOURCE = SIM_DIR / "sim_driver.cpp"
DRIVER_SOURCES = (DRIVER_SOURCE, SIM_DIR / "sim_streams.h", SIM_DIR / "sim_timing.h")

# contraction off, no -march=native: the same bits on every CI processor; strict aliasing off because
# the kernels read weights through casts of byte pointers, which is fine on a GPU compiler
COMMON_FLAGS = ["-std=c++17", "-O2", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-strict-aliasing",
                "-fvisibility=hidden", "-w"]  # fmt: skip
SHARED_USE = re.compile(r"^(?!\s*#\s*define)[^\n]*?\b(?:DYN_)?SHARED\s*\(\s*\w+\s*,\s*\w+", re.MULTILINE)
KERNEL_MARK = re.compile(r"FOMOE_SIM_KERNEL\s+void\s+FOMOE_SIM_BOUND\s*\(([^)]*)\)\s+(\w+)\s*\(")
_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def host_compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise FomoeError("the simulated device needs a C++ compiler (g++ or clang++) on the PATH, or $CXX")
    return cxx


@cache
def compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise FomoeError(f"the C++ compiler {cxx} does not run: {e}") from e
    return out.splitlines()[0].strip()


def _bound(expr: str) -> int:
    """The launch bound's expression after preprocessing, e.g. '4 * 32' (integers and + - * / only)."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
            return _ARITH[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            return ev(node.left) // ev(node.right)
        raise ValueError(expr)

    return ev(ast.parse(expr.replace("(", " (").strip(), mode="eval").body)


def declares_shared(source: KernelSource) -> bool:
    """Whether any text of the module declares shared memory (SHARED or DYN_SHARED outside a #define)."""
    texts = [source.text, *(text for _, text in source.headers)]
    return any(SHARED_USE.search(re.sub(r"//[^\n]*", "", t)) for t in texts)


SPELLINGS = {"cuda": [], "hip": ["-DFOMOE_SIM_HIP"]}


def racecheck_default() -> bool:
    return os.environ.get("FOMOEPY_SIM_RACECHECK", "1") not in ("", "0")


def instrumentation_flags(cxx: str) -> list[str]:
    """Thread-sanitizer instrumentation of every load and store, without function entry/exit calls."""
    if "clang" in compiler_version(cxx).lower():
        return ["-fsanitize=thread", "-fno-sanitize-thread-func-entry-exit"]
    return ["-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0"]


class SimCompiler:
    """The kernel compiler of the simulated device: `compile` returns the module's shared library."""

    vendor = "sim"

    def __init__(self, extra_flags: tuple[str, ...] = (), racecheck: bool | None = None, spelling: str = "cuda") -> None:
        """`extra_flags` e.g. ("-DFOMOE_SIM_UCONTEXT",): the portable context switch on x86-64 too.
        `racecheck`: build the shared-memory race detector in (default: FOMOEPY_SIM_RACECHECK, on).
        `spelling`: which vendor's branches of compat.h to build, "cuda" or "hip" (the simulator
        defines both vendors' intrinsics, so each branch is code that runs)."""
        if spelling not in SPELLINGS:
            raise FomoeError(f"the simulated device builds {' or '.join(SPELLINGS)} spellings, not {spelling!r}")
        self.cxx = host_compiler()
        self.spelling = spelling
        self.extra_flags = list(extra_flags) + SPELLINGS[spelling]
        self.racecheck = racecheck_default() if racecheck is None else racecheck
        self.checks = ["-DFOMOE_SIM_RACECHECK", *instrumentation_flags(self.cxx)] if self.racecheck else []
        # the cache key: the simulator's headers, and this file (how a module is built, which gets the checks)
        header = hashlib.sha256(b"".join(h.read_bytes() for h in (*DEVICE_HEADERS, Path(__file__)))).hexdigest()[:16]
        self.version = f"{compiler_version(self.cxx)} sim-{header}"

    def options(self, arch: str) -> list[str]:
        """The flags of the cache key; a module that declares no shared memory is built without `checks`."""
        return [*COMMON_FLAGS, "-DFOMOE_SIM", *self.extra_flags, *self.checks]

    def flags(self, source: KernelSource, arch: str) -> list[str]:
        """The flags `source` is compiled with (to an object file: -shared is the link's)."""
        drop = {"-shared"} if declares_shared(source) else {"-shared", *self.checks}
        return [o for o in self.options(arch) if o not in drop]

    def _run(self, args: list[str], source: KernelSource, cwd: str) -> str:
        proc = subprocess.run(args, capture_output=True, text=True, cwd=cwd, check=False)
        if proc.returncode != 0:
            raise KernelCompileError(f"{source.name}.hip does not compile for the simulated device with {self.version}:\n{proc.stderr[-4000:]}")
        return proc.stdout

    def kernels_of(self, source: KernelSource, workdir: str) -> list[tuple[str, int]]:
        """(name, launch bound) of every kernel the module defines, in source order."""
        text = self._run([self.cxx, "-std=c++17", "-E", "-P", "-DFOMOE_SIM", "-DFOMOE_SIM_SCAN", *self.extra_flags, f"-I{SIM_DIR}", "-I.",
                          "-x", "c++", f"{source.name}.hip"], source, workdir)  # fmt: skip
        found = [(name, _bound(expr)) for expr, name in KERNEL_MARK.findall(text)]
        if not found:
            raise KernelCompileError(f"{source.name}.hip defines no KERNEL")
        return found

    def compile(self, source: KernelSource, arch: str) -> bytes:
        with tempfile.TemporaryDirectory(prefix="fomoe-sim-") as d:
            for name, text in source.headers:
                Path(d, name).write_text(text)
            Path(d, f"{source.name}.hip").write_text(source.text)
            entries = "".join(f"FOMOE_SIM_ENTRY({name}, {bound})\n" for name, bound in self.kernels_of(source, d))
            Path(d, "module.cpp").write_text(f'#include "{source.name}.hip"\n{entries}')
            # compiled, then linked without -fsanitize: the instrumentation's calls are the module's own,
            # and no sanitizer runtime may be linked into a library that Python loads
            self._run([self.cxx, *self.flags(source, arch), f"-I{SIM_DIR}", "-I.", "-x", "c++", "-c", "module.cpp", "-o", "module.o"], source, d)
            self._run([self.cxx, "-shared", "-pthread", "-Wl,--no-undefined", "module.o", "-o", "module.so"], source, d)
            return Path(d, "module.so").read_bytes()


def driver_library() -> Path:
    """The driver's shared library, built once per source and compiler and cached."""
    cxx = host_compiler()
    sources = b"".join(p.read_bytes() for p in DRIVER_SOURCES)
    key = hashlib.sha256(sources + compiler_version(cxx).encode() + " ".join(COMMON_FLAGS).encode()).hexdigest()[:24]
    path = cache_root() / "sim" / f"driver-{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    proc = subprocess.run([cxx, *COMMON_FLAGS, str(DRIVER_SOURCE), "-o", str(tmp), "-ldl"], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise FomoeError(f"the simulated device's driver does not build with {cxx}:\n{proc.stderr[-4000:]}")
    os.replace(tmp, path)
    return path


STANDIN_SOURCE = SIM_DIR / "standin.cpp"
STANDIN_NAMES = ("libcuda.so.1", "libamdhip64.so")  # what cuda-python and hip-python dlopen


def standin_drivers(directory: Path, rocm5: bool = False) -> Path:
    """Stand-in CUDA and HIP driver libraries over the simulated device (standin.cpp), and the
    simulator's builds of every hip_kernels/ module they run, under `directory`:
        directory/libcuda.so.1, directory/libamdhip64.so   (put `directory` on LD_LIBRARY_PATH)
        directory/modules/<module>.so                      (FOMOE_STANDIN_MODULES for CUDA: its spellings)
        directory/modules-hip/<module>.so                  (FOMOE_STANDIN_MODULES for HIP: HIP's spellings)
    `rocm5`: a HIP runtime like ROCm 5's, without hipGetDevicePropertiesR0600 (which hip-python 7.2 needs).
    """
    from fomoepy.runtime.kernels import compile_cached, load_sources

    cxx = host_compiler()
    directory.mkdir(parents=True, exist_ok=True)
    flags = ["-DFOMOE_STANDIN_ROCM5"] if rocm5 else []
    sources = STANDIN_SOURCE.read_bytes() + b"".join(p.read_bytes() for p in DRIVER_SOURCES)
    key = hashlib.sha256(sources + compiler_version(cxx).encode() + str(flags).encode()).hexdigest()[:16]
    library = directory / f"libfomoe-standin-{key}.so"
    if not library.exists():
        tmp = library.with_suffix(f".tmp{os.getpid()}")
        proc = subprocess.run([cxx, *COMMON_FLAGS, *flags, f"-I{SIM_DIR}", str(STANDIN_SOURCE), "-o", str(tmp), "-ldl"], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise FomoeError(f"the stand-in drivers do not build with {cxx}:\n{proc.stderr[-4000:]}")
        os.replace(tmp, library)
    for name in STANDIN_NAMES:
        link = directory / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(library.name)
    for spelling, name in (("cuda", "modules"), ("hip", "modules-hip")):
        modules = directory / name
        modules.mkdir(exist_ok=True)
        compiler = SimCompiler(spelling=spelling)
        for source in load_sources():
            (modules / f"{source.name}.so").write_bytes(compile_cached(compiler, source, "sim"))
    return directory
