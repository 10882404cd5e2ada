"""The runtime shim without a GPU: clear errors when a driver or package is missing, checked calls,
and kernel parameter blocks laid out as the C ABI expects."""

from __future__ import annotations

import ctypes
import sys

import pytest

from fomoepy.errors import FomoeError
from fomoepy.runtime import shim
from fomoepy.runtime.shim_cuda import CUDA_NAMES
from fomoepy.runtime.shim_hip import HIP_NAMES


def _has_device(vendor: str) -> bool:
    try:
        shim.open_runtime(vendor)
    except FomoeError:
        return False
    return True


@pytest.mark.parametrize("vendor,says", [
    ("cuda", r"NVIDIA driver|fomoepy\[cuda\]|CUDA device"),
    ("hip", r"ROCm|fomoepy\[hip\]|HIP device"),
])  # fmt: skip
def test_no_driver_is_one_clear_error(vendor, says):
    if _has_device(vendor):
        pytest.skip(f"a {vendor} device is present")
    with pytest.raises(FomoeError, match=says):
        shim.open_runtime(vendor)


@pytest.mark.parametrize("vendor,module,says", [
    ("cuda", "cuda.bindings", r"pip install 'fomoepy\[cuda\]'"),
    ("hip", "hip", r"pip install 'fomoepy\[hip\]'"),
])  # fmt: skip
def test_a_missing_package_names_the_extra_to_install(monkeypatch, vendor, module, says):
    monkeypatch.setitem(sys.modules, module, None)  # import of it now raises ImportError
    with pytest.raises(FomoeError, match=says):
        shim.open_runtime(vendor)


def test_unknown_vendor():
    with pytest.raises(FomoeError, match="unknown"):
        shim.open_runtime("metal")


def test_both_vendors_name_every_call():
    for names in (CUDA_NAMES, HIP_NAMES):
        assert all(getattr(names, f) for f in names.__dataclass_fields__)


class _FakeApi:
    def cuMemAlloc(self, n):
        return (0, 0x1000 + n)

    def cuMemFree(self, ptr):
        return (2,)  # CUDA_ERROR_OUT_OF_MEMORY

    def cuGetErrorString(self, status):
        return (0, b"out of memory")


class _Shim(shim.DriverShim):
    vendor = "cuda"
    names = CUDA_NAMES

    def _make_current(self):
        pass


def test_calls_are_checked_and_name_the_call():
    s = _Shim(_FakeApi())
    assert s.malloc(16) == 0x1010
    with pytest.raises(shim.GpuError, match="cuMemFree failed: out of memory"):
        s.free(0x1010)


def test_kernel_parameters_are_packed_in_their_c_types():
    dims = shim.Dims4()
    dims.n[:] = [1, 2, 3, 4]
    packed = shim.PackedParams("pilfdD", [0xDEADBEEF, -3, 1 << 40, 0.5, 2.25, dims])
    addrs = [packed.array[i] for i in range(6)]
    assert ctypes.c_uint64.from_address(addrs[0]).value == 0xDEADBEEF
    assert ctypes.c_int32.from_address(addrs[1]).value == -3
    assert ctypes.c_int64.from_address(addrs[2]).value == 1 << 40
    assert ctypes.c_float.from_address(addrs[3]).value == 0.5
    assert ctypes.c_double.from_address(addrs[4]).value == 2.25
    assert list(shim.Dims4.from_address(addrs[5]).n) == [1, 2, 3, 4]
    assert ctypes.sizeof(shim.Dims4) == 128
    with pytest.raises(TypeError, match="takes 2 arguments"):
        shim.PackedParams("pi", [1])


def test_backend_selection_without_a_gpu():
    from fomoepy.runtime.backends import make_backend
    from fomoepy.runtime.cpu import CpuBackend

    if _has_device("cuda") or _has_device("hip"):
        pytest.skip("a GPU is present")
    assert isinstance(make_backend("auto"), CpuBackend)
    assert isinstance(make_backend("cpu"), CpuBackend)
    with pytest.raises(FomoeError, match="no GPU backend could start: cuda: "):
        make_backend("cuda")
    with pytest.raises(FomoeError, match="not available"):
        make_backend("tpu")


# -- defects found through the real bindings (issue 20) ---------------------------------------------


