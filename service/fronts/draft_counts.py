"""A call's speculative decoding counts for its usage, on every front: each sequence's last event carries its
own (`TokenEvent.draft_tokens`, `accepted_draft_tokens`), and a call sums them over its sequences.

    drafts = DraftCounts()
    drafts.add(events)                  # every event of the call, as it arrives
    drafts.proposed, drafts.accepted, drafts.rejected

All three stay 0 when the server runs without speculative decoding (docs/speculative.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from service.engine.request import TokenEvent


@dataclass
class DraftCounts:
    proposed: int = 0  # draft tokens the model checked, over the call's sequences so far ended
    accepted: int = 0  # of those, the ones it kept: they are among the completion tokens

    @property
    def rejected(self) -> int:
        """Draft tokens the model checked and did not keep."""
        return self.proposed - self.accepted

    def add(self, events: Iterable[TokenEvent]) -> None:
        for event in events:
            if event.finish_reason is not None:
                self.proposed += event.draft_tokens
                self.accepted += event.accepted_draft_tokens
