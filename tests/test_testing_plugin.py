"""reach.testing as the pytest plugin of users' own tests: an open and a secured fabric,
credentials, agents and clients that stop with the test, and waiting for a route.

The fixtures are used here directly (this suite loads the plugin too), and through
pytester: a test module of a user's, run in pytest-asyncio's auto and strict modes, and a
failing one, after which everything the fixtures started has stopped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from reach.errors import ClearanceExceeded, ConfigurationError, NotAuthorized
from reach.fabric import Fabric
from reach.fabric.embedded import port_in_use
from reach.testing import AgentFactory, ClientFactory, CredentialsFactory, wait_routable

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent


def manifest(
    agent_id: str, name: str = "customer_orders", level: int = 1, **extra: Any
) -> dict[str, Any]:
    return {
        "agent_id": agent_id,
        "agent_name": agent_id.rsplit("-", 1)[0],
        "version": "1.0.0",
        "capabilities": [{"name": name, "security_level": level, "latency_sla_ms": 500}],
        **extra,
    }


async def orders(request: dict[str, Any]) -> dict[str, Any]:
    return {"user": request["user"], "orders": []}


# -- import cost --------------------------------------------------------------------------


def test_the_plugin_imports_no_nats_and_none_of_the_fabric_at_load() -> None:
    """pytest imports it in every project that installs Agent-Reach."""
    code = "import sys, json\nimport reach.testing\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    loaded = json.loads(out.stdout)
    heavy = ("nats", "pydantic", "jsonschema", "cryptography", "msgpack", "yaml", "opentelemetry")
    assert [m for m in loaded if m.split(".")[0] in heavy] == []
    ours = sorted(m for m in loaded if m.split(".")[0] == "reach")
    assert ours == [
        "reach",
        "reach.errors",
        "reach.fabric",
        "reach.fabric.embedded",
        "reach.lazy",
        "reach.testing",
    ]


# -- the fixtures, used directly ----------------------------------------------------------


@pytest.fixture
def users_dev_creds() -> None:
    """A credentials file of the user's where the tests run (``reach up`` wrote it): the
    fixtures' agents and clients never use it."""
    Path(".reach").mkdir()
    Path(".reach/dev.creds").write_text("not credentials")


@pytest.mark.usefixtures("users_dev_creds")
async def test_an_agent_and_a_client_on_the_open_fabric(
    reach_fabric: Fabric, reach_agent: AgentFactory, reach_client: ClientFactory
) -> None:
    assert not reach_fabric.secure
    assert os.environ["REACH_URL"] == reach_fabric.url
    agent = await reach_agent(manifest("vault-1"), orders)
    client = await reach_client()
    (found,) = await wait_routable(client, "customer_orders")
    assert found.agent_id == agent.agent_id == "vault-1"
    result = await client.call("customer_orders", {"user": 7})
    assert (result.value, result.agent_id) == ({"user": 7, "orders": []}, "vault-1")


async def test_an_agent_from_a_yaml_manifest_with_a_handler_per_capability(
    reach_agent: AgentFactory, reach_client: ClientFactory, tmp_path: Path
) -> None:
    data = manifest("shop-1")
    data["capabilities"].append({"name": "refund", "security_level": 1})
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(data))

    async def refund(request: dict[str, Any]) -> str:
        return "refunded"

    await reach_agent(path, {"customer_orders": orders, "refund": refund})
    client = await reach_client()
    assert (await client.call("refund", {})).value == "refunded"
    assert (await client.call("customer_orders", {"user": 1})).value["user"] == 1


async def test_a_level_2_caller_is_refused_a_level_3_capability_on_the_secured_fabric(
    reach_secure_fabric: Fabric, reach_agent: AgentFactory, reach_client: ClientFactory
) -> None:
    assert reach_secure_fabric.secure
    assert reach_secure_fabric.logins
    # its own credential, made at the level of its capability and bound to it
    vault = await reach_agent(manifest("vault-1", level=3), orders)
    assert vault.credentials == reach_secure_fabric.store / "vault-1.creds"
    analyst = await reach_client(level=2, client_id="analyst")
    auditor = await reach_client(level=3)
    await wait_routable(analyst, "customer_orders")
    assert (await auditor.call("customer_orders", {"user": 7})).agent_id == "vault-1"
    with pytest.raises(NotAuthorized) as refused:
        await analyst.call("customer_orders", {"user": 7})
    assert (refused.value.level_required, refused.value.level_held) == (3, 2)


