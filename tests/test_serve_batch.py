"""The daemon's batch, watched step by step: requests join and leave it at token boundaries (finish,
cancel, disconnect, pause), a long prompt is prefilled one bounded chunk per step beside running
streams, the KV budget refuses what can never fit and holds back what does not fit now, and every
request's tokens are those the engine gives it alone.

The worker reports each engine step (`observe`: the prompt chunks evaluated and the decoding jobs), so
the assertions are about the order of steps, not about time.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
import time
from contextlib import contextmanager

import pytest
from conftest import ORACLE
from test_serve import raw_connect, slow_reader, wait_paused
from test_serve_fairness import GatedEngine, final, held, read_until, send

from fomoepy.engine import Engine, EngineOptions
from fomoepy.sampling import SamplingParams
from fomoepy.serve.config import DaemonConfig
from fomoepy.serve.protocol import FrameDecoder
from fomoepy.serve.thread import DaemonThread

MODEL = "qwen3moe_q4_k_m"


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(ORACLE / f"{MODEL}.gguf")


class Steps:
    """Every engine step of a daemon, as (((request id, prompt tokens) of each chunk evaluated), [decoding ids])."""

    def __init__(self) -> None:
        self.steps: list[tuple[tuple | None, list]] = []
        self._lock = threading.Lock()

    def __call__(self, prefills, decoders) -> None:
        with self._lock:
            self.steps.append((tuple((j.id, n) for j, n in prefills), [j.id for j in decoders]))

    def copy(self) -> list:
        with self._lock:
            return list(self.steps)

    def wait(self, pred, timeout: float = 60) -> list:
        deadline = time.monotonic() + timeout
        while not pred(steps := self.copy()):
            assert time.monotonic() < deadline, "the steps never got there"
            time.sleep(0.005)
        return steps

    def decoded(self, id) -> list[int]:
        """Indices of the steps that decoded a token of `id`."""
        return [i for i, (_, ids) in enumerate(self.copy()) if id in ids]


@contextmanager
def daemon(engine, **config):
    d = tempfile.mkdtemp(dir="/tmp", prefix="fomoe-b-")
    steps = Steps()
    try:
        with DaemonThread(engine, f"{d}/d.sock", DaemonConfig(**config)) as t:
            t.call(lambda: setattr(t.daemon.worker, "observe", steps))
            yield t, steps
    finally:
        shutil.rmtree(d, ignore_errors=True)


def alone(engine, prompt: str, n: int) -> list[int]:
    return list(engine.generate(engine.tokenizer.encode(prompt), n, SamplingParams.greedy(), stop_at_eog=False))


def generate(s: socket.socket, id, prompt: str, n: int) -> None:
    send(s, op="generate", id=id, prompt=prompt, max_tokens=n, temperature=0, ignore_eos=True, return_tokens=True)


def finals(s: socket.socket, dec: FrameDecoder, n: int, seen: list | None = None) -> dict:
    """The final messages of a connection's next n requests to end, by id (they end in an order of their own);
    every message read on the way is appended to `seen` where given."""
    done: dict = {}
    got = read_until(s, dec, lambda m: m["type"] not in ("queued", "delta") and bool(done.setdefault(m["id"], m)) and len(done) == n)
    if seen is not None:
        seen.extend(got)
    return done


def test_a_request_joins_a_running_one_and_leaves_before_it_each_with_its_lone_tokens(engine):
    sizes, decode = [], engine.decode
    engine.decode = lambda gens: sizes.append(len(gens)) or decode(gens)  # the engine's own view of a step
    with daemon(engine) as (d, steps):
        a, b = raw_connect(d.path), raw_connect(d.path)
        da, db = FrameDecoder(1 << 20), FrameDecoder(1 << 20)
        generate(a, "A", "the quick fox", 40)
        steps.wait(lambda s: sum("A" in ids for _, ids in s) >= 5)
        generate(b, "B", "a lazy dog", 8)
        done_b, _ = final(b, db, "B")
        done_a, _ = final(a, da, "A")
        a.close(), b.close()
    del engine.decode
    assert sizes.count(2) == 7  # B's decode steps were A's too: one batched step each, not two
    assert done_a["tokens"] == alone(engine, "the quick fox", 40)
    assert done_b["tokens"] == alone(engine, "a lazy dog", 8)
    in_a, in_b = steps.decoded("A"), steps.decoded("B")
    together = set(in_a) & set(in_b)
    assert len(together) == 7  # B's 7 decode steps (its first token came with its prompt) all beside A's
    assert in_a[0] < min(in_b) and max(in_b) < in_a[-1]  # B joined A's batch and left it while A ran on
    assert in_a == list(range(in_a[0], in_a[0] + 39))  # A decoded at every step: no step passed it by


def test_prompts_that_arrive_together_are_evaluated_in_one_step_each_with_its_lone_tokens(engine):
    # three requests queue while a running one holds the engine in a step; at the next step they join,
    # and their prompts are evaluated together (their expert reads shared) as far as a chunk's worth of
    # tokens goes: any two of these fit in one (24 to 31 tokens each, 64 a step), all three do not
    gated = GatedEngine(engine)
    prompts = {"A": "a lazy dog sleeps under the old oak tree in the sun", "B": "over the hill the river runs down to the sea",
               "C": "the red kite flies high above the quiet fields"}  # fmt: skip
    sizes = {k: len(engine.tokenizer.encode(p)) for k, p in prompts.items()}
    chunk = engine.prefill_chunk
    assert max(a + b for a in sizes.values() for b in sizes.values()) <= chunk < sum(sizes.values())
    with daemon(gated) as (d, steps):
        r = raw_connect(d.path)
        conns = {k: raw_connect(d.path) for k in prompts}
        with held(gated):
            generate(r, "R", "the quick fox", 20)
            assert gated.in_step.wait(10)
            for k, prompt in prompts.items():
                generate(conns[k], k, prompt, 6)
            deadline = time.monotonic() + 10
            while d.call(lambda: d.daemon.worker.queue_length) < len(prompts):
                assert time.monotonic() < deadline, "the requests never queued"
                time.sleep(0.005)
        done = {k: final(c, FrameDecoder(1 << 20), k)[0] for k, c in conns.items()}
        final(r, FrameDecoder(1 << 20), "R")
        for c in [r, *conns.values()]:
            c.close()
    recorded = [dict(p) for p, _ in steps.copy()]
    assert all(sum(p.values()) <= chunk for p in recorded)  # a running stream's gap: one chunk's worth of prompt
    theirs = [p for p in recorded if set(p) & set(prompts)]
    assert len(theirs[0]) == 2 and len(theirs[1]) == 1  # two together at once, then the third
    assert {k: n for p in theirs for k, n in p.items()} == sizes
    for k, prompt in prompts.items():
        assert done[k]["tokens"] == alone(engine, prompt, 6)


class FailingPrompts(GatedEngine):
    """An engine whose passes over several prompts fail (a bug in a step)."""

    def prefill_many(self, gens):
        if len(gens) > 1:
            raise RuntimeError("a joint pass broke")
        return super().prefill_many(gens)


def test_a_failed_joint_pass_ends_its_requests_and_the_running_stream_goes_on(engine):
    failing = FailingPrompts(engine)
    with daemon(failing) as (d, steps):
        r = raw_connect(d.path)
        conns = {k: raw_connect(d.path) for k in "AB"}
        with held(failing):
            generate(r, "R", "the quick fox", 20)
            assert failing.in_step.wait(10)
            generate(conns["A"], "A", "a lazy dog", 6)
            generate(conns["B"], "B", "over the hill", 6)
            deadline = time.monotonic() + 10
            while d.call(lambda: d.daemon.worker.queue_length) < 2:
                assert time.monotonic() < deadline, "the requests never queued"
                time.sleep(0.005)
        failed = {k: final(c, FrameDecoder(1 << 20), k)[0] for k, c in conns.items()}
        done_r, _ = final(r, FrameDecoder(1 << 20), "R")
        for c in [r, *conns.values()]:
            c.close()
    for k in "AB":
        assert failed[k]["type"] == "error" and failed[k]["code"] == "internal" and "a joint pass broke" in failed[k]["message"]
    assert done_r["finish_reason"] == "length" and done_r["tokens"] == alone(engine, "the quick fox", 20)


def test_cancel_and_disconnect_inside_a_batch_leave_the_others_running(engine):
    with daemon(engine) as (d, steps):
        conns = {k: raw_connect(d.path) for k in "ABC"}
        decs = {k: FrameDecoder(1 << 20) for k in "ABC"}
        generate(conns["A"], "A", "the quick fox", 60)
        generate(conns["B"], "B", "a lazy dog", 400)
        generate(conns["C"], "C", "over the hill", 400)
        steps.wait(lambda s: any({"A", "B", "C"} <= set(ids) for _, ids in s))
        send(conns["B"], op="cancel", id="x", target="B")
        conns["C"].close()
        done_b, seen_b = final(conns["B"], decs["B"], "B")
        done_a, _ = final(conns["A"], decs["A"], "A")
        stats = d.call(d.daemon.stats)
        for k in "AB":
            conns[k].close()
    assert done_a["finish_reason"] == "length" and done_a["tokens"] == alone(engine, "the quick fox", 60)
    assert done_b["finish_reason"] == "cancelled" and done_b["usage"]["completion_tokens"] < 400
    assert {"type": "ok", "id": "x", "cancelled": True} in seen_b  # answered at once, before its done
    assert stats["outcomes"].get("cancelled") == 2 and stats["running"] == 0
    in_a, in_b, in_c = steps.decoded("A"), steps.decoded("B"), steps.decoded("C")
    assert max(in_b) < in_a[-1] and max(in_c) < in_a[-1]  # both left; A ran on alone
    assert in_a == list(range(in_a[0], in_a[0] + 59))


def test_a_slow_reader_is_paused_out_of_the_batch_and_resumes_with_its_lone_tokens(engine):
    with daemon(engine, write_buffer=1024, pause_timeout=30.0) as (d, steps):
        s = slow_reader(d)
        generate(s, "S", "over the hill", 300)
        b = raw_connect(d.path)
        generate(b, "B", "the quick fox", 120)
        wait_paused(d, 1)
        paused_at = len(steps.copy())
        done_b, _ = final(b, FrameDecoder(1 << 20), "B")
        b.close()
        done_s, _ = final(s, FrameDecoder(1 << 20), "S")  # reading again: S resumes
        s.close()
    assert done_b["tokens"] == alone(engine, "the quick fox", 120)
    assert done_s["finish_reason"] == "length" and done_s["tokens"] == alone(engine, "over the hill", 300)
    in_s, in_b = steps.decoded("S"), steps.decoded("B")
    assert set(in_s) & set(in_b)  # S was in B's batch before it paused
    assert [i for i in in_b if i >= paused_at and i not in in_s]  # B went on without S while S was paused


def test_a_paused_generation_gives_its_memory_to_a_waiting_one_and_is_rebuilt_when_read_again(engine):
    # the budget holds one sequence: S, paused (its client does not read), holds it; B would wait for S's
    # pause timeout (30 s, past the socket's) without the preemption
    with daemon(engine, kv_budget=engine.kv_nbytes(1), write_buffer=1024, pause_timeout=30.0) as (d, steps):
        s = slow_reader(d)
        generate(s, "S", "over the hill", 200)
        wait_paused(d, 1)
        b = raw_connect(d.path)
        generate(b, "B", "the quick fox", 30)
        done_b, _ = final(b, FrameDecoder(1 << 20), "B")
        b.close()
        preempted = d.call(d.daemon.stats)["preempted"]
        done_s, _ = final(s, FrameDecoder(1 << 20), "S")  # reading again: S is rebuilt and goes on
        s.close()
    assert done_b["tokens"] == alone(engine, "the quick fox", 30) and preempted == 1
    # S's tokens: what it had made alone until it gave its state up, then what a generation gets that
    # evaluates its prompt and those tokens as one prompt (the rebuild: prefill chunks, then decode steps)
    prompt = engine.tokenizer.encode("over the hill")
    evaluated = [n for prefills, _ in steps.copy() for id, n in prefills if id == "S"]
    assert evaluated[0] == len(prompt) and sum(evaluated[1:]) > len(prompt)
    m = sum(evaluated[1:]) - len(prompt)  # tokens it had made: all but the last were in its state
    rebuilt = list(engine.generate(prompt + done_s["tokens"][:m], 200 - m, SamplingParams.greedy(), stop_at_eog=False))
    assert done_s["finish_reason"] == "length" and done_s["tokens"] == alone(engine, "over the hill", 200)[:m] + rebuilt


def test_a_4mb_prompt_is_prefilled_one_bounded_chunk_per_step_beside_running_streams():
    # a context large enough for the whole prompt, so it is really prefilled (chunk by chunk)
    big_engine = Engine(ORACLE / f"{MODEL}.gguf", EngineOptions(n_ctx=4_100_000))
    chunk = big_engine.prefill_chunk
    text = "def f(x):\n    return x\n" * (4_000_000 // 23)
    with daemon(big_engine, max_frame=4 << 20) as (d, steps):
        big = raw_connect(d.path)
        big.settimeout(120)
        generate(big, "big", text, 4)
        steps.wait(lambda s: sum(any(i == "big" for i, _ in p) for p, _ in s) >= 3, timeout=120)
        a, b = raw_connect(d.path), raw_connect(d.path)
        generate(a, "A", "the quick fox", 30)
        generate(b, "B", "a lazy dog", 30)
        done_a, _ = final(a, FrameDecoder(1 << 20), "A")
        done_b, _ = final(b, FrameDecoder(1 << 20), "B")
        big.close()  # the client goes: its prefill stops
        a.close(), b.close()
    assert done_a["tokens"] == alone(big_engine, "the quick fox", 30)
    assert done_b["tokens"] == alone(big_engine, "a lazy dog", 30)
    recorded = steps.copy()
    for id in ("A", "B"):
        mine = steps.decoded(id)
        # between two tokens of a running stream: exactly one step, with at most a chunk's prompt tokens
        assert mine == list(range(mine[0], mine[0] + 29))
        for i in mine:
            prefills, _ = recorded[i]
            assert sum(n for _, n in prefills) <= chunk
        assert sum(any(j == "big" for j, _ in recorded[i][0]) for i in mine) >= 10  # it was beside


def test_the_kv_budget_refuses_what_never_fits_and_queues_what_does_not_fit_now(engine):
    one_chunk = engine.kv_nbytes(1)  # a sequence of up to 256 tokens
    with daemon(engine, kv_budget=one_chunk) as (d, steps):
        a, b = raw_connect(d.path), raw_connect(d.path)
        da, db = FrameDecoder(1 << 20), FrameDecoder(1 << 20)
        generate(a, "huge", "the quick fox", 300)
        refused, _ = final(a, da, "huge")
        generate(a, "A", "the quick fox", 30)
        steps.wait(lambda s: any("A" in ids for _, ids in s))
        generate(b, "B", "a lazy dog", 30)
        done_b, seen_b = final(b, db, "B")
        done_a, _ = final(a, da, "A")
        a.close(), b.close()
    assert refused["type"] == "error" and refused["code"] == "bad_request"
    assert "more than the daemon's KV budget" in refused["message"] and "(--kv-budget)" in refused["message"]
    assert [m["position"] for m in seen_b if m["type"] == "queued"] == [0]  # B waited, told its place
    assert not set(steps.decoded("A")) & set(steps.decoded("B"))  # never in one step: the budget holds one
    assert done_a["tokens"] == alone(engine, "the quick fox", 30)
    assert done_b["tokens"] == alone(engine, "a lazy dog", 30)


def test_a_full_batch_keeps_newcomers_queued_in_turn(engine):
    with daemon(engine, max_batch=2) as (d, steps):
        conns = [raw_connect(d.path) for _ in range(4)]
        decs = [FrameDecoder(1 << 20) for _ in range(4)]
        # (the two first end at different steps, so the slots free one at a time: two slots freed at once
        # would take both newcomers in one step, their prompts in one joint pass, whatever their order)
        for i, (c, n) in enumerate(zip(conns[:2], (40, 30))):
            generate(c, i, "the quick fox", n)
        steps.wait(lambda s: any(len(ids) == 2 for _, ids in s))
        for i, c in enumerate(conns[2:], 2):
            generate(c, i, "a lazy dog", 5)
        dones = [final(c, dec, i) for i, (c, dec) in enumerate(zip(conns, decs))]
        for c in conns:
            c.close()
    assert max(len(ids) for _, ids in steps.copy()) == 2
    queued = [[m["position"] for m in seen if m["type"] == "queued"] for _, seen in dones[2:]]
    assert queued[0][0] == 0 and queued[1][0] == 1  # told their places while the batch was full
    first = {i: min(steps.decoded(i)) for i in range(4)}
    assert first[2] < first[3]  # and started in that order
    assert all(done["tokens"] == alone(engine, p, n) for (done, _), (p, n) in
               zip(dones, [("the quick fox", 40), ("the quick fox", 30)] + [("a lazy dog", 5)] * 2))  # fmt: skip


def test_a_client_holding_the_whole_batch_gives_a_place_to_another_clients_request(engine):
    # A pipelines two long requests into a batch of two places; B's request takes the place of A's later one
    # at a token boundary, not after a whole generation of A's; A2 goes on where it stopped once B is done
    # (its state kept), ahead of A's next request, so every request's tokens are still its lone run's
    with daemon(engine, max_batch=2) as (d, steps):
        a, b = raw_connect(d.path), raw_connect(d.path)
        da, db = FrameDecoder(1 << 20), FrameDecoder(1 << 20)
        generate(a, "A1", "the quick fox", 120)
        steps.wait(lambda s: any("A1" in ids for _, ids in s))
        generate(a, "A2", "over the hill", 120)  # (told it is first in the queue, then admitted)
        steps.wait(lambda s: any(set(ids) == {"A1", "A2"} for _, ids in s))
        generate(a, "A3", "a lazy dog", 5)
        deadline = time.monotonic() + 30
        while d.call(d.daemon.stats)["queue_length"] < 1:  # A3 queued before B arrives
            assert time.monotonic() < deadline
            time.sleep(0.005)
        generate(b, "B", "a lazy dog", 8)
        done_b, _ = final(b, db, "B")
        seen: list = []
        done = finals(a, da, 3, seen)
        done_a1, done_a2, done_a3 = done["A1"], done["A2"], done["A3"]
        yielded = d.call(d.daemon.stats)["yielded"]
        a.close(), b.close()
    recorded = steps.copy()
    assert max(len(ids) for _, ids in recorded) == 2 and yielded == 1
    in_a1, in_a2, in_b = steps.decoded("A1"), steps.decoded("A2"), steps.decoded("B")
    b_prompt = next(i for i, (prefills, _) in enumerate(recorded) if any(id == "B" for id, _ in prefills))
    assert b_prompt < in_a1[-1] and b_prompt < in_a2[-1]  # B started while both of A's were still running
    assert in_a1 == list(range(in_a1[0], in_a1[0] + 119))  # A1 kept its place: a token every step
    assert not set(in_a2) & set(in_b) and [i for i in in_a2 if i > in_b[-1]]  # A2 stood aside for B, then went on
    assert [i for i in in_a2 if i < b_prompt]
    assert min(i for i in in_a2 if i > in_b[-1]) < min(steps.decoded("A3"))  # and before A's next request
    kinds = [m["type"] for m in seen if m.get("id") == "A2"]
    assert "queued" in kinds[kinds.index("delta") :]  # A2's client was told it is queued again, mid-stream
    assert done_b["tokens"] == alone(engine, "a lazy dog", 8)
    assert done_a1["tokens"] == alone(engine, "the quick fox", 120)
    assert done_a2["tokens"] == alone(engine, "over the hill", 120)
    assert done_a3["tokens"] == alone(engine, "a lazy dog", 5)


def test_a_request_that_gave_its_place_up_gives_its_memory_up_too_when_the_head_of_the_queue_needs_it():
    # a budget of three chunks: A2 gives its place to B keeping its one chunk; C, behind no running job but
    # A1, needs all three: once A1 is done only A2's queued state stands in its way, and A2 gives it up (to be
    # rebuilt when it runs again) instead of C and A2 waiting on each other for good
    e = Engine(ORACLE / f"{MODEL}.gguf", EngineOptions(n_ctx=1024))
    chunk = e.kv_nbytes(1)
    assert e.kv_nbytes(524) == 3 * chunk
    with daemon(e, max_batch=2, kv_budget=3 * chunk) as (d, steps):
        a, b, c = raw_connect(d.path), raw_connect(d.path), raw_connect(d.path)
        generate(a, "A1", "the quick fox", 60)
        generate(a, "A2", "over the hill", 120)
        steps.wait(lambda s: any(set(ids) == {"A1", "A2"} for _, ids in s))
        generate(b, "B", "a lazy dog", 8)
        steps.wait(lambda s: any("B" in ids for _, ids in s))
        generate(c, "C", "a lazy dog", 520)
        done_c, _ = final(c, FrameDecoder(1 << 20), "C")
        done_b, _ = final(b, FrameDecoder(1 << 20), "B")
        done = finals(a, FrameDecoder(1 << 20), 2)
        stats = d.call(d.daemon.stats)
        a.close(), b.close(), c.close()
    assert stats["yielded"] == 1 and stats["preempted"] == 1
    assert done_c["tokens"] == alone(e, "a lazy dog", 520) and done_b["tokens"] == alone(e, "a lazy dog", 8)
    assert done["A1"]["tokens"] == alone(e, "the quick fox", 60)
    assert min(steps.decoded("C")) < min(i for i in steps.decoded("A2") if i > steps.decoded("A1")[-1])  # C went first
    # A2's tokens: its lone run's until it gave its state up, then a generation over its prompt and those tokens
    prompt = e.tokenizer.encode("over the hill")
    evaluated = [n for prefills, _ in steps.copy() for id, n in prefills if id == "A2"]
    m = sum(evaluated[1:]) - len(prompt)
    rebuilt = list(e.generate(prompt + done["A2"]["tokens"][:m], 120 - m, SamplingParams.greedy(), stop_at_eog=False))
    assert done["A2"]["tokens"] == alone(e, "over the hill", 120)[:m] + rebuilt


def test_a_place_given_up_goes_to_the_head_even_where_the_giver_was_served_longer_ago(engine):
    # A's two requests were admitted before B's first, so once A's later one gives its place up A heads the fair
    # order again; the place must still go to B's request (the head it was given to), and A2 wait first of A's
    # queue: not A2 taken out of the queue and lost while B2 runs twice (in the batch and still queued)
    with daemon(engine, max_batch=3) as (d, steps):
        a, b, c = raw_connect(d.path), raw_connect(d.path), raw_connect(d.path)
        da, db, dc = FrameDecoder(1 << 20), FrameDecoder(1 << 20), FrameDecoder(1 << 20)
        generate(a, "A1", "the quick fox", 200)
        generate(a, "A2", "over the hill", 200)
        steps.wait(lambda s: any({"A1", "A2"} <= set(ids) for _, ids in s))
        generate(b, "B1", "a lazy dog", 2)
        final(b, db, "B1")  # B served after A's last turn
        generate(c, "C1", "the red kite", 200)
        steps.wait(lambda s: any({"A1", "A2", "C1"} <= set(ids) for _, ids in s))
        generate(b, "B2", "a lazy dog", 8)  # A holds two places, B none: A2 gives its place to B2
        done_b2, _ = final(b, db, "B2")
        done = finals(a, da, 2)
        done_c1, _ = final(c, dc, "C1")
        stats = d.call(d.daemon.stats)
        a.close(), b.close(), c.close()
    assert stats["yielded"] == 1 and stats["running"] == stats["queue_length"] == 0
    assert done_b2["tokens"] == alone(engine, "a lazy dog", 8)
    assert done["A1"]["tokens"] == alone(engine, "the quick fox", 200)
    assert done["A2"]["tokens"] == alone(engine, "over the hill", 200)
    assert done_c1["tokens"] == alone(engine, "the red kite", 200)
    assert not set(steps.decoded("A2")) & set(steps.decoded("B2"))  # A2 stood aside while B2 ran
