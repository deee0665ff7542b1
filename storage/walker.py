"""The directory walk behind :meth:`ckptier.storage.local.LocalStore.list`,
shared by the listing process and a helper process that walks big trees.

Stdlib only, no package-relative imports: ``python -I -S walker.py`` runs
this file as the helper (see :func:`main`), which starts in milliseconds.
Why a process and not a thread: the walk is one ``stat`` per file (most of
its time in the kernel) plus a few microseconds of Python per entry; in a
thread that Python waits for the GIL behind format recognition, so the two
ran one after the other (measured: no gain). In a process of its own the
walk runs on the second core while the listing process recognises what it
has already received.

The helper reads one request from stdin (``marshal``: the directories still
to walk, the key prefix, the temporary-file prefix, the directory keys it
must not enter but hand back) and writes frames to stdout: a 4-byte
little-endian length, then a ``marshal``-ed list of ``(rel, records,
facts)`` batches as :func:`walk_dirs` yields them, an ``("error", errno, strerror,
rel)`` tuple for a directory that cannot be read, or ``("end",)``.
``marshal`` is used only between two processes of this package, over a
private pipe.
"""

from __future__ import annotations

import errno
import gc
import marshal
import os
import stat
import struct
import sys
from collections.abc import Callable, Generator
from typing import Any

#: Record kinds in a directory's batch (see :func:`walk_dirs`).
FILE, LINK, SKIPPED, DEFER = 0, 1, 2, 3

#: How a directory is opened to be read (its entries are then read relative to it).
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)

#: Frames are flushed to the pipe once they hold this many records.
FRAME_RECORDS = 4096

#: A record: ``(FILE|LINK, name, size, mtime)``, ``(SKIPPED, name, reason)``
#: or ``(DEFER, name, path)``.
Record = tuple[Any, ...]

#: What the walk saw of a directory it read: ``(mtime_ns, entries, subdirs,
#: token)``: its mtime, from a ``stat`` taken just before reading it; the
#: number of its entries (every one, as ``os.listdir`` counts them); the
#: names of its subdirectories (not symlinks to directories), entered or not;
#: and its :func:`dir_token`.
DirFacts = tuple[int, int, list[str], str]


def dir_token(rel: str, mtime_ns: int, nlink: int) -> str:
    """The part of a directory stamp that one directory contributes: its key
    (``rel``, with a trailing ``/``; ``""`` for the root), mtime and link
    count. Made here by the walk (in the helper processes, for a big tree)
    and by a stamp read from the tree, which must agree to the byte."""
    return f"{rel}\0{mtime_ns}\0{nlink}"


class WalkError(Exception):
    """An entry of the walk could not be read: ``rel`` is its key (a
    directory's with a trailing ``/``, ``""`` for the start), ``error`` the
    ``OSError``."""

    def __init__(self, rel: str, error: OSError) -> None:
        super().__init__(f"{rel or '.'}: {error}")
        self.rel = rel
        self.error = error


def symlink_problem(path: str) -> str | None:
    """Why the symlink at ``path`` is not listed, or None when it leads to a regular file."""
    try:
        st = os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "symlink loop (too many levels of symbolic links): not followed"
        if isinstance(exc, FileNotFoundError):
            return "dangling symlink (its target does not exist): not followed"
        return f"symlink that cannot be resolved ({exc.strerror or exc}): not followed"
    if stat.S_ISDIR(st.st_mode):
        return "symlink to a directory: not followed (scan the directory itself)"
    if not stat.S_ISREG(st.st_mode):
        return "symlink to something that is not a file: not followed"
    return None


def walk_dirs(
    stack: list[tuple[str, str]],
    prefix: str,
    temp_prefix: str,
    enter: Callable[[str], bool | None],
) -> Generator[tuple[str, list[Record], DirFacts], None, None]:
    """Walk depth-first from ``stack`` (``(path, rel)`` pairs, ``rel`` the
    directory's key with a trailing ``/`` or ``""``; popped from the end,
    subdirectories pushed as found), yielding ``(rel, records, facts)`` for
    each directory read (``facts``: :data:`DirFacts`), its entries in
    ``scandir`` order:

    * ``(FILE, name, size, mtime)``: a regular file (``lstat``);
    * ``(LINK, name, size, mtime)``: a symlink to a regular file (its target's ``stat``);
    * ``(SKIPPED, name, reason)``: any other symlink (loop, dangling, to a directory...);
    * ``(DEFER, name, path)``: a subdirectory ``enter(key)`` returned None for
      (the caller decides, and walks it itself if it wants it).

    Only entries whose key starts with ``prefix`` are recorded (and only
    directories on the way to it entered); names starting with
    ``temp_prefix`` are left out. A directory ``enter`` returns False for is
    not entered. Directories and files that vanish while walking are left
    out; any other error reading a directory or a file's status raises
    :class:`WalkError`.
    ``stack`` is left holding exactly the directories not yet read, so a
    caller may stop after any batch and go on elsewhere.
    """
    while stack:
        path, rel = stack.pop()
        try:
            fd = os.open(path, _DIR_FLAGS)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise WalkError(rel, exc) from exc
        try:
            read = _read_dir(fd, path, rel, stack, prefix, temp_prefix, enter)
        finally:
            os.close(fd)
        yield read


