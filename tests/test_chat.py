"""Chat formatting: the GGUF's own template rendered in a sandbox, ChatML fallback, clear errors."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from fomoepy.errors import FomoeError
from fomoepy.model.chat import render_chat
from fomoepy.model.gguf_file import read_metadata

ORACLE = Path(__file__).parent / "fixtures" / "oracle"
SPECIALS = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
USER = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def qwen2_template() -> str:
    return read_metadata(ORACLE / "real_qwen2.gguf")["tokenizer.chat_template"]


def test_real_qwen2_template_inserts_its_default_system_prompt(qwen2_template):
    text = render_chat(USER, template=qwen2_template, **SPECIALS)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_real_qwen2_template_keeps_a_given_system_prompt(qwen2_template):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    text = render_chat(messages, template=qwen2_template, add_generation_prompt=False, **SPECIALS)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
    )


@pytest.mark.parametrize("template", [None, ""])
def test_chatml_is_the_fallback(template):
    assert render_chat(USER, template=template, **SPECIALS) == (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_chat(USER, template=template, add_generation_prompt=False, **SPECIALS) == (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    )


def test_template_sees_special_tokens_and_transformers_whitespace_rules():
    template = "{{ bos_token }}\n{% for m in messages %}\n    {{ m.role }}:{{ m.content }}\n{% endfor %}{{ eos_token }}"
    # trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before one
    assert render_chat(USER, template=template, **SPECIALS) == "<|endoftext|>\n    user:What is 2+2?\n<|im_end|>"


def test_template_helpers_raise_exception_strftime_now_tojson():
    assert render_chat(USER, template="{{ strftime_now('%Y') }}", **SPECIALS) == str(datetime.date.today().year)
    messages = [{"role": "user", "content": "<b>&'ключ'"}]
    assert render_chat(messages, template="{{ messages | tojson }}", **SPECIALS) == (
        '[{"role": "user", "content": "<b>&\'ключ\'"}]'
    )
    with pytest.raises(FomoeError, match="chat template failed to render: only user and assistant roles"):
        render_chat(USER, template="{{ raise_exception('only user and assistant roles') }}", **SPECIALS)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__ }}",
        "{{ messages.append({'role': 'x', 'content': 'y'}) }}",
        "{{ raise_exception.__globals__ }}",
    ],
)
def test_unsafe_template_access_is_refused(template):
    with pytest.raises(FomoeError, match=r"chat template failed to render: access to attribute .* is unsafe") as info:
        render_chat(USER, template=template, **SPECIALS)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "template, message",
    [
        ("{% for m in messages %}{{ m.content }}", r"does not compile: .*endfor.* \(template line 1\)"),
        ("{{ messages[0].content + 1 }}", r"failed to render: .*"),
        ("{{ 1 / 0 }}", r"failed to render: ZeroDivisionError"),
    ],
)
def test_broken_template_is_one_clear_error(template, message):
    with pytest.raises(FomoeError, match=message) as info:
        render_chat(USER, template=template, **SPECIALS)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "messages, message",
    [
        ({"role": "user", "content": "hi"}, r"messages must be a list, got dict"),
        ([], r"messages is empty"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"content": "hi"}], r"messages\[0\] is missing 'role'"),
        ([{"role": "user"}], r"messages\[0\] is missing 'content'"),
        ([{"role": "user", "content": None}], r"messages\[0\].content must be a string, got NoneType"),
        ([{"role": "", "content": "hi"}], r"messages\[0\].role is empty"),
        ([{"role": "user", "content": "hi", "name": "x"}], r"messages\[0\] has unexpected key 'name'"),
    ],
)
def test_bad_messages_are_refused(messages, message):
    with pytest.raises(FomoeError, match=message):
        render_chat(messages, template=None, **SPECIALS)


@pytest.mark.parametrize("template", [5, ["{{ x }}"], b"{{ x }}"])
def test_a_template_that_is_not_a_string_names_its_key(template):
    # (GGUF metadata can hold any value type under tokenizer.chat_template)
    with pytest.raises(FomoeError, match=r"the model's tokenizer.chat_template must be a string, got (int|list|bytes)$"):
        render_chat(USER, template=template, **SPECIALS)


def test_template_cannot_change_the_callers_messages():
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(FomoeError):
        render_chat(messages, template="{{ messages[0].update({'content': 'x'}) }}", **SPECIALS)
    assert messages == [{"role": "user", "content": "hi"}]