class _RaisingApi(_FakeApi):
    def cuMemAlloc(self, n):
        raise RuntimeError("failed to dlsym cuMemAlloc")


def test_an_exception_from_the_binding_becomes_a_gpu_error_naming_the_call():
    with pytest.raises(shim.GpuError, match="cuda: cuMemAlloc raised RuntimeError: failed to dlsym"):
        _Shim(_RaisingApi()).malloc(16)


class _MemsetApi(_FakeApi):
    """Takes the pattern as a C int when `signed` (hip-python), as unsigned otherwise (cuda-python)."""

    def __init__(self, signed: bool):
        self.signed, self.got = signed, None

    def cuMemsetD32Async(self, dst, value, count, stream):
        lo, hi = (-(1 << 31), (1 << 31) - 1) if self.signed else (0, (1 << 32) - 1)
        if not lo <= value <= hi:
            raise OverflowError(f"value {value} out of range")
        self.got = value
        return (0,)


@pytest.mark.parametrize("signed, want", [(True, -1), (False, 0xFFFFFFFF)])
def test_memset_passes_the_32_bit_pattern_as_each_binding_takes_it(signed, want):
    api = _MemsetApi(signed)
    s = _Shim(api)
    s.memset_signed = signed
    s.memset32(0x1000, 0xFFFFFFFF, 4, None)
    assert api.got == want
    s.memset32(0x1000, -1, 4, None)  # the same bits, however the caller spelled them
    assert api.got == want


def test_a_rocm5_runtime_is_one_error_naming_what_hip_python_needs(monkeypatch):
    import sys
    import types

    class Props:
        gcnArchName, name, totalGlobalMem = b"gfx1201", b"stand-in", 1 << 34

    hip = types.SimpleNamespace(
        hipInit=lambda flags: (0,),
        hipGetDeviceCount=lambda: (0, 1),
        hipDeviceProp_t=Props,
        hipSetDevice=lambda d: (0,),
        hipGetDeviceProperties=lambda props, d: (_ for _ in ()).throw(RuntimeError("failed to dlsym hipGetDevicePropertiesR0600")),
        hipGetErrorString=lambda status: (0, b"?"),
    )
    monkeypatch.setitem(sys.modules, "hip", types.SimpleNamespace(hip=hip))
    from fomoepy.runtime.shim_hip import open_hip

    with pytest.raises(FomoeError, match=r"needs ROCm >= 6 \(>= 6.4 for RDNA4\).*hipGetDeviceProperties raised RuntimeError"):
        open_hip(0)


def test_auto_falls_back_to_the_cpu_whatever_fails_while_opening_a_device(monkeypatch):
    from fomoepy.runtime import gpu
    from fomoepy.runtime.backends import make_backend
    from fomoepy.runtime.cpu import CpuBackend

    def broken(vendor, device=0):
        raise RuntimeError(f"{vendor} driver exploded")

    monkeypatch.setattr(gpu, "GpuBackend", broken)
    assert isinstance(make_backend("auto"), CpuBackend)
    with pytest.raises(FomoeError, match="hip: hip driver exploded"):
        make_backend("hip")


def test_a_reused_parameter_block_holds_what_packed_params_hold():
    # the block a launch refills in place: each argument's bytes where PackedParams puts its C value
    args = [0xDEADBEEF, -3, 1 << 40, 0.5, 2.25, 7]
    block = shim.ParamBlock("pilfdi")
    address = block.pack(args)
    packed = shim.PackedParams("pilfdi", args)
    array = (ctypes.c_void_p * 6).from_address(address)
    sizes = [8, 4, 8, 4, 8, 4]
    for i, size in enumerate(sizes):
        assert ctypes.string_at(array[i], size) == ctypes.string_at(packed.array[i], size)
    block.pack([1, 2, 3, 4.0, 5.0, 6])  # the next launch's arguments replace them
    assert ctypes.c_int32.from_address(array[5]).value == 6 and ctypes.c_uint64.from_address(array[0]).value == 1
    assert shim.param_block("pD") is None  # a struct by value: PackedParams
    with pytest.raises(TypeError, match="kernel arguments"):
        block.pack([1, 2 << 40, 3, 4.0, 5.0, 6])  # an int32 out of range is refused, not wrapped
