"""``python -m bench.discovery [--quick] [--servers URL] [--out FILE]``: the discovery
benchmark. Three parts, each against a real nats-server (one started per part, or the
one given by ``--servers``):

1. **Route choice** — µs per lookup in a :class:`RouteCache` holding 10, 1,000 and 10,000
   instance records, written to REACH_REGISTRY through :class:`RegistryStore` and fed to
   the cache by its KV watch, as a caller's cache is. Two layouts: instances spread over
   capabilities (10 instances each) and all instances in one capability. Lookups: by
   capability (``for_capability``, ``find``), by tag (``find`` with tags), and the full
   choice a :class:`ReachClient` makes on every call (candidates, ``rank()``, breaker).
2. **Announce → visible** — wall time from sending an announce (this process, through a
   registrar in its own process) to the record's arrival in the route cache of a third
   process; p50/p99 over sequential announces.
3. **Registrar load** — a registrar process with 1,000 and 10,000 simulated instances
   heartbeating every 5 s (one light process announces them all, sends properly
   enveloped heartbeats, each instance with a token of its own, and answers the registrar's
   probes): registrar CPU
   from /proc and KV writes/s from the REACH_REGISTRY stream's sequence, over a window.
   Then, on the same instances, the floor: :mod:`bench.rawregistrar` moves the same
   heartbeats and probes at the rates the registrar had with plain nats-py and nothing
   else; its CPU, and the registrar's as a multiple of it.

Child roles (started by the bench, not by hand)::

    python -m bench.discovery child watch URL PREFIX
    python -m bench.discovery child hbsim URL CREDS PREFIX COUNT INTERVAL [--bye] [--signing-key F]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import gc
import heapq
import json
import random
import secrets
import shutil
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence, Sized
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.callpath import server_version
from bench.fabricscale import fabric_tables, fabric_targets
from bench.procs import Child, cpu_seconds, log_dir
from bench.report import (
    NO_MATPLOTLIB,
    machine_info,
    percentile,
    pyplot,
    require_fresh_build,
    write_json,
)

__all__ = ["DEFAULT", "QUICK", "Settings", "main", "run_discovery"]

_ROOT = Path(__file__).resolve().parent.parent
_DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "discovery.json"
_START_TIMEOUT = 60.0
#: registry streams are named after the bucket (JetStream KV convention)
_KV_STREAM = "KV_REACH_REGISTRY"
#: targets of the benchmark issue
TARGET_CHOICE_US = 20.0
TARGET_VISIBLE_P99_MS = 100.0

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Settings:
    #: instances in the route cache (part 1)
    scales: tuple[int, ...] = (10, 1_000, 10_000)
    #: instances per capability in the "spread" layout
    per_capability: int = 10
    #: lookups per operation and scale, at most (fewer if the time budget runs out)
    lookups: int = 2_000
    lookup_budget_sec: float = 2.0
    #: the full choice and its two controls, timed in turn (their p99s are compared)
    choice_lookups: int = 20_000
    #: sequential announces (part 2)
    announces: int = 200
    #: simulated heartbeating instances (part 3)
    load_scales: tuple[int, ...] = (1_000, 10_000)
    #: each measured twice (part 3): every instance in its first day ("young": probed
    #: twice per health interval, as after a fabric-wide deploy) and every instance past
    #: it ("settled": probed once per interval, a fabric's steady state)
    load_ages: tuple[str, ...] = ("young", "settled")
    #: runs of each scale and age (part 3), the ages in turn; the median one is reported
    load_repeats: int = 1
    hb_interval_sec: float = 5.0
    #: after the last announce, before the window: probes and heartbeats reach steady state
    #: (at least two intervals: an instance's first heartbeat comes one interval after it
    #: announced, and past its first day so does its first probe)
    settle_sec: float = 5.0
    window_sec: float = 25.0
    #: announcing stops counting here: a registrar that cannot keep up is measured as it is
    announce_deadline_sec: float = 120.0
    #: heartbeating instances under callers on a cluster (part 4, ``bench.fabricscale``)
    fabric_scales: tuple[int, ...] = (1_000, 10_000)
    fabric_per_capability: int = 10
    caller_capabilities: int = 10
    fabric_window_sec: float = 30.0
    #: announces (then byes) timed to every caller's cache
    fabric_changes: int = 200
    cluster_size: int = 3
    registrars: int = 1
    #: which parts run (1 to 4)
    parts: tuple[int, ...] = (1, 2, 3, 4)


DEFAULT = Settings()
QUICK = Settings(
    scales=(10, 100),
    lookups=200,
    lookup_budget_sec=0.3,
    choice_lookups=300,
    announces=20,
    load_scales=(10, 100),
    hb_interval_sec=1.0,
    settle_sec=1.0,
    window_sec=3.0,
    announce_deadline_sec=30.0,
    fabric_scales=(100,),
    fabric_window_sec=3.0,
    fabric_changes=5,
)


# -- shared: servers, children, numbers ------------------------------------------------


@asynccontextmanager
async def _server(
    servers: str | None, logs: Path, name: str
) -> AsyncIterator[tuple[str, int | None]]:
    """A fresh nats-server for one part (its URL and pid), or the given one (pid None).
    Its config maps heartbeats onto partitions, as every config reach writes does (what
    a fabric started by `reach up` runs: registrars hear only their partitions)."""
    if servers is not None:
        yield servers, None
        return
    from reach.security import natsconf
    from reach.testing import NatsServer

    config = natsconf.write_open_config(logs / f"nats-{name}.conf")
    server = NatsServer(store_dir=logs / f"nats-{name}", config_file=config)
    await server.start()
    try:
        yield server.url, server.pid
    finally:
        await server.stop()


async def _spawn(name: str, args: Sequence[str], logs: Path) -> Child:
    """A child of this module (``child ROLE ...``) that has said READY."""
    return await Child.launch(name, "bench.discovery", ["child", *args], logs)


async def _registrar(url: str, logs: Path, *, settled: bool = False) -> Child:
    """The registrar and token issuer in their own process (``bench.procs registrar``);
    ``settled``: every instance is taken as past its first day (probed once per interval)."""
    workdir = logs / f"registrar-{secrets.token_hex(2)}"
    workdir.mkdir()
    args = ["registrar", url, str(workdir), *(["--settled"] if settled else [])]
    return await Child.start(workdir.name, args, logs)


def _creds_of(registrar_workdir: Path) -> Path | None:
    path = registrar_workdir / "bench.creds"
    return path if path.exists() else None


async def _line(child: Child, word: str, timeout: float) -> str:
    """The rest of the next line of ``child`` that starts with ``word``."""
    assert child.proc.stdout is not None
    async with asyncio.timeout(timeout):
        while True:
            raw = await child.proc.stdout.readline()
            if not raw:
                raise RuntimeError(f"{child.name} exited; its log:\n{child.tail()}")
            line = raw.decode(errors="replace").rstrip("\n")
            if line.startswith(word):
                return line[len(word) :].strip()


def _stats(values: Sequence[float], digits: int = 2) -> dict[str, Any]:
    if not values:
        return {"count": 0, "median": None, "p99": None, "mean": None, "max": None}
    return {
        "count": len(values),
        "median": round(percentile(values, 0.5), digits),
        "p99": round(percentile(values, 0.99), digits),
        "mean": round(sum(values) / len(values), digits),
        "max": round(max(values), digits),
    }


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


# -- part 1: route choice from the cache -----------------------------------------------

#: what the records look like: a capability with a small input schema and two tags
_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
_REGIONS = 4
_LOOKUPS = (
    ("for_capability", "list(cache.for_capability(cap))"),
    ("find_capability", "cache.find(cap)"),
    ("find_capability_tag", "cache.find(cap, tags=[region])"),
    ("find_tag", "cache.find(tags=[team]): tag only, no capability"),
    ("choose", "client choice: entries + choose() + breaker, as ReachClient._choose"),
    (
        "choose_all",
        "the same choice sampling among all candidates, no aperture (the design before it),"
        " timed in turn with choose",
    ),
    ("choose_tag", "client choice with a tag: candidates from the (capability, tag) index"),
    ("control", "a fixed loop as long as choose's median, timed in turn with it: jitter"),
    ("control_memory", "8 random reads among the records, timed in turn with choose: memory"),
)


@dataclass(frozen=True)
class _Layout:
    name: str
    prefix: str
    per_capability: int | None  # None: every instance in one capability

    def capability(self, i: int) -> str:
        if self.per_capability is None:
            return f"{self.prefix}-cap"
        return f"{self.prefix}-cap{i // self.per_capability}"

    def team(self, i: int) -> str:
        return f"team-{0 if self.per_capability is None else i // self.per_capability}"

    def capabilities(self, count: int) -> list[str]:
        return sorted({self.capability(i) for i in range(count)})


def _record(layout: _Layout, i: int, now: float) -> Any:
    """A registry record like the registrar writes; a realistic mix of states and loads."""
    from reach.wire.models import Instance, Manifest, Transition

    version = "1.3.0-rc.1" if i % 10 == 9 else "1.2.3"
    manifest = Manifest.model_validate(
        {
            "agent_id": f"{layout.prefix}-{i}",
            "agent_name": layout.prefix,
            "version": version,
            "max_concurrency": 16,
            "capabilities": [
                {
                    "name": layout.capability(i),
                    "description": "a capability of the discovery benchmark",
                    "input_schema": _SCHEMA,
                    "tags": [f"region-{i % _REGIONS}", layout.team(i)],
                    "latency_sla_ms": 200,
                    "security_level": 2,
                }
            ],
            # long: a registrar on a shared server (--servers) leaves these alone for an hour
            "health": {"interval_sec": 3600, "timeout_sec": 3, "failures_before_unhealthy": 2},
        }
    )
    status = "unhealthy" if i % 97 == 96 else "degraded" if i % 50 == 49 else "healthy"
    return Instance(
        manifest=manifest,
        instance_id=secrets.token_hex(8),
        status=status,
        status_reason="heartbeat ok" if status == "healthy" else "bench",
        registered_at=now,
        last_heartbeat_at=now,
        in_flight=i % 5,
        max_concurrency=16,
        completed=i * 3,
        memory_bytes=80_000_000,
        registrar_id="reg-bench",
        transitions=[Transition(at=now, status="healthy", reason="announced")],
    )


async def _write_records(store: Any, layout: _Layout, first: int, last: int) -> None:
    """Instance records alone (no route keys: the caches here follow every record)."""
    from reach.wire import subjects
    from reach.wire.modelcodec import encode_model

    now = time.time()
    batch = 256
    for start in range(first, last, batch):
        records = [_record(layout, i, now) for i in range(start, min(last, start + batch))]
        await asyncio.gather(
            *(store.bucket.create(subjects.agent_key(r.agent_id), encode_model(r)) for r in records)
        )


async def _delete_records(store: Any, layout: _Layout, count: int) -> None:
    batch = 256
    for start in range(0, count, batch):
        ids = [f"{layout.prefix}-{i}" for i in range(start, min(count, start + batch))]
        await asyncio.gather(
            *(store.bucket.delete(f"agent.{a}") for a in ids), return_exceptions=True
        )


class _Chooser:
    """The caller's side of a route choice, as ``ReachClient._prepare`` + ``_choose``."""

    def __init__(self, cache: Any) -> None:
        from reach.resilience.breaker import BreakerBoard

        self.cache = cache
        self.breakers = BreakerBoard()

    def warm(self) -> None:
        """Latency seen for half of the instances, breakers for all: a caller in use."""
        peers = self.cache.peers
        for n, inst in enumerate(self.cache.all()):
            if n % 2 == 0:
                peers.observe(inst.agent_id, 5.0 + n % 40)
            self.breakers.get(inst.agent_id)

    def choose(self, capability: str, tags: Sequence[str] = (), *, focus: bool = True) -> Any:
        """What ReachClient does before every call: candidates, their contract, the choice
        (``focus=False``: without the aperture, sampling among all candidates)."""
        from reach.caller.routing import APERTURE_ABOVE, choose

        candidates = self.cache.entries(capability, tags)
        if candidates:  # ReachClient._spec: the capability's contract
            candidates[0].spec  # noqa: B018
        index = (
            self.cache.index_of(capability, tuple(tags), candidates)
            if focus and len(candidates) > APERTURE_ABOVE
            else None
        )
        aperture = index.aperture if index is not None else None
        chosen, _ = choose(candidates, capability, breakers=self.breakers, aperture=aperture)
        return chosen


