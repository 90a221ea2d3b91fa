"""A chat's prompt: its messages rendered by the model's chat template and tokenized, the one way both
/v1/chat/completions and /tokenize do it.

    text, ids = render_prompt(template, prompt, conversation, tools, model)   # blocking: the template runs
"""

from __future__ import annotations

from typing import Any

from service.engine.errors import InvalidRequest
from service.fronts.http.openai_schema import ChatPrompt
from service.fronts.validation import ModelFacts, check_text_fits
from service.runtime.chat_template import ChatTemplate, ChatTemplateError


def render_prompt(template: ChatTemplate, prompt: ChatPrompt, conversation: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None, model: ModelFacts,
                  add_special_tokens: bool = False) -> tuple[str, list[int]]:
    """The prompt text of `conversation` (`prompt.conversation()`) and `tools` (None: the template gets none), and
    its token ids: the template writes any BOS itself, so the tokenizer adds special tokens only when asked.
    With `continue_final_message` the text ends where the final message's content does, as transformers cuts it.
    Raises InvalidRequest naming `messages` when the template refuses them or the text cannot fit the model."""
    try:
        text = template.render(conversation, add_generation_prompt=prompt.add_generation_prompt, tools=tools,
                               **prompt.template_variables())
    except ChatTemplateError as e:
        raise InvalidRequest("messages", f"the model's chat template refused them: {e}") from None
    if prompt.continue_final_message:
        text = _through_final_message(text, conversation[-1].get("content") or "")
    check_text_fits("messages", text, model)
    return text, model.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _through_final_message(text: str, content: str) -> str:
    """`text` up to the end of the final message's content, where its template closed it: the trailing whitespace
    the content ends with stays when the rendered text has it too (templates may strip it)."""
    core = content.strip()
    if not core:
        raise InvalidRequest("continue_final_message", "the final message has no content to continue")
    at = text.rfind(core)
    if at < 0:
        raise InvalidRequest("continue_final_message", "the chat template did not write the final message's content "
                             "as it is, so there is no place to continue it from")
    whole = content.lstrip()
    end = at + (len(whole) if text.startswith(whole, at) else len(core))
    return text[:end]
