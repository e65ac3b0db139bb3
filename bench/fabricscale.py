"""Part 4 of ``bench.discovery``: callers on a fabric of many heartbeating instances.

On a three-server JetStream cluster (as ``reach up --cluster 3`` runs one; or the server
given by ``--servers``), a registrar process and simulated instances (one process,
``bench.discovery child hbsim``) spread over capabilities, ``per_capability`` instances
each, heartbeating every interval. Two caller processes on other servers of the cluster
hold route caches:

- ``used``: the cache a ``ReachClient`` keeps, following the route keys of the
  ``caller_capabilities`` capabilities it calls;
- ``all``: a cache following every instance record (the design before route keys, and
  what tools that list the fabric still do).

Over a window in which nothing changes but heartbeats, each caller's CPU and the records
it received; then announces and byes of instances of a capability both follow, timed
from the request to its arrival in each cache (p50/p99); the registrar's CPU; the
registry stream's writes, messages and bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from bench.callpath import server_version
from bench.procs import Child, cpu_seconds

__all__ = ["callers_at_scale", "child_caller", "cluster", "fabric_tables", "fabric_targets"]

#: the issue's scale and targets
TARGET_SCALE = 100_000
TARGET_CALLER_CPU_PCT = 2.0
TARGET_VISIBLE_P99_MS = 100.0
TARGET_REGISTRAR_PCT_PER_10K = 25.0

Progress = Callable[[str], None]

#: announces and byes that get no answer before the timing of changes stops (a
#: registrar that cannot keep up: what is measured then is its backlog)
_GIVE_UP_AFTER = 5
#: the caller modes: following the capabilities used, or every record
MODES = ("used", "all")


@asynccontextmanager
async def cluster(logs: Path, name: str, size: int) -> AsyncIterator[tuple[list[str], list[int]]]:
    """``size`` nats-servers on loopback as one JetStream cluster: their URLs and pids.
    Each one's config maps heartbeats onto partitions, as the configs of
    ``reach up --cluster`` do."""
    from reach.fabric.embedded import free_port
    from reach.security import natsconf
    from reach.testing import NatsServer

    routes = [free_port() for _ in range(size)]
    joined = ",".join(f"nats://127.0.0.1:{port}" for port in routes)
    servers = [
        NatsServer(
            store_dir=logs / f"nats-{name}-{n}",
            config_file=natsconf.write_open_config(logs / f"nats-{name}-{n}.conf"),
            name=f"{name}-{n}",
            extra_args=[
                *("--cluster_name", "bench", "--cluster", f"nats://127.0.0.1:{routes[n]}"),
                *("--routes", joined),
            ],
        )
        for n in range(size)
    ]
    try:
        # a clustered server's JetStream is ready once the others are up: all at once
        await asyncio.gather(*(asyncio.to_thread(s.start_now, 60.0) for s in servers))
        await _meta_leader([s.url for s in servers])
        yield [s.url for s in servers], [s.pid or 0 for s in servers]
    finally:
        for server in servers:
            await server.stop()


async def _meta_leader(urls: list[str], timeout: float = 60.0) -> None:
    """Wait until the cluster has elected its JetStream meta leader (the API answers)."""
    import nats

    nc = await nats.connect(servers=urls, name="bench-cluster-ready")
    try:
        js = nc.jetstream(timeout=2.0)
        async with asyncio.timeout(timeout):
            while True:
                try:
                    await js.account_info()
                    return
                except Exception:  # no meta leader yet: the API does not answer
                    await asyncio.sleep(0.2)
    finally:
        await nc.close()


@asynccontextmanager
async def _servers(
    given: str | None, logs: Path, name: str, size: int
) -> AsyncIterator[tuple[list[str], list[int]]]:
    if given is not None:
        yield [given] * 3, []
        return
    if size <= 1:
        from reach.security import natsconf
        from reach.testing import NatsServer

        config = natsconf.write_open_config(logs / f"nats-{name}.conf")
        server = NatsServer(store_dir=logs / f"nats-{name}", config_file=config)
        await server.start()
        try:
            yield [server.url] * 3, [server.pid or 0]
        finally:
            await server.stop()
        return
    async with cluster(logs, name, size) as found:
        yield [found[0][n % size] for n in range(3)], found[1]


async def callers_at_scale(
    servers: str | None, logs: Path, settings: Any, progress: Progress
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for count in settings.fabric_scales:
        try:
            async with _servers(servers, logs, f"fabric-{count}", settings.cluster_size) as (
                urls,
                pids,
            ):
                row = await _case(urls, pids, count, servers is not None, logs, settings, progress)
        except Exception as exc:  # one broken case must not lose the others' numbers
            progress(f"callers at {count}: failed: {type(exc).__name__}: {exc}")
            row = {"instances": count, "error": f"{type(exc).__name__}: {exc}"}
        rows.append(row)
    return rows


async def _case(
    urls: list[str],
    pids: list[int],
    count: int,
    shared: bool,
    logs: Path,
    settings: Any,
    progress: Progress,
) -> dict[str, Any]:
    import nats

    from bench import discovery as d

    prefix, vis = f"fab{secrets.token_hex(2)}", f"fv{secrets.token_hex(2)}"
    per = settings.fabric_per_capability
    capabilities = max(1, -(-count // per))
    used = [d.sim_capability(n) for n in range(min(settings.caller_capabilities, capabilities))]
    registrars = [await d._registrar(urls[0], logs) for _ in range(settings.registrars)]
    nc = await nats.connect(urls[0], name="bench-stream-info")
    children: list[Child] = []
    try:
        creds = d._creds_of(logs / registrars[0].name)
        args = ["hbsim", urls[0], str(creds or "-"), prefix, str(count)]
        args += [str(settings.hb_interval_sec), "--per-capability", str(per)]
        args += ["--bye"] if shared else []
        key = logs / registrars[0].name / "signing.key"
        if creds is not None and key.exists():
            args += ["--signing-key", str(key)]
        sim = await d._spawn(f"fabsim-{count}", args, logs)
        children.append(sim)
        with contextlib.suppress(TimeoutError):
            await d._line(sim, "ANNOUNCED", settings.announce_deadline_sec)
        callers = {}
        for n, mode in enumerate(MODES):
            caller_args = ["caller", urls[1 + n % 2], mode, vis, ",".join(used)]
            callers[mode] = await d._spawn(f"caller-{mode}-{count}", caller_args, logs)
            children.append(callers[mode])
        await asyncio.sleep(max(settings.settle_sec, settings.hb_interval_sec))
        progress(
            f"callers at {count:>6}: measuring {settings.fabric_window_sec:.0f}s of heartbeats"
        )
        row = await _window(nc, registrars, pids, callers, sim, count, settings)
        row["capabilities"] = capabilities
        row["caller_capabilities"] = len(used)
        row["visibility"] = await _changes(callers, urls[0], creds, vis, used[0], settings)
        row["server_version"] = await asyncio.to_thread(server_version, urls[0])
        row["registrar_kept_up"] = kept_up(row)
    finally:
        for registrar in registrars:
            await registrar.stop()
        for child in children:
            await child.stop()
        await nc.close()
    _say(progress, row)
    return row


async def _window(
    nc: Any,
    registrars: Sequence[Child],
    pids: Sequence[int],
    callers: dict[str, Child],
    sim: Child,
    count: int,
    settings: Any,
) -> dict[str, Any]:
    from bench import discovery as d

    js = nc.jetstream()
    await d._ask_stats(sim)  # resets the simulator's window
    records0 = {mode: await _records(c) for mode, c in callers.items()}
    info0 = await js.stream_info(d._KV_STREAM)

    def cpu() -> list[float | None]:
        return [
            *(c.cpu_seconds() for c in callers.values()),
            *(r.cpu_seconds() for r in registrars),
            *(cpu_seconds(pid) for pid in pids),
        ]

    cpu0, t0 = cpu(), time.perf_counter()
    await asyncio.sleep(settings.fabric_window_sec)
    cpu1, seconds = cpu(), time.perf_counter() - t0
    info1 = await js.stream_info(d._KV_STREAM)
    records1 = {mode: await _records(c) for mode, c in callers.items()}
    stats = await d._ask_stats(sim)

    def pct(i: int) -> float | None:
        used = d._delta(cpu0[i], cpu1[i])
        return None if used is None else round(100 * used / seconds, 2)

    n_callers, n_regs = len(callers), len(registrars)
    registrar_pct = [pct(n_callers + i) for i in range(n_regs)]
    server_pct = [pct(n_callers + n_regs + i) for i in range(len(pids))]
    total_registrar = sum(p for p in registrar_pct if p is not None)
    writes = int(info1.state.last_seq) - int(info0.state.last_seq)
    return {
        "instances": count,
        "interval_sec": settings.hb_interval_sec,
        "window_sec": round(seconds, 2),
        "announced": stats["announced"],
        "registrars": n_regs,
        "heartbeats_per_sec": round(stats["hb_sent"] / seconds, 1),
        "heartbeat_reply_ms": stats["hb_reply_ms"],
        "heartbeat_replies_ok_ratio": round(stats["hb_ok"] / max(1, stats["hb_sent"]), 3),
        "caller_cpu_pct": {mode: pct(i) for i, mode in enumerate(callers)},
        "caller_records_per_sec": {
            mode: round((records1[mode] - records0[mode]) / seconds, 1) for mode in callers
        },
        "registrar_cpu_pct": registrar_pct,
        "registrar_cpu_pct_per_10k": round(total_registrar * 10_000 / count, 2) if count else None,
        "server_cpu_pct": server_pct,
        "kv_writes_per_sec": round(writes / seconds, 1),
        "kv_writes_per_sec_per_10k": round(writes / seconds * 10_000 / count, 1),
        "registry_keys": int(info1.state.messages),
        "registry_bytes": int(info1.state.bytes),
        "registry_bytes_per_10k": round(int(info1.state.bytes) * 10_000 / count),
        # each heartbeat is a request, its reply, and what it writes (republished once)
        "messages_per_sec_per_10k": round(
            (2 * stats["hb_sent"] / seconds + 2 * writes / seconds) * 10_000 / count, 1
        ),
    }


async def _records(caller: Child) -> int:
    from bench import discovery as d

    assert caller.proc.stdin is not None
    caller.proc.stdin.write(b"RECORDS\n")
    await caller.proc.stdin.drain()
    return int(await d._line(caller, "RECORDS", 30))


async def _changes(
    callers: dict[str, Child],
    url: str,
    creds: Path | None,
    prefix: str,
    capability: str,
    settings: Any,
) -> dict[str, Any]:
    """Announces, then byes, of instances of ``capability``: ms from the request until
    each caller's cache has the change."""
    from bench import discovery as d

    loop = asyncio.get_running_loop()
    seen: dict[tuple[str, str, str], asyncio.Future[float]] = {}

    def future(key: tuple[str, str, str]) -> asyncio.Future[float]:
        return seen.setdefault(key, loop.create_future())

    async def read(mode: str, caller: Child) -> None:
        while True:
            rest = await d._line(caller, "CHANGE", 3600)
            kind, agent_id, at = rest.split()
            fut = future((mode, kind, agent_id))
            if not fut.done():
                fut.set_result(float(at))

    readers = [asyncio.create_task(read(m, c)) for m, c in callers.items()]
    control = await d._Control.open(url, creds, "bench-changes")
    times: dict[str, dict[str, list[float]]] = {m: {"announce": [], "bye": []} for m in callers}
    missed = failed = 0
    try:
        for n in range(settings.fabric_changes):
            if failed >= _GIVE_UP_AFTER:
                break
            agent_id, instance_id = f"{prefix}-{n}", secrets.token_hex(8)
            control.capability_of[agent_id] = capability
            for kind in ("announce", "bye"):
                keys = [(m, kind, agent_id) for m in callers]
                sent = time.time()
                try:
                    if kind == "announce":
                        await control.announce(agent_id, instance_id, 60.0, timeout=5.0)
                    else:
                        await control.bye(agent_id, instance_id)
                except Exception:  # not answered in time (a registrar that cannot keep up)
                    failed += 1
                    if failed >= _GIVE_UP_AFTER:
                        break
                for key in keys:
                    try:
                        at = await asyncio.wait_for(asyncio.shield(future(key)), 5.0)
                    except TimeoutError:
                        missed += 1
                        continue
                    times[key[0]][kind].append((at - sent) * 1000)
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        await control.close()
    out: dict[str, Any] = {
        "changes": settings.fabric_changes,
        "not_seen_within_5s": missed,
        "requests_failed": failed,
    }
    for mode, kinds in times.items():
        out[mode] = {kind: d._stats(values) for kind, values in kinds.items()}
    return out


