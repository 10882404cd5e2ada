"""Check a whole expert store: every record of every copy against its checksum and against the GGUF's bytes."""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from fomoepy.errors import StoreError
from fomoepy.experts.reads import Read
from fomoepy.experts.store_reader import ExpertBytes, ExpertStore
from fomoepy.model.gguf_file import GGUFFile

MAX_LISTED = 3  # errors quoted in the one-line report; the count says how many there were


@dataclass(frozen=True)
class VerifyReport:
    dirs: tuple[Path, ...]
    mirror: bool
    n_layers: int
    n_records: int  # per copy
    n_copies: int
    nbytes: int  # read, all copies
    seconds: float

    def line(self) -> str:
        layout = f"mirrored x{self.n_copies}" if self.mirror else f"striped over {len(self.dirs)}"
        return (
            f"store OK ({layout}: {', '.join(map(str, self.dirs))}): {self.n_records} experts of {self.n_layers} layers"
            f"{f' x {self.n_copies} copies' if self.n_copies > 1 else ''}, {self.nbytes / 1e9:.3f} GB read in "
            f"{self.seconds:.1f} s ({self.nbytes / 1e9 / max(self.seconds, 1e-9):.2f} GB/s); every record matches "
            f"its checksum and the GGUF"
        )


def verify_store(gguf_path: str | os.PathLike[str], dirs: Sequence[str | os.PathLike[str]], progress: bool = True,
                 threads: int | None = None) -> VerifyReport:
    """Read every record of every copy through the reader pool; raise one StoreError listing what is wrong."""
    gf = GGUFFile(gguf_path)
    data = gf.raw_file()
    t0 = time.perf_counter()
    with ExpertStore.open(dirs, gf, threads=threads, verify=True) as store:
        m = store.manifest
        keys = [(ll.layer, e) for ll in m.layers for e in range(ll.n_expert)]
        total = store.n_copies * sum(m.layers[layer].slot_nbytes for layer, _ in keys)
        errors: list[str] = []

        def check(layer: int, expert: int, copy: int, future: Read) -> None:
            try:
                got = future.result()
            except StoreError as e:
                errors.append(str(e))
                return
            for part, view in zip(store.layers[layer].parts, got):
                start, size = part.range_of(expert)
                if not np.array_equal(view, data[start : start + size]):
                    errors.append(f"layer {layer} expert {expert}: {store.record_path(layer, expert, copy)} passes its "
                                  f"checksum but differs from {gf.path} ({part.tensor})")
                    return

        with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=not progress, file=sys.stderr) as bar:
            window: deque = deque()
            for copy in range(store.n_copies):
                for layer, expert in keys:
                    window.append((layer, expert, copy, store.submit(layer, expert, copy=copy)))
                    if len(window) >= 2 * store.threads:  # bounded: memory stays at a few records per thread
                        check(*window.popleft())
                    bar.update(m.layers[layer].slot_nbytes)
            while window:
                check(*window.popleft())
        report = VerifyReport(tuple(store.dirs.values()), m.mirror, len(m.layers), len(keys), store.n_copies, total,
                              time.perf_counter() - t0)
    if errors:
        raise StoreError(
            f"{len(errors)} of {len(keys) * report.n_copies} records are bad: {'; '.join(errors[:MAX_LISTED])}"
            + (" ..." if len(errors) > MAX_LISTED else "")
        )
    return report
