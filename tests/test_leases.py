"""Catalog leases and delete intents on SQLite and PostgreSQL: holders, heartbeats, take-over, fencing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from ckptier.storage.catalog.api import Catalog, LeaseHolder, ProcessId
from ckptier.storage.records import FileRef, Format, Found, Recognition, State, Tier
from ckptier.tasks.leases import LeaseKeeper

T0 = datetime(2026, 3, 1, tzinfo=UTC)
TTL = timedelta(minutes=2)
STORE = "file:///hot"
DEAD = ProcessId("h1", 4242, "boot:1")


def found(step: int) -> Found:
    prefix = f"llm/step-{step:08d}"
    files = tuple(FileRef(f"{prefix}/{rel}", rel, 10) for rel in ("metadata.json", "rank-0000/model.pt"))
    return Found(job="llm", step=step, format=Format.GUIDE, prefix=prefix, files=files, committed=True, reason="ok")


@pytest.fixture
def cat(catalog_url: str) -> Iterator[Catalog]:
    c = Catalog.open(catalog_url)
    c.record_scan(STORE, Recognition((found(100), found(200)), (), 4), now=T0)
    yield c
    c.close()


def cid(c: Catalog, step: int) -> int:
    rec = c.get("llm", step)
    assert rec is not None
    return rec.id


def test_a_lease_records_its_holder_and_is_taken_over_only_when_the_holder_is_gone(cat: Catalog) -> None:
    c = cid(cat, 100)
    gen = cat.claim(c, "run-a", now=T0, ttl=TTL, process=DEAD)
    holder = cat.lease_holder(c, now=T0)
    assert holder == LeaseHolder("run-a", gen, T0 + TTL, DEAD)  # type: ignore[arg-type]
    assert "run-a (host h1 pid 4242" in holder.describe()
    seen: list[LeaseHolder] = []
    assert cat.claim(c, "run-b", now=T0, ttl=TTL, take_over=lambda h: seen.append(h) or False) is None
    assert seen == [holder]  # asked, and told the holder lives: nothing changes
    taken = cat.claim(c, "run-b", now=T0, ttl=TTL, process=ProcessId("h1", 7, "boot:2"), take_over=lambda h: True)
    assert taken is not None and taken > gen  # type: ignore[operator]
    assert cat.lease_holder(c, now=T0).owner == "run-b"  # type: ignore[union-attr]
    [event] = [e for e in cat.events(job="llm") if e.kind == "lease.taken_over"]
    assert "run-a" in event.message and "run-b" in event.message
    # The old holder is fenced out of everything.
    assert not cat.mark_deleted(c, owner="run-a", generation=gen, now=T0, reasons=["zombie"])  # type: ignore[arg-type]
    assert cat.renew(c, "run-a", gen, now=T0, ttl=TTL) is None  # type: ignore[arg-type]
    assert cat.release(c, "run-b", taken)
    assert cat.lease_holder(c, now=T0) is None


def test_renew_extends_only_a_live_lease_of_its_holder(cat: Catalog) -> None:
    c = cid(cat, 100)
    gen = cat.claim(c, "run-a", now=T0, ttl=TTL)
    assert gen is not None
    later = T0 + TTL - timedelta(seconds=1)
    assert cat.renew(c, "run-a", gen, now=later, ttl=TTL) == later + TTL
    assert cat.claim(c, "run-b", now=T0 + TTL + timedelta(seconds=30), ttl=TTL) is None  # renewed: still held
    assert cat.renew(c, "run-a", gen, now=later + TTL, ttl=TTL) is None  # ran out: lost for good


def test_delete_intents_are_fenced_and_cleared_by_the_tombstone(cat: Catalog) -> None:
    c = cid(cat, 100)
    gen = cat.claim(c, "run-a", now=T0, ttl=TTL)
    assert gen is not None
    assert not cat.record_delete_intent(c, owner="run-b", generation=gen, scope="checkpoint", files=2, now=T0)
    assert cat.record_delete_intent(c, owner="run-a", generation=gen, scope="checkpoint", files=2, now=T0)
    [intent] = cat.delete_intents()
    assert (intent.checkpoint_id, intent.scope, intent.files, intent.at) == (c, "checkpoint", 2, T0)
    assert cat.mark_deleted(c, owner="run-a", generation=gen, now=T0, reasons=["rolling"])
    assert cat.delete_intents() == []


def test_a_rescan_settles_intents_of_vanished_checkpoints_only(cat: Catalog) -> None:
    for step, scope in ((100, "checkpoint"), (200, "hot-copy")):
        c = cid(cat, step)
        gen = cat.claim(c, "run-a", now=T0, ttl=TTL)
        assert gen is not None
        assert cat.record_delete_intent(c, owner="run-a", generation=gen, scope=scope, files=2, now=T0)
    # A rescan that still lists both changes nothing.
    cat.record_scan(STORE, Recognition((found(100), found(200)), (), 4), now=T0 + timedelta(hours=1))
    assert len(cat.delete_intents()) == 2
    # Both gone: 100 is tombstoned, 200 keeps its state and loses its hot copy only.
    cat.record_scan(STORE, Recognition((), (), 0), now=T0 + timedelta(hours=2))
    r100, r200 = cat.get("llm", 100), cat.get("llm", 200)
    assert r100 is not None and r100.state == State.DELETED and r100.missing_since is None
    assert r200 is not None and r200.state == State.COMMITTED and r200.missing_since is None
    assert [(x.tier, x.state) for x in r200.copies] == [(Tier.HOT, "deleted")]
    assert cat.delete_intents() == []


def test_the_heartbeat_keeps_a_lease_and_notices_when_it_is_lost(cat: Catalog) -> None:
    c = cid(cat, 100)
    ttl = timedelta(seconds=0.6)
    with LeaseKeeper(cat, "run-a", now=lambda: datetime.now(UTC), ttl=ttl) as keeper:
        lease = keeper.claim(c)
        assert lease is not None
        time.sleep(3 * ttl.total_seconds())
        assert keeper.valid(lease)  # renewed twice or more while we slept
        assert cat.claim(c, "run-b", now=datetime.now(UTC), ttl=ttl) is None
        # Another run takes it over (its holder judged gone): the next heartbeat marks ours lost.
        assert cat.claim(c, "run-b", now=datetime.now(UTC), ttl=timedelta(minutes=5), take_over=lambda h: True)
        time.sleep(2 * ttl.total_seconds())
        assert lease.lost and not keeper.valid(lease)
