"""``reach a2a``: serve the fabric's agents as A2A agents (Agent Cards, JSON-RPC)."""

from __future__ import annotations

from typing import Any

import click

from reach.cli.common import Target, connection_options, fail, run
from reach.cli.doors import door_options, policy_of


async def _serve(
    target: Target,
    host: str,
    port: int,
    public_url: str | None,
    job_wait: float,
    login: bool,
    policy: Any,
) -> None:
    from reach.caller.client import ReachClient
    from reach.gateways.a2a import A2AGateway, serve

    async with ReachClient(
        servers=target.servers, credentials=target.credentials, name="reach-a2a"
    ) as client:
        gateway = A2AGateway(client, public_url=public_url, job_wait=job_wait)

        def ready(url: str) -> None:
            agents = len({inst.manifest.agent_name for inst in client.routes.find()})
            click.echo(f"Agent-Reach A2A gateway on {url} ({agents} agents; index at {url})")

        await serve(gateway, host, port, ready, policy=policy, login=login)


def register(main: click.Group) -> None:
    @main.command("a2a", short_help="Serve the fabric's agents as A2A agents.")
    @click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
    @click.option(
        "--port",
        type=click.IntRange(0, 65535),
        default=8080,
        show_default=True,
        help="port to listen on (0: a free one, named in the line printed when up)",
    )
    @click.option(
        "--public-url",
        metavar="URL",
        default=None,
        help="the base URL the Agent Cards give (behind a proxy); default: the one asked",
    )
    @click.option(
        "--job-wait",
        type=click.FloatRange(min=0),
        default=30.0,
        show_default=True,
        help="seconds a message to an async-mode capability waits for its job to finish",
    )
    @door_options
    @connection_options
    def a2a(
        target: Target,
        host: str,
        port: int,
        public_url: str | None,
        job_wait: float,
        no_login: bool,
        allow_hosts: tuple[str, ...],
        allow_origins: tuple[str, ...],
        max_body: int,
    ) -> None:
        """Serve every agent on the fabric as an A2A agent: an Agent Card each at
        /agents/NAME/.well-known/agent-card.json (skills = its capabilities), A2A JSON-RPC
        (message/send, tasks/get) at /agents/NAME, made into fabric calls. Every caller
        logs in with its own Agent-Reach credential (OAuth 2.1 client credentials at
        /oauth/token, then Authorization: Bearer) and calls as itself; this gateway's
        credential needs the gateway role (reach creds add NAME --level N --role
        gateway). Needs the gateways extra: pip install 'agent-reach[gateways]'."""
        try:
            import a2a.server  # noqa: F401 - the SDK is an optional extra
            import uvicorn  # noqa: F401
        except ImportError as exc:
            fail(f"reach a2a needs the A2A SDK: pip install 'agent-reach[gateways]' ({exc})")
        policy = policy_of(host, allow_hosts, allow_origins, max_body)
        run(_serve(target, host, port, public_url, job_wait, not no_login, policy))
