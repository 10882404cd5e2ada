"""Kernel sources (hip_kernels/) compiled at run time by NVRTC or hiprtc, with an on-disk cache.

One source tree serves both vendors: each `*.hip` file is one module, compiled with the headers
beside it (`compat.h`, `dequant.h`) handed to the compiler by name, so no include path or toolkit
header is involved. Binaries are cached under $XDG_CACHE_HOME/fomoepy/kernels keyed by the source
hash, the target architecture and the compiler's version.

Kernel names come from quants.FORMATS (`QuantFormat.kernel_suffix`): every supported type has kernels,
and asking for another is quants' one `UnsupportedQuantType`, never a fallback.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gguf import GGMLQuantizationType

from fomoepy import quants
from fomoepy.errors import FomoeError

# tensor type -> the suffix of its kernels, a view of quants.FORMATS (the one table of per-type facts)
KERNEL_TYPE_NAMES: dict[GGMLQuantizationType, str] = {qtype: fmt.kernel_suffix for qtype, fmt in quants.FORMATS.items()}


class KernelCompileError(FomoeError):
    """A kernel source that the run-time compiler rejected (the log says where)."""


def kernel_name(family: str, qtype: int, tensor_name: str | None = None) -> str:
    """`<family>_<type>` for a weight of `qtype`, e.g. kernel_name("mv", Q4_K) == "mv_q4_k"; a type
    fomoepy does not support is the one `UnsupportedQuantType` of quants.require_format."""
    return f"{family}_{quants.require_format(qtype, tensor_name).kernel_suffix}"


# -- sources -----------------------------------------------------------------------------------------

WARP_SIZE = 32  # compat.h's WARP: every warp reduction assumes it (tests/test_kernels_compile.py reads it back)



def kernel_dir() -> Path:
    """hip_kernels/ of this checkout, or $FOMOEPY_KERNEL_DIR."""
    override = os.environ.get("FOMOEPY_KERNEL_DIR")
    path = Path(override) if override else Path(__file__).resolve().parents[2] / "hip_kernels"
    if not (path / "compat.h").is_file():
        raise FomoeError(f"kernel sources not found: expected {path}/compat.h (set FOMOEPY_KERNEL_DIR)")
    return path


@dataclass(frozen=True)
class KernelSource:
    name: str  # the module, e.g. "matvec" for matvec.hip
    text: str
    headers: tuple[tuple[str, str], ...]  # (include name, text) of every header beside it

    @property
    def digest(self) -> str:
        h = hashlib.sha256(self.text.encode())
        for name, text in self.headers:
            h.update(b"\0" + name.encode() + b"\0" + text.encode())
        return h.hexdigest()


def load_sources(directory: Path | None = None) -> list[KernelSource]:
    d = directory or kernel_dir()
    headers = tuple((p.name, p.read_text()) for p in sorted(d.glob("*.h")))
    return [KernelSource(p.stem, p.read_text(), headers) for p in sorted(d.glob("*.hip"))]


# -- compilers ---------------------------------------------------------------------------------------


class Compiler(Protocol):
    vendor: str  # "cuda" or "hip"
    version: str

    def options(self, arch: str) -> list[str]: ...

    def compile(self, source: KernelSource, arch: str) -> bytes: ...


class NvrtcCompiler:
    """NVRTC through cuda-python (`cuda.bindings.nvrtc`); needs no GPU, only the nvrtc library
    (the `nvidia-cuda-nvrtc` wheel, found by cuda-pathfinder)."""

    vendor = "cuda"

    def __init__(self) -> None:
        try:
            from cuda.bindings import nvrtc
        except ImportError as e:
            raise FomoeError("NVRTC is not available: pip install 'fomoepy[cuda]'") from e
        self._nvrtc = nvrtc
        try:
            _, major, minor = nvrtc.nvrtcVersion()
        except Exception as e:  # the library itself failed to load
            raise FomoeError(f"NVRTC could not be loaded ({e}): pip install 'fomoepy[cuda]'") from e
        self.version = f"nvrtc-{major}.{minor}"

    def options(self, arch: str) -> list[str]:
        # NVRTC has no -O3; device optimisation is on by default and ptxas is told -O3 explicitly
        return [f"--gpu-architecture={arch}", "-std=c++17", "--dopt=on", "-Xptxas=-O3"]

    def compile(self, source: KernelSource, arch: str) -> bytes:
        return self._compile(source, arch)[0]

    def resource_report(self, source: KernelSource, arch: str) -> str:
        """ptxas's account of each kernel of `source` (registers, stack frame, spills): its -v log."""
        return self._compile(source, arch, ["-Xptxas=-v"])[1]

    def _compile(self, source: KernelSource, arch: str, extra: list[str] | None = None) -> tuple[bytes, str]:
        n = self._nvrtc
        names = [name.encode() for name, _ in source.headers]
        texts = [text.encode() for _, text in source.headers]
        err, prog = n.nvrtcCreateProgram(source.text.encode(), f"{source.name}.hip".encode(), len(names), texts, names)
        _check_nvrtc(n, err, "nvrtcCreateProgram")
        try:
            opts = [o.encode() for o in self.options(arch) + (extra or [])]
            (err,) = n.nvrtcCompileProgram(prog, len(opts), opts)
            if err != n.nvrtcResult.NVRTC_SUCCESS:
                raise KernelCompileError(f"{source.name}.hip does not compile for {arch} with {self.version}:\n{_nvrtc_log(n, prog)}")
            err, size = n.nvrtcGetCUBINSize(prog)
            _check_nvrtc(n, err, "nvrtcGetCUBINSize")
            buf = bytes(size)
            (err,) = n.nvrtcGetCUBIN(prog, buf)
            _check_nvrtc(n, err, "nvrtcGetCUBIN")
            return buf, _nvrtc_log(n, prog)
        finally:
            n.nvrtcDestroyProgram(prog)


