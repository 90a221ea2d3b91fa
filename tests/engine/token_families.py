"""Tokenizers whose added tokens are laid out as the chat families' are, on top of a small trained BPE.

    tokenizer = with_family_tokens(hf_tokenizer, "qwen2.5")   # a copy with the family's added tokens

    qwen2.5  `<|im_start|>`, `<|im_end|>` special; `<tool_call>`, `</tool_call>` added but not special (as
             Qwen2.5's own tokenizer.json has them: transformers decodes them as text)
    hermes   the same four, all special (Hermes 2 Pro marks its tool tags special)
    llama3   `<|start_header_id|>`, `<|end_header_id|>`, `<|eot_id|>`, `<|python_tag|>`, all special

Each family adds FAMILY_TOKENS tokens, so one model's vocabulary fits all three.
"""

from __future__ import annotations

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

FAMILIES: dict[str, list[tuple[str, bool]]] = {  # (content, special)
    "qwen2.5": [("<|im_start|>", True), ("<|im_end|>", True), ("<tool_call>", False), ("</tool_call>", False)],
    "hermes": [("<|im_start|>", True), ("<|im_end|>", True), ("<tool_call>", True), ("</tool_call>", True)],
    "llama3": [("<|start_header_id|>", True), ("<|end_header_id|>", True), ("<|eot_id|>", True),
               ("<|python_tag|>", True)],
}
FAMILY_TOKENS = 4


def with_family_tokens(base: HFTokenizer, family: str) -> HFTokenizer:
    """A copy of `base` with `family`'s added tokens after its vocabulary."""
    tokenizer = HFTokenizer.from_str(base.to_str())
    for content, special in FAMILIES[family]:
        token = AddedToken(content, special=special, normalized=False)
        added = tokenizer.add_special_tokens([token]) if special else tokenizer.add_tokens([token])
        assert added == 1, f"{content} is already in the vocabulary"
    return tokenizer


def added_ids(tokenizer: HFTokenizer, family: str) -> dict[str, int]:
    return {content: tokenizer.token_to_id(content) for content, _ in FAMILIES[family]}
