"""A job's retention policy as S3 bucket lifecycle rules: a backstop S3 enforces itself.

Pure: builds the ``LifecycleConfiguration`` document (boto3's shape, the
JSON ``aws s3api put-bucket-lifecycle-configuration`` takes) without
touching a store; S3 itself decides which objects a rule applies to. What S3
can enforce by itself, and only that:

* **archive tiers**: archive copies under the job's archive prefix move to
  colder classes by age (the policy's ``archive_tiers``);
* **expiry of what ckptier decided to delete, and nothing else**: objects
  under the job's hot prefix that carry the tag
  ``ckptier:retention = delete`` (:data:`DELETE_TAG`) expire. ckptier sets
  that tag only on the files of checkpoints its plan deletes
  (``ckptier apply`` tags the files it is about to delete once it has
  recorded the delete intent: :func:`ckptier.tasks.apply.tag_keys`), so the
  store never expires a checkpoint the plan keeps: every expiring rule is
  scoped by prefix AND tag;
* **housekeeping** under both prefixes: noncurrent versions expire (a
  versioned bucket otherwise keeps deleted checkpoints' bytes forever),
  delete markers left without versions go, incomplete multipart uploads are
  aborted.

S3 applies a bucket's whole lifecycle configuration at once and
``PutBucketLifecycleConfiguration`` *replaces* it: merge these rules (their
IDs start with ``ckptier:<job>:``) with the bucket's other rules.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptier.storage.errors import ConfigError
from ckptier.storage.records import CheckpointRecord
from ckptier.storage.url import parse_location, parse_url

from .retention import Policy
from .tiers import NEEDS_RESTORE, lifecycle_problem

#: The tag ckptier puts on every hot file of a checkpoint its plan deletes
#: (``ckptier apply``, after recording the delete intent, before deleting).
DELETE_TAG: tuple[str, str] = ("ckptier:retention", "delete")
#: What that tag becomes when a delete that had not started is dropped and
#: the plan decides anew (no expiring rule matches it).
KEEP_TAG: tuple[str, str] = ("ckptier:retention", "keep")
#: Days after creation before S3 expires a tagged object (S3's minimum is 1;
#: ckptier deletes them itself first, the rule is the backstop).
EXPIRE_TAGGED_DAYS = 1
#: Days a noncurrent version of a hot file is kept before it expires.
HOT_NONCURRENT_DAYS = 7
#: Days a noncurrent version of an archive object is kept (longer: the
#: archive may hold the only copy of a milestone, and this is the window in
#: which an accidental delete can be undone).
ARCHIVE_NONCURRENT_DAYS = 30
#: Days before S3 aborts an incomplete multipart upload (S3 rounds up to the
#: next midnight UTC; ckptier's janitor aborts them after 24 h).
ABORT_MULTIPART_DAYS = 2
_MAX_ID = 255
_ROOT_RE = re.compile(r"^(s3://[^/]+/|file:///)")


@dataclass(frozen=True)
class LifecycleConfig:
    """The rules for one bucket. ``rules`` are S3 ``Rule`` objects (boto3
    shape); ``notes`` are one-line remarks for the user (what the rules do not
    cover, what to merge)."""

    job: str
    bucket: str
    hot_prefix: str | None
    archive_prefix: str | None
    rules: tuple[Mapping[str, Any], ...]
    notes: tuple[str, ...]

    def document(self) -> dict[str, Any]:
        """The ``LifecycleConfiguration`` document (a fresh copy)."""
        return {"Rules": [copy.deepcopy(dict(r)) for r in self.rules]}


# ------------------------------------------------------------------ the job's prefix


def job_prefix_url(records: Sequence[CheckpointRecord]) -> str | None:
    """The deepest directory URL (ending in ``/``) holding every checkpoint of
    ``records`` (one job): the parent of each checkpoint's location, then
    their common directory. None when there are no records or they span
    stores (schemes or buckets)."""
    roots: set[str] = set()
    dirs: list[list[str]] = []
    for r in records:
        match = _ROOT_RE.match(r.location)
        if match is None:
            return None
        roots.add(match.group(0))
        dirs.append([p for p in r.location[match.end():].rstrip("/").split("/") if p][:-1])
    if len(roots) != 1:
        return None
    common: list[str] = []
    for parts in zip(*dirs, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return roots.pop() + "".join(f"{p}/" for p in common)


# ------------------------------------------------------------------ rules


def _rule_id(job: str, what: str) -> str:
    room = _MAX_ID - len("ckptier::") - len(what)
    return f"ckptier:{job[:room]}:{what}"


def _filter(prefix: str, tags: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
    """S3's Filter for ``prefix`` AND every tag (``And`` only when it combines two or more)."""
    tag_list = [{"Key": k, "Value": v} for k, v in tags]
    if tag_list and (prefix or len(tag_list) > 1):
        both: dict[str, Any] = {"Tags": tag_list}
        if prefix:
            both = {"Prefix": prefix, **both}
        return {"And": both}
    if tag_list:
        return {"Tag": tag_list[0]}
    return {"Prefix": prefix}


def _housekeeping(job: str, where: str, prefix: str, noncurrent_days: int, abort_days: int) -> dict[str, Any]:
    return {
        "ID": _rule_id(job, f"{where}-housekeeping"),
        "Filter": _filter(prefix),
        "Status": "Enabled",
        "Expiration": {"ExpiredObjectDeleteMarker": True},
        "NoncurrentVersionExpiration": {"NoncurrentDays": noncurrent_days},
        "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": abort_days},
    }


