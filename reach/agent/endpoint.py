"""A capability as an agent serves it: its handler and compiled contract, the handler's
argument decoded from a request, and what the caller hears when a call fails."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pydantic import BaseModel, ValidationError

from reach.errors import BusinessError, ContractError, ReachError, RemoteError
from reach.security.tokens import call_audience
from reach.wire import codec
from reach.wire.contract import Validator, compile_schema
from reach.wire.models import Capability, format_validation_error

__all__ = [
    "Endpoint",
    "Failure",
    "Handler",
    "ServedStats",
    "decode_input",
    "endpoint_for",
    "failure_of",
]

Handler = Callable[[Any], Awaitable[Any]]


def _model_of(annotation: Any) -> type[BaseModel] | None:
    return (
        annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    )


class ServedStats:
    """What an endpoint served, counted by the call path as it serves (``$SRV.STATS``,
    ``reach.agent.microsvc``): plain attributes bumped in place, read when someone asks."""

    def __init__(self) -> None:
        #: calls received: each call of a batch, the refused ones too
        self.requests = 0
        #: calls answered with an error of any kind (refused, denied, failed); a repeat
        #: answered with the first call's reply counts as a request only
        self.errors = 0
        #: calls refused for their token or clearance (also counted in ``errors``)
        self.denied = 0
        #: seconds spent on the calls that ran, from admission to their reply
        self.busy_sec = 0.0
        #: the code and description of the last error answered
        self.last_code = ""
        self.last_description = ""


@dataclass(frozen=True)
class Endpoint:
    """One capability as served: its handler and compiled contract."""

    capability: Capability
    handler: Handler
    input_validator: Validator
    output_validator: Validator
    input_model: type[BaseModel] | None = None
    output_model: type[BaseModel] | None = None
    #: the audience of the tokens its calls carry (``call_audience``; ``endpoint_for``
    #: sets it)
    audience: str = ""
    #: it runs as a job (an async-mode capability): a call is answered with the job's id
    job: bool = False
    #: what it served: shared by the copies made for its subjects (``dataclasses.replace``)
    stats: ServedStats = field(default_factory=ServedStats, compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.capability.name


def endpoint_for(capability: Capability, handler: Handler, *, job: bool = False) -> Endpoint:
    """Compile a capability's contract; pydantic models in the handler's signature win.
    ``job``: it runs as a job (its mode, or its agent's, is async)."""
    try:
        hints = typing.get_type_hints(handler)
    except Exception:
        hints = {}
    params = [p for p in inspect.signature(handler).parameters.values()]
    input_model = _model_of(hints.get(params[0].name)) if params else None
    output_model = _model_of(hints.get("return"))
    input_schema = capability.input_schema
    if input_model is not None and not input_schema:
        input_schema = input_model.model_json_schema()
    output_schema = capability.output_schema
    if output_model is not None and not output_schema:
        output_schema = output_model.model_json_schema()
    return Endpoint(
        capability=capability.model_copy(
            update={"input_schema": input_schema, "output_schema": output_schema}
        ),
        handler=handler,
        input_validator=compile_schema(input_schema),
        output_validator=compile_schema(output_schema),
        input_model=input_model,
        output_model=output_model,
        audience=call_audience(capability.name),
        job=job,
    )


class Failure(NamedTuple):
    """A failed call as its caller hears it: the reply's kind, code and description, and
    for a contract error the field at fault (the reply's ``err.path``)."""

    kind: str
    code: str
    description: str
    path: str = ""


def failure_of(capability: str, exc: ReachError) -> Failure:
    """What the caller hears of a ReachError the handler of ``capability`` raised: its own
    (an Unavailable, a BusinessError it chose) as it is; one of a call it made and did not
    handle as an internal error of this handler, whatever its kind (``ReachError.dependency``),
    except a business refusal, which it passes on."""
    if exc.dependency is not None and not isinstance(exc, BusinessError):
        return Failure(
            "internal",
            "dependency_failed",
            f"{capability}: its call to {exc.dependency} failed: {type(exc).__name__}: {exc}",
        )
    if isinstance(exc, RemoteError):
        return Failure(exc.kind, exc.code, exc.description)
    path = exc.path if isinstance(exc, ContractError) else ""
    if isinstance(exc, ContractError) and exc.rule:
        # the rule it names, as the caller's own
        return Failure(exc.kind, exc.rule, str(exc), path)
    return Failure(exc.kind, type(exc).__name__, str(exc), path)


def decode_input(endpoint: Endpoint, body: bytes) -> Any:
    """The handler's argument from the request body, or a contract Failure."""
    try:
        payload = codec.decode(body, checked=False)
        plain = codec.check_value(payload)  # within the default limits, or a CodecError
        endpoint.input_validator.validate(payload, plain=plain)
        if endpoint.input_model is not None:
            return endpoint.input_model.model_validate(payload)
        return payload
    except ContractError as exc:
        return Failure("contract", exc.rule or "input", str(exc), exc.path)
    except ValidationError as exc:
        lines = format_validation_error(exc)
        path = lines[0].split(": ", 1)[0] if lines else ""
        return Failure("contract", "input", "; ".join(lines), path)
