"""Shared fixtures: where the oracle files are, engines opened once per session, and the plan tests'
workload (Qwen3.5-397B's shape) and rig (FOMOE's)."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

import pytest

ORACLE = Path(__file__).parent / "fixtures" / "oracle"


@pytest.fixture
def deferred():
    """The simulated device's streams deferred for the test: queued work runs only when something waits
    for it, so a missing wait or a buffer reused too early changes the bytes every time."""
    from fomoepy.runtime.sim.shim import configure

    before = configure(deferred=True)
    yield
    configure(**before)


@pytest.fixture(scope="session")
def standin(tmp_path_factory) -> Path:
    """The stand-in driver libraries (fomoepy/runtime/sim: libcuda and libamdhip64 over the simulated
    device), built once for the tests that load them under the real bindings."""
    from fomoepy.runtime.sim.build import standin_drivers

    if os.environ.get("FOMOEPY_TEST_REAL_DRIVER"):  # the tests go to the real driver (test_standin_bindings.standin_environ)
        return None
    return standin_drivers(tmp_path_factory.mktemp("standin"))


@contextmanager
def counting_calls(obj, name: str, which=None):
    """Count the calls of `obj`'s method `name` while the block runs (a test's check that a wait or a copy
    is made, or is not): yields a one-item list, the count so far. `which(*args)`, when given, picks the
    calls counted. The counter shadows the class's method on the object and goes with the block."""
    real, count = getattr(obj, name), [0]

    def counted(*args, **kwargs):
        if which is None or which(*args, **kwargs):
            count[0] += 1
        return real(*args, **kwargs)

    setattr(obj, name, counted)
    try:
        yield count
    finally:
        delattr(obj, name)


@pytest.fixture(scope="session")
def oracle_dir() -> Path:
    return ORACLE


@pytest.fixture(scope="session")
def manifest() -> dict:
    return json.loads((ORACLE / "MANIFEST.json").read_text())


@pytest.fixture(scope="session")
def q397():
    from fomoepy.plan.shapes import SHAPES, model_bytes
    from fomoepy.plan.timemodel import Workload

    return Workload(model_bytes(SHAPES["qwen3.5-397b-a17b"]))


@pytest.fixture(scope="session")
def fomoe_rig():
    from fomoepy.plan.hardware import load_hardware

    return load_hardware("fomoe-rig")


STREAMED_MODELS = ["qwen3moe_q4_k_m", "qwen35moe_q4_k"]


@pytest.fixture(scope="session", params=STREAMED_MODELS)
def streamed_model(request, tmp_path_factory):
    """An oracle model with its expert store striped over two directories, for the streaming tests:
    (the model file, the store's directories, the oracle's tokens, the all-resident engine's logits)."""
    import numpy as np

    from fomoepy.engine import Engine, EngineOptions
    from fomoepy.experts.store_writer import prepare_store

    name = request.param
    path = ORACLE / f"{name}.gguf"
    store = tmp_path_factory.mktemp(f"store-{name}")
    prepare_store(path, [store / "a", store / "b"], progress=False)
    tokens = np.load(ORACLE / f"{name}.tokens.npy")
    resident = Engine(path, EngineOptions()).logits(tokens)  # every expert compute-ready
    return path, [str(store / "a"), str(store / "b")], tokens, resident


_engines: dict = {}


def open_oracle_engine(name: str):
    """One engine per oracle model for the whole test session (opening costs more than most tests)."""
    from fomoepy.engine import Engine

    if name not in _engines:
        _engines[name] = Engine(ORACLE / f"{name}.gguf")
    return _engines[name]
