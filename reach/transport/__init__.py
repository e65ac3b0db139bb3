"""The NATS boundary: the one package under ``reach/`` that imports nats-py.

Everything above it speaks Agent-Reach types and errors; every nats-py error is
translated into the Agent-Reach tree here (``denials.translate_error``), at this seam.

- ``connection``: a connected client narrowed to what Agent-Reach uses (publish,
  subscribe, request/reply, flush, KV buckets and streams), and ``connect``;
- ``kv``: JetStream KV buckets with compare-and-set; ``kvfollow`` follows a public
  bucket without a JetStream consumer;
- ``jetstream``: JetStream streams, idempotent publishing and ordered reads, a size cap
  fitted to the server's storage limit; ``streamreads``: an operator's read of a stream,
  started again after a transient failure within its deadline;
- ``denials``: nats-py's errors in Agent-Reach terms, and the server's permission refusals;
  ``storestate``: a JetStream write that went unanswered, named ``StoreFull`` when the
  fabric's store takes no writes; ``serverhealth``: the servers' own health (system
  account), and what it says of their store;
- ``link``: nats-py's client, made to keep a connection through refused logins;
  ``linkstate``: the state of a connection (up, or down since when and why);
- ``natsio`` and ``mux``: the call path's socket plumbing (direct writes, inline
  delivery) and its request/reply (one inbox, one timer, batches);
- ``adopt``: a connected nats-py client (or a ``Connection``) given to an Agent or a
  ReachClient, wrapped once into the ``Connection`` they share;
- ``internals``: the private attributes of nats-py that ``link`` and ``natsio`` use,
  checked at the first connection against the supported nats-py releases;
  ``REACH_NATS_INTERNALS=off`` runs every connection on nats-py's public API alone.
"""

from reach.transport.connection import (
    Connection,
    Handler,
    InlineHandler,
    Message,
    RawRequest,
    Subscription,
    connect,
)
from reach.transport.denials import Denials, translate_error
from reach.transport.internals import UnsupportedNatsPy
from reach.transport.jetstream import Stream, StreamMessage
from reach.transport.kv import KVBucket, KVConflict, KVEntry
from reach.transport.mux import ReplyBatch

__all__ = [
    "Connection",
    "Denials",
    "Handler",
    "InlineHandler",
    "KVBucket",
    "KVConflict",
    "KVEntry",
    "Message",
    "RawRequest",
    "ReplyBatch",
    "Stream",
    "StreamMessage",
    "Subscription",
    "UnsupportedNatsPy",
    "connect",
    "translate_error",
]
