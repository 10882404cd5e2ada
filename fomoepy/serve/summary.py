"""A daemon's statistics as a few lines a person reads: speed, queue, and the engine's own lines (per-tier
hit rates, CAR substitution rate, prefetch accuracy: the lines `fomoe generate` prints to stderr)."""

from __future__ import annotations

from typing import Any


def summary_lines(stats: dict[str, Any]) -> list[str]:
    lines = [
        f"speed: prefill {stats.get('prefill_tok_per_s', 0):.1f} tok/s, decode {stats.get('decode_tok_per_s', 0):.1f} tok/s; "
        f"{stats.get('requests', 0)} requests, {stats.get('prompt_tokens', 0)} prompt + {stats.get('completion_tokens', 0)} completion tokens",
        f"queue: {stats.get('queue_length', 0)} waiting, {stats.get('running', 0)} running, {stats.get('paused', 0)} paused; "
        f"{stats.get('connections', 0)} connections, {stats.get('sessions', 0)} sessions kept; up {stats.get('uptime_s', 0):.0f} s",
    ]  # fmt: skip
    engine = stats.get("engine_lines") or []
    return lines + [str(line) for line in engine]
