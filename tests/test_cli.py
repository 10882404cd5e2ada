"""The `fomoe` command's contract: names, flags, output formats, and one error line for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import ORACLE

from fomoepy.cli import main

Q4KM = str(ORACLE / "qwen3moe_q4_k_m.gguf")


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_tokenize_json_matches_llamacpp_cases(capsys, tmp_path):
    cases = json.loads((ORACLE / "tokenize.json").read_text())
    for case in cases[::7]:
        f = tmp_path / "t.txt"
        f.write_bytes(case["text"].encode("utf-8"))
        flags = [] if case["parse_special"] else ["--no-special"]
        flags += [] if case["add_special"] else ["--no-bos"]
        code, out, _ = run_cli(capsys, "tokenize", str(ORACLE / "tokenizer.gguf"), "--text-file", str(f), *flags, "--json")
        assert code == 0
        assert json.loads(out) == case["ids"], case["text"][:40]


def test_tokenize_keeps_crlf_and_trailing_newline(capsys, tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes(b"a\r\nb\n")
    code, out, _ = run_cli(capsys, "tokenize", str(ORACLE / "tokenizer.gguf"), "--text-file", str(f), "--json")
    assert code == 0
    from fomoepy.model.tokenizer import Tokenizer

    assert json.loads(out) == Tokenizer.from_gguf(ORACLE / "tokenizer.gguf").encode("a\r\nb\n")


def test_logits_writes_float32_all_positions(capsys, tmp_path):
    out_path = tmp_path / "l.npy"
    tokens = ORACLE / "qwen3moe_q4_k_m.tokens.npy"
    code, _, _ = run_cli(capsys, "logits", Q4KM, "--tokens-npy", str(tokens), "--out", str(out_path), "--backend", "reference")
    assert code == 0
    logits = np.load(out_path)
    exact = np.load(ORACLE / "qwen3moe_q4_k_m.exact.npy")
    assert logits.dtype == np.float32 and logits.shape == exact.shape
    assert np.abs(logits - exact).max() <= 1e-3 * exact.std()


def test_logits_accepts_comma_list(capsys, tmp_path):
    out_path = tmp_path / "l.npy"
    code, _, _ = run_cli(capsys, "logits", Q4KM, "--tokens", "1,2,3", "--out", str(out_path))
    assert code == 0
    assert np.load(out_path).shape == (3, 512)


def test_generate_greedy_is_deterministic_and_streams_text(capsys):
    args = ["generate", Q4KM, "-p", "Hello", "-n", "8", "--temp", "0", "--ignore-eos"]
    code, first, err = run_cli(capsys, *args)
    assert code == 0 and first.startswith("Hello")
    assert "generated 8 tokens" in err
    _, second, _ = run_cli(capsys, *args)
    assert first == second


def test_generate_same_seed_same_text(capsys):
    args = ["generate", Q4KM, "-p", "x", "-n", "12", "--seed", "7", "--temp", "1.0", "--ignore-eos"]
    _, a, _ = run_cli(capsys, *args)
    _, b, _ = run_cli(capsys, *args)
    assert a == b


@pytest.mark.parametrize(
    "argv, message",
    [
        (["logits", Q4KM, "--tokens", "1,2,99999", "--out", "/dev/null"], "token id 99999 is outside the vocabulary"),
        (["logits", Q4KM, "--tokens", "1,x", "--out", "/dev/null"], "--tokens must be comma-separated integers"),
        (["info", str(ORACLE / "missing.gguf")], "no such file"),
        (["info", str(ORACLE / "tokenizer.gguf")], "has no tensors"),
        (["generate", Q4KM, "-p", "hi", "-n", "-1"], "-n must be >= 0"),
        (["generate", Q4KM, "-p", "hi", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["logits", Q4KM, "--tokens", ",".join(["1"] * 600), "--out", "/dev/null"], "600 tokens exceed the context of 512"),
    ],
)
def test_bad_input_is_one_error_line(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fomoe: error: ")
    assert message in lines[0]


def test_truncated_model_through_the_console_script(tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes((ORACLE / "qwen3moe_f32.gguf").read_bytes()[:100_000])
    proc = subprocess.run(
        [sys.executable, "-m", "fomoepy.cli", "info", str(cut)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"fomoe: error: {cut}: truncated GGUF file: tensor " + proc.stderr.split("tensor ", 1)[1].strip()
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["logits", Q4KM, "--tokens", "1,99999999999999999999", "--out", "{tmp}/l.npy"], "token id 99999999999999999999 is out of range"),
        (["logits", Q4KM, "--tokens", "1,2", "--out", "{tmp}/missing/l.npy"], "--out {tmp}/missing/l.npy: no such directory"),
        (["logits", Q4KM, "--tokens", "1,2", "--out", "{tmp}"], "--out {tmp}: is a directory"),
        (["tokenize", Q4KM, "--text", "\udcff\udcfe"], "--text is not valid UTF-8 text (bad byte at offset 0)"),
        (["generate", Q4KM, "-p", "a\udcffb", "-n", "1"], "--prompt is not valid UTF-8 text (bad byte at offset 1)"),
        (["generate", Q4KM, "-p", "hi", "--chat", "--system", "\udcff"], "--system is not valid UTF-8 text"),
        (["generate", Q4KM, "-p", "hi", "--seed", "-2"], "--seed must be in [-1, 18446744073709551615], got -2"),
        (["generate", Q4KM, "-p", "hi", "--seed", "1" + "0" * 20], "--seed must be in [-1, 18446744073709551615]"),
        (["generate", Q4KM, "-p", "hi", "--threads", "100000"], "--threads must be in [1, 512], got 100000"),
        (["generate", Q4KM, "-p", "hi", "--ram-cache", "99999999T"], "size '99999999T' is too large"),
        (["generate", Q4KM, "-p", "hi", "--vram-cache", "9" * 5000, "--backend", "reference"], "is too large"),
        (["generate", Q4KM, "-p", "hi", "--trace", "{tmp}/missing/t.trace"], "--trace {tmp}/missing/t.trace: no such directory"),
        (["generate", Q4KM, "-p", "hi", "--trace", "{tmp}"], "--trace {tmp}: is a directory"),
        (["info", "{tmp}"], "{tmp}: is a directory, not a GGUF file"),
        (["generate", Q4KM, "-p", "hi", "--store", Q4KM], f"{Q4KM}: not a directory"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_before_any_work_and_writes_nothing(capsys, tmp_path, argv, message):
    code, out, err = run_cli(capsys, *(a.replace("{tmp}", str(tmp_path)) for a in argv))
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fomoe: error: ")
    assert message.replace("{tmp}", str(tmp_path)) in lines[0]
    assert list(tmp_path.iterdir()) == []  # no output, no probe, no partial file


def test_logits_writes_exactly_the_path_given(capsys, tmp_path):
    # np.save given a name adds ".npy" to it: the file written must be the one reported
    out_path = tmp_path / "logits"
    code, _, err = run_cli(capsys, "logits", Q4KM, "--tokens", "1,2", "--out", str(out_path))
    assert code == 0 and f"-> {out_path}" in err
    assert [p.name for p in tmp_path.iterdir()] == ["logits"]
    assert np.load(out_path).shape == (2, 512)


def test_seed_minus_one_is_a_random_seed(capsys):
    args = ["generate", Q4KM, "-p", "x", "-n", "4", "--seed", "-1", "--temp", "1.0", "--ignore-eos"]
    code, out, err = run_cli(capsys, *args)
    assert code == 0 and out.startswith("x") and "error" not in err


def test_non_finite_logits_are_one_error_naming_the_position(capsys, tmp_path):
    # a damaged model: NaN token embeddings make NaN logits, which left the sampler no candidate (a
    # zero-size reduction) with temperature > 0, and an arbitrary token with temperature 0
    from fomoepy.model.gguf_file import GGUFFile

    source = ORACLE / "qwen3moe_f32.gguf"
    embd = GGUFFile(source).tensors["token_embd.weight"]
    data = bytearray(source.read_bytes())
    data[embd.offset : embd.offset + embd.nbytes] = np.full(embd.nbytes // 4, np.nan, np.float32).tobytes()
    damaged = tmp_path / "nan.gguf"
    damaged.write_bytes(bytes(data))
    for temp in ("0.8", "0"):
        code, _, err = run_cli(capsys, "generate", str(damaged), "-p", "Hello", "-n", "2", "--temp", temp)
        lines = err.strip().splitlines()
        assert code == 1 and len(lines) == 1
        assert lines[0].startswith("fomoe: error: the model produced non-finite logits at position ")
