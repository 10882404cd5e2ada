"""The GPU runtime shim: the dozen driver calls fomoepy makes, for CUDA (cuda-python) and HIP (hip-python).

The two bindings differ only in names (cuMemAlloc / hipMalloc, cuLaunchKernel / hipModuleLaunchKernel,
...), so `DriverShim` implements every call once over a table of names (`ApiNames`), and
shim_cuda.py / shim_hip.py supply the table plus the few lines that really differ: opening the
device and naming its architecture. Everything above this module is vendor-neutral.

Device pointers, pinned host pointers and kernel parameter blocks are plain ints; streams, events,
modules and functions are the bindings' handle objects, passed back untouched.

The calls a decode step makes by the dozen (launches, async copies, event records and waits,
synchronisations) go through the bindings' C function pointers where the package's compiled helper
is built (fomoepy/runtime/_driver_calls.c): the same driver functions, a tenth of the host time.
"""

from __future__ import annotations

import ctypes
import logging
import struct
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fomoepy.errors import FomoeError

try:  # optional (setup.py): without it the bindings' Python functions make every call
    from fomoepy.runtime import _driver_calls
except ImportError:
    _driver_calls = None

log = logging.getLogger(__name__)

VENDORS = ("cuda", "hip", "sim")


class GpuError(FomoeError):
    """A driver call that failed (out of memory, a bad launch, no device); the message names the call."""


@dataclass(frozen=True)
class ApiNames:
    """The binding's name for each call; the argument order is the same in both APIs."""

    malloc: str
    free: str
    host_alloc: str
    host_free: str
    host_register: str
    host_unregister: str
    stream_create: str
    stream_sync: str
    stream_wait_event: str
    event_create: str
    event_record: str
    event_sync: str
    event_elapsed: str
    memcpy_htod: str
    memcpy_dtoh: str
    memcpy_dtod: str
    memset_d32: str
    module_load: str
    module_function: str
    launch: str
    mem_info: str
    driver_version: str
    error_string: str
    status: str = ""  # the binding's enum of call results (none: they are ints)


# the calls made directly: _driver_calls.Calls's method -> the ApiNames field of the driver function it
# calls, in the order Calls takes their capsules (fomoepy/runtime/_driver_calls.c)
DIRECT_CALLS = {"launch": "launch", "htod": "memcpy_htod", "dtoh": "memcpy_dtoh", "dtod": "memcpy_dtod",
                "record": "event_record", "wait": "stream_wait_event", "sync": "stream_sync",
                "event_sync": "event_sync", "memset32": "memset_d32"}  # fmt: skip
# of those, the ones the shim hands out as its own methods while the direct calls are in use (DriverShim.direct)
BOUND_DIRECT = ("htod", "dtoh", "dtod", "record", "wait", "event_sync")


# flag values shared by both APIs (CU_STREAM_NON_BLOCKING == hipStreamNonBlocking, ...)
STREAM_NON_BLOCKING = 1
EVENT_DEFAULT = 0
EVENT_DISABLE_TIMING = 2


def address(handle: Any) -> int:
    """The integer address behind a binding's pointer object (CUdeviceptr, hip-python's pointers)."""
    if handle is None:
        return 0
    try:
        return int(handle)
    except TypeError:
        return handle.as_c_void_p().value or 0


