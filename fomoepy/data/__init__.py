"""Files that ship inside the package: the embedded demo model and its evaluation text.

    demo-qwen3moe.gguf          a small trained qwen3moe (4 layers, 32 experts top-4), Q4_K_M-like mix
    demo-qwen3moe.check.npz     tokens [T] and PyTorch's float32 logits [T, n_vocab] of the unquantised model
    demo-heldout.txt            held-out text (stdlib files the model never saw) for `fomoe ppl`

All three are made by tools/train_demo_model.py.
"""

from __future__ import annotations

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
