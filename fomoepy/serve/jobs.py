"""One generation request's life, and the pure pieces it is made of (stop strings, session reuse).

A Job is driven by the worker on the event loop: `begin` (take the session's state, plan the cached
prefix, start its `Generation`), then the worker's engine steps advance `gen` on the inference thread
(prompt chunks, then batched decode steps), `accept` takes each token on the loop (text, stop strings,
streaming), and `finish` sends the final message and returns the session. Only the worker's steps
touch the engine.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from fomoepy.errors import FomoeError
from fomoepy.generation import Generation, Phase
from fomoepy.model.chat import render_chat
from fomoepy.model.state import DeltaNetState, InferenceState
from fomoepy.sampling import SamplingParams
from fomoepy.serve.protocol import Generate, RequestId


class JobState(enum.Enum):
    PREPARING = "preparing"  # the prompt is being rendered and tokenized
    QUEUED = "queued"
    RUNNING = "running"  # in the batch: prompt chunks, then one token per decode step
    PAUSED = "paused"  # the client is not reading; the engine serves others meanwhile
    DONE = "done"


class Sink(Protocol):
    """Where a job's messages go (a client connection)."""

    @property
    def write_paused(self) -> bool: ...

    def send(self, message: dict[str, Any]) -> None: ...

    def finished(self, id: RequestId) -> None: ...


# -- pure pieces -----------------------------------------------------------------------------------


class StopMatcher:
    """Cuts streamed text at the first stop string; holds back text that may be the start of one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was found; then nothing after it is emitted)."""
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


def reusable_prefix(past: Sequence[int], prompt: Sequence[int], can_rewind: bool) -> int | None:
    """How many of a kept state's tokens a new prompt can keep; None: start a fresh state.

    At least one prompt token is always evaluated anew (its logits pick the first token). A state that
    cannot rewind (recurrent DeltaNet layers) is kept only when the prompt extends it exactly.
    """
    n = 0
    for a, b in zip(past, prompt):
        if a != b:
            break
        n += 1
    if can_rewind:
        return min(n, len(prompt) - 1)
    return n if n == len(past) and len(prompt) > n else None


def can_rewind(state: InferenceState) -> bool:
    return not any(isinstance(layer, DeltaNetState) for layer in state.layers)


class Sessions:
    """Inference states kept between requests of a chat session, least recently used dropped first.

    A job checks a state out for its whole run and back in at the end, so two requests of one
    session never share a state: the second, if concurrent, starts fresh.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._states: OrderedDict[str, InferenceState] = OrderedDict()

    def checkout(self, key: str) -> InferenceState | None:
        return self._states.pop(key, None)

    def checkin(self, key: str, state: InferenceState) -> None:
        self._states[key] = state
        self._states.move_to_end(key)
        while len(self._states) > self.capacity:
            self._states.popitem(last=False)

    def clear(self) -> None:
        self._states.clear()

    def __len__(self) -> int:
        return len(self._states)


def prompt_text(engine, text: str | None, messages: list[dict[str, str]] | None) -> str:
    """A raw prompt as it is, or messages rendered by the model's chat template (FomoeError if bad)."""
    if messages is None:
        assert text is not None  # the protocol requires one of the two
        return text
    tok = engine.tokenizer
    return render_chat(
        messages,
        template=engine.file.get("tokenizer.chat_template"),
        bos_token=tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
        eos_token=tok.token_text(tok.eos_id) if tok.eos_id is not None else "",
    )


def check_fits_context(engine, text: str) -> None:
    """Refuse, before tokenizing it, a prompt that has more tokens than the context whatever its text:
    tokens >= UTF-8 bytes / the longest token's bytes (Tokenizer.min_token_count). A 4 MB prompt against a
    512-token context is refused in milliseconds instead of after seconds of tokenizing."""
    least = engine.tokenizer.min_token_count(text)
    if least > engine.n_ctx:
        raise FomoeError(
            f"the prompt has at least {least} tokens ({len(text.encode('utf-8', 'surrogatepass'))} bytes, "
            f"at most {engine.tokenizer.max_token_bytes} per token), more than the context of {engine.n_ctx}"
        )


# -- the job ---------------------------------------------------------------------------------------