def _time_lookups(
    lookup: Callable[[int], object], count: int, budget_sec: float
) -> tuple[list[float], int]:
    """µs per call of ``lookup(k)`` for k = 0, 1, ...; stops early when over budget."""
    gc.collect()
    clock = time.perf_counter_ns
    samples: list[float] = []
    size = 0
    give_up = clock() + int(budget_sec * 1e9)
    for k in range(count):
        started = clock()
        found = lookup(k)
        ended = clock()
        samples.append((ended - started) / 1000)
        if k == 0:
            size = len(found) if isinstance(found, Sized) else int(found is not None)
        if k >= 30 and ended > give_up:
            break
    return samples, size


def _time_interleaved(
    lookups: dict[str, Callable[[int], object]], count: int, budget_sec: float
) -> dict[str, list[float]]:
    """µs per call of each lookup, timed in turn sample by sample (k = 0, 1, ...): every
    one of them sees the same moments of this machine, so their tails compare."""
    gc.collect()
    clock = time.perf_counter_ns
    samples: dict[str, list[float]] = {name: [] for name in lookups}
    timed = [(lookup, samples[name].append) for name, lookup in lookups.items()]
    give_up = clock() + int(budget_sec * 1e9)
    for k in range(count):
        for lookup, keep in timed:
            started = clock()
            lookup(k)
            keep((clock() - started) / 1000)
        if k >= 30 and clock() > give_up:
            break
    return samples


