"""`fomoe ppl`: llama-perplexity's method and output, checked against the oracle's perplexity fixture.

The fixture (tests/fixtures/oracle/README.md, "Perplexity fixture") gives, for qwen3moe_q4_k_m and qwen35moe_f32,
the tokens of ppl.txt, llama.cpp's and the exact PPL with every running value, and the per-token NLLs behind them.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ORACLE, open_oracle_engine
from float32_bounds import ppl_bound, reorder_bound

from fomoepy.cli import main
from fomoepy.errors import FomoeError
from fomoepy.eval import kl as klm
from fomoepy.eval.journal import Journal
from fomoepy.eval.klfile import KlBase
from fomoepy.eval.ppl import (
    ChunkNll,
    PplTotals,
    TooFewTokens,
    batch_spans,
    format_final,
    format_running,
    plan_chunks,
    token_nll,
)
from fomoepy.eval.ppl_run import PplRequest, PplRun, read_text, tokenize_text

PPL_TXT = str(ORACLE / "ppl.txt")
PPL_JSON = json.loads((ORACLE / "ppl.json").read_text())
MODELS = ["qwen3moe_q4_k_m", "qwen35moe_f32"]
RUNNING = re.compile(r"\[(\d+)\](\d+\.\d{4}),")
FINAL = re.compile(r"^Final estimate: PPL = (\d+\.\d{4}) \+/- (\d+\.\d{5})$")


def model_path(name: str) -> str:
    return str(ORACLE / f"{name}.gguf")


def running_rtol(name: str, n_ctx: int, n_chunks: int, ppl: float, evaluations: int) -> float:
    """How far a float32 run's printed running PPL may sit from another float32 run's (evaluations=2) or
    from the exact run's (evaluations=1): tests/float32_bounds.py, scaled by the chunks' largest logit."""
    engine = open_oracle_engine(name)
    tokens = np.asarray(PPL_JSON["runs"][name]["tokens_of_text"][: n_ctx * n_chunks]).reshape(n_chunks, n_ctx)
    max_abs_logit = max(float(np.abs(engine.logits(chunk)).max()) for chunk in tokens)
    return ppl_bound(reorder_bound(engine.spec, n_ctx, evaluations), max_abs_logit, ppl)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["ppl", "--backend", "reference", *argv])  # compared with the exact engine's figures
    out, err = capsys.readouterr()
    return code, out, err


def parse_ppl_stdout(out: str) -> tuple[list[float], float, float]:
    """stdout of a PPL run → (running values, final PPL, its error); checks the layout on the way."""
    lines = out.split("\n")
    assert lines[-1] == "" and len(lines) == 3, out[-300:]
    assert re.fullmatch(r"(\[\d+\]\d+\.\d{4},)+", lines[0]), lines[0][:200]
    running = RUNNING.findall(lines[0])
    assert [int(i) for i, _ in running] == list(range(1, len(running) + 1))
    final = FINAL.match(lines[1])
    assert final, lines[1]
    return [float(v) for _, v in running], float(final.group(1)), float(final.group(2))


# -- the pure computations ------------------------------------------------------------------------------


def test_plan_chunks_is_llama_perplexity_chunking():
    plan = plan_chunks(28669, 128)
    assert (plan.n_chunks, plan.first, plan.n_scored, plan.n_tokens_used) == (223, 64, 63, 28544)
    assert plan_chunks(28669, 128, max_chunks=10).n_chunks == 10
    assert plan_chunks(28669, 128, max_chunks=-1).n_chunks == 223
    assert plan_chunks(28669, 128, max_chunks=10_000).n_chunks == 223
    assert plan_chunks(256, 128).n_chunks == 2  # llama-perplexity's minimum: 2 * n_ctx tokens
    with pytest.raises(TooFewTokens, match="only 255 tokens.*needs at least 256"):
        plan_chunks(255, 128)
    with pytest.raises(FomoeError, match="scores no token"):
        plan_chunks(1000, 2)
    assert plan_chunks(100, 3).n_scored == 1
    odd = plan_chunks(1000, 129)
    assert (odd.first, odd.n_scored) == (64, 64)


def test_chunk_tokens_and_targets_with_bos_replacement():
    tokens = np.arange(1000, 1000 + 40)
    plan = plan_chunks(len(tokens), 8, bos_id=7)
    chunk = plan.eval_tokens(tokens, 2)
    assert chunk.tolist() == [7] + list(range(1017, 1024))  # first token replaced by BOS
    assert plan.targets(tokens, 2).tolist() == [1021, 1022, 1023]  # original ids at positions first+1 .. ctx-1
    assert tokens[16] == 1016  # the caller's tokens are untouched
    no_bos = plan_chunks(len(tokens), 8)
    assert no_bos.eval_tokens(tokens, 2).tolist() == list(range(1016, 1024))


def test_batch_spans_like_n_batch():
    assert batch_spans(128, 2048) == [(0, 128)]
    assert batch_spans(128, 128) == [(0, 128)]
    assert batch_spans(128, 50) == [(0, 50), (50, 100), (100, 128)]
    with pytest.raises(FomoeError):
        batch_spans(128, 0)


def test_token_nll_is_float64_log_softmax():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((5, 300)) * 4).astype(np.float32)
    logits[0, 3] = 80.0  # large values must not overflow
    targets = np.array([3, 0, 299, 17, 42])
    z = logits.astype(np.float64)
    expected = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1) - z[np.arange(5), targets]
    np.testing.assert_allclose(token_nll(logits, targets), expected, rtol=1e-14)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("kind", ["llamacpp", "exact"])
def test_running_and_final_estimate_reproduce_ppl_json_from_its_nlls(name, kind):
    run = PPL_JSON["runs"][name][kind]
    nll = np.load(ORACLE / "ppl_nll.npz")[f"{name}.{kind}"]  # [223, 63]
    totals = PplTotals()
    running = []
    for i, row in enumerate(nll):
        totals.add(ChunkNll.of(i, row))
        running.append(totals.estimate().ppl)
    np.testing.assert_allclose(running, run["running"], rtol=1e-12)
    est = totals.estimate()
    assert est.count == 223 * 63
    assert est.ppl == pytest.approx(run["ppl"], rel=1e-12)
    assert est.mean_nll == pytest.approx(run["mean_nll"], rel=1e-12)
    assert est.err == pytest.approx(run["ppl_err"], rel=1e-9)


def test_print_formats_are_llama_perplexity_s():
    assert format_running(1, 728.98921) == "[1]728.9892,"
    assert format_running(12, 2.03125) == "[12]2.0312,"  # an exact tie: round-half-even, as glibc printf
    est = PplTotals()
    est.add(ChunkNll.of(0, np.array([6.0, 7.0, 6.5])))
    assert FINAL.match(format_final(est.estimate()))


# -- the oracle runs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_tokenization_of_ppl_txt_is_tokens_of_text(name):
    text, _ = read_text(PPL_TXT)
    assert not text.endswith("\n")  # -f strips one trailing newline
    tokens = tokenize_text(open_oracle_engine(name), text)
    assert tokens.tolist() == PPL_JSON["runs"][name]["tokens_of_text"]


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_fomoe_ppl_matches_the_oracle_perplexity(capsys, name):
    run = PPL_JSON["runs"][name]
    exact, llama = run["exact"], run["llamacpp"]
    code, out, err = run_cli(capsys, model_path(name), "--file", PPL_TXT, "--ctx", "128")
    assert code == 0, err
    running, ppl, ppl_err = parse_ppl_stdout(out)
    assert len(running) == run["n_chunks"] == 223
    # every running value: %.4f of a PPL within 1e-4 of exact (and of llama.cpp, allowing its rounding gap)
    np.testing.assert_allclose(running, exact["running"], rtol=1e-4)
    gap = np.abs(np.array(llama["running"]) - np.array(exact["running"]))
    assert np.all(np.abs(np.array(running) - llama["running"]) <= 1e-4 * np.array(llama["running"]) + gap + 5e-5)
    assert abs(ppl - exact["ppl"]) <= 1e-4 * exact["ppl"]
    assert abs(ppl - llama["ppl"]) <= 1e-4 * llama["ppl"] + abs(llama["ppl"] - exact["ppl"])
    assert ppl_err == pytest.approx(exact["ppl_err"], rel=1e-3)
    assert "calculating perplexity over 223 chunks, n_ctx=128, batch_size=128, n_seq=1" in err
    assert "KV cache reset per chunk; expert caches carried over" in err


def test_batch_smaller_than_ctx_continues_the_state(capsys):
    # qwen35moe: DeltaNet recurrent state and KV cache both carried across the eval calls of a chunk
    args = [model_path("qwen35moe_f32"), "--file", PPL_TXT, "--ctx", "128", "--chunks", "4"]
    _, whole, _ = run_cli(capsys, *args)
    code, split, err = run_cli(capsys, *args, "-b", "48")
    assert code == 0 and "3 eval call(s) of <= 48 tokens" in err
    a, b = parse_ppl_stdout(whole), parse_ppl_stdout(split)
    # same function, other BLAS shapes: only the order of float32 sums differs
    np.testing.assert_allclose(a[0], b[0], rtol=running_rtol("qwen35moe_f32", 128, 4, min(a[0]), evaluations=2))
    np.testing.assert_allclose(PPL_JSON["runs"]["qwen35moe_f32"]["exact"]["running"][:4], b[0], rtol=1e-4)


class BosTokenizer:
    """The model's tokenizer as if its GGUF said add_bos_token = true."""

    def __init__(self, tok):
        self._tok = tok
        self.add_bos, self.add_eos, self.bos_id = True, False, tok.bos_id

    def encode(self, text, *, add_special=True, parse_special=True):
        ids = self._tok.encode(text, add_special=False, parse_special=parse_special)
        return [self.bos_id, *ids] if add_special else ids


