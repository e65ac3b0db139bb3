"""The tasks ``reach a2a`` keeps for ``GetTask``: each one its caller's, under unguessable
ids, bounded in count, in bytes and in time.

A task's id is 128 random bits, never derived from the call it stands for (a call id, a
job id), so one answer says nothing of another's id. A task is kept with its owner, and
``get`` answers only that owner: anyone else is told nothing, exactly as for an id that
was never issued.

What is kept is measured as protobuf serializes it (``Task.ByteSize()``, plus the owner's
name). The store holds at most ``max_tasks`` tasks and ``max_bytes`` bytes, the oldest
going first, and drops a task ``ttl`` seconds after it was kept. A task larger than
``max_task_bytes`` is kept without its history (the input messages), then if need be
without its artifacts and status message, and its metadata says what was left out and
why; the answer to the message itself carried everything.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass

from a2a.server.context import ServerCallContext
from a2a.types import Task

from reach.clock import Clock, system_clock
from reach.errors import ConfigurationError

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_TASKS",
    "DEFAULT_TTL",
    "ID_BYTES",
    "NOT_KEPT_KEY",
    "TaskStore",
    "new_task_id",
    "owner_of",
]

#: the bytes of every kept task together
DEFAULT_MAX_BYTES = 16 * 1024 * 1024
#: how many tasks are kept
DEFAULT_MAX_TASKS = 1024
#: how long a task is kept, in seconds
DEFAULT_TTL = 3600.0
#: a task id's random bytes
ID_BYTES = 16
#: the task metadata key that lists the parts of a task that were not kept
NOT_KEPT_KEY = "not_kept"
_NOT_KEPT_WHY = "not_kept_reason"
#: what is left out of a task too large to keep whole, in this order
_PARTS = ("history", "artifacts", "status.message")


def new_task_id() -> str:
    """A fresh task id: ``ID_BYTES`` random bytes as hex."""
    return secrets.token_hex(ID_BYTES)


def owner_of(context: ServerCallContext) -> str:
    """Who a request's tasks belong to: its authenticated user's name, else the empty
    name (a gateway without login has one caller, whoever reaches its port)."""
    return context.user.user_name if context.user.is_authenticated else ""


@dataclass(slots=True)
class _Kept:
    owner: str
    task: Task
    size: int
    expires: float


class TaskStore:
    """Tasks by id, each its owner's, bounded as the module says."""

    def __init__(
        self,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_tasks: int = DEFAULT_MAX_TASKS,
        max_task_bytes: int | None = None,
        ttl: float = DEFAULT_TTL,
        clock: Clock = system_clock,
    ) -> None:
        """``max_task_bytes``: by default a sixteenth of ``max_bytes``, so that a few
        large tasks cannot push out every other."""
        self.max_bytes = max_bytes
        self.max_tasks = max_tasks
        self.max_task_bytes = max_bytes // 16 if max_task_bytes is None else max_task_bytes
        self.ttl = ttl
        self._clock = clock
        if min(max_bytes, max_tasks, self.max_task_bytes) < 1 or ttl <= 0:
            raise ConfigurationError("the A2A task store's bounds must be positive")
        if self.max_task_bytes > max_bytes:
            raise ConfigurationError(
                f"the A2A task store's per-task bound ({self.max_task_bytes} bytes) is"
                f" above its total ({max_bytes} bytes)"
            )
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._kept)

    @property
    def bytes(self) -> int:
        """The measured size of every kept task together."""
        self._expire()
        return self._bytes

    def put(self, owner: str, task: Task) -> Task:
        """Keep ``task`` (by its id) for ``owner``, in place of any earlier one of that id;
        what is kept, which is ``task`` itself unless it was too large to keep whole."""
        self.drop(task.id)
        kept = self._within_bound(task, owner)
        size = kept.ByteSize() + len(owner.encode())
        self._kept[task.id] = _Kept(owner, kept, size, self._clock.monotonic() + self.ttl)
        self._bytes += size
        self._expire()
        while self._bytes > self.max_bytes or len(self._kept) > self.max_tasks:
            self._pop_oldest()
        return kept

    def get(self, owner: str, task_id: str) -> Task | None:
        """The task ``task_id`` if ``owner`` put it and it is still kept; else None,
        whether it never existed, is gone or is another owner's."""
        self._expire()
        kept = self._kept.get(task_id)
        if kept is None or not secrets.compare_digest(kept.owner.encode(), owner.encode()):
            return None
        return kept.task

    def drop(self, task_id: str) -> bool:
        """Forget task ``task_id`` (a cancelled one, say); whether it was kept."""
        kept = self._kept.pop(task_id, None)
        if kept is None:
            return False
        self._bytes -= kept.size
        return True

    def _within_bound(self, task: Task, owner: str) -> Task:
        if task.ByteSize() + len(owner.encode()) <= self.max_task_bytes:
            return task
        trimmed = Task()
        trimmed.CopyFrom(task)
        left_out: list[str] = []
        for part in _PARTS:
            if part == "history":
                trimmed.ClearField("history")
            elif part == "artifacts":
                trimmed.ClearField("artifacts")
            else:
                trimmed.status.ClearField("message")
            left_out.append(part)
            trimmed.metadata[NOT_KEPT_KEY] = left_out
            trimmed.metadata[_NOT_KEPT_WHY] = (
                f"the task is larger than the {self.max_task_bytes} bytes the gateway keeps"
                " of one task for GetTask; the answer to the message carried it whole"
            )
            if trimmed.ByteSize() + len(owner.encode()) <= self.max_task_bytes:
                break
        return trimmed

    def _expire(self) -> None:
        # kept in the order they were put, all with one ttl: the oldest expires first
        now = self._clock.monotonic()
        while self._kept and next(iter(self._kept.values())).expires <= now:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        _, kept = self._kept.popitem(last=False)
        self._bytes -= kept.size
