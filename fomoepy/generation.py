"""One request's decoding, apart from the forward pass: its state, sampler, the prompt tokens still to
evaluate, and the sampled token its next step evaluates.

The engine advances a Generation in two kinds of steps (fomoepy.engine.Engine): `prefill` evaluates
at most `prefill_chunk` of its prompt tokens (the last chunk samples the first token); `decode`
evaluates the pending token of each of several generations in one batched step and samples the next.
`Engine.generate` is the same steps for one request alone, so a request served beside others by the
daemon takes exactly the steps it takes alone.

    PREFILL --(last prompt chunk)--> DECODE --(eog, max_tokens, context full)--> DONE
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np

from fomoepy.errors import FomoeError
from fomoepy.model.state import InferenceState
from fomoepy.sampling import Sampler, SamplingParams


class Phase(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


class Generation:
    def __init__(self, state: InferenceState, prompt: Sequence[int], max_tokens: int, params: SamplingParams,
                 eog: frozenset[int], stop_at_eog: bool = True):  # fmt: skip
        if max_tokens < 0:
            raise FomoeError(f"max_tokens must be >= 0, got {max_tokens}")
        if not len(prompt):
            raise FomoeError("the prompt is empty: give at least one token")
        state.check_room(len(prompt))  # refused before any chunk changes the state
        self.state: InferenceState | None = state  # None between give_up_state and restart
        self.sampler = Sampler(params)
        self.max_tokens = max_tokens
        self.eog = eog
        self.stop_at_eog = stop_at_eog
        self.history = list(state.tokens) + list(prompt)  # what the repetition penalty looks back on
        self.pending = [int(t) for t in prompt]  # prompt tokens not evaluated yet
        self.next_token: int | None = None  # sampled, to be evaluated by the next decode step
        self.produced = 0
        self.last_chunk = 0  # prompt tokens the last prefill step evaluated
        self.phase = Phase.PREFILL

    def take_chunk(self, n: int) -> list[int]:
        """The next at most n prompt tokens to evaluate."""
        if self.phase is not Phase.PREFILL:
            raise FomoeError(f"expected a generation in prefill, got one in {self.phase.value}")
        chunk, self.pending = self.pending[:n], self.pending[n:]
        self.last_chunk = len(chunk)
        return chunk

    def prompt_done(self, logits: np.ndarray) -> int | None:
        """The last prompt chunk was evaluated: the first token (None when max_tokens is 0)."""
        if self.max_tokens == 0:
            self.phase = Phase.DONE
            return None
        return self.sampled(logits)

    def sampled(self, logits: np.ndarray) -> int:
        """Sample the next token from the logits of the last evaluated position; decide whether another
        step follows (as Engine.generate always has: stop after eog, max_tokens, or a full context)."""
        token = self.sampler(logits, self.history)
        self.history.append(token)
        self.produced += 1
        ended = (
            self.produced >= self.max_tokens
            or (self.stop_at_eog and token in self.eog)
            or self.state.n_past >= self.state.n_ctx
        )
        self.next_token = None if ended else token
        self.phase = Phase.DONE if ended else Phase.DECODE
        return token

    def give_up_state(self) -> None:
        """Its state taken away (the daemon hands a paused request's memory to one that waits): every token
        the state had evaluated, and the sampled one it had yet to, become prompt tokens again, evaluated
        anew on the state `restart` gives; after the last of them the next token is sampled as the decode
        step would have sampled it. A prefill sums in another order than the decode steps did, so what
        follows is the model's continuation, not bit for bit an uninterrupted run's."""
        if self.phase is Phase.DONE or self.state is None:
            raise FomoeError(f"expected a generation with a state to give up, got one in {self.phase.value}")
        unevaluated = [self.next_token] if self.phase is Phase.DECODE else []
        self.pending = list(self.state.tokens) + unevaluated + self.pending
        self.state, self.next_token, self.phase = None, None, Phase.PREFILL

    def restart(self, state: InferenceState) -> None:
        """Continue on `state` (empty) after give_up_state."""
        if self.state is not None or state.n_past:
            raise FomoeError("expected a generation that gave its state up, and an empty state")
        state.check_room(len(self.pending))
        self.state = state

    @property
    def finished(self) -> bool:
        return self.phase is Phase.DONE