def _measure_cache(
    cache: Any, layout: _Layout, count: int, settings: Settings
) -> dict[str, dict[str, Any]]:
    caps = layout.capabilities(count)
    chooser = _Chooser(cache)
    chooser.warm()

    def cap(k: int) -> str:
        return caps[k % len(caps)]

    def cap_index(k: int) -> int:
        return (k % len(caps)) * (layout.per_capability or 0)

    def choose(k: int) -> object:
        return chooser.choose(cap(k))

    lookups: dict[str, Callable[[int], object]] = {
        "for_capability": lambda k: list(cache.for_capability(cap(k))),
        "find_capability": lambda k: cache.find(cap(k)),
        "find_capability_tag": lambda k: cache.find(cap(k), tags=[f"region-{k % _REGIONS}"]),
        "find_tag": lambda k: cache.find(tags=[layout.team(cap_index(k))]),
        "choose_tag": lambda k: chooser.choose(cap(k), [f"region-{k % _REGIONS}"]),
    }
    out: dict[str, dict[str, Any]] = {}
    for name, lookup in lookups.items():
        lookup(0)  # warm: first-use costs (breakers, interned strings) out of the samples
        samples, size = _time_lookups(lookup, settings.lookups, settings.lookup_budget_sec)
        out[name] = {**_stats(samples), "unit": "us", "result_size": size}
    # the choice beside its two controls, in turn: what the machine adds at p99 to
    # anything as long (the loop) and to anything that reads records at random (memory)
    choose(0)
    probe, size = _time_lookups(choose, 200, 1.0)
    spin = _spin_lookup(statistics.median(probe))
    touch = _memory_lookup(cache)
    timed = _time_interleaved(
        {
            "choose": choose,
            # another capability than the choice just timed, whose routes it left warm
            "choose_all": lambda k: chooser.choose(cap(k + len(caps) // 2), focus=False),
            "control": spin,
            "control_memory": touch,
        },
        settings.choice_lookups,
        settings.lookup_budget_sec * 4,
    )
    for name in ("choose", "choose_all", "control", "control_memory"):
        out[name] = {
            **_stats(timed[name]),
            "unit": "us",
            "result_size": size if name.startswith("choose") else 1,
        }
    return {name: out[name] for name, _ in _LOOKUPS}


def _memory_lookup(cache: Any) -> Callable[[int], object]:
    """Eight random reads among the cache's records (as a choice samples eight among
    thousands of instances), with no logic around them: what this machine's memory adds
    at p99 to anything that touches records at random."""
    records = list(cache.all())
    count = len(records)
    draw = random.random

    def touch(k: int) -> int:
        total = 0
        for _ in range(8):
            record = records[int(draw() * count)]
            total += record.in_flight + len(record.agent_id) + len(record.status)
        return total

    touch(0)
    return touch


def _spin(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


def _spin_lookup(median_us: float) -> Callable[[int], object]:
    """A fixed loop of pure Python as long as a choice's median: what this machine's own
    jitter (interrupts, neighbours, frequency) adds at p99 to anything that takes that
    long."""
    probe, _ = _time_lookups(lambda k: _spin(1000), 200, 1.0)
    per_step = statistics.median(probe) / 1000
    steps = max(1, round(median_us / per_step)) if per_step > 0 else 1
    return lambda k: _spin(steps)


def _changes_at_least(target: int) -> Callable[[Any], bool]:
    def reached(cache: Any) -> bool:
        return bool(cache.changes >= target)

    return reached


async def _route_choice_layout(
    url: str, layout: _Layout, settings: Settings, progress: Progress
) -> list[dict[str, Any]]:
    from reach.caller.routecache import RouteCache
    from reach.registry.store import RegistryStore
    from reach.transport import connect

    rows: list[dict[str, Any]] = []
    writer = await connect([url], name="bench-discovery-writer")
    reader = await connect([url], name="bench-discovery-cache")
    try:
        store = await RegistryStore.open(writer)
        watched = await RegistryStore.open(reader, create=False)
        cache = RouteCache(watched)
        await cache.start()
        base = cache.changes
        have = 0
        try:
            for count in settings.scales:
                started = time.perf_counter()
                await _write_records(store, layout, have, count)
                written = time.perf_counter() - started
                # the cache follows the watch; only records are created, so one change each
                await cache.wait_for(_changes_at_least(base + count), timeout=300)
                visible = time.perf_counter() - started
                have = count
                cold = RouteCache(watched)  # a caller starting now: its initial sync
                started = time.perf_counter()
                await cold.start(timeout=300)
                cold_sync = time.perf_counter() - started
                await cold.stop()
                lookups = _measure_cache(cache, layout, count, settings)
                rows.append(
                    {
                        "layout": layout.name,
                        "instances": count,
                        "capabilities": len(layout.capabilities(count)),
                        "populate_sec": round(written, 3),
                        "populate_visible_sec": round(visible, 3),
                        "cold_sync_ms": round(cold_sync * 1000, 1),
                        "lookups": lookups,
                    }
                )
                progress(
                    f"route choice {layout.name} {count:>6}: choose median"
                    f" {lookups['choose']['median']} µs, p99 {lookups['choose']['p99']} µs"
                    f" (populated in {written:.1f}s, cold sync {cold_sync * 1000:.0f} ms)"
                )
        finally:
            await cache.stop()
            await _delete_records(store, layout, have)
    finally:
        await reader.close()
        await writer.close()
    return rows


def record_decode_us(samples: int = 300) -> dict[str, Any]:
    """µs to decode one registry record, as every route cache and the registrar do for each
    KV change they watch: as written here, and the same record without a JSON Schema."""
    from reach.registry.store import decode_instance
    from reach.wire.modelcodec import encode_model

    layout = _Layout("decode", "dec", 10)
    now = time.time()
    records = [_record(layout, i, now) for i in range(samples)]
    bare = [
        r.model_copy(
            update={
                "manifest": r.manifest.model_copy(
                    update={
                        "capabilities": [
                            c.model_copy(update={"input_schema": {}, "output_schema": {}})
                            for c in r.manifest.capabilities
                        ]
                    }
                )
            }
        )
        for r in records
    ]
    # the same agents' records after a heartbeat: their manifests are known by then
    beats = [r.model_copy(update={"last_heartbeat_at": now + 5.0, "in_flight": 1}) for r in records]
    out: dict[str, Any] = {}
    for name, batch in (
        ("with_input_schema", records),
        ("without_schemas", bare),
        ("after_heartbeat", beats),
    ):
        blobs = [encode_model(r) for r in batch]
        gc.collect()
        times: list[float] = []
        for blob in blobs:
            started = time.perf_counter_ns()
            decode_instance(blob)
            times.append((time.perf_counter_ns() - started) / 1000)
        out[name] = {**_stats(times), "unit": "us", "record_bytes": len(blobs[0])}
    return out


async def route_choice(
    servers: str | None, logs: Path, settings: Settings, progress: Progress
) -> list[dict[str, Any]]:
    run = secrets.token_hex(2)
    layouts = [
        _Layout("spread", f"rc{run}s", settings.per_capability),
        _Layout("one_capability", f"rc{run}o", None),
    ]
    rows: list[dict[str, Any]] = []
    for layout in layouts:
        async with _server(servers, logs, f"route-{layout.name}") as (url, _pid):
            rows += await _route_choice_layout(url, layout, settings, progress)
    return rows


# -- part 2: announce → visible in another process's route cache -----------------------


def sim_capability(n: int) -> str:
    """The ``n``-th capability of simulated instances spread over capabilities."""
    return f"bench-sim-{n}"


def _sim_manifest(agent_id: str, interval: float, capability: str = "bench-sim") -> Any:
    from reach.wire.models import Manifest

    return Manifest.model_validate(
        {
            "agent_id": agent_id,
            "agent_name": agent_id.rsplit("-", 1)[0],
            "version": "1.0.0",
            "max_concurrency": 16,
            "capabilities": [
                {
                    "name": capability,
                    "input_schema": _SCHEMA,
                    "tags": ["bench", f"shard-{hash(agent_id) % 8}"],
                    "latency_sla_ms": 200,
                    "security_level": 1,
                }
            ],
            "health": {"interval_sec": interval, "timeout_sec": 2, "failures_before_unhealthy": 2},
        }
    )


class _Control:
    """Enveloped control messages (announce, heartbeat, bye): each agent's with its own
    token when ``tokens`` has one (as on a fabric, where every agent logs in with its own
    credential), else with this process's."""

    def __init__(self, conn: Any, security: Any) -> None:
        self.conn = conn
        self.security = security
        self.tokens: dict[str, str] = {}
        #: agent id → the capability it serves (else ``bench-sim``)
        self.capability_of: dict[str, str] = {}

    async def sign_tokens(self, key_file: Path, agent_ids: Sequence[str]) -> None:
        """A credential record and a token for each of ``agent_ids``, bound to it and to
        the simulated capability, signed with the registrar's key (what each would get at
        login with a credential from ``reach creds add ID --agent-id ID --cap bench-sim``;
        the registrar refuses an announce its credential does not allow)."""
        from reach.security.credentials import ClientRecord
        from reach.security.tokens import KeyRing, TokenIssuer
        from reach.wire import subjects
        from reach.wire.modelcodec import encode_model

        issuer = TokenIssuer(KeyRing.load_or_generate(key_file))
        bucket = await self.conn.key_value(subjects.CREDENTIALS_BUCKET, create=False)
        now = time.time()
        records = []
        for agent_id in agent_ids:
            record = ClientRecord(
                client_id=agent_id,
                level=1,
                agent_id=agent_id,
                capabilities=(self.capability_of.get(agent_id, "bench-sim"),),
                secret_hash="-",
                created_at=now,
            )
            records.append(record)
            self.tokens[agent_id] = issuer.issue(record)
        for start in range(0, len(records), 256):
            await asyncio.gather(
                *(
                    bucket.put(f"client.{r.client_id}", encode_model(r))
                    for r in records[start : start + 256]
                )
            )

    def request(self, agent_id: str, model: Any) -> bytes:
        from reach.wire import envelope
        from reach.wire.modelcodec import encode_model

        token = self.tokens.get(agent_id) or self.security.token()
        meta = envelope.RequestMeta(call_id=secrets.token_hex(8), caller=agent_id, token=token)
        return envelope.pack_request(meta, encode_model(model))

    async def announce(
        self, agent_id: str, instance_id: str, interval: float, timeout: float = 30.0
    ) -> bool:
        from reach.wire import envelope, subjects
        from reach.wire.modelcodec import decode_model
        from reach.wire.models import AnnounceReply, AnnounceRequest

        capability = self.capability_of.get(agent_id, "bench-sim")
        request = AnnounceRequest(
            manifest=_sim_manifest(agent_id, interval, capability),
            instance_id=instance_id,
            started_at=time.time(),
        )
        raw = await self.conn.request(
            subjects.announce(agent_id), self.request(agent_id, request), timeout=timeout
        )
        reply = envelope.unpack_reply(raw)
        if not reply.ok:
            raise RuntimeError(f"announce of {agent_id} refused: {reply.description}")
        return decode_model(AnnounceReply, reply.body).accepted

    async def bye(self, agent_id: str, instance_id: str) -> None:
        from reach.wire import subjects
        from reach.wire.models import Bye

        bye = Bye(agent_id=agent_id, instance_id=instance_id, reason="bench done")
        with contextlib.suppress(Exception):
            await self.conn.request(subjects.bye(agent_id), self.request(agent_id, bye), 5.0)

    @classmethod
    async def open(cls, url: str, creds: Path | None, name: str) -> _Control:
        from reach.security.credentials import CredentialsFile
        from reach.security.membership import FabricSecurity
        from reach.transport import connect

        conn = await connect([url], name=name)
        credentials = CredentialsFile.read(creds) if creds is not None else None
        security = await FabricSecurity.join(
            conn, credentials, verify=False, need_token=credentials is not None
        )
        return cls(conn, security)

    async def close(self) -> None:
        await self.security.close()
        await self.conn.close()


async def visibility(
    servers: str | None, logs: Path, settings: Settings, progress: Progress
) -> dict[str, Any]:
    prefix = f"vis{secrets.token_hex(2)}"
    async with _server(servers, logs, "visibility") as (url, _pid):
        registrar = await _registrar(url, logs)
        try:
            creds = _creds_of(logs / registrar.name)
            watcher = await _spawn("watcher", ["watch", url, prefix], logs)
            try:
                result = await _announce_and_watch(watcher, url, creds, prefix, settings, progress)
                result["server_version"] = await asyncio.to_thread(server_version, url)
                return result
            finally:
                await watcher.stop()
        finally:
            await registrar.stop()


async def _announce_and_watch(
    watcher: Child,
    url: str,
    creds: Path | None,
    prefix: str,
    settings: Settings,
    progress: Progress,
) -> dict[str, Any]:
    seen: dict[str, asyncio.Future[float]] = {}
    loop = asyncio.get_running_loop()

    async def read_seen() -> None:
        while True:
            rest = await _line(watcher, "SEEN", 3600)
            agent_id, at = rest.split()
            fut = seen.setdefault(agent_id, loop.create_future())
            if not fut.done():
                fut.set_result(float(at))

    reader = asyncio.create_task(read_seen())
    control = await _Control.open(url, creds, "bench-announcer")
    visible_ms: list[float] = []
    reply_ms: list[float] = []
    missed = 0
    announced: list[tuple[str, str]] = []
    try:
        for n in range(settings.announces):
            agent_id, instance_id = f"{prefix}-{n}", secrets.token_hex(8)
            fut = seen.setdefault(agent_id, loop.create_future())
            sent = time.time()
            accepted = await control.announce(agent_id, instance_id, 60.0)
            replied = time.time()
            if not accepted:
                raise RuntimeError(f"the registrar did not accept {agent_id}")
            announced.append((agent_id, instance_id))
            reply_ms.append((replied - sent) * 1000)
            try:
                at = await asyncio.wait_for(asyncio.shield(fut), 5.0)
            except TimeoutError:
                missed += 1
                continue
            visible_ms.append((at - sent) * 1000)
            # calls are not back to back: each announce meets an idle fabric
            await asyncio.sleep(random.uniform(0.005, 0.02))
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, RuntimeError):
            await reader
        await asyncio.gather(*(control.bye(a, i) for a, i in announced))
        await control.close()
    result: dict[str, Any] = {
        "announces": settings.announces,
        "not_seen_within_5s": missed,
        "visible_ms": _stats(visible_ms),
        "announce_reply_ms": _stats(reply_ms),
        "samples_visible_ms": [round(v, 3) for v in visible_ms],
    }
    progress(
        f"announce → visible: p50 {result['visible_ms']['median']} ms,"
        f" p99 {result['visible_ms']['p99']} ms ({missed} not seen)"
    )
    return result


async def _child_watch(url: str, prefix: str) -> None:
    """Print ``SEEN agent_id unix_time`` when a record of ``prefix`` arrives in the cache."""
    from reach.caller.routecache import RouteCache
    from reach.registry.store import RegistryStore
    from reach.transport import connect

    conn = await connect([url], name="bench-watcher")
    cache = RouteCache(await RegistryStore.open(conn))
    out = sys.stdout

    def on_change(agent_id: str, inst: object) -> None:
        if inst is not None and agent_id.startswith(prefix):
            out.write(f"SEEN {agent_id} {time.time():.6f}\n")
            out.flush()

    cache.on_change(on_change)
    await cache.start()
    print("READY", flush=True)
    try:
        await _until_stdin_closes({})
    finally:
        await cache.stop()
        await conn.close()


# -- part 3: registrar CPU and KV writes under heartbeats ------------------------------


async def _stream_state(js: Any) -> tuple[int, int]:
    """(last sequence, messages) of the registry's stream: writes so far and live keys."""
    info = await js.stream_info(_KV_STREAM)
    return int(info.state.last_seq), int(info.state.messages)


async def registrar_load(
    servers: str | None, logs: Path, settings: Settings, progress: Progress
) -> list[dict[str, Any]]:
    """Each scale at each age, ``load_repeats`` times in turn (young, settled, young, …:
    a slow minute of the machine falls on both); a row per scale and age, the run whose
    multiple of its floor is the median, with every run's figures under ``runs``."""
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for count in settings.load_scales:
        for repeat in range(settings.load_repeats):
            for age in settings.load_ages:
                name = f"load-{count}-{age}-{repeat}"
                async with _server(servers, logs, name) as (url, server_pid):
                    try:
                        row = await _load_case(
                            url, server_pid, count, age, servers, logs, settings, progress
                        )
                    except Exception as exc:  # one broken case must not lose the others'
                        progress(
                            f"registrar load {count} {age}: failed: {type(exc).__name__}: {exc}"
                        )
                        row = {
                            "instances": count,
                            "age": age,
                            "error": f"{type(exc).__name__}: {exc}",
                        }
                runs.setdefault((count, age), []).append(row)
    return [_median_run(rows) for rows in runs.values()]


def _median_run(rows: list[dict[str, Any]]) -> dict[str, Any]:
    measured = [r for r in rows if r.get("registrar_over_raw_floor") is not None]
    if not measured:
        return rows[0]
    measured.sort(key=lambda r: r["registrar_over_raw_floor"])
    median = dict(measured[(len(measured) - 1) // 2])
    median["runs"] = [
        {
            "registrar_cpu_pct": r.get("registrar_cpu_pct"),
            "raw_floor_cpu_pct": r["raw_floor"]["cpu_pct"] if "raw_floor" in r else None,
            "registrar_over_raw_floor": r.get("registrar_over_raw_floor"),
            "error": r.get("error"),
        }
        for r in rows
    ]
    return median


async def _load_case(
    url: str,
    server_pid: int | None,
    count: int,
    age: str,
    servers: str | None,
    logs: Path,
    settings: Settings,
    progress: Progress,
) -> dict[str, Any]:
    import nats

    prefix = f"sim{secrets.token_hex(2)}"
    registrar = await _registrar(url, logs, settled=age == "settled")
    nc = await nats.connect(url, name="bench-stream-info")
    sim: Child | None = None
    try:
        creds = _creds_of(logs / registrar.name)
        args = ["hbsim", url, str(creds or "-"), prefix, str(count), str(settings.hb_interval_sec)]
        if servers is not None:
            args.append("--bye")  # a shared server keeps no records of ours
        key = logs / registrar.name / "signing.key"
        if creds is not None and key.exists():
            # each instance speaks with a token of its own, as on a fabric: the registrar
            # checks as many distinct tokens as there are instances
            args += ["--signing-key", str(key)]
        started = time.perf_counter()
        sim = await _spawn(f"hbsim-{count}", args, logs)
        try:
            await _line(sim, "ANNOUNCED", settings.announce_deadline_sec)
        except TimeoutError:
            progress(
                f"registrar load {count:>6} {age}: announces not done after"
                f" {settings.announce_deadline_sec:.0f}s: measuring anyway"
            )
        announce_sec = round(time.perf_counter() - started, 1)
        # an instance's first probe is written (its first latency), and the heartbeat
        # after it may be; past its first day that probe comes one interval after the
        # announce: two intervals, so the window sees the steady state at either age
        await asyncio.sleep(max(settings.settle_sec, 2 * settings.hb_interval_sec))
        js = nc.jetstream()
        announce = await _ask_stats(sim)  # also resets the window counters
        progress(
            f"registrar load {count:>6} {age}: {announce['announced']} announced in {announce_sec}s"
            f" ({announce['announce_failed']} refused or failed); measuring"
            f" {settings.window_sec:.0f}s"
        )
        seq0, _ = await _stream_state(js)
        cpu0 = (registrar.cpu_seconds(), cpu_seconds(server_pid), sim.cpu_seconds())
        t0 = time.perf_counter()
        await asyncio.sleep(settings.window_sec)
        seq1, keys = await _stream_state(js)
        cpu1 = (registrar.cpu_seconds(), cpu_seconds(server_pid), sim.cpu_seconds())
        seconds = time.perf_counter() - t0
        stats = await _ask_stats(sim)
        # the floor: the same simulated instances, their heartbeats answered and their
        # probes sent at the rates the registrar had, by plain nats-py doing nothing else
        await registrar.stop()
        floor = await _raw_floor(url, prefix, count, stats["probes"] / seconds, sim, logs, settings)
    finally:
        # the registrar first: probes of a stopped simulator would fail and be logged
        await registrar.stop()
        if sim is not None:
            await sim.stop()
        await nc.close()
    errors_logged = _count_lines(registrar.log, "registrar failed on")

    def pct(i: int) -> float | None:
        used = _delta(cpu0[i], cpu1[i])
        return None if used is None else round(100 * used / seconds, 1)

    row = {
        "instances": count,
        "age": age,
        "interval_sec": settings.hb_interval_sec,
        "window_sec": round(seconds, 2),
        "announce_sec": announce_sec,
        "announce_done_sec": announce["announce_done_sec"],
        "announced": stats["announced"],
        "announce_failed": stats["announce_failed"],
        "registrar_cpu_pct": pct(0),
        "server_cpu_pct": pct(1),
        "simulator_cpu_pct": pct(2),
        "kv_writes_per_sec": round((seq1 - seq0) / seconds, 1),
        "expected_heartbeats_per_sec": round(count / (0.95 * settings.hb_interval_sec), 1),
        "heartbeats_per_sec": round(stats["hb_sent"] / seconds, 1),
        "heartbeat_replies_ok": stats["hb_ok"],
        "heartbeat_replies_missing": max(0, stats["hb_sent"] - stats["hb_replies"]),
        "heartbeat_reannounce": stats["hb_reannounce"],
        "heartbeat_reply_ms": stats["hb_reply_ms"],
        "probes_per_sec": round(stats["probes"] / seconds, 1),
        "registry_keys": keys,
        "registrar_errors_logged": errors_logged,
        "registrar_cpu_ms_per_heartbeat": None,
    }
    # the registrar kept up if every instance got in and every heartbeat got its reply
    row["registrar_kept_up"] = (
        stats["announced"] == count
        and stats["hb_reannounce"] == 0
        and row["heartbeat_replies_missing"] <= 0.02 * stats["hb_sent"]
        and row["heartbeats_per_sec"] >= 0.9 * row["expected_heartbeats_per_sec"]
    )
    used = _delta(cpu0[0], cpu1[0])
    if used is not None and stats["hb_sent"]:
        row["registrar_cpu_ms_per_heartbeat"] = round(1000 * used / stats["hb_sent"], 3)
    row["raw_floor"] = floor
    if row["registrar_cpu_pct"] is not None and floor["cpu_pct"]:
        row["registrar_over_raw_floor"] = round(row["registrar_cpu_pct"] / floor["cpu_pct"], 2)
    progress(
        f"registrar load {count:>6} {age}: registrar {row['registrar_cpu_pct']}% CPU,"
        f" {row['kv_writes_per_sec']} KV writes/s, {row['heartbeats_per_sec']} heartbeats/s,"
        f" {row['probes_per_sec']} probes/s, heartbeat reply p99"
        f" {row['heartbeat_reply_ms']['p99']} ms"
    )
    return row


async def _raw_floor(
    url: str,
    prefix: str,
    count: int,
    probes_per_sec: float,
    sim: Child,
    logs: Path,
    settings: Settings,
) -> dict[str, Any]:
    """CPU of :mod:`bench.rawregistrar` answering ``sim``'s heartbeats and probing its
    instances at ``probes_per_sec``, over the same window as the registrar's."""
    raw = await Child.launch(
        f"rawregistrar-{count}",
        "bench.rawregistrar",
        [url, prefix, str(count), f"{probes_per_sec:.1f}"],
        logs,
    )
    try:
        await asyncio.sleep(settings.settle_sec)
        await _ask_stats(sim)  # the window starts now
        await _ask_stats(raw)
        cpu0 = raw.cpu_seconds()
        t0 = time.perf_counter()
        await asyncio.sleep(settings.window_sec)
        cpu1 = raw.cpu_seconds()
        seconds = time.perf_counter() - t0
        counts = await _ask_stats(raw)
        seen = await _ask_stats(sim)
    finally:
        await raw.stop()
    used = _delta(cpu0, cpu1)
    return {
        "cpu_pct": None if used is None else round(100 * used / seconds, 1),
        "heartbeats_per_sec": round(counts["heartbeats"] / seconds, 1),
        "probes_per_sec": round(counts["probes"] / seconds, 1),
        "probe_replies_per_sec": round(counts["probe_replies"] / seconds, 1),
        "heartbeat_replies_ok": seen["hb_ok"],
    }


def _count_lines(path: Path, needle: str) -> int:
    try:
        with path.open(errors="replace") as lines:
            return sum(1 for line in lines if needle in line)
    except OSError:
        return 0


async def _ask_stats(sim: Child) -> dict[str, Any]:
    assert sim.proc.stdin is not None
    sim.proc.stdin.write(b"STATS\n")
    await sim.proc.stdin.drain()
    stats: dict[str, Any] = json.loads(await _line(sim, "STATS", 30))
    return stats


class _Simulator:
    """Many instances in one process: announce, heartbeat every interval, answer probes."""

    def __init__(
        self, control: _Control, prefix: str, count: int, interval: float, run: str
    ) -> None:
        self.control = control
        self.interval = interval
        self.ids = [f"{prefix}-{n}" for n in range(count)]
        self.instance_ids = [f"{run}-{n}" for n in range(count)]
        self.index = {agent_id: n for n, agent_id in enumerate(self.ids)}
        self.seq = [0] * count
        self.sent_at = [0.0] * count
        self.due: list[tuple[float, int]] = []
        self.inbox = control.conn.new_inbox()
        self.probe_replies: dict[str, bytes] = {}
        self.announced = 0
        self.announce_failed = 0
        self.announce_done_sec: float | None = None
        self.window: dict[str, Any] = {}
        self.reset()

    def reset(self) -> dict[str, Any]:
        old = self.window
        self.window = {
            "hb_sent": 0,
            "hb_replies": 0,
            "hb_ok": 0,
            "hb_reannounce": 0,
            "probes": 0,
            "latencies": [],
        }
        return old

    async def start(self) -> None:
        from reach.wire import subjects

        conn = self.control.conn
        # one answer per probe whichever process gets it: the instance id is known to all
        await conn.subscribe(subjects.probe("*"), self.on_probe)
        await conn.subscribe(f"{self.inbox}.*", self.on_reply)
        await conn.flush()

    async def announce_all(self, batch: int = 200) -> float:
        started = time.perf_counter()
        for first in range(0, len(self.ids), batch):
            indexes = range(first, min(len(self.ids), first + batch))
            await asyncio.gather(*(self.announce(n) for n in indexes))
        self.announce_done_sec = round(time.perf_counter() - started, 2)
        return self.announce_done_sec

    async def announce(self, n: int) -> None:
        try:
            ok = await self.control.announce(self.ids[n], self.instance_ids[n], self.interval)
        except Exception as exc:
            ok = False
            if not self.announce_failed:  # the first one says why
                print(f"announce of {self.ids[n]} failed: {exc}", file=sys.stderr, flush=True)
        if not ok:
            self.announce_failed += 1
            return
        self.announced += 1
        # the first heartbeat one interval later, as Agent._heartbeat_loop sleeps first
        heapq.heappush(self.due, (time.monotonic() + self._period(), n))

    def _period(self) -> float:
        return self.interval * random.uniform(0.9, 1.0)

    async def heartbeat_loop(self) -> None:
        from reach.wire import subjects
        from reach.wire.models import Heartbeat

        while True:
            now = time.monotonic()
            while self.due and self.due[0][0] <= now:
                _, n = heapq.heappop(self.due)
                self.seq[n] += 1
                hb = Heartbeat(
                    agent_id=self.ids[n],
                    instance_id=self.instance_ids[n],
                    seq=self.seq[n],
                    sent_at=time.time(),
                    in_flight=n % 3,
                    max_concurrency=16,
                    completed=self.seq[n] * 7,
                    last_completion_at=time.time(),
                    memory_bytes=80_000_000,
                )
                self.sent_at[n] = time.perf_counter()
                await self.control.conn.publish(
                    subjects.heartbeat(self.ids[n]),
                    self.control.request(self.ids[n], hb),
                    reply=f"{self.inbox}.{n}",
                )
                self.window["hb_sent"] += 1
                heapq.heappush(self.due, (now + self._period(), n))
            wait = self.due[0][0] - time.monotonic() if self.due else 0.05
            await asyncio.sleep(min(0.05, max(0.001, wait)))

    async def on_reply(self, msg: Any) -> None:
        from reach.wire import envelope
        from reach.wire.modelcodec import decode_model
        from reach.wire.models import HeartbeatReply

        n = int(msg.subject.rsplit(".", 1)[1])
        self.window["hb_replies"] += 1
        self.window["latencies"].append((time.perf_counter() - self.sent_at[n]) * 1000)
        reply = envelope.unpack_reply(msg.data)
        if not reply.ok:
            return
        answer = decode_model(HeartbeatReply, reply.body)
        if answer.ok:
            self.window["hb_ok"] += 1
        elif answer.reannounce:
            self.window["hb_reannounce"] += 1
            # evicted (the registrar fell behind): announce again, as an Agent does
            with contextlib.suppress(Exception):
                await self.control.announce(self.ids[n], self.instance_ids[n], self.interval)

    async def on_probe(self, msg: Any) -> None:
        from reach.wire import envelope, subjects
        from reach.wire.modelcodec import encode_model
        from reach.wire.models import ProbeReply

        agent_id = subjects.last_token(msg.subject)
        data = self.probe_replies.get(agent_id)
        if data is None:
            n = self.index.get(agent_id)
            if n is None:
                return
            answer = ProbeReply(
                agent_id=agent_id,
                instance_id=self.instance_ids[n],
                in_flight=0,
                max_concurrency=16,
            )
            data = envelope.pack_ok(encode_model(answer), agent_id)
            self.probe_replies[agent_id] = data
        self.window["probes"] += 1
        await self.control.conn.respond(msg, data)

    def stats(self) -> dict[str, Any]:
        window = self.reset()
        latencies: list[float] = window.pop("latencies")
        return {
            **window,
            "hb_reply_ms": _stats(latencies),
            "announced": self.announced,
            "announce_failed": self.announce_failed,
            "announce_done_sec": self.announce_done_sec,
        }


async def _child_hbsim(
    url: str,
    creds: Path | None,
    prefix: str,
    count: int,
    interval: float,
    bye: bool,
    signing_key: Path | None,
    per_capability: int = 0,
) -> None:
    control = await _Control.open(url, creds, "bench-hbsim")
    sim = _Simulator(control, prefix, count, interval, secrets.token_hex(4))
    if per_capability:  # instances spread over capabilities: bench-sim-0, bench-sim-1, …
        control.capability_of = {
            agent_id: sim_capability(n // per_capability) for n, agent_id in enumerate(sim.ids)
        }
    if signing_key is not None:
        await control.sign_tokens(signing_key, sim.ids)
    await sim.start()
    beating = asyncio.create_task(sim.heartbeat_loop())
    print("READY", flush=True)
    try:

        async def announce() -> None:
            seconds = await sim.announce_all()
            print(f"ANNOUNCED {seconds}", flush=True)

        def stats() -> None:
            print(f"STATS {json.dumps(sim.stats())}", flush=True)

        announcing = asyncio.create_task(announce())
        await _until_stdin_closes({"STATS": stats})
        announcing.cancel()
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating
        if bye:
            for first in range(0, count, 200):
                await asyncio.gather(
                    *(
                        control.bye(sim.ids[n], sim.instance_ids[n])
                        for n in range(first, min(count, first + 200))
                    )
                )
        await control.close()


async def _until_stdin_closes(commands: dict[str, Callable[[], None]]) -> None:
    """Run ``commands[line]`` for each line read from stdin, until it closes (the bench
    closed it, or died: a child never outlives the bench)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        command = commands.get(line.decode().strip())
        if command is not None:
            command()


# -- the run, the document, the table --------------------------------------------------


async def run_discovery(
    settings: Settings, servers: str | None, progress: Progress
) -> dict[str, Any]:
    from bench.fabricscale import callers_at_scale

    logs = log_dir()
    began = time.perf_counter()
    parts = settings.parts
    choice: list[dict[str, Any]] = []
    decode: dict[str, Any] = {}
    visible: dict[str, Any] = {}
    load: list[dict[str, Any]] = []
    fabric: list[dict[str, Any]] = []
    try:
        if 1 in parts:
            progress("part 1: route choice from the cache")
            decode = record_decode_us()
            progress(
                "decode of one registry record: median"
                f" {decode['with_input_schema']['median']} µs with a JSON Schema,"
                f" {decode['without_schemas']['median']} µs without,"
                f" {decode['after_heartbeat']['median']} µs after a heartbeat (manifest known)"
            )
            choice = await route_choice(servers, logs, settings, progress)
        if 2 in parts:
            progress("part 2: announce → visible in another process's cache")
            visible = await visibility(servers, logs, settings, progress)
        if 3 in parts:
            progress("part 3: registrar CPU and KV writes under heartbeats")
            load = await registrar_load(servers, logs, settings, progress)
        if 4 in parts:
            progress("part 4: callers on a cluster of many heartbeating instances")
            fabric = await callers_at_scale(servers, logs, settings, progress)
    except BaseException:
        progress(f"failed; logs of the child processes are in {logs}")
        raise
    shutil.rmtree(logs, ignore_errors=True)
    return {
        "route_choice": choice,
        "record_decode_us": decode,
        "visibility": visible,
        "registrar_load": load,
        "callers_at_scale": fabric,
        "server_version": visible.pop("server_version", None)
        or next((r["server_version"] for r in fabric if "server_version" in r), "unknown"),
        "wall_sec": round(time.perf_counter() - began, 1),
    }


def _targets(doc: dict[str, Any]) -> dict[str, Any]:
    largest = max((r["instances"] for r in doc["route_choice"]), default=0)
    choice = {
        r["layout"]: r["lookups"]["choose"]["p99"]
        for r in doc["route_choice"]
        if r["instances"] == largest
    }
    medians = {
        r["layout"]: r["lookups"]["choose"]["median"]
        for r in doc["route_choice"]
        if r["instances"] == largest
    }
    jitter = {
        r["layout"]: r["lookups"].get("control", {}).get("p99")
        for r in doc["route_choice"]
        if r["instances"] == largest
    }
    memory = {
        r["layout"]: r["lookups"].get("control_memory", {}).get("p99")
        for r in doc["route_choice"]
        if r["instances"] == largest
    }
    unfocused = {
        r["layout"]: r["lookups"].get("choose_all", {}).get("p99")
        for r in doc["route_choice"]
        if r["instances"] == largest
    }
    p99 = doc["visibility"]["visible_ms"]["p99"]
    return {
        "route_choice_us": {
            "target": f"< {TARGET_CHOICE_US:g} µs at {largest:,} instances (p99 of 'choose')",
            "p99_by_layout": choice,
            "median_by_layout": medians,
            #: p99 of a fixed loop with the same median: what the machine adds by itself
            "control_p99_by_layout": jitter,
            #: p99 of eight random reads among the records, with no logic around them
            "control_memory_p99_by_layout": memory,
            #: p99 of the same choice sampling among all candidates (no aperture)
            "without_aperture_p99_by_layout": unfocused,
            "met_by_layout": {k: v is not None and v < TARGET_CHOICE_US for k, v in choice.items()},
        },
        "announce_visible_ms": {
            "target": f"< {TARGET_VISIBLE_P99_MS:g} ms p99",
            "p99": p99,
            "met": p99 is not None and p99 < TARGET_VISIBLE_P99_MS,
        },
    }


def build_document(
    result: dict[str, Any], settings: Settings, argv: Sequence[str]
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "benchmark": "discovery",
        "format": 1,
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench.discovery", *argv]),
        "machine": machine_info(result["server_version"]),
        "settings": dataclasses.asdict(settings),
        "lookups": dict(_LOOKUPS),
        "wall_sec": result["wall_sec"],
        "route_choice": result["route_choice"],
        "record_decode_us": result["record_decode_us"],
        "visibility": result["visibility"],
        "registrar_load": result["registrar_load"],
        "callers_at_scale": result["callers_at_scale"],
    }
    doc["targets"] = _targets(doc) if doc["route_choice"] and doc["visibility"] else {}
    doc["targets"].update(fabric_targets(doc["callers_at_scale"]))
    return doc


def _table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).rjust(w) for c, w in zip(cells, widths, strict=True))

    return "\n".join([title, line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _n(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.1f}" if value >= 10 else f"{value:.2f}"


def format_tables(doc: dict[str, Any]) -> str:
    parts = [_format_parts(doc)] if doc["route_choice"] and doc["visibility"] else []
    if doc["registrar_load"]:
        parts.append(_registrar_table(doc["registrar_load"]))
    if doc["callers_at_scale"]:
        parts.append(fabric_tables(doc["callers_at_scale"]))
    return "\n\n".join(parts)


def _format_parts(doc: dict[str, Any]) -> str:
    names = [name for name, _ in _LOOKUPS]
    rows = [
        [r["layout"], f"{r['instances']:,}", f"{r['capabilities']:,}"]
        + [f"{_n(r['lookups'][k]['median'])}/{_n(r['lookups'][k]['p99'])}" for k in names]
        for r in doc["route_choice"]
    ]
    parts = [
        _table(
            "Route choice from the cache: µs per lookup, median/p99",
            ["layout", "instances", "caps", *names],
            rows,
        )
    ]
    decode = doc["record_decode_us"]
    parts.append(
        _table(
            "Decode of one registry record (every route cache and registrar, per KV change): µs",
            ["record", "bytes", "median", "p99"],
            [[k, str(v["record_bytes"]), _n(v["median"]), _n(v["p99"])] for k, v in decode.items()],
        )
    )
    vis = doc["visibility"]
    parts.append(
        _table(
            f"Announce → visible in another process's route cache ({vis['announces']} announces)",
            ["", "median ms", "p99 ms", "max ms", "not seen"],
            [
                [
                    "visible",
                    _n(vis["visible_ms"]["median"]),
                    _n(vis["visible_ms"]["p99"]),
                    _n(vis["visible_ms"]["max"]),
                    str(vis["not_seen_within_5s"]),
                ],
                [
                    "announce reply",
                    _n(vis["announce_reply_ms"]["median"]),
                    _n(vis["announce_reply_ms"]["p99"]),
                    _n(vis["announce_reply_ms"]["max"]),
                    "",
                ],
            ],
        )
    )
    targets = doc["targets"]
    choice = targets["route_choice_us"]
    met = ", ".join(
        f"{k}: median {_n(choice['median_by_layout'][k])} µs,"
        f" p99 {_n(choice['p99_by_layout'][k])} µs {'met' if ok else 'NOT met'}"
        f" (p99 of a fixed loop of the same median"
        f" {_n(choice.get('control_p99_by_layout', {}).get(k))} µs, of 8 random reads among"
        f" the records {_n(choice.get('control_memory_p99_by_layout', {}).get(k))} µs;"
        f" without the aperture"
        f" {_n(choice.get('without_aperture_p99_by_layout', {}).get(k))} µs)"
        for k, ok in choice["met_by_layout"].items()
    )
    vis_t = targets["announce_visible_ms"]
    parts.append(
        "Targets\n"
        f"route choice {choice['target']}: {met}\n"
        f"announce → visible {vis_t['target']}: p99 {_n(vis_t['p99'])} ms"
        f" {'met' if vis_t['met'] else 'NOT met'}"
    )
    return "\n\n".join(parts)


def _registrar_table(rows: list[dict[str, Any]]) -> str:
    return _table(
        "Registrar under heartbeats (CPU % of one core)",
        [
            "instances",
            "age",
            "registrar %",
            "raw nats-py %",
            "× raw",
            "server %",
            "sim %",
            "KV writes/s",
            "hb/s",
            "probes/s",
            "hb reply p99 ms",
            "reannounce",
            "keys",
            "kept up",
        ],
        [
            [f"{r['instances']:,}", r.get("age", ""), f"failed: {r['error']}", *[""] * 11]
            if "error" in r
            else [
                f"{r['instances']:,}",
                r.get("age", "young"),
                _n(r["registrar_cpu_pct"]),
                _n(r["raw_floor"]["cpu_pct"]),
                _times_floor(r),
                _n(r["server_cpu_pct"]),
                _n(r["simulator_cpu_pct"]),
                _n(r["kv_writes_per_sec"]),
                _n(r["heartbeats_per_sec"]),
                _n(r["probes_per_sec"]),
                _n(r["heartbeat_reply_ms"]["p99"]),
                str(r["heartbeat_reannounce"]),
                f"{r['registry_keys']:,}",
                "yes" if r["registrar_kept_up"] else "NO",
            ]
            for r in rows
        ],
    )


def _times_floor(row: dict[str, Any]) -> str:
    """The row's multiple of its floor, and the range over its runs if there were several."""
    ratios = [r["registrar_over_raw_floor"] for r in row.get("runs", ())]
    ratios = [x for x in ratios if x is not None]
    text = _n(row.get("registrar_over_raw_floor"))
    if len(ratios) > 1:
        text += f" ({_n(min(ratios))}–{_n(max(ratios))})"
    return text


def write_chart(doc: dict[str, Any], path: Path) -> str:
    """A PNG of lookup cost by instance count (log-log); a note instead without matplotlib."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, layout in zip(axes, ("spread", "one_capability"), strict=True):
        rows = [r for r in doc["route_choice"] if r["layout"] == layout]
        xs = [r["instances"] for r in rows]
        for name, _ in _LOOKUPS:
            ax.plot(xs, [r["lookups"][name]["median"] for r in rows], marker="o", label=name)
        ax.axhline(TARGET_CHOICE_US, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("instances in the cache")
        ax.set_title(f"{layout}: µs per lookup (median)")
    axes[0].set_ylabel("µs")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return ""


# -- command line ----------------------------------------------------------------------


def _counts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 10,1000, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("every count must be >= 1")
    return values


def _ages(text: str) -> tuple[str, ...]:
    ages = tuple(a.strip() for a in text.split(",") if a.strip())
    unknown = sorted(set(ages) - {"young", "settled"})
    if not ages or unknown:
        raise argparse.ArgumentTypeError(f"ages are young and settled, not {', '.join(unknown)}")
    return ages


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.discovery",
        description="Discovery benchmark: route choice, announce visibility, registrar load.",
    )
    parser.add_argument("--quick", action="store_true", help="tiny counts and short windows")
    parser.add_argument(
        "--servers", default=None, help="use this NATS (JetStream on) instead of starting one"
    )
    parser.add_argument("--out", type=Path, default=_DEFAULT_OUT, help="JSON results file")
    parser.add_argument("--scales", type=_counts, default=None, help="route-cache sizes")
    parser.add_argument("--load-scales", type=_counts, default=None, help="heartbeating instances")
    parser.add_argument("--announces", type=int, default=None, help="announces to time")
    parser.add_argument("--window", type=float, default=None, help="seconds of a load window")
    parser.add_argument("--no-chart", action="store_true", help="do not write a PNG chart")
    parser.add_argument(
        "--fabric-scales", type=_counts, default=None, help="instances under callers (part 4)"
    )
    parser.add_argument("--registrars", type=int, default=None, help="registrars (part 4)")
    parser.add_argument(
        "--fabric-changes", type=int, default=None, help="announces and byes timed (part 4)"
    )
    parser.add_argument("--parts", type=_counts, default=None, help="parts to run: 1,2,3,4")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs of each scale and age of part 3, in turn; the median is reported",
    )
    parser.add_argument(
        "--ages",
        type=_ages,
        default=None,
        help="instance ages of part 3: young (first day: probed twice per interval),"
        " settled (past it: once); default both",
    )
    args = parser.parse_args(argv)
    base = QUICK if args.quick else DEFAULT
    overrides = {
        "fabric_scales": args.fabric_scales,
        "fabric_changes": args.fabric_changes,
        "registrars": args.registrars,
        "parts": args.parts,
        "load_ages": args.ages,
        "load_repeats": args.repeats,
        "scales": args.scales,
        "load_scales": args.load_scales,
        "announces": args.announces,
        "window_sec": args.window,
    }
    settings = dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
    if settings.announces < 1 or settings.window_sec <= 0 or settings.load_repeats < 1:
        parser.error("--announces and --repeats must be >= 1 and --window > 0")
    return args, settings


def _child_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.discovery child")
    roles = parser.add_subparsers(dest="role", required=True)
    watch = roles.add_parser("watch")
    watch.add_argument("url")
    watch.add_argument("prefix")
    sim = roles.add_parser("hbsim")
    sim.add_argument("url")
    sim.add_argument("creds")
    sim.add_argument("prefix")
    sim.add_argument("count", type=int)
    sim.add_argument("interval", type=float)
    sim.add_argument("--bye", action="store_true")
    sim.add_argument("--signing-key", type=Path, help="sign a token for each instance")
    sim.add_argument("--per-capability", type=int, default=0, help="instances per capability")
    caller = roles.add_parser("caller")
    caller.add_argument("url")
    caller.add_argument("mode", choices=("used", "all"))
    caller.add_argument("prefix")
    caller.add_argument("capabilities")
    args = parser.parse_args(argv)
    if args.role == "watch":
        asyncio.run(_child_watch(args.url, args.prefix))
    elif args.role == "caller":
        from bench.fabricscale import child_caller

        asyncio.run(child_caller(args.url, args.mode, args.prefix, args.capabilities.split(",")))
    else:
        creds = None if args.creds == "-" else Path(args.creds)
        asyncio.run(
            _child_hbsim(
                args.url,
                creds,
                args.prefix,
                args.count,
                args.interval,
                args.bye,
                args.signing_key,
                args.per_capability,
            )
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    require_fresh_build()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["child"]:
        return _child_main(argv[1:])
    args, settings = parse_args(argv)

    def progress(line: str) -> None:
        print(f"[discovery] {line}", file=sys.stderr, flush=True)

    result = asyncio.run(run_discovery(settings, args.servers, progress))
    doc = build_document(result, settings, argv)
    out: Path = args.out
    charts, note = ([], "chart not requested (--no-chart)") if args.no_chart else _charts(doc, out)
    doc["charts"] = [str(c) for c in charts]
    if note:
        doc["charts_note"] = note
    write_json(doc, out)
    print(format_tables(doc))
    print(f"\nJSON: {out}" + "".join(f"\nchart: {c}" for c in charts) + (f"\n{note}" * bool(note)))
    return 0


def _charts(doc: dict[str, Any], out: Path) -> tuple[list[Path], str]:
    """The route choice chart (``OUT.png``, part 1) and the chart of callers on a fabric
    (``OUT-fabric.png``, part 4), for the parts that ran; and what kept one from being drawn."""
    from bench.fabricchart import write_fabric_chart

    charts: list[Path] = []
    notes: list[str] = []
    if doc["route_choice"]:
        note = write_chart(doc, out.with_suffix(".png"))
        charts += [] if note else [out.with_suffix(".png")]
        notes += [note] if note else []
    if doc["callers_at_scale"]:
        fabric, note = write_fabric_chart(
            doc["callers_at_scale"], out.with_name(f"{out.stem}-fabric.png")
        )
        charts += [fabric] if fabric is not None else []
        notes += [note] if note else []
    return charts, "; ".join(dict.fromkeys(notes))


if __name__ == "__main__":
    sys.exit(main())