class Job:
    def __init__(self, request: Generate, sink: Sink, params: SamplingParams,
                 on_end: Callable[[Job], None] | None = None):  # fmt: skip
        self.request = request
        self.sink = sink
        self.params = params
        self._on_end = on_end  # called once, when the final message (done or error) has been sent
        self.queue_position: int | None = None  # the last position sent in a `queued` message
        self.outcome: str | None = None  # the finish reason, or the error code
        self.prompt: list[int] = []  # set once prepared
        self.state = JobState.PREPARING
        self.cancel_requested = False
        self.t_submit = time.perf_counter()
        self.t_start: float | None = None
        self.t_first: float | None = None
        self.completion: list[int] = []
        self.cached = 0
        self.gen: Generation | None = None
        self._inference: InferenceState | None = None
        self._text: list[str] = []  # the whole answer, when not streamed
        self._decoder = None
        self._stop = StopMatcher(request.stop)
        self._eog: frozenset[int] = frozenset()

    @property
    def id(self) -> RequestId:
        return self.request.id

    def begin(self, engine, sessions: Sessions) -> None:
        """On the loop thread: pick the state (a session's, rewound to the common prefix, or fresh)."""
        self.state = JobState.RUNNING
        self.t_start = time.perf_counter()
        state = sessions.checkout(self.request.session) if self.request.session else None
        keep = None
        if state is not None:
            keep = reusable_prefix(state.tokens, self.prompt, can_rewind(state))
        if keep is None:
            state = engine.new_state()
            keep = 0
        state.truncate(keep)
        self.cached = keep
        self._inference = state
        self._decoder = engine.tokenizer.stream_decoder()
        self._eog = frozenset(engine.tokenizer.eog_ids)
        self.gen = engine.start(
            self.prompt[keep:], self.request.max_tokens, self.params, state=state,
            stop_at_eog=not self.request.ignore_eos,
        )  # fmt: skip

    def give_up_state(self) -> None:
        """Paused, its memory wanted: the state is dropped, rebuilt by prefill when the job runs again
        (rejoin; Generation.give_up_state)."""
        self.gen.give_up_state()
        self._inference = None

    def rejoin(self, engine) -> None:
        """Back in the batch: a state given up is made anew (its tokens are evaluated again as a prompt)."""
        if self.gen is not None and self.gen.state is None:
            self._inference = engine.new_state()
            self.gen.restart(self._inference)

    @property
    def decoding(self) -> bool:
        """Past its prompt, with a token for the next decode step."""
        return self.gen is not None and self.gen.phase is Phase.DECODE

    def accept(self, token: int) -> str | None:
        """On the loop thread: a produced token; a finish reason when it ends the generation."""
        if self.t_first is None:
            self.t_first = time.perf_counter()
        self.completion.append(token)
        if token in self._eog and not self.request.ignore_eos:
            return "eog"
        text, stopped = self._stop.feed(self._decoder.feed(token))
        self._emit(text)
        if stopped:
            return "stop"
        if len(self.completion) >= self.request.max_tokens:
            return "length"
        return None

    def finish(self, reason: str, sessions: Sessions | None) -> dict[str, Any]:
        """Send the final message; return the state to the session (None: drop it). Returns timings."""
        self.outcome = reason
        self.gen = None
        if reason != "stop" and self._decoder is not None:
            text, _ = self._stop.feed(self._decoder.flush())
            self._emit(text + self._stop.flush())
        if sessions is not None and self.request.session and self._inference is not None:
            sessions.checkin(self.request.session, self._inference)
        self._inference = None
        self.state = JobState.DONE
        now = time.perf_counter()
        t_start = self.t_start if self.t_start is not None else now
        t_first = self.t_first if self.t_first is not None else now
        decode_s = now - t_first
        timings = {
            "queued_s": round(t_start - self.t_submit, 6),
            "prefill_s": round(t_first - t_start, 6),
            "decode_s": round(decode_s, 6),
            "decode_tok_per_s": round((len(self.completion) - 1) / decode_s, 3) if decode_s > 0 else 0.0,
        }
        done: dict[str, Any] = {
            "type": "done",
            "id": self.id,
            "finish_reason": reason,
            "usage": {
                "prompt_tokens": len(self.prompt),
                "completion_tokens": len(self.completion),
                "cached_tokens": self.cached,
            },
            "timings": timings,
        }
        if not self.request.stream:
            done["text"] = "".join(self._text)
        if self.request.return_tokens:
            done["tokens"] = list(self.completion)
        self.sink.send(done)
        self._ended()
        return timings

    def fail(self, code: str, message: str) -> None:
        """End with an error reply instead of `done`; the state, possibly half-updated, is dropped."""
        self.outcome = code
        self.gen = None
        self._inference = None
        self.state = JobState.DONE
        self.sink.send({"type": "error", "id": self.id, "code": code, "message": message})
        self._ended()

    def tell_position(self, position: int) -> None:
        """A `queued` message: `position` requests will start before this one. Sent when the job is
        queued, then only when the position has moved materially: by a quarter of the last one sent, or
        to any of the last four places, so a long queue does not turn into a stream of messages."""
        last = self.queue_position
        if last is not None and (position == last or (abs(position - last) < max(1, last // 4) and position > 3)):
            return
        self.queue_position = position
        self.sink.send({"type": "queued", "id": self.id, "position": position})

    def _ended(self) -> None:
        self.sink.finished(self.id)
        if self._on_end is not None:
            on_end, self._on_end = self._on_end, None
            on_end(self)

    def _emit(self, text: str) -> None:
        if not text:
            return
        if self.request.stream:
            self.sink.send({"type": "delta", "id": self.id, "text": text})
        else:
            self._text.append(text)