def _say(progress: Progress, row: dict[str, Any]) -> None:
    vis = row["visibility"]
    progress(
        f"callers at {row['instances']:>6}: caller CPU used {row['caller_cpu_pct']['used']}%"
        f" / all {row['caller_cpu_pct']['all']}%, records/s used"
        f" {row['caller_records_per_sec']['used']} / all {row['caller_records_per_sec']['all']};"
        f" announce visible p99 {vis['used']['announce']['p99']} ms, bye"
        f" {vis['used']['bye']['p99']} ms; registrar {row['registrar_cpu_pct']}% CPU,"
        f" {row['kv_writes_per_sec']} KV writes/s, {row['registry_bytes']} bytes"
    )


async def child_caller(url: str, mode: str, prefix: str, capabilities: Sequence[str]) -> None:
    """A route cache following ``capabilities`` (mode ``used``) or every record (``all``):
    prints ``CHANGE announce|bye AGENT_ID UNIX_TIME`` for agents of ``prefix``, and
    answers ``RECORDS`` with the records it received so far."""
    from bench import discovery as d
    from reach.caller.routecache import RouteCache
    from reach.registry.store import RegistryStore
    from reach.transport import connect

    conn = await connect([url], name=f"bench-caller-{mode}")
    cache = RouteCache(await RegistryStore.open(conn, create=False), follow_all=mode == "all")
    out = sys.stdout
    present: set[str] = set()

    def on_change(agent_id: str, inst: object) -> None:
        if not agent_id.startswith(prefix):
            return
        if inst is not None and agent_id not in present:
            present.add(agent_id)
            out.write(f"CHANGE announce {agent_id} {time.time():.6f}\n")
        elif inst is None and agent_id in present:
            present.discard(agent_id)
            out.write(f"CHANGE bye {agent_id} {time.time():.6f}\n")
        out.flush()

    cache.on_change(on_change)
    await cache.start(120.0)
    for capability in capabilities if mode == "used" else ():
        await cache.follow(capability, 120.0)
    print("READY", flush=True)

    def records() -> None:
        print(f"RECORDS {cache.records}", flush=True)

    try:
        await d._until_stdin_closes({"RECORDS": records})
    finally:
        await cache.stop()
        await conn.close()


