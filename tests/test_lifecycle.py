"""``ckptier lifecycle``: the policy as S3 lifecycle rules.

Pure tests of the rules and of the tests' model of S3's documented filter
semantics (``tests/fixtures/s3_lifecycle.py``); then against real S3 servers
(moto, Ceph RGW): the configuration is accepted and round-trips, the delete
tag lands on exactly the files the plan deletes, and the rules' filters match
exactly those (moto stores lifecycle rules without enforcing them, so the
model is what checks the filters).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from ckptier.flows.cli import main
from ckptier.storage.errors import ConfigError
from ckptier.storage.records import (
    CheckpointRecord,
    CopyRecord,
    FileRecord,
    Format,
    State,
    Tier,
)
from ckptier.storage.s3 import S3Store
from ckptier.storage.base import file_key
from ckptier.tasks.lifecycle import DELETE_TAG, job_prefix_url, lifecycle_for_job
from ckptier.tasks.retention import KeepLast, Milestones, Plan, Policy, plan_retention
from ckptier.tasks.run import StoreCache
from ckptier.tasks.tiers import ArchiveTier

from tests.fixtures.s3 import S3Bucket
from tests.fixtures.s3_lifecycle import expires_current, matching_keys, rule_applies
from tests.test_apply_faults import s3_world  # noqa: F401 - the S3 world fixture

D = timedelta(days=1)
NOW = datetime(2026, 6, 1, tzinfo=UTC)
TIERS = (ArchiveTier(30 * D, "STANDARD_IA"), ArchiveTier(90 * D, "GLACIER_IR"))


def policy(archive: str | None = "s3://bkt/archive", tiers: tuple[ArchiveTier, ...] = TIERS) -> Policy:
    return Policy((KeepLast(2), Milestones(log=True)), archive=archive, archive_tiers=tiers if archive else ())


def record(id: int, step: int, location: str, relpaths: tuple[str, ...] = ("rank-0000/model.pt", "metadata.json"),
           *, archived: bool = False, job: str = "llama") -> CheckpointRecord:
    t = NOW - timedelta(hours=100 - id)
    copies = (CopyRecord(Tier.ARCHIVE, f"s3://bkt/archive/{job}/step-{step:08d}", "present", 10, t, "ckz1"),) if archived else ()
    return CheckpointRecord(
        id=id, job=job, step=step, format=Format.GUIDE, state=State.VERIFIED, location=location, bytes=100,
        saved_at=t, first_seen=t, last_seen=t, missing_since=None, verified_at=t, state_reason=None,
        files=tuple(FileRecord(r, 50, None, None, None, None, "ok", None) for r in relpaths), copies=copies,
    )


def hot_keys(r: CheckpointRecord) -> tuple[str, ...]:
    """The keys of ``r``'s hot files in its bucket, in the catalog's file order,
    as a run names them: the location split by the run's store cache
    (:meth:`StoreCache.for_record`, apply's ``hot_for``), then each file's key
    (:func:`ckptier.storage.base.file_key`, what apply tags and deletes)."""
    _, prefix = StoreCache().for_record(r)
    return tuple(file_key(prefix, r, f.relpath) for f in r.files)


def deleted_ids(plan: Plan) -> set[int]:
    """Ids of the checkpoints ``plan`` deletes, either scope."""
    return {i.checkpoint_id for i in plan.items if i.action == "delete"}


# ------------------------------------------------------------------ the matcher (the tests' model of S3)


RULES: dict[str, dict[str, Any]] = {
    "prefix": {"ID": "p", "Status": "Enabled", "Filter": {"Prefix": "runs/llama/"}},
    "tag": {"ID": "t", "Status": "Enabled", "Filter": {"Tag": {"Key": "k", "Value": "v"}}},
    "and": {"ID": "a", "Status": "Enabled",
            "Filter": {"And": {"Prefix": "runs/llama/", "Tags": [{"Key": "k", "Value": "v"}, {"Key": "x", "Value": ""}]}}},
    "size": {"ID": "s", "Status": "Enabled", "Filter": {"ObjectSizeGreaterThan": 100}},
    "and-size": {"ID": "as", "Status": "Enabled",
                 "Filter": {"And": {"Prefix": "a/", "ObjectSizeGreaterThan": 10, "ObjectSizeLessThan": 20}}},
    "empty": {"ID": "e", "Status": "Enabled", "Filter": {}},
    "legacy": {"ID": "l", "Status": "Enabled", "Prefix": "old/"},
    "disabled": {"ID": "d", "Status": "Disabled", "Filter": {"Prefix": ""}},
}


@pytest.mark.parametrize(
    "rule, key, tags, size, applies",
    [
        ("prefix", "runs/llama/step-1/m.pt", {}, 1, True),
        ("prefix", "runs/llama-2/step-1/m.pt", {}, 1, False),  # a literal prefix, up to the slash
        ("prefix", "Runs/llama/step-1/m.pt", {}, 1, False),  # case-sensitive
        ("prefix", "runs/llama*", {}, 1, False),  # no wildcards
        ("tag", "anything", {"k": "v"}, 1, True),
        ("tag", "anything", {"k": "V"}, 1, False),  # values are exact
        ("tag", "anything", {"K": "v"}, 1, False),  # keys too
        ("tag", "anything", {}, 1, False),
        ("and", "runs/llama/a", {"k": "v", "x": "", "other": "1"}, 1, True),  # extra tags do not matter
        ("and", "runs/llama/a", {"k": "v"}, 1, False),  # every listed tag is needed
        ("and", "runs/other/a", {"k": "v", "x": ""}, 1, False),  # and the prefix
        ("size", "k", {}, 101, True),
        ("size", "k", {}, 100, False),  # strictly greater
        ("and-size", "a/k", {}, 15, True),
        ("and-size", "a/k", {}, 20, False),  # strictly less
        ("and-size", "a/k", {}, 10, False),
        ("empty", "any/key", {}, 0, True),
        ("legacy", "old/key", {}, 0, True),
        ("legacy", "new/key", {}, 0, False),
        ("disabled", "k", {}, 0, False),  # only Enabled rules act
    ],
)
def test_rule_applies_mirrors_s3(rule: str, key: str, tags: dict[str, str], size: int, applies: bool) -> None:
    assert rule_applies(RULES[rule], key, tags, size) is applies


def test_malformed_filters_are_refused() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        rule_applies({"Status": "Enabled", "Filter": {"Prefix": "a", "Tag": {"Key": "k", "Value": "v"}}}, "a", {})
    with pytest.raises(ValueError, match="exactly one of"):
        rule_applies({"Status": "Enabled", "Filter": {"Prefx": "a"}}, "a", {})
    with pytest.raises(ValueError, match="unknown keys"):
        rule_applies({"Status": "Enabled", "Filter": {"And": {"Prefix": "a", "Tag": {}}}}, "a", {})


def test_expires_current_versions_only_by_days_or_date() -> None:
    assert expires_current({"Expiration": {"Days": 1}})
    assert expires_current({"Expiration": {"Date": "2030-01-01T00:00:00Z"}})
    assert not expires_current({"Expiration": {"ExpiredObjectDeleteMarker": True}})
    assert not expires_current({"Transitions": [{"Days": 30, "StorageClass": "GLACIER_IR"}]})


# ------------------------------------------------------------------ prefixes and targets


def test_job_prefix_url() -> None:
    guide = [record(1, 1000, "s3://bkt/runs/llama/step-00001000"), record(2, 2000, "s3://bkt/runs/llama/step-00002000")]
    assert job_prefix_url(guide) == "s3://bkt/runs/llama/"
    hf = [record(1, 10, "s3://bkt/out/checkpoint-10"), record(2, 20, "s3://bkt/out/checkpoint-20")]
    assert job_prefix_url(hf) == "s3://bkt/out/"
    lightning = [record(1, 10, "file:///ckpt/run/epoch=0-step=10.ckpt", ("epoch=0-step=10.ckpt",))]
    assert job_prefix_url(lightning) == "file:///ckpt/run/"
    top = [record(1, 10, "s3://bkt/step-00000010")]
    assert job_prefix_url(top) == "s3://bkt/"
    assert job_prefix_url([record(1, 1, "s3://a1a/x/step-1"), record(2, 2, "s3://b2b/x/step-2")]) is None
    assert job_prefix_url([]) is None


def test_hot_keys_and_the_plans_deletions() -> None:
    assert hot_keys(record(1, 1000, "s3://bkt/runs/llama/step-00001000")) == (
        "runs/llama/step-00001000/rank-0000/model.pt", "runs/llama/step-00001000/metadata.json")
    single = record(1, 10, "s3://bkt/ckpt/epoch=0-step=10.ckpt", ("epoch=0-step=10.ckpt",))
    assert hot_keys(single) == ("ckpt/epoch=0-step=10.ckpt",)
    records = _catalog()
    plan = plan_retention(records, policy(), now=NOW)
    deleted = deleted_ids(plan)
    assert deleted and deleted <= {r.id for r in records}  # the plan deletes some, both scopes
    kept = {i.checkpoint_id for i in plan.items if i.action != "delete"}
    assert not deleted & kept
    assert any(i.scope == "hot-copy" for i in plan.items if i.action == "delete")  # archived milestones' hot copies


# ------------------------------------------------------------------ the rules


def test_rules_for_a_job_with_hot_and_archive_in_one_bucket() -> None:
    cfg = lifecycle_for_job("llama", hot_url="s3://bkt/runs/llama/", policy=policy())
    assert (cfg.bucket, cfg.hot_prefix, cfg.archive_prefix) == ("bkt", "runs/llama/", "archive/llama/")
    rules = {r["ID"]: r for r in cfg.document()["Rules"]}
    assert list(rules) == ["ckptier:llama:hot-expire-deleted", "ckptier:llama:hot-housekeeping",
                           "ckptier:llama:archive-tiers", "ckptier:llama:archive-housekeeping"]
    expire = rules["ckptier:llama:hot-expire-deleted"]
    assert expire["Filter"] == {"And": {"Prefix": "runs/llama/", "Tags": [{"Key": DELETE_TAG[0], "Value": DELETE_TAG[1]}]}}
    assert expire["Expiration"] == {"Days": 1}
    # the only rule that expires current versions is scoped by prefix AND tag
    assert [r["ID"] for r in rules.values() if expires_current(r)] == ["ckptier:llama:hot-expire-deleted"]
    assert rules["ckptier:llama:archive-tiers"]["Transitions"] == [
        {"Days": 30, "StorageClass": "STANDARD_IA"}, {"Days": 90, "StorageClass": "GLACIER_IR"}]
    for where, days in (("hot", 7), ("archive", 30)):
        hk = rules[f"ckptier:llama:{where}-housekeeping"]
        assert hk["Expiration"] == {"ExpiredObjectDeleteMarker": True}
        assert hk["NoncurrentVersionExpiration"] == {"NoncurrentDays": days}
        assert hk["AbortIncompleteMultipartUpload"] == {"DaysAfterInitiation": 2}
    assert any("replaces every rule" in n for n in cfg.notes)


@pytest.mark.parametrize("job", ["p%41x", "a#b", "q?r"])
def test_a_job_prefix_is_the_raw_key_prefix(job: str) -> None:
    # The job's directory URL was read as a URL: '%41' became 'A' (rules scoped to another
    # prefix), '#' and '?' were refused.
    cfg = lifecycle_for_job(job, hot_url=f"s3://bkt/runs/{job}/", policy=policy())
    assert cfg.hot_prefix == f"runs/{job}/"


def test_rules_for_separate_buckets_need_the_bucket() -> None:
    p = policy(archive="s3://cold-bkt/archive")
    with pytest.raises(ConfigError, match="pass --bucket bkt or --bucket cold-bkt"):
        lifecycle_for_job("llama", hot_url="s3://bkt/runs/llama/", policy=p)
    hot = lifecycle_for_job("llama", hot_url="s3://bkt/runs/llama/", policy=p, bucket="bkt")
    assert hot.archive_prefix is None and all("archive" not in r["ID"] for r in hot.rules)
    cold = lifecycle_for_job("llama", hot_url="s3://bkt/runs/llama/", policy=p, bucket="cold-bkt")
    assert cold.hot_prefix is None and [r["ID"] for r in cold.rules] == [
        "ckptier:llama:archive-tiers", "ckptier:llama:archive-housekeeping"]
    with pytest.raises(ConfigError, match="bucket 'other' holds nothing of job 'llama'"):
        lifecycle_for_job("llama", hot_url="s3://bkt/runs/llama/", policy=p, bucket="other")


def test_nothing_on_s3_is_an_error() -> None:
    with pytest.raises(ConfigError, match="nothing for a bucket lifecycle to enforce"):
        lifecycle_for_job("llama", hot_url="file:///data/llama/", policy=policy(archive="/mnt/cold"))


def test_tiers_s3_cannot_carry_out_are_refused() -> None:
    early = policy(tiers=(ArchiveTier(14 * D, "STANDARD_IA"), ArchiveTier(90 * D, "GLACIER_IR")))
    with pytest.raises(ConfigError, match=r"cannot move objects to STANDARD_IA before 30 days .*set after = \"30d\""):
        lifecycle_for_job("llama", hot_url="s3://bkt/runs/llama/", policy=early)


def test_notes_for_top_level_checkpoints_and_restore_classes() -> None:
    deep = policy(tiers=(ArchiveTier(180 * D, "DEEP_ARCHIVE"),))
    cfg = lifecycle_for_job("llama", hot_url="s3://bkt/", policy=deep)
    assert cfg.rules[0]["Filter"] == {"Tag": {"Key": DELETE_TAG[0], "Value": DELETE_TAG[1]}}
    assert any("top of bucket bkt" in n for n in cfg.notes)
    assert any("DEEP_ARCHIVE need a restore" in n for n in cfg.notes)
    plain = lifecycle_for_job("llama", hot_url="s3://bkt/runs/llama/", policy=policy(tiers=()))
    assert "ckptier:llama:archive-tiers" not in [r["ID"] for r in plain.rules]


def test_rule_ids_fit_s3s_limit() -> None:
    cfg = lifecycle_for_job("j" * 400, hot_url="s3://bkt/runs/x/", policy=policy())
    assert all(len(r["ID"]) <= 255 for r in cfg.rules) and len({r["ID"] for r in cfg.rules}) == len(cfg.rules)


# ------------------------------------------------------------------ against moto_server


def _catalog() -> list[CheckpointRecord]:
    """Job llama: steps 1000..8000 under runs/llama/; 1000, 2000 and 5000 are
    milestones with verified archive copies (their hot copies go)."""
    return [
        record(i, step, f"s3://bkt/runs/llama/step-{step:08d}", archived=step in (1000, 2000, 5000))
        for i, step in enumerate(range(1000, 9000, 1000), start=1)
    ]


@pytest.mark.s3
def test_configuration_is_accepted_and_filters_match_exactly_the_tagged_files(s3_bucket: S3Bucket) -> None:
    c, bkt = s3_bucket.client, s3_bucket.name
    records = [
        dataclass_replace_location(r, bkt) for r in _catalog()
    ]
    neighbour = [record(100 + i, step, f"s3://{bkt}/runs/llama-2/step-{step:08d}", job="llama-2")
                 for i, step in enumerate((1000, 3000))]
    for r in records + neighbour:
        for key in hot_keys(r):
            c.put_object(Bucket=bkt, Key=key, Body=b"x" * 50)
    archive_keys = {f"archive/llama/step-{s:08d}/{name}" for s in (1000, 2000, 5000)
                    for name in ("rank-0000/model.pt.ckz", "ckptier-manifest.json")}
    for key in archive_keys | {"archive/llama-2/step-00001000/ckptier-manifest.json"}:
        c.put_object(Bucket=bkt, Key=key, Body=b"y" * 50)

    # ckptier tags what its plan deletes (both scopes), in this job only
    p = Policy((KeepLast(2), Milestones(log=True)), archive=f"s3://{bkt}/archive", archive_tiers=TIERS)
    plan = plan_retention(records, p, now=NOW)
    deleted = deleted_ids(plan)
    targets = {k for r in records if r.id in deleted for k in hot_keys(r)}
    store = S3Store(bkt, client=c)
    for key in sorted(targets):
        store.put_object_tagging(key, dict([DELETE_TAG]))
    other_job = set(hot_keys(neighbour[0]))
    for key in other_job:  # llama-2's own deletions: not this job's rule's business
        store.put_object_tagging(key, dict([DELETE_TAG]))

    cfg = lifecycle_for_job("llama", hot_url=job_prefix_url(records), policy=p)
    c.put_bucket_lifecycle_configuration(Bucket=bkt, LifecycleConfiguration=cfg.document())
    got = as_written(c.get_bucket_lifecycle_configuration(Bucket=bkt)["Rules"])
    assert got == as_written(cfg.document()["Rules"])  # accepted and round-tripped

    objects = {}
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bkt):
        for o in page.get("Contents", ()):
            tags = {t["Key"]: t["Value"] for t in c.get_object_tagging(Bucket=bkt, Key=o["Key"])["TagSet"]}
            objects[o["Key"]] = (tags, o["Size"])
    # the tag sits on exactly the files of the checkpoints the plan deletes (plus llama-2's)
    tagged = {k for k, (tags, _) in objects.items() if tags.get(DELETE_TAG[0]) == DELETE_TAG[1]}
    assert tagged == targets | other_job
    # S3 would expire exactly this job's tagged files, nothing the plan keeps, nothing of llama-2
    assert matching_keys(got, objects, expiring_only=True) == targets
    kept = {k for r in records if r.id not in deleted for k in hot_keys(r)}
    assert kept and not kept & matching_keys(got, objects, expiring_only=True)
    # and would move exactly this job's archive objects between classes
    tiers_rule = next(r for r in got if r["ID"].endswith("archive-tiers"))
    assert matching_keys([tiers_rule], objects) == archive_keys


def dataclass_replace_location(r: CheckpointRecord, bucket: str) -> CheckpointRecord:
    from dataclasses import replace

    copies = tuple(replace(x, url=x.url.replace("s3://bkt/", f"s3://{bucket}/")) for x in r.copies)
    return replace(r, location=r.location.replace("s3://bkt/", f"s3://{bucket}/"), copies=copies)


@pytest.mark.s3
def test_cli_emits_the_document_for_a_scanned_job(s3_env: str, s3_bucket: S3Bucket, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from ckptier.tasks.demo import write_guide_checkpoint

    local = tmp_path / "local"
    for step in (1000, 2000):
        write_guide_checkpoint(local / "llm" / f"step-{step:08d}", {"rank-0000/model.pt": {"w": [1, 2]}}, step=step, loss=1.0)
    for path in sorted(local.rglob("*")):
        if path.is_file():
            s3_bucket.client.put_object(Bucket=s3_bucket.name, Key="runs/" + path.relative_to(local).as_posix(),
                                        Body=path.read_bytes())
    config = tmp_path / "ckptier.toml"
    config.write_text(f'[[policy]]\nkeep_last = 2\nmilestones = "log"\narchive = "s3://{s3_bucket.name}/archive"\n'
                      'archive_tiers = [{ after = "30d", storage_class = "STANDARD_IA" }]\n')
    monkeypatch.setenv("CKPTIER_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    monkeypatch.setenv("CKPTIER_CONFIG", str(config))
    assert main(["scan", f"s3://{s3_bucket.name}/runs", "--json"]) == 0
    capsys.readouterr()
    assert main(["lifecycle", "--job", "llm", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    ids = [r["ID"] for r in doc["Rules"]]
    assert ids == ["ckptier:llm:hot-expire-deleted", "ckptier:llm:hot-housekeeping",
                   "ckptier:llm:archive-tiers", "ckptier:llm:archive-housekeeping"]
    assert doc["Rules"][0]["Filter"]["And"]["Prefix"] == "runs/llm/"
    s3_bucket.client.put_bucket_lifecycle_configuration(Bucket=s3_bucket.name, LifecycleConfiguration=doc)
    assert main(["lifecycle", "--job", "llm"]) == 0
    human = capsys.readouterr().out
    assert "put-bucket-lifecycle-configuration" in human and "# archive copies never expire" in human
    assert main(["lifecycle", "--job", "nope"]) == 2
    assert "job 'nope'" in capsys.readouterr().err


# ------------------------------------------------------------------ apply tags what it deletes


class TagWitness:
    """The hot S3 store as apply sees it (every method forwarded), which
    records the tags each key carries at the moment it is deleted, and can
    refuse every delete (a bucket policy denying DeleteObject): then the
    tagged objects stay for the lifecycle rule to expire."""

    def __init__(self, inner: S3Store, *, refuse_deletes: bool = False) -> None:
        self.inner = inner
        self.refuse_deletes = refuse_deletes
        self.tags_at_delete: dict[str, dict[str, str]] = {}

    @property
    def url(self) -> str:
        return self.inner.url

    def list(self, prefix: str = "") -> Any:
        return self.inner.list(prefix)

    def stat(self, key: str) -> Any:
        return self.inner.stat(key)

    def open_read(self, key: str) -> Any:
        return self.inner.open_read(key)

    def write(self, key: str, data: Any, *, if_absent: bool = False) -> Any:
        return self.inner.write(key, data, if_absent=if_absent)

    def delete_many(self, keys: Any) -> Any:
        from ckptier.storage.errors import StoreError

        for key in keys:
            self.tags_at_delete[key] = self.inner.get_object_tagging(key)
        if self.refuse_deletes:
            raise StoreError(f"{self.url}: AccessDenied on DeleteObjects (a bucket policy)")
        return self.inner.delete_many(keys)

    def delete_proven(self, proven: Any) -> Any:
        from ckptier.storage.errors import StoreError

        for info in proven:
            self.tags_at_delete[info.key] = self.inner.get_object_tagging(info.key)
        if self.refuse_deletes:
            raise StoreError(f"{self.url}: AccessDenied on DeleteObjects (a bucket policy)")
        return self.inner.delete_proven(proven)

    def put_object_tagging(self, key: str, tags: Any) -> None:
        self.inner.put_object_tagging(key, tags)

    def get_object_tagging(self, key: str) -> dict[str, str]:
        return self.inner.get_object_tagging(key)


def as_written(rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Lifecycle rules read back from a server, in the form ckptier writes them, ordered by ID.

    Servers render the same rules differently: Ceph RGW 16.2 returns them in
    its own order (and a rule's transitions too) and ``And {Prefix, one Tag}``
    as ``{Prefix, Tag}``, which S3 defines as the same filter. Anything else a server changed is left
    as it is, so the comparison still fails on it.
    """
    out = []
    for rule in rules:
        rule = dict(rule)
        f = rule.get("Filter")
        if isinstance(f, dict) and set(f) == {"Prefix", "Tag"}:
            rule["Filter"] = {"And": {"Prefix": f["Prefix"], "Tags": [f["Tag"]]}}
        if "Transitions" in rule:  # a set in S3's model; RGW lists it in its own order
            rule["Transitions"] = sorted(rule["Transitions"], key=lambda t: (t.get("Days", 0), t["StorageClass"]))
        out.append(rule)
    return sorted(out, key=lambda r: str(r.get("ID")))


def _bucket_tags(bucket: S3Bucket) -> dict[str, tuple[dict[str, str], int]]:
    c, out = bucket.client, {}
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket.name):
        for o in page.get("Contents", ()):
            tags = c.get_object_tagging(Bucket=bucket.name, Key=o["Key"])["TagSet"]
            out[o["Key"]] = ({t["Key"]: t["Value"] for t in tags}, o["Size"])
    return out


