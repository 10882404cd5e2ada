"""Chat formatting: a conversation rendered to prompt text by the GGUF's own `tokenizer.chat_template`.

Templates are Jinja, as in HF transformers' `apply_chat_template`: rendered in an immutable sandbox
with `trim_blocks` and `lstrip_blocks`, the globals `raise_exception` and `strftime_now`, and a
`tojson` filter that does not HTML-escape. A GGUF without a template gets ChatML. Every failure, a bad
message list or a template that does not compile or render, is one `FomoeError` line.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
from gguf import Keys
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from fomoepy.errors import FomoeError

# llama.cpp's "chatml" format, used when the GGUF has no template
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

MESSAGE_KEYS = ("role", "content")


def render_chat(
    messages: list[dict],
    *,
    template: str | None,
    bos_token: str,
    eos_token: str,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text for `messages` (each exactly {"role": str, "content": str}).

    `template` is the GGUF's `tokenizer.chat_template`; None or "" means ChatML. With
    `add_generation_prompt` the text ends with the opening of the assistant's turn. The template sees
    copies of the messages, so it cannot change the caller's data.
    """
    checked = _check_messages(messages)
    if template is not None and not isinstance(template, str):  # (GGUF metadata: any value type)
        raise FomoeError(f"the model's {Keys.Tokenizer.CHAT_TEMPLATE} must be a string, got {type(template).__name__}")
    compiled = _compile(template or CHATML_TEMPLATE)
    try:
        return compiled.render(
            messages=checked,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except jinja2.TemplateError as e:
        raise FomoeError(f"chat template failed to render: {_one_line(e)}") from None
    # what a template's own expressions can raise (e.g. `1 / 0`, `'a' + 1`, `[][0]`)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError, RecursionError) as e:
        raise FomoeError(f"chat template failed to render: {type(e).__name__}: {_one_line(e)}") from None


def _check_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list):
        raise FomoeError(f"messages must be a list, got {type(messages).__name__}")
    if not messages:
        raise FomoeError("messages is empty")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise FomoeError(f"messages[{i}] must be an object with 'role' and 'content', got {type(message).__name__}")
        unexpected = sorted(set(message) - set(MESSAGE_KEYS), key=str)
        if unexpected:
            raise FomoeError(f"messages[{i}] has unexpected key {unexpected[0]!r} (expected 'role' and 'content')")
        for key in MESSAGE_KEYS:
            if key not in message:
                raise FomoeError(f"messages[{i}] is missing {key!r}")
            if not isinstance(message[key], str):
                raise FomoeError(f"messages[{i}].{key} must be a string, got {type(message[key]).__name__}")
        if not message["role"]:
            raise FomoeError(f"messages[{i}].role is empty")
        checked.append({key: message[key] for key in MESSAGE_KEYS})
    return checked


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, failing at the first unsafe attribute access.

    The stock sandbox turns `x.__class__` into an undefined value that prints as "", so a probing
    template would render quietly; here it is an error.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    """One compiled template per template text (a server renders the same one for every request)."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise FomoeError(f"chat template does not compile: {_one_line(e)} (template line {e.lineno})") from None


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:  # fmt: skip
    # Jinja's own tojson HTML-escapes '<', '>', '&' and "'", which would change prompts; transformers
    # overrides it the same way.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__