class RecordingEngine:
    """The real engine with a BOS-adding tokenizer; records what each eval call evaluates."""

    def __init__(self, engine):
        self._engine = engine
        self.tokenizer = BosTokenizer(engine.tokenizer)
        self.calls: list[list[int]] = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def eval(self, state, tokens, all_logits=False, **kw):
        self.calls.append(list(map(int, tokens)))
        return self._engine.eval(state, tokens, all_logits=all_logits, **kw)


def test_bos_is_prepended_and_starts_every_chunk_when_the_model_adds_it():
    engine = RecordingEngine(open_oracle_engine("qwen35moe_f32"))
    text_ids = PPL_JSON["runs"]["qwen35moe_f32"]["tokens_of_text"]
    bos = engine.tokenizer.bos_id
    req = PplRequest(model=model_path("qwen35moe_f32"), text_file=PPL_TXT, n_ctx=128, n_batch=2048, max_chunks=3)
    run = PplRun(engine, req, out=io.StringIO(), err=io.StringIO())
    run.run()
    tokens = [bos, *text_ids]  # BOS prepended to the text, then cut into chunks
    assert [c[0] for c in engine.calls] == [bos] * 3  # and every chunk's first token replaced by BOS
    for i, call in enumerate(engine.calls):
        assert call[1:] == tokens[i * 128 + 1 : (i + 1) * 128]
    assert f"BOS {bos} first in every chunk" in run.err.getvalue()
    nll = []
    for i, call in enumerate(engine.calls):
        logits = engine.logits(call)[64:127]
        nll.append(token_nll(logits, np.array(tokens[i * 128 + 65 : (i + 1) * 128])))
    expected = math.exp(np.concatenate(nll).mean())
    _, ppl, _ = parse_ppl_stdout(run.out.getvalue())
    assert ppl == pytest.approx(expected, abs=5e-5)


