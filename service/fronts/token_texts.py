"""Each token's own text, decoded once, as each front reports it in logprobs.

    texts = TokenTexts(tokenizer)
    texts(token_id)          # gRPC: the tokenizer's decoding of the token alone
    texts.openai(token_id)   # OpenAI: (its name, its bytes); a token that is part of a UTF-8 character is
                             # named `bytes:\\xe2\\x80`, so two such tokens never share a name
    texts.openai_logprob(token_id, logprob, top)   # a token's entry in OpenAI's chat and Responses logprobs
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from service.runtime.tokenizer import Tokenizer


class TokenTexts:
    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._openai: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text

    def openai(self, token_id: int) -> tuple[str, list[int]]:
        found = self._openai.get(token_id)
        if found is None:
            raw = self._tokenizer.token_bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            found = self._openai[token_id] = (text, list(raw))
        return found

    def openai_logprob(self, token_id: int, logprob: float,
                       top: Iterable[tuple[int, float]] | None = None) -> dict[str, Any]:
        """The token, its bytes and logprob, and its most likely alternatives the same way."""
        return {**self._openai_entry(token_id, logprob),
                "top_logprobs": [self._openai_entry(t, v) for t, v in top or ()]}

    def _openai_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self.openai(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}
