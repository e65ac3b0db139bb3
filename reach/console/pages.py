"""What each page shows, computed from the ``FabricView`` and rendered with Jinja2.

Every template is rendered with autoescaping: names, descriptions, tags, reasons and
error texts come from agents and callers and are shown as text, never as markup. The
only markup not escaped is the charts' (``reach.console.charts``), built from numbers and
escaped labels.
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape

from reach.audit.stats import LATENCY
from reach.caller.routing import score_instance
from reach.cli.agents import age_text
from reach.console.charts import ERROR_COLOURS, calls_chart, errors_chart
from reach.console.rollup import Summary
from reach.console.state import FabricView
from reach.wire.models import Capability, Instance

__all__ = ["BREAKER_SEEN_SEC", "LIVE_PAGES", "MAX_ROWS", "Pages", "make_environment"]

#: an instance counts as behind an open breaker when a caller passed it over this recently
BREAKER_SEEN_SEC = 30.0
#: rows of the agents table at most (a live table of thousands is read by nobody, and
#: costs its rendering every second): those in trouble first, then by agent id; a
#: filter by capability or tag shows the others
MAX_ROWS = 200
#: the pages with a live part (``Pages.fragment``)
LIVE_PAGES = ("agents", "capability", "alerts")
_TROUBLE_FIRST = {"unhealthy": 0, "degraded": 1, "healthy": 2}


def _ms(value: float | None) -> str:
    return f"{value:.1f} ms" if value is not None else "-"


def _clock(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _pct(value: float | None) -> str:
    return f"{value:.1%}" if value is not None else "-"


def make_environment() -> Environment:
    env = Environment(
        loader=PackageLoader("reach.console", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(ms=_ms, ago=age_text, clock=_clock, pct=_pct)
    env.globals.update(LATENCY=LATENCY, ERROR_COLOURS=ERROR_COLOURS)
    return env


@dataclass(frozen=True)
class AgentRow:
    inst: Instance
    capabilities: list[str]
    tags: list[str]
    calls: Summary
    breaker_open: bool
    age: float
    #: the last health change: (status, reason, how long ago)
    transition: tuple[str, str, float] | None


@dataclass(frozen=True)
class InstanceScore:
    inst: Instance
    capability: Capability
    calls: Summary
    score: float
    breaker_open: bool


def _tags(inst: Instance, capability: str = "") -> list[str]:
    return sorted(
        {t for c in inst.manifest.capabilities if c.name == capability or not capability
         for t in c.tags}
    )  # fmt: skip


class Pages:
    """The pages' contexts, and the live fragments (``fragment``) the feed sends."""

    def __init__(self, view: FabricView, env: Environment | None = None) -> None:
        self.view = view
        self.env = env or make_environment()

    def render(self, template: str, **context: Any) -> str:
        context.setdefault("notes", sorted(self.view.notes.values()))
        return self.env.get_template(template).render(**context)

    def _breaker_open(self, agent_id: str, now: float) -> bool:
        return self.view.rollup.breaker_skips.get(agent_id, 0.0) >= now - BREAKER_SEEN_SEC

    def agent_rows(
        self, capability: str = "", tag: str = "", limit: int = MAX_ROWS
    ) -> tuple[list[AgentRow], int]:
        """The rows of the instances matching the filter, those in trouble first, at most
        ``limit``; and how many matched."""
        now = self.view.now()
        self.view.rollup.trim(now)
        matching = [
            inst
            for inst in self.view.instances()
            if (not capability or any(c.name == capability for c in inst.manifest.capabilities))
            and (not tag or tag in _tags(inst, capability))
        ]
        matching.sort(key=lambda i: (_TROUBLE_FIRST.get(i.status, 0), i.agent_id))
        return [self._row(inst, now) for inst in matching[:limit]], len(matching)

    def _row(self, inst: Instance, now: float) -> AgentRow:
        last = inst.transitions[-1] if inst.transitions else None
        return AgentRow(
            inst, [c.name for c in inst.manifest.capabilities], _tags(inst),
            self.view.rollup.instance(inst.agent_id, now),
            self._breaker_open(inst.agent_id, now), inst.age(now),
            (last.status, last.reason, now - last.at) if last else None,
        )  # fmt: skip

    def agents_fragment(self, params: dict[str, str]) -> str:
        rows, matching = self.agent_rows(params.get("capability", ""), params.get("tag", ""))
        return self.render(
            "agents_table.html", rows=rows, matching=matching, total=len(self.view.instances())
        )

    def capability_scores(self, name: str) -> list[InstanceScore]:
        """The instances offering ``name``, best score first: the router's formula over
        the registry record and the latency the audit stream observed (the router reads
        its own caller's average, which the console, calling nothing, does not have)."""
        now = self.view.now()
        out = []
        for inst in self.view.instances():
            cap = next((c for c in inst.manifest.capabilities if c.name == name), None)
            if cap is None:
                continue
            calls = self.view.rollup.instance(inst.agent_id, now)
            score = score_instance(
                inst, sla_ms=cap.latency_sla_ms, avg_latency_ms=calls.mean, load=inst.load
            )
            out.append(
                InstanceScore(inst, cap, calls, score, self._breaker_open(inst.agent_id, now))
            )
        return sorted(out, key=lambda s: (-s.score, s.inst.agent_id))

    def capability_fragment(self, params: dict[str, str]) -> str:
        name = params.get("name", "")
        now = self.view.now()
        rollup = self.view.rollup
        rollup.trim(now)
        series = rollup.series(name, now)
        return self.render(
            "capability_live.html",
            name=name,
            scores=self.capability_scores(name),
            summary=rollup.capability(name, now),
            calls_chart=calls_chart(series, rollup.bucket_sec),
            errors_chart=errors_chart(series, rollup.bucket_sec),
            kinds=sorted({k for _, b in series for k in b.errors}),
            window=rollup.window_sec,
        )

    def contracts(self, name: str) -> list[tuple[str, Capability, str, str]]:
        """The contract of ``name`` once per distinct declaration: (the instances that
        declare it, the capability, its input and output schemas as indented JSON)."""
        seen: dict[str, tuple[list[str], Capability]] = {}
        for inst in sorted(self.view.instances(), key=lambda i: i.agent_id):
            cap = next((c for c in inst.manifest.capabilities if c.name == name), None)
            if cap is None:
                continue
            key = cap.model_dump_json()
            versions, _ = seen.setdefault(key, ([], cap))
            versions.append(f"{inst.agent_id} ({inst.manifest.agent_name} {inst.manifest.version})")
        return [
            (", ".join(versions), cap, _json(cap.input_schema), _json(cap.output_schema))
            for versions, cap in seen.values()
        ]

    def alerts_fragment(self, params: dict[str, str]) -> str:
        rule = params.get("rule", "")
        alerts = [a for a in reversed(self.view.alerts) if not rule or a.rule == rule]
        return self.render("alerts_list.html", alerts=alerts[:200], now=time.time())

    def fragment(self, page: str, params: dict[str, str]) -> str | None:
        """The live part of ``page`` as HTML, None for a page without one."""
        if page == "agents":
            return self.agents_fragment(params)
        if page == "capability":
            return self.capability_fragment(params)
        if page == "alerts":
            return self.alerts_fragment(params)
        return None


def _json(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) if schema else "(none declared)"
