"""A registrar's view of the registry as its watch delivers changes, out of order
included (its own writes and the watch race): no NATS, the changes are fed directly."""

from __future__ import annotations

from reach.registry.instances import RecordView
from reach.registry.ownership import Ownership
from reach.registry.store import RecordChange
from reach.registry.watch import RegistryWatch
from reach.wire import subjects
from reach.wire.models import Instance, Manifest, RegistrarRecord


def _instance(agent_id: str, instance_id: str) -> Instance:
    manifest = Manifest.model_validate(
        {
            "agent_id": agent_id,
            "agent_name": "svc",
            "version": "1.0.0",
            "capabilities": [{"name": "echo"}],
        }
    )
    return Instance(
        manifest=manifest, instance_id=instance_id, registered_at=0.0, last_heartbeat_at=0.0
    )


def _put(inst: Instance, revision: int) -> RecordChange:
    return RecordChange(subjects.agent_key(inst.agent_id), revision, instance=inst)


def _deleted(agent_id: str, revision: int) -> RecordChange:
    return RecordChange(subjects.agent_key(agent_id), revision, deleted=True)


def _watch() -> tuple[RegistryWatch, RecordView, Ownership, list[str]]:
    gone: list[str] = []
    view = RecordView(on_gone=gone.append)
    ownership = Ownership("reg-a")
    watch = RegistryWatch(
        view, ownership, alerts=None, on_trouble=lambda: None, running=lambda: True
    )
    return watch, view, ownership, gone


def test_an_older_change_never_replaces_a_newer_record() -> None:
    watch, view, _, _ = _watch()
    newer = _instance("svc-1", "b")
    view.remember(newer, 7)  # the registrar's own write, seen before the watch's
    watch.apply(_put(_instance("svc-1", "a"), 5))
    assert view.get("svc-1") == (newer, 7)
    watch.apply(_deleted("svc-1", 6))
    assert view.get("svc-1") == (newer, 7)


def test_a_deletion_drops_the_record_and_says_so() -> None:
    watch, view, _, gone = _watch()
    watch.apply(_put(_instance("svc-1", "a"), 3))
    watch.apply(_deleted("svc-1", 4))
    assert view.get("svc-1") is None
    assert view.instances() == []
    assert gone == ["svc-1"]


def test_the_end_of_the_first_pass_marks_the_view_synced() -> None:
    watch, _, _, _ = _watch()
    assert not watch.synced.is_set()
    watch.apply(None)
    assert watch.synced.is_set()


def test_registrar_records_feed_ownership() -> None:
    watch, _, ownership, _ = _watch()
    record = RegistrarRecord(registrar_id="reg-b", started_at=0.0, seen_at=0.0, interval_sec=1.0)
    watch.apply(RecordChange(subjects.registrar_key("reg-b"), 1, registrar=record))
    assert ownership.registrars == {"reg-b": record}
    watch.apply(RecordChange(subjects.registrar_key("reg-b"), 2, deleted=True))
    assert ownership.registrars == {}
