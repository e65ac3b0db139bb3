"""The A2A request handler of ``reach a2a``: ``SendMessage`` (0.3: ``message/send``) as a
fabric call, ``GetTask`` (``tasks/get``) as a look at the task it made.

A message to an agent calls one of its skills (``reach.gateways.a2a_tasks.choose_skill``)
with ``ReachClient.call``: the capability's best instance, with retries, the gateway's
clearance and its audit. A sync capability's call ends the task at once (completed, or
failed naming the layer). An async-mode capability's call is a job: the gateway waits up
to ``job_wait`` seconds for it to finish (not at all when the request asks to return
immediately), and ``GetTask`` reads the job's record from then on.

Every task gets a fresh random id (``reach.gateways.a2a_store``), the call id and job id
going in its metadata, and is kept for ``GetTask`` in a ``TaskStore``, bounded in count,
bytes and time, as its caller's (``owner_of``): ``GetTask`` answers only the caller that
sent the message, and anyone else gets TaskNotFoundError, as for an id never issued. A
job is read only through the task id this gateway gave for it.

Streaming, cancelling, listing tasks and push notifications are not offered (the cards
say so); requests for them get A2A's errors for that.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncGenerator, Callable

from a2a.server.context import ServerCallContext
from a2a.server.request_handlers.request_handler import RequestHandler
from a2a.types import (
    AgentCard,
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    ExtendedAgentCardNotConfiguredError,
    GetExtendedAgentCardRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    InternalError,
    InvalidParamsError,
    ListTaskPushNotificationConfigsRequest,
    ListTaskPushNotificationConfigsResponse,
    ListTasksRequest,
    ListTasksResponse,
    Message,
    PushNotificationNotSupportedError,
    SendMessageRequest,
    SubscribeToTaskRequest,
    Task,
    TaskPushNotificationConfig,
    UnsupportedOperationError,
)
from a2a.utils.proto_utils import validate_proto_required_fields
from a2a.utils.task import apply_history_length, validate_history_length

from reach.agent.jobs import JobHandle
from reach.caller.client import ReachClient
from reach.errors import NotFound, ReachError
from reach.gateways.a2a_cards import agents_of, capabilities_of, runs_as_job
from reach.gateways.a2a_store import NOT_KEPT_KEY, TaskStore, new_task_id, owner_of
from reach.gateways.a2a_tasks import (
    JOB_KEY,
    choose_skill,
    completed_task,
    failed_task,
    job_task,
    payload_of,
)
from reach.gateways.failures import layer_of
from reach.wire.models import Instance

__all__ = ["AGENT_KEY", "FabricRequestHandler"]

#: the call context's key for the agent name of the request's path
AGENT_KEY = "reach.agent.agent"


class FabricRequestHandler(RequestHandler):
    """A2A requests to the fabric's agents, through one ``ReachClient``; ``tasks`` keeps
    the tasks for ``GetTask`` (by default a ``TaskStore`` of the default bounds)."""

    def __init__(
        self, client: ReachClient, *, job_wait: float = 30.0, tasks: TaskStore | None = None
    ) -> None:
        self._client = client
        self.job_wait = job_wait
        self.tasks = tasks if tasks is not None else TaskStore()
        #: the card of an agent (its name) for the caller of a context, with the skills
        #: that caller may call; None: extended cards are not served
        self.extended_card: Callable[[str, ServerCallContext], AgentCard | None] | None = None

    def instances(self, agent: str) -> list[Instance]:
        """The live instances of agent ``agent``; none is A2A's InvalidParamsError."""
        found = agents_of(self._client.routes.find()).get(agent)
        if not found:
            raise InvalidParamsError(message=f"discovery: no agent named {agent!r} is live")
        return found

    async def on_message_send(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> Task | Message:
        validate_proto_required_fields(params)
        owner = owner_of(context)
        instances = self.instances(str(context.state.get(AGENT_KEY, "")))
        capability = choose_skill(params, [cap.name for cap in capabilities_of(instances)])
        payload = payload_of(params.message)
        context_id = params.message.context_id or uuid.uuid4().hex
        history = [params.message]
        task_id = new_task_id()
        job = runs_as_job(instances, capability)
        try:
            if job and params.configuration.return_immediately:
                handle = await self._client.submit(capability, payload)
                return await self._job(owner, task_id, handle, context_id, history, wait=0)
            result = await self._client.call(capability, payload)
            if result.job is not None:
                return await self._job(
                    owner, task_id, result.job, context_id, history, wait=self.job_wait
                )
            task = completed_task(task_id, result, context_id, history)
        except ReachError as exc:
            task = failed_task(task_id, context_id, capability, exc, history)
        self.tasks.put(owner, task)
        return task

    async def _job(
        self,
        owner: str,
        task_id: str,
        handle: JobHandle,
        context_id: str,
        history: list[Message],
        *,
        wait: float,
    ) -> Task:
        """The job's task once it is done or ``wait`` seconds have passed, whichever is
        first: its record says which. What is kept is the job's id, not its state: a
        later ``GetTask`` reads the record again."""
        if wait > 0:
            # the outcome, an error included, is read from the record below
            with contextlib.suppress(ReachError):
                await handle.result(timeout=wait)
        try:
            record = await handle.status()
        except ReachError as exc:  # unreadable (credentials without the jobs role, say)
            task = failed_task(task_id, context_id, handle.capability, exc, history)
            self.tasks.put(owner, task)
            return task
        task = job_task(task_id, record, context_id, history)
        kept = Task(id=task_id, context_id=context_id, history=history)
        kept.metadata.update(task.metadata)
        self.tasks.put(owner, kept)
        return task

    async def on_get_task(self, params: GetTaskRequest, context: ServerCallContext) -> Task | None:
        validate_proto_required_fields(params)
        validate_history_length(params)
        kept = self.tasks.get(owner_of(context), params.id)
        if kept is None:
            return None
        if JOB_KEY not in kept.metadata:
            return apply_history_length(kept, params)
        job_id = str(kept.metadata[JOB_KEY])
        try:
            handle = await self._client.job(job_id)
            record = await handle.status()
        except NotFound:  # past the job store's retention
            return None
        except ReachError as exc:
            raise InternalError(message=f"{layer_of(exc)} error reading the job: {exc}") from None
        task = job_task(kept.id, record, kept.context_id, list(kept.history))
        if NOT_KEPT_KEY in kept.metadata:
            task.metadata.update(kept.metadata)
        return apply_history_length(task, params)

    async def on_list_tasks(
        self, params: ListTasksRequest, context: ServerCallContext
    ) -> ListTasksResponse:
        raise UnsupportedOperationError(
            message="tasks are fabric calls and jobs; `reach audit tail` lists the calls"
        )

    async def on_cancel_task(
        self, params: CancelTaskRequest, context: ServerCallContext
    ) -> Task | None:
        raise UnsupportedOperationError(
            message="a fabric call is not cancelled once sent, and a job runs to its end"
        )

    async def on_message_send_stream(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> AsyncGenerator[Task]:
        raise UnsupportedOperationError(message="the fabric's agents do not stream (see the card)")
        yield  # an async generator, as the interface declares

    async def on_subscribe_to_task(
        self, params: SubscribeToTaskRequest, context: ServerCallContext
    ) -> AsyncGenerator[Task]:
        raise UnsupportedOperationError(message="the fabric's agents do not stream (see the card)")
        yield  # an async generator, as the interface declares

    async def on_create_task_push_notification_config(
        self, params: TaskPushNotificationConfig, context: ServerCallContext
    ) -> TaskPushNotificationConfig:
        raise PushNotificationNotSupportedError

    async def on_get_task_push_notification_config(
        self, params: GetTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> TaskPushNotificationConfig:
        raise PushNotificationNotSupportedError

    async def on_list_task_push_notification_configs(
        self, params: ListTaskPushNotificationConfigsRequest, context: ServerCallContext
    ) -> ListTaskPushNotificationConfigsResponse:
        raise PushNotificationNotSupportedError

    async def on_delete_task_push_notification_config(
        self, params: DeleteTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> None:
        raise PushNotificationNotSupportedError

    async def on_get_extended_agent_card(
        self, params: GetExtendedAgentCardRequest, context: ServerCallContext
    ) -> AgentCard:
        agent = str(context.state.get(AGENT_KEY, ""))
        card = self.extended_card(agent, context) if self.extended_card is not None else None
        if card is None:
            raise ExtendedAgentCardNotConfiguredError
        return card
