"""`fomoe profile` writes a .freq of the router's original choices that `--freq-profile` can seed from."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ORACLE

from fomoepy.cli import main
from fomoepy.experts.profile import read_freq

MODEL = str(ORACLE / "qwen3moe_q4_k_m.gguf")


def test_profile_counts_every_token_of_every_layer(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("def main():\n\nThe quick brown fox\n")
    out = tmp_path / "m.freq"
    assert main(["profile", MODEL, "--prompts", str(prompts), "--out", str(out), "-n", "3"]) == 0
    profile = read_freq(out, n_layer=3, n_expert=16)
    per_layer = np.zeros(3)
    for layer, _, freq in profile.items():
        per_layer[layer] += freq
    # freq = count / tokens, and each token picks top-4 experts in every layer
    assert np.allclose(per_layer, 4.0, atol=1e-4)
    freqs = [f for _, _, f in profile.items()]
    assert freqs == sorted(freqs, reverse=True)

    code = main(["generate", MODEL, "-p", "hi", "-n", "2", "--temp", "0", "--freq-profile", str(out), "--vram-cache", "2M", "--backend", "reference"])
    assert code == 0


@pytest.mark.parametrize("out, message", [("missing/m.freq", "no such directory"), ("taken", "is a directory")])
def test_an_unwritable_out_is_refused_before_profiling_and_leaves_nothing(tmp_path, capsys, out, message):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    (tmp_path / "taken").mkdir()
    assert main(["profile", MODEL, "--prompts", str(prompts), "--out", str(tmp_path / out), "-n", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"fomoe: error: --out {tmp_path / out}: {message}" + (f" {tmp_path / 'missing'}" if "such" in message else "")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.txt", "taken"]  # no .partial file


def test_a_failed_profile_write_leaves_no_partial_file(tmp_path):
    from fomoepy.experts.profile import FreqProfile, write_freq

    class FailingEntries:  # fails half-way through the write, after the header, as a full disk would
        def __len__(self):
            return 1

        def astype(self, dtype):
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_freq(tmp_path / "m.freq", FreqProfile(3, FailingEntries()))
    assert list(tmp_path.iterdir()) == []


def test_profile_of_an_empty_prompt_file_is_an_error(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n\n")
    code = main(["profile", MODEL, "--prompts", str(prompts), "--out", str(tmp_path / "m.freq")])
    assert code == 1
    assert "no prompts" in capsys.readouterr().err
