"""``ckptier verify`` as one operation: choose the checkpoints, read them, record what was found.

:func:`run_verify` is what the command line runs directly and what the
verify flow's task wraps (re-exported by :mod:`ckptier.tasks.pipeline` with
the other operations). It lives apart from them so that a verify run loads
what verifying needs only: the catalog, the stores, the hashing and the
formats' checkers, not retention, promotion, deletion or the catalog's
backup (the archive's read-back is imported when an archive copy is read).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptier.storage.catalog.api import Catalog, LeaseLost, ReadBack
from ckptier.storage.records import CheckpointRecord, CopyState, State, Tier

from .config import policy_grace
from .leases import LeaseKeeper, this_process
from .reports import VerifyReport, VerifyRow, VerifyTotals, archive_file_problems, file_problems
from .run import CLAIM_SHARE, FIRST_POLL, MIN_CLAIM, Clock, RowClaims, Run, StoreCache, unknown_job
from .verify import needs_verification, select_sample, verify_fanned, verify_many

if TYPE_CHECKING:
    from .fanout import Fanout


@dataclass(frozen=True)
class VerifyOptions:
    """What ``ckptier verify`` (and the verify flow) is asked to check, and how.

    ``job`` (None: every job); ``deep``: read every byte even where the store
    keeps a full-object checksum, and read archive copies back;
    ``sample=(k, n)``: only the k-th of n disjoint slices, read deep;
    ``workers``: files read at once by this process's threads; ``claims``:
    share the work with other runs on the catalog (:class:`~ckptier.tasks.run.RowClaims`).
    """

    job: str | None = None
    deep: bool = False
    sample: tuple[int, int] | None = None
    workers: int = 4
    claims: RowClaims | None = None


def run_verify(run: Run, options: VerifyOptions = VerifyOptions(), *,
               progress: Callable[[int, int], None] | None = None, fanout: Fanout | None = None) -> VerifyReport:
    """Verify the checkpoints that need it and record the results.

    What to verify is ``options`` (:class:`VerifyOptions`). ``fanout`` (a
    :class:`ckptier.tasks.fanout.Fanout`) reads the files there, in batches
    of checkpoints, instead of ``options.workers`` threads here; this process
    still records every result; ``progress(done_bytes, total_bytes)`` is
    told how far the reading got. With ``options.claims``, this run is
    one of several sharing the catalog: it claims the candidates row by row
    (:meth:`Catalog.claim_rows`, leases kept alive by a heartbeat) until none
    is left unchecked since ``claims.since``, records each result only while
    its lease holds (so each row is recorded by exactly one run), and reads
    back the archive copies of the rows it claimed only; rows a dead run had
    claimed are taken once its lease runs out.

    Candidates are committed, verified and corrupt checkpoints present in
    the hot tier (``job`` restricts them; ``sample=(k, n)`` keeps the k-th
    of n disjoint slices). Which of them are read is
    :func:`~ckptier.tasks.verify.needs_verification`: a committed one; one
    already verified only with ``deep`` or a sample (a periodic deep read),
    when a file of it could not be read last time, or when its files changed
    since (a rescan put it back to ``committed``). Returns a
    :class:`~ckptier.tasks.reports.VerifyReport`: one
    :class:`~ckptier.tasks.reports.VerifyRow` per hot copy checked, then one
    per archive copy read back, their totals (``totals.corrupt`` > 0 means
    corruption was found) and the sample; ``by_job`` is left None;
    ``nothing_checked`` says why when no copy was read.
    ``run.config`` gives each job's grace (default 2 h): a checkpoint whose
    manifest requires absent files is ``incomplete`` within it, ``corrupt``
    after. A row's ``files`` lists every file found bad, with the expected
    and the actual size and hashes (:class:`~ckptier.tasks.reports.FileProblem`);
    an archive copy's row also has ``problems``, one line per damaged file
    of the copy.
    """
    catalog, stores, now = run.catalog, run.stores, run.now
    job, deep, sample, workers, claims = options.job, options.deep, options.sample, options.workers, options.claims
    states = (State.COMMITTED, State.VERIFIED, State.CORRUPT)
    cataloged = catalog.checkpoints(job=job, states=states)
    if job and not cataloged and not catalog.checkpoints(job=job):
        raise unknown_job(job)
    if sample is not None:
        cataloged = select_sample(cataloged, *sample)
    # Verify against the store's checksum unless a deep read was asked for.
    deep_read = deep or sample is not None
    # Hot copies are verified where they still exist (a milestone whose hot copy
    # ckptier deleted lives on in the archive only, and is read back there), when
    # the rule says so (a deep read or a sample reads every one).
    records = [c for c in cataloged if "hot" in c.tiers and needs_verification(c, deep=deep_read) is not None]
    rows: list[VerifyRow] = []
    grace_for = policy_grace(run.config)

    def verified(batch: Sequence[CheckpointRecord], report: Callable[[int, int], None] | None = None
                 ) -> Iterable[tuple[CheckpointRecord, Any]]:
        if fanout is not None:
            return verify_fanned(fanout, batch, deep=deep_read, progress=report)
        return verify_many(stores.for_record, batch, deep=deep_read, workers=workers, progress=report)

    claimed: list[CheckpointRecord] = []
    chunks: Iterable[list[tuple[CheckpointRecord, Any, Any]]]
    if claims is not None:
        chunks = _claimed_verification(catalog, records, with_archive_copy(cataloged) if deep_read else [],
                                       claims=claims, now=now, verified=verified, claimed=claimed)
    else:
        chunks = recording_batches((record, outcome, None) for record, outcome in verified(records, progress))
    for chunk in chunks:
        recorded = catalog.record_verifications(
            [ReadBack(record.id, tuple(outcome.results), grace=grace_for(record.job), extra=tuple(outcome.extra),
                      claim=None if lease is None or claims is None else (claims.owner, lease.generation))
             for record, outcome, lease in chunk], now=now())
        for (record, outcome, _), state in zip(chunk, recorded, strict=True):
            if isinstance(state, LeaseLost):
                continue  # our lease ran out: the row's new holder records it
            errors = outcome.count("error")
            detail = "; ".join(
                [f"{r.relpath}: {r.detail}" for r in outcome.results if r.status != "ok" and r.detail][:3]
                + [f"extra file {x}" for x in outcome.extra[:3]]
                + outcome.notes
            )
            rows.append(VerifyRow(
                job=record.job, step=record.step, tier="hot", state=state.value,
                bytes_read=outcome.bytes_read, bytes_skipped=outcome.bytes_skipped,
                errors=errors, extra=tuple(outcome.extra), detail=detail or None,
                files=tuple(file_problems(record.files, outcome.results)),
            ))
    if deep or sample is not None:
        archived = with_archive_copy(claimed if claims is not None else cataloged)
        if archived:
            rows.extend(_verify_archive_copies(catalog, archived, stores=stores, now=now))
    idle = None if rows else nothing_verified(catalog.checkpoints(job=job, with_files=False), deep=deep, sample=sample)
    return VerifyReport(tuple(rows), VerifyTotals.of(rows), sample, nothing_checked=idle)


def nothing_verified(records: Sequence[CheckpointRecord], *, deep: bool, sample: tuple[int, int] | None) -> str:
    """Why a verify run over ``records`` (the cataloged checkpoints it considered,
    any state) read nothing, in words (pure)."""
    if not records:
        return "the catalog holds no checkpoints yet; run 'ckptier scan URL' first"
    if sample is not None:
        return f"slice {sample[0]}/{sample[1]} holds none of the {len(records)} cataloged checkpoints"
    if deep:
        return f"none of the {len(records)} cataloged checkpoints has a copy to read (states: " + \
            ", ".join(sorted({c.state.value for c in records})) + ")"
    waiting = sum(1 for c in records if c.state == State.INCOMPLETE)
    return (f"every one of the {len(records)} cataloged checkpoints is already verified or still being written"
            + (f" ({waiting} incomplete)" if waiting else "") + "; --deep re-reads every byte")


#: Most checkpoints recorded in one catalog transaction, and the bytes read
#: after which a batch is recorded anyway (big checkpoints: one by one).
RECORD_BATCH = 16
RECORD_BATCH_BYTES = 256 << 20


def recording_batches(results: Iterable[tuple[CheckpointRecord, Any, Any]], *, most: int = RECORD_BATCH,
                      max_bytes: int = RECORD_BATCH_BYTES) -> Iterator[list[tuple[CheckpointRecord, Any, Any]]]:
    """``results`` (record, outcome, lease) in order, cut into the batches a run records at
    once: a batch ends at ``most`` checkpoints or once its checkpoints hold ``max_bytes``,
    so a run killed mid-way loses little read work and the catalog writes cost little per checkpoint."""
    batch: list[tuple[CheckpointRecord, Any, Any]] = []
    size = 0
    for item in results:
        batch.append(item)
        size += sum(f.size for f in item[0].files)
        if len(batch) >= most or size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _claimed_verification(
    catalog: Catalog,
    records: Sequence[CheckpointRecord],
    archive_only: Sequence[CheckpointRecord],
    *,
    claims: RowClaims,
    now: Clock,
    verified: Callable[[Sequence[CheckpointRecord]], Iterable[tuple[CheckpointRecord, Any]]],
    claimed: list[CheckpointRecord],
) -> Iterator[list[tuple[CheckpointRecord, Any, Any]]]:
    """Claim ``records`` (and the ``archive_only`` ones: archive copies to read back)
    batch by batch, verify each claimed hot copy and yield each batch's ``(record, outcome,
    lease)`` triples at once, to be recorded together (their leases are kept alive until
    the caller asks for the next batch). At most three batches are held at once: one
    being recorded, one read, one claimed.

    Claimed records are appended to ``claimed``. A claimed row that no longer
    needs this run (deleted, its hot copy gone, not in this run's selection)
    is marked checked and released. Ends when no candidate is left unchecked
    since ``claims.since``.
    """
    since = claims.since or now()
    hot_ids = {r.id for r in records}
    pending = sorted(hot_ids | {r.id for r in archive_only if "hot" not in r.tiers})
    stop = threading.Event()

    def claim_next(keeper: LeaseKeeper, wait: bool) -> list[tuple[CheckpointRecord, Any]] | None:
        """Claim a batch: the claimed hot copies to read, with their leases. None: the
        sweep is done; an empty list: nothing is free now (only with ``wait`` False;
        with ``wait``, looks again while others hold the rest, at growing intervals: see RowClaims)."""
        delay = min(claims.poll, FIRST_POLL)
        while True:
            left = catalog.unchecked(pending, since=since)
            if stop.is_set() or not left:
                return None
            share = max(MIN_CLAIM, -(-left // CLAIM_SHARE))
            leases = keeper.claim_rows(pending, since=since, limit=max(1, min(claims.batch, share)))
            if leases:
                break
            if not wait:
                return []
            stop.wait(delay)
            delay = min(claims.poll, delay * 2)
        by_id = {lease.checkpoint_id: lease for lease in leases}
        fresh = catalog.get_many(by_id)
        to_read: list[tuple[CheckpointRecord, Any]] = []
        for record in fresh:
            if record.id in hot_ids and "hot" in record.tiers and record.state != State.DELETED:
                to_read.append((record, by_id[record.id]))
                claimed.append(record)
                continue
            if record.state != State.DELETED and record.archive_copy() is not None:
                claimed.append(record)  # archive copy only: read back by the caller
            catalog.finish_claim(record.id, claims.owner, by_id[record.id].generation, now=now())
            keeper.settled(by_id[record.id])
        for gone in set(by_id) - {r.id for r in fresh}:
            keeper.release(by_id[gone])
            pending.remove(gone)
        return to_read

    def read(batch: list[tuple[CheckpointRecord, Any]]) -> list[tuple[CheckpointRecord, Any, Any]]:
        leases = {record.id: lease for record, lease in batch}
        return [(record, outcome, leases[record.id]) for record, outcome in verified([r for r, _ in batch])]

    # A pipeline on two threads: batch k+1 is claimed (and its rows loaded) and
    # batch k read while the caller records batch k-1. A claim never waits on
    # rows this run holds itself: with batches in flight it says "nothing free
    # now", and the oldest batch is recorded first.
    with LeaseKeeper(catalog, claims.owner, now=now, ttl=claims.ttl, process=this_process(), take_over=None) as keeper, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptier-claims") as claimer, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptier-reads") as reader:
        in_flight: deque[Future[list[tuple[CheckpointRecord, Any, Any]]]] = deque()
        try:
            claiming = claimer.submit(claim_next, keeper, False)
            while (got := claiming.result()) is not None:
                if got:
                    in_flight.append(reader.submit(read, got))
                elif in_flight:  # nothing free now: record what this run holds, then look again
                    yield from _recorded_then_settled(in_flight.popleft().result(), keeper)
                claiming = claimer.submit(claim_next, keeper, not in_flight)
                if len(in_flight) > 1:
                    yield from _recorded_then_settled(in_flight.popleft().result(), keeper)
            while in_flight:
                yield from _recorded_then_settled(in_flight.popleft().result(), keeper)
        finally:
            stop.set()


def _recorded_then_settled(batch: list[tuple[CheckpointRecord, Any, Any]], keeper: Any
                           ) -> Iterator[list[tuple[CheckpointRecord, Any, Any]]]:
    """Yield ``batch`` (when not empty) to be recorded, then stop keeping its leases alive."""
    if batch:
        yield batch
    for _, _, lease in batch:
        keeper.settled(lease)


def with_archive_copy(records: Iterable[CheckpointRecord]) -> list[CheckpointRecord]:
    """The records that have an archive copy to read back (present or already degraded)."""

    return [c for c in records if c.archive_copy() is not None]


def _verify_archive_copies(catalog: Catalog, records: Sequence[CheckpointRecord], *, stores: StoreCache,
                           now: Clock) -> Iterator[VerifyRow]:
    """Deep-read each record's archive copy; mark it ``degraded`` (with an event) when its bytes are bad.
    Yields one archive :class:`~ckptier.tasks.reports.VerifyRow` per record, in order.

    A degraded copy of a checkpoint that no longer has a hot copy is the
    only copy at risk: its event says so.
    """
    from .archive import archive_root, check_archive_copy  # lazy: a verify run without archive copies never loads them

    for record in records:
        copy = record.archive_copy()
        assert copy is not None  # with_archive_copy() chose these records
        check = check_archive_copy(record, stores.store(archive_root(copy.url, record)))
        state = CopyState.PRESENT if check.ok else CopyState.DEGRADED
        if state != copy.state:
            catalog.set_copy_state(record.id, tier=Tier.ARCHIVE, url=copy.url, state=state, now=now())
        detail = "; ".join(check.problems[:3]) or None
        only = "hot" not in record.tiers
        if not check.ok:
            catalog.log_event(
                "archive.degraded",
                f"{record.job} step {record.step}: archive copy {copy.url} is damaged"
                + (" and it is the ONLY copy: restore it from elsewhere now" if only else "; the hot copy is intact")
                + f" ({detail})",
                now=now(), job=record.job, checkpoint_id=record.id,
                data={"only_copy": only, "problems": list(check.problems)},
            )
        yield VerifyRow(job=record.job, step=record.step, tier=Tier.ARCHIVE.value,
                        state=State.VERIFIED.value if check.ok else CopyState.DEGRADED.value,
                        bytes_read=check.bytes_read, bytes_skipped=0, errors=0, extra=(),
                        detail=(("only copy at risk: " if only else "") + detail) if detail else None,
                        files=tuple(archive_file_problems(record.files, check.bad_files)),
                        problems=tuple(check.problems))
