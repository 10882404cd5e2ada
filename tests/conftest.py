"""Shared fixtures: where the oracle files are, and engines opened once per session."""

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


_engines: dict = {}


def open_oracle_engine(name: str):
    """One engine per oracle model for the whole test session (opening costs more than most tests)."""
    from fomoepy.engine import Engine

    if name not in _engines:
        _engines[name] = Engine(ORACLE / f"{name}.gguf")
    return _engines[name]
