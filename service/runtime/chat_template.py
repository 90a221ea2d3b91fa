"""The model's chat template: messages -> the prompt text, rendered as transformers renders it.

    template = ChatTemplate.from_bundle(bundle_dir)     # None: the model has no chat template
    text = template.render(messages, add_generation_prompt=True, tools=None)   # tools: OpenAI's function dicts
    ids = tokenizer.encode(text, add_special_tokens=False)   # the template wrote the BOS if it wants one

The template comes from the checkpoint the bundle was imported from: `chat_template.jinja`, or the
`chat_template` of `tokenizer_config.json` (a string, or a list of named templates whose `default` is
used). It is rendered with Jinja2 in a sandbox, in the environment transformers'
`apply_chat_template` gives it: `trim_blocks` and `lstrip_blocks`, the loop controls, a `tojson`
that keeps non-ASCII text, `raise_exception`, `strftime_now`, and the special tokens
(`bos_token`, `eos_token`, ...) as variables. Chat templates are code from the checkpoint's author:
the sandbox keeps them from reaching Python internals.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template refused the conversation (its `raise_exception`) or failed to render it."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template does not parse: {e.message} (line {e.lineno})") from None

    @classmethod
    def from_bundle(cls, directory: str | Path) -> ChatTemplate | None:
        """The template of a bundle (or model directory), or None when it has none."""
        directory = Path(directory)
        config: dict[str, Any] = {}
        if (directory / TOKENIZER_CONFIG_FILE).is_file():
            config = json.loads((directory / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8"))
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if (directory / TEMPLATE_FILE).is_file():
            source = (directory / TEMPLATE_FILE).read_text(encoding="utf-8")
        if not isinstance(source, str) or not source.strip():
            return None
        tokens = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None}
        return cls(source, tokens)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, **variables: Any) -> str:
        """The prompt text for `messages` (plain dicts: role, content, ...) and `tools` (`{"type": "function",
        "function": {...}}` dicts, or None as transformers passes no tools); raises ChatTemplateError."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                         documents=None, **{**self.special_tokens, **variables})
        except jinja2.TemplateError as e:
            raise ChatTemplateError(str(e)) from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