def _read_dir(
    fd: int,
    path: str,
    rel: str,
    stack: list[tuple[str, str]],
    prefix: str,
    temp_prefix: str,
    enter: Callable[[str], bool | None],
) -> tuple[str, list[Record], DirFacts]:
    """One directory of :func:`walk_dirs`, open as ``fd``: its batch, its
    subdirectories to enter pushed on ``stack``.

    Read through the descriptor: the directory whose entries are read is the
    one whose status is taken, and each entry's ``lstat`` is relative to it
    (``scandir`` keeps using ``fd``, which must stay open until this returns).
    The status is taken before the entries are read: an entry added while
    they are read moves the mtime past it, so a stamp made of these facts no
    longer matches the directory.
    """
    try:
        st = os.fstat(fd)
        entries = os.scandir(fd)
    except OSError as exc:
        raise WalkError(rel, exc) from exc
    records: list[Record] = []
    subdirs: list[str] = []
    count = 0
    everything = not prefix  # every key starts with "": no key to build for a file
    with entries:
        for entry in entries:
            count += 1
            name = entry.name
            if name.startswith(temp_prefix):
                continue
            if entry.is_dir(follow_symlinks=False):
                subdirs.append(name)
                key = rel + name
                if everything or key.startswith(prefix) or prefix.startswith(key + "/"):
                    go = enter(key)
                    if go:
                        stack.append((f"{path}/{name}", key + "/"))
                    elif go is None:
                        records.append((DEFER, name, f"{path}/{name}"))
                continue
            if not everything and not (rel + name).startswith(prefix):
                continue
            if entry.is_file(follow_symlinks=False):  # the common case first: a regular file
                try:
                    fst = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # deleted while listing
                except OSError as exc:
                    raise WalkError(rel + name, exc) from exc
                records.append((FILE, name, fst.st_size, fst.st_mtime))
            elif entry.is_symlink():
                why = symlink_problem(f"{path}/{name}")
                if why is None:
                    try:
                        fst = entry.stat()
                    except FileNotFoundError:
                        continue  # deleted while listing
                    except OSError as exc:
                        raise WalkError(rel + name, exc) from exc
                    records.append((LINK, name, fst.st_size, fst.st_mtime))
                else:
                    records.append((SKIPPED, name, why))
    mtime_ns = st.st_mtime_ns
    return rel, records, (mtime_ns, count, subdirs, dir_token(rel, mtime_ns, st.st_nlink))


def _write_frame(out: Any, obj: Any) -> None:
    data = marshal.dumps(obj)
    out.write(struct.pack("<I", len(data)))
    out.write(data)


def main() -> int:
    """The helper process: one request on stdin, frames on stdout (module docstring)."""
    gc.disable()  # the walk makes no cycles; collections would only cost time
    stack, prefix, temp_prefix, deferred = marshal.loads(sys.stdin.buffer.read())
    deferred = frozenset(deferred)
    out = sys.stdout.buffer
    try:
        import fcntl

        fcntl.fcntl(out.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (ImportError, OSError):
        pass  # a bigger pipe only smooths the flow

    def enter(key: str) -> bool | None:
        return None if key in deferred else True

    batch: list[tuple[str, list[Record], DirFacts]] = []
    pending = 0
    try:
        for batched in walk_dirs(stack, prefix, temp_prefix, enter):
            batch.append(batched)
            pending += len(batched[1]) + 1
            if pending >= FRAME_RECORDS:
                _write_frame(out, batch)
                out.flush()
                batch, pending = [], 0
        if batch:
            _write_frame(out, batch)
        _write_frame(out, ("end",))
    except WalkError as failed:
        if batch:
            _write_frame(out, batch)
        _write_frame(out, ("error", failed.error.errno, failed.error.strerror, failed.rel))
    except BrokenPipeError:
        return 0  # the listing stopped reading: nothing left to say
    out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
