"""Hardware figures from a small TOML file: the only inputs of a projection the user states.

    name = "one RTX 4090, 64 GB, two NVMe"
    [device]            # each GPU; count = 0 for a CPU-only box
    count = 1
    memory = "24G"
    bandwidth = "1008 GB/s"      # device memory bandwidth
    link = "25 GB/s"             # host -> device copies, per device
    sync = "30 us"               # one host round trip: launch, read back the router's choice
    flops = "82 TFLOPS"          # arithmetic rate of the kernels' math (prefill); optional
    [host]
    memory = "64G"
    bandwidth = "60 GB/s"
    matvec = "20 GB/s"           # CPU backend: weight bytes per second through its expert matvec
    make_ready = "2 GB/s"        # CPU backend: store bytes per second made compute-ready (its "copy up")
    plan = "1445 us"             # host time per MoE layer step (routing, cache plan, binding calls): measured
                                 # by bench/host_time.py or `fomoe plan MODEL --measure DIR`
    serial = "700 us"            # of plan, the part in series with the step's reads (before they are issued,
                                 # after the last lands); the GPU engine schedule runs the rest beside them;
                                 # optional, default all of plan
    before_reads = "400 us"      # of serial, the part before the step's reads are issued (the next layer's
                                 # guesses are read after them); optional, default all of serial
    before_launch = "500 us"     # of plan, the part before the step's first expert launch (the GPU computes the
                                 # experts it holds, and copies up those at hand, from then); optional, default serial
    before_copies = "600 us"     # of plan, the part before the step's reads are copied up (after its cache plan);
                                 # optional, default before_launch
    flops = "1 TFLOPS"           # CPU backend: its quantised products at prompt batch sizes; optional
    fill = "2 GB/s"              # cpu backend: store bytes per second set into its tier's slots (in their form), per
                                 # expert read from the drive; optional, default none
    fill_share = 0.33            # cpu backend: of the experts a step reads, the share set into tier slots (those the
                                 # tier keeps; it computes the others where their reads landed); optional, default 1
    [drives]
    count = 2
    bandwidth = "7 GB/s"         # each
    latency = "80 us"

Rates are strings with their unit, so "GB/s" (1e9) and "GiB/s" (2^30) cannot be confused. A flops
figure left out is 0: prefill is then projected from bytes alone, an upper bound, and says so.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from fomoepy.errors import FomoeError
from fomoepy.experts.sizes import parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10 has no tomllib
    import tomli as tomllib

RIGS_DIR = Path(__file__).parent / "rigs"
_RATE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(i?)B/s\s*", re.IGNORECASE)
_FLOPS = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGTP]?)FLOP(?:S|/s)\s*", re.IGNORECASE)
_TIME = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ns|us|µs|ms|s)\s*")
_PREFIX = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_rate(text: str, where: str) -> float:
    """'320 GB/s' -> 3.2e11 bytes/s; '14.5 GiB/s' -> 14.5 * 2^30."""
    m = _RATE.fullmatch(str(text))
    if not m:
        raise FomoeError(f"{where}: expected a rate such as '14.5 GiB/s' or '320 GB/s', got {text!r}")
    base = 1024 if m.group(3) else 1000
    return float(m.group(1)) * base ** _PREFIX[m.group(2).lower()]


def parse_flops(text: str, where: str) -> float:
    """'82.6 TFLOPS' or '900 GFLOP/s' -> operations per second."""
    m = _FLOPS.fullmatch(str(text))
    if not m:
        raise FomoeError(f"{where}: expected an arithmetic rate such as '25 TFLOPS' or '900 GFLOP/s', got {text!r}")
    return float(m.group(1)) * 1000 ** _PREFIX[m.group(2).lower()]


def parse_time(text: str, where: str) -> float:
    m = _TIME.fullmatch(str(text))
    if not m:
        raise FomoeError(f"{where}: expected a time such as '80 us' or '0.5 ms', got {text!r}")
    return float(m.group(1)) * _SECONDS[m.group(2)]


@dataclass(frozen=True)
class Device:
    count: int
    memory: int  # bytes, each
    bandwidth: float  # bytes/s
    link: float  # host -> device bytes/s, each
    sync: float  # seconds per host round trip
    flops: float = 0.0  # operations/s of the kernels' arithmetic, each device; 0: not stated


@dataclass(frozen=True)
class Host:
    memory: int
    bandwidth: float
    matvec: float  # weight bytes/s through the CPU backend's expert matvec
    make_ready: float  # store bytes/s made compute-ready by the CPU backend
    plan: float  # seconds of host bookkeeping per MoE layer step
    flops: float = 0.0  # operations/s of the CPU backend's products at prompt batch sizes; 0: not stated
    # of `plan`, the seconds in series with the step's reads: before they are issued (routing, the cache
    # plan) and after the last has landed (its copy, the last launches); the GPU engine makes the rest of
    # its copies and launches while they are read. None: all of it in series
    serial: float | None = None
    # of `serial`, the seconds before the step's reads are issued: the next layer's guesses go to the drives
    # after them (fomoepy.experts.read_ahead), so they shorten the guesses' window. None: all of `serial`
    before_reads: float | None = None
    # of `plan`, the seconds from the routing to the step's first expert launch: the device computes the
    # experts it holds, and copies up those at hand, only from then. None: `serial` (as if they started
    # once the reads were issued and the host's part after the last landing was made)
    before_launch: float | None = None
    # of `plan`, the seconds from the routing to the step's device part after its cache plan: the copies up
    # of its reads start then (the plan says which slots they fill). None: `before_launch`
    before_copies: float | None = None
    # store bytes/s the cpu (ggml) backend sets into its tier's slots (in their form: plain or repacked), per expert
    # read from the drive (its "copy up"; 0: none, it computes store bytes in place)
    fill: float = 0.0
    # of the experts a step reads from the drives, the share the cpu backend sets into tier slots: those the
    # tier admits (a decode step computes the others where their reads landed; `fomoe plan --measure` takes
    # it from the engine's own decode). 1: every one
    fill_share: float = 1.0


@dataclass(frozen=True)
class Drives:
    count: int
    bandwidth: float  # each
    latency: float


@dataclass(frozen=True)
class Hardware:
    name: str
    device: Device
    host: Host
    drives: Drives

    def with_changes(self, **sections) -> Hardware:
        """A copy with some fields of some sections replaced: with_changes(drives={"count": 2})."""
        out = self
        for section, fields in sections.items():
            out = replace(out, **{section: replace(getattr(out, section), **fields)})
        return out


_FIELDS = {
    "device": {"count": int, "memory": "size", "bandwidth": "rate", "link": "rate", "sync": "time", "flops": "flops"},
    "host": {"memory": "size", "bandwidth": "rate", "matvec": "rate", "make_ready": "rate", "plan": "time", "flops": "flops",
             "serial": "time", "before_reads": "time", "before_launch": "time", "before_copies": "time", "fill": "rate",
             "fill_share": "share"},
    "drives": {"count": int, "bandwidth": "rate", "latency": "time"},
}
_DEFAULTS = {
    "device": {"count": 0, "memory": 0, "bandwidth": 0.0, "link": 0.0, "sync": 0.0, "flops": 0.0},
    # a file without `plan` gets the GPU path's measured host time per MoE layer step (bench/host_time.py,
    # the 397B shape, the default policy, on a 2-core AVX2 machine: bench/RESULTS.md)
    "host": {"make_ready": 0.0, "plan": 1445e-6, "flops": 0.0, "serial": None, "before_reads": None, "before_launch": None, "before_copies": None, "fill": 0.0,
             "fill_share": 1.0},
    "drives": {},
}


def _value(kind, raw, where: str):
    if kind is int:
        if not isinstance(raw, int) or raw < 0:
            raise FomoeError(f"{where}: expected a whole number >= 0, got {raw!r}")
        return raw
    if kind == "size":
        try:
            return parse_size(str(raw))
        except FomoeError as exc:
            raise FomoeError(f"{where}: {exc}") from None
    if kind == "flops":
        return parse_flops(raw, where)
    if kind == "share":
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not 0.0 <= raw <= 1.0:
            raise FomoeError(f"{where}: expected a share from 0 to 1, got {raw!r}")
        return float(raw)
    return parse_rate(raw, where) if kind == "rate" else parse_time(raw, where)


def hardware_from_dict(data: dict, source: str) -> Hardware:
    extra = sorted(set(data) - set(_FIELDS) - {"name"})
    if extra:
        raise FomoeError(f"{source}: unknown key {extra[0]}; expected name, device, host, drives")
    sections = {}
    for section, fields in _FIELDS.items():
        given = data.get(section, {})
        if not isinstance(given, dict):
            raise FomoeError(f"{source}: [{section}] must be a table")
        unknown = sorted(set(given) - set(fields))
        if unknown:
            raise FomoeError(f"{source}: unknown key [{section}] {unknown[0]}; expected one of {', '.join(fields)}")
        values = dict(_DEFAULTS[section])
        for key, kind in fields.items():
            if key in given:
                values[key] = _value(kind, given[key], f"{source}: [{section}] {key}")
            elif key not in values:
                raise FomoeError(f"{source}: [{section}] needs {key}")
        sections[section] = values
    host = sections["host"]
    if host["serial"] is not None and host["serial"] > host["plan"]:
        raise FomoeError(f"{source}: [host] serial is a part of plan, so at most {host['plan'] * 1e6:.0f} us; "
                         f"got {host['serial'] * 1e6:.0f} us")  # fmt: skip
    if host["before_reads"] is not None and host["before_reads"] > (host["plan"] if host["serial"] is None else host["serial"]):
        raise FomoeError(f"{source}: [host] before_reads is a part of serial, so at most "
                         f"{(host['plan'] if host['serial'] is None else host['serial']) * 1e6:.0f} us; got {host['before_reads'] * 1e6:.0f} us")  # fmt: skip
    for key in ("before_launch", "before_copies"):
        if host[key] is not None and host[key] > host["plan"]:
            raise FomoeError(f"{source}: [host] {key} is a part of plan, so at most {host['plan'] * 1e6:.0f} us; "
                             f"got {host[key] * 1e6:.0f} us")  # fmt: skip
    return Hardware(str(data.get("name", source)), Device(**sections["device"]), Host(**host), Drives(**sections["drives"]))


def load_hardware(path: str) -> Hardware:
    """A TOML file, or the name of a shipped rig (see `shipped_rigs()`)."""
    file = Path(path)
    if not file.exists() and (RIGS_DIR / f"{path}.toml").exists():
        file = RIGS_DIR / f"{path}.toml"
    try:
        data = tomllib.loads(file.read_text(encoding="utf-8"))  # (TOML is UTF-8 whatever the locale)
    except OSError as exc:
        raise FomoeError(f"cannot read hardware file {path}: {exc.strerror}; shipped rigs: {', '.join(shipped_rigs())}") from None
    except UnicodeDecodeError as exc:
        raise FomoeError(f"{path}: not a TOML hardware file (not UTF-8 text: bad byte at offset {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise FomoeError(f"{path}: not valid TOML: {exc}") from None
    return hardware_from_dict(data, str(path))


def shipped_rigs() -> list[str]:
    return sorted(p.stem for p in RIGS_DIR.glob("*.toml"))
