"""Confining a process's writes with Landlock (``ckptier.tasks.confine``).

Every test that needs the kernel feature runs the confined code in a child
process (confinement cannot be undone) and skips, saying why, where the
kernel offers no Landlock.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckptier.tasks.confine import (
    FS_MAKE_REG,
    FS_REFER,
    FS_TRUNCATE,
    FS_WRITE_FILE,
    Confinement,
    landlock_abi,
    unavailable_reason,
    write_rights,
)

ABI, WHY_NOT = landlock_abi()
needs_landlock = pytest.mark.skipif(ABI is None, reason=f"no Landlock here: {WHY_NOT}")


@pytest.mark.parametrize(
    "err, words",
    [
        (errno.ENOSYS, "no Landlock system calls"),
        (errno.EOPNOTSUPP, "lsm= kernel boot parameter"),
        (errno.EPERM, "seccomp"),
        (errno.EINVAL, os.strerror(errno.EINVAL)),
    ],
)
def test_why_landlock_is_unavailable(err: int, words: str) -> None:
    assert words in unavailable_reason(err)


def test_write_rights_grow_with_the_abi() -> None:
    assert write_rights(1) & FS_WRITE_FILE and write_rights(1) & FS_MAKE_REG
    assert not write_rights(1) & (FS_REFER | FS_TRUNCATE)
    assert write_rights(2) & FS_REFER and not write_rights(2) & FS_TRUNCATE
    assert write_rights(3) == write_rights(7) and write_rights(3) & FS_TRUNCATE


ATTEMPTS = textwrap.dedent(
    """
    import errno, json, os, socket, sys
    from pathlib import Path
    from ckptier.tasks.confine import confine_writes

    inside, outside = Path(sys.argv[1]), Path(sys.argv[2])
    status = confine_writes([inside])

    def attempt(action):
        try:
            action()
            return "ok"
        except OSError as exc:
            return errno.errorcode.get(exc.errno, str(exc.errno))

    def bind_unix(path):
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(path))

    results = {}
    for where, base in (("inside", inside), ("outside", outside)):
        results[where] = {
            "create": attempt(lambda: (base / "new.txt").write_text("x")),
            "append": attempt(lambda: open(base / "existing.txt", "a").close()),
            "truncate": attempt(lambda: os.truncate(base / "existing.txt", 0)),
            "mkdir": attempt(lambda: (base / "dir").mkdir()),
            "symlink": attempt(lambda: os.symlink("/etc/hostname", base / "link")),
            "fifo": attempt(lambda: os.mkfifo(base / "fifo")),
            "socket": attempt(lambda: bind_unix(base / "sock")),
            "rename": attempt(lambda: os.rename(base / "victim.txt", base / "renamed.txt")),
            "unlink": attempt(lambda: os.unlink(base / "existing.txt")),
        }
    results["read outside"] = attempt(lambda: (outside / "victim.txt").read_text())
    results["move out"] = attempt(lambda: os.rename(inside / "new.txt", outside / "moved.txt"))
    results["hardlink in"] = attempt(lambda: os.link(outside / "victim.txt", inside / "hard"))
    results["dev null"] = attempt(lambda: open(os.devnull, "w").write("x"))
    print(json.dumps({"status": status.to_json(), "results": results}))
    """
)


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    inside, outside = tmp_path / "scratch", tmp_path / "elsewhere"
    for d in (inside, outside):
        d.mkdir()
        (d / "existing.txt").write_text("old")
        (d / "victim.txt").write_text("precious")
    return inside, outside


@needs_landlock
def test_confined_process_writes_only_inside(tmp_path: Path) -> None:
    inside, outside = _tree(tmp_path)
    done = subprocess.run([sys.executable, "-c", ATTEMPTS, str(inside), str(outside)], capture_output=True, text=True,
                          timeout=60, check=True)
    report = json.loads(done.stdout)
    status = Confinement.from_json(report["status"])
    assert status.confined and f"ABI {ABI}" in status.detail and str(inside) in status.detail
    results = report["results"]
    assert set(results["inside"].values()) == {"ok"}, results["inside"]
    assert "ok" not in results["outside"].values(), results["outside"]
    assert results["read outside"] == "ok" and results["dev null"] == "ok"
    assert results["move out"] != "ok" and results["hardlink in"] != "ok"
    assert (outside / "victim.txt").read_text() == "precious" and (outside / "existing.txt").read_text() == "old"
    assert sorted(p.name for p in outside.iterdir()) == ["existing.txt", "victim.txt"]


def test_launcher_reports_then_runs_the_command(tmp_path: Path) -> None:
    inside, outside = _tree(tmp_path)
    read, write = os.pipe()
    probe = f"import pathlib; pathlib.Path({str(outside / 'escape.txt')!r}).write_text('x')"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptier.tasks.confine", "--write", str(inside), "--status-fd", str(write), "--",
         sys.executable, "-c", probe],
        pass_fds=(write,), stderr=subprocess.PIPE, text=True,
    )
    os.close(write)
    _, err = proc.communicate(timeout=60)
    with os.fdopen(read) as fh:
        status = Confinement.from_json(fh.read())
    if ABI is None:
        assert not status.confined and WHY_NOT in status.detail
        assert proc.returncode == 0 and (outside / "escape.txt").exists()
    else:
        assert status.confined
        assert proc.returncode != 0 and "PermissionError" in err
        assert not (outside / "escape.txt").exists()


NESTED = textwrap.dedent(
    """
    import sys
    from ckptier.tasks.confine import confine_writes
    for _ in range(16):  # the most Landlock domains a process may stack, each allowing every write
        assert confine_writes(["/"]).confined
    print(confine_writes([sys.argv[1]]).to_json())
    """
)


@needs_landlock
def test_a_refused_confinement_is_reported_not_hidden(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", NESTED, str(tmp_path)], capture_output=True, text=True, timeout=60, check=True)
    status = Confinement.from_json(done.stdout)
    assert not status.confined
    assert status.detail.startswith("writes not confined:") and "nested Landlock domains" in status.detail


def test_a_missing_directory_is_reported(tmp_path: Path) -> None:
    script = f"from ckptier.tasks.confine import confine_writes; print(confine_writes([{str(tmp_path / 'absent')!r}]).to_json())"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    status = Confinement.from_json(done.stdout)
    assert not status.confined
    assert ("absent" in status.detail) if ABI is not None else (WHY_NOT in status.detail)


THREAD_NAME = textwrap.dedent(
    """
    import json, os, sys, threading
    from ckptier.tasks.confine import confine_writes
    confine_writes([sys.argv[1]])

    def name_thread(out):
        try:
            with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as fh:
                fh.write("drill-worker")
            out.append("ok")
        except OSError as exc:
            out.append(exc.strerror)

    out = []
    for _ in range(3):  # threads started after confining, as CUDA's are
        thread = threading.Thread(target=name_thread, args=(out,))
        thread.start()
        thread.join()

    def attempt(path):
        try:
            open(path, "w").close()
            return "ok"
        except OSError as exc:
            return exc.strerror

    print(json.dumps({"threads": out, "parent": attempt(f"/proc/{os.getppid()}/comm"), "sysctl": attempt("/proc/sys/kernel/hostname")}))
    """
)


@needs_landlock
def test_threads_can_still_name_themselves_but_the_rest_of_proc_stays_read_only(tmp_path: Path) -> None:
    # CUDA's cuInit writes /proc/<pid>/task/<tid>/comm and fails when refused.
    done = subprocess.run([sys.executable, "-c", THREAD_NAME, str(tmp_path)], capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(done.stdout)
    assert result["threads"] == ["ok", "ok", "ok"]
    assert result["parent"] != "ok" and result["sysctl"] != "ok"


NAMER = textwrap.dedent(
    """
    import sys, threading
    print("ready", flush=True)
    sys.stdin.readline()  # wait while the test drops the kernel's dentry cache
    out = []
    def name_thread():
        try:
            open(f"/proc/self/task/{threading.get_native_id()}/comm", "w").write("drill-worker")
            out.append("ok")
        except OSError as exc:
            out.append(exc.strerror)
    for _ in range(3):
        thread = threading.Thread(target=name_thread)
        thread.start()
        thread.join()
    print(out)
    """
)


@needs_landlock
@pytest.mark.skipif(not os.access("/proc/sys/vm/drop_caches", os.W_OK), reason="dropping the dentry cache needs root")
def test_thread_naming_survives_exec_and_a_dropped_dentry_cache(tmp_path: Path) -> None:
    # The rule binds to the inode of /proc/<pid>/task; the launcher keeps it open
    # across exec, else a later look-up finds a fresh inode and the write is refused.
    proc = subprocess.Popen([sys.executable, "-m", "ckptier.tasks.confine", "--write", str(tmp_path), "--",
                             sys.executable, "-c", NAMER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("2\n")
        out, _ = proc.communicate("\n", timeout=60)
    finally:
        proc.kill()
    assert out.strip() == "['ok', 'ok', 'ok']"
