"""Tokenizer: llama.cpp's ids for every oracle string, exact decoding, streaming, and load-time errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import Keys

from fomoepy.errors import ModelFileError
from fomoepy.model.gguf_file import read_metadata
from fomoepy.model.tokenizer import Tokenizer

ORACLE = Path(__file__).parent / "fixtures" / "oracle"
K = Keys.Tokenizer

# cases file -> the vocabulary llama.cpp tokenized it with
SUITES = {
    "tokenize.json": "tokenizer.gguf",
    "tokenize_qwen35.json": "tokenizer_qwen35.gguf",
    "tokenize_real_qwen2.json": "real_qwen2.gguf",
}


def _cases() -> list:
    params = []
    for cases_file, gguf in SUITES.items():
        for i, case in enumerate(json.loads((ORACLE / cases_file).read_text())):
            params.append(pytest.param(gguf, case, id=f"{Path(cases_file).stem}-{i}-{case['category']}"))
    return params


CASES = _cases()


@pytest.fixture(scope="module")
def metadata() -> dict[str, dict]:
    """Metadata of each vocabulary, read once (real_qwen2.gguf alone takes ~12 s to parse)."""
    return {gguf: read_metadata(ORACLE / gguf) for gguf in SUITES.values()}


@pytest.fixture(scope="module")
def tokenizers(metadata) -> dict[str, Tokenizer]:
    return {gguf: Tokenizer.from_metadata(md, gguf) for gguf, md in metadata.items()}


@pytest.fixture
def toy_md(metadata) -> dict:
    """A copy of tokenizer.gguf's metadata that a test may modify."""
    return {k: list(v) if isinstance(v, list) else v for k, v in metadata["tokenizer.gguf"].items()}


@pytest.mark.parametrize("gguf, case", CASES)
def test_encode_gives_llamacpp_ids(tokenizers, gguf, case):
    tok = tokenizers[gguf]
    assert tok.encode(case["text"], add_special=case["add_special"], parse_special=case["parse_special"]) == case["ids"]


@pytest.mark.parametrize("gguf, case", CASES)
def test_decode_gives_back_text_and_llamacpp_detokenized(tokenizers, gguf, case):
    tok = tokenizers[gguf]
    text = tok.decode(case["ids"])
    assert text == case["detokenized"]
    assert text == case["text"]


@pytest.mark.parametrize("gguf, case", CASES)
def test_stream_decoder_reproduces_decode(tokenizers, gguf, case):
    tok = tokenizers[gguf]
    stream = tok.stream_decoder()
    pieces = [stream.feed(i) for i in case["ids"]]
    assert not stream.pending
    assert "".join(pieces) + stream.flush() == tok.decode(case["ids"])


def test_stream_decoder_holds_back_split_characters(tokenizers):
    tok = tokenizers["tokenizer.gguf"]
    text = "naïve 🎉👍🏽 ключ 中文 👨‍👩‍👧"
    ids = tok.encode(text)
    # the toy vocabulary has no token for these characters, so some tokens carry part of a character
    assert any(not _is_utf8(tok.token_bytes(i)) for i in ids)
    stream = tok.stream_decoder()
    out, held_back = [], False
    for i in ids:
        piece = stream.feed(i)
        assert "\ufffd" not in piece
        held_back |= stream.pending
        out.append(piece)
    assert held_back
    assert "".join(out) + stream.flush() == text


def test_stream_decoder_flush_renders_a_dangling_byte_like_decode(tokenizers):
    tok = tokenizers["tokenizer.gguf"]
    ids = tok.encode("中")
    partial = ids[:-1]
    assert partial and not _is_utf8(b"".join(tok.token_bytes(i) for i in partial))
    stream = tok.stream_decoder()
    assert "".join(stream.feed(i) for i in partial) == ""
    assert stream.flush() == tok.decode(partial) == "\ufffd"
    assert not stream.pending


def test_render_special_false_hides_control_tokens_only(tokenizers):
    tok = tokenizers["real_qwen2.gguf"]
    ids = tok.encode("<|im_start|>user\nhi [PAD151700]<|im_end|>")
    assert ids[0] == 151644 and ids[-1] == 151645
    assert tok.decode(ids, render_special=False) == "user\nhi [PAD151700]"
    stream = tok.stream_decoder(render_special=False)
    assert "".join(stream.feed(i) for i in ids) == "user\nhi [PAD151700]"


def test_real_qwen2_facts_match_manifest(tokenizers, manifest):
    facts = manifest["tokenizers"]["real_qwen2"]
    tok = tokenizers["real_qwen2.gguf"]
    assert tok.n_vocab == facts["n_vocab"]
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (facts["bos_token_id"], facts["eos_token_id"], facts["pad_token_id"])
    assert sorted(tok.eog_ids) == facts["eog_token_ids_llamacpp"]
    assert (tok.add_bos, tok.add_eos) == (facts["add_bos_effective"], facts["add_eos_effective"])
    for text, token_id in facts["special_tokens"].items():
        assert tok.token_text(token_id) == text
    assert tok.is_eog(151645) and not tok.is_eog(151644)


def test_toy_facts_match_manifest(tokenizers, manifest):
    facts = manifest["tokenizer"]
    tok = tokenizers["tokenizer.gguf"]
    assert tok.n_vocab == facts["n_vocab"]
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (facts["bos_token_id"], facts["eos_token_id"], facts["pad_token_id"])
    assert tok.eog_ids == {facts["special_tokens"]["<|endoftext|>"], facts["special_tokens"]["<|im_end|>"]}


