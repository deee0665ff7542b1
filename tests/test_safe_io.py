"""Nothing outside what was proven is ever read or deleted: the attacks and careless operators of
docs/failure-scenarios.md ("Links, swaps and hostile bytes"), end to end through the command line.

Each test builds a local tree of guide checkpoints (``metadata.json`` written last, listing each
file's size and, unless said otherwise, its sha256), runs ``ckptier`` in-process through ``main()``
and then changes the tree the way an attacker who can write the hot tree, a deduplicating tool or
a dying trainer would, before the command that must not be fooled.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptier.flows.cli import main

JOB = "job"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def step_dir(root: Path, step: int) -> Path:
    return root / JOB / f"step-{step:08d}"


def write_guide(root: Path, step: int, files: dict[str, bytes], *, sha: bool = True,
                links: dict[str, str] | None = None, sizes: dict[str, int] | None = None) -> Path:
    """A guide checkpoint: ``files`` written, ``links`` (relpath -> symlink target) made, then
    ``metadata.json`` listing every one with its size (``sizes`` overrides) and sha256."""
    d = step_dir(root, step)
    listed: dict[str, dict[str, object]] = {}
    for rel, data in files.items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        entry: dict[str, object] = {"size": len(data)}
        if sha:
            entry["sha256"] = hashlib.sha256(data).hexdigest()
        listed[rel] = entry
    for rel, target in (links or {}).items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, p)
    for rel, size in (sizes or {}).items():
        listed.setdefault(rel, {})["size"] = size
    (d / "metadata.json").write_text(json.dumps({"step": step, "files": listed}))
    return d


def payload(step: int, rel: str, n: int = 6000) -> bytes:
    return random.Random(f"{step}/{rel}").randbytes(n)


def ckpt_files(step: int) -> dict[str, bytes]:
    return {rel: payload(step, rel) for rel in ("rank-0000/model.pt", "rank-0000/optimizer.pt")}


def snapshot(path: Path) -> dict[str, bytes | str]:
    """Every entry below ``path`` (not following links): a file's bytes, a link's target, a directory."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(path).as_posix()
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = p.read_bytes()
    return out


