"""S3Store.list on a real moto_server bucket: the parallel listing (ranges cut at
the job and step prefixes, listed concurrently) yields exactly the objects of
a flat listing, each once, and recognition makes the same of both."""

from __future__ import annotations

import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from ckptier.formats import recognise
from ckptier.storage.base import ObjectInfo, read_bytes
from ckptier.storage.s3 import S3Store

from tests.fixtures.s3 import S3Server, make_client
from tests.test_s3_faults import error_xml, fake_response

pytestmark = [pytest.mark.s3, pytest.mark.slow]

PAGE = 25


def layout() -> dict[str, bytes]:
    """About 2,600 keys: five jobs of guide-layout steps, keys directly at the root and
    at intermediate levels, names that sort between a prefix and its slash
    (``step-00000005.tmp`` < ``step-00000005/``), a deeper tree, a folder marker and
    an unsafe key."""
    keys: dict[str, bytes] = {
        "README": b"r", "a.txt": b"a", "job-a.txt": b"j", "zz-root": b"z",
        "job-a/notes.txt": b"n", "job-a/step-00000005.tmp": b"t", "job-a/step-00000005-old/x": b"x",
        "job-b/sub/deeper/step-00000001/x/y/z.bin": b"d", "job-b/sub/loose": b"l",
        "job-c/": b"", "job-d//double": b"u",
    }
    for j in "abcde":
        for s in range(1, 101):
            base = f"job-{j}/step-{s:08d}"
            for r in range(4):
                keys[f"{base}/rank-{r:04d}/model.pt"] = b"w"
            keys[f"{base}/metadata.json"] = json.dumps({"step": s}).encode()
    return keys


_FILLED: dict[str, tuple[str, str, dict[str, bytes]]] = {}


@pytest.fixture
def filled(s3_server: S3Server) -> tuple[str, str, dict[str, bytes]]:
    """One bucket per server for the module, filled once (PUTs in parallel), under the prefix ``runs``.

    The tests only read it, so every test of the module on one server shares it.
    """
    if s3_server.name not in _FILLED:
        client = make_client(s3_server.endpoint, max_pool_connections=16)
        name = f"ckptier-list-{uuid.uuid4().hex[:12]}"
        client.create_bucket(Bucket=name)
        keys = layout()
        with ThreadPoolExecutor(12) as pool:
            list(pool.map(lambda kv: client.put_object(Bucket=name, Key=f"runs/{kv[0]}", Body=kv[1]), keys.items()))
        client.put_object(Bucket=name, Key="other/outside", Body=b"o")  # outside the store's prefix
        _FILLED[s3_server.name] = (s3_server.endpoint, name, keys)
    return _FILLED[s3_server.name]


def store_for(endpoint: str, bucket: str, *, workers: int, **config: Any) -> S3Store:
    client = make_client(endpoint, max_pool_connections=32, **config)
    return S3Store(bucket, "runs", client=client, list_page_size=PAGE, list_workers=workers)


def count_lists(store: S3Store) -> list[str]:
    """Record the operation of every ListObjectsV2 request (``flat``/``delimiter``)."""
    seen: list[str] = []
    lock = threading.Lock()

    def hook(params: dict[str, Any], **_: Any) -> None:
        with lock:
            seen.append("delimiter" if params.get("Delimiter") else "flat")

    store.client.meta.events.register("before-parameter-build.s3.ListObjectsV2", hook)
    return seen


def as_tuples(infos: list[ObjectInfo]) -> list[tuple[str, int, float | None, str | None]]:
    return sorted((i.key, i.size, i.mtime, i.etag) for i in infos)


