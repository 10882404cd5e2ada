"""Placement of layers on devices, and the relay of the hidden state between them.

Pure policy over layer indices: which device owns each layer's dense weights, KV/recurrent
state and device expert tier. The hidden state crosses devices only where consecutive layers
sit on different ones, through host memory (`relay`).

    pingpong  layer L on device L mod N (FOMOE's layout: every token visits every device in turn)
    blocks    contiguous ranges, as even as possible (one relay per device boundary)
    explicit  a map such as "0,0,1,1,1,0": one device index per layer
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fomoepy.errors import FomoeError

PLACEMENTS = ("pingpong", "blocks")


@dataclass(frozen=True)
class Placement:
    n_devices: int
    device_of_layer: tuple[int, ...]

    @classmethod
    def single(cls, n_layer: int) -> Placement:
        return cls(1, (0,) * n_layer)

    @classmethod
    def pingpong(cls, n_layer: int, n_devices: int) -> Placement:
        return cls(n_devices, tuple(layer % n_devices for layer in range(n_layer)))

    @classmethod
    def blocks(cls, n_layer: int, n_devices: int) -> Placement:
        # the first n_layer % n_devices devices take one layer more
        base, extra = divmod(n_layer, n_devices)
        owners = []
        for d in range(n_devices):
            owners += [d] * (base + (1 if d < extra else 0))
        return cls(n_devices, tuple(owners))

    @classmethod
    def parse(cls, text: str, n_layer: int, n_devices: int) -> Placement:
        """'pingpong', 'blocks', or an explicit comma-separated device index per layer."""
        if n_devices < 1:
            raise FomoeError(f"--devices must be >= 1, got {n_devices}")
        if text == "pingpong":
            return cls.pingpong(n_layer, n_devices)
        if text == "blocks":
            return cls.blocks(n_layer, n_devices)
        try:
            owners = tuple(int(t) for t in text.split(","))
        except ValueError:
            raise FomoeError(
                f"--placement must be pingpong, blocks or one device index per layer (e.g. 0,0,1,1), got {text!r}"
            ) from None
        if len(owners) != n_layer:
            raise FomoeError(f"--placement lists {len(owners)} devices, the model has {n_layer} layers")
        bad = [d for d in owners if not 0 <= d < n_devices]
        if bad:
            raise FomoeError(f"--placement names device {bad[0]}, expected 0..{n_devices - 1}")
        return cls(n_devices, owners)

    def relays(self) -> int:
        """Device changes a token's hidden state makes on its way through the layers."""
        return sum(a != b for a, b in zip(self.device_of_layer, self.device_of_layer[1:]))

    def device_of_tensor(self, name: str) -> int:
        """A layer's tensors live with the layer; the rest (output norm and head) with the last layer."""
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        return self.device_of_layer[layer]


def relay(x: Any, src: Any, dst: Any) -> Any:
    """Move the hidden state from backend `src` to backend `dst` through host memory.

    On the CPU backend this is a copy (the logical devices share one address space, but the path
    is the one a GPU pair takes: download to a host buffer, upload to the other device).
    """
    host = np.array(np.asarray(x), dtype=np.float32, copy=True)
    upload = getattr(dst, "upload", None)
    return upload(host) if upload is not None else host
