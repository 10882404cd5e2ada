"""The simulated device behind the driver shim: `--backend sim` (never chosen by `auto`).

The driver (sim_driver.cpp) is called through ctypes with the same calls, in the same order, as
hip-python and cuda-python make them, so GpuBackend, GpuExperts and the placement code above run
unchanged; only the kernels' code objects differ (host shared libraries, see build.py).

Configuration, for tests and debugging (read when the driver is first opened in a process):
    FOMOEPY_SIM_DEVICES   number of simulated devices (default 4)
    FOMOEPY_SIM_MEMORY    bytes per device (default 16 GiB, an RX 9070's)
    FOMOEPY_SIM_DEFERRED  1: a stream runs its work only when a sync or an event needs it, the host
                          sees a copy down only once it syncs that copy's stream, and a free runs no
                          stream (sim_streams.h)
    FOMOEPY_SIM_ORDER     a seed: each block's warps run in an order drawn from it (default 0: in order)
    FOMOEPY_SIM_RACECHECK 0: kernels built without the shared-memory race detector (build.py)
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

from fomoepy.errors import FomoeError
from fomoepy.runtime.shim import ApiNames, DriverShim

c_void_p, c_size_t, c_int, c_uint = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint

SIM_NAMES = ApiNames(
    malloc="malloc",
    free="free",
    host_alloc="host_alloc",
    host_free="host_free",
    host_register="host_register",
    host_unregister="host_unregister",
    stream_create="stream_create",
    stream_sync="stream_sync",
    stream_wait_event="stream_wait_event",
    event_create="event_create",
    event_record="event_record",
    event_sync="event_sync",
    event_elapsed="event_elapsed",
    memcpy_htod="memcpy_htod",
    memcpy_dtoh="memcpy_dtoh",
    memcpy_dtod="memcpy_dtod",
    memset_d32="memset_d32",
    module_load="module_load",
    module_function="module_function",
    launch="launch",
    mem_info="mem_info",
    driver_version="driver_version",
    error_string="error_string",
)

_SIGNATURES: dict[str, list[Any]] = {
    "sim_configure": [c_int, ctypes.c_ulonglong, c_int],
    "sim_device_count": [ctypes.POINTER(c_int)],
    "sim_set_order_seed": [c_uint],
    "sim_mem_info": [c_int, ctypes.POINTER(c_size_t), ctypes.POINTER(c_size_t)],
    "sim_malloc": [c_int, ctypes.POINTER(c_void_p), c_size_t],
    "sim_free": [c_void_p],
    "sim_host_alloc": [ctypes.POINTER(c_void_p), c_size_t],
    "sim_host_free": [c_void_p],
    "sim_host_register": [c_void_p, c_size_t],
    "sim_host_unregister": [c_void_p],
    "sim_allocation_count": [c_int, ctypes.POINTER(c_size_t), ctypes.POINTER(c_size_t)],
    "sim_stream_create": [c_int, ctypes.POINTER(c_void_p)],
    "sim_stream_sync": [c_void_p],
    "sim_event_create": [c_int, ctypes.POINTER(c_void_p)],
    "sim_event_record": [c_void_p, c_void_p],
    "sim_stream_wait_event": [c_void_p, c_void_p],
    "sim_event_sync": [c_void_p],
    "sim_event_elapsed": [ctypes.POINTER(ctypes.c_float), c_void_p, c_void_p],
    "sim_memcpy_async": [c_void_p, c_void_p, c_size_t, c_void_p, c_int],
    "sim_memset_d32_async": [c_void_p, c_uint, c_size_t, c_void_p],
    "sim_module_load": [c_int, ctypes.c_char_p, c_size_t, ctypes.POINTER(c_void_p)],
    "sim_module_function": [ctypes.POINTER(c_void_p), c_void_p, ctypes.c_char_p],
    "sim_kernel_params": [c_void_p, ctypes.POINTER(c_int), ctypes.POINTER(c_int), ctypes.POINTER(c_int), ctypes.POINTER(c_int)],
    "sim_launch": [c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p, c_void_p],
}

_lock = threading.Lock()
_driver: ctypes.CDLL | None = None
_config: dict[str, Any] = {}


def driver() -> ctypes.CDLL:
    """The driver library, built if needed and configured from the environment on first use."""
    global _driver
    with _lock:
        if _driver is None:
            from fomoepy.runtime.sim.build import driver_library

            lib = ctypes.CDLL(str(driver_library()))
            for name, args in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, c_int
            lib.sim_last_error.restype = ctypes.c_char_p
            lib.sim_last_error.argtypes = []
            _config.update(
                n_devices=int(os.environ.get("FOMOEPY_SIM_DEVICES", "4")),
                memory_per_device=int(float(os.environ.get("FOMOEPY_SIM_MEMORY", str(16 << 30)))),
                deferred=os.environ.get("FOMOEPY_SIM_DEFERRED", "0") not in ("", "0"),
                order_seed=int(os.environ.get("FOMOEPY_SIM_ORDER", "0") or 0),
            )
            if lib.sim_configure(_config["n_devices"], _config["memory_per_device"], int(_config["deferred"])) != 0:
                raise FomoeError(f"simulated device: {lib.sim_last_error().decode()}")
            lib.sim_set_order_seed(_config["order_seed"])
            _driver = lib
        return _driver


def configure(n_devices: int | None = None, memory_per_device: int | None = None, deferred: bool | None = None,
              order_seed: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Change the simulator's settings (tests; None keeps one); returns the settings before, to restore.
    Devices being dropped must hold no memory. `order_seed` applies to launches submitted from now on."""
    lib = driver()
    before = dict(_config)
    given = (("n_devices", n_devices), ("memory_per_device", memory_per_device), ("deferred", deferred), ("order_seed", order_seed))
    merged = before | {k: v for k, v in given if v is not None}
    if lib.sim_configure(merged["n_devices"], merged["memory_per_device"], int(merged["deferred"])) != 0:
        raise FomoeError(f"simulated device: {lib.sim_last_error().decode()}")
    lib.sim_set_order_seed(merged["order_seed"])
    _config.update(merged)
    return before


