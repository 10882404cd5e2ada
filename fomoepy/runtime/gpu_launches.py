"""The arithmetic of a MoE layer step on the GPU (fomoepy.runtime.gpu_experts.GpuExperts): its tables, the
grouped launches of its stages over the device slots (hip_kernels/experts.hip) and the combine.

A step's tables go up in one copy; its work items are launched by stretch (gate/up, then down) as their
experts are in slots, then one combine adds each token's pairs; a step that launches every item at once
fuses down and the weighted sum for up to DOWN_SUM_MAX_TOKENS tokens. Where the binding's C functions
are in use, a decode step (one token) packs and uploads its tables and makes each launch in one C call
(fomoepy/runtime/_driver_calls.c's DecodeLaunch): the same driver calls, with the same arguments, in the
same order as the Python path below, which stays the definition and serves everywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fomoepy.errors import UnsupportedQuantType
from fomoepy.experts.source import LayerExperts
from fomoepy.runtime import kernels
from fomoepy.runtime.gpu_arrays import DeviceArray
from fomoepy.runtime.gpu_sides import DeviceSide
from fomoepy.runtime.moe_tables import MOE_TILE, PAIR_DTYPE, MoETables, build_tables
from fomoepy.runtime.pinned import contiguous_address

try:  # optional (setup.py): without it a decode step's tables and launches are made in Python (the same calls)
    from fomoepy.runtime._driver_calls import DecodeLaunch
except ImportError:
    DecodeLaunch = None

DOWN_SUM_MAX_TOKENS = 4  # up to this many tokens (all in slots, or all copied) the fused down + weighted-sum kernel is used


@dataclass(slots=True)
class Launch:
    """One layer step's grouped launches: its tables on the device and the arrays its stages write."""

    layer: int
    tables: MoETables
    on_device: DeviceArray  # tables.host, uploaded
    h: DeviceArray  # [T, D]
    act: DeviceArray  # [T*k, F]
    part: DeviceArray | None  # [T*k, D]: each pair's down output, when a combine sums them
    out: DeviceArray  # [T, D]
    compiled: Any = None  # a decode step's DecodeLaunch, which makes its tables and launches in C


