"""A small byte-level BPE vocabulary, learnt deterministically, for the tokenizer metadata of test models.

The vocabulary is laid out like a Qwen GGUF's (and like the oracle fixtures'):

    ids 0..255                  the GPT-2 byte-to-unicode symbol of byte 0..255, in byte order
    ids 256..n_vocab-4          tokens learnt by BPE, in the order their merges were learnt
    n_vocab-3 .. n_vocab-1      <|endoftext|>, <|im_start|>, <|im_end|>, token type CONTROL

Merges are learnt by the `tokenizers` BpeTrainer over the Qwen2 pre-tokenizer split of a fixed list of
Python standard-library source files, read in a fixed order: text that exists on every machine with no
download. The trainer breaks ties by pair, so the result is the same on every run; it depends only on
those files, i.e. on the Python version.
"""

from __future__ import annotations

import functools
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from gguf import TokenType

QWEN2_PRE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Standard-library modules whose sources make the training text (~4.4 MB on Python 3.11); a module
# missing from some Python version is skipped. Order matters only through the text it makes.
CORPUS_MODULES = (
    "argparse",
    "ast",
    "calendar",
    "collections",
    "configparser",
    "dataclasses",
    "datetime",
    "difflib",
    "doctest",
    "enum",
    "fractions",
    "functools",
    "gettext",
    "inspect",
    "ipaddress",
    "json.decoder",
    "logging",
    "mailbox",
    "optparse",
    "pathlib",
    "pickle",
    "pickletools",
    "platform",
    "pydoc",
    "shutil",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "tokenize",
    "traceback",
    "typing",
    "unittest.case",
    "zipfile",
    "email._header_value_parser",
    "email.message",
    "email.feedparser",
    "asyncio.base_events",
    "asyncio.tasks",
    "http.client",
    "http.server",
    "urllib.request",
    "urllib.parse",
    "xml.dom.minidom",
    "xml.etree.ElementTree",
    "multiprocessing.connection",
    "concurrent.futures._base",
    "importlib._bootstrap_external",
    "random",
    "locale",
    "codecs",
    "os",
    "socket",
    "ssl",
    "smtplib",
    "imaplib",
    "ftplib",
    "turtle",
    "_pyio",
    "_pydecimal",
    "pdb",
    "bdb",
    "cmd",
    "copy",
    "csv",
    "dis",
    "fileinput",
    "gzip",
    "heapq",
    "numbers",
    "plistlib",
    "pprint",
    "pstats",
    "queue",
    "shlex",
    "selectors",
    "socketserver",
    "tempfile",
    "timeit",
    "trace",
    "types",
    "uuid",
    "warnings",
    "weakref",
    "webbrowser",
    "zipimport",
)


@dataclass(frozen=True)
class Vocab:
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]  # gguf.TokenType values
    merges: tuple[str, ...]  # "left right", highest priority first
    bos_id: int
    eos_id: int
    pad_id: int


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (byte-level BPE's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def corpus_texts() -> list[str]:
    """The training text: the sources of CORPUS_MODULES that exist under this Python's stdlib."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for module in CORPUS_MODULES:
        rel = Path(*module.split("."))
        for candidate in (root / rel.with_suffix(".py"), root / rel / "__init__.py"):
            if candidate.is_file():
                texts.append(candidate.read_text(encoding="utf-8"))
                break
    if not texts:
        raise RuntimeError(f"no Python standard-library sources found under {root} to learn a vocabulary from")
    return texts


@functools.lru_cache(maxsize=8)
def byte_level_bpe(n_vocab: int) -> Vocab:
    """A vocabulary of exactly `n_vocab` tokens (256 byte symbols, learnt tokens, the 3 control tokens)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    n_learnt = n_vocab - len(SPECIAL_TOKENS)
    if n_learnt < 256:
        raise ValueError(f"n_vocab must be at least {256 + len(SPECIAL_TOKENS)}, got {n_vocab}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=n_learnt, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(corpus_texts(), trainer)
    model = json.loads(tokenizer.to_str())["model"]

    byte_symbols = [bytes_to_unicode()[b] for b in range(256)]
    alphabet = set(byte_symbols)
    learnt = [tok for tok, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]) if tok not in alphabet]
    if 256 + len(learnt) != n_learnt:
        raise ValueError(
            f"the built-in corpus yields at most {256 + len(learnt) + len(SPECIAL_TOKENS)} tokens, "
            f"asked for n_vocab={n_vocab}"
        )
    merges = tuple(" ".join(m) if isinstance(m, list) else m for m in model["merges"])
    tokens = (*byte_symbols, *learnt, *SPECIAL_TOKENS)
    types = (int(TokenType.NORMAL),) * n_learnt + (int(TokenType.CONTROL),) * len(SPECIAL_TOKENS)
    endoftext, _, im_end = (tokens.index(t) for t in SPECIAL_TOKENS)
    return Vocab(tokens=tokens, token_types=types, merges=merges, bos_id=endoftext, eos_id=im_end, pad_id=endoftext)
