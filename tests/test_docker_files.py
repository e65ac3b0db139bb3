"""docker/: the compose topology and its NATS configs agree with what ``reach up --cluster``
generates (no Docker engine here: the files are parsed, and nats-server checks the configs)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from reach.fabric.embedded import find_nats_server
from reach.security import natsconf

DOCKER = Path(__file__).parent.parent / "docker"
NODES = ("n1", "n2", "n3")
ROUTE_PORT = 6222
URLS = ",".join(f"nats://{node}:4222" for node in NODES)


# -- a small reader for the nats-server config syntax we write ---------------------------------

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<comment>\#[^\n]*) |
        (?P<string>"(?:[^"\\]|\\.)*") |
        (?P<punct>[{}\[\],:=]) |
        (?P<word>[^\s{}\[\],:="#]+)
    )""",
    re.VERBOSE,
)


def _tokens(text: str) -> list[str]:
    tokens, pos = [], 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            if text[pos:].strip():
                raise ValueError(f"cannot read the config at {text[pos : pos + 20]!r}")
            break
        pos = match.end()
        if match.group("comment") is None and match.lastgroup is not None:
            tokens.append(match.group(match.lastgroup))
    return tokens


def parse_conf(text: str) -> dict[str, Any]:
    """The config as a dict: blocks as dicts, lists, strings unquoted, other values as words."""
    tokens = _tokens(text)
    pos = 0

    def value() -> Any:
        nonlocal pos
        token = tokens[pos]
        pos += 1
        if token == "{":
            return block("}")
        if token == "[":
            items = []
            while tokens[pos] != "]":
                items.append(value())
                if tokens[pos] == ",":
                    pos += 1
            pos += 1
            return items
        if token.startswith('"'):
            return token[1:-1].encode().decode("unicode_escape")
        return token

    def block(end: str | None) -> dict[str, Any]:
        nonlocal pos
        out: dict[str, Any] = {}
        while pos < len(tokens) and tokens[pos] != end:
            key = tokens[pos].strip('"')
            pos += 1
            if tokens[pos] in (":", "="):
                pos += 1
            out[key] = value()
            if pos < len(tokens) and tokens[pos] == ",":
                pos += 1
        pos += 1
        return out

    return block(None)


def _generated(index: int) -> dict[str, Any]:
    """Node ``index`` (0-based) of a local cluster, as ``reach up --cluster 3`` writes it."""
    setup = natsconf.SecureSetup(
        issuer=natsconf.NKey.create(),
        callout_user=natsconf.ServiceUser("reach-auth", "p1", natsconf.AUTH_ACCOUNT),
        registrar_user=natsconf.ServiceUser("reach-registrar", "p2", natsconf.APP_ACCOUNT),
        system_user=natsconf.ServiceUser("reach-system", "p3", natsconf.SYSTEM_ACCOUNT),
    )
    nodes = [natsconf.ClusterNode(f"reach-{i}", "127.0.0.1", 4222 + i, 6222 + i) for i in (1, 2, 3)]
    text = natsconf.render_config(
        setup,
        port=nodes[index].port,
        store_dir=None,
        server_name=nodes[index].name,
        cluster=natsconf.ClusterPeers.of(nodes, index, "route-secret"),
        sync_always=True,
    )
    return parse_conf(text)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    return data


def _option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_the_reader_reads_what_natsconf_writes() -> None:
    conf = _generated(0)
    assert conf["server_name"] == "reach-1"
    assert conf["jetstream"] == natsconf.jetstream_settings(None, sync_always=True)
    assert conf["cluster"]["routes"] == [
        "nats-route://reach-route:route-secret@127.0.0.1:6224",
        "nats-route://reach-route:route-secret@127.0.0.1:6225",
    ]
    assert conf["authorization"]["auth_callout"]["account"] == natsconf.AUTH_ACCOUNT


@pytest.mark.parametrize("index", [0, 1, 2])
def test_each_node_config_has_the_generated_cluster_and_jetstream_blocks(
    compose: dict[str, Any], index: int
) -> None:
    node = NODES[index]
    docker = parse_conf((DOCKER / f"nats-{index + 1}.conf").read_text())
    generated = _generated(index)

    assert docker["server_name"] == generated["server_name"] == f"reach-{index + 1}"
    assert docker["jetstream"] == generated["jetstream"] == {"sync_interval": "always"}
    # the same cluster block but for addresses, the secret (from the environment) and the
    # routes, which the compose command gives (they carry the secret)
    ours, theirs = docker["cluster"], generated["cluster"]
    assert set(ours) | {"routes"} == set(theirs)
    assert ours["name"] == theirs["name"] == natsconf.CLUSTER_NAME
    assert ours["listen"] == f"0.0.0.0:{ROUTE_PORT}"
    assert set(ours["authorization"]) == set(theirs["authorization"])
    assert ours["authorization"]["user"] == theirs["authorization"]["user"]
    assert ours["authorization"]["password"] == "$REACH_ROUTE_PASSWORD"
    assert ours["ping_interval"] == theirs["ping_interval"]
    assert ours["ping_max"] == theirs["ping_max"]

    # the accounts and the auth callout: what `reach nats-auth` writes, from its volume
    assert docker["include"] == "reach/nats-auth.conf"
    assert not {"accounts", "authorization", "system_account"} & set(docker)
    assert {"accounts", "authorization", "system_account"} <= set(generated)

    service = compose["services"][node]
    assert service["image"].startswith("nats:")
    assert f"./nats-{index + 1}.conf:/etc/nats/nats.conf:ro" in service["volumes"]
    assert "nats-auth:/etc/nats/reach:ro" in service["volumes"]
    assert service["depends_on"] == {"nats-auth": {"condition": "service_completed_successfully"}}
    command = service["command"]
    assert _option(command, "-c") == "/etc/nats/nats.conf"
    assert _option(command, "-sd") == "/data"  # as `reach up` passes -sd, not store_dir
    routes = _option(command, "--routes").split(",")
    user = f"{natsconf.ROUTE_USER}:${{REACH_ROUTE_PASSWORD}}"
    others = [other for other in NODES if other != node]
    assert routes == [f"nats-route://{user}@{other}:{ROUTE_PORT}" for other in others]
    assert len(routes) == len(theirs["routes"])
    assert "REACH_ROUTE_PASSWORD" in service["environment"]


