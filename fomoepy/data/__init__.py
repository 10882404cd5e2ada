"""Files that ship inside the package: the embedded demo model and its evaluation text.

    demo-qwen3moe.gguf          a small trained qwen3moe (4 layers, 32 experts top-4), Q4_K_M-like mix
    demo-qwen3moe.check.npz     tokens [T] and PyTorch's float32 logits [T, n_vocab] of the unquantised model
    demo-heldout.txt            held-out text (stdlib files the model never saw) for `fomoe ppl`

All three are made by tools/train_demo_model.py.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

DEMO_MODEL = "demo-qwen3moe.gguf"
DEMO_CHECK = "demo-qwen3moe.check.npz"
DEMO_HELDOUT = "demo-heldout.txt"


def data_path(name: str) -> Path:
    """A file of this package as a file-system path (the package is installed as files, never zipped:
    the engine memory-maps the model)."""
    path = Path(str(resources.files(__name__).joinpath(name)))
    if not path.is_file():
        raise FileNotFoundError(f"{name}: not found in the fomoepy package data ({path.parent})")
    return path


def demo_model_path() -> Path:
    return data_path(DEMO_MODEL)


def demo_heldout_path() -> Path:
    return data_path(DEMO_HELDOUT)


def demo_check_path() -> Path:
    return data_path(DEMO_CHECK)


def ensure_demo_store(model: Path) -> Path:
    """The demo model's expert store under $XDG_CACHE_HOME/fomoepy (made, or finished, on first use).

    The directory name carries a digest of the model file and the store format's version, so a new demo
    model, or a new format, gets a new store."""
    import hashlib
    import sys

    from fomoepy.experts.store_format import MANIFEST_NAME
    from fomoepy.experts.store_format import VERSION as STORE_VERSION
    from fomoepy.experts.store_writer import prepare_store

    digest = hashlib.sha256()
    with open(model, "rb") as f:
        digest.update(f.read(1 << 20))
    digest.update(str(model.stat().st_size).encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    store = cache / "fomoepy" / "stores" / f"{model.stem}-{digest.hexdigest()[:12]}-v{STORE_VERSION}"
    if not (store / MANIFEST_NAME).exists():
        print(f"fomoe: preparing the demo model's expert store in {store} (first use)", file=sys.stderr)
        prepare_store(model, [store], progress=False)
    return store
