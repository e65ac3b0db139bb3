"""A2A messages and tasks as fabric calls: which capability a message asks for, its input,
and the Task that says how the call or job ended (a data artifact, or the typed error
naming the layer that failed).

``google.protobuf.Value``, which carries A2A data parts, holds every number as a double:
a data part's whole numbers are given to the capability as integers, as JSON text would
give them.
"""

from __future__ import annotations

import base64
import json
import math
import uuid
from typing import Any

from a2a.helpers import get_data_parts, new_data_part
from a2a.types import (
    Artifact,
    InvalidParamsError,
    Message,
    Part,
    Role,
    SendMessageRequest,
    Task,
    TaskState,
    TaskStatus,
)

from reach.agent.jobs import JobRecord
from reach.caller.result import CallResult
from reach.errors import (
    ContractError,
    ReachError,
)
from reach.gateways.a2a_cards import whole_numbers
from reach.gateways.failures import failure_details, layer_of

__all__ = [
    "JOB_KEY",
    "SKILL_KEYS",
    "choose_skill",
    "completed_task",
    "failed_task",
    "job_task",
    "payload_of",
]

#: the metadata keys (of the message, else of the request) that name the skill to call
SKILL_KEYS = ("skill", "capability")
#: the task metadata key of the job a task stands for
JOB_KEY = "job_id"

_JOB_STATES = {
    "accepted": TaskState.TASK_STATE_SUBMITTED,
    "running": TaskState.TASK_STATE_WORKING,
    "succeeded": TaskState.TASK_STATE_COMPLETED,
    "failed": TaskState.TASK_STATE_FAILED,
}


def choose_skill(request: SendMessageRequest, skills: list[str]) -> str:
    """The skill a message asks for: named in its metadata (``skill`` or ``capability``),
    else the agent's only one. A2A's InvalidParamsError says what was wrong."""
    for meta in (request.message.metadata, request.metadata):
        for key in SKILL_KEYS:
            if key not in meta:
                continue
            named = meta[key]
            if named in skills:
                return str(named)
            raise InvalidParamsError(
                message=f"discovery: this agent has no skill {named!r}; its skills: "
                + ", ".join(skills)
            )
    if len(skills) == 1:
        return skills[0]
    if not skills:
        raise InvalidParamsError(message="discovery: this agent serves no capability")
    raise InvalidParamsError(
        message="contract: this agent has several skills; name one in the message's"
        f" metadata as 'skill': {', '.join(skills)}"
    )


def payload_of(message: Message) -> Any:
    """The capability's input: the message's first data part, else its first text part
    read as JSON."""
    data = get_data_parts(message.parts)
    if data:
        return whole_numbers(data[0])
    for part in message.parts:
        if part.HasField("text"):
            try:
                return json.loads(part.text)
            except ValueError as exc:
                raise InvalidParamsError(
                    message=f"contract: the text part is not JSON ({exc}); send the"
                    " capability's input as a data part or as JSON text"
                ) from None
    raise InvalidParamsError(
        message="contract: the message holds no data part and no text part with the"
        " capability's input"
    )


def _jsonable(value: Any) -> Any:
    """A result as a data part can hold it: bytes as base64 text, tuples as lists, keys
    as text, NaN and infinities as null, integers a double cannot hold as text."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value if abs(value) < 2**53 else str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return str(value)


def _data_part(value: Any) -> Part:
    try:
        return new_data_part(_jsonable(value), media_type="application/json")
    except Exception as exc:  # protobuf's ParseError: nested deeper than it takes
        raise ContractError(f"the answer cannot be carried in an A2A data part: {exc}") from exc


def _agent_message(task_id: str, context_id: str, *parts: Part) -> Message:
    return Message(
        message_id=uuid.uuid4().hex,
        role=Role.ROLE_AGENT,
        task_id=task_id,
        context_id=context_id,
        parts=list(parts),
    )


def failed_task(
    task_id: str, context_id: str, capability: str, exc: ReachError, history: list[Message]
) -> Task:
    """A call that failed: rejected (the handler refused it) or failed, its status message
    naming the layer in text and as data."""
    layer = layer_of(exc)
    text = f"{layer} error calling {capability} ({type(exc).__name__}): {exc}"
    state = TaskState.TASK_STATE_REJECTED if layer == "business" else TaskState.TASK_STATE_FAILED
    status = TaskStatus(
        state=state,
        message=_agent_message(
            task_id, context_id, Part(text=text), _data_part(failure_details(exc))
        ),
    )
    return Task(id=task_id, context_id=context_id, status=status, history=history)


def _artifact(task_id: str, capability: str, value: Any) -> Artifact:
    return Artifact(artifact_id=task_id, name=capability, parts=[_data_part(value)])


def completed_task(
    task_id: str, result: CallResult, context_id: str, history: list[Message]
) -> Task:
    """A call answered: its value as the task's one data artifact, named for the
    capability; the call's id in the task's metadata."""
    meta = {
        "call_id": result.call_id,
        "agent_id": result.agent_id,
        "attempts": result.attempts,
        "latency_ms": round(result.latency_ms, 3),
    }
    return Task(
        id=task_id,
        context_id=context_id,
        status=TaskStatus(state=TaskState.TASK_STATE_COMPLETED),
        artifacts=[_artifact(task_id, result.capability, result.value)],
        history=history,
        metadata=meta,
    )


def job_task(
    task_id: str, record: JobRecord, context_id: str, history: list[Message] | None = None
) -> Task:
    """A job as a task: submitted, working, completed with its result, or failed with its
    typed error; the job's id and its call's in the task's metadata."""
    meta = {JOB_KEY: record.job_id, "agent_id": record.agent_id, "call_id": record.call_id}
    task = Task(id=task_id, context_id=context_id, history=history or [], metadata=meta)
    if record.status == "failed":
        failed = failed_task(task_id, context_id, record.capability, record.error_value(), [])
        task.status.CopyFrom(failed.status)
    else:
        task.status.state = _JOB_STATES[record.status]
    if record.status == "succeeded":
        try:
            task.artifacts.append(_artifact(task_id, record.capability, record.result))
        except ContractError as exc:
            task.status.CopyFrom(
                failed_task(task_id, context_id, record.capability, exc, []).status
            )
    return task
