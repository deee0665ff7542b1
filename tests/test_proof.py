"""Proof levels (committed < verified < drilled) in the catalog, `ckptier latest` and `ckptier ls`."""

from __future__ import annotations

import re
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from ckptier.flows.cli import main
from ckptier.storage.catalog.api import Catalog, DrillRecord
from ckptier.storage.records import FileCheck, FileRef, Format, Found, Recognition, State
from ckptier.storage.transitions import Proof

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
STORE = "file:///data/runs"
JOB = "llama"


def found(step: int) -> Found:
    prefix = f"{JOB}/step-{step:08d}"
    return Found(job=JOB, step=step, format=Format.GUIDE, prefix=prefix,
                 files=(FileRef(f"{prefix}/metadata.json", "metadata.json", 10, 1_700_000_000.0),),
                 committed=True, reason="metadata.json present")


def drill(cat: Catalog, step: int, ok: bool, at: datetime, error: str | None = None) -> None:
    rec = cat.get(JOB, step)
    assert rec is not None
    cat.record_drill(DrillRecord(job=JOB, step=step, checkpoint_id=rec.id, started_at=at, finished_at=at + timedelta(minutes=1),
                                 ok=ok, device="cpu", source_tier="hot", verdict={"summary": "s"}, error=error))


@pytest.fixture
def cat(catalog_url: str) -> Iterator[Catalog]:
    """Steps 1-4 verified, 5 committed: 1 drilled ok, 3 drilled ok then failed, 4 never drilled."""
    with Catalog.open(catalog_url) as c:
        c.record_scan(STORE, Recognition(tuple(found(s) for s in (1, 2, 3, 4, 5)), (), 5), now=T0)
        for s in (1, 2, 3, 4):
            rec = c.get(JOB, s)
            assert rec is not None
            c.record_verification(rec.id, [FileCheck("metadata.json", "ok", 10, f"crc{s}")], now=T0)
        drill(c, 1, True, T0 + timedelta(hours=1))
        drill(c, 3, True, T0 + timedelta(hours=1))
        drill(c, 3, False, T0 + timedelta(hours=2), error="restore: optimizer state has no 'step'")
        yield c


def test_the_catalog_carries_each_checkpoints_last_drill(cat: Catalog) -> None:
    by_step = {r.step: r for r in cat.checkpoints(job=JOB)}
    assert by_step[1].last_drill is not None and by_step[1].last_drill.ok
    assert by_step[1].last_drill.at == T0 + timedelta(hours=1, minutes=1)
    three = by_step[3].last_drill
    assert three is not None and not three.ok and three.detail == "restore: optimizer state has no 'step'"
    assert by_step[4].last_drill is None


def test_latest_passes_over_a_failed_drill_and_drilled_asks_for_a_passed_one(cat: Catalog) -> None:
    latest = cat.choose_latest(JOB)
    assert latest.record is not None and latest.record.step == 4 and latest.proof == Proof.VERIFIED
    assert latest.record.files  # the chosen record comes with its files
    # Step 4 fails its drill too: step 3's failure and step 4's are both named, step 2 is the answer.
    drill(cat, 4, False, T0 + timedelta(hours=3), error="load: unexpected key 'x'")
    latest = cat.choose_latest(JOB)
    assert latest.record is not None and latest.record.step == 2
    assert [s for s, _ in latest.passed_over] == [4, 3]
    assert "load: unexpected key 'x'" in latest.passed_over[0][1]
    drilled = cat.choose_latest(JOB, drilled=True)
    assert drilled.record is not None and drilled.record.step == 1
    assert (drilled.proof, drilled.proven_at) == (Proof.DRILLED, T0 + timedelta(hours=1, minutes=1))
    assert cat.latest(JOB, drilled=True).step == 1  # type: ignore[union-attr]


def test_latest_leaves_out_the_checkpoints_excluded(cat: Catalog) -> None:
    """What ``resume`` asks after passing over the newest: the next one ``latest`` would answer."""
    four, two = cat.get(JOB, 4), cat.get(JOB, 2)
    assert four is not None and two is not None
    latest = cat.choose_latest(JOB, exclude={four.id})
    assert latest.record is not None and latest.record.step == 2 and latest.record.files
    assert [s for s, _ in latest.passed_over] == [3]  # the failed drill is still named
    assert cat.choose_latest(JOB, exclude={four.id, two.id}).record.step == 1  # type: ignore[union-attr]
    assert cat.choose_latest(JOB, exclude={four.id, two.id, cat.get(JOB, 1).id}).record is None  # type: ignore[union-attr]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_latest_and_ls_show_the_proof(cat: Catalog, catalog_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "latest", "--job", JOB, "--catalog", catalog_url)
    assert code == 0
    assert f"{JOB} step 4: {STORE}/{JOB}/step-00000004 (guide, 10 B, verified {T0.isoformat()})" in out
    assert "passed over step" not in out
    drill(cat, 4, False, T0 + timedelta(hours=3), error="load: unexpected key 'x'")
    code, out, _ = run(capsys, "latest", "--job", JOB, "--catalog", catalog_url)
    catalog_line, answer = out.split("\n", 1)
    assert code == 0 and catalog_line.startswith("catalog: ") and answer.startswith(f"{JOB} step 2:")
    assert "  passed over step 4: its drill failed at 2026-01-01T15:01:00+00:00: load: unexpected key 'x'" in out

    code, out, _ = run(capsys, "latest", "--job", JOB, "--drilled", "--json", "--catalog", catalog_url)
    doc = json.loads(out)
    assert code == 0 and doc["step"] == 1 and doc["proof"] == "drilled"
    assert doc["proven_at"] == "2026-01-01T13:01:00+00:00"
    assert doc["last_drill"] == {"ok": True, "at": "2026-01-01T13:01:00+00:00", "detail": None}
    assert [p["step"] for p in doc["passed_over"]] == [4, 3]

    code, out, _ = run(capsys, "ls", "--job", JOB, "--json", "--catalog", catalog_url)
    proofs = {c["step"]: (c["proof"], c["last_drill"] and c["last_drill"]["ok"]) for c in json.loads(out)}
    assert proofs == {1: ("drilled", True), 2: ("verified", None), 3: ("verified", False), 4: ("verified", False),
                      5: ("committed", None)}
    code, out, _ = run(capsys, "ls", "--job", JOB, "--catalog", catalog_url)
    assert out.startswith("catalog: ")
    header, *rows = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines()[1:]]
    proof = {int(r[header.index("STEP")]): r[header.index("PROOF")] for r in rows}
    assert proof == {1: "drilled", 2: "verified", 3: "verified (drill failed)", 4: "verified (drill failed)",
                     5: "committed"}


def test_cli_latest_drilled_with_none_says_so(catalog_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with Catalog.open(catalog_url) as c:
        c.record_scan(STORE, Recognition((found(1),), (), 1), now=T0)
        rec = c.get(JOB, 1)
        assert rec is not None
        c.record_verification(rec.id, [FileCheck("metadata.json", "ok", 10, "crc")], now=T0)
        assert c.get(JOB, 1).state == State.VERIFIED  # type: ignore[union-attr]
    code, out, err = run(capsys, "latest", "--job", JOB, "--drilled", "--json", "--catalog", catalog_url)
    assert code == 1 and json.loads(out)["latest"] is None
    assert "no verified checkpoint whose most recent drill passed; run 'ckptier drill --job llama'" in err
