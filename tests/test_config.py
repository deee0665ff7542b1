"""``ckptier.toml`` loading: valid files, defaults, and every error path."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from ckptier.storage.errors import ConfigError
from ckptier.tasks.config import (
    DrillSettings,
    load_config,
    parse_config,
)
from ckptier.tasks.retention import (
    KeepDaily,
    KeepLast,
    KeepWeekly,
    KeepWithin,
    Milestones,
    Pinned,
)

FULL = """
[catalog]
url = "sqlite:////tmp/catalog.db"

[[policy]]
jobs = "llama-*"
keep_last = 5
milestones = "log"
keep_within = "36h"
keep_daily = 7
keep_weekly = 4
pinned = [12000, 3]
min_verified = 3
grace = "1d12h"
delete_stale_incomplete = true
archive = "s3://bucket/archive"
storage_class = "GLACIER_IR"
hot_after_archive = "keep"
max_missing_fraction = 0.25

[[policy]]
jobs = "bert-[0-9]*"
keep_last = 0
milestones = { every_n_steps = 10000 }

[[policy]]
milestones = [1000, 5000]
archive = "/mnt/archive"

[[drill]]
jobs = "llama-*"
model = "mypkg.models:build_llama"
steps = 20
device = "cuda"
timeout = "30min"
loss_tolerance = 0.05
allow_globals = ["mypkg.config.TrainConfig", "argparse.Namespace", "mypkg.config.TrainConfig"]

