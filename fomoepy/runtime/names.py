"""The backend names `--backend` takes (fomoepy.runtime.backends opens them); a module of its own so the
options can name them without importing any backend."""

BACKEND_NAMES = ("cpu", "reference", "cuda", "hip", "sim", "auto")