class DriverShim(ABC):
    """One device of one vendor. Calls raise `GpuError` naming the call and the driver's message."""

    vendor: str
    names: ApiNames
    launch_extra: Any = None  # the `extra` argument of a launch meaning "none"
    device_name: str
    arch: str  # what the kernel compiler targets: "sm_90", "gfx1201"
    total_memory: int
    warp_size: int  # lanes per warp (wavefront) the device runs: what the kernels' WARP must equal

    # which shim's device is current on each thread: the driver keeps one current device (CUDA context,
    # HIP device) per thread, shared by every shim, so a shim that made its device current once must
    # make it current again after another shim's call on the same thread
    _current = threading.local()

    def __init__(self, api: Any, device: int = 0):
        self.api = api
        self.device = device
        self._syncs: dict[int, SyncCount] = {}  # id of a stream -> the host's waits for it so far
        self.direct = None  # _driver_calls.Calls over the binding's C functions, once use_direct_calls found them

    def __setattr__(self, name: str, value: Any) -> None:
        # (`direct` stays a plain attribute, read at every launch; setting it rebinds the calls below)
        object.__setattr__(self, name, value)
        if name == "direct":
            self._bind_direct(value)

    def _bind_direct(self, calls: Any) -> None:
        """The direct calls now in use (None: the binding's Python functions). Those a decode step makes by
        the dozen and that need nothing of the shim's around them are then this shim's own methods, the C
        ones (a Python method wrapped around each cost a frame per call, about a tenth of a MoE step's
        calls): they make the same call, or none for zero bytes, as the methods below."""
        for name in BOUND_DIRECT:
            if calls is None:
                self.__dict__.pop(name, None)
            else:
                self.__dict__[name] = getattr(calls, name)

    # -- what differs: set in the vendor modules --------------------------------------------------------
    @abstractmethod
    def _make_current(self) -> None:
        """Bind this device to the calling thread (a context on CUDA, the current device on HIP)."""

    def _host_alloc_args(self, nbytes: int) -> tuple:
        return (nbytes,)

    # -- calls ------------------------------------------------------------------------------------------
    def call(self, name: str, *args: Any) -> Any:
        """api.<name>(*args) with its status checked; returns the remaining results (None, one, or a tuple)."""
        self._current_here()
        try:
            result = getattr(self.api, name)(*args)
        except GpuError:
            raise
        except Exception as e:  # a binding that raises (a missing symbol, a bad argument) names the call too
            raise GpuError(f"{self.vendor}: {name} raised {type(e).__name__}: {e}") from e
        if not isinstance(result, tuple):
            if int(result) != 0:
                raise GpuError(f"{self.vendor}: {name} failed: {self.error_string(result)}")
            return None
        if int(result[0]) != 0:
            raise GpuError(f"{self.vendor}: {name} failed: {self.error_string(result[0])}")
        n = len(result)  # (status, *results): none, one, or a tuple of them
        return None if n == 1 else result[1] if n == 2 else result[1:]

    def _current_here(self) -> None:
        """This shim's device is the calling thread's current one."""
        if getattr(DriverShim._current, "shim", None) is not self:
            DriverShim._current.shim = self
            self._make_current()

    # -- the direct calls ---------------------------------------------------------------------------------
    def use_direct_calls(self, exported: dict[str, Any] | None, signatures: dict[str, str]) -> None:
        """Make the hot calls through the binding's C functions (`exported`: its Cython module's
        __pyx_capi__, name -> capsule), where the compiled helper is built and the binding exports them
        all with the C signatures it was written for (`signatures`, by name); else they stay with its
        Python functions."""
        if _driver_calls is None or not exported:
            return
        names = [getattr(self.names, call) for call in DIRECT_CALLS.values()]
        try:  # each call makes this shim's device current, takes handle objects and raises on failure itself
            self.direct = _driver_calls.Calls(tuple(exported[n] for n in names), tuple(signatures[n] for n in names),
                                              self, address, tuple(names))  # fmt: skip
        except (KeyError, TypeError) as e:  # a binding without one of them, or one whose C function changed
            log.info("%s: driver calls through the binding's Python functions (%s)", self.vendor, e)

    def _failed(self, name: str, status: int) -> None:
        """Raise the GpuError of the driver's `name` returning `status` (an int) to a direct call (the
        compiled helper calls this, having made the call with this shim's device current)."""
        enum = getattr(self.api, self.names.status, None)
        raise GpuError(f"{self.vendor}: {name} failed: {self.error_string(enum(status) if enum else status)}")

    def launcher(self, function: Any, stream: Any, signature: str) -> Any:
        """A compiled launcher of `function` on `stream` (_driver_calls.Launcher: the arguments packed and
        the launch made in one C call), where the direct calls are in use and the signature has scalars
        and pointers only; else None."""
        if self.direct is None or any(code not in _PACKED for code in signature):
            return None
        return _driver_calls.Launcher(self.direct, address(function), address(stream), signature)

    def error_string(self, status: Any) -> str:
        try:
            result = getattr(self.api, self.names.error_string)(status)
            text = result[-1] if isinstance(result, tuple) else result
            text = text.decode() if isinstance(text, bytes) else str(text)
        except Exception:  # the message is a courtesy; the status below is the fact
            text = "unknown error"
        return f"{text} ({getattr(status, 'name', status)})"

    # memory
    def malloc(self, nbytes: int) -> int:
        return address(self.call(self.names.malloc, max(1, nbytes)))

    def free(self, ptr: int) -> None:
        self.call(self.names.free, ptr)

    def host_alloc(self, nbytes: int) -> int:
        """Pinned (page-locked) host memory: the source of asynchronous host-to-device copies."""
        return address(self.call(self.names.host_alloc, *self._host_alloc_args(max(1, nbytes))))

    def host_free(self, ptr: int) -> None:
        self.call(self.names.host_free, ptr)

    def host_register(self, ptr: int, nbytes: int) -> None:
        self.call(self.names.host_register, ptr, nbytes, 0)

    def host_unregister(self, ptr: int) -> None:
        self.call(self.names.host_unregister, ptr)

    def mem_info(self) -> tuple[int, int]:
        free, total = self.call(self.names.mem_info)
        return int(free), int(total)

    # streams and events
    def stream(self) -> Any:
        return self.call(self.names.stream_create, STREAM_NON_BLOCKING)

    def sync(self, stream: Any) -> None:
        if self.direct is None:
            self.call(self.names.stream_sync, stream)
        else:
            self.direct.sync(stream)
        self.sync_count(stream).n += 1

    def syncs(self, stream: Any) -> int:
        """How many times the host has waited for `stream` (the one object its owner keeps): at each,
        everything queued on it before was done. Whoever needs to know that some work of theirs is done
        compares this count with the one when they queued it, whatever made the wait."""
        return self.sync_count(stream).n

    def sync_count(self, stream: Any) -> SyncCount:
        """The count `syncs` reads, as an object its holder reads with no call (a MoE step asks a dozen times)."""
        count = self._syncs.get(id(stream))
        if count is None:
            count = self._syncs[id(stream)] = SyncCount()
        return count

    def event(self, timing: bool = False) -> Any:
        return self.call(self.names.event_create, EVENT_DEFAULT if timing else EVENT_DISABLE_TIMING)

    def record(self, event: Any, stream: Any) -> None:
        if self.direct is None:
            self.call(self.names.event_record, event, stream)
        else:
            self.direct.record(event, stream)

    def wait(self, stream: Any, event: Any) -> None:
        """Work queued on `stream` after this waits for `event` (no host synchronisation)."""
        if self.direct is None:
            self.call(self.names.stream_wait_event, stream, event, 0)
        else:
            self.direct.wait(stream, event)

    def event_sync(self, event: Any) -> None:
        if self.direct is None:
            self.call(self.names.event_sync, event)
        else:
            self.direct.event_sync(event)

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(self.call(self.names.event_elapsed, start, end))

    # copies: device pointers and host pointers are ints
    def htod(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        if not nbytes:
            return
        if self.direct is None:
            self.call(self.names.memcpy_htod, dst, src, nbytes, stream)
        else:
            self.direct.htod(dst, src, nbytes, stream)

    def dtoh(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        if not nbytes:
            return
        if self.direct is None:
            self.call(self.names.memcpy_dtoh, dst, src, nbytes, stream)
        else:
            self.direct.dtoh(dst, src, nbytes, stream)

    def dtod(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        if not nbytes:
            return
        if self.direct is None:
            self.call(self.names.memcpy_dtod, dst, src, nbytes, stream)
        else:
            self.direct.dtod(dst, src, nbytes, stream)

    memset_signed = False  # hip-python takes the 32-bit pattern as a C int, cuda-python as unsigned

    def memset32(self, dst: int, value: int, count: int, stream: Any) -> None:
        if not count:
            return
        pattern = value & 0xFFFFFFFF
        if self.direct is not None:  # (a C int or unsigned int: the same 32 bits in the same register)
            self.direct.memset32(dst, pattern, count, stream)
            return
        if self.memset_signed and pattern >= 1 << 31:
            pattern -= 1 << 32  # the same 32 bits as a signed int
        self.call(self.names.memset_d32, dst, pattern, count, stream)

    # modules and launches
    def load_module(self, binary: bytes) -> Any:
        return self.call(self.names.module_load, binary)

    def function(self, module: Any, name: str) -> Any:
        return self.call(self.names.module_function, module, name.encode())

    def launch(self, function: Any, grid: Sequence[int], block: Sequence[int], shared: int, stream: Any, params: int) -> None:
        gx, gy, gz = _dims3(grid)
        bx, by, bz = _dims3(block)
        if self.direct is None:
            self.call(self.names.launch, function, gx, gy, gz, bx, by, bz, shared, stream, params, self.launch_extra)
        else:
            self.direct.launch(function, gx, gy, gz, bx, by, bz, shared, stream, params)

    def driver_version(self) -> int:
        return int(self.call(self.names.driver_version))


class SyncCount:
    """How many times the host has waited for one stream (DriverShim.syncs)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


def _dims3(dims: Sequence[int]) -> tuple[int, int, int]:
    """A grid or block of one to three dimensions as (x, y, z), the missing ones 1."""
    n = len(dims)
    if n == 1:
        return dims[0], 1, 1
    if n == 2:
        return dims[0], dims[1], 1
    return dims[0], dims[1], dims[2]


# -- kernel parameters ---------------------------------------------------------------------------------


class Dims4(ctypes.Structure):
    """hip_kernels/elementwise.hip's Dims4, passed by value."""

    _fields_ = [("n", ctypes.c_int64 * 4), ("so", ctypes.c_int64 * 4), ("sa", ctypes.c_int64 * 4), ("sb", ctypes.c_int64 * 4)]


# one letter per C parameter type of a kernel signature (KERNEL_SIGNATURES in kernels.py)
PARAM_TYPES: dict[str, Any] = {
    "p": ctypes.c_uint64,  # any pointer
    "i": ctypes.c_int32,
    "l": ctypes.c_int64,
    "f": ctypes.c_float,
    "d": ctypes.c_double,
    "D": Dims4,
}


class PackedParams:
    """The `void* params[]` block of a launch: each argument in its C type, and the array of their addresses."""

    __slots__ = ("array", "values")

    def __init__(self, signature: str, args: Sequence[Any]):
        if len(signature) != len(args):
            raise TypeError(f"kernel takes {len(signature)} arguments ({signature}), got {len(args)}")
        self.values = [a if code == "D" else PARAM_TYPES[code](a) for code, a in zip(signature, args)]
        self.array = (ctypes.c_void_p * len(args))(*[ctypes.addressof(v) for v in self.values])

    @property
    def address(self) -> int:
        return ctypes.addressof(self.array)


_PACKED = {"p": "Q", "i": "i4x", "l": "q", "f": "f4x", "d": "d"}  # each argument in an 8-byte slot


class ParamBlock:
    """A kernel's `void* params[]`, reused launch after launch: each argument has a fixed 8-byte slot in
    one buffer and the array of their addresses never changes, so a launch packs its arguments with one
    struct.pack_into instead of building a ctypes object per argument (microseconds a launch, and a MoE
    layer step launches several). The driver copies the values during the launch call, so the buffer may
    be refilled by the next one at once. Signatures with a struct argument (D) use PackedParams."""

    __slots__ = ("_struct", "address", "array", "buffer")

    def __init__(self, signature: str):
        if any(code not in _PACKED for code in signature):
            raise TypeError(f"ParamBlock packs scalars and pointers only, got signature {signature!r}")
        self._struct = struct.Struct("<" + "".join(_PACKED[code] for code in signature))
        self.buffer = ctypes.create_string_buffer(max(8, 8 * len(signature)))
        base = ctypes.addressof(self.buffer)
        self.array = (ctypes.c_void_p * max(1, len(signature)))(*[base + 8 * i for i in range(len(signature))])
        self.address = ctypes.addressof(self.array)

    def pack(self, args: Sequence[Any]) -> int:
        """The arguments in their slots; returns the params array's address for the launch."""
        try:
            self._struct.pack_into(self.buffer, 0, *args)
        except struct.error as e:
            raise TypeError(f"kernel arguments {list(args)!r}: {e}") from None
        return self.address


def param_block(signature: str) -> ParamBlock | None:
    """A reusable parameter block for the signature, or None where it has a struct argument."""
    return ParamBlock(signature) if all(code in _PACKED for code in signature) else None


def open_runtime(vendor: str, device: int = 0) -> DriverShim:
    """The shim for `vendor` ("cuda", "hip" or "sim", the simulated device), or one FomoeError naming what to install."""
    if vendor == "cuda":
        from fomoepy.runtime.shim_cuda import open_cuda

        return open_cuda(device)
    if vendor == "hip":
        from fomoepy.runtime.shim_hip import open_hip

        return open_hip(device)
    if vendor == "sim":
        from fomoepy.runtime.sim.shim import open_sim

        return open_sim(device)
    raise FomoeError(f"GPU vendor {vendor!r} is unknown (known: {', '.join(VENDORS)})")