def test_parallel_listing_yields_exactly_the_flat_listing(filled: tuple[str, str, dict[str, bytes]]) -> None:
    endpoint, bucket, keys = filled
    flat_store = store_for(endpoint, bucket, workers=1)
    flat_requests = count_lists(flat_store)
    flat = list(flat_store.list())
    par_store = store_for(endpoint, bucket, workers=4)
    par_requests = count_lists(par_store)
    parallel = list(par_store.list())

    expected = {k for k in keys if not k.endswith("/") and "//" not in k}
    assert {i.key for i in flat} == expected
    assert len(parallel) == len({i.key for i in parallel}) == len(expected), "each key exactly once"
    assert as_tuples(parallel) == as_tuples(flat)
    # It really ran in parallel ranges, and cost about what the flat listing costs.
    assert par_requests.count("delimiter") >= 2
    assert flat_requests == ["flat"] * -(-len(keys) // PAGE)
    assert par_requests.count("flat") <= len(flat_requests) + 4 * 4 + 1


def test_the_production_wrapper_lists_in_parallel(filled: tuple[str, str, dict[str, bytes]]) -> None:
    """Runs list through ``resuming``: the wrapped store's listing is still the parallel one."""
    from ckptier.storage.wrappers import resuming

    endpoint, bucket, keys = filled
    inner = store_for(endpoint, bucket, workers=4)
    requests = count_lists(inner)
    threads: set[str] = set()
    inner.client.meta.events.register("before-parameter-build.s3.ListObjectsV2",
                                      lambda **_: threads.add(threading.current_thread().name))
    listed = list(resuming(inner).list())
    assert len(listed) == len({i.key for i in listed}) == len({k for k in keys if not k.endswith("/") and "//" not in k})
    assert requests.count("delimiter") >= 2
    assert len({t for t in threads if t.startswith("ckptier-s3-list")}) >= 2


def test_parallel_listing_of_a_sub_prefix_and_of_nothing(filled: tuple[str, str, dict[str, bytes]]) -> None:
    endpoint, bucket, keys = filled
    store = store_for(endpoint, bucket, workers=4)
    got = [i.key for i in store.list("job-a/")]
    assert sorted(got) == sorted(k for k in keys if k.startswith("job-a/"))
    assert len(got) == len(set(got))
    assert list(store.list("job-zzz/")) == []


def test_short_listing_is_one_request(filled: tuple[str, str, dict[str, bytes]]) -> None:
    endpoint, bucket, _ = filled
    store = store_for(endpoint, bucket, workers=4)
    requests = count_lists(store)
    assert [i.key for i in store.list("job-a/step-00000001/")] == [
        *(f"job-a/step-00000001/{n}" for n in ["metadata.json"]),
        *(f"job-a/step-00000001/rank-{r:04d}/model.pt" for r in range(4)),
    ]
    assert requests == ["flat"]


def test_recognition_is_the_same_on_both_listings(filled: tuple[str, str, dict[str, bytes]]) -> None:
    endpoint, bucket, _ = filled
    flat_store = store_for(endpoint, bucket, workers=1)
    par_store = store_for(endpoint, bucket, workers=4)
    now = time.time()
    a = recognise(flat_store.list(), lambda k: read_bytes(flat_store, k), root_name="runs", now=now)
    b = recognise(par_store.list(), lambda k: read_bytes(par_store, k), root_name="runs", now=now)
    assert a == b
    assert len(a.checkpoints) == 500


def test_throttled_pages_are_retried_and_nothing_is_lost(filled: tuple[str, str, dict[str, bytes]]) -> None:
    endpoint, bucket, keys = filled
    store = store_for(endpoint, bucket, workers=4, retries={"mode": "standard", "total_max_attempts": 3})
    calls = {"n": 0, "failed": 0}
    seen: set[str] = set()
    lock = threading.Lock()

    def throttle(request: Any, **_: Any) -> Any:
        """Every third distinct request is throttled once (its retry goes through)."""
        with lock:
            fail = request.url not in seen and calls["n"] % 3 == 0
            if request.url not in seen:
                calls["n"] += 1
                seen.add(request.url)
            calls["failed"] += fail
        if fail:
            return fake_response(request, 503, error_xml("SlowDown", "Please reduce your request rate."))
        return None

    store.client.meta.events.register("before-send.s3.ListObjectsV2", throttle)
    got = [i.key for i in store.list()]
    assert calls["failed"] >= 5
    assert len(got) == len(set(got)) == len({k for k in keys if not k.endswith("/") and "//" not in k})


def test_closing_the_listing_early_stops_its_threads(filled: tuple[str, str, dict[str, bytes]]) -> None:
    endpoint, bucket, _ = filled
    store = store_for(endpoint, bucket, workers=4)
    listing = store.list()
    first = [next(listing) for _ in range(PAGE + 5)]  # into the parallel part
    assert len(first) == PAGE + 5
    listing.close()  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while any(t.name.startswith("ckptier-s3-list") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("ckptier-s3-list")]


def test_missing_bucket_is_not_found(s3_server: S3Server) -> None:
    from ckptier.storage.errors import NotFound

    store = S3Store("ckptier-no-such-bucket-xyz", client=make_client(s3_server.endpoint), list_workers=4)
    with pytest.raises(NotFound, match="bucket does not exist"):
        list(store.list())


@pytest.mark.parametrize("text", ["2026-11-30T15:03:29.000Z", "2026-11-30T15:03:29Z", "2026-11-30T15:03:29.123456Z",
                                  "Mon, 30 Nov 2026 15:03:29 GMT", "Sun, 01 Feb 2026 00:00:00 GMT",
                                  "Wed, 29 Feb 2028 23:59:59 GMT", "Mon, 30 Nov 2026 15:03:29 +0000", "1796051009"])
def test_the_fast_timestamp_parser_agrees_with_botocores(text: str) -> None:
    from botocore.utils import parse_timestamp
    from ckptier.storage.s3 import fast_timestamp

    assert fast_timestamp(text) == parse_timestamp(text)
    assert fast_timestamp(text).timestamp() == parse_timestamp(text).timestamp()
