"""An engine whose model's memory is bounded (a store, or --ram-cache) gives what its passes free back to
the OS (fomoepy.runtime.heap): freed megabyte blocks do not stay resident.

Each case runs in a process of its own (the setting is process-wide) and frees blocks the way glibc
keeps them: after one large block has been freed, blocks of that size come from the heap, and a small
block allocated after each keeps the heap from shrinking when they are freed."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest
from conftest import ORACLE

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc keeps freed blocks; others differ")

CHURN = """
import numpy as np

def rss_anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon")) * 1024

first = np.ones(30 << 17)  # 30 MiB, freed: glibc then serves blocks up to that size from its heap
del first
before = rss_anon()
blocks, pins = [], []
for _ in range(16):
    blocks.append(np.ones(4 << 17))  # 4 MiB, touched
    pins.append(bytearray(256 << 10))  # above it in the heap (too large for the holes imports leave)
blocks.clear()
print(rss_anon() - before)
"""


def kept_after_churn(setup: str) -> int:
    """Bytes still resident of 64 MiB of blocks freed (and 4 MiB of small ones kept), after `setup` ran in a fresh process."""
    code = textwrap.dedent(setup) + CHURN
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    return int(out.strip().splitlines()[-1])


def test_without_the_setting_freed_blocks_stay_resident():
    # the pattern the other tests rely on: glibc keeps most of the 64 MiB
    assert kept_after_churn("") > 32 << 20


def test_the_setting_gives_freed_blocks_back():
    assert kept_after_churn("from fomoepy.runtime.heap import return_freed_memory\nassert return_freed_memory()\n") < 8 << 20


@pytest.mark.parametrize("bounded", [True, False])
def test_an_engine_holds_the_setting_only_where_its_memory_is_bounded(bounded):
    model = ORACLE / "qwen3moe_q4_k_m.gguf"
    setup = f"""
    from fomoepy.engine import Engine, EngineOptions
    e = Engine({str(model)!r}, EngineOptions(ram_cache={1 << 20 if bounded else None}))
    e.eval(e.new_state(), [1, 2, 3])
    """
    kept = kept_after_churn(setup)
    assert kept < 8 << 20 if bounded else kept > 32 << 20