class SimApi:
    """The driver's calls for one device, shaped as the bindings' are: (status, results...)."""

    def __init__(self, lib: ctypes.CDLL, device: int):
        self.lib = lib
        self.device = device

    def _out(self, status: int, *values: Any) -> Any:
        return (status, *[getattr(v, "value", v) for v in values])

    def malloc(self, n):
        p = c_void_p()
        return self._out(self.lib.sim_malloc(self.device, ctypes.byref(p), n), p)

    def free(self, p):
        return self.lib.sim_free(p)

    def host_alloc(self, n):
        p = c_void_p()
        return self._out(self.lib.sim_host_alloc(ctypes.byref(p), n), p)

    def host_free(self, p):
        return self.lib.sim_host_free(p)

    def host_register(self, p, n, flags):
        return self.lib.sim_host_register(p, n)

    def host_unregister(self, p):
        return self.lib.sim_host_unregister(p)

    def stream_create(self, flags):
        s = c_void_p()
        return self._out(self.lib.sim_stream_create(self.device, ctypes.byref(s)), s)

    def stream_sync(self, s):
        return self.lib.sim_stream_sync(s)

    def stream_wait_event(self, s, e, flags):
        return self.lib.sim_stream_wait_event(s, e)

    def event_create(self, flags):
        e = c_void_p()
        return self._out(self.lib.sim_event_create(self.device, ctypes.byref(e)), e)

    def event_record(self, e, s):
        return self.lib.sim_event_record(e, s)

    def event_sync(self, e):
        return self.lib.sim_event_sync(e)

    def event_elapsed(self, a, b):
        ms = ctypes.c_float()
        return self._out(self.lib.sim_event_elapsed(ctypes.byref(ms), a, b), ms)

    def memcpy_htod(self, dst, src, n, s):
        return self.lib.sim_memcpy_async(dst, src, n, s, 1)

    def memcpy_dtoh(self, dst, src, n, s):
        return self.lib.sim_memcpy_async(dst, src, n, s, 2)

    def memcpy_dtod(self, dst, src, n, s):
        return self.lib.sim_memcpy_async(dst, src, n, s, 3)

    def memset_d32(self, dst, value, count, s):
        return self.lib.sim_memset_d32_async(dst, value, count, s)

    def module_load(self, image):
        m = c_void_p()
        return self._out(self.lib.sim_module_load(self.device, image, len(image), ctypes.byref(m)), m)

    def module_function(self, module, name):
        f = c_void_p()
        return self._out(self.lib.sim_module_function(ctypes.byref(f), module, name), f)

    def launch(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        return self.lib.sim_launch(fn, gx, gy, gz, bx, by, bz, shared, stream, params)

    def mem_info(self):
        free, total = c_size_t(), c_size_t()
        return self._out(self.lib.sim_mem_info(self.device, ctypes.byref(free), ctypes.byref(total)), free, total)

    def driver_version(self):
        return (0, 1)

    def error_string(self, status):
        return self.lib.sim_last_error().decode()


class SimShim(DriverShim):
    """One simulated device: memory, streams and events in sim_driver.cpp; kernels as host code."""

    vendor = "sim"
    names = SIM_NAMES
    arch = "sim"

    def __init__(self, device: int = 0):
        lib = driver()
        count = c_int()
        lib.sim_device_count(ctypes.byref(count))
        if not 0 <= device < count.value:
            raise FomoeError(f"no simulated device {device}: the simulator has {count.value} (FOMOEPY_SIM_DEVICES)")
        super().__init__(SimApi(lib, device), device)
        self.device_name = f"simulated device {device} (kernels run as fibers on the CPU)"
        self.total_memory = self.mem_info()[1]
        self.warp_size = 32  # sim_device.h's warps

    def _make_current(self) -> None:
        pass  # every call names its device

    def error_string(self, status: Any) -> str:
        return f"{self.api.error_string(status)} (status {int(status)})"

    def kernel_params(self, function: Any) -> tuple[list[int], list[bool], int]:
        """(sizes, is-pointer flags, launch bound) of a kernel's parameters as its C code declares them."""
        n, bound = c_int(), c_int()
        sizes, pointers = (c_int * 24)(), (c_int * 24)()
        self.api.lib.sim_kernel_params(function, ctypes.byref(n), sizes, pointers, ctypes.byref(bound))
        return list(sizes[: n.value]), [bool(p) for p in pointers[: n.value]], bound.value

    def device_allocations(self) -> tuple[int, int]:
        """(count, bytes) of this device's live allocations (tests: what a backend leaves behind)."""
        count, nbytes = c_size_t(), c_size_t()
        self.api.lib.sim_allocation_count(self.device, ctypes.byref(count), ctypes.byref(nbytes))
        return count.value, nbytes.value


def open_sim(device: int = 0) -> SimShim:
    return SimShim(device)
