"""HIP through hip-python (`hip.hip`): the names, the device's gfx architecture, and nothing else."""

from __future__ import annotations

from fomoepy.errors import FomoeError
from fomoepy.runtime.shim import ApiNames, DriverShim, GpuError

INSTALL = "pip install 'fomoepy[hip]'"

HIP_NAMES = ApiNames(
    malloc="hipMalloc",
    free="hipFree",
    host_alloc="hipHostMalloc",
    host_free="hipHostFree",
    host_register="hipHostRegister",
    host_unregister="hipHostUnregister",
    stream_create="hipStreamCreateWithFlags",
    stream_sync="hipStreamSynchronize",
    stream_wait_event="hipStreamWaitEvent",
    event_create="hipEventCreateWithFlags",
    event_record="hipEventRecord",
    event_sync="hipEventSynchronize",
    event_elapsed="hipEventElapsedTime",
    memcpy_htod="hipMemcpyHtoDAsync",
    memcpy_dtoh="hipMemcpyDtoHAsync",
    memcpy_dtod="hipMemcpyDtoDAsync",
    memset_d32="hipMemsetD32Async",
    module_load="hipModuleLoadData",
    module_function="hipModuleGetFunction",
    launch="hipModuleLaunchKernel",
    mem_info="hipMemGetInfo",
    driver_version="hipDriverGetVersion",
    error_string="hipGetErrorString",
    status="hipError_t",
)

# the C signatures fomoepy/runtime/_driver_calls.c calls hip-python's C functions with (as hip.chip names them)
HIP_SIGNATURES = {
    "hipModuleLaunchKernel": "enum hipError_t (hipFunction_t, unsigned int, unsigned int, unsigned int, unsigned int, "
                             "unsigned int, unsigned int, unsigned int, hipStream_t, void **, void **)",
    "hipMemcpyHtoDAsync": "enum hipError_t (void *, void const *, unsigned long, hipStream_t)",
    "hipMemcpyDtoHAsync": "enum hipError_t (void *, void *, unsigned long, hipStream_t)",
    "hipMemcpyDtoDAsync": "enum hipError_t (void *, void *, unsigned long, hipStream_t)",
    "hipEventRecord": "enum hipError_t (hipEvent_t, hipStream_t)",
    "hipStreamWaitEvent": "enum hipError_t (hipStream_t, hipEvent_t, unsigned int)",
    "hipStreamSynchronize": "enum hipError_t (hipStream_t)",
    "hipEventSynchronize": "enum hipError_t (hipEvent_t)",
    "hipMemsetD32Async": "enum hipError_t (void *, int, unsigned long, hipStream_t)",
}  # fmt: skip


class HipShim(DriverShim):
    vendor = "hip"
    names = HIP_NAMES

    def __init__(self, api, device: int = 0):
        super().__init__(api, device)
        props = api.hipDeviceProp_t()
        self.call("hipGetDeviceProperties", props, device)
        self.arch = _text(props.gcnArchName).split(":")[0]  # "gfx1201:sramecc-:xnack-" -> "gfx1201"
        self.device_name = _text(props.name)
        self.total_memory = int(props.totalGlobalMem)
        self.warp_size = int(props.warpSize)
        from hip import chip  # hip-python's C layer: the driver functions its Python ones call

        self.use_direct_calls(getattr(chip, "__pyx_capi__", None), HIP_SIGNATURES)

    memset_signed = True

    def _make_current(self) -> None:
        result = self.api.hipSetDevice(self.device)
        status = result[0] if isinstance(result, tuple) else result
        if int(status) != 0:
            raise GpuError(f"hip: hipSetDevice({self.device}) failed: {getattr(status, 'name', status)}")

    def _host_alloc_args(self, nbytes: int) -> tuple:
        return (nbytes, 0)  # hipHostMallocDefault


def _text(value) -> str:
    return (value.split(b"\0")[0].decode() if isinstance(value, bytes) else str(value)).strip()


def open_hip(device: int = 0) -> HipShim:
    try:
        from hip import hip
    except ImportError as e:
        raise FomoeError(f"the HIP backend needs hip-python: {INSTALL}") from e
    try:
        (status,) = hip.hipInit(0)
    except Exception as e:  # hip-python raises when libamdhip64.so cannot be opened
        raise FomoeError(f"no ROCm HIP runtime found (libamdhip64.so could not be loaded: install ROCm and the amdgpu driver): {e}") from e
    if int(status) != 0:
        raise FomoeError(f"no usable HIP device: hipInit failed with {getattr(status, 'name', status)}")
    status, count = hip.hipGetDeviceCount()
    if int(status) != 0 or count <= device:
        raise FomoeError(f"no HIP device {device}: the runtime reports {count if int(status) == 0 else 0} device(s)")
    try:
        return HipShim(hip, device)
    except GpuError as e:  # e.g. ROCm 5.x has no hipGetDevicePropertiesR0600, which hip-python 7.2 calls
        raise FomoeError(f"the HIP runtime does not match hip-python 7.2, which needs ROCm >= 6 (>= 6.4 for RDNA4): {e}") from e
