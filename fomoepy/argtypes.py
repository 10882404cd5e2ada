"""Argument types for the `fomoe` parsers: each checks one flag's value as it is parsed.

They raise FomoeError rather than argparse's ArgumentTypeError, so a bad value is the CLI's one
`fomoe: error:` line and status 1 (argparse's own errors print the usage and exit 2).
"""

from __future__ import annotations

from collections.abc import Callable

from fomoepy.errors import FomoeError

INT64_MAX = (1 << 63) - 1
UINT64_MAX = (1 << 64) - 1  # the daemon's protocol takes msgpack's integers: a larger one cannot even be sent
RANDOM_SEED = -1  # --seed -1: a random seed, as llama.cpp's -1 (generate draws one; chat sends none)


def utf8_text(flag: str) -> Callable[[str], str]:
    """Command-line text that is valid UTF-8. Python hands over argv bytes that are not as lone
    surrogates ('\\udcff' for 0xff), which no tokenizer or wire format can encode."""

    def check(text: str) -> str:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise FomoeError(f"{flag} is not valid UTF-8 text (bad byte at offset {_byte_offset(text, e.start)})") from None
        return text

    return check


def _byte_offset(text: str, index: int) -> int:
    # the bad byte's offset in the argument as given: each character before it is its UTF-8 bytes
    return len(text[:index].encode("utf-8", "surrogateescape"))


def int_in(flag: str, low: int, high: int = INT64_MAX) -> Callable[[str], int]:
    """An integer in [low, high] (the default high: what an int64 holds, where C code or msgpack takes it)."""

    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise FomoeError(f"{flag} must be an integer, got {text!r}") from None
        if not low <= value <= high:
            raise FomoeError(f"{flag} must be in [{low}, {high}], got {value}")
        return value

    return check

