"""Byte-level BPE tokenizer built from GGUF metadata, giving llama.cpp's token ids.

Encoding follows llama.cpp's `llama_tokenize` for a `gpt2` vocabulary:

1. special-token partition: special token texts found in the input become their ids, longest
   text first (CONTROL/UNKNOWN tokens only with `parse_special`, USER_DEFINED ones always);
2. each remaining text fragment: pre-tokenizer regex split -> GPT-2 byte-to-unicode map -> BPE
   merges by rank. This step is HF `tokenizers` (a BPE model from the GGUF vocabulary and merges);
3. BOS / EOS only where the GGUF asks for them (`tokenizer.ggml.add_bos_token` / `add_eos_token`).

There is no Unicode normalisation (llama.cpp applies none). Decoding concatenates each token's
bytes, as llama.cpp's token-to-piece cache does, so a streaming decoder can hold back an
incomplete UTF-8 sequence split across tokens.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Iterable, Mapping
from typing import Any

from gguf import Keys, TokenType
from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from fomoepy.errors import ModelFileError
from fomoepy.model.gguf_file import read_metadata

K = Keys.Tokenizer

# tokenizer.ggml.pre -> the split regex llama.cpp uses for it (src/llama-vocab.cpp). Only names for
# which llama.cpp also turns `clean_spaces` off are listed: decoding here never edits spaces.
PRE_TOKENIZER_REGEX: dict[str, str] = {
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    # qwen35: combining marks (\p{M}) join the letter run and leave the punctuation run
    "qwen35": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
        r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
PRE_TOKENIZER_REGEX["deepseek-r1-qwen"] = PRE_TOKENIZER_REGEX["qwen2"]

# llama.cpp (llama_vocab::impl::load) finds end-of-generation tokens by their text and forces them
# to CONTROL, whatever type the file gives them. "</s>", which later llama.cpp versions add, is left
# out: it is an ordinary token of Qwen vocabularies (id 128247 in Qwen2), and the llama.cpp of the
# oracle fixtures does not end generation on it (MANIFEST eog_token_ids_llamacpp).
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})  # fmt: skip

# Fill-in-the-middle tokens: (id keys, texts llama.cpp looks for when no key is given, end-of-generation?).
# A token found by its text is forced to CONTROL (real Qwen files store <|fim_prefix|> etc. as USER_DEFINED).
_FIM_KINDS: tuple[tuple[tuple[str, ...], tuple[str, ...], bool], ...] = (
    ((K.FIM_PRE_ID, K.PREFIX_ID), ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>",
                                   "<PRE>", "▁<PRE>", "<|code_prefix|>", "<|prefix|>"), False),
    ((K.FIM_SUF_ID, K.SUFFIX_ID), ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>",
                                   "<SUF>", "▁<SUF>", "<|code_suffix|>", "<|suffix|>"), False),
    ((K.FIM_MID_ID, K.MIDDLE_ID), ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>",
                                   "<MID>", "▁<MID>", "<|code_middle|>", "<|middle|>"), False),
    ((K.FIM_PAD_ID,), ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"), True),
    ((K.FIM_REP_ID,), ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"), True),
    ((K.FIM_SEP_ID,), ("<|file_sep|>",), True),
)  # fmt: skip

# Types whose text is matched in the input only with parse_special, and rendered only with render_special.
_HIDDEN_TYPES = (TokenType.CONTROL, TokenType.UNKNOWN)


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's byte -> printable character map: byte b is written as _BYTE_CHARS[b] in the vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = [""] * 256
    extra = 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_BYTE_CHARS = _gpt2_byte_chars()
_TO_LATIN1 = {ord(c): b for b, c in enumerate(_BYTE_CHARS)}  # str.translate: byte char -> chr(byte)
_DROP_BYTE_CHARS = dict.fromkeys(_TO_LATIN1)  # str.translate: leaves only the chars outside the map


class Tokenizer:
    """A GGUF vocabulary as llama.cpp reads it. Build with `from_gguf` or `from_metadata`.

    Attributes: `pre` (tokenizer.ggml.pre); `bos_id`, `eos_id`, `pad_id` (None when the GGUF does not
    set them; llama.cpp would then fall back to GPT-2's id 11, which we do not copy); `eog_ids`, the
    ids that end generation (eos, eot, eom, and tokens llama.cpp recognises by text such as
    <|im_end|> and <|endoftext|>); `add_bos`, `add_eos` (what `encode(add_special=True)` adds).
    """

    def __init__(
        self,
        *,
        tokens: list[str],
        types: list[int],
        merges: list[tuple[str, str]],
        pre: str,
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None,
        eog_ids: frozenset[int],
        add_bos: bool,
        add_eos: bool,
    ):
        self._tokens = tokens
        self.pre = pre
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.eog_ids = eog_ids
        self.add_bos, self.add_eos = add_bos, add_eos

        bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges)
        self._hf = HFTokenizer(bpe)
        self._hf.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEX[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip

        # (id, text) of every token matched in raw input, longest UTF-8 text first (llama.cpp's order)
        special = [i for i, t in enumerate(types) if t in _HIDDEN_TYPES or t == TokenType.USER_DEFINED]
        special.sort(key=lambda i: -len(tokens[i].encode()))
        self._special_all = [(i, tokens[i]) for i in special]
        self._special_user = [(i, tokens[i]) for i in special if types[i] == TokenType.USER_DEFINED]
        self._max_token_bytes: int | None = None
        self._hidden = frozenset(i for i in special if types[i] in _HIDDEN_TYPES)
        self._pieces = [_piece(t, k) for t, k in zip(tokens, types, strict=True)]

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        return cls.from_metadata(read_metadata(path), str(path))

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], source: str) -> Tokenizer:
        """Validate the tokenizer keys of a GGUF's metadata; any problem is one ModelFileError naming `source`."""
        model = md.get(K.MODEL)
        if model != "gpt2":
            raise ModelFileError(f"{source}: {K.MODEL} is {model!r}; only 'gpt2' (byte-level BPE) is supported")
        pre = md.get(K.PRE)
        if pre not in PRE_TOKENIZER_REGEX:
            known = ", ".join(sorted(PRE_TOKENIZER_REGEX))
            raise ModelFileError(f"{source}: unsupported pre-tokenizer {K.PRE} = {pre!r} (supported: {known})")

        tokens = _str_list(md, K.LIST, source)
        types = _int_list(md, K.TOKEN_TYPE, source)
        if len(types) != len(tokens):
            raise ModelFileError(f"{source}: {K.TOKEN_TYPE} has {len(types)} entries, {K.LIST} has {len(tokens)}")
        # llama.cpp renames empty tokens so that every text names exactly one id
        tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        ids = {t: i for i, t in enumerate(tokens)}
        if len(ids) != len(tokens):
            seen: dict[str, int] = {}
            for i, t in enumerate(tokens):
                if t in seen:
                    raise ModelFileError(f"{source}: duplicate token {t!r} at ids {seen[t]} and {i}")
                seen[t] = i
        # BPE starts from one token per byte: llama.cpp fails on a byte it cannot map, HF would drop it
        missing = [b for b, c in enumerate(_BYTE_CHARS) if c not in ids]
        if missing:
            raise ModelFileError(f"{source}: vocabulary lacks the byte-level token of byte 0x{missing[0]:02x}")
        merges = _merges(_str_list(md, K.MERGES, source), ids, source)

        n = len(tokens)
        bos_id, eos_id, pad_id = (_token_id(md, key, n, source) for key in (K.BOS_ID, K.EOS_ID, K.PAD_ID))
        add_bos, add_eos = (_flag(md, key, source) for key in (K.ADD_BOS, K.ADD_EOS))
        if add_bos and bos_id is None:
            raise ModelFileError(f"{source}: {K.ADD_BOS} is true but {K.BOS_ID} is not set")
        if add_eos and eos_id is None:
            raise ModelFileError(f"{source}: {K.ADD_EOS} is true but {K.EOS_ID} is not set")

        types = list(types)
        eog = {i for i in (eos_id, *(_token_id(md, key, n, source) for key in (K.EOT_ID, K.EOM_ID))) if i is not None}
        for keys, texts, is_eog in _FIM_KINDS:
            fim_id = next((i for key in keys if (i := _token_id(md, key, n, source)) is not None), None)
            if fim_id is None:
                fim_id = next((ids[t] for t in texts if t in ids), None)
                if fim_id is not None:
                    types[fim_id] = TokenType.CONTROL
            if is_eog and fim_id is not None:
                eog.add(fim_id)
        for text in _EOG_TEXTS & ids.keys():
            types[ids[text]] = TokenType.CONTROL
            eog.add(ids[text])

        return cls(
            tokens=tokens, types=types, merges=merges, pre=pre, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id,
            eog_ids=frozenset(eog), add_bos=add_bos, add_eos=add_eos,
        )  # fmt: skip

    @property
    def n_vocab(self) -> int:
        return len(self._tokens)

    @property
    def max_token_bytes(self) -> int:
        """The most bytes of input text one token can stand for: its decoded bytes, or for a special token
        the text it is matched by."""
        if self._max_token_bytes is None:
            pieces = max((len(p) for p in self._pieces), default=1)
            specials = max((len(t.encode()) for _, t in self._special_all), default=1)
            self._max_token_bytes = max(pieces, specials, 1)
        return self._max_token_bytes

    def min_token_count(self, text: str, *, add_special: bool = True) -> int:
        """A lower bound on len(encode(text)), found without tokenizing: byte-level BPE splits the UTF-8
        bytes of the text into tokens (no normaliser changes them), each covering at most max_token_bytes."""
        n_bytes = len(text.encode("utf-8", "surrogatepass"))
        extra = int(add_special and self.add_bos) + int(add_special and self.add_eos)
        return -(-n_bytes // self.max_token_bytes) + extra

    def token_text(self, token_id: int) -> str:
        """The token's text as stored in the vocabulary (byte-level form for ordinary tokens, e.g. 'Ġthe')."""
        return self._tokens[self._check(token_id)]

    def token_bytes(self, token_id: int, *, render_special: bool = True) -> bytes:
        """The bytes the token decodes to; CONTROL tokens give their text, or nothing without render_special."""
        token_id = self._check(token_id)
        if not render_special and token_id in self._hidden:
            return b""
        return self._pieces[token_id]

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """llama_tokenize(text, add_special, parse_special).

        parse_special: CONTROL token texts in `text` become those tokens (otherwise they are ordinary text);
        USER_DEFINED token texts always do. add_special: BOS/EOS only if the GGUF's add_bos/add_eos say so.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids: list[int] = []
        if add_special and self.add_bos:
            ids.append(self.bos_id)  # type: ignore[arg-type]  # from_metadata checked it is set
        for fragment in self._partition(text, parse_special):
            if isinstance(fragment, int):
                ids.append(fragment)
            else:
                try:
                    # the batch call runs without the interpreter lock (a single encode holds it throughout:
                    # 4.5 s for 4 MB of text, during which no other thread of the daemon runs)
                    ids.extend(self._hf.encode_batch([fragment], add_special_tokens=False)[0].ids)
                except TypeError:
                    # HF refuses a str that is not UTF-8 encodable (a lone surrogate) with a vague
                    # TypeError; this raises UnicodeEncodeError (a ValueError) naming the character
                    fragment.encode()
                    raise
        if add_special and self.add_eos:
            ids.append(self.eos_id)  # type: ignore[arg-type]
        return ids

    def decode(self, ids: Iterable[int], *, render_special: bool = True) -> str:
        """llama_detokenize(ids, remove_special=False, unparse_special=render_special); bad UTF-8 becomes U+FFFD."""
        data = b"".join(self.token_bytes(i, render_special=render_special) for i in ids)
        return data.decode("utf-8", errors="replace")

    def stream_decoder(self, *, render_special: bool = True) -> StreamDecoder:
        return StreamDecoder(self, render_special=render_special)

    def _check(self, token_id: int) -> int:
        token_id = int(token_id)
        if not 0 <= token_id < len(self._tokens):
            raise ValueError(f"token id {token_id} outside the vocabulary [0, {len(self._tokens)})")
        return token_id

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split `text` at special token texts, as llama.cpp's tokenizer_st_partition: for each special
        token, longest first, every non-overlapping occurrence (left to right) in the remaining text."""
        specials = self._special_all if parse_special else self._special_user
        fragments: list[str | int] = [text] if text else []
        # every fragment is a piece of `text`, so a token absent from `text` splits nothing
        for token_id, token_text in [(i, t) for i, t in specials if t in text]:
            split: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or token_text not in fragment:
                    split.append(fragment)
                    continue
                for k, part in enumerate(fragment.split(token_text)):
                    if k:
                        split.append(token_id)
                    if part:
                        split.append(part)
            fragments = split
        return fragments


class StreamDecoder:
    """Token-by-token text for streaming output.

    `feed(id)` returns only complete UTF-8 characters and holds back a multi-byte sequence split across
    tokens (an emoji, a CJK character). The concatenation of every `feed` result and `flush()` equals
    `tokenizer.decode(ids, render_special=...)` of the same ids.
    """

    def __init__(self, tokenizer: Tokenizer, *, render_special: bool = True):
        self._tokenizer = tokenizer
        self._render_special = render_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.token_bytes(token_id, render_special=self._render_special))

    @property
    def pending(self) -> bool:
        """Whether bytes of an incomplete character are held back."""
        return bool(self._utf8.getstate()[0])

    def flush(self) -> str:
        """End of stream: held-back bytes come out as U+FFFD (as decode() would render them); then reset."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


def _piece(text: str, token_type: int) -> bytes:
    """What llama.cpp's token_to_piece gives for a BPE token (with special tokens rendered)."""
    if token_type == TokenType.NORMAL:
        if text.translate(_DROP_BYTE_CHARS):
            # a character outside GPT-2's byte map (a malformed token): keep it as its own UTF-8
            return b"".join(bytes([_TO_LATIN1[ord(c)]]) if ord(c) in _TO_LATIN1 else c.encode() for c in text)
        return text.translate(_TO_LATIN1).encode("latin-1")
    if token_type in _HIDDEN_TYPES or token_type == TokenType.USER_DEFINED:
        return text.encode()
    if token_type == TokenType.BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        return bytes([int(text[3:5], 16)])
    return b""  # UNUSED and undefined types render as nothing


def _str_list(md: Mapping[str, Any], key: str, source: str) -> list[str]:
    value = md.get(key)
    if value is None:
        raise ModelFileError(f"{source}: missing metadata key {key!r}")
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ModelFileError(f"{source}: {key} must be an array of strings")
    return value


def _int_list(md: Mapping[str, Any], key: str, source: str) -> list[int]:
    value = md.get(key)
    if value is None:
        raise ModelFileError(f"{source}: missing metadata key {key!r}")
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ModelFileError(f"{source}: {key} must be an array of integers")
    return value


def _token_id(md: Mapping[str, Any], key: str, n_vocab: int, source: str) -> int | None:
    value = md.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n_vocab:
        raise ModelFileError(f"{source}: {key} = {value!r}, expected a token id in [0, {n_vocab})")
    return value


def _flag(md: Mapping[str, Any], key: str, source: str) -> bool:
    value = md.get(key, False)  # llama.cpp's default for gpt2-type vocabularies
    if not isinstance(value, bool):
        raise ModelFileError(f"{source}: {key} = {value!r}, expected true or false")
    return value


def _merges(lines: list[str], ids: Mapping[str, int], source: str) -> list[tuple[str, str]]:
    """'left right' lines -> pairs in rank order. A repeated pair keeps its first rank (llama.cpp's emplace)."""
    pairs: dict[tuple[str, str], None] = {}
    for rank, line in enumerate(lines):
        cut = line.find(" ", 1)  # the first space after the first character, as llama.cpp splits
        if cut < 0:
            raise ModelFileError(f"{source}: merge {rank} {line!r} is not 'left right'")
        left, right = line[:cut], line[cut + 1 :]
        for part in (left, right, left + right):
            if part not in ids:
                raise ModelFileError(f"{source}: merge {rank} {line!r} names {part!r}, which is not in the vocabulary")
        pairs.setdefault((left, right))
    return list(pairs)