def _check_nvrtc(n, err, what: str) -> None:
    if err != n.nvrtcResult.NVRTC_SUCCESS:
        raise FomoeError(f"{what} failed: {err}")


def _nvrtc_log(n, prog) -> str:
    _, size = n.nvrtcGetProgramLogSize(prog)
    buf = bytes(size)
    n.nvrtcGetProgramLog(prog, buf)
    return buf.rstrip(b"\0").decode(errors="replace")


class HiprtcCompiler:
    """hiprtc through a small C-API handle: hip-python's `hip.hiprtc` on a ROCm machine, or the
    library loaded with ctypes (`ctypes_hiprtc`), which is how CI compiles without a GPU."""

    vendor = "hip"

    def __init__(self, lib: ctypes.CDLL, version: str):
        self._lib = lib
        self.version = version

    def options(self, arch: str) -> list[str]:
        return [f"--offload-arch={arch}", "-O3", "-std=c++17"]

    def compile(self, source: KernelSource, arch: str) -> bytes:
        lib = self._lib
        prog = ctypes.c_void_p()
        n_h = len(source.headers)
        texts = (ctypes.c_char_p * n_h)(*[t.encode() for _, t in source.headers])
        names = (ctypes.c_char_p * n_h)(*[nm.encode() for nm, _ in source.headers])
        rc = lib.hiprtcCreateProgram(ctypes.byref(prog), source.text.encode(), f"{source.name}.hip".encode(), n_h, texts, names)
        if rc != 0:
            raise FomoeError(f"hiprtcCreateProgram failed with code {rc}")
        try:
            opts = [o.encode() for o in self.options(arch)]
            rc = lib.hiprtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
            if rc != 0:
                size = ctypes.c_size_t()
                lib.hiprtcGetProgramLogSize(prog, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value + 1)
                lib.hiprtcGetProgramLog(prog, log)
                raise KernelCompileError(
                    f"{source.name}.hip does not compile for {arch} with {self.version}:\n{log.value.decode(errors='replace')}"
                )
            size = ctypes.c_size_t()
            lib.hiprtcGetCodeSize(prog, ctypes.byref(size))
            code = ctypes.create_string_buffer(size.value)
            lib.hiprtcGetCode(prog, code)
            return code.raw
        finally:
            lib.hiprtcDestroyProgram(ctypes.byref(prog))