def lifecycle_for_job(
    job: str,
    *,
    hot_url: str | None,
    policy: Policy,
    bucket: str | None = None,
    expire_tagged_days: int = EXPIRE_TAGGED_DAYS,
    hot_noncurrent_days: int = HOT_NONCURRENT_DAYS,
    archive_noncurrent_days: int = ARCHIVE_NONCURRENT_DAYS,
    abort_multipart_days: int = ABORT_MULTIPART_DAYS,
) -> LifecycleConfig:
    """The lifecycle rules mirroring ``policy`` for ``job`` in one bucket.

    ``hot_url``: the directory holding the job's checkpoints (see
    :func:`job_prefix_url`); the archive prefix is ``<policy.archive>/<job>/``
    (the archive's layout). ``bucket`` chooses the bucket when the hot
    checkpoints and the archive live in different ones. Raises
    :class:`ConfigError` (one line, naming the fix) when nothing of the job is
    on S3, when the bucket is ambiguous or holds nothing of the job, or when
    S3 would reject the policy's ``archive_tiers``.
    """
    for name, days in (("expire_tagged_days", expire_tagged_days), ("hot_noncurrent_days", hot_noncurrent_days),
                       ("archive_noncurrent_days", archive_noncurrent_days),
                       ("abort_multipart_days", abort_multipart_days)):
        if days < 1:
            raise ConfigError(f"{name} = {days}: S3 lifecycle days must be ≥ 1")
    hot = parse_location(hot_url) if hot_url else None  # a location: its keys are raw
    arch = parse_url(policy.archive) if policy.archive else None
    places: dict[str, list[str]] = {}
    if hot is not None and hot.scheme == "s3":
        places.setdefault(hot.bucket, []).append("hot")
    if arch is not None and arch.scheme == "s3":
        places.setdefault(arch.bucket, []).append("archive")
    if not places:
        raise ConfigError(
            f"job {job!r}: neither its checkpoints ({hot_url or 'unknown'}) nor its archive "
            f"({policy.archive or 'none'}) are on S3: there is nothing for a bucket lifecycle to enforce"
        )
    if bucket is None:
        if len(places) > 1:
            raise ConfigError(
                f"job {job!r} uses buckets {', '.join(sorted(places))} (a lifecycle configuration belongs to one "
                f"bucket): pass --bucket {' or --bucket '.join(sorted(places))}"
            )
        bucket = next(iter(places))
    elif bucket not in places:
        raise ConfigError(
            f"bucket {bucket!r} holds nothing of job {job!r} (its buckets: {', '.join(sorted(places))}); "
            f"pass one of those to --bucket"
        )
    rules: list[dict[str, Any]] = []
    notes: list[str] = [
        (
            "PutBucketLifecycleConfiguration replaces every rule of the bucket: merge these with the bucket's "
            f"other rules (IDs starting with ckptier:{job}: are ckptier's)"
        ),
    ]
    hot_prefix = archive_prefix = None
    if "hot" in places[bucket]:
        assert hot is not None
        hot_prefix = f"{hot.prefix}/" if hot.prefix else ""
        rules.append({
            "ID": _rule_id(job, "hot-expire-deleted"),
            "Filter": _filter(hot_prefix, [DELETE_TAG]),
            "Status": "Enabled",
            "Expiration": {"Days": expire_tagged_days},
        })
        rules.append(_housekeeping(job, "hot", hot_prefix, hot_noncurrent_days, abort_multipart_days))
        if not hot_prefix:
            notes.append(
                f"job {job!r}'s checkpoints sit at the top of bucket {bucket}: the expiry rule matches ckptier's "
                f"delete tag anywhere in it (only objects ckptier decided to delete carry that tag)"
            )
        notes.append(
            f"checkpoints ckptier deletes are tagged {DELETE_TAG[0]}={DELETE_TAG[1]} first; S3 expires tagged ones "
            f"left behind after {expire_tagged_days} day(s) (counted from each object's creation)"
        )
    if "archive" in places[bucket]:
        assert arch is not None
        archive_prefix = f"{arch.prefix}/{job}/" if arch.prefix else f"{job}/"
        if policy.archive_tiers:
            if (problem := lifecycle_problem(policy.archive_tiers)) is not None:
                raise ConfigError(f"policy for job {job!r}: {problem}")
            rules.append({
                "ID": _rule_id(job, "archive-tiers"),
                "Filter": _filter(archive_prefix),
                "Status": "Enabled",
                "Transitions": [{"Days": t.days, "StorageClass": t.storage_class} for t in policy.archive_tiers],
            })
            cold = [t for t in policy.archive_tiers if t.storage_class in NEEDS_RESTORE]
            if cold:
                notes.append(
                    f"archive copies in {cold[0].storage_class} need a restore (hours) before ckptier can read, "
                    f"verify, fetch or drill them"
                )
        else:
            notes.append(f"the policy sets no archive_tiers: archive copies stay in {policy.storage_class or 'STANDARD'}")
        rules.append(_housekeeping(job, "archive", archive_prefix, archive_noncurrent_days, abort_multipart_days))
        notes.append("archive copies never expire: retention never deletes them")
    return LifecycleConfig(job, bucket, hot_prefix, archive_prefix, tuple(rules), tuple(notes))
