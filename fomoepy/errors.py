"""User-facing errors: each one is a single line that says what is wrong and where."""


class FomoeError(Exception):
    """An error caused by input (a file, a flag, a request) rather than a bug; the CLI prints it as one line."""


class ModelFileError(FomoeError):
    """A GGUF file that cannot be read or does not describe a model we support."""


class UnsupportedQuantType(FomoeError):
    """A tensor type for which we have no dequantiser or kernel: never guessed, always refused."""


class StoreError(FomoeError):
    """An expert store that is missing, incomplete, damaged, or prepared from another GGUF: never read as weights."""