# libraries libhiprtc / libamdhip64 need, in load order, when they live outside the loader's path
HIPRTC_DEPENDENCIES = ("libhsakmt.so.1", "libLLVM-15.so.1", "libhsa-runtime64.so.1", "libamd_comgr.so.2", "libhiprtc-builtins.so.5")
HIPRTC_LIBRARIES = ("libhiprtc.so", "libhiprtc.so.7", "libhiprtc.so.6", "libhiprtc.so.5", "libamdhip64.so", "libamdhip64.so.5")


def ctypes_hiprtc(lib_dir: str | os.PathLike[str] | None = None) -> HiprtcCompiler:
    """hiprtc from ROCm on the loader's path, or from `lib_dir` (an unpacked ROCm, see
    tools/setup_kernel_compilers.sh). ROCm 5.x keeps hiprtc inside libamdhip64."""
    if lib_dir is not None:
        for dep in HIPRTC_DEPENDENCIES:
            path = Path(lib_dir) / dep
            if path.exists():
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    errors = []
    for name in HIPRTC_LIBRARIES:
        target = str(Path(lib_dir) / name) if lib_dir is not None else name
        try:
            lib = ctypes.CDLL(target, mode=ctypes.RTLD_GLOBAL)
            lib.hiprtcCreateProgram  # noqa: B018 - libamdhip64 >= 6 no longer carries hiprtc
        except (OSError, AttributeError) as e:
            errors.append(str(e))
            continue
        major, minor = ctypes.c_int(), ctypes.c_int()
        lib.hiprtcVersion(ctypes.byref(major), ctypes.byref(minor))
        return HiprtcCompiler(lib, f"hiprtc-{major.value}.{minor.value}")
    where = f" in {lib_dir}" if lib_dir is not None else ""
    raise FomoeError(f"hiprtc not found{where} (install ROCm's hiprtc): " + "; ".join(errors[-2:]))


def compiler_for(vendor: str) -> Compiler:
    """The run-time compiler of a vendor's kernels: NVRTC, hiprtc, or the host C++ compiler for the simulator."""
    if vendor == "cuda":
        return NvrtcCompiler()
    if vendor == "hip":
        return ctypes_hiprtc()
    if vendor == "sim":
        from fomoepy.runtime.sim.build import SimCompiler

        return SimCompiler()
    raise FomoeError(f"no kernel compiler for vendor {vendor!r}")


# -- the binary cache --------------------------------------------------------------------------------


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fomoepy" / "kernels"


def compile_cached(compiler: Compiler, source: KernelSource, arch: str, root: Path | None = None) -> bytes:
    """The binary of `source` for `arch`, from the cache or compiled (and then cached, atomically)."""
    key = hashlib.sha256(
        "\0".join([source.digest, arch, compiler.vendor, compiler.version, *compiler.options(arch)]).encode()
    ).hexdigest()[:24]
    directory = (root or cache_root()) / f"{compiler.vendor}-{arch}"
    path = directory / f"{source.name}-{key}.bin"
    try:
        return path.read_bytes()
    except OSError:
        pass
    binary = compiler.compile(source, arch)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(binary)
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache costs a recompile next time, not a failure now
    return binary


def compile_all(compiler: Compiler, arch: str, root: Path | None = None) -> dict[str, bytes]:
    """Every module of hip_kernels/ for `arch`: {"matvec": binary, ...}."""
    return {src.name: compile_cached(compiler, src, arch, root) for src in load_sources()}


