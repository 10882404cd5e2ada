"""Device memory for the GPU backend: a buffer pool and `DeviceArray`, the numpy subset the model uses.

The forward pass (fomoepy/model) is written against numpy: between backend ops it reshapes, slices
a view, gathers heads with an index array, adds, multiplies by a scalar or a broadcast vector, and
writes into the KV cache. `DeviceArray` does exactly those on the device, so the model code runs
unchanged on either backend. Views share memory (shape, element strides, offset); arithmetic
produces new contiguous arrays through one strided kernel (`ew_f32`); numpy operands are uploaded,
and `np.asarray(device_array)` downloads.

All work goes to the backend's one compute stream, in order, so a buffer returned to the pool may
be handed out again at once: any kernel that still reads it was queued before the one that will
write it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from fomoepy.runtime.shim import Dims4

F32 = np.float32

# op codes of ew_f32 (hip_kernels/elementwise.hip)
EW_OPS = {
    "copy": 0, "add": 1, "sub": 2, "mul": 3, "div": 4, "silu": 5, "sigmoid": 6,
    "softplus": 7, "exp": 8, "neg": 9, "sigmoid_mul": 10, "silu_mul": 11, "rsub": 12, "rdiv": 13,
}  # fmt: skip
REVERSED = {"add": "add", "mul": "mul", "sub": "rsub", "div": "rdiv"}  # op(s, a) == REVERSED[op](a, s)
MAX_DIMS = 4


class DeviceBuffer:
    """One device allocation; goes back to its pool (or is freed) when the last array using it is gone."""

    __slots__ = ("nbytes", "pool", "ptr")

    def __init__(self, pool: BufferPool | None, ptr: int, nbytes: int):
        self.pool = pool
        self.ptr = ptr
        self.nbytes = nbytes

    def __del__(self) -> None:
        if self.pool is not None:
            self.pool.release(self.ptr, self.nbytes)


class BufferPool:
    """Allocations by size class, reused in stream order (cuMemAlloc per op would cost more than the op)."""

    def __init__(self, rt: Any, stream: Any):
        self.rt = rt
        self.stream = stream  # the one stream whose order makes reuse safe
        self.free: dict[int, list[int]] = {}
        self.held = 0  # bytes allocated from the driver by this pool

    @staticmethod
    def size_class(nbytes: int) -> int:
        if nbytes <= 256:
            return 256
        if nbytes <= 64 << 20:
            return 1 << (nbytes - 1).bit_length()
        return -(-nbytes // (16 << 20)) * (16 << 20)

    def get(self, nbytes: int) -> DeviceBuffer:
        return self.get_class(self.size_class(nbytes))

    def get_class(self, size: int) -> DeviceBuffer:
        """get of a size that is a size class already (GpuBackend.empty's, worked out once per shape)."""
        stack = self.free.get(size)
        if stack:
            return DeviceBuffer(self, stack.pop(), size)
        try:
            ptr = self.rt.malloc(size)
        except Exception:
            self.trim()  # cached blocks of other sizes may be what stands in the way
            ptr = self.rt.malloc(size)
        self.held += size
        return DeviceBuffer(self, ptr, size)

    def release(self, ptr: int, size: int) -> None:
        self.free.setdefault(size, []).append(ptr)

    def trim(self) -> None:
        """Give every cached block back to the driver (all queued work that used them must be done)."""
        self.rt.sync(self.stream)
        for size, ptrs in self.free.items():
            for ptr in ptrs:
                try:
                    self.rt.free(ptr)
                except Exception:
                    pass
                self.held -= size
        self.free.clear()


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    known = _STRIDES.get(shape)
    if known is not None:
        return known
    strides = []
    acc = 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    out = tuple(reversed(strides))
    if len(_STRIDES) < 4096:  # a model's step makes a few dozen shapes; building them costs microseconds each
        _STRIDES[shape] = out
    return out


_STRIDES: dict[tuple[int, ...], tuple[int, ...]] = {}


def broadcast_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            raise ValueError(f"shapes {a} and {b} do not broadcast")
        out.append(max(x, y))
    return tuple(out)


def broadcast_strides(shape: tuple[int, ...], strides: tuple[int, ...], to: tuple[int, ...]) -> tuple[int, ...]:
    """Strides that read an array of `shape` as `to` (0 on broadcast axes)."""
    pad = len(to) - len(shape)
    shape, strides = (1,) * pad + shape, (0,) * pad + strides
    return tuple(0 if n == 1 and m != 1 else s for n, s, m in zip(shape, strides, to))


def dims4(shape: tuple[int, ...], out: tuple[int, ...], *operands: tuple[int, ...]) -> Dims4:
    """The kernel's 4-D index space: leading axes padded with size 1."""
    if len(shape) > MAX_DIMS:
        raise ValueError(f"device arrays have at most {MAX_DIMS} dimensions, got shape {shape}")
    pad = MAX_DIMS - len(shape)
    d = Dims4()
    d.n[:] = [1] * pad + list(shape)
    d.so[:] = [0] * pad + list(out)
    if operands:
        d.sa[:] = [0] * pad + list(operands[0])
    if len(operands) > 1:
        d.sb[:] = [0] * pad + list(operands[1])
    return d


def normalize_index(key: Any, shape: tuple[int, ...]) -> tuple[list[Any], int | None]:
    """Key as a list with Ellipsis expanded; the position of its one integer-array entry, if any."""
    key = list(key) if isinstance(key, tuple) else [key]
    n_real = sum(1 for k in key if k is not None and k is not Ellipsis)
    if n_real > len(shape):
        raise IndexError(f"too many indices for an array of shape {shape}")
    if any(k is Ellipsis for k in key):
        i = next(i for i, k in enumerate(key) if k is Ellipsis)
        key[i : i + 1] = [slice(None)] * (len(shape) - n_real)
    else:
        key += [slice(None)] * (len(shape) - n_real)
    arrays = [i for i, k in enumerate(key) if isinstance(k, (list, np.ndarray))]
    if len(arrays) > 1:
        raise IndexError("device arrays take at most one integer-array index")
    return key, (arrays[0] if arrays else None)


def view_of(shape, strides, offset, key: list[Any]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Basic indexing (ints, slices, None) of a strided view: the new (shape, strides, offset)."""
    new_shape, new_strides = [], []
    axis = 0
    for k in key:
        if k is None:
            new_shape.append(1)
            new_strides.append(0)
            continue
        n, s = shape[axis], strides[axis]
        if isinstance(k, slice):
            start, stop, step = k.indices(n)
            length = len(range(start, stop, step))
            offset += start * s
            new_shape.append(length)
            new_strides.append(s * step)
        elif isinstance(k, numbers.Integral):
            i = int(k) + n if k < 0 else int(k)
            if not 0 <= i < n:
                raise IndexError(f"index {k} is out of bounds for axis {axis} with size {n}")
            offset += i * s
        else:
            raise IndexError(f"device arrays do not take index {k!r}")
        axis += 1
    return tuple(new_shape), tuple(new_strides), offset


class DeviceArray:
    """A strided view of device memory (float32, or int32 for ids), with numpy's semantics where used."""

    __array_ufunc__ = None  # `numpy_array + device_array` calls our __radd__ instead of converting us
    __slots__ = ("buf", "dev", "dtype", "offset", "ptr", "shape", "strides")

    def __init__(self, dev: Any, buf: DeviceBuffer, shape, dtype=F32, strides=None, offset: int = 0):
        self.dev = dev  # the GpuBackend that launches kernels on this memory
        self.buf = buf
        self.shape = shape = tuple(map(int, shape))
        if strides is None:  # (the known shapes' strides without a call: arrays are made by the dozen a step)
            strides = _STRIDES.get(shape) or contiguous_strides(shape)
        self.strides = tuple(strides)
        self.offset = offset  # elements
        self.dtype = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
        # the first element's address: a view's buffer and offset never change, and kernels ask for it
        # several times a launch
        self.ptr = buf.ptr + offset * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)  # (np.prod of a tuple costs microseconds; the shape's ints are Python's)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def is_contiguous(self) -> bool:
        if self.strides == contiguous_strides(self.shape):
            return True
        return all(s == c for n, s, c in zip(self.shape, self.strides, contiguous_strides(self.shape)) if n != 1)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, strides={self.strides})"

    # -- views and copies -----------------------------------------------------------------------------
    def view(self, shape, strides, offset: int) -> DeviceArray:
        return DeviceArray(self.dev, self.buf, shape, self.dtype, strides, offset)

    def contiguous(self) -> DeviceArray:
        if self.strides == _STRIDES.get(self.shape):  # (the common case, without the property's calls)
            return self
        return self if self.is_contiguous else self.copy()

    def copy(self) -> DeviceArray:
        out = self.dev.empty(self.shape, self.dtype)
        self.dev.copy_into(out, self)
        return out

    def astype(self, dtype) -> DeviceArray:
        if np.dtype(dtype) != self.dtype:
            raise TypeError(f"device arrays do not convert {self.dtype} to {np.dtype(dtype)}")
        return self.copy()

    def reshape(self, *shape) -> DeviceArray:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = tuple(int(n) for n in shape)
        if -1 in shape:
            known = int(np.prod([n for n in shape if n != -1], dtype=np.int64))
            shape = tuple(self.size // known if n == -1 else n for n in shape)
        if int(np.prod(shape, dtype=np.int64)) != self.size:
            raise ValueError(f"cannot reshape an array of shape {self.shape} into {shape}")
        base = self.contiguous()
        return base.view(shape, contiguous_strides(shape), base.offset)

    @property
    def T(self) -> DeviceArray:
        return self.view(self.shape[::-1], self.strides[::-1], self.offset)

    def __getitem__(self, key) -> DeviceArray:
        key, adv = normalize_index(key, self.shape)
        if adv is None:
            return self.view(*view_of(self.shape, self.strides, self.offset, key))
        # one integer array (the others full slices): gather along that axis
        if any(not (isinstance(k, slice) and k == slice(None)) for i, k in enumerate(key) if i != adv):
            raise IndexError("an integer-array index on a device array must come with full slices only")
        axis = sum(1 for k in key[:adv] if k is not None)
        return self.dev.gather(self, axis, np.asarray(key[adv]))

    def __setitem__(self, key, value) -> None:
        key, adv = normalize_index(key, self.shape)
        if adv is not None:
            raise IndexError("device arrays take no integer-array index on assignment")
        target = self.view(*view_of(self.shape, self.strides, self.offset, key))
        self.dev.copy_into(target, self.dev.asdevice(value, target.dtype))

    # -- host transfer --------------------------------------------------------------------------------
    def to_host(self) -> np.ndarray:
        return self.dev.to_host(self)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self.to_host()
        return out if dtype is None else out.astype(dtype)

    # -- arithmetic -----------------------------------------------------------------------------------
    def __add__(self, other):
        return self.dev.binary("add", self, other)

    def __radd__(self, other):
        return self.dev.binary("add", other, self)

    def __sub__(self, other):
        return self.dev.binary("sub", self, other)

    def __rsub__(self, other):
        return self.dev.binary("sub", other, self)

    def __mul__(self, other):
        return self.dev.binary("mul", self, other)

    def __rmul__(self, other):
        return self.dev.binary("mul", other, self)

    def __truediv__(self, other):
        return self.dev.binary("div", self, other)

    def __rtruediv__(self, other):
        return self.dev.binary("div", other, self)

    def __neg__(self):
        return self.dev.unary("neg", self)
