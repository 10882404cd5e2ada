"""Engine: one opened model (file, spec, tokenizer, backend, experts) and what can be asked of it.

`logits` scores a token sequence at every position; `generate` streams sampled tokens. Both run
prefill (every prompt token in one batched pass) and then one-token decode steps on an
`InferenceState` that a caller may keep to continue a conversation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from fomoepy.errors import FomoeError
from fomoepy.experts.source import GGUFExpertSource
from fomoepy.model.gguf_file import GGUFFile
from fomoepy.model.spec import ModelSpec
from fomoepy.model.state import InferenceState
from fomoepy.model.tokenizer import Tokenizer
from fomoepy.model.transformer import Transformer
from fomoepy.runtime.cpu import CpuBackend
from fomoepy.runtime.cpu_experts import CpuExperts
from fomoepy.sampling import Sampler, SamplingParams

BACKENDS = {"cpu": CpuBackend}


@dataclass(frozen=True)
class EngineOptions:
    backend: str = "cpu"
    n_ctx: int | None = None  # None: the model's training context
    ready_cache_bytes: int | None = None  # CPU compute-ready expert tier; None: sized from free memory


class Engine:
    def __init__(self, model_path: str | os.PathLike[str], options: EngineOptions = EngineOptions()):
        if options.backend not in BACKENDS:
            raise FomoeError(f"backend {options.backend!r} is not available (available: {', '.join(BACKENDS)})")
        self.options = options
        self.file = GGUFFile(model_path)
        self.spec = ModelSpec.from_gguf(self.file)
        self.tokenizer = Tokenizer.from_metadata(self.file.metadata, str(self.file.path))
        self.n_ctx = options.n_ctx or self.spec.context_length
        if self.n_ctx < 1:
            raise FomoeError(f"context size must be >= 1, got {self.n_ctx}")
        self.ops = BACKENDS[options.backend]()
        source = GGUFExpertSource(self.file, self.spec)
        budget = options.ready_cache_bytes
        if budget is None:
            budget = default_ready_budget(self.spec)
        self.experts = CpuExperts(source, budget)
        self.model = Transformer(self.file, self.spec, self.ops, self.experts)

    def new_state(self) -> InferenceState:
        return InferenceState.new(self.spec, self.n_ctx)

    def eval(self, state: InferenceState, tokens: Sequence[int] | np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Append tokens to the sequence; logits of every new position, or of the last one only."""
        return self.model.forward(np.asarray(tokens, dtype=np.int64), state, all_logits=all_logits)

    def logits(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """float32 [T, n_vocab]: row i scores the token after tokens[0..i], from an empty state."""
        return self.eval(self.new_state(), tokens, all_logits=True)

    def generate(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        params: SamplingParams = SamplingParams.greedy(),
        state: InferenceState | None = None,
        stop_at_eog: bool = True,
    ) -> Iterator[int]:
        """Yield up to max_tokens sampled ids after `prompt`; stops after an end-of-generation token.

        The prompt continues `state` when one is given (its past stays), so a chat can keep its cache.
        """
        if max_tokens < 0:
            raise FomoeError(f"max_tokens must be >= 0, got {max_tokens}")
        if not len(prompt):
            raise FomoeError("the prompt is empty: give at least one token")
        state = state if state is not None else self.new_state()
        sampler = Sampler(params)
        history = list(state.tokens) + list(prompt)
        logits = self.eval(state, prompt)[-1]
        eog = set(self.tokenizer.eog_ids)
        for _ in range(max_tokens):
            token = sampler(logits, history)
            yield token
            history.append(token)
            if stop_at_eog and token in eog:
                return
            if state.n_past >= state.n_ctx:
                return
            logits = self.eval(state, [token])[-1]


def default_ready_budget(spec: ModelSpec) -> int:
    """All experts compute-ready if they fit in half of the available memory, else as many as do."""
    m = spec.moe
    per_expert = 3 * m.expert_ff * spec.n_embd * 4
    wanted = per_expert * m.n_expert * spec.n_layer
    return min(wanted, available_memory_bytes() // 2)


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30
