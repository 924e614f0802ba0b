"""A bounded log of what became of each engine request, shared by the model stages.

Each model stage keeps the newest records (prompt, outcome, tokens, ...) for
inspection by operators and tests; the first outcome a running request gets
(finished, released, cancelled, failed) is the one that sticks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, TypeVar


class Tracked(Protocol):
    request_id: str
    outcome: str


R = TypeVar("R", bound=Tracked)


class RequestLog(OrderedDict[str, R]):
    """Request id -> record, oldest first, at most ``keep`` of them."""

    def __init__(self, keep: int) -> None:
        super().__init__()
        self.keep = keep

    def add(self, record: R) -> R:
        self[record.request_id] = record
        while len(self) > self.keep:
            self.popitem(last=False)
        return record

    def note(self, request_ids: Sequence[str], outcome: str) -> None:
        """Settle the still-running requests among ``request_ids`` with ``outcome``."""
        for request_id in request_ids:
            record = self.get(request_id)
            if record is not None and record.outcome == "running":
                record.outcome = outcome