async def test_an_agent_runs_with_the_credential_it_is_given(
    reach_credentials: CredentialsFactory, reach_agent: AgentFactory
) -> None:
    low = await reach_credentials("vault", 1, agent_id="vault-1", capabilities=["customer_orders"])
    with pytest.raises(ClearanceExceeded, match="holds clearance 1"):
        await reach_agent(manifest("vault-1", level=3), orders, credentials=low)


async def test_only_a_client_with_the_jobs_role_submits_jobs(
    reach_secure_fabric: Fabric, reach_agent: AgentFactory, reach_client: ClientFactory
) -> None:
    await reach_agent(manifest("export-1", "bulk_export", mode="async"), orders)
    reader = await reach_client(roles="jobs")
    job = await reader.submit("bulk_export", {"user": 3})
    assert await job.result(timeout=10) == {"user": 3, "orders": []}
    other = await reach_client()
    with pytest.raises(NotAuthorized, match="jobs"):
        await other.submit("bulk_export", {"user": 3})


async def test_bad_uses_of_the_factories_are_configuration_errors(
    reach_fabric: Fabric, reach_agent: AgentFactory, reach_client: ClientFactory
) -> None:
    with pytest.raises(ConfigurationError, match="open fabric has no credentials"):
        await reach_client(level=2)
    with pytest.raises(ConfigurationError, match="'refund' is not in the manifest"):
        await reach_agent(manifest("vault-1"), {"refund": orders})
    with pytest.raises(ConfigurationError, match="no handler registered for: customer_orders"):
        await reach_agent(manifest("vault-1"), {})
    with pytest.raises(ConfigurationError, match="must be an async function"):
        await reach_agent(manifest("vault-1"), lambda request: request)
    with pytest.raises(ConfigurationError, match="count must be 1 or more, not 0"):
        await wait_routable(await reach_client(), "customer_orders", count=0)
    assert reach_agent.started == []


async def test_bad_credentials_asked_for_are_configuration_errors(
    reach_credentials: CredentialsFactory, reach_client: ClientFactory
) -> None:
    with pytest.raises(ConfigurationError, match="give agent_id too"):
        await reach_credentials("vault", 3, capabilities=["customer_orders"])
    with pytest.raises(ConfigurationError, match="needs the capabilities it serves"):
        await reach_credentials("vault", 3, agent_id="vault-1")
    with pytest.raises(ConfigurationError, match="invalid client 'vault'"):
        await reach_credentials("vault", 5)
    made = await reach_credentials("analyst", 2)
    with pytest.raises(ConfigurationError, match="not both"):
        await reach_client(made, level=2)


async def test_waiting_for_a_route_that_never_comes_names_what_the_client_knows(
    reach_agent: AgentFactory, reach_client: ClientFactory
) -> None:
    await reach_agent(manifest("vault-1"), orders)
    client = await reach_client()
    with pytest.raises(TimeoutError) as waited:
        await wait_routable(client, "customer_orders", count=2, timeout=0.5)
    assert str(waited.value) == (
        "customer_orders: no 2 routable instance(s) within 0.5 s; the client knows"
        " vault-1 (healthy)"
    )


# -- a user's test module, through pytester ---------------------------------------------

USER_TESTS = """
import pytest

from reach.errors import NotAuthorized
from reach.testing import wait_routable

VAULT = {
    "agent_id": "vault-1",
    "agent_name": "vault",
    "version": "1.0.0",
    "capabilities": [{"name": "customer_orders", "security_level": 3}],
}


async def orders(request):
    return {"user": request["user"]}


@pytest.mark.asyncio
async def test_open(reach_agent, reach_client):
    await reach_agent(VAULT, orders)
    client = await reach_client()
    await wait_routable(client, "customer_orders")
    assert (await client.call("customer_orders", {"user": 7})).value == {"user": 7}


@pytest.mark.asyncio
async def test_secured(reach_secure_fabric, reach_agent, reach_client):
    await reach_agent(VAULT, orders)
    analyst = await reach_client(level=2)
    with pytest.raises(NotAuthorized):
        await analyst.call("customer_orders", {"user": 7})
"""


