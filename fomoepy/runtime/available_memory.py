"""How much more memory this process may take: the kernel's MemAvailable, bounded by the memory cgroup
the process runs in, which MemAvailable knows nothing of.

A systemd unit's MemoryMax=, a container's --memory or a `systemd-run -p MemoryMax=` caps the cgroup:
past its limit the kernel reclaims the cgroup's own pages, the mapped model's first, while the host's
MemAvailable may still show gigabytes free. A tier sized from MemAvailable alone then pushes out the
weights every token reads (by hand, under `bench/over_memory.py`'s 320 MiB cap, a model 4x the cap:
1.8 tok/s with a 128 MiB tier, 4.8 with 64 MiB).

    available_memory_bytes()   min(MemAvailable, the tightest limit − working set of this process's
                               memory cgroup and its ancestors, v2 or v1)
"""

from __future__ import annotations

from pathlib import Path

FALLBACK = 4 << 30  # neither /proc/meminfo nor a limited cgroup could be read
NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as the page counter's maximum (~2**63, page-aligned)


def available_memory_bytes(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes this process may still take: MemAvailable, or less where its memory cgroup is limited."""
    known = [x for x in (meminfo_available(proc), cgroup_headroom(proc, cgroup_root)) if x is not None]
    return min(known) if known else FALLBACK


def meminfo_available(proc: Path = Path("/proc")) -> int | None:
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_headroom(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """limit − working set (usage less inactive page cache) of the tightest limited memory cgroup this
    process is in (its own or an ancestor: each one's limit holds for everything below it); None where
    none is limited or none can be read. cgroup v2 (`0::/path`: memory.max, memory.current, memory.stat's
    inactive_file) and v1 (`N:memory:/path`: memory.limit_in_bytes, memory.usage_in_bytes, memory.stat's
    total_inactive_file), both where a hybrid host mounts both."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    headroom = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            base, limit_file, usage_file, inactive = cgroup_root, "memory.max", "memory.current", "inactive_file"
        elif "memory" in controllers.split(","):
            base, limit_file, usage_file = cgroup_root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
            inactive = "total_inactive_file"
        else:
            continue
        group = base / path.lstrip("/")
        for directory in (group, *group.parents):
            limit, usage = _read_int(directory / limit_file), _read_int(directory / usage_file)
            if limit is not None and usage is not None and limit < NO_LIMIT:
                # the page cache no one has touched twice is the first the kernel takes back: usage less it
                # is the group's working set (as cAdvisor counts it; loading a model reads most of its file)
                headroom.append(max(0, limit - usage + _stat(directory / "memory.stat", inactive)))
            if directory == base:
                break
    return min(headroom) if headroom else None


def _stat(path: Path, key: str) -> int:
    """One counter of a cgroup's memory.stat; 0 where it is not there."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _read_int(path: Path) -> int | None:
    """A cgroup file's number; None for "max" (v2's no limit) or a file that is not there."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
