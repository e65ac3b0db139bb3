"""``reach mcp`` over stdio, its pipes read and written by the event loop.

The MCP SDK's ``stdio_server`` reads and writes the process's stdin and stdout through
``anyio.wrap_file``: each line read, each write and each flush goes to a worker thread
and back, a few thread switches per message each way. ``pipes`` gives ``stdio_server``
its stdin and stdout as the event loop's own pipe transports instead; the SDK's framing
(one JSON-RPC message per line, UTF-8) and everything above it stay the SDK's.

As the SDK does, while the gateway serves, descriptor 0 reads the null device and
descriptor 1 writes to stderr, so that nothing else in the process can write into the
protocol's stream (or read from it); both are put back at the end. A stdin or stdout
that is not a pipe, a socket or a terminal (a regular file, say) is left to the SDK's
own reader and writer (``pipes`` gives None).
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import anyio

__all__ = ["LINE_LIMIT", "pipes"]

#: the longest line (one JSON-RPC message) read from stdin, far above what one fabric
#: call carries
LINE_LIMIT = 64 * 1024 * 1024


class _Lines:
    """The lines of stdin, as ``stdio_server`` iterates over them."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader

    def __aiter__(self) -> _Lines:
        return self

    async def __anext__(self) -> str:
        line = await self._reader.readline()
        if not line:
            raise StopAsyncIteration
        return line.decode("utf-8", errors="replace")


class _Out:
    """Stdout, as ``stdio_server`` writes to it: ``flush`` waits while the pipe is full."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer

    async def write(self, text: str) -> None:
        self._writer.write(text.encode("utf-8"))

    async def flush(self) -> None:
        await self._writer.drain()


def _streams_like(fd: int) -> bool:
    mode = os.fstat(fd).st_mode
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode)


@asynccontextmanager
async def pipes() -> AsyncIterator[tuple[anyio.AsyncFile[str], anyio.AsyncFile[str]] | None]:
    """Stdin and stdout for ``stdio_server(stdin, stdout)``, or None where the event loop
    cannot take them (then ``stdio_server()`` serves them itself)."""
    if not (_streams_like(0) and _streams_like(1)):
        yield None
        return
    loop = asyncio.get_running_loop()
    # the transports' own copies (each closes its copy when done: stdin at its end), and
    # the copies that put descriptors 0 and 1 back
    wire_in, wire_out = os.dup(0), os.dup(1)
    saved_in, saved_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    transports: list[asyncio.BaseTransport] = []
    try:
        reader = asyncio.StreamReader(limit=LINE_LIMIT)
        read, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(wire_in, "rb", buffering=0)
        )
        transports.append(read)
        write, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(wire_out, "wb", buffering=0)
        )
        transports.append(write)
        writer = asyncio.StreamWriter(write, protocol, None, loop)
        # what stdio_server uses of a file: iteration by line, write, flush
        yield cast(Any, _Lines(reader)), cast(Any, _Out(writer))
    finally:
        for transport in transports:
            transport.close()
        for saved, fd in ((saved_in, 0), (saved_out, 1)):
            os.dup2(saved, fd)
            os.close(saved)
