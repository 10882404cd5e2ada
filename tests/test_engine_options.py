"""EngineOptions is the engine's one configuration: every bad value is refused when it is made, with
one error naming the flag a user typed, and the command-line flags build it."""

from __future__ import annotations

import argparse
import re

import pytest

from fomoepy.errors import FomoeError
from fomoepy.experts.car import CarConfig
from fomoepy.options import EngineOptions, add_engine_options


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("backend", "tpu", "--backend 'tpu' is not available"),
        ("n_ctx", 0, "--ctx-size must be >= 1, got 0"),
        ("threads", 0, "--threads must be in [1, 512], got 0"),
        ("threads", 100_000, "--threads must be in [1, 512], got 100000"),
        ("devices", 0, "--devices must be >= 1, got 0"),
        ("placement", "zigzag", "--placement must be pingpong, blocks or one device index per layer"),
        ("vram_cache", -1, "--vram-cache must be >= 0"),
        ("ram_cache", -5, "--ram-cache must be >= 0"),
        ("cache_policy", "fifo", "--cache-policy 'fifo' is unknown"),
        ("backfill", "later", "--backfill must be one of off, thread, sync"),
        ("backfill_per_token", -1, "--backfill-per-token must be >= 0"),
    ],
)  # fmt: skip
def test_each_bad_value_is_one_error_naming_its_flag(field, value, message):
    with pytest.raises(FomoeError, match=re.escape(message)):
        EngineOptions(**{field: value})


def test_the_flags_build_the_options():
    p = argparse.ArgumentParser()
    add_engine_options(p)
    args = p.parse_args(["--backend", "reference", "-c", "256", "--devices", "2", "--placement", "0,1,1", "--vram-cache", "4M",
                         "--ram-cache", "1G", "--car-threshold", "0.3", "--car-warmup", "5", "--no-prefetch"])  # fmt: skip
    o = EngineOptions.from_args(args)
    assert (o.backend, o.n_ctx, o.devices, o.placement) == ("reference", 256, 2, "0,1,1")
    assert (o.vram_cache, o.ram_cache, o.prefetch) == (4 << 20, 1 << 30, False)
    assert o.car == CarConfig(threshold=0.3, warmup_tokens=5)
    settings = o.settings()
    assert settings["car_threshold"] == 0.3 and settings["vram_cache"] == 4 << 20 and "n_ctx" not in settings
    assert o.backfills and not EngineOptions(car=o.car, backfill="off").backfills and not EngineOptions().backfills


def test_a_gpu_engine_opens_without_the_cpu_backends_library(tmp_path):
    """A GPU install need not have ggml: choosing the executor and sizing the device tier import no other
    backend's library (on the first real GPU run the cuda engine failed on `import ggml`)."""
    import subprocess
    import sys

    from conftest import ORACLE

    script = (
        "import sys; sys.modules['ggml'] = None\n"  # any `import ggml` now raises ImportError
        "from fomoepy.engine import Engine\nfrom fomoepy.options import EngineOptions\n"
        f"e = Engine({str(ORACLE / 'qwen3moe_f32.gguf')!r}, EngineOptions(backend='sim', vram_cache=0, ram_cache=0))\n"
        "print(type(e.experts.device).__name__)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "GpuExperts"