@pytest.fixture()
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A hot tree, a catalog, an archive and a policy keeping the newest verified checkpoint only."""
    hot = tmp_path / "hot"
    hot.mkdir()
    archive = tmp_path / "archive"
    catalog = tmp_path / "catalog.db"
    config = tmp_path / "ckptier.toml"
    config.write_text('[[policy]]\njobs = "*"\nkeep_last = 1\nmin_verified = 1\n')
    monkeypatch.setenv("CKPTIER_CATALOG_URL", f"sqlite:///{catalog}")
    monkeypatch.setenv("CKPTIER_CONFIG", str(config))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    return {"hot": hot, "archive": archive, "catalog": catalog, "config": config, "tmp": tmp_path}


def age(root: Path, seconds: float) -> None:
    """Set every mtime below ``root`` back by ``seconds``: a tree written long ago, whose
    directories a scan stamps (and then skips while the stamps hold)."""
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in [*filenames, *dirnames, ""]:
            p = Path(dirpath) / name if name else Path(dirpath)
            if not p.is_symlink():
                st = p.stat()
                os.utime(p, (st.st_atime - seconds, st.st_mtime - seconds))


def scan_verify(env: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "scan", str(env["hot"]))
    assert code == 0, out + err
    code, out, err = run(capsys, "verify")
    assert code in (0, 1), out + err


def states(capsys: pytest.CaptureFixture[str]) -> dict[int, str]:
    code, out, err = run(capsys, "ls", "--json", "--all")
    assert code == 0, err
    return {r["step"]: r["state"] for r in json.loads(out)}


# --------------------------------------------------------------------------- 1. a symlinked step directory


@pytest.mark.parametrize("where", ["newest", "outside", "job-dir"])
def test_a_step_directory_swapped_for_a_symlink_deletes_nothing_through_it(
        env: dict[str, Path], capsys: pytest.CaptureFixture[str], where: str) -> None:
    for step in (100, 200, 300):
        write_guide(env["hot"], step, ckpt_files(step))
    scan_verify(env, capsys)
    assert states(capsys) == {100: "verified", 200: "verified", 300: "verified"}

    # After scan and verify: rm -rf job/step-00000100 && ln -s <target> job/step-00000100
    victim = step_dir(env["hot"], 100)
    if where == "newest":
        shutil.rmtree(victim)
        target = step_dir(env["hot"], 300)
        os.symlink(target.name, victim)
    elif where == "outside":  # a tree the attacker cannot touch, laid out like a checkpoint, with a subdirectory
        shutil.rmtree(victim)
        target = env["tmp"] / "outside"
        write_guide(target.parent / "outside-root", 100, ckpt_files(100))
        shutil.copytree(step_dir(target.parent / "outside-root", 100), target)
        (target / "rank-0000" / "keep-me").mkdir()
        os.symlink(target, victim)
    else:  # the job directory itself, above every step: a copy of it elsewhere takes its place
        target = env["tmp"] / "outside-job"
        shutil.copytree(env["hot"] / JOB, target)
        shutil.rmtree(env["hot"] / JOB)
        os.symlink(target, env["hot"] / JOB)
        victim = env["hot"] / JOB
    before = snapshot(target)

    code, out, err = run(capsys, "apply")
    assert snapshot(target) == before, "apply deleted or removed something through the symlink"
    assert "step 100: delete done" not in out + err
    assert victim.is_symlink()  # the link itself is not ours to judge: a rescan finds it
    after = states(capsys)
    assert after[300] == "verified" and after[100] == "verified"  # skipped, not tombstoned: nothing was deleted
    assert after[200] == ("verified" if where == "job-dir" else "deleted")
    if where == "job-dir":  # every keeper is out of reach below the link: the job's deletes wait
        assert "could not be proven" in out + err and "not followed" in out + err
        return
    assert "rescan" in out + err

    fetched = env["tmp"] / "fetched"
    code, out, err = run(capsys, "fetch", "--job", JOB, "--step", "300", str(fetched))
    assert code == 0, out + err
    assert {p.relative_to(fetched).as_posix(): p.read_bytes() for p in fetched.rglob("*") if p.is_file()} == {
        **ckpt_files(300), "metadata.json": (step_dir(env["hot"], 300) / "metadata.json").read_bytes()}


def test_a_file_replaced_after_verify_or_between_its_proof_and_its_delete_is_left_alone(
        env: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptier.storage.local import LocalStore

    for step in (100, 200, 300):
        write_guide(env["hot"], step, ckpt_files(step))
    scan_verify(env, capsys)
    # Step 100's model.pt rewritten in place after verify (same size, new bytes): its delete waits for a verify.
    model = step_dir(env["hot"], 100) / "rank-0000" / "model.pt"
    model.write_bytes(payload(100, "other", 6000))
    # Step 200's optimizer.pt is replaced while apply runs, after its proof and before its delete.
    swapped = step_dir(env["hot"], 200) / "rank-0000" / "optimizer.pt"
    theirs = b"written by someone else, between the proof and the delete"
    real = LocalStore.delete_proven

    def racing(self: LocalStore, proven: list) -> object:  # type: ignore[type-arg]
        if any(i.key.endswith("step-00000200/rank-0000/optimizer.pt") for i in proven) and not swapped.read_bytes() == theirs:
            swapped.unlink()
            swapped.write_bytes(theirs)
        return real(self, proven)

    monkeypatch.setattr(LocalStore, "delete_proven", racing)
    code, out, err = run(capsys, "apply")
    assert code == 1, out + err  # step 200's delete is partial: the replaced file stays
    assert "changed since its verdict" in out + err and "partial" in out + err
    assert model.read_bytes() == payload(100, "other", 6000) and swapped.read_bytes() == theirs
    assert states(capsys) == {100: "committed", 200: "verified", 300: "verified"}
    code, out, err = run(capsys, "apply")  # the next run finishes the interrupted delete, leaving their file
    assert code == 0, out + err
    assert swapped.read_bytes() == theirs and not (swapped.parent / "model.pt").exists()
    code, out, err = run(capsys, "ls", "--json", "--all")
    [row] = [r for r in json.loads(out) if r["step"] == 200]
    assert row["state"] == "deleted" and "left in place, replaced since they were proven" in row["reason"]


def test_a_hard_linked_file_frees_nothing_in_the_figure(env: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    for step in (100, 200):
        write_guide(env["hot"], step, ckpt_files(step))
    elsewhere = env["tmp"] / "elsewhere.bin"
    os.link(step_dir(env["hot"], 100) / "rank-0000" / "model.pt", elsewhere)  # a second name, outside the root
    meta = len((step_dir(env["hot"], 100) / "metadata.json").read_bytes())
    scan_verify(env, capsys)
    code, out, err = run(capsys, "apply")
    assert code == 0, out + err
    assert states(capsys)[100] == "deleted" and elsewhere.read_bytes() == ckpt_files(100)["rank-0000/model.pt"]
    freed = len(ckpt_files(100)["rank-0000/optimizer.pt"]) + meta  # model.pt's bytes live on under its other name
    assert f"delete 1 ({freed} bytes freed)" in out, out


# --------------------------------------------------------------------------- 2. a keeper's file linked into a rolling one


def test_a_keepers_file_linked_into_a_rolling_checkpoint_keeps_that_checkpoint(
        env: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """rdfind / jdupes -l: the newest checkpoint's optimizer.pt became a link to the identical file
    of an older, rolling checkpoint. Deleting the old one would leave the keeper pointing at nothing."""
    shared = payload(0, "frozen")
    write_guide(env["hot"], 100, {"rank-0000/model.pt": payload(100, "m"), "rank-0000/optimizer.pt": shared})
    write_guide(env["hot"], 200, {"rank-0000/model.pt": payload(200, "m"), "rank-0000/optimizer.pt": shared})
    write_guide(env["hot"], 300, {"rank-0000/model.pt": payload(300, "m")},
                links={"rank-0000/optimizer.pt": "../../step-00000100/rank-0000/optimizer.pt"},
                sizes={"rank-0000/optimizer.pt": len(shared)})
    scan_verify(env, capsys)
    assert states(capsys) == {100: "verified", 200: "verified", 300: "verified"}

    code, out, err = run(capsys, "apply")
    assert code == 0, out + err
    after = states(capsys)
    assert after[300] == "verified" and after[200] == "deleted"
    assert after[100] == "verified", "the checkpoint a kept checkpoint's link points into was deleted"
    assert (step_dir(env["hot"], 300) / "rank-0000" / "optimizer.pt").read_bytes() == shared
    code, out, err = run(capsys, "latest", "--job", JOB, "--json")
    assert code == 0 and json.loads(out)["step"] == 300
    fetched = env["tmp"] / "fetched"
    code, out, err = run(capsys, "fetch", "--job", JOB, "--step", "300", str(fetched))
    assert code == 0, out + err
    got = fetched / "rank-0000" / "optimizer.pt"
    assert not got.is_symlink() and got.read_bytes() == shared


# --------------------------------------------------------------------------- 3. exfiltration through a link


def test_a_link_to_a_file_outside_the_root_is_never_read_archived_or_fetched(
        env: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    secret_dir = env["tmp"] / "root-only"
    secret_dir.mkdir(mode=0o700)
    secret = secret_dir / "shadow"
    secret.write_bytes(b"root:$6$very-secret-hash:19000:0:99999:7:::\n" * 8)
    secret.chmod(0o600)
    env["config"].write_text(f'[[policy]]\njobs = "*"\nkeep_last = 1\nmin_verified = 1\nmilestones = [300]\n'
                             f'archive = "{env["archive"].as_uri()}"\n')
    write_guide(env["hot"], 300, ckpt_files(300), sha=False, links={"notes.txt": str(secret)},
                sizes={"notes.txt": secret.stat().st_size})
    scan_verify(env, capsys)
    code, out, err = run(capsys, "apply")
    code, out, err = run(capsys, "ls", "--json")
    [row] = json.loads(out)
    assert row["state"] != "verified", row
    leaked = [p for p in env["archive"].rglob("*") if p.is_file() and "notes.txt" in p.name]
    assert leaked == [], "the linked file was archived"
    fetched = env["tmp"] / "fetched"
    run(capsys, "fetch", "--job", JOB, "--step", "300", str(fetched))
    assert not any(p.read_bytes() == secret.read_bytes() for p in fetched.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- 4. in-place changes


def test_a_file_truncated_in_place_after_verify_is_never_answered_by_latest(
        env: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    for step in (100, 200):
        write_guide(env["hot"], step, ckpt_files(step))
    age(env["hot"], 3 * 3600)
    scan_verify(env, capsys)
    assert states(capsys) == {100: "verified", 200: "verified"}
    model = step_dir(env["hot"], 200) / "rank-0000" / "model.pt"
    ino = model.stat().st_ino
    with open(model, "r+b") as fh:  # a restarted job re-saving step 200 with torch.save, killed part-way
        fh.truncate(1000)
    assert model.stat().st_ino == ino

    code, out, err = run(capsys, "scan", str(env["hot"]), "--json")
    assert code == 0 and json.loads(out)[0]["unchanged_dirs"] == 2  # the directories' stamps hold
    run(capsys, "verify")
    code, out, err = run(capsys, "latest", "--job", JOB, "--json")
    assert code == 0, err
    assert json.loads(out)["step"] == 100, "latest answered a torn checkpoint as verified"
    assert states(capsys)[200] != "verified"
    run(capsys, "verify")
    assert states(capsys)[200] == "corrupt"


@pytest.mark.parametrize("command", ["plan", "fetch", "drill"])
def test_plan_fetch_and_drill_never_trust_a_verdict_about_bytes_that_changed(
        env: dict[str, Path], capsys: pytest.CaptureFixture[str], command: str) -> None:
    for step in (100, 200):
        write_guide(env["hot"], step, ckpt_files(step))
    age(env["hot"], 3 * 3600)
    scan_verify(env, capsys)
    model = step_dir(env["hot"], 200) / "rank-0000" / "model.pt"
    with open(model, "r+b") as fh:  # torn in place: no directory changes, no rescan sees it
        fh.truncate(1000)
    if command == "plan":  # the newest verified checkpoint the deletions rest on is no longer trusted
        code, out, err = run(capsys, "plan", "--json")
        assert code == 0, err
        rows = {r["step"]: r for r in json.loads(out)}
        assert rows[200]["state"] == "committed" and rows[100]["action"] == "keep", rows
    elif command == "fetch":  # the hot copy is not what was verified: nothing torn is restored
        code, out, err = run(capsys, "fetch", "--job", JOB, "--step", "200", str(env["tmp"] / "restored"))
        assert code != 0 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert not (env["tmp"] / "restored").exists()
    else:  # the drill passes over it without blaming it, and drills the next one
        code, out, err = run(capsys, "drill", "--job", JOB, "--step", "200", "--steps", "1", "--json",
                             "--model", "ckptier.tasks.drill_models:demo_model")
        assert code != 0
        assert "changed since its verdict" in out + err and "verify it again" in out + err
        code, out, err = run(capsys, "ls", "--json", "--all")
        assert not any(r.get("last_drill") for r in json.loads(out))  # nothing recorded against it
    assert states(capsys)[200] == "committed"


def _lightning_file(path: Path, n: int = 200_000) -> bytes:
    """A torch-style zip (stored members, a central directory) like Lightning's .ckpt."""
    import io

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
        zf.writestr("archive/data/0", random.Random(1).randbytes(n))
        zf.writestr("archive/version", b"3\n")
    data = buf.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    return data


