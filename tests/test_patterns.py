"""``[[pattern]]`` rules: from ``ckptier.toml`` to every scan (command line and Prefect task).

The layout is a trainer's own, which no built-in format claims:
``{job}/save_{N:07d}/part_{R:02d}/model_optim_rng.pt`` plus a ``COMMITTED``
marker the trainer writes last, and a ``latest_checkpointed_iteration.txt``
beside the iterations.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from ckptier.flows.cli import main
from ckptier.storage.base import ObjectInfo
from ckptier.storage.catalog.api import Catalog
from ckptier.storage.errors import ConfigError
from ckptier.formats import PatternRule, recognise
from ckptier.storage.records import Format, State
from ckptier.tasks.config import load_config, parse_config

RULE = """
[[pattern]]
glob = "*/save_*/**"
step_regex = 'save_(?P<step>\\d+)'
commit_marker = "COMMITTED"
"""


def write_iteration(root: Path, job: str, step: int, *, committed: bool) -> None:
    d = root / job / f"save_{step:07d}"
    for rank in range(2):
        (d / f"part_{rank:02d}").mkdir(parents=True, exist_ok=True)
        (d / f"part_{rank:02d}" / "model_optim_rng.pt").write_bytes(os.urandom(128))
    if committed:
        (d / "COMMITTED").write_bytes(b"")
    (root / job / "latest_checkpointed_iteration.txt").write_text(str(step))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "ckpts"
    write_iteration(root, "gpt", 1000, committed=True)
    write_iteration(root, "gpt", 2000, committed=False)  # a save in flight
    return root


def test_scan_advice_can_be_followed(tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The scan says 'add a [[pattern]] rule'; ckptier.toml accepts one, and the next scan uses it."""
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    assert main(["scan", "--no-prefect", "--catalog", url, str(tree), "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["checkpoints"] == 0
    advice = {u["key"]: u["reason"] for u in report["unrecognised"]}
    assert "add a [[pattern]] rule to ckptier.toml" in advice["gpt/save_0001000/part_00/"]

    config = tmp_path / "ckptier.toml"
    config.write_text(RULE)
    assert main(["scan", "--no-prefect", "--catalog", url, "--config", str(config), str(tree), "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert (report["checkpoints"], report["committed"], report["incomplete"]) == (2, 1, 1)
    assert [u["key"] for u in report["unrecognised"]] == ["gpt/"]  # latest_checkpointed_iteration.txt
    with Catalog.open(url) as cat:
        rows = {c.step: c for c in cat.checkpoints(job="gpt")}
    assert rows[1000].format == Format.PATTERN and rows[1000].state == State.COMMITTED
    assert rows[1000].state_reason == "committed: COMMITTED present"
    assert sorted(f.relpath for f in rows[1000].files) == [
        "COMMITTED", "part_00/model_optim_rng.pt", "part_01/model_optim_rng.pt"]
    assert rows[2000].state == State.INCOMPLETE and rows[2000].state_reason == "no COMMITTED: save in flight or torn"


def test_the_prefect_scan_task_uses_the_config_patterns(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.logging import disable_run_logger

    from ckptier.tasks.prefect_tasks import scan_task
    from ckptier.tasks.run import open_run
    from ckptier.tasks.settings import Settings

    config = tmp_path / "ckptier.toml"
    config.write_text(RULE)
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    with disable_run_logger():
        with open_run(Settings(url, config), create=True) as run:
            report = scan_task.fn(run, str(tree))
        assert report.committed == 1
        # a run given no config path: the default lookup ($CKPTIER_CONFIG, ./ckptier.toml) applies
        monkeypatch.setenv("CKPTIER_CONFIG", str(config))
        write_iteration(tree, "gpt", 3000, committed=True)
        with open_run(Settings(url)) as run:
            assert scan_task.fn(run, str(tree)).committed == 2


def _info(key: str, mtime: float, size: int = 10) -> ObjectInfo:
    return ObjectInfo(key=key, size=size, mtime=mtime)


def test_marker_and_settle_time_both_must_hold() -> None:
    now = 10_000.0
    rule = PatternRule("**", r"save_(?P<step>\d+)", 60, commit_marker="COMMITTED")
    listing = [
        _info("j/save_1/a.pt", now - 600), _info("j/save_1/COMMITTED", now - 600, 0),
        _info("j/save_2/a.pt", now - 5), _info("j/save_2/COMMITTED", now - 5, 0),  # marker, but just written
        _info("j/save_3/a.pt", now - 600),  # settled, but no marker
    ]
    rec = recognise(listing, lambda key: b"", root_name="r", now=now, patterns=[rule])
    got = {c.step: (c.committed, c.reason) for c in rec.checkpoints}
    assert got[1] == (True, "committed: COMMITTED present")
    assert got[2][0] is False and got[2][1].startswith("COMMITTED present but modified 5 s ago")
    assert got[3] == (False, "no COMMITTED: save in flight or torn")
    # a marker rule never commits a single-file checkpoint: there is no directory to hold the marker
    single = PatternRule("**", r"snap-(?P<step>\d+)\.tar", 0, commit_marker="DONE")
    (one,) = recognise([_info("j/snap-7.tar", now - 600)], lambda key: b"", root_name="r", now=now,
                       patterns=[single]).checkpoints
    assert not one.committed and "single-file checkpoint" in one.reason


def test_pattern_tables_parse_in_order() -> None:
    cfg = parse_config(
        RULE + '[[pattern]]\nglob = "snaps/*.tar"\nstep_regex = \'snap-(?P<step>\\d+)\\.tar\'\nsettle = "2min"\n'
    )
    assert cfg.patterns == (
        PatternRule("*/save_*/**", r"save_(?P<step>\d+)", 0.0, commit_marker="COMMITTED"),
        PatternRule("snaps/*.tar", r"snap-(?P<step>\d+)\.tar", 120.0),
    )
    assert parse_config("").patterns == ()


BAD: list[tuple[str, tuple[str, ...]]] = [
    ('[[pattern]]\nstep_regex = "(?P<step>\\\\d+)"\nsettle = "1min"\n', ("pattern[0].glob is missing", "glob = ")),
    ('[[pattern]]\nglob = "a/**"\nsettle = "1min"\n', ("pattern[0].step_regex is missing",)),
    ('[[pattern]]\nglob = "a/[x"\nstep_regex = "(?P<step>\\\\d+)"\nsettle = "1min"\n', ("pattern[0].glob", '"a/[x"', "no closing ']'")),
    ('[[pattern]]\nglob = "a/**"\nstep_regex = "(?P<step>\\\\d+"\nsettle = "1min"\n', ("pattern[0].step_regex", "not a regular expression")),
    ('[[pattern]]\nglob = "a/**"\nstep_regex = "save_(\\\\d+)"\nsettle = "1min"\n', ("pattern[0].step_regex", "named step", "(?P<step>")),
    ('[[pattern]]\nglob = "a/**"\nstep_regex = "(?P<step>\\\\d+)"\n', ("pattern[0]", 'glob = "a/**"', "no commit evidence", "commit_marker", "settle")),
    ('[[pattern]]\nglob = "a/**"\nstep_regex = "(?P<step>\\\\d+)"\nsettle = "soon"\n', ("pattern[0].settle", '"soon"', "'2min'")),
    ('[[pattern]]\nglob = "a/**"\nstep_regex = "(?P<step>\\\\d+)"\nsettle = "0s"\n', ("pattern[0].settle", "longer than zero")),
    ('[[pattern]]\nglob = "a/**"\nstep_regex = "(?P<step>\\\\d+)"\ncommit_marker = "../DONE"\n', ("pattern[0].commit_marker", '"../DONE"', "inside the checkpoint directory")),
    ('[[pattern]]\nglob = "a/**"\nstep_regex = "(?P<step>\\\\d+)"\nmarker = "DONE"\n', ("pattern[0].marker", "unknown key", "did you mean commit_marker?")),
    ('[pattern]\nglob = "a/**"\n', ("pattern must be an array of tables", "[[pattern]]")),
]


@pytest.mark.parametrize("text,fragments", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_pattern_errors_are_one_line_naming_table_key_value_and_fix(
    tmp_path: Path, text: str, fragments: tuple[str, ...]
) -> None:
    f = tmp_path / "ckptier.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(f)), msg
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"


def test_bad_pattern_is_one_line_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "ckptier.toml"
    config.write_text('[[pattern]]\nglob = "a/**"\nstep_regex = "save_(\\\\d+)"\nsettle = "1min"\n')
    code = main(["scan", "--no-prefect", "--catalog", f"sqlite:///{tmp_path / 'c.db'}", "--config", str(config),
                 str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "pattern[0].step_regex" in err and "Traceback" not in err


def test_s3_scan_uses_pattern_rules(s3_bucket: Any, s3_env: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    client, bucket = s3_bucket.client, s3_bucket.name
    for key in ("run/gpt/save_0000500/part_00/model_optim_rng.pt", "run/gpt/save_0000500/COMMITTED"):
        client.put_object(Bucket=bucket, Key=key, Body=os.urandom(16))
    config = tmp_path / "ckptier.toml"
    config.write_text(RULE)
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    assert main(["scan", "--no-prefect", "--catalog", url, "--config", str(config), f"s3://{bucket}/run", "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["committed"] == 1 and report["jobs"] == ["gpt"]
