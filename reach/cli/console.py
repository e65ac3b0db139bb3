"""``reach console``: the fabric on one web page (docs/console.md)."""

from __future__ import annotations

import contextlib
import os

import click

from reach.cli.common import Target, connection, connection_options, fail, run

#: the environment variable of the console's login password when not on loopback
PASSWORD_ENV = "REACH_CONSOLE_PASSWORD"


async def _console(
    target: Target, host: str, port: int, password: str | None, window: float
) -> None:
    from reach.console import Console, FabricView
    from reach.http.serve import listen, serve, url_of

    sock = listen(host, port)  # a busy port fails the command before it connects
    with contextlib.closing(sock):
        async with connection(target, "reach-console") as conn:
            view = FabricView(conn, window_sec=window)
            await view.start()
            console = Console(view, password=password, loopback_only=password is None)
            click.echo(f"reach console on {url_of(sock)} (Ctrl-C to stop)", err=True)
            try:
                # told to stop, the live feeds end at once (they would run for ever)
                await serve(console.asgi, sock, graceful_sec=2, stopping=console.closing.set)
            finally:
                console.closing.set()
                await view.stop()


def register(main: click.Group) -> None:
    @main.command("console", short_help="Serve the fabric as a live web page.")
    @click.option("--port", type=click.IntRange(0, 65535), default=8222, show_default=True)
    @click.option(
        "--host",
        default="127.0.0.1",
        show_default=True,
        help="address to listen on; any but loopback asks for a login",
    )
    @click.option(
        "--window", type=float, default=300.0, show_default=True,
        help="seconds of calls the charts and figures keep",
    )  # fmt: skip
    @connection_options
    def console(target: Target, port: int, host: str, window: float) -> None:
        """Serve a web page of the fabric, live: agents with health, load and latency;
        a capability's instances, scores, breakers, charts and contract; a search of the
        audit trail; alerts; and the doctor's six steps. It reads with the credentials
        given (--creds), shows what they may read, and changes nothing.

        On 127.0.0.1 (the default) there is no login. Bound to any other address it asks
        for one: HTTP Basic, user "operator", the password from REACH_CONSOLE_PASSWORD, or
        one made now and printed once. Needs the console extra: pip install
        'agent-reach[console]'."""
        try:
            import jinja2  # noqa: F401 - the console's web server is an optional extra
            import starlette  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError as exc:
            fail(f"reach console needs its web server: pip install 'agent-reach[console]' ({exc})")
        from reach.console.auth import LOGIN_USER, is_loopback, make_password

        if window <= 0:
            raise click.UsageError("--window must be > 0")
        password = None
        if not is_loopback(host):
            password = os.environ.get(PASSWORD_ENV) or ""
            said = f"the password from {PASSWORD_ENV}"
            if not password:
                password = make_password()
                said = f"password {password}"
            click.echo(f"login: user {LOGIN_USER}, {said}", err=True)
        run(_console(target, host, port, password, window))
