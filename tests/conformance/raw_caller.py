"""An Agent-Reach caller written from the protocol spec with nats-py and msgpack: no
``reach`` import.

It logs in with its credentials file, gets a fabric token and, for each instance it
calls, a call token (the two-step token flow, each request wrapped in the envelope),
finds the instances of a capability in the registry bucket (opened the way nats-py
opens any bucket; keys listed from the stream's subjects, values read by direct gets),
and calls over the instance subject, moving on to the next instance when one answers
``unavailable`` or nobody listens, with the same call id and the next attempt number.
Failures come back as ``WireError`` with the reply's kind, code and description.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from nats.aio.client import Client
from nats.js.kv import KeyValue

from .wire import Creds, WireError, ask, body_of, call_token, connect, fabric_token, request, unpack

REGISTRY = "REACH_REGISTRY"
EARLY = 30.0  # seconds before its expiry a token is replaced


class RawCaller:
    def __init__(self, creds: Creds) -> None:
        self.creds = creds
        self.nc: Client | None = None
        self.registry: KeyValue | None = None
        self.fabric: dict[str, Any] = {}
        self.tokens: dict[tuple[str, str], dict[str, Any]] = {}
        self.call_ids: list[str] = []  # of every call made, in order

    async def start(self, url: str | None = None) -> None:
        self.nc = await connect(self.creds, url)
        self.fabric = await fabric_token(self.nc, self.creds)
        self.registry = await self.nc.jetstream().key_value(REGISTRY)

    async def stop(self) -> None:
        if self.nc is not None:
            await self.nc.close()

    async def instances(self, capability: str) -> list[str]:
        """Agent ids of the live, ready instances serving ``capability``, least busy first."""
        assert self.nc is not None
        assert self.registry is not None
        js = self.nc.jetstream()
        info = await js.stream_info(f"KV_{REGISTRY}", subjects_filter=f"$KV.{REGISTRY}.agent.>")
        found: list[tuple[int, str]] = []
        for subject in info.state.subjects or {}:
            try:
                entry = await self.registry.get(subject.removeprefix(f"$KV.{REGISTRY}."))
            except Exception:  # deleted since it was listed
                continue
            record = unpack(entry.value or b"")
            manifest = record.get("manifest", {})
            names = {cap.get("name") for cap in manifest.get("capabilities", [])}
            ready = record.get("readiness", {}).get("ready", True)
            if capability in names and record.get("status") != "unhealthy" and ready:
                found.append((int(record.get("in_flight", 0)), manifest["agent_id"]))
        return [agent_id for _, agent_id in sorted(found)]

    async def _token(self, capability: str, instance: str) -> str:
        assert self.nc is not None
        if self.fabric.get("expires_at", 0) - EARLY < time.time():
            self.fabric = await fabric_token(self.nc, self.creds)
        held = self.tokens.get((capability, instance))
        if held is None or held["expires_at"] - EARLY < time.time():
            held = await call_token(
                self.nc, self.creds, self.fabric["token"], capability, instance or None
            )
            self.tokens[(capability, instance)] = held
        return str(held["token"])

    async def call(self, capability: str, payload: Any, timeout: float = 5.0) -> tuple[Any, str]:
        """(the result, the instance that answered); WireError when the call failed."""
        assert self.nc is not None
        call_id = secrets.token_hex(12)  # kept across attempts: a callee may deduplicate
        self.call_ids.append(call_id)
        targets = await self.instances(capability) or [""]  # none known: the queue group
        last: WireError | None = None
        for attempt, instance in enumerate(targets[:3], start=1):
            subject = f"reach.v1.cap.{capability}" + (f".{instance}" if instance else "")
            deadline = int((time.time() + timeout) * 1000)
            data = request(
                payload,
                id=call_id,
                tok=await self._token(capability, instance),
                dl=deadline,
                at=attempt,
            )
            try:
                reply = await ask(self.nc, self.creds.client_id, subject, data, timeout)
            except TimeoutError:
                raise WireError(
                    "timeout", "timeout", f"{subject}: no reply in {timeout}s"
                ) from None
            try:
                result = body_of(reply)
            except WireError as exc:
                if exc.kind != "unavailable":
                    raise
                last = exc  # not ready, at capacity, or nobody listens: the next one
                continue
            return result, str(unpack(reply).get("by", instance))
        assert last is not None
        raise last