# -- the table, the targets, the projection ------------------------------------------------


def _measured(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted((r for r in rows if "error" not in r), key=lambda r: r["instances"])


def _figures(row: dict[str, Any]) -> dict[str, float | None]:
    vis = row["visibility"]
    worst_p99 = [
        vis[mode][kind]["p99"] for mode in MODES if mode in vis for kind in ("announce", "bye")
    ]
    return {
        "caller_cpu_used_pct": row["caller_cpu_pct"]["used"],
        "caller_cpu_all_pct": row["caller_cpu_pct"]["all"],
        "caller_records_used_per_sec": row["caller_records_per_sec"]["used"],
        "caller_records_all_per_sec": row["caller_records_per_sec"]["all"],
        "visible_p99_ms": max((p for p in worst_p99 if p is not None), default=None),
        "registrar_cpu_pct_per_10k": row["registrar_cpu_pct_per_10k"],
        "kv_writes_per_sec_per_10k": row["kv_writes_per_sec_per_10k"],
        "registry_bytes_per_10k": row["registry_bytes_per_10k"],
        "messages_per_sec_per_10k": row["messages_per_sec_per_10k"],
    }


#: how each figure grows with the instances when fewer than two scales were measured with
#: the registrar keeping up: a caller following 10 capabilities receives the writes of
#: their instances alone (flat); one following every record, all of them (linear); the
#: figures per 10,000 instances are flat by definition
_MODEL_EXPONENT = {
    "caller_cpu_used_pct": 0.0,
    "caller_cpu_all_pct": 1.0,
    "caller_records_used_per_sec": 0.0,
    "caller_records_all_per_sec": 1.0,
}


#: figures per 10,000 instances of a cost that is a fixed part plus a part per instance
#: (a registrar's CPU): while the figure falls with the scale, projected with that line
#: through the two largest scales, not a power law, which would let the fixed part's
#: shrinking share go on shrinking below the part per instance
_AFFINE = frozenset({"registrar_cpu_pct_per_10k"})


def _affine(n_a: int, per_10k_a: float, n_b: int, per_10k_b: float, scale: int) -> float | None:
    """A per-10,000 figure at ``scale`` from a total that grows as fixed + per instance
    through the totals at ``n_a`` < ``n_b`` (the part per instance never below zero);
    None where that line does not fit: scales not apart, or a figure that rises with the
    scale (a fixed part below zero, which would flatten the growth measured)."""
    if n_b <= n_a or per_10k_b > per_10k_a:
        return None
    total_a, total_b = per_10k_a * n_a / 10_000, per_10k_b * n_b / 10_000
    per_instance = max(0.0, (total_b - total_a) / (n_b - n_a))
    fixed = total_b - per_instance * n_b
    return round((fixed + per_instance * scale) * 10_000 / scale, 2)


def kept_up(row: dict[str, Any]) -> bool:
    """Whether the registrar answered (within 2 %) every heartbeat and every announce
    timed: else what is measured is its backlog."""
    answered = row.get("visibility", {}).get("requests_failed", 0) == 0
    return bool(answered and row.get("heartbeat_replies_ok_ratio", 0.0) >= 0.98)


def project(rows: Sequence[dict[str, Any]], scale: int = TARGET_SCALE) -> dict[str, Any]:
    """Each figure at ``scale``: measured if a row is there, else a projection from the
    scales where the registrar kept up, with the growth measured between the two largest
    of them (a power law through both, or for ``_AFFINE`` figures that fall with the scale
    a fixed part plus a part per instance, listed in ``fixed_plus_per_instance``), or with
    ``_MODEL_EXPONENT`` from one."""
    import math

    measured = _measured(rows)
    exact = [r for r in measured if r["instances"] == scale]
    if exact:
        return {"instances": scale, "projected": False, **_figures(exact[0])}
    good = [r for r in measured if kept_up(r)]
    out: dict[str, Any] = {"instances": scale, "projected": True, "growth_exponent": {}}
    if not good:
        return out
    last = good[-1]
    b = _figures(last)
    a = _figures(good[-2]) if len(good) > 1 else None
    span = math.log(last["instances"] / good[-2]["instances"]) if len(good) > 1 else 0
    out["from_instances"] = [r["instances"] for r in good[-2:]]
    for name, value in b.items():
        if value is None:
            out[name] = None
            continue
        before = a[name] if a is not None else None
        if name in _AFFINE and before is not None:
            line = _affine(good[-2]["instances"], before, last["instances"], value, scale)
            if line is not None:
                out[name] = line
                out["fixed_plus_per_instance"] = [*out.get("fixed_plus_per_instance", ()), name]
                continue
        exponent = _MODEL_EXPONENT.get(name, 0.0)
        if span and before and value > 0 and before > 0:
            exponent = math.log(value / before) / span
        out["growth_exponent"][name] = round(exponent, 2)
        out[name] = round(value * (scale / last["instances"]) ** exponent, 2)
    return out


def fabric_targets(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    if not rows:
        return {}
    at = project(rows)
    word = "projected" if at.get("projected") else "measured"

    def target(text: str, value: float | None, limit: float) -> dict[str, Any]:
        return {
            "target": text,
            word: value,
            "met": value is not None and value < limit,
        }

    return {
        "caller_cpu_pct_at_100k": target(
            f"< {TARGET_CALLER_CPU_PCT:g} % of a core, 10 capabilities used, at 100,000",
            at.get("caller_cpu_used_pct"),
            TARGET_CALLER_CPU_PCT,
        ),
        "change_visible_p99_ms_at_100k": target(
            f"< {TARGET_VISIBLE_P99_MS:g} ms p99 at every caller, at 100,000",
            at.get("visible_p99_ms"),
            TARGET_VISIBLE_P99_MS,
        ),
        "registrar_cpu_pct_per_10k": target(
            f"<= {TARGET_REGISTRAR_PCT_PER_10K:g} % of a core per 10,000 instances",
            at.get("registrar_cpu_pct_per_10k"),
            TARGET_REGISTRAR_PCT_PER_10K + 1e-9,
        ),
    }


def fabric_tables(rows: Sequence[dict[str, Any]]) -> str:
    from bench.discovery import _n, _table

    measured = _measured(rows)
    header = ["instances", "caps", "regs", "hb/s", "KV writes/s", "caller used %"]
    header += ["caller all %", "rec/s used", "rec/s all", "vis p99 used", "vis p99 all"]
    header += ["registrar %/10k", "bytes/10k", "msg/s/10k"]
    lines = []
    for r in rows:
        if "error" in r:
            lines.append([f"{r['instances']:,}", f"failed: {r['error']}", *[""] * 12])
            continue
        vis = r["visibility"]
        lines.append(
            [
                f"{r['instances']:,}",
                f"{r['capabilities']:,}",
                str(r["registrars"]),
                _n(r["heartbeats_per_sec"]),
                _n(r["kv_writes_per_sec"]),
                _n(r["caller_cpu_pct"]["used"]),
                _n(r["caller_cpu_pct"]["all"]),
                _n(r["caller_records_per_sec"]["used"]),
                _n(r["caller_records_per_sec"]["all"]),
                "/".join(_n(vis["used"][k]["p99"]) for k in ("announce", "bye")),
                "/".join(_n(vis["all"][k]["p99"]) for k in ("announce", "bye")),
                _n(r["registrar_cpu_pct_per_10k"]),
                f"{r['registry_bytes_per_10k']:,}",
                _n(r["messages_per_sec_per_10k"]),
            ]
        )
    at = project(rows)
    if measured and at.get("projected") and "caller_cpu_used_pct" in at:
        lines.append(
            [
                f"{TARGET_SCALE:,} (projected)",
                "",
                "",
                "",
                "",
                _n(at["caller_cpu_used_pct"]),
                _n(at["caller_cpu_all_pct"]),
                _n(at["caller_records_used_per_sec"]),
                _n(at["caller_records_all_per_sec"]),
                _n(at["visible_p99_ms"]),
                "",
                _n(at["registrar_cpu_pct_per_10k"]),
                f"{at['registry_bytes_per_10k']:,.0f}",
                _n(at["messages_per_sec_per_10k"]),
            ]
        )
    title = (
        "Callers on a fabric of heartbeating instances (CPU % of one core; visibility p99 ms"
        " of announce/bye; 'used': a cache following 10 capabilities, 'all': every record)"
    )
    return _table(title, header, lines)
