"""The memory the engine sizes its default tiers by: MemAvailable, bounded by the memory cgroup the
process runs in (v2 and v1, the process's own group or an ancestor), read from fake /proc and cgroup
trees; and the cpu backend's default tier leaves the mapped dense weights their pages."""

from __future__ import annotations

from pathlib import Path

from conftest import ORACLE

from fomoepy.runtime import available_memory
from fomoepy.runtime.available_memory import (
    FALLBACK,
    NO_LIMIT,
    available_memory_bytes,
    cgroup_headroom,
)

GIB = 1 << 30


def machine(tmp_path: Path, cgroup_lines: list[str], files: dict[str, int | str], mem_available_kib: int | None = 8 << 20):
    """A fake /proc (meminfo, self/cgroup) and cgroup root holding `files` (path under the root -> content)."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    if mem_available_kib is not None:
        (proc / "meminfo").write_text(f"MemTotal:       16000000 kB\nMemFree:         100 kB\nMemAvailable:   {mem_available_kib} kB\n")
    (proc / "self" / "cgroup").write_text("".join(line + "\n" for line in cgroup_lines))
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{content}\n")
    return proc, root


def test_without_a_limited_cgroup_it_is_memavailable(tmp_path):
    proc, root = machine(tmp_path, ["0::/user.slice/me"], {"user.slice/me/memory.max": "max", "user.slice/me/memory.current": 5 * GIB})
    assert cgroup_headroom(proc, root) is None
    assert available_memory_bytes(proc, root) == 8 * GIB


def test_a_v2_limit_bounds_it_by_the_tightest_group_up_the_tree(tmp_path):
    files = {
        "system.slice/fomoe.service/memory.max": 3 * GIB, "system.slice/fomoe.service/memory.current": 1 * GIB,
        "system.slice/memory.max": 2 * GIB, "system.slice/memory.current": int(1.5 * GIB),  # the parent's is tighter
        "system.slice/memory.stat": f"anon 1000\nfile 7000\ninactive_file {GIB // 4}\nactive_file 9\n",  # reclaimed first
    }  # fmt: skip
    proc, root = machine(tmp_path, ["0::/system.slice/fomoe.service"], files)
    assert cgroup_headroom(proc, root) == GIB // 2 + GIB // 4
    assert available_memory_bytes(proc, root) == GIB // 2 + GIB // 4
    files["system.slice/memory.max"] = "max"
    proc, root = machine(tmp_path / "b", ["0::/system.slice/fomoe.service"], files)
    assert available_memory_bytes(proc, root) == 2 * GIB


def test_a_v1_limit_counts_on_a_hybrid_host_and_no_limit_is_none(tmp_path):
    lines = ["9:name=systemd:/", "4:memory:/capped", "0::/"]  # v2 mounted without its memory files (hybrid)
    files = {"memory/capped/memory.limit_in_bytes": 320 << 20, "memory/capped/memory.usage_in_bytes": 300 << 20,
             "memory/capped/memory.stat": f"cache {280 << 20}\ninactive_file {8 << 20}\ntotal_inactive_file {250 << 20}\n",
             "memory/memory.limit_in_bytes": 9223372036854771712, "memory/memory.usage_in_bytes": 7 * GIB}  # fmt: skip
    proc, root = machine(tmp_path, lines, files)
    assert available_memory_bytes(proc, root) == (320 - 300 + 250) << 20  # the model's file read at load is reclaimable
    files["memory/capped/memory.limit_in_bytes"] = NO_LIMIT + 4096
    proc, root = machine(tmp_path / "b", lines, files)
    assert cgroup_headroom(proc, root) is None


def test_usage_over_the_limit_leaves_nothing_and_nothing_readable_leaves_the_fallback(tmp_path):
    proc, root = machine(tmp_path, ["0::/g"], {"g/memory.max": 100, "g/memory.current": 150})
    assert available_memory_bytes(proc, root) == 0
    proc, root = machine(tmp_path / "b", [], {}, mem_available_kib=None)
    assert available_memory_bytes(proc, root) == FALLBACK


def test_the_cpu_tier_takes_half_of_what_the_dense_weights_leave(monkeypatch, tmp_path):
    from fomoepy.engine import Engine, EngineOptions
    from fomoepy.experts.store_writer import prepare_store

    path = ORACLE / "qwen3moe_q4_k_m.gguf"
    store = tmp_path / "s"
    prepare_store(path, [store], progress=False)
    probe = Engine(path, EngineOptions(backend="cpu", threads=1, ram_cache=0))
    dense, unit = probe._dense_bytes(), probe.source.layers[0].expert_nbytes
    whole = unit * probe.spec.moe.n_expert * len(probe.source.layers)
    probe.close()
    assert 0 < dense < path.stat().st_size
    import fomoepy.engine as engine_module

    for available, want in [(dense + 2 * 3 * unit, 3 * unit), (dense // 2, 0), (dense + 4 * whole, whole)]:
        monkeypatch.setattr(engine_module, "available_memory_bytes", lambda available=available: available)
        engine = Engine(path, EngineOptions(backend="cpu", threads=1, store=(str(store),)))
        assert engine.experts.streamer.cache.device.capacity == want
        engine.close()


def test_the_real_machine_gives_a_positive_figure():
    assert available_memory.available_memory_bytes() > 0