def test_the_registrar_runs_on_all_three_nodes_at_three_replicas(compose: dict[str, Any]) -> None:
    reach = compose["services"]["reach"]
    assert reach["build"]["dockerfile"] == "docker/Dockerfile"
    command = reach["command"]
    assert command[0] == "up"
    assert _option(command, "--servers") == URLS
    assert _option(command, "--replicas") == "3"
    # it answers the nodes' logins with the secrets nats-auth wrote the nodes' file from
    assert "--auth-callout" in command
    auth = compose["services"]["nats-auth"]
    assert auth["command"][0] == "nats-auth"
    assert _option(auth["command"], "--store") == _option(command, "--store") == "/data"
    assert _option(auth["command"], "--out") == "/auth/nats-auth.conf"
    assert set(auth["volumes"]) == {"reach-store:/data", "nats-auth:/auth"}
    assert "reach-store:/data" in reach["volumes"]
    assert set(reach["depends_on"]) == set(NODES)
    for name in ("data-query-1", "data-query-2"):
        agent = compose["services"][name]
        assert agent["entrypoint"] == ["python", "-m", "reach.demo.data_query"]
        assert agent["command"][:2] == [URLS, name]
        # its own credential, and nothing of the reach store (signing key, gate secrets)
        assert agent["environment"] == {"REACH_CREDS": f"/creds/{name}.creds"}
        assert agent["volumes"] == ["agent-creds:/creds:ro"]
        assert agent["depends_on"] == {
            "agent-creds": {"condition": "service_completed_successfully"}
        }


def test_each_agent_gets_a_credential_bound_to_its_agent_id(compose: dict[str, Any]) -> None:
    service = compose["services"]["agent-creds"]
    assert service["depends_on"] == {"reach": {"condition": "service_healthy"}}
    assert set(service["volumes"]) == {"reach-store:/data:ro", "agent-creds:/creds"}
    assert service["entrypoint"] == ["sh", "-c"]
    (script,) = service["command"]
    # what compose runs: $$ is a literal $ for the shell
    script = script.replace("$$", "$")
    assert "for id in data-query-1 data-query-2; do" in script
    assert (
        "reach creds add $id --level 2 --agent-id $id --cap query_industry_data"
        " --creds /data/admin.creds --out /creds/$id.creds" in script
    )
    assert "test -f /creds/$id.creds ||" in script  # a restart keeps the credentials


def test_the_dockerfile_installs_the_package_with_reach_as_entrypoint() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    assert "FROM python:3.11-slim" in text
    assert re.search(r"pip install .*\s\.(\s|$)", text)
    assert 'ENTRYPOINT ["reach"]' in text


@pytest.mark.parametrize("index", [1, 2, 3])
def test_nats_server_accepts_each_node_config(index: int, tmp_path: Path) -> None:
    # laid out as in the container: the node's config, and the volume nats-auth wrote
    conf = tmp_path / "nats.conf"
    conf.write_text((DOCKER / f"nats-{index}.conf").read_text())
    natsconf.write_auth(natsconf.prepare(tmp_path / "store"), tmp_path / "reach" / "nats-auth.conf")
    env = {**os.environ, "REACH_ROUTE_PASSWORD": "a-route-secret"}
    result = subprocess.run(
        [find_nats_server(), "-t", "-c", str(conf)],
        capture_output=True,
        env=env,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, (result.stdout + result.stderr).decode()


def test_nats_server_accepts_a_generated_cluster_node_config(tmp_path: Path) -> None:
    setup = natsconf.prepare(tmp_path)
    nodes = [natsconf.ClusterNode(f"reach-{i}", "127.0.0.1", 4222 + i, 6222 + i) for i in (1, 2, 3)]
    path = natsconf.write_config(
        setup,
        tmp_path / "nats-1.conf",
        port=nodes[0].port,
        store_dir=None,
        server_name=nodes[0].name,
        cluster=natsconf.ClusterPeers.of(nodes, 0, natsconf.route_user(tmp_path).password),
        sync_always=True,
    )
    result = subprocess.run(
        [find_nats_server(), "-t", "-c", str(path)], capture_output=True, timeout=30, check=False
    )
    assert result.returncode == 0, (result.stdout + result.stderr).decode()
