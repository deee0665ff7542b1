"""Confine a process's filesystem writes to a few directories (Linux Landlock).

The drill worker runs a user's model factory and reads an untrusted
checkpoint. The safe loader keeps checkpoint code from running; this is the
second wall: the operating system refuses every write outside the worker's
scratch directory, whatever runs in it.

Run as a launcher, so that the process is confined before it runs anything
else (Landlock confines the calling thread and what it starts; torch starts
threads when imported)::

    python -m ckptier.tasks.confine --write DIR [--write DIR...] [--status-fd N] -- CMD ARGS...

confines itself, writes a :class:`Confinement` as JSON to file descriptor
``N`` (written before any of CMD runs, so CMD cannot forge it) and replaces
itself with CMD. Landlock domains survive ``execve`` and are inherited by
every child. Reads, execution and network access are left alone: torch, the
user's model module and the checkpoint stay readable.

Where Landlock is missing (not Linux, a kernel before 5.13 or without
Landlock enabled, a seccomp filter refusing the calls) CMD still runs,
unconfined, and the status says why.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

# Landlock system calls have the same numbers on every architecture Linux
# added them to after the syscall-table unification (x86_64, arm64, riscv...).
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
_O_PATH = getattr(os, "O_PATH", 0o10000000)

# Filesystem access rights (linux/landlock.h).
FS_WRITE_FILE = 1 << 1
FS_REMOVE_DIR = 1 << 4
FS_REMOVE_FILE = 1 << 5
FS_MAKE_CHAR = 1 << 6
FS_MAKE_DIR = 1 << 7
FS_MAKE_REG = 1 << 8
FS_MAKE_SOCK = 1 << 9
FS_MAKE_FIFO = 1 << 10
FS_MAKE_BLOCK = 1 << 11
FS_MAKE_SYM = 1 << 12
FS_REFER = 1 << 13  # ABI 2: links and renames across directories
FS_TRUNCATE = 1 << 14  # ABI 3

_WRITE_RIGHTS_BY_ABI = {
    1: FS_WRITE_FILE | FS_REMOVE_DIR | FS_REMOVE_FILE | FS_MAKE_CHAR | FS_MAKE_DIR | FS_MAKE_REG
    | FS_MAKE_SOCK | FS_MAKE_FIFO | FS_MAKE_BLOCK | FS_MAKE_SYM,
    2: FS_REFER,
    3: FS_TRUNCATE,
}
"""Every right that changes the filesystem, by the ABI that introduced it.
Reading (READ_FILE, READ_DIR), EXECUTE and device ioctls (ABI 5) are not
handled, so they stay allowed everywhere."""

_FILE_RIGHTS = FS_WRITE_FILE | FS_TRUNCATE
"""The rights a rule on a single file (not a directory) may grant."""

DEVICE_PATHS: tuple[str, ...] = (
    "/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom",
    # GPU drivers open their compute device nodes read-write: NVIDIA (driver 570+ also
    # opens nvidia-uvm-tools), MIG capabilities, AMD's kfd.
    "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-caps", "/dev/kfd",
)
"""Device nodes that stay open for writing (plus /dev/nvidiaN and DRM render
nodes /dev/dri/renderD*, found at run time): writing them changes no file,
and CUDA or ROCm cannot start without them. Display devices are not listed."""

_OWN_TASKS = "/proc/self/task"
"""The process's own thread entries: CUDA's cuInit names its threads by
writing /proc/<pid>/task/<tid>/comm and fails (error 304) when refused.
Only this process's entries; the rest of /proc (sysctls, other processes)
stays read-only."""

_pinned: list[int] = []


@dataclass(frozen=True)
class Confinement:
    """Whether writes are confined, and a one-line ``detail`` saying how or why not."""

    confined: bool
    detail: str
    abi: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Confinement:
        data = json.loads(text)
        return cls(bool(data["confined"]), str(data["detail"]), data.get("abi"))


def unavailable_reason(err: int) -> str:
    """Why Landlock cannot be used, from the ``errno`` of its version query; pure."""
    if err == errno.ENOSYS:
        return ("the kernel has no Landlock system calls (Linux before 5.13, built without "
                "CONFIG_SECURITY_LANDLOCK, or a seccomp filter of the container runtime hides them)")
    if err == errno.EOPNOTSUPP:
        return "Landlock is built into the kernel but not enabled; add landlock to the lsm= kernel boot parameter"
    if err == errno.EPERM:
        return "the kernel refused the Landlock system call (EPERM; a seccomp filter?)"
    return f"the Landlock version query failed: {os.strerror(err)}"


def write_rights(abi: int) -> int:
    """The write rights a ruleset of Landlock ``abi`` can handle; pure."""
    rights = 0
    for since, bits in _WRITE_RIGHTS_BY_ABI.items():
        if abi >= since:
            rights |= bits
    return rights


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.prctl.restype = ctypes.c_int
    return libc


def landlock_abi() -> tuple[int | None, str]:
    """``(abi, "")`` when the kernel offers Landlock, else ``(None, why)``."""
    if not sys.platform.startswith("linux"):
        return None, f"Landlock is Linux-only and this platform is {sys.platform}"
    libc = _libc()
    abi = libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    if abi < 0:
        return None, unavailable_reason(ctypes.get_errno())
    return int(abi), ""


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _device_paths() -> list[str]:
    found = list(DEVICE_PATHS)
    try:
        found += sorted(f"/dev/{n}" for n in os.listdir("/dev") if n.startswith("nvidia") and n[6:].isdigit())
        found += sorted(f"/dev/dri/{n}" for n in os.listdir("/dev/dri") if n.startswith("renderD"))
    except OSError:
        pass
    return found


def _pin_own_tasks() -> str | None:
    """``/proc/<pid>/task`` of this process, held open (across exec, which
    keeps the pid) so that the rule's inode stays the one path look-ups find."""
    try:
        fd = os.open(_OWN_TASKS, _O_PATH)
        os.set_inheritable(fd, True)  # the command exec'd next keeps it open
    except OSError:
        return None
    _pinned.append(fd)
    return f"/proc/{os.getpid()}/task"