def _ini(pytester: pytest.Pytester, mode: str) -> None:
    pytester.makeini(
        f"""
        [pytest]
        asyncio_mode = {mode}
        asyncio_default_fixture_loop_scope = function
        """
    )


@pytest.mark.parametrize("mode", ["auto", "strict"])
def test_a_users_test_module_passes_in_both_modes_of_pytest_asyncio(
    pytester: pytest.Pytester, mode: str
) -> None:
    _ini(pytester, mode)
    pytester.makepyfile(test_user=USER_TESTS)
    # in a process of its own: what a user's session leaves to the garbage collector is
    # not this session's
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


FAILING_TESTS = '''
import json
from pathlib import Path

import pytest

RECORD = Path(__file__).parent / "record.json"
MANIFEST = {
    "agent_id": "vault-1",
    "agent_name": "vault",
    "version": "1.0.0",
    "capabilities": [{"name": "customer_orders", "security_level": 1}],
}


async def orders(request):
    return request


@pytest.fixture
def observe(request):
    """Set up before the reach fixtures, so torn down after them: what they left."""
    seen = {}
    yield seen

    def stopped(get):
        try:
            get()
        except RuntimeError:
            return True
        return False

    fabric, agent, client = seen["fabric"], seen["agent"], seen["client"]
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    record[request.node.name] = {
        "port": fabric.nodes[0].port,
        "server_running": fabric.nodes[0].running,
        "agent_stopped": stopped(lambda: agent.connection),
        "client_closed": stopped(lambda: client.routes),
    }
    RECORD.write_text(json.dumps(record))


@pytest.mark.asyncio
async def test_open_fails(observe, reach_fabric, reach_agent, reach_client):
    observe.update(
        fabric=reach_fabric,
        agent=await reach_agent(MANIFEST, orders),
        client=await reach_client(),
    )
    assert False, "the test fails with everything running"


@pytest.mark.asyncio
async def test_secured_fails(observe, reach_secure_fabric, reach_agent, reach_client):
    observe.update(
        fabric=reach_secure_fabric,
        agent=await reach_agent(MANIFEST, orders),
        client=await reach_client(level=1),
    )
    assert False, "the test fails with everything running"
'''


def test_a_failing_test_leaves_nothing_running(pytester: pytest.Pytester) -> None:
    _ini(pytester, "strict")
    pytester.makepyfile(test_failing=FAILING_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    record = json.loads((pytester.path / "record.json").read_text())
    assert set(record) == {"test_open_fails", "test_secured_fails"}
    for name, left in record.items():
        assert left["agent_stopped"], name
        assert left["client_closed"], name
        assert not left["server_running"], name
        assert not port_in_use(left["port"]), name


def test_without_pytest_asyncio_an_async_fixture_fails_saying_what_to_install(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # this reach/, either build
    # no plugin loads by itself (pytest-asyncio's would): only this one, named
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makepyfile(
        test_sync="""
        def test_uses_a_fabric(reach_fabric):
            pass


        def test_uses_a_server(nats_server):
            assert nats_server.running
        """
    )
    # pytest-asyncio as if not installed: not importable
    run = textwrap.dedent(
        """
        import sys


        class NotInstalled:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "pytest_asyncio":
                    raise ImportError(f"No module named {name!r}")


        sys.meta_path.insert(0, NotInstalled())
        import pytest

        sys.exit(pytest.main(["-p", "reach.testing", "-p", "no:cacheprovider"]))
        """
    )
    result = pytester.run(sys.executable, "-c", run)
    result.assert_outcomes(passed=1, errors=1)
    assert (
        "the fixture reach_fabric is async: it needs pytest-asyncio"
        " (pip install 'agent-reach[testing]')"
    ) in result.stdout.str()