[[drill]]
model = "tests.models:tiny"
"""


def test_full_file(tmp_path: Path) -> None:
    f = tmp_path / "ckptier.toml"
    f.write_text(FULL)
    cfg = load_config(f)
    assert cfg.source == f
    assert cfg.catalog_url == "sqlite:////tmp/catalog.db"
    p = cfg.policy_for("llama-7b")
    assert p is not None and p.jobs == "llama-*"
    assert p.rules == (
        KeepLast(5),
        Milestones(log=True),
        KeepWithin(timedelta(hours=36)),
        KeepDaily(7),
        KeepWeekly(4),
        Pinned((12000, 3)),
    )
    assert (p.min_verified, p.grace, p.delete_stale_incomplete) == (3, timedelta(hours=36), True)
    assert (p.archive, p.storage_class, p.hot_after_archive) == ("s3://bucket/archive", "GLACIER_IR", "keep")
    assert p.max_missing_fraction == 0.25
    bert = cfg.policy_for("bert-1")
    assert bert is not None and bert.rules == (Milestones(every=10000),)
    assert bert.archive is None and bert.hot_after_archive == "delete"
    # the catch-all third table, with defaults
    other = cfg.policy_for("bert-x")
    assert other is not None and other.jobs == "*"
    assert other.rules == (Milestones(steps=(1000, 5000)),)  # its own rules only: no hidden keep_last
    assert (other.grace, other.min_verified, other.max_missing_fraction) == (timedelta(hours=2), 2, 0.5)
    assert other.delete_stale_incomplete is False
    assert cfg.drill_for("llama-7b") == DrillSettings(
        jobs="llama-*", model="mypkg.models:build_llama", steps=20, device="cuda",
        timeout=timedelta(minutes=30), loss_tolerance=0.05,
        allow_globals=("mypkg.config.TrainConfig", "argparse.Namespace"),  # file order, duplicates dropped
    )
    d = cfg.drill_for("bert-1")
    assert d == DrillSettings(jobs="*", model="tests.models:tiny")
    assert (d.steps, d.device, d.timeout, d.loss_tolerance) == (10, "auto", timedelta(minutes=15), None)
    assert d.allow_globals == ()


def test_milestone_matching_tiering_and_drilled_floor_keys() -> None:
    cfg = parse_config(
        '[[policy]]\njobs = "a*"\nkeep_last = 5\nmilestones = "log"\nmilestone_match = "exact"\n'
        'archive = "s3://bucket/arch"\narchive_after = "14d"\narchive_when = "leaving_hot"\nmin_drilled = 1\n'
        '[[policy]]\nmilestones = { every_n_steps = 500 }\n'
    )
    p = cfg.policy_for("abc")
    assert p is not None and p.rules == (KeepLast(5), Milestones(log=True, match="exact"))
    assert (p.archive_after, p.archive_when, p.min_drilled) == (timedelta(days=14), "leaving_hot", 1)
    other = cfg.policy_for("zzz")
    assert other is not None and other.milestones == (Milestones(every=500, match="at_or_after"),)
    assert (other.archive_after, other.archive_when, other.min_drilled) == (None, "immediately", 0)


def test_first_matching_table_wins() -> None:
    cfg = parse_config('[[policy]]\njobs = "a*"\nkeep_last = 1\n[[policy]]\njobs = "ab*"\nkeep_last = 9\n')
    assert cfg.policy_for("abc").rules == (KeepLast(1),)  # type: ignore[union-attr]
    assert cfg.policy_for("zzz") is None
    assert cfg.drill_for("abc") is None
    assert parse_config('[[policy]]\njobs = "A*"\n').policy_for("abc") is None  # case-sensitive


def test_drill_model_is_optional_and_may_be_a_file() -> None:
    """HF jobs need no factory (config.json builds the model); a factory may live in a .py file."""
    cfg = parse_config('[[drill]]\njobs = "hf-*"\nsteps = 3\n[[drill]]\nmodel = "/opt/train/models.py:build"\n')
    assert cfg.drill_for("hf-gpt") == DrillSettings(jobs="hf-*", steps=3)
    assert cfg.drill_for("other").model == "/opt/train/models.py:build"  # type: ignore[union-attr]


def test_absent_default_file_means_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CKPTIER_CONFIG", raising=False)
    cfg = load_config()
    assert cfg.source is None and cfg.catalog_url is None and cfg.drills == ()
    p = cfg.policy_for("anything")
    assert p is not None and p.rules == (KeepLast(3),) and p.min_verified == 2


def test_default_file_in_cwd_and_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CKPTIER_CONFIG", raising=False)
    (tmp_path / "ckptier.toml").write_text("[[policy]]\nkeep_last = 7\n")
    assert load_config().policy_for("x").rules == (KeepLast(7),)  # type: ignore[union-attr]
    other = tmp_path / "other.toml"
    other.write_text("[[policy]]\nkeep_last = 8\n")
    monkeypatch.setenv("CKPTIER_CONFIG", str(other))
    assert load_config().policy_for("x").rules == (KeepLast(8),)  # type: ignore[union-attr]
    # an explicit argument beats the environment
    assert load_config(tmp_path / "ckptier.toml").policy_for("x").rules == (KeepLast(7),)  # type: ignore[union-attr]


def test_explicit_missing_file_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"nope\.toml.*does not exist"):
        load_config(tmp_path / "nope.toml")
    monkeypatch.setenv("CKPTIER_CONFIG", str(tmp_path / "env.toml"))
    with pytest.raises(ConfigError, match=r"env\.toml.*CKPTIER_CONFIG.*does not exist"):
        load_config()


def test_syntax_error_names_the_file(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("[[policy]\nkeep_last = 3\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: not valid TOML") as e:
        load_config(f)
    assert "\n" not in str(e.value)


def test_no_policy_table_gets_the_default_policy() -> None:
    cfg = parse_config('[catalog]\nurl = "sqlite://"\n')
    assert cfg.policy_for("x").rules == (KeepLast(3),)  # type: ignore[union-attr]


# Each bad file and the fragments its one-line message must contain: the
# table, the key, the value (as written) and a hint at the fix.
BAD: list[tuple[str, tuple[str, ...]]] = [
    ("[[policy]]\nkeep_lats = 3\n", ("policy[0].keep_lats", "= 3", "unknown key", "did you mean keep_last?")),
    ("[[policy]]\n[[policy]]\nkeep_last = -2\n", ("policy[1].keep_last", "= -2", "≥ 0")),
    ('[[policy]]\nkeep_last = "3"\n', ("policy[0].keep_last", '"3"', "whole number")),
    ("[[policy]]\nkeep_last = true\n", ("policy[0].keep_last", "= true", "whole number")),
    ("[[policy]]\nkeep_last = 2.5\n", ("policy[0].keep_last", "2.5", "whole number")),
    ("[[policy]]\nkeep_daily = -1\n", ("policy[0].keep_daily", "-1", "≥ 0")),
    ("[[policy]]\nkeep_weekly = -1\n", ("policy[0].keep_weekly", "-1")),
    ("[[policy]]\nmin_verified = -1\n", ("policy[0].min_verified", "-1")),
    ('[[policy]]\nkeep_within = "7 days"\n', ("policy[0].keep_within", '"7 days"', "'36h'")),
    ('[[policy]]\nkeep_within = "0h"\n', ("policy[0].keep_within", '"0h"', "longer than zero")),
    ("[[policy]]\nkeep_within = 7\n", ("policy[0].keep_within", "= 7", "duration")),
    ('[[policy]]\ngrace = "2 hours"\n', ("policy[0].grace", '"2 hours"', "'2h'")),
    ('[[policy]]\njobs = "llama-[0-9"\n', ("policy[0].jobs", '"llama-[0-9"', "no closing ']'")),
    ('[[policy]]\njobs = ""\n', ("policy[0].jobs", '""', "non-empty glob")),
    ("[[policy]]\njobs = 3\n", ("policy[0].jobs", "= 3", "glob")),
    ('[[policy]]\nmilestones = "logarithmic"\n', ("policy[0].milestones", '"logarithmic"', '"log"')),
    ("[[policy]]\nmilestones = []\n", ("policy[0].milestones", "[]", "omit the key")),
    ('[[policy]]\nmilestones = [1, "2"]\n', ("policy[0].milestones", "list of whole step numbers")),
    ("[[policy]]\nmilestones = [-5]\n", ("policy[0].milestones", "-5", "≥ 0")),
    ("[[policy]]\nmilestones = { every = 100 }\n", ("policy[0].milestones", "every", "every_n_steps")),
    ("[[policy]]\nmilestones = { every_n_steps = 0 }\n", ("policy[0].milestones", "every_n_steps", "> 0")),
    ("[[policy]]\nmilestones = 100\n", ("policy[0].milestones", "= 100", '"log"')),
    ('[[policy]]\npinned = "5"\n', ("policy[0].pinned", '"5"', "list")),
    ('[[policy]]\narchive = "s3://"\n', ("policy[0].archive", '"s3://"', "bucket")),
    ('[[policy]]\narchive = "gs://b/x"\n', ("policy[0].archive", '"gs://b/x"', "'gs'", "s3://bucket")),
    ('[[policy]]\narchive = "file://rel"\n', ("policy[0].archive", "file:///path")),
    ('[[policy]]\narchive = ""\n', ("policy[0].archive", "non-empty")),
    ('[[policy]]\nstorage_class = "GLACIER"\n', ("policy[0].storage_class", '"GLACIER"', "without archive")),
    ('[[policy]]\narchive = "s3://bucket/a"\nstorage_class = "GLACIER-IR"\n', ("policy[0].storage_class", '"GLACIER-IR"', "did you mean 'GLACIER_IR'?")),
    ('[[policy]]\narchive = "s3://bucket/a"\nstorage_class = "COLD"\n', ("policy[0].storage_class", '"COLD"', "must be one of STANDARD")),
    ('[[policy]]\narchive = "/mnt/a"\nstorage_class = "GLACIER_IR"\n', ("policy[0].storage_class", "s3:// archives only", '"/mnt/a"')),
    ('[[policy]]\narchive = "/a"\nhot_after_archive = "delet"\n', ("policy[0].hot_after_archive", '"delet"', '"delete" or "keep"')),
    ("[[policy]]\nmax_missing_fraction = 1.5\n", ("policy[0].max_missing_fraction", "1.5", "between 0.0 and 1.0")),
    ("[[policy]]\nmax_missing_fraction = -0.1\n", ("policy[0].max_missing_fraction", "-0.1")),
    ('[[policy]]\nmax_missing_fraction = "half"\n', ("policy[0].max_missing_fraction", '"half"', "number")),
    ('[[policy]]\ndelete_stale_incomplete = "yes"\n', ("policy[0].delete_stale_incomplete", '"yes"', "true or false")),
    ('[[policy]]\njobs = "x"\nkeep_last = 0\n', ("policy[0]", 'jobs = "x"', "keeps nothing", "keep_last")),
    ("[[policy]]\nkeep_last = 0\npinned = []\n", ("policy[0]", "keeps nothing")),
    ("[policy]\nkeep_last = 3\n", ("policy must be an array of tables", "[[policy]]")),
    ("policy = [1]\n", ("policy[0] must be a table",)),
    ('[[drill]]\nmodel = "mypkg.models.build"\n', ("drill[0].model", '"mypkg.models.build"', "module:function")),
    ('[[drill]]\nmodel = "m:f"\nsteps = 0\n', ("drill[0].steps", "= 0", "≥ 1")),
    ('[[drill]]\nmodel = "m:f"\ndevice = "gpu"\n', ("drill[0].device", '"gpu"', '"cuda"')),
    ('[[drill]]\nmodel = "m:f"\ntimeout = "0s"\n', ("drill[0].timeout", '"0s"', "longer than zero")),
    ('[[drill]]\nmodel = "m:f"\ntimeout = "soon"\n', ("drill[0].timeout", '"soon"', "'15min'")),
    ('[[drill]]\nmodel = "m:f"\nloss_tolerance = 0\n', ("drill[0].loss_tolerance", "= 0", "> 0.0")),
    ('[[drill]]\nmodel = "m:f"\nloss_tolerance = "5%"\n', ("drill[0].loss_tolerance", '"5%"', "number")),
    ('[[drill]]\nmodel = "m:f"\nretries = 2\n', ("drill[0].retries", "unknown key", "loss_tolerance")),
    ('[[drill]]\nmodel = "m:f"\njobs = "[x"\n', ("drill[0].jobs", '"[x"', "closing")),
    ('[[drill]]\nmodel = "m:f"\nallow_globals = "a.B"\n', ("drill[0].allow_globals", '"a.B"', "list of module.Name")),
    ('[[drill]]\nmodel = "m:f"\nallow_globals = ["TrainConfig"]\n', ("drill[0].allow_globals", '"TrainConfig"', "dotted module.Name")),
    ('[[drill]]\nmodel = "m:f"\nallow_globals = ["a.B", 3]\n', ("drill[0].allow_globals", "entry 3", "dotted module.Name")),
    ('[[drill]]\nmodel = "m:f"\nallow_globals = ["a.b:C"]\n', ("drill[0].allow_globals", '"a.b:C"', "dotted module.Name")),
    ('[[drill]]\nmodel = "m:f"\nallow_globals = ["builtins.eval"]\n', ("drill[0].allow_globals", '"builtins.eval"', "'builtins'", "own plain classes")),
    ('[[drill]]\nmodel = "m:f"\nallow_globals = ["subprocess.Popen"]\n', ("drill[0].allow_globals", "'subprocess'")),
    ('[[drill]]\nmodel = "m:f"\nallow_global = ["a.B"]\n', ("drill[0].allow_global", "did you mean allow_globals")),
    ('[catalog]\nurl = 5\n', ("catalog.url", "= 5", "non-empty string")),
    ('[catalog]\nuri = "sqlite://"\n', ("catalog.uri", "unknown key", "url")),
    ('catalog = "sqlite://"\n', ("catalog must be a table", "[catalog]")),
    ("[[polciy]]\nkeep_last = 3\n", ("unknown top-level key 'polciy'", "[[policy]]")),
    ('[[policy]]\nmilestones = "log"\nmilestone_match = "nearest"\n', ("policy[0].milestone_match", '"nearest"', '"at_or_after" or "exact"')),
    ('[[policy]]\nmilestone_match = "exact"\n', ("policy[0].milestone_match", '"exact"', "without milestones")),
    ('[[policy]]\narchive = "/a"\narchive_after = "2 weeks"\n', ("policy[0].archive_after", '"2 weeks"', "'14d'")),
    ('[[policy]]\narchive = "/a"\narchive_after = "0d"\n', ("policy[0].archive_after", '"0d"', "longer than zero")),
    ('[[policy]]\narchive_after = "14d"\n', ("policy[0].archive_after", '"14d"', "without archive")),
    ('[[policy]]\narchive = "/a"\narchive_when = "later"\n', ("policy[0].archive_when", '"later"', '"immediately" or "leaving_hot"')),
    ('[[policy]]\narchive_when = "leaving_hot"\n', ("policy[0].archive_when", '"leaving_hot"', "without archive")),
    ("[[policy]]\nmin_drilled = -1\n", ("policy[0].min_drilled", "-1", "≥ 0")),
    ('[[policy]]\nmin_drilled = "one"\n', ("policy[0].min_drilled", '"one"', "whole number")),
]


@pytest.mark.parametrize("text,fragments", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_errors_name_table_key_value_and_fix(tmp_path: Path, text: str, fragments: tuple[str, ...]) -> None:
    f = tmp_path / "ckptier.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert msg.startswith(str(f)), msg
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        parse_config("[[policy]]\nkeep_last = -1\n")


@pytest.mark.parametrize("glob", ["*", "llama-*", "job-[0-9]*", "x[!a]y", "a[]]b", "a[[]b", "run?"])
def test_good_globs(glob: str) -> None:
    assert parse_config(f'[[policy]]\njobs = "{glob}"\n').policies[0].jobs == glob


@pytest.mark.parametrize("url", ["/mnt/archive", "relative/dir", "file:///mnt/a", "s3://bucket", "s3://bucket/pre/fix"])
def test_good_archive_urls(url: str) -> None:
    assert parse_config(f'[[policy]]\narchive = "{url}"\n').policies[0].archive == url