def confine_writes(writable: Sequence[str | Path], *, devices: Sequence[str] | None = None) -> Confinement:
    """Confine this process (and what it starts) so that it can change the
    filesystem only beneath ``writable`` (plus writing to ``devices``, by
    default :data:`DEVICE_PATHS`, and to its own ``/proc/<pid>/task``
    entries).

    Irreversible. Never raises: when Landlock is missing or a step fails, the
    process stays unconfined and the result says why. ``writable`` must exist.
    """
    abi, why = landlock_abi()
    if abi is None:
        return Confinement(False, f"writes not confined: {why}")
    libc = _libc()
    handled = write_rights(abi)
    attr = ctypes.c_uint64(handled)  # struct landlock_ruleset_attr, first field only: fine for every ABI
    ruleset = libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(8), ctypes.c_uint32(0))
    if ruleset < 0:
        return Confinement(False, f"writes not confined: Landlock ABI {abi} refused a ruleset: {os.strerror(ctypes.get_errno())}", abi)
    try:
        for path in writable:
            problem = _allow(libc, int(ruleset), str(path), handled, required=True)
            if problem:
                return Confinement(False, f"writes not confined: {problem}", abi)
        for path in _device_paths() if devices is None else devices:
            _allow(libc, int(ruleset), path, handled & _FILE_RIGHTS, required=False)
        own_tasks = _pin_own_tasks()
        if own_tasks is not None:
            _allow(libc, int(ruleset), own_tasks, handled & _FILE_RIGHTS, required=False)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return Confinement(False, f"writes not confined: prctl(NO_NEW_PRIVS) failed: {os.strerror(ctypes.get_errno())}", abi)
        if libc.syscall(_SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            err = ctypes.get_errno()
            hint = " (more than 16 nested Landlock domains)" if err == errno.E2BIG else ""
            return Confinement(False, f"writes not confined: Landlock ABI {abi} refused to restrict the process: {os.strerror(err)}{hint}", abi)
    finally:
        os.close(int(ruleset))
    places = ", ".join(str(p) for p in writable)
    return Confinement(True, f"writes confined by Landlock (ABI {abi}) to {places}", abi)


def _allow(libc: ctypes.CDLL, ruleset: int, path: str, rights: int, *, required: bool) -> str | None:
    try:
        fd = os.open(path, _O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        return f"cannot open {path} for a Landlock rule: {exc.strerror}" if required else None
    try:
        if not os.path.isdir(path):
            rights &= _FILE_RIGHTS
        if not rights:
            return None
        rule = _PathBeneath(rights, fd)
        if libc.syscall(_SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH), ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
            err = os.strerror(ctypes.get_errno())
            return f"Landlock refused the rule for {path}: {err}" if required else None
        return None
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    """``--write DIR... [--status-fd N] -- CMD...``: confine, report, exec CMD."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args:
        print("usage: python -m ckptier.tasks.confine --write DIR [--status-fd N] -- CMD...", file=sys.stderr)
        return 2
    split = args.index("--")
    options, command = args[:split], args[split + 1:]
    writable: list[str] = []
    status_fd: int | None = None
    it = iter(options)
    for opt in it:
        value = next(it, None)
        if value is None or opt not in ("--write", "--status-fd"):
            print(f"confine: bad option {opt!r}", file=sys.stderr)
            return 2
        if opt == "--write":
            writable.append(value)
        else:
            status_fd = int(value)
    if not command:
        print("confine: no command given after --", file=sys.stderr)
        return 2
    result = confine_writes(writable)
    if status_fd is not None:
        with os.fdopen(status_fd, "w") as out:
            out.write(result.to_json())
    os.execvp(command[0], command)
    return 127  # pragma: no cover - execvp does not return


if __name__ == "__main__":
    sys.exit(main())
