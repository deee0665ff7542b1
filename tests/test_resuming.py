"""Work that a failure cuts off part-way goes on, through the stores every run uses.

botocore retries each S3 request (standard mode), but not a response body
that breaks off mid-read, and a listing or a batch delete is many requests:
when one of them still fails, the whole call fails. ``resuming`` (what
``StoreCache`` and ``scan_url`` open every store through) adds exactly that:
a broken read goes on from where it stopped (same object version only), a
listing is started again, a batch delete resends what was not confirmed,
and nothing else is tried again (so a store that is down fails as fast as
before). Faults are injected into the real moto_server exchange with
botocore event hooks: the body of a GET that breaks after some bytes (as a
reset connection does), pages and batches answered with 503.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from ckptier.storage.base import MAX_DELETE_BATCH, ObjectInfo, read_bytes
from ckptier.storage.catalog.api import Catalog
from ckptier.storage.errors import DeleteInterrupted, ObjectChanged, Unavailable
from ckptier.storage.records import State
from ckptier.storage.s3 import S3Store
from ckptier.storage.wrappers import RetryingStore, resuming

from tests.fixtures.s3 import S3Bucket, make_client
from tests.test_s3_faults import error_xml, fake_response, keys_in

pytestmark = pytest.mark.s3

MiB = 1 << 20
BREAK_AFTER = 256 << 10


class BreaksAfter:
    """A GetObject body that raises as a reset connection does after ``limit`` bytes."""

    def __init__(self, body: Any, limit: int) -> None:
        self._body, self._left = body, limit

    def read(self, amt: int | None = None) -> bytes:
        from botocore.exceptions import ResponseStreamingError

        reset = ResponseStreamingError(error=ConnectionResetError(104, "Connection reset by peer"))
        if self._left <= 0 or amt is None or amt < 0:  # a read to the end dies with what it had read
            raise reset
        data = self._body.read(min(amt, self._left))
        self._left -= len(data)
        return bytes(data)

    def close(self) -> None:
        self._body.close()


class Network:
    """Hooks on one client: the first ``breaks`` full GETs of each key break after
    ``BREAK_AFTER`` bytes; ``gets`` records every GET's key, Range and If-Match."""

    def __init__(self, client: Any, breaks: int = 1) -> None:
        self.client, self.breaks = client, breaks
        self.gets: list[tuple[str, str | None, str | None]] = []
        self.broken: dict[str, int] = {}
        self.before_resume: Any = None
        client.meta.events.register("before-call.s3.GetObject", self._before)
        client.meta.events.register("after-call.s3.GetObject", self._after)

    def _before(self, params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        key = params["url_path"].lstrip("/")  # the bucket is added to the URL later
        headers = params["headers"]
        self.gets.append((key, headers.get("Range"), headers.get("If-Match")))
        context["ckptier_key"], context["ckptier_ranged"] = key, "Range" in headers
        if "Range" in headers and self.before_resume is not None:
            self.before_resume(key)

    def _after(self, parsed: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        key = context.get("ckptier_key", "")
        if "Body" in parsed and not context.get("ckptier_ranged") and self.broken.get(key, 0) < self.breaks:
            self.broken[key] = self.broken.get(key, 0) + 1
            parsed["Body"] = BreaksAfter(parsed["Body"], BREAK_AFTER)


@pytest.fixture
def client(s3_bucket: S3Bucket) -> Any:
    """A private client (its hooks stay in this test), retrying like production's."""
    return make_client(s3_bucket.endpoint, retries={"mode": "standard", "total_max_attempts": 3})


def payload(size: int) -> bytes:
    return bytes((i * 7 + (i >> 9)) & 0xFF for i in range(size))


def read_in_chunks(store: Any, key: str, chunk: int = 64 << 10) -> bytes:
    """The whole object, read as verification and fetch read: a chunk at a time."""
    out = bytearray()
    with store.open_read(key) as fh:
        while data := fh.read(chunk):
            out += data
    return bytes(out)


# -- a read whose connection breaks ----------------------------------------------------------


def test_a_broken_read_goes_on_where_it_stopped_on_the_same_version(s3_bucket: S3Bucket, client: Any) -> None:
    raw = S3Store(s3_bucket.name, "p", client=client)
    data = payload(3 * MiB + 17)
    raw.write("big", data)
    net = Network(client, breaks=1)
    with pytest.raises(Unavailable, match="unreachable or timing out"):
        read_in_chunks(raw, "big")  # the fault is real: a plain store fails the read
    net.breaks += 1
    assert read_in_chunks(resuming(raw), "big") == data
    etag = raw.stat("big").etag
    key = "p/big"
    assert net.gets[-2:] == [(key, None, None), (key, f"bytes={BREAK_AFTER}-", etag)]  # resumed, pinned
    net.breaks += 1
    assert read_bytes(resuming(raw), "big") == data  # a read to the end that dies goes on from byte 0
    assert net.gets[-1] == (key, "bytes=0-", etag)


def test_an_object_replaced_before_the_read_resumes_is_never_mixed(s3_bucket: S3Bucket, client: Any) -> None:
    raw = S3Store(s3_bucket.name, client=client)
    data = payload(1 * MiB)
    raw.write("obj", data)
    net = Network(client)
    net.before_resume = lambda key: s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=key, Body=data[::-1])
    with pytest.raises(ObjectChanged, match="replaced while it was being read"):
        read_in_chunks(resuming(raw), "obj")


def _guide_checkpoint(root: Path, step: int) -> None:
    import torch
    from ckptier.tasks.demo import write_guide_checkpoint

    gen = torch.Generator().manual_seed(step)
    write_guide_checkpoint(root / f"llm/step-{step:08d}", {"rank-0000/model.pt": {"w": torch.randn(512, 1024, generator=gen)}},
                           step=step, loss=1.0)


def _upload(root: Path, store: S3Store) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            store.write(path.relative_to(root).as_posix(), path.read_bytes())


def test_a_deep_verify_through_the_run_stores_survives_broken_reads(
    s3_bucket: S3Bucket, client: Any, tmp_path: Path
) -> None:
    from ckptier.tasks.archive import prefix_from_location
    from ckptier.tasks.pipeline import VerifyOptions, run_verify
    from ckptier.tasks.run import Run, StoreCache
    from ckptier.tasks.scan import scan_url
    from ckptier.tasks.verify import verify_many

    for step in (100, 200):
        _guide_checkpoint(tmp_path / "ckpt", step)
    store = S3Store(s3_bucket.name, client=client)
    _upload(tmp_path / "ckpt", store)
    now = datetime.now(UTC) + timedelta(hours=3)
    with Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        scan_url(store.url, cat, now=now, store=store)
        records = cat.checkpoints(job="llm")
        net = Network(client)
        # The fault is real: over the plain store, the broken reads are errors.
        plain = {r.step: o for r, o in verify_many(lambda r: (store, prefix_from_location(store, r.location)), records,
                                                   deep=True)}
        assert all(o.count("error") == 1 for o in plain.values()), plain  # model.pt broke; metadata.json is small
        net.broken.clear()
        report = run_verify(Run.of(cat, now=lambda: now, stores=StoreCache(opener=lambda url: store)), VerifyOptions(deep=True))
        assert report.totals.verified == 2 and report.totals.errors == 0, report
        assert report.totals.bytes_read == sum(r.bytes for r in records)
        assert all(cat.get("llm", s).state == State.VERIFIED for s in (100, 200))  # type: ignore[union-attr]
        assert sum(1 for _, rng, _ in net.gets if rng) == 2  # each model.pt resumed once


# -- a listing that fails part-way ---------------------------------------------------------------


def test_a_scan_whose_listing_fails_part_way_is_started_again(
    s3_bucket: S3Bucket, client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptier.tasks import scan
    from ckptier.tasks.scan import scan_url

    steps = (100, 200, 300)
    for step in steps:
        _guide_checkpoint(tmp_path / "ckpt", step)
    # A flat listing (one thread), so that every page after the first carries a continuation token.
    store = S3Store(s3_bucket.name, "hot", client=client, list_page_size=2, list_workers=1)
    _upload(tmp_path / "ckpt", store)
    pages: list[bool] = []

    def third_page_fails_once(request: Any, **_: Any) -> Any:
        failing = "continuation-token" in request.url and len(pages) < 5 and sum(pages) < 3
        pages.append(failing)
        return fake_response(request, 503, error_xml("SlowDown", "Reduce your request rate.")) if failing else None

    client.meta.events.register("before-send.s3.ListObjectsV2", third_page_fails_once)
    now = datetime.now(UTC) + timedelta(hours=3)
    with Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}") as cat:
        with pytest.raises(Unavailable):  # the fault is real: botocore's 3 attempts all fail
            scan_url(store.url, cat, now=now, store=store)
        assert cat.checkpoints() == []  # a failed listing records nothing
        pages.clear()
        monkeypatch.setattr(scan, "open_store", lambda url: store)  # the store the run would open
        report = scan_url(store.url, cat, now=now)
        assert [c.step for c in cat.checkpoints(job="llm")] == list(steps)
        assert report.objects == 2 * len(steps)  # each object once, though listed again
    assert pages.count(True) == 3 and pages[0] is False  # the first page passed, then the second failed 3 times


# -- nothing else is tried again -----------------------------------------------------------------


def test_a_call_that_makes_no_progress_fails_after_the_requests_own_retries(s3_bucket: S3Bucket, client: Any) -> None:
    store = resuming(S3Store(s3_bucket.name, client=client, list_page_size=2))
    store.write("a", b"1")
    sent: list[str] = []

    def storm(request: Any, **_: Any) -> Any:
        sent.append(request.method)
        return fake_response(request, 503, error_xml("SlowDown", "Reduce your request rate."))

    for operation, call in (("HeadObject", lambda: store.stat("a")), ("ListObjectsV2", lambda: list(store.list())),
                            ("GetObject", lambda: store.open_read("a"))):
        sent.clear()
        client.meta.events.register(f"before-send.s3.{operation}", storm)
        with pytest.raises(Unavailable):
            call()
        client.meta.events.unregister(f"before-send.s3.{operation}", storm)
        assert len(sent) == 3, operation  # botocore's attempts, not multiplied


def test_a_batch_delete_resends_only_after_progress(s3_bucket: S3Bucket, client: Any) -> None:
    store = resuming(S3Store(s3_bucket.name, client=client))
    keys = [f"k/{i:05d}" for i in range(MAX_DELETE_BATCH + 3)]
    store.write(keys[-1], b"x")
    batches: list[list[str]] = []
    fail = {"from": 2, "times": 3}

    def nth_batch_throttled(request: Any, **_: Any) -> Any:
        batches.append(keys_in(request))
        if len(batches) >= fail["from"] and fail["times"] > 0:
            fail["times"] -= 1
            return fake_response(request, 503, error_xml("SlowDown", "Reduce your request rate."))
        return None

    client.meta.events.register("before-send.s3.DeleteObjects", nth_batch_throttled)
    result = store.delete_many(keys)  # batch 1 confirmed, batch 2 failed 3 times: resent once, then done
    assert sorted(result.deleted) == keys
    assert [len(b) for b in batches] == [MAX_DELETE_BATCH, 3, 3, 3, 3]
    batches.clear()
    fail.update({"from": 1, "times": 3})
    with pytest.raises(DeleteInterrupted) as info:  # the first batch fails: nothing confirmed, nothing resent
        store.delete_many(keys)
    assert len(batches) == 3 and info.value.result.deleted == []



class _ListsInTries:
    """A store whose listing is scripted try by try: each try yields its keys,
    then raises a transient error unless it is the last."""

    def __init__(self, tries: list[list[str]]) -> None:
        self.tries = tries
        self.started = 0

    def list(self, prefix: str = "") -> Any:
        keys = self.tries[self.started]
        self.started += 1
        for key in keys:
            yield ObjectInfo(key, 1)
        if self.started < len(self.tries):
            raise Unavailable(f"listing cut off after {keys[-1:] or 'nothing'}")


@pytest.mark.parametrize(
    ("tries", "want", "started"),
    [
        pytest.param([["a", "b"], ["a", "b", "c"], ["a", "b", "c", "d", "e"]], ["a", "b", "c", "d", "e"], 3,
                     id="each try gets further"),
        pytest.param([["b", "a"], ["c", "a", "d", "b"], ["e", "d", "c", "b", "a"]], ["b", "a", "c", "d", "e"], 3,
                     id="in another order each time"),
        pytest.param([["a", "b"], ["b", "a"], ["a", "b", "c"]], None, 2, id="a try with nothing new stops"),
        pytest.param([[], ["a"]], None, 1, id="a first try with nothing stops"),
    ],
)
def test_a_restarted_listing_yields_each_key_once_and_goes_on_only_after_progress(
    tries: list[list[str]], want: list[str] | None, started: int
) -> None:
    inner = _ListsInTries(tries)
    store = RetryingStore(inner, resume_only=True, sleep=lambda s: None)  # type: ignore[arg-type]
    got: list[str] = []
    if want is None:
        with pytest.raises(Unavailable):
            got.extend(info.key for info in store.list())
        assert len(got) == len(set(got))
    else:
        got.extend(info.key for info in store.list())
        assert got == want
    assert inner.started == started
