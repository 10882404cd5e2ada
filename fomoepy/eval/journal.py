"""The `--resume` file: what a perplexity run has finished, one fsynced JSON line per chunk.

    line 1   {"fomoe_ppl_resume": 1, "identity": {...}}     what the results depend on: model and text
                                                             fingerprints, tokens, ctx, batch, mode, engine options
    line 2+  {"chunk": i, ...}                               chunk i's results, i = 0, 1, 2, ... in order

Floats are written with Python's repr, which reads back to the same bits, so a resumed run ends on exactly
the number an uninterrupted one prints. A run killed while writing leaves at most one partial last line;
opening the file cuts it off.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from fomoepy.errors import FomoeError

FORMAT_KEY = "fomoe_ppl_resume"
VERSION = 1


class Journal:
    """Open with `Journal.open(path, identity)`; `records` are the chunks already done."""

    def __init__(self, path: Path, f: TextIO, records: list[dict[str, Any]]):
        self.path = path
        self.f = f
        self.records = records

    @classmethod
    def open(cls, path: str | os.PathLike[str], identity: dict[str, Any]) -> Journal:
        path = Path(path)
        identity = json.loads(json.dumps(identity))  # as it will read back (tuples become lists)
        try:
            data = path.read_bytes() if path.exists() else b""
        except OSError as e:
            raise FomoeError(f"{path}: cannot read ({e.strerror})") from None
        if not data.strip() or (b"\n" not in data and data.startswith(b'{"' + FORMAT_KEY.encode())):
            # new, or killed while its header was being written
            f = open(path, "w", encoding="utf-8")  # noqa: SIM115 (open across chunks; close())
            f.write(json.dumps({FORMAT_KEY: VERSION, "identity": identity}, sort_keys=True) + "\n")
            _fsync(f)
            return cls(path, f, [])
        lines = data.split(b"\n")
        # lines[-1] is what follows the last newline: b"" for a complete file, else a partial record
        header = _parse(lines[0]) if len(lines) > 1 else None
        if not isinstance(header, dict) or header.get(FORMAT_KEY) != VERSION:
            raise FomoeError(f"{path}: not a fomoe ppl resume file")
        _check_identity(path, header.get("identity", {}), identity)
        records: list[dict[str, Any]] = []
        good_end = len(lines[0]) + 1
        for n, line in enumerate(lines[1:-1], start=2):
            rec = _parse(line)
            if not isinstance(rec, dict) or rec.get("chunk") != len(records):
                if n == len(lines) - 1:  # a damaged last line: the write the kill interrupted
                    break
                raise FomoeError(f"{path}: line {n}: expected the record of chunk {len(records)}")
            records.append(rec)
            good_end += len(line) + 1
        if good_end < len(data):
            print(f"fomoe ppl: {path}: dropped an incomplete last record", file=sys.stderr)
        f = open(path, "r+", encoding="utf-8")  # noqa: SIM115 (open across chunks; close())
        f.truncate(good_end)
        f.seek(good_end)
        return cls(path, f, records)

    def append(self, record: dict[str, Any]) -> None:
        if record.get("chunk") != len(self.records):
            raise ValueError(f"chunk: expected {len(self.records)}, got {record.get('chunk')}")
        self.f.write(json.dumps(record) + "\n")
        _fsync(self.f)
        self.records.append(record)

    def close(self) -> None:
        self.f.close()


def _parse(line: bytes) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        return None


def _fsync(f: TextIO) -> None:
    f.flush()
    os.fsync(f.fileno())


def _check_identity(path: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Reports the first difference in the current identity's key order (most telling first)."""
    for key in [*current, *(k for k in saved if k not in current)]:
        if saved.get(key) != current.get(key):
            raise FomoeError(
                f"{path} belongs to another run: {key} expected {_short(saved.get(key))}, got "
                f"{_short(current.get(key))} (give another --resume file, or delete this one)"
            )


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 120 else text[:117] + "..."
