"""The nats-py internals the transport uses: every one is in the installed nats-py, the
supported range is the pinned one, and a nats-py that lacks one is refused by name."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from nats.aio.client import Client as NatsClient

from reach.errors import ConfigurationError
from reach.testing import NatsServer
from reach.transport import UnsupportedNatsPy, connect, internals

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


class Lacking:
    """Stands in for a nats-py object that lacks the attribute ``name``."""

    def __init__(self, real: object, name: str) -> None:
        self._real = real
        self._name = name

    def __getattr__(self, attr: str) -> object:
        if attr == self._name:
            raise AttributeError(attr)
        return getattr(self._real, attr)


def _lacking(owner: str, name: str) -> dict[str, object]:
    found = internals.samples()
    found[owner] = Lacking(found[owner], name)
    return found


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:3])


def test_the_installed_nats_py_has_every_internal_the_transport_uses() -> None:
    # an upgrade that removes one fails here, with UnsupportedNatsPy naming it
    internals.check()


def test_the_supported_range_is_the_pinned_one_and_holds_the_installed_release() -> None:
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    assert f"nats-py{internals.SUPPORTED}" in dependencies
    lowest, above = (part.lstrip("<>=") for part in internals.SUPPORTED.split(","))
    assert _release(lowest) <= _release(internals.installed()) < _release(above)


@pytest.mark.parametrize("internal", internals.USED, ids=str)
def test_a_nats_py_without_an_internal_is_refused_by_its_name(
    internal: internals.Internal,
) -> None:
    with pytest.raises(UnsupportedNatsPy) as refused:
        internals.check(_lacking(internal.owner, internal.name))
    message = str(refused.value)
    assert f"{internal.owner}.{internal.name}" in message
    assert internal.used_by in message
    assert f"nats-py{internals.SUPPORTED}" in message
    assert f"nats-py {internals.installed()} lacks" in message
    # what only the internals need, nats-py's public API can do without
    assert (f"{internals.ENV}=off" in message) is not internal.public


def test_a_method_without_a_parameter_the_transport_passes_is_refused() -> None:
    class OlderClient(NatsClient):
        async def _flush_pending(self) -> None:  # type: ignore[override]
            return None

    with pytest.raises(UnsupportedNatsPy, match=r"Client\._flush_pending\(force_flush=\)"):
        internals.check({**internals.samples(), "Client": OlderClient()})


def test_an_attribute_of_another_kind_is_refused() -> None:
    found = internals.samples()
    found["Subscription"]._pending_queue = []  # type: ignore[attr-defined]
    with pytest.raises(UnsupportedNatsPy, match=r"Subscription\._pending_queue"):
        internals.check(found)


def test_without_the_internals_only_the_public_api_is_required() -> None:
    internals.check(_lacking("Client", "_pending_data_size"), internals=False)
    with pytest.raises(UnsupportedNatsPy, match="reconnect_to_server_handler"):
        internals.check(
            {**internals.samples(), "Client": Lacking(NatsClient(), "connect")}, internals=False
        )


def test_the_setting_is_on_or_off_and_anything_else_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(internals.ENV, "off")
    assert internals.resolve() is False
    assert internals.resolve(True) is True  # an argument wins
    monkeypatch.setenv(internals.ENV, "on")
    assert internals.resolve() is True
    monkeypatch.delenv(internals.ENV)
    assert internals.resolve() is True
    monkeypatch.setenv(internals.ENV, "fast")
    with pytest.raises(ConfigurationError, match=f"{internals.ENV} must be on or off, not 'fast'"):
        internals.resolve()


async def test_connect_refuses_a_nats_py_without_them_before_connecting_unless_told_not_to_use_them(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = _lacking("Subscription", "_pending_queue")
    monkeypatch.setattr(internals, "_checked", set())
    monkeypatch.setattr(internals, "samples", lambda: broken)
    with pytest.raises(UnsupportedNatsPy, match=r"Subscription\._pending_queue"):
        await connect([nats_server.url], name="unsupported")
    conn = await connect([nats_server.url], name="public", internals=False)
    try:
        assert not conn.uses_internals
        assert conn.is_connected
    finally:
        await conn.close()