def test_a_file_found_half_written_then_completed_is_verified_again(
        env: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = env["hot"] / "pl" / "epoch=0-step=100.ckpt"
    whole = _lightning_file(ckpt)
    ckpt.write_bytes(whole[: len(whole) // 2])  # caught half-written...
    hour_ago = ckpt.stat().st_mtime - 3600  # ...by a file server whose clock is an hour behind
    os.utime(ckpt, (hour_ago, hour_ago))
    scan_verify(env, capsys)
    assert states(capsys) == {100: "corrupt"}
    with open(ckpt, "r+b") as fh:  # the save completes, in place
        fh.seek(0)
        fh.write(whole)
    os.utime(ckpt, (hour_ago + 5, hour_ago + 5))
    scan_verify(env, capsys)
    assert states(capsys) == {100: "verified"}


# --------------------------------------------------------------------------- 5. a zip bomb in a .pt

_MEASURE = textwrap.dedent("""
    import json, resource, sys
    from ckptier.flows.cli import main
    code = main(["verify", "--json"])
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print("PEAK", peak_kib, code, file=sys.stderr)
""")


def _zip_bomb(path: Path, inflated: int) -> None:
    """A torch-style .pt whose one deflated member inflates to ``inflated`` bytes of zeros."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        zf.writestr(zipfile.ZipInfo("archive/data.pkl"), b"\x80\x02}q\x00.", compress_type=zipfile.ZIP_STORED)
        info = zipfile.ZipInfo("archive/data/0")
        info.compress_type = zipfile.ZIP_DEFLATED
        zero = bytes(1 << 20)
        with zf.open(info, "w", force_zip64=True) as member:
            for _ in range(inflated >> 20):
                member.write(zero)


def _peak_verify_rss(env: dict[str, Path], tmp: Path, name: str, make: object) -> int:
    hot = tmp / name / "hot"
    catalog = tmp / name / "catalog.db"
    hot.mkdir(parents=True)
    model = step_dir(hot, 100) / "rank-0000" / "model.pt"
    make(model)  # type: ignore[operator]
    d = step_dir(hot, 100)
    (d / "metadata.json").write_text(json.dumps({"step": 100, "files": {"rank-0000/model.pt": {
        "size": model.stat().st_size}}}))
    environ = {**os.environ, "CKPTIER_CATALOG_URL": f"sqlite:///{catalog}"}
    subprocess.run([sys.executable, "-m", "ckptier.flows.cli", "scan", str(hot)], env=environ, check=True,
                   capture_output=True)
    proc = subprocess.run([sys.executable, "-c", _MEASURE], env=environ, capture_output=True, text=True, timeout=600)
    line = next(x for x in proc.stderr.splitlines() if x.startswith("PEAK"))
    _, peak, code = line.split()
    assert code in ("0", "1"), proc.stderr
    return int(peak)


def test_verify_of_a_zip_bomb_stays_within_twice_its_baseline_memory(
        env: dict[str, Path], tmp_path: Path) -> None:
    baseline = _peak_verify_rss(env, tmp_path, "plain", lambda p: _zip_bomb(p, 1 << 20))
    bomb = _peak_verify_rss(env, tmp_path, "bomb", lambda p: _zip_bomb(p, 1 << 30))
    size = (tmp_path / "bomb" / "hot" / JOB / "step-00000100" / "rank-0000" / "model.pt").stat().st_size
    assert size < 2 << 20  # about 1 MB on disk holding 1 GiB
    assert bomb <= 2 * baseline, f"verify peaked at {bomb} KiB against a baseline of {baseline} KiB"


# --------------------------------------------------------------------------- 6. environment errors


@pytest.fixture()
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs (root only); skipped where it cannot be mounted."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(fs: Path, leave: int = 0) -> None:
    """Fill ``fs`` up to ``leave`` bytes."""
    filler = fs / "filler"
    with open(filler, "wb") as fh:
        try:
            while True:
                fh.write(bytes(64 << 10))
                fh.flush()
        except OSError:
            pass
    if leave:
        os.truncate(filler, max(0, filler.stat().st_size - leave))


def _one_line_naming(err: str, *names: str) -> None:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert "unexpected error" not in err and "Traceback" not in err, err
    for name in names:
        assert name in lines[0], lines[0]


def test_fetch_to_a_full_disk_is_one_line_naming_the_path(
        env: dict[str, Path], capsys: pytest.CaptureFixture[str], small_fs: Path) -> None:
    write_guide(env["hot"], 100, {"rank-0000/model.pt": payload(100, "m", 3 << 20)})
    scan_verify(env, capsys)
    _fill(small_fs, leave=64 << 10)
    dest = small_fs / "restore"
    code, out, err = run(capsys, "fetch", "--job", JOB, "--step", "100", str(dest))
    assert code == 1, out + err
    _one_line_naming(err, str(small_fs))
    assert "space" in err.lower()
    assert not dest.exists() and [p.name for p in small_fs.iterdir()] == ["filler"]  # nothing half-written


def test_fetch_to_proc_is_one_line_naming_the_path(env: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    write_guide(env["hot"], 100, ckpt_files(100))
    scan_verify(env, capsys)
    code, out, err = run(capsys, "fetch", "--job", JOB, "--step", "100", "/proc/x")
    assert code == 1, out + err
    _one_line_naming(err, "/proc")


def test_a_catalog_on_a_full_disk_during_apply_is_one_line_naming_it(
        env: dict[str, Path], capsys: pytest.CaptureFixture[str], small_fs: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    catalog = small_fs / "catalog.db"
    monkeypatch.setenv("CKPTIER_CATALOG_URL", f"sqlite:///{catalog}")
    for step in (100, 200, 300):
        write_guide(env["hot"], step, ckpt_files(step))
    scan_verify(env, capsys)
    _fill(small_fs)
    code, out, err = run(capsys, "apply")
    assert code == 1, out + err
    _one_line_naming(err, str(catalog))
    assert "full" in err.lower()