class ExpertLaunches:
    """The tables and launches of each layer's steps; `side_of[layer]` is the device side the layer's slots
    and decode arrays are on, `offsets[layer]` where gate, up and down sit in one of its slots."""

    def __init__(self, layers: tuple[LayerExperts, ...], side_of: list[DeviceSide], offsets: list[tuple[int, int, int]]):
        self.layers = layers
        self.side_of = side_of
        self.offsets = offsets
        self.names: list[dict] = []  # per layer: gate/up by tile, down, fused down + sum; looked up once
        for layer in layers:
            gate, up, down = layer.parts
            if gate.qtype != up.qtype:
                raise UnsupportedQuantType(
                    f"layer {layer.layer}: gate is {gate.qtype.name} and up is {up.qtype.name}; the grouped expert kernel needs one type for both"
                )
            gate_up = kernels.kernel_name("moe_gate_up", gate.qtype, gate.tensor)
            self.names.append({"gate_up": {t: f"{gate_up}_t{t}" for t in (1, MOE_TILE)},
                               "down": kernels.kernel_name("moe_down", down.qtype, down.tensor),
                               "down_sum": kernels.kernel_name("moe_down_sum", down.qtype, down.tensor)})  # fmt: skip
        self._compiled: list[Any] = [None] * len(layers)  # per layer: its DecodeLaunch, False where none can be made

    def close(self) -> None:
        """The DecodeLaunches go with the decode arrays they name (DeviceSide.decode_arrays, cleared too)."""
        self._compiled = [None] * len(self.layers)

    def prepare(self, layer: int, h: DeviceArray, ids: np.ndarray, weights: np.ndarray, slot_ptr: dict[int, int],
                first: list[int] | None, at_hand: list[int]) -> Launch:  # fmt: skip
        """The step's tables, in one upload, and its arrays. `first`: when given (a step split between the
        experts in slots and those copied up), they get the first work items, to be launched on their own,
        and those `at_hand` (copied before any read lands) the next ones."""
        gate_m, _, down_m = self.layers[layer].parts
        T, k = ids.shape
        F, D = gate_m.shape[0], down_m.shape[0]
        side = self.side_of[layer]
        dev = side.dev
        then = at_hand if first is not None else ()
        if T == 1:  # a decode step: its tables and intermediate arrays are the side's, reused (decode_scratch)
            on_device, act, part = side.decode_scratch(k, F, D)
            compiled = self._decode_launch(layer, side, k, on_device, act, part) if side.rt.direct is not None else None
            out = dev.empty((T, D))
            if compiled is not None:
                n_first, experts = compiled.tables(ids[0].tolist(), weights[0].tolist(), slot_ptr, first or (), then)
                tables = MoETables(None, k * PAIR_DTYPE.itemsize, n_first, k, 1, experts)  # type: ignore[arg-type]
                return Launch(layer, tables, on_device, h, act, part if first is not None else None, out, compiled)
            run = Launch(layer, build_tables(ids, weights, slot_ptr, self.offsets[layer], first or (), then), on_device, h, act,
                         part if first is not None else None, out)  # fmt: skip
            # the tables into the side's reused device table, on the compute stream (behind the launches
            # that read the last ones); their host bytes kept until the stream is next waited for, as
            # dev.upload keeps its own
            dev._keepalive.append(run.tables.host)
            side.rt.htod(on_device.ptr, contiguous_address(run.tables.host), run.tables.host.nbytes, dev.stream)
            return run
        tables = build_tables(ids, weights, slot_ptr, self.offsets[layer], first or (), then)
        part = dev.empty((T * k, D)) if first is not None or T > DOWN_SUM_MAX_TOKENS else None
        return Launch(layer, tables, dev.upload(tables.host), h, dev.empty((T * k, F)), part, dev.empty((T, D)))

    def _decode_launch(self, layer: int, side: DeviceSide, k: int, tables: DeviceArray, act: DeviceArray, part: DeviceArray) -> Any:
        """The layer's DecodeLaunch over the side's decode arrays, made at its first decode step; None where
        the extension is not built or a kernel's launches go through Python."""
        compiled = self._compiled[layer]
        if compiled is None:
            compiled = self._compiled[layer] = self._make_decode_launch(layer, side, k, tables, act, part) or False
        return compiled or None

    def _make_decode_launch(self, layer: int, side: DeviceSide, k: int, tables: DeviceArray, act: DeviceArray, part: DeviceArray) -> Any:
        if DecodeLaunch is None:
            return None
        names = self.names[layer]
        launchers = [side.dev.compiled_launcher(name) for name in (names["gate_up"][1], names["down"], names["down_sum"], "moe_combine")]
        if any(launcher is None for launcher in launchers):
            return None
        gate_m, _, down_m = self.layers[layer].parts
        F, D = gate_m.shape[0], down_m.shape[0]
        return DecodeLaunch(*launchers, tables.ptr, act.ptr, part.ptr, tuple(self.offsets[layer]), F, D, k, gate_m.nbytes // F,
                            down_m.nbytes // D, side.dev._keepalive)  # fmt: skip

    def stages(self, run: Launch, start: int, stop: int) -> None:
        """gate/up, then down, over work items [start, stop): the act and part rows of their pairs."""
        if run.compiled is not None:
            run.compiled.stages(start, stop, run.h.ptr)
            return
        if stop <= start:
            return
        gate_m, _, down_m = self.layers[run.layer].parts
        F, D = gate_m.shape[0], down_m.shape[0]
        k = run.act.shape[0] // run.h.shape[0]
        dev = self.side_of[run.layer].dev
        work = run.on_device.ptr + run.tables.work_row(start)
        names = self.names[run.layer]
        dev.launch(names["gate_up"][run.tables.tile], (-(-F // 4), stop - start), 128, work, run.h.ptr, D, F, k, gate_m.nbytes // F, run.act.ptr)
        dev.launch(names["down"], (-(-D // 4), stop - start), 128, work, run.act.ptr, D, F, down_m.nbytes // D, run.part.ptr)

    def combine(self, run: Launch) -> None:
        """out[t] = sum_j w[t, j] * part[t*k + j], j ascending (the fused kernel's order)."""
        if run.compiled is not None:
            run.compiled.combine(run.out.ptr)
            return
        T, D = run.out.shape
        k = run.act.shape[0] // T
        self.side_of[run.layer].dev.launch("moe_combine", (-(-(T * D) // 256),), 256, run.on_device.ptr, run.part.ptr, T, D, k, run.out.ptr)

    def grouped(self, run: Launch) -> None:
        """Every work item in one launch per stage; a few tokens fuse down and the weighted sum."""
        T, D = run.out.shape
        if T > DOWN_SUM_MAX_TOKENS:
            self.stages(run, 0, run.tables.n_work)
            self.combine(run)
            return
        if run.compiled is not None:
            run.compiled.grouped(run.h.ptr, run.out.ptr)
            return
        gate_m, _, down_m = self.layers[run.layer].parts
        F = gate_m.shape[0]
        k = run.act.shape[0] // T
        dev = self.side_of[run.layer].dev
        work = run.on_device.ptr + run.tables.work_offset
        names = self.names[run.layer]
        dev.launch(names["gate_up"][run.tables.tile], (-(-F // 4), run.tables.n_work), 128, work, run.h.ptr, D, F, k, gate_m.nbytes // F, run.act.ptr)
        dev.launch(names["down_sum"], (-(-D // 4), T), 128, run.on_device.ptr, run.act.ptr, D, F, k, down_m.nbytes // D, run.out.ptr)
