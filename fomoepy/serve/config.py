"""The daemon's limits: one frozen dataclass, validated once (kept light: the CLI reads its defaults)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fomoepy.errors import FomoeError
from fomoepy.serve.protocol import DEFAULT_MAX_FRAME


@dataclass(frozen=True)
class DaemonConfig:
    max_frame: int = DEFAULT_MAX_FRAME  # bytes of one request frame
    max_sessions: int = 8  # chat sessions whose state is kept (LRU)
    max_pending: int = 16  # unfinished requests per connection
    max_queue: int = 256  # unfinished generation requests, all clients together (and as many tokenize/stats)
    write_buffer: int = 64 << 10  # bytes a client may leave unread before its generation pauses
    pause_timeout: float = 60.0  # seconds a paused generation waits for its client before it is cancelled
    drain_timeout: float = 5.0  # seconds shutdown waits for clients to take their last messages
    max_batch: int = 8  # generations decoded together in one engine step (bench/batch.py)
    kv_budget: int | None = None  # bytes of KV cache the batch may reserve; None: worker.default_kv_budget

    def __post_init__(self) -> None:
        for name in ("max_frame", "max_sessions", "max_pending", "max_queue", "write_buffer", "max_batch"):
            if getattr(self, name) < 1:
                raise FomoeError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_budget is not None and self.kv_budget < 1:
            raise FomoeError(f"kv_budget must be >= 1 byte, got {self.kv_budget}")
        if not (math.isfinite(self.pause_timeout) and self.pause_timeout > 0):  # (nan compares false both ways)
            raise FomoeError(f"pause_timeout must be a finite number of seconds > 0, got {self.pause_timeout}")