def test_llama_perplexity_spellings(capsys):
    code, out, _ = run_cli(capsys, "-m", model_path("qwen35moe_f32"), "-f", PPL_TXT, "-c", "128", "--chunks", "2")
    assert code == 0
    exact = PPL_JSON["runs"]["qwen35moe_f32"]["exact"]["running"][:2]
    rtol = running_rtol("qwen35moe_f32", 128, 2, min(exact), evaluations=1)
    np.testing.assert_allclose(parse_ppl_stdout(out)[0], exact, rtol=rtol)


# -- bad input: one error line ---------------------------------------------------------------------------


def test_text_too_short_for_two_chunks_is_one_error_line(capsys, tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("Only a few words here.\n")
    code, out, err = run_cli(capsys, model_path("qwen35moe_f32"), "--file", str(f), "--ctx", "128")
    assert code == 1 and out == ""
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and "tokenizes to only" in lines[0] and "needs at least 256" in lines[0]


def test_non_utf8_text_is_one_error_line_before_loading(capsys, tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes("caf\xe9 au lait\n".encode("latin-1") * 100)
    code, out, err = run_cli(capsys, model_path("qwen35moe_f32"), "--file", str(f))
    assert code == 1 and out == ""
    assert err.strip().splitlines() == [f"fomoe: error: {f}: not UTF-8 text (bad byte at offset 3)"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--resume", "{tmp}/missing/r.json"], "--resume {tmp}/missing/r.json: no such directory"),
        (["--resume", "{tmp}"], "--resume {tmp}: is a directory"),
        (["--kl-base", "{tmp}/missing/b.bin"], "--kl-base {tmp}/missing/b.bin: no such directory"),
        (["--kl-base", "{tmp}/b.bin", "--kl-top-k", "-1"], "--kl-top-k must be in [0, "),
    ],
)
def test_unwritable_outputs_are_refused_before_loading(capsys, tmp_path, flags, message):
    code, out, err = run_cli(capsys, model_path("qwen3moe_q4_k_m"), "--file", PPL_TXT, "--ctx", "64", "--chunks", "1",
                             *(f.replace("{tmp}", str(tmp_path)) for f in flags))  # fmt: skip
    lines = err.strip().splitlines()
    assert code == 1 and out == "" and len(lines) == 1
    assert lines[0].startswith("fomoe: error: " + message.replace("{tmp}", str(tmp_path)))
    assert list(tmp_path.iterdir()) == []


def test_wikitext_raw_layout_is_read_as_is(capsys, tmp_path):
    # WikiText-2 raw: " = Title = " headings, " @-@ " / " @,@ " tokens, blank lines of one space
    para = " The 1 @,@ 000 @-@ year old tower , built in 1890 , was restored ( twice ) . \n"
    f = tmp_path / "wiki.test.raw"
    f.write_text(" \n = Valkyria Chronicles III = \n \n" + para * 60 + " \n = = Gameplay = = \n \n" + para * 60)
    code, out, _ = run_cli(capsys, model_path("qwen35moe_f32"), "--file", str(f), "--ctx", "64", "--chunks", "3")
    assert code == 0 and len(parse_ppl_stdout(out)[0]) == 3


def test_kl_divergence_flag_needs_a_base_file(capsys):
    code, _, err = run_cli(capsys, model_path("qwen35moe_f32"), "-f", PPL_TXT, "--kl-divergence")
    assert code == 1 and "--kl-divergence-base" in err


# -- resume ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_after_sigkill_ends_with_the_uninterrupted_result(tmp_path):
    resume = tmp_path / "run.resume"
    cmd = [sys.executable, "-m", "fomoepy.cli", "ppl", model_path("qwen3moe_q4_k_m"), "--file", PPL_TXT]
    cmd += ["--ctx", "128", "--chunks", "30"]
    reference = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout

    proc = subprocess.Popen([*cmd, "--resume", str(resume)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if resume.exists() and resume.read_bytes().count(b"\n") >= 1 + 3:  # header + 3 chunks on disk
            break
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"
    n_done = resume.read_bytes().count(b"\n") - 1
    assert 3 <= n_done < 30

    resumed = subprocess.run([*cmd, "--resume", str(resume)], capture_output=True, text=True, check=True)
    assert f"{n_done} of 30 chunks already done" in resumed.stderr
    assert resumed.stdout == reference  # every running value and the final line
    again = subprocess.run([*cmd, "--resume", str(resume)], capture_output=True, text=True, check=True)
    assert again.stdout == reference and "evaluated" not in again.stderr  # all done: nothing evaluated


def test_resume_file_of_another_run_is_refused(capsys, tmp_path):
    resume = str(tmp_path / "r.resume")
    args = ["--file", PPL_TXT, "--chunks", "2", "--resume", resume]
    assert run_cli(capsys, model_path("qwen35moe_f32"), "--ctx", "128", *args)[0] == 0
    code, _, err = run_cli(capsys, model_path("qwen35moe_f32"), "--ctx", "64", *args)
    assert code == 1 and "belongs to another run: n_ctx expected 128, got 64" in err
    code, _, err = run_cli(capsys, model_path("qwen3moe_q4_k_m"), "--ctx", "128", *args)
    assert code == 1 and "belongs to another run: model" in err
    code, _, err = run_cli(capsys, model_path("qwen35moe_f32"), "--ctx", "128", *args, "--vram-cache", "4M")
    assert code == 1 and "belongs to another run: option --vram-cache expected null, got 4194304" in err  # the size as parsed
    other = tmp_path / "other.txt"
    other.write_text(read_text(PPL_TXT)[0][::-1])
    code, _, err = run_cli(capsys, model_path("qwen35moe_f32"), "--ctx", "128", "--file", str(other), *args[2:])
    assert code == 1 and "belongs to another run: text_sha256" in err
    not_ours = tmp_path / "notes.txt"
    not_ours.write_text("my notes\n")
    code, _, err = run_cli(capsys, model_path("qwen35moe_f32"), *args[:-1], str(not_ours))
    assert code == 1 and "not a fomoe ppl resume file" in err
    assert not_ours.read_text() == "my notes\n"


def test_resume_with_car_needs_each_chunk_from_empty_tiers(capsys, tmp_path):
    # CAR's substitutions depend on what the tiers hold, carried over from chunk to chunk; a resumed run
    # starts them empty, so its perplexity differed from the uninterrupted run's (61.15 against 60.99)
    resume = str(tmp_path / "r.resume")
    args = ["--ctx", "64", "--file", PPL_TXT, "--chunks", "2", "--resume", resume, "--car-threshold", "0.3"]
    code, _, err = run_cli(capsys, model_path("qwen35moe_f32"), *args)
    assert code == 1 and "--resume with --car-threshold needs --reset-cache-per-chunk" in err
    assert not os.path.exists(resume)
    assert run_cli(capsys, model_path("qwen35moe_f32"), *args, "--reset-cache-per-chunk")[0] == 0


def test_journal_drops_a_partial_last_record(tmp_path):
    path = tmp_path / "j"
    j = Journal.open(path, {"a": 1})
    j.append({"chunk": 0, "x": 0.1})
    j.append({"chunk": 1, "x": 1 / 3})
    j.close()
    with open(path, "a") as f:
        f.write('{"chunk": 2, "x": 0.')  # killed mid-write
    j = Journal.open(path, {"a": 1})
    assert [r["x"] for r in j.records] == [0.1, 1 / 3]  # floats read back to the same bits
    j.append({"chunk": 2, "x": 2.0})
    j.close()
    assert [json.loads(line)["chunk"] for line in path.read_text().splitlines()[1:]] == [0, 1, 2]
    with pytest.raises(FomoeError, match="belongs to another run: a expected 1, got 2"):
        Journal.open(path, {"a": 2})


def test_resume_continues_a_kl_base_file_byte_for_byte(capsys, tmp_path):
    name = model_path("qwen35moe_f32")
    full_base, full_resume = tmp_path / "full.kl", tmp_path / "full.resume"
    args = ["--file", PPL_TXT, "--ctx", "128", "--chunks", "5", "--kl-top-k", "20"]
    run_cli(capsys, name, *args, "--kl-base", str(full_base), "--resume", str(full_resume))
    # a run killed after chunk 2 was journaled, while chunk 3's base record was half written
    base, resume = tmp_path / "b.kl", tmp_path / "b.resume"
    lines = full_resume.read_text().splitlines(keepends=True)
    resume.write_text("".join(lines[:3]))
    kb = KlBase(full_base)
    base.write_bytes(full_base.read_bytes()[: kb.records_offset + 2 * kb.record_nbytes + kb.record_nbytes // 2])
    code, _, err = run_cli(capsys, name, *args, "--kl-base", str(base), "--resume", str(resume))
    assert code == 0 and "2 of 5 chunks already done" in err
    assert base.read_bytes() == full_base.read_bytes()
    assert resume.read_text() == full_resume.read_text()


# -- KL divergence ----------------------------------------------------------------------------------------


def kl_run(name: str, base_path, **kw) -> PplRun:
    run = PplRun(
        open_oracle_engine(name),
        PplRequest(model=model_path(name), text_file=None, n_ctx=128, n_batch=2048, **kw),
        KlBase(base_path),
        out=io.StringIO(),
        err=io.StringIO(),
    )
    assert run.run() == 0
    return run


@pytest.mark.parametrize("top_k", ["0", "16"])
def test_kl_of_a_run_against_its_own_base_is_zero(capsys, tmp_path, top_k):
    name = "qwen3moe_q4_k_m"
    base = tmp_path / "base.kl"
    code, out, _ = run_cli(
        capsys, model_path(name), "-f", PPL_TXT, "--ctx", "128", "--chunks", "3", "--kl-base", str(base), "--kl-top-k", top_k
    )
    assert code == 0
    _, ppl, _ = parse_ppl_stdout(out)  # a --kl-base run prints its perplexity as usual
    run = kl_run(name, base)
    s = klm.KlSums.total(run.kl_sums)
    assert s.count == 3 * 63 and s.n_same_top == s.count
    assert s.sum_kld == 0.0 and s.sum_nll == s.sum_nll_base and s.sum_p_diff2 == 0.0
    report = run.out.getvalue()
    assert report.startswith(klm.TABLE_HEADER + "\n")
    mean_ppl = float(re.search(r"Mean PPL\(Q\) +: +([0-9.]+)", report).group(1))
    assert round(mean_ppl, 4) == ppl
    assert "Mean    KLD:   0.000000 ±   0.000000" in report
    assert "Mean ln(PPL(Q)/PPL(base))     :   0.000000 ±   0.000000" in report
    assert "Same top p: 100.000 ± 0.000 %" in report


def test_kl_against_another_model_full_and_top_k(tmp_path, capsys):
    # the two F32 test models share the toy vocabulary; their distributions differ
    full, top = tmp_path / "full.kl", tmp_path / "top.kl"
    for path, k in ((full, "0"), (top, "16")):
        args = ["-f", PPL_TXT, "--ctx", "128", "--chunks", "3", "--kl-base", str(path), "--kl-top-k", k]
        assert run_cli(capsys, model_path("qwen35moe_f32"), *args)[0] == 0
    assert KlBase(full).full_rows and not KlBase(top).full_rows
    a, b = kl_run("qwen3moe_f32", full), kl_run("qwen3moe_f32", top)
    kld_full = np.concatenate([np.asarray(k) for k, _ in a.kl_values])
    kld_top = np.concatenate([np.asarray(k) for k, _ in b.kl_values])
    assert np.all(kld_full > 0.01)
    assert np.all(kld_top <= kld_full + 1e-6)  # grouping the tail never increases a KL divergence
    assert np.all(kld_top > 0)
    # PPL(base) and the ratio do not depend on K
    sa, sb = klm.KlSums.total(a.kl_sums), klm.KlSums.total(b.kl_sums)
    assert sa.sum_nll_base == pytest.approx(sb.sum_nll_base, rel=1e-12) and sa.sum_nll == sb.sum_nll


def test_kl_compare_is_the_kl_divergence_on_synthetic_rows():
    rng = np.random.default_rng(1)
    p_logits = rng.standard_normal((6, 50)).astype(np.float32) * 3
    q_logits = p_logits + rng.standard_normal((6, 50)).astype(np.float32) * 0.3
    targets = rng.integers(0, 50, 6)
    lp = p_logits.astype(np.float64) - np.log(np.exp(p_logits.astype(np.float64)).sum(1, keepdims=True))
    lq = q_logits.astype(np.float64) - np.log(np.exp(q_logits.astype(np.float64)).sum(1, keepdims=True))
    exact = (np.exp(lp) * (lp - lq)).sum(1)
    full = klm.compare(q_logits, targets, klm.base_rows(p_logits, targets, 0))
    np.testing.assert_allclose(full.kld, exact, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(full.nll_base, -lp[np.arange(6), targets], rtol=1e-12)
    at = (np.arange(6), targets)
    np.testing.assert_allclose(full.p_diff, np.exp(lq[at]) - np.exp(lp[at]), atol=1e-12)
    for k in (1, 5, 49):
        part = klm.compare(q_logits, targets, klm.base_rows(p_logits, targets, k))
        assert np.all(part.kld <= exact + 1e-6) and np.all(part.kld >= -1e-9)
    rows = klm.base_rows(p_logits, targets, 5)
    assert rows.ids.shape == (6, 5) and np.all(np.diff(rows.logp, axis=1) <= 0)
    assert np.array_equal(rows.top1, np.argmax(p_logits, axis=1))
    np.testing.assert_allclose(np.exp(rows.log_tail) + np.exp(rows.logp.astype(np.float64)).sum(1), 1.0, atol=1e-6)


def write_llama_cpp_base(path, n_ctx: int, tokens: np.ndarray, logits_per_chunk: list[np.ndarray]) -> None:
    """A `--kl-divergence-base` file the way llama-perplexity writes it (perplexity.cpp, log_softmax(uint16))."""
    n_vocab = logits_per_chunk[0].shape[1]
    nv = 2 * ((n_vocab + 1) // 2) + 4
    with open(path, "wb") as f:
        f.write(b"_logits_" + struct.pack("<iii", n_ctx, n_vocab, len(logits_per_chunk)))
        f.write(tokens.astype("<i4").tobytes())
        for logits in logits_per_chunk:
            for row in logits.astype(np.float32):
                mx, mn = np.float32(row.max()), np.float32(max(row.min(), row.max() - 16))
                lse = np.float32(math.log(np.exp((row - mx).astype(np.float64)).sum()))
                scale = np.float32((mx - mn) / np.float32(65535))
                q = np.where(row > mn, np.rint((row - mn) / scale), 0).astype("<u2")
                rec = np.zeros(nv, "<u2")
                rec[:4] = np.array([scale, mn - mx - lse], "<f4").view("<u2")
                rec[4 : 4 + n_vocab] = q
                f.write(rec.tobytes())


def test_llama_perplexity_base_files_are_read(tmp_path):
    name = "qwen35moe_f32"
    engine = open_oracle_engine(name)
    tokens = np.array(PPL_JSON["runs"][name]["tokens_of_text"][: 2 * 128])
    logits = [engine.logits(tokens[i * 128 : (i + 1) * 128])[64:127] for i in range(2)]
    path = tmp_path / "llama.kld"
    write_llama_cpp_base(path, 128, tokens, logits)
    base = KlBase(path)
    assert (base.kind, base.n_ctx, base.n_chunks, base.full_rows) == ("llama.cpp", 128, 2, True)
    run = kl_run(name, path)
    s = klm.KlSums.total(run.kl_sums)
    assert s.count == 126 and s.n_same_top == 126
    assert abs(s.sum_kld / s.count) < 1e-6  # only the 16-bit quantisation of the base separates them (its
    # rows then sum to 1 only within ~1e-7, so the KL can come out a hair below 0)
    assert abs(s.sum_nll - s.sum_nll_base) / s.count < 1e-3


def test_kl_with_car_is_positive(capsys, tmp_path):
    base = tmp_path / "base.kl"
    model = model_path("qwen3moe_q4_k_m")
    assert run_cli(capsys, model, "-f", PPL_TXT, "--ctx", "128", "--chunks", "2", "--kl-base", str(base))[0] == 0
    # a compute-ready tier of ~20 of the 48 experts (786 KiB each), token by token (CAR substitutes in decode steps)
    car = ["--car-threshold", "0.01", "--vram-cache", "16M", "-b", "1"]
    code, out, err = run_cli(capsys, model, "--kl", str(base), *car)
    assert code == 0
    kld = float(re.search(r"Mean    KLD: +([0-9.]+)", out).group(1))
    same_top = float(re.search(r"Same top p: +([0-9.]+)", out).group(1))
    assert kld > 0 and same_top < 100
    rate = re.search(r"CAR: (\d+) of (\d+) expert slots substituted", err)  # the engine's substitution rate
    assert rate and int(rate.group(1)) > 0


# -- caches and stats ---------------------------------------------------------------------------------------


def ppl_run_with(engine, **kw) -> PplRun:
    req = PplRequest(model=model_path("qwen3moe_q4_k_m"), text_file=PPL_TXT, n_ctx=128, n_batch=2048, max_chunks=3, **kw)
    run = PplRun(engine, req, out=io.StringIO(), err=io.StringIO())
    assert run.run() == 0
    return run


def test_reset_cache_per_chunk_empties_the_tiers_each_chunk_and_counts_the_whole_run():
    from fomoepy.engine import Engine, EngineOptions

    # a device tier that holds every expert of the model (3 layers x 16): carried over, chunks 2 and 3 hit
    # it entirely; reset per chunk, every use is a miss, and the counters still cover all three chunks
    runs = {}
    for reset in (False, True):
        engine = Engine(ORACLE / "qwen3moe_q4_k_m.gguf", EngineOptions(vram_cache=64 << 20))
        run = ppl_run_with(engine, reset_cache_per_chunk=reset)
        runs[reset] = (run, engine.stats()["cache"])
    (warm, carried), (cold, reset) = runs[False], runs[True]
    assert warm.out.getvalue() == cold.out.getvalue()  # CAR off: where experts come from changes nothing
    assert "KV and expert caches reset per chunk" in cold.err.getvalue()
    assert "KV cache reset per chunk; expert caches carried over\n" in warm.err.getvalue()
    assert carried["accesses"] == reset["accesses"] == 3 * 3 * 16  # chunks x layers x experts (a batch uses all)
    assert carried["device"]["misses"] == 3 * 16 and carried["device"]["hits"] == 2 * 3 * 16
    assert reset["device"]["hits"] == 0 and reset["device"]["misses"] == 3 * 3 * 16
    line = next(x for x in cold.err.getvalue().splitlines() if "experts:" in x)
    assert "144 uses" in line and "device 0.0% hit" in line


def test_a_trace_runs_on_across_cache_resets(tmp_path):
    from fomoepy.engine import Engine, EngineOptions
    from fomoepy.experts.trace import read_trace

    path = tmp_path / "run.trace"
    engine = Engine(ORACLE / "qwen3moe_q4_k_m.gguf", EngineOptions(vram_cache=8 << 20, trace=str(path)))
    ppl_run_with(engine, reset_cache_per_chunk=True)
    engine.close()
    assert read_trace(path).n_tokens == 3 * 128  # every chunk's tokens, not only the last chunk's


def test_an_engine_without_an_expert_cache_reset_says_so():
    class WithoutReset:  # an engine of another kind: no reset_expert_cache
        def __init__(self, engine):
            self._engine = engine

        def __getattr__(self, name):
            if name == "reset_expert_cache":
                raise AttributeError(name)
            return getattr(self._engine, name)

    log = ppl_run_with(WithoutReset(open_oracle_engine("qwen3moe_q4_k_m")), reset_cache_per_chunk=True).err.getvalue()
    assert "KV cache reset per chunk; expert caches carried over (this engine has no expert-cache reset)" in log


def test_cold_chunks_give_the_same_perplexity(capsys):
    # CAR off: resetting the expert caches changes where experts come from, never the numbers
    args = [model_path("qwen3moe_q4_k_m"), "-f", PPL_TXT, "--ctx", "128", "--chunks", "3"]
    _, warm, _ = run_cli(capsys, *args)
    code, cold, err = run_cli(capsys, *args, "--reset-cache-per-chunk")
    assert code == 0 and cold == warm
    assert "caches reset per chunk" in err
