"""Learn a Qwen-style byte-level BPE vocabulary from any texts, and encode with it quickly.

`bpe_vocab.byte_level_bpe` learns the test models' vocabulary from a fixed module list; this is the same
recipe over texts the caller chooses (the demo model's training corpus), with the same layout:

    ids 0..255                  the GPT-2 byte-to-unicode symbol of byte 0..255, in byte order
    ids 256..n_vocab-4          learnt tokens, in the order their merges were learnt
    n_vocab-3 .. n_vocab-1      <|endoftext|>, <|im_start|>, <|im_end|>, token type CONTROL

`encoder(vocab)` is the HF tokenizer that reproduces llama.cpp's (and fomoepy's) ids for this vocabulary
(oracle README, "Tokenizer fixture"), for encoding megabytes of training text fast.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from gguf import TokenType
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from fomoepy.devtools.bpe_vocab import (
    QWEN2_PRE_REGEX,
    SPECIAL_TOKENS,
    Vocab,
    bytes_to_unicode,
)


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def train_vocab(texts: Sequence[str], n_vocab: int) -> Vocab:
    """Exactly n_vocab tokens learnt from texts (deterministic: the trainer breaks ties by pair)."""
    n_learnt = n_vocab - len(SPECIAL_TOKENS)
    if n_learnt < 256:
        raise ValueError(f"n_vocab must be at least {256 + len(SPECIAL_TOKENS)}, got {n_vocab}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = _pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=n_learnt, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer)
    model = json.loads(tokenizer.to_str())["model"]

    byte_symbols = [bytes_to_unicode()[b] for b in range(256)]
    alphabet = set(byte_symbols)
    learnt = [tok for tok, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]) if tok not in alphabet]
    if 256 + len(learnt) != n_learnt:
        raise ValueError(f"the texts yield at most {256 + len(learnt) + len(SPECIAL_TOKENS)} tokens, asked for {n_vocab}")
    merges = tuple(" ".join(m) if isinstance(m, list) else m for m in model["merges"])
    tokens = (*byte_symbols, *learnt, *SPECIAL_TOKENS)
    types = (int(TokenType.NORMAL),) * n_learnt + (int(TokenType.CONTROL),) * len(SPECIAL_TOKENS)
    endoftext, _, im_end = (tokens.index(t) for t in SPECIAL_TOKENS)
    return Vocab(tokens=tokens, token_types=types, merges=merges, bos_id=endoftext, eos_id=im_end, pad_id=endoftext)


def encoder(vocab: Vocab) -> Tokenizer:
    """HF tokenizer with this vocabulary's ids; control-token text in the input becomes the control token."""
    ids = {tok: i for i, tok in enumerate(vocab.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    tokenizer = Tokenizer(models.BPE(vocab=ids, merges=merges, ignore_merges=False))
    tokenizer.pre_tokenizer = _pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer
