"""Types of reach/audit/_columns.c: ``reach.audit.columns.Columns`` in C."""

from typing import Any

from reach.audit.columns import ColumnLists

class Columns:
    @property
    def size(self) -> int: ...
    @property
    def full(self) -> bool: ...
    def __len__(self) -> int: ...
    def add(
        self,
        ts: float,
        call_id: str,
        trace_id: str,
        caller: str,
        caller_agent: str | None,
        callee: str,
        latency_ms: float,
        candidates: tuple[str, ...],
        n_candidates: int,
        score: float | None,
        attempt_latency_ms: float,
        /,
    ) -> None: ...
    def encode(self, capability: str, /) -> dict[str, Any]: ...
    def columns(self) -> ColumnLists: ...
