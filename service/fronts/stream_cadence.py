"""How many tokens a stream message carries, and how long it waits for them: the first token goes at
once; then a message waits until its oldest token is `stream_interval_ms` old and it holds
`stream_tokens` tokens, never longer than `stream_max_delay_ms`. With `stream_tokens` 0 the count
adapts: 1 while few sequences run; beyond STREAM_FANOUT, enough that the whole server sends about
STREAM_FANOUT messages per model step (each message costs the server and the client CPU that the
model would use).
"""

from __future__ import annotations

from service.engine.async_engine import RequestStream
from service.engine.request import TokenEvent
from service.settings import ServerSettings

STREAM_FANOUT = 8  # adaptive streaming: about this many stream messages per model step in all
MAX_TOKENS_PER_MESSAGE = 16


class StreamCadence:
    def __init__(self, settings: ServerSettings):
        self.fixed_tokens = settings.stream_tokens
        self.min_age_s = settings.stream_interval_ms / 1000
        self.max_delay_s = settings.stream_max_delay_ms / 1000

    def tokens_per_message(self, running_sequences: int) -> int:
        if self.fixed_tokens:
            return self.fixed_tokens
        return min(-(-running_sequences // STREAM_FANOUT), MAX_TOKENS_PER_MESSAGE) or 1

    async def next_message(self, stream: RequestStream, running_sequences: int) -> list[TokenEvent]:
        """A stream's next events, gathered as above (the first token goes at once)."""
        if not stream.timing.first_token_at:
            return await stream.next_batch()
        return await stream.next_batch(self.tokens_per_message(running_sequences), self.min_age_s,
                                       self.max_delay_s)
