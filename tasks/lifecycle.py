"""A job's retention policy as S3 bucket lifecycle rules: a backstop S3 enforces itself.

Pure: builds the ``LifecycleConfiguration`` document (boto3's shape, the
JSON ``aws s3api put-bucket-lifecycle-configuration`` takes) and says which
objects a rule applies to, without touching a store. What S3 can enforce by
itself, and only that:

* **archive tiers**: archive copies under the job's archive prefix move to
  colder classes by age (the policy's ``archive_tiers``);
* **expiry of what ckptier decided to delete, and nothing else**: objects
  under the job's hot prefix that carry the tag
  ``ckptier:retention = delete`` (:data:`DELETE_TAG`) expire. ckptier sets
  that tag only on the files of checkpoints its plan deletes
  (:func:`deletion_targets`; ``ckptier apply`` tags them once it has
  decided, before it deletes them), so the store never expires a checkpoint the
  plan keeps: every expiring rule is scoped by prefix AND tag;
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

from .retention import Plan, Policy
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


# ------------------------------------------------------------------ prefixes and targets


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


def hot_file_urls(record: CheckpointRecord) -> tuple[str, ...]:
    """URLs of the checkpoint's files in the hot store (its location itself
    for a single-file checkpoint), in the catalog's file order."""
    loc = record.location.rstrip("/")
    if len(record.files) == 1 and loc.rsplit("/", 1)[-1] == record.files[0].relpath:
        return (loc,)
    return tuple(f"{loc}/{f.relpath}" for f in record.files)


def deletion_targets(plan: Plan, records: Sequence[CheckpointRecord]) -> dict[int, tuple[str, ...]]:
    """For every checkpoint ``plan`` deletes (either scope), the hot file URLs
    to tag with :data:`DELETE_TAG`, by checkpoint id. Nothing the plan keeps
    or promotes is ever a target; archive copies never are."""
    by_id = {r.id: r for r in records}
    return {
        i.checkpoint_id: hot_file_urls(by_id[i.checkpoint_id])
        for i in plan.items
        if i.action == "delete" and i.checkpoint_id in by_id
    }


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


# ------------------------------------------------------------------ S3's matching


def rule_applies(rule: Mapping[str, Any], key: str, tags: Mapping[str, str], size: int | None = None) -> bool:
    """Whether S3 applies ``rule`` to the object ``key`` with ``tags`` and ``size`` bytes.

    Mirrors S3's documented semantics: only ``Status = Enabled`` rules act;
    a ``Filter`` holds exactly one of ``Prefix`` (a literal, case-sensitive
    key prefix: no wildcards; ``""`` matches every key), ``Tag`` (the object
    has that key with exactly that value), ``ObjectSizeGreaterThan`` /
    ``ObjectSizeLessThan`` (strict, in bytes), or ``And`` (every condition
    it lists holds); an empty ``Filter`` matches every object; a rule with no
    ``Filter`` uses its legacy top-level ``Prefix``. Raises ``ValueError``
    for a malformed filter (S3 would reject the configuration).
    """
    if rule.get("Status") != "Enabled":
        return False
    if "Filter" not in rule:
        return key.startswith(rule.get("Prefix", ""))
    f = rule["Filter"]
    conditions = [k for k in ("Prefix", "Tag", "ObjectSizeGreaterThan", "ObjectSizeLessThan", "And") if k in f]
    if len(f) != len(conditions) or len(conditions) > 1:
        raise ValueError(f"rule {rule.get('ID')!r}: a Filter holds exactly one of Prefix, Tag, ObjectSize*, And; got {sorted(f)}")
    if not conditions:
        return True
    if "And" in f:
        both = f["And"]
        unknown = set(both) - {"Prefix", "Tags", "ObjectSizeGreaterThan", "ObjectSizeLessThan"}
        if unknown:
            raise ValueError(f"rule {rule.get('ID')!r}: And holds unknown keys {sorted(unknown)}")
        return (
            key.startswith(both.get("Prefix", ""))
            and all(tags.get(t["Key"]) == t["Value"] for t in both.get("Tags", ()))
            and _size_ok(both, size)
        )
    if "Prefix" in f:
        return key.startswith(f["Prefix"])
    if "Tag" in f:
        return bool(tags.get(f["Tag"]["Key"]) == f["Tag"]["Value"])
    return _size_ok(f, size)


def _size_ok(f: Mapping[str, Any], size: int | None) -> bool:
    if "ObjectSizeGreaterThan" in f and (size is None or not size > f["ObjectSizeGreaterThan"]):
        return False
    return not ("ObjectSizeLessThan" in f and (size is None or not size < f["ObjectSizeLessThan"]))


def expires_current(rule: Mapping[str, Any]) -> bool:
    """True when ``rule`` expires current object versions (``Expiration`` by
    ``Days`` or ``Date``; ``ExpiredObjectDeleteMarker`` removes only markers)."""
    exp = rule.get("Expiration") or {}
    return "Days" in exp or "Date" in exp


def matching_keys(
    rules: Sequence[Mapping[str, Any]],
    objects: Mapping[str, tuple[Mapping[str, str], int]],
    *,
    expiring_only: bool = False,
) -> set[str]:
    """Keys of ``objects`` (key → (tags, size)) that any of ``rules`` applies
    to (only rules that expire current versions with ``expiring_only``)."""
    chosen = [r for r in rules if not expiring_only or expires_current(r)]
    return {k for k, (tags, size) in objects.items() if any(rule_applies(r, k, tags, size) for r in chosen)}
