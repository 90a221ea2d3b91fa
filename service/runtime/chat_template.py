"""The model's chat template: messages -> the prompt text, rendered as transformers renders it.

    template = ChatTemplate.from_bundle(bundle_dir)     # None: the model has no chat template
    text = template.render(messages, add_generation_prompt=True, tools=None)   # tools: OpenAI's function dicts
    ids = tokenizer.encode(text, add_special_tokens=False)   # the template wrote the BOS if it wants one

The template comes from the checkpoint the bundle was imported from: `chat_template.jinja`, or the
`chat_template` of `tokenizer_config.json` (a string, or a list of named templates whose `default` is
used). It is rendered with Jinja2 in a sandbox, in the environment transformers'
`apply_chat_template` gives it: `trim_blocks` and `lstrip_blocks`, the loop controls, the
`{% generation %}` block (transformers marks the assistant's tokens with it; here it renders its body),
a `tojson` that keeps non-ASCII text, `raise_exception`, `strftime_now`, `dict`, a `namespace` that
refuses underscore names, and the special tokens (`bos_token`, `eos_token`, ...) as variables. A
message's reasoning reaches the template as transformers passes it: under `reasoning_content` and
`thinking` both, whichever of `reasoning_content`, `thinking`, `reasoning` it came in. Further
variables (`enable_thinking`, ...) are the caller's `**variables`. Chat templates are code from the
checkpoint's author: the sandbox keeps them from reaching Python internals.
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
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is the one templates read


class ChatTemplateError(ValueError):
    """The template refused the conversation (its `raise_exception`) or failed to render it."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _dict(*args: Any, **kwargs: Any) -> dict:
    return dict(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing the underscore names through which a template could reach internals."""

    def __init__(*args: Any, **kwargs: Any):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers records where the assistant's text lies; the
    text itself renders as if the tags were not there."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _dict
    env.globals["namespace"] = _Namespace
    return env


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    """A message with its reasoning under `reasoning_content` and `thinking` (gpt-oss templates read that)."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


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
        messages = [_with_reasoning_aliases(m) if isinstance(m, dict) else m for m in messages]
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                         documents=None, **{**self.special_tokens, **variables})
        except jinja2.TemplateError as e:
            raise ChatTemplateError(str(e)) from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ArithmeticError) as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