def _tagged(objects: dict[str, tuple[dict[str, str], int]], tag: tuple[str, str] = DELETE_TAG) -> set[str]:
    return {k for k, (tags, _) in objects.items() if tags.get(tag[0]) == tag[1]}


def _plan_targets(world: Any) -> set[str]:
    """The bucket keys of the hot files of every checkpoint the world's plan deletes."""
    deleted = deleted_ids(world.plan())
    return {k for r in world.catalog.checkpoints() if r.id in deleted for k in hot_keys(r)}


@pytest.mark.s3
def test_apply_tags_exactly_what_it_deletes_before_deleting(request: pytest.FixtureRequest, s3_bucket: S3Bucket) -> None:
    from tests.test_apply import DELETED_STEPS

    w = request.getfixturevalue("s3_world")
    targets = _plan_targets(w)
    assert {k.split("/")[2] for k in targets} == {f"step-{s:08d}" for s in DELETED_STEPS}
    witness = TagWitness(w.hot)
    report = w.apply(hot=witness)
    assert report.ok, report.summary()
    assert {"hot/" + k for k in witness.tags_at_delete} == targets  # deleted: exactly the plan's targets
    assert all(t == dict([DELETE_TAG]) for t in witness.tags_at_delete.values())  # each tagged before it went
    assert not _tagged(_bucket_tags(s3_bucket))  # nothing that stays carries the tag