# -- which module holds each kernel (tests/test_sim_device.py checks it against the compiled modules) --
_FAMILY_MODULES = {
    "mv_": "matvec", "embed_": "matvec", "moe_": "experts", "rms_norm": "norm", "l2_norm": "norm", "softmax": "norm",
    "rope": "rope", "attention": "attention", "kv_append": "attention", "sigmoid_gate": "attention", "causal_conv1d": "deltanet",
    "delta_rule": "deltanet", "route_": "router", "argmax": "router", "ew_": "elementwise", "copy_": "elementwise",
    "gather": "elementwise",
}  # fmt: skip


def module_of(kernel: str) -> str:
    """The hip_kernels/ module (file stem) that defines `kernel`."""
    for prefix, module in _FAMILY_MODULES.items():
        if kernel.startswith(prefix):
            return module
    raise FomoeError(f"kernel {kernel} belongs to no module of hip_kernels/")


# -- the launch ABI --------------------------------------------------------------------------------------
# Every kernel's parameters, one letter each: p pointer, i int32, l int64, f float, d double, D Dims4.
# tests/test_kernels_compile.py checks this table against the KERNEL declarations in hip_kernels/.
_PER_TYPE_SIGNATURES = {
    "mv_{}_t1": "plplpliii",  # W, row_bytes, X, x_stride, Y, y_stride, N, K, T
    "mv_{}_t8": "plplpliii",
    "embed_{}": "plpiiipp",  # table, row_bytes, tokens, T, n_vocab, D, out, err
    "moe_gate_up_{}_t1": "ppiiilp",  # work, X, D, F, k, row_bytes, act
    "moe_gate_up_{}_t8": "ppiiilp",
    "moe_down_sum_{}": "ppiiilp",  # pairs, act, D, F, k, row_bytes, out
    "moe_down_{}": "ppiilp",  # work, act, D, F, row_bytes, part
}
KERNEL_SIGNATURES: dict[str, str] = {
    pattern.format(suffix): sig for pattern, sig in _PER_TYPE_SIGNATURES.items() for suffix in KERNEL_TYPE_NAMES.values()
} | {
    "moe_combine": "ppiiip",  # pairs, part, T, D, k, out
    "rms_norm_f32": "plppiif",  # x, x_stride, w, y, n_rows, n, eps
    "l2_norm_f32": "plpiif",  # x, x_stride, y, n_rows, n, eps
    "softmax_f32": "plpii",  # x, x_stride, y, n_rows, n
    "rope_neox_f32": "pllpiiiipid",  # x, xt, xh, out, T, H, hd, rotary_dim, positions, n_past, base
    "attention_f32": "pllpppiiiiiifp",  # q, qt, qh, k, v, out, T, H, Hkv, hd, n_past, n_ctx, scale, err
    "attention_rows_f32": "pllppppiiiifp",  # q, qt, qh, k_caches, v_caches, rows, out, B, H, Hkv, hd, scale, err
    "kv_append_rows_f32": "pppppiip",  # k, v, k_caches, v_caches, rows, B, n, err
    "sigmoid_gate_f32": "pppl",  # a, gate, out, n
    "causal_conv1d_f32": "ppppiiip",  # x, state, w, out, T, C, K, err
    "causal_conv1d_rows_f32": "ppppiiip",  # x, states, w, out, B, C, K, err
    "delta_rule_f32": "pppppppiiiip",  # q, k, v, g, beta, S, o, T, Hv, dk, dv, err
    "delta_rule_rows_f32": "pppppppiiiip",  # q, k, v, g, beta, states, o, B, Hv, dk, dv, err
    "route_softmax_topk": "piiipppp",  # logits, T, E, k, probs, ids, weights, err
    "argmax_f32": "piip",  # x, n_rows, n, ids
    "ew_f32": "ippfpD",  # op, a, b, s, out, dims
    "copy_b32": "ppD",  # a, out, dims
    "gather_f32": "pppllllp",  # src, idx, out, outer, axis_len, n_idx, inner, err
}
