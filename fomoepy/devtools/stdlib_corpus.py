"""A deterministic text corpus from the Python standard library's own sources (code and docstrings).

Text that exists on every machine with Python, no download. The corpus depends only on the Python
version (its stdlib files), never on file-system order or on the machine:

    eligible files  every *.py under the stdlib directory, outside SKIP_DIRS, that decodes as UTF-8,
                    sorted by relative POSIX path
    held out        files whose index in that order is HELDOUT_OFFSET modulo HELDOUT_EVERY (whole files,
                    so no file is split between training and evaluation)
    training        the other files, in order, until TRAIN_BYTES of text (the last file is cut at a line)

Documents are joined with "<|endoftext|>" when tokenized. `heldout_excerpt` picks a fixed-size slice of
the held-out files (a piece from the middle of each, cut at line boundaries) to ship as evaluation text.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Generated tables (encodings), tests, GUI code, vendored packages and build configuration: not prose or
# typical code, or not present on every install.
SKIP_DIRS = frozenset({
    "__pycache__", "config-3.11-x86_64-linux-gnu", "dist-packages", "encodings", "ensurepip", "idlelib",
    "lib2to3", "site-packages", "test", "tests", "tkinter", "turtledemo", "venv", "__phello__",
})  # fmt: skip
HELDOUT_EVERY = 20
HELDOUT_OFFSET = 12
TRAIN_BYTES = 8_000_000


@dataclass(frozen=True)
class Document:
    path: str  # relative to the stdlib directory, POSIX form
    text: str


@dataclass(frozen=True)
class Corpus:
    train: tuple[Document, ...]
    heldout: tuple[Document, ...]

    @property
    def train_bytes(self) -> int:
        return sum(len(d.text.encode("utf-8")) for d in self.train)

    @property
    def heldout_bytes(self) -> int:
        return sum(len(d.text.encode("utf-8")) for d in self.heldout)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def eligible_documents(root: Path | None = None) -> list[Document]:
    root = root or stdlib_root()
    docs = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            docs.append(Document(rel.as_posix(), text))
    if not docs:
        raise RuntimeError(f"no Python standard-library sources found under {root}")
    return docs


def _cut_at_line(text: str, max_bytes: int) -> str:
    """The longest prefix of whole lines of `text` within max_bytes UTF-8 bytes (at least one line's worth cut)."""
    head = text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")
    newline = head.rfind("\n")
    return head[: newline + 1] if newline >= 0 else head


def build_corpus(root: Path | None = None, train_bytes: int = TRAIN_BYTES) -> Corpus:
    train: list[Document] = []
    heldout: list[Document] = []
    used = 0
    for i, doc in enumerate(eligible_documents(root)):
        if i % HELDOUT_EVERY == HELDOUT_OFFSET:
            heldout.append(doc)
            continue
        if used >= train_bytes:
            continue
        size = len(doc.text.encode("utf-8"))
        if used + size > train_bytes:
            doc = Document(doc.path, _cut_at_line(doc.text, train_bytes - used))
            size = len(doc.text.encode("utf-8"))
        train.append(doc)
        used += size
    return Corpus(tuple(train), tuple(heldout))


def heldout_excerpt(corpus: Corpus, total_bytes: int = 40_000, piece_bytes: int = 2_000) -> str:
    """About total_bytes of held-out text: from each held-out file in order, whole lines starting at
    the first line break past a third of the file, up to piece_bytes; pieces separated by a blank line."""
    pieces: list[str] = []
    used = 0
    for doc in corpus.heldout:
        start = doc.text.find("\n", len(doc.text) // 3) + 1
        piece = _cut_at_line(doc.text[start:], min(piece_bytes, total_bytes - used)).strip("\n")
        if not piece.strip():
            continue
        pieces.append(piece)
        used += len(piece.encode("utf-8")) + 2
        if used >= total_bytes - 200:
            break
    return "\n\n".join(pieces) + "\n"


def prompt_lines(text: str, n: int = 48, min_chars: int = 24) -> list[str]:
    """n prompts from evaluation text: every k-th line (stripped) of at least min_chars characters."""
    lines = [line.strip() for line in text.splitlines() if len(line.strip()) >= min_chars]
    step = max(1, len(lines) // n)
    return lines[::step][:n]
