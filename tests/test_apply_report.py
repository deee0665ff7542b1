"""``apply --json`` and ``janitor --json`` print the typed report's ``to_json()``, with the keys they always had."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckptier.flows import runner
from ckptier.tasks.reports import ItemResult, Proof
from ckptier.tasks.reports import ApplyRunReport, JanitorRunReport, TieringOutcome
from tests.test_cli import env, run, trained  # noqa: F401 - the fixtures

APPLY_KEYS = {"dry_run", "items", "lines", "bytes_freed", "failed", "held", "proofs", "outcome"}
OUTCOME_KEYS = {"tiers", "promoted", "deleted", "hot_freed_bytes"}


def _capture(monkeypatch: pytest.MonkeyPatch, name: str) -> list[Any]:
    """Record what ``runner.<name>`` hands the command line (the real operation still runs)."""
    seen: list[Any] = []
    real = getattr(runner, name)

    def recording(**kwargs: Any) -> Any:
        seen.append(real(**kwargs))
        return seen[-1]

    monkeypatch.setattr(runner, name, recording)
    return seen


def test_apply_json_is_the_reports_to_json(env: dict[str, Path], capsys: pytest.CaptureFixture[str],  # noqa: F811
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    for argv in (["scan", str(env["hot"])], ["verify"]):
        assert run(capsys, *argv)[0] == 0
    seen = _capture(monkeypatch, "apply")
    code, out, err = run(capsys, "apply", "--json")
    assert code == 0, out + err
    [report] = seen
    assert isinstance(report, ApplyRunReport)
    printed = json.loads(out)
    assert printed == json.loads(json.dumps(report.to_json(), default=str))
    assert printed.keys() == APPLY_KEYS and printed["outcome"].keys() == OUTCOME_KEYS
    # Something was carried out, so every part of the report is in the comparison.
    assert report.items and report.proofs and report.outcome.promoted and report.outcome.deleted
    assert all(isinstance(i, ItemResult) for i in report.items) and all(isinstance(p, Proof) for p in report.proofs)
    assert printed["bytes_freed"] == report.bytes_freed == sum(i.freed for i in report.items) > 0
    assert printed["outcome"]["hot_freed_bytes"] == report.outcome.hot_freed_bytes == report.bytes_freed
    assert [i["step"] for i in printed["items"]] == [i.step for i in report.items]

    # The human output reads the same report: its lines.
    seen.clear()
    code, out, err = run(capsys, "apply")
    assert code == 0, out + err
    [again] = seen
    assert out.splitlines()[1:] == list(again.lines)  # after the line naming the catalog


def test_janitor_json_is_the_reports_to_json(env: dict[str, Path], capsys: pytest.CaptureFixture[str],  # noqa: F811
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    for argv in (["scan", str(env["hot"])], ["verify"], ["apply"]):
        assert run(capsys, *argv)[0] == 0
    seen = _capture(monkeypatch, "janitor")
    code, out, _ = run(capsys, "janitor", "--older-than", "1h", "--json")
    assert code == 0
    [report] = seen
    assert isinstance(report, JanitorRunReport)
    printed = json.loads(out)
    assert printed == json.loads(json.dumps(report.to_json(), default=str))
    assert printed.keys() == {"archives", "lines"} and list(printed["archives"]) == list(report.archives)


def test_an_empty_apply_report_has_the_same_keys() -> None:
    empty = ApplyRunReport(dry_run=True, items=(), lines=(), bytes_freed=0, failed=False, held=(), proofs=(),
                           outcome=TieringOutcome((), (), ()))
    assert empty.to_json() == {"dry_run": True, "items": [], "lines": [], "bytes_freed": 0, "failed": False,
                               "held": [], "proofs": [],
                               "outcome": {"tiers": (), "promoted": (), "deleted": (), "hot_freed_bytes": 0}}
