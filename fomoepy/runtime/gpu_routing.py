"""The GPU backend's on-device decisions (fomoepy.runtime.gpu.GpuBackend's routing): the router's top-k
computed on the device, every request of a step read back in one copy with the kernels' error flag, and a
decode step's routing made in one C call (_driver_calls.DecodeRoute) where the binding's C functions are
in use; route_many stays the definition.

DeviceRouting is GpuBackend's base: it uses the backend's launches, arrays and read-back area (launch,
compiled_launcher, _matrix, empty, to_host, synchronize, _check_flag, err, _err_host, _readback_host,
_keepalive, _decode_routes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fomoepy.errors import FomoeError
from fomoepy.experts.routing import Routing, routing_of
from fomoepy.runtime import kernels
from fomoepy.runtime.gpu_arrays import DeviceArray

try:  # optional (setup.py): without it a decode step's routing goes through route_many (the same calls)
    from fomoepy.runtime._driver_calls import DecodeRoute
except ImportError:
    DecodeRoute = None

I32 = np.int32
READBACK_BYTES = 64 << 10  # the error flag's area: the flag, then small results read back with it
READBACK_AT = 256  # where the results start in it (an aligned offset past the flag)
DEVICE_GATING = {"softmax": "route_softmax_topk"}


class DeviceRouting:
    def route(self, logits: Any, gating: str, k: int) -> Routing:
        """The router's selection computed on the device; ids, weights and probabilities read back once."""
        if gating == "softmax" and type(logits) is DeviceArray and logits.shape[0] == 1 and len(logits.shape) == 2 and self.rt.direct is not None:
            E = logits.shape[1]
            compiled = self._decode_routes.get((E, k))
            if compiled is None:
                compiled = self._decode_routes[E, k] = self.compiled_route(E, k) or False
            if compiled and logits.strides == (E, 1):  # a decode step's: launched and read back in one C call
                return self.read_routings(compiled.route(logits.ptr, 0), ((1, E, k),))[0]
        return self.route_many([(logits, gating, k)])[0]

    def compiled_route(self, E: int, k: int, router: Any = None, predicted: DeviceArray | None = None, own: Any = None,
                       logits: DeviceArray | None = None) -> Any:  # fmt: skip
        """A decode step's routing in one C call (_driver_calls.DecodeRoute): the top-k of [1, E] softmax
        logits, and, given the next layer's `router` [E, K] and `predicted` [1, E] (its output), that product
        of the step's hidden state and its top-k too; read back together (read_routings). Given the layer's
        `own` router [E, K] and `logits` [1, E] (its output), its product of the hidden state is made first
        (DecodeRoute.route_from). None where the launches go through Python (linear and route_many, the
        definition)."""
        if DecodeRoute is None or READBACK_AT + 4 * 2 * (E + 2 * k) > READBACK_BYTES:
            return None
        route = self.compiled_launcher(DEVICE_GATING["softmax"])
        mv, weight, row_bytes, K = None, 0, 0, 1
        if router is not None:
            W = self._matrix(router)
            K = W.shape[1]
            mv = self.compiled_launcher(f"{kernels.kernel_name('mv', W.qtype, W.name)}_t1")
            if mv is None or W.shape[0] != E or predicted is None or predicted.shape != (1, E):
                return None
            weight, row_bytes = W.ptr, W.row_bytes
        first: tuple = ()  # the layer's own router product, made first
        if own is not None:
            O = self._matrix(own)
            own_mv = self.compiled_launcher(f"{kernels.kernel_name('mv', O.qtype, O.name)}_t1")
            if own_mv is None or O.shape != (E, K) or logits is None or logits.shape != (1, E):
                return None
            first = (own_mv, O.ptr, O.row_bytes, logits.ptr)
        if route is None:
            return None
        return DecodeRoute(route, mv, weight, row_bytes, 0 if predicted is None else predicted.ptr, E, K, k, self.err.ptr,
                           self._err_host, READBACK_AT, self._keepalive, self.rt.sync_count(self.stream), *first)  # fmt: skip

    def read_routings(self, total: int, shapes: Sequence[tuple[int, int, int]]) -> list[Routing]:
        """The routings a compiled route read back (`total` floats, the read-back area's (T, E, k) requests in
        order), after the flag is checked."""
        if self._err_code[0]:  # (_check_flag's test inline; it raises)
            self._check_flag()
        first = READBACK_AT // 4
        return self._routings(self._readback_host[first : first + total].copy(), shapes)

    @staticmethod
    def _routings(host: np.ndarray, shapes: Sequence[tuple[int, int, int]]) -> list[Routing]:
        """Each request's probabilities [T, E], ids [T, k], weights [T, k], one after another in `host`."""
        routings, at = [], 0
        for T, E, k in shapes:
            ids_at, weights_at = at + T * E, at + T * (E + k)
            if T == 1:  # (a decode step's: each a [1, n] view in one indexing, not a slice and a reshape)
                routings.append(routing_of((host[None, ids_at:weights_at].view(I32).astype(np.int64), host[None, weights_at : weights_at + k],
                                            host[None, at:ids_at], None)))  # fmt: skip
            else:
                routings.append(Routing(host[ids_at:weights_at].view(I32).astype(np.int64).reshape(T, k),
                                        host[weights_at : weights_at + T * k].reshape(T, k), host[at:ids_at].reshape(T, E)))  # fmt: skip
            at = weights_at + T * k
        return routings

    def route_many(self, requests: Sequence[tuple[Any, str, int]]) -> list[Routing]:
        """route for each (logits, gating, k), with one read-back for all: probabilities, ids and weights of
        every request in one allocation, copied in one go (a binding call costs microseconds, and a decode
        step routes twice per layer: its own choice and the next layer's prediction)."""
        rows, total = [], 0
        for logits, gating, k in requests:
            kernel = DEVICE_GATING.get(gating)
            if kernel is None:
                raise FomoeError(f"gating {gating!r} has no GPU kernel (have: {', '.join(DEVICE_GATING)})")
            if type(logits) is DeviceArray and len(logits.shape) == 2 and logits.strides == (logits.shape[1], 1):
                T, E = logits.shape  # (a decode step's logits, [T, E] and contiguous, without three calls)
            else:
                logits, T, E, _ = self._rows(self.asdevice(logits).contiguous())
            rows.append((kernel, logits, T, E, k, total))
            total += T * (E + 2 * k)
        small = READBACK_AT + 4 * total <= READBACK_BYTES  # a decode step's: read back with the error flag
        out = None if small else self.empty((max(total, 1),))
        base = self.err.ptr + READBACK_AT if out is None else out.ptr
        err = self.err.ptr
        for kernel, logits, T, E, k, at in rows:
            if T:
                ptr = base + 4 * at
                self.launch(kernel, (T,), 256, logits.ptr, T, E, k, ptr, ptr + 4 * T * E, ptr + 4 * T * (E + k), err, shared=4 * E)
        if out is None:
            self.synchronize(4 * total)
            first = READBACK_AT // 4
            host = self._readback_host[first : first + total].copy()
        else:
            host = self.to_host(out)
        return self._routings(host, [(T, E, k) for _, _, T, E, k, _ in rows])

