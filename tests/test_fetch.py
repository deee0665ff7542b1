"""``fetch`` is all or nothing, on local and S3 stores.

The files land in a staging directory beside DEST and are renamed into place
only when every one is complete and verified; DEST must be new or empty; a
checkpoint whose keys cannot live on a filesystem together (an S3 key that
is also the "directory" of other keys) is refused before anything is
written, by ``fetch`` and by the drill (which then tries the next one).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest

from ckptier.flows.cli import main
from ckptier.storage.errors import ConfigError
from ckptier.tasks.archive import FETCH_STAGE_PREFIX, check_fetch_dest, overlong_names, path_conflicts
from ckptier.tasks.demo import train_demo_run


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(FETCH_STAGE_PREFIX))


# ----------------------------------------------------------------- pure parts


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (["a", "b"], []),
        (["rank-0000", "rank-0000/model.pt"], [("rank-0000", "rank-0000/model.pt")]),
        (["x/y", "x/y/z/w", "x/yz"], [("x/y", "x/y/z/w")]),
        (["a", "a/b", "a/b/c"], [("a", "a/b"), ("a", "a/b/c")]),
        (["model.pt", "model.pt.index/x"], []),
    ],
)
def test_path_conflicts(names: list[str], expected: list[tuple[str, str]]) -> None:
    assert path_conflicts(names) == expected


def test_overlong_names() -> None:
    names = ["a" * 255, "b/" + "c" * 256 + "/d", "é" * 127, "é" * 128, "x/y"]
    assert overlong_names(names) == ["b/" + "c" * 256 + "/d", "é" * 128]  # bytes, not characters


def test_fetch_destination_must_be_new_or_empty(tmp_path: Path) -> None:
    check_fetch_dest(tmp_path / "new" / "deeper")  # absent, parents absent: fine
    (tmp_path / "empty").mkdir()
    check_fetch_dest(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    for name, needle in (("file", "is a file"), ("full", "is not empty (keep.txt)"), ("link", "symbolic link"),
                         ("file/sub", "is a file, not a directory")):
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            check_fetch_dest(tmp_path / name)


# ----------------------------------------------------------------- local


@pytest.fixture()
def local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> dict[str, Path]:
    hot = tmp_path / "hot"
    train_demo_run(hot, steps=100, every=25)
    config = tmp_path / "ckptier.toml"
    config.write_text('[[policy]]\njobs = "*"\nkeep_last = 2\n')
    monkeypatch.setenv("CKPTIER_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    monkeypatch.setenv("CKPTIER_CONFIG", str(config))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    for argv in (["scan", str(hot)], ["verify"]):
        assert run(capsys, *argv)[0] == 0
    return {"hot": hot, "step": hot / "demo-run" / "step-00000050"}


def test_fetch_refuses_a_destination_that_is_not_new_or_empty(local: dict[str, Path], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    code, out, err = run(capsys, "fetch", "--job", "demo-run", "--step", "50", str(full))
    assert code == 2 and "not empty (notes.txt)" in err and out == ""
    assert sorted(p.name for p in full.iterdir()) == ["notes.txt"] and leftovers(tmp_path) == []

    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, err = run(capsys, "fetch", "--job", "demo-run", "--step", "50", str(empty), "--json")
    assert code == 0, err
    assert sorted(p.relative_to(empty).as_posix() for p in empty.rglob("*") if p.is_file()) == [
        "metadata.json", "rank-0000/model.pt", "rank-0000/optimizer.pt"]
    assert leftovers(tmp_path) == []


def test_a_failed_fetch_leaves_nothing_behind(local: dict[str, Path], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    victim = local["step"] / "rank-0000" / "optimizer.pt"  # sorted last: model.pt is written first
    before = victim.stat()
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    dest = tmp_path / "restore" / "into" / "here"
    # Bit rot: the same size and mtime, so only the read finds it, after model.pt was written.
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    code, out, err = run(capsys, "fetch", "--job", "demo-run", "--step", "50", str(dest))
    assert code == 2 and "optimizer.pt" in err and len(err.strip().splitlines()) == 1, err
    assert "hash" in err or "crc" in err.lower() or "differ" in err, err
    assert not (tmp_path / "restore").exists()  # not DEST, not the parents it made, no staging directory
    assert leftovers(tmp_path) == []
    # A rewrite the stat sees: the hot copy is no longer trusted, and the refusal names the file.
    victim.write_bytes(bytes(data))
    code, out, err = run(capsys, "fetch", "--job", "demo-run", "--step", "50", str(dest))
    assert code == 2 and "optimizer.pt" in err and "not verified" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "restore").exists() and leftovers(tmp_path) == []


def test_a_stale_staging_directory_of_a_killed_fetch_is_removed(local: dict[str, Path], tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "out"
    dead_pid = 2 ** 22 + 7  # above Linux's default pid_max: no such process
    host = socket.gethostname()
    stale = tmp_path / f"{FETCH_STAGE_PREFIX}out.{host}.{dead_pid}.abc"
    (stale / "rank-0000").mkdir(parents=True)
    (stale / "rank-0000" / "model.pt").write_bytes(b"half")
    other_host = tmp_path / f"{FETCH_STAGE_PREFIX}out.other-host.{dead_pid}.abc"  # maybe alive over there
    other_host.mkdir()
    code, _, err = run(capsys, "fetch", "--job", "demo-run", "--step", "50", str(dest))
    assert code == 0, err
    assert not stale.exists() and other_host.exists() and (dest / "metadata.json").exists()


# ----------------------------------------------------------------- S3


@pytest.fixture()
def s3_job(s3_env: str, s3_bucket: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A demo run uploaded to S3; step 75's ``rank-0000`` is also an object of its own."""
    local = tmp_path / "local"
    train_demo_run(local, steps=100, every=25)
    client, bucket = s3_bucket.client, s3_bucket.name
    for path in sorted(local.rglob("*")):
        if path.is_file():
            key = "runs/" + path.relative_to(local).as_posix()
            client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes(), ChecksumAlgorithm="CRC64NVME")
    stray = "runs/demo-run/step-00000075/rank-0000"
    client.put_object(Bucket=bucket, Key=stray, Body=b"written by another tool", ChecksumAlgorithm="CRC64NVME")
    config = tmp_path / "ckptier.toml"
    config.write_text('[[policy]]\njobs = "*"\nkeep_last = 2\n'
                      '[[drill]]\njobs = "*"\nmodel = "ckptier.tasks.drill_models:demo_model"\nsteps = 2\n')
    monkeypatch.setenv("CKPTIER_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    monkeypatch.setenv("CKPTIER_CONFIG", str(config))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    return {"bucket": bucket, "client": client, "url": f"s3://{bucket}/runs"}


@pytest.mark.s3
def test_s3_key_that_is_also_a_directory_is_refused_before_writing(
    s3_job: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``.../rank-0000`` and ``.../rank-0000/model.pt``: fetch crashed with FileExistsError
    and left a partial DEST; the drill crashed too."""
    from ckptier.storage.catalog.api import Catalog

    assert run(capsys, "scan", s3_job["url"])[0] == 0
    with Catalog.open(os.environ["CKPTIER_CATALOG_URL"]) as cat:
        record = cat.get("demo-run", 75)
        assert record is not None and "rank-0000" in {f.relpath for f in record.files}  # the case at hand
    dest = tmp_path / "dest"
    code, out, err = run(capsys, "fetch", "--job", "demo-run", "--step", "75", str(dest))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "'rank-0000' is both a file and the directory of" in lines[0]
    assert not dest.exists() and leftovers(tmp_path) == []

    # The drill records the refusal for that checkpoint and restores the next one instead.
    assert run(capsys, "verify")[0] == 0
    code, out, err = run(capsys, "drill", "--job", "demo-run", "--step", "75", "--json")
    assert out, err
    (report,) = json.loads(out)
    assert code == 1 and report["stage"] == "fetch" and "both a file and the directory" in report["error"]
    code, out, err = run(capsys, "drill", "--job", "demo-run", "--json")
    reports = json.loads(out)
    assert [r["step"] for r in reports][-1] == 50 and reports[-1]["ok"], err


@pytest.mark.s3
def test_s3_key_with_a_name_no_filesystem_holds_is_refused_before_writing(
    s3_job: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A key segment of 300 bytes (S3 allows 1,024 for the whole key): fetch crashed with
    OSError ENAMETOOLONG, a traceback."""
    key = "runs/demo-run/step-00000050/rank-0000/" + "y" * 300 + ".pt"
    s3_job["client"].put_object(Bucket=s3_job["bucket"], Key=key, Body=b"extra", ChecksumAlgorithm="CRC64NVME")
    assert run(capsys, "scan", s3_job["url"])[0] == 0
    assert run(capsys, "verify")[0] == 0
    dest = tmp_path / "dest"
    code, out, err = run(capsys, "fetch", "--job", "demo-run", "--step", "50", str(dest))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "holds a name over 255 bytes" in lines[0], err
    assert not dest.exists() and leftovers(tmp_path) == []


@pytest.mark.s3
def test_s3_fetch_that_fails_half_way_leaves_nothing(s3_job: dict[str, Any], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "scan", s3_job["url"])[0] == 0
    assert run(capsys, "verify")[0] == 0
    client, bucket = s3_job["client"], s3_job["bucket"]
    key = "runs/demo-run/step-00000050/rank-0000/optimizer.pt"  # written after model.pt
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[10] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))  # replaced behind the catalog's back
    dest = tmp_path / "a" / "b"
    code, _, err = run(capsys, "fetch", "--job", "demo-run", "--step", "50", str(dest))
    assert code == 2 and "optimizer.pt" in err
    assert not (tmp_path / "a").exists() and leftovers(tmp_path) == []

    good = tmp_path / "good"
    code, _, err = run(capsys, "fetch", "--job", "demo-run", "--step", "25", str(good), "--json")
    assert code == 0, err
    assert (good / "rank-0000" / "model.pt").stat().st_size > 0 and leftovers(tmp_path) == []
    shutil.rmtree(good)
