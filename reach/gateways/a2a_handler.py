"""The A2A request handler of ``reach a2a``: ``SendMessage`` (0.3: ``message/send``) as a
fabric call, ``GetTask`` (``tasks/get``) as a look at a job.

A message to an agent calls one of its skills (``reach.gateways.a2a_tasks.choose_skill``)
with ``ReachClient.call``: the capability's best instance, with retries, the gateway's
clearance and its audit. A sync capability's call ends the task at once (completed, or
failed naming the layer). An async-mode capability's call is a job, the task's id its
job id: the gateway waits up to ``job_wait`` seconds for it to finish (not at all when
the request asks to return immediately), and ``GetTask`` reads the job's record from
then on. The tasks of sync calls are kept for ``GetTask`` too, the last ``MAX_TASKS`` of
them, in this process.

Streaming, cancelling, listing tasks and push notifications are not offered (the cards
say so); requests for them get A2A's errors for that.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator

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

from reach.client import ReachClient
from reach.errors import NotFound, PermissionDenied, ReachError
from reach.gateways.a2a_cards import agents_of, capabilities_of, runs_as_job
from reach.gateways.a2a_tasks import (
    choose_skill,
    completed_task,
    failed_task,
    job_task,
    payload_of,
)
from reach.gateways.failures import layer_of
from reach.jobs import JobHandle
from reach.models import Instance

__all__ = ["AGENT_KEY", "MAX_TASKS", "FabricRequestHandler"]

#: the call context's key for the agent name of the request's path
AGENT_KEY = "reach.agent"
#: the tasks of sync calls kept for ``GetTask``
MAX_TASKS = 1024

#: what a job id looks like (``reach.jobs.new_job_id``): anything else is no job
_JOB_ID = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)+")


class FabricRequestHandler(RequestHandler):
    """A2A requests to the fabric's agents, through one ``ReachClient``."""

    def __init__(self, client: ReachClient, *, job_wait: float = 30.0) -> None:
        self._client = client
        self.job_wait = job_wait
        self._tasks: OrderedDict[str, Task] = OrderedDict()
        #: a job's context id, given when it was submitted (a job record keeps none)
        self._contexts: OrderedDict[str, str] = OrderedDict()

    def instances(self, agent: str) -> list[Instance]:
        """The live instances of agent ``agent``; none is A2A's InvalidParamsError."""
        found = agents_of(self._client.routes.find()).get(agent)
        if not found:
            raise InvalidParamsError(message=f"discovery: no agent named {agent!r} is live")
        return found

    def _keep(self, task: Task) -> Task:
        self._tasks[task.id] = task
        self._tasks.move_to_end(task.id)
        while len(self._tasks) > MAX_TASKS:
            self._tasks.popitem(last=False)
        return task

    async def on_message_send(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> Task | Message:
        validate_proto_required_fields(params)
        instances = self.instances(str(context.state.get(AGENT_KEY, "")))
        capability = choose_skill(params, [cap.name for cap in capabilities_of(instances)])
        payload = payload_of(params.message)
        context_id = params.message.context_id or uuid.uuid4().hex
        history = [params.message]
        job = runs_as_job(instances, capability)
        try:
            if job and params.configuration.return_immediately:
                handle = await self._client.submit(capability, payload)
                return await self._job(handle, context_id, history, wait=0)
            result = await self._client.call(capability, payload)
            if result.job is not None:
                return await self._job(result.job, context_id, history, wait=self.job_wait)
            return self._keep(completed_task(result, context_id, history))
        except ReachError as exc:
            task_id = uuid.uuid4().hex
            return self._keep(failed_task(task_id, context_id, capability, exc, history))

    async def _job(
        self, handle: JobHandle, context_id: str, history: list[Message], *, wait: float
    ) -> Task:
        """The job's task once it is done or ``wait`` seconds have passed, whichever is
        first: its record says which."""
        self._contexts[handle.job_id] = context_id
        while len(self._contexts) > MAX_TASKS:
            self._contexts.popitem(last=False)
        if wait > 0:
            # the outcome, an error included, is read from the record below
            with contextlib.suppress(ReachError):
                await handle.result(timeout=wait)
        try:
            record = await handle.status()
        except ReachError as exc:  # unreadable (credentials without the jobs role, say)
            return failed_task(handle.job_id, context_id, handle.capability, exc, history)
        return job_task(record, context_id, history)

    async def on_get_task(self, params: GetTaskRequest, context: ServerCallContext) -> Task | None:
        validate_proto_required_fields(params)
        kept = self._tasks.get(params.id)
        if kept is not None:
            return kept
        if not _JOB_ID.fullmatch(params.id):
            return None
        try:
            handle = await self._client.job(params.id)
            record = await handle.status()
        except (NotFound, PermissionDenied):  # none, or another client's
            return None
        except ReachError as exc:
            raise InternalError(message=f"{layer_of(exc)} error reading the job: {exc}") from None
        return job_task(record, self._contexts.get(params.id, params.id))

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
        raise ExtendedAgentCardNotConfiguredError