@pytest.mark.s3
def test_a_run_stopped_before_deleting_leaves_the_lifecycle_rule_exactly_the_plans_deletions(
        request: pytest.FixtureRequest, s3_bucket: S3Bucket) -> None:
    w = request.getfixturevalue("s3_world")
    targets = _plan_targets(w)
    report = w.apply(hot=TagWitness(w.hot, refuse_deletes=True))
    assert not report.ok and not report.deleted
    objects = _bucket_tags(s3_bucket)
    assert _tagged(objects) == targets and targets < set(objects)

    # the policy as lifecycle rules: accepted by the server, and S3 would expire exactly the tagged files
    cfg = lifecycle_for_job("llm", hot_url=job_prefix_url(w.catalog.checkpoints()), policy=w.policy)
    c = s3_bucket.client
    c.put_bucket_lifecycle_configuration(Bucket=s3_bucket.name, LifecycleConfiguration=cfg.document())
    rules = as_written(c.get_bucket_lifecycle_configuration(Bucket=s3_bucket.name)["Rules"])
    assert rules == as_written(cfg.document()["Rules"])
    assert matching_keys(rules, objects, expiring_only=True) == targets

    # the next run keeps everything: the interrupted deletes had not started, their tags turn to keep
    w.clock.advance(timedelta(hours=1))
    w.policy = Policy((KeepLast(100),), archive=w.policy.archive)
    again = w.apply(replan=True)
    assert again.ok and not again.deleted, again.summary()
    objects = _bucket_tags(s3_bucket)
    assert set(objects) >= targets and not _tagged(objects)
    assert _tagged(objects, ("ckptier:retention", "keep")) == targets
    assert not matching_keys(rules, objects, expiring_only=True)


@pytest.mark.s3
def test_dry_run_says_it_would_tag_and_puts_no_tag(request: pytest.FixtureRequest, s3_bucket: S3Bucket) -> None:
    from tests.test_apply import DELETED_STEPS

    report = request.getfixturevalue("s3_world").apply(dry_run=True)
    assert report.ok and [r.step for r in report.deleted] == DELETED_STEPS
    assert all(r.detail.endswith(f"tagged {DELETE_TAG[0]}={DELETE_TAG[1]} first") for r in report.deleted)
    assert not _tagged(_bucket_tags(s3_bucket))

