"""Shared fixtures: where the oracle files are, engines opened once per session, and the plan tests'
workload (Qwen3.5-397B's shape) and rig (FOMOE's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ORACLE = Path(__file__).parent / "fixtures" / "oracle"


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


_engines: dict = {}


def open_oracle_engine(name: str):
    """One engine per oracle model for the whole test session (opening costs more than most tests)."""
    from fomoepy.engine import Engine

    if name not in _engines:
        _engines[name] = Engine(ORACLE / f"{name}.gguf")
    return _engines[name]