def test_user_defined_tokens_match_without_parse_special(tokenizers):
    tok = tokenizers["real_qwen2.gguf"]
    assert tok.encode("a[PAD151700]b", parse_special=False) == [*tok.encode("a"), 151700, *tok.encode("b")]
    # a CONTROL token's text stays text
    assert 151645 not in tok.encode("<|im_end|>", parse_special=False)


def test_add_bos_and_add_eos_are_honoured_when_set(toy_md):
    plain = Tokenizer.from_metadata(toy_md, "toy")
    toy_md[K.ADD_BOS] = True
    toy_md[K.ADD_EOS] = True
    tok = Tokenizer.from_metadata(toy_md, "toy")
    body = plain.encode("Hello world")
    assert tok.add_bos and tok.add_eos
    assert tok.encode("Hello world") == [tok.bos_id, *body, tok.eos_id]
    assert tok.encode("Hello world", add_special=False) == body
    assert tok.encode("") == [tok.bos_id, tok.eos_id]


def test_add_bos_defaults_to_false_when_absent(toy_md):
    del toy_md[K.ADD_BOS]
    del toy_md[K.ADD_EOS]
    tok = Tokenizer.from_metadata(toy_md, "toy")
    assert not tok.add_bos and not tok.add_eos
    assert tok.encode("Hello") == tok.encode("Hello", add_special=False)


def test_longest_special_token_is_matched_first(toy_md):
    # llama.cpp splits at each special token in order of decreasing length, not leftmost-first
    n = len(toy_md[K.LIST])
    toy_md[K.LIST] += ["<tag>", "g>end!"]
    toy_md[K.TOKEN_TYPE] += [4, 4]
    tok = Tokenizer.from_metadata(toy_md, "toy")
    assert tok.encode("x<tag>end!") == [*tok.encode("x<ta", parse_special=False), n + 1]
    assert tok.encode("<tag>!") == [n, *tok.encode("!")]


def test_control_looking_token_is_forced_to_control(toy_md):
    # llama.cpp makes every end-of-generation text CONTROL, whatever the file says
    toy_md[K.TOKEN_TYPE][3999] = 1
    tok = Tokenizer.from_metadata(toy_md, "toy")
    assert 3999 in tok.eog_ids
    assert 3999 not in tok.encode("<|im_end|>", parse_special=False)
    assert tok.encode("<|im_end|>") == [3999]


def test_text_that_is_not_unicode_is_refused(tokenizers):
    with pytest.raises(UnicodeEncodeError, match="surrogates not allowed"):
        tokenizers["tokenizer.gguf"].encode("a\ud800b")


def test_out_of_range_ids_are_refused(tokenizers):
    tok = tokenizers["tokenizer.gguf"]
    for bad in (-1, tok.n_vocab):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tok.decode([bad])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tok.token_text(bad)


def _set(**values):
    return lambda md: md.update({getattr(K, key): value for key, value in values.items()})


def _drop(key):
    return lambda md: md.pop(getattr(K, key))


def _duplicate_token(md):
    md[K.LIST][5] = md[K.LIST][6]


BAD_METADATA = {
    "unknown-pre": (_set(PRE="llama-bpe"), r"unsupported pre-tokenizer tokenizer.ggml.pre = 'llama-bpe'"),
    "missing-pre": (_drop("PRE"), r"unsupported pre-tokenizer tokenizer.ggml.pre = None"),
    "not-gpt2": (_set(MODEL="llama"), r"tokenizer.ggml.model is 'llama'; only 'gpt2'"),
    "no-tokens": (_drop("LIST"), r"missing metadata key 'tokenizer.ggml.tokens'"),
    "no-merges": (_drop("MERGES"), r"missing metadata key 'tokenizer.ggml.merges'"),
    "type-count": (lambda md: md[K.TOKEN_TYPE].pop(), r"token_type has 3999 entries, tokenizer.ggml.tokens has 4000"),
    "merge-unknown": (lambda md: md[K.MERGES].append("Ġ nosuchtoken"), r"merge 3741 .* names 'nosuchtoken'"),
    "merge-malformed": (lambda md: md[K.MERGES].append("nospace"), r"merge 3741 'nospace' is not 'left right'"),
    "bos-range": (_set(BOS_ID=4000), r"bos_token_id = 4000, expected a token id in \[0, 4000\)"),
    "eos-negative": (_set(EOS_ID=-1), r"eos_token_id = -1, expected a token id"),
    "flag-type": (_set(ADD_BOS=1), r"add_bos_token = 1, expected true or false"),
    "duplicate": (_duplicate_token, r"duplicate token .* at ids 5 and 6"),
    "add-bos-without-id": (
        lambda md: (md.pop(K.BOS_ID), md.update({K.ADD_BOS: True})),
        r"add_bos_token is true but tokenizer.ggml.bos_token_id is not set",
    ),
}


@pytest.mark.parametrize("edit, message", BAD_METADATA.values(), ids=BAD_METADATA.keys())
def test_bad_metadata_is_one_clear_error(toy_md, edit, message):
    edit(toy_md)
    with pytest.raises(ModelFileError, match=message) as info:
        Tokenizer.from_metadata(toy_md, "broken.gguf")
    assert str(info.value).startswith("broken.gguf: ")
    assert "\n" not in str(info.value)


def test_from_gguf_reads_the_file(tokenizers):
    tok = Tokenizer.from_gguf(ORACLE / "tokenizer_qwen35.gguf")
    assert tok.pre == "qwen35"
    text = "re\u0301sume\u0301 <|im_end|>"
    assert tok.encode(text) == tokenizers["tokenizer_qwen35.gguf"].encode(text)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
