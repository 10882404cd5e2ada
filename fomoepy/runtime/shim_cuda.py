"""CUDA through cuda-python's driver API (`cuda.bindings.driver`): the names, and a primary context."""

from __future__ import annotations

from fomoepy.errors import FomoeError
from fomoepy.runtime.shim import ApiNames, DriverShim

INSTALL = "pip install 'fomoepy[cuda]'"

CUDA_NAMES = ApiNames(
    malloc="cuMemAlloc",
    free="cuMemFree",
    host_alloc="cuMemAllocHost",
    host_free="cuMemFreeHost",
    host_register="cuMemHostRegister",
    host_unregister="cuMemHostUnregister",
    stream_create="cuStreamCreate",
    stream_sync="cuStreamSynchronize",
    stream_wait_event="cuStreamWaitEvent",
    event_create="cuEventCreate",
    event_record="cuEventRecord",
    event_sync="cuEventSynchronize",
    event_elapsed="cuEventElapsedTime",
    memcpy_htod="cuMemcpyHtoDAsync",
    memcpy_dtoh="cuMemcpyDtoHAsync",
    memcpy_dtod="cuMemcpyDtoDAsync",
    memset_d32="cuMemsetD32Async",
    module_load="cuModuleLoadData",
    module_function="cuModuleGetFunction",
    launch="cuLaunchKernel",
    mem_info="cuMemGetInfo",
    driver_version="cuDriverGetVersion",
    error_string="cuGetErrorString",
    status="CUresult",
)

# the C signatures fomoepy/runtime/_driver_calls.c calls cuda-python's C functions with (as cydriver names them)
CUDA_SIGNATURES = {
    "cuLaunchKernel": "CUresult (CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int, "
                      "unsigned int, unsigned int, CUstream, void **, void **)",
    "cuMemcpyHtoDAsync": "CUresult (CUdeviceptr, void const *, size_t, CUstream)",
    "cuMemcpyDtoHAsync": "CUresult (void *, CUdeviceptr, size_t, CUstream)",
    "cuMemcpyDtoDAsync": "CUresult (CUdeviceptr, CUdeviceptr, size_t, CUstream)",
    "cuEventRecord": "CUresult (CUevent, CUstream)",
    "cuStreamWaitEvent": "CUresult (CUstream, CUevent, unsigned int)",
    "cuStreamSynchronize": "CUresult (CUstream)",
    "cuEventSynchronize": "CUresult (CUevent)",
    "cuMemsetD32Async": "CUresult (CUdeviceptr, unsigned int, size_t, CUstream)",
}  # fmt: skip


class CudaShim(DriverShim):
    vendor = "cuda"
    names = CUDA_NAMES
    launch_extra = 0

    def __init__(self, api, device: int = 0):
        super().__init__(api, device)
        DriverShim._current.shim = self  # the context is made current by hand just below
        self.handle = self.call("cuDeviceGet", device)
        self.context = self.call("cuDevicePrimaryCtxRetain", self.handle)
        self.call("cuCtxSetCurrent", self.context)
        attr = api.CUdevice_attribute
        major = self.call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.handle)
        minor = self.call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.handle)
        self.arch = f"sm_{major}{minor}"
        self.device_name = self.call("cuDeviceGetName", 256, self.handle).split(b"\0")[0].decode()
        self.total_memory = int(self.call("cuDeviceTotalMem", self.handle))
        self.warp_size = int(self.call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_WARP_SIZE, self.handle))
        from cuda.bindings import cydriver  # cuda-python's C layer: the driver functions its Python ones call

        self.use_direct_calls(getattr(cydriver, "__pyx_capi__", None), CUDA_SIGNATURES)

    def _make_current(self) -> None:
        self.api.cuCtxSetCurrent(self.context)


def open_cuda(device: int = 0) -> CudaShim:
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise FomoeError(f"the CUDA backend needs cuda-python: {INSTALL}") from e
    try:
        (status,) = driver.cuInit(0)
    except Exception as e:  # cuda-pathfinder raises when libcuda.so.1 is absent
        raise FomoeError(f"no NVIDIA driver found (libcuda.so.1 could not be loaded: install the NVIDIA driver): {e}") from e
    if int(status) != 0:
        raise FomoeError(f"no usable CUDA device: cuInit failed with {getattr(status, 'name', status)}")
    status, count = driver.cuDeviceGetCount()
    if int(status) != 0 or count <= device:
        raise FomoeError(f"no CUDA device {device}: the driver reports {count if int(status) == 0 else 0} device(s)")
    return CudaShim(driver, device)
