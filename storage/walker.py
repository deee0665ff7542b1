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
must not enter but hand back, the scanned root, the directory stamps it
checks itself and the small files it reads ahead, see :func:`walk_dirs`)
and writes frames to stdout: a 4-byte
little-endian length, then a ``marshal``-ed list of ``(rel, records,
facts)`` batches as :func:`walk_dirs` yields them, an ``("error", errno, strerror,
rel)`` tuple for a directory that cannot be read, or ``("end",)``.
``marshal`` is used only between two processes of this package, over a
private pipe.

Nothing here follows a symlink, the discipline of ``rm -r``'s fts: every
directory is opened with ``O_NOFOLLOW``, and its identity (``st_dev``,
``st_ino``) is compared with what its parent's listing saw of it (an
``lstat`` relative to the parent's open descriptor), so a directory swapped
for a symlink, or a parent swapped while the walk was elsewhere, is never
entered. A symlink is reported as what it is: a link to a regular file
inside the scanned root is listed with the key it points at (and that
file's size and mtime, from an ``fstatat`` below the root reached without
following any link); anything else (outside the root, dangling, a loop, a
chain of links, a directory) is skipped with its reason.
:func:`open_below`, :func:`stat_below` and :func:`resolve_link` are the
primitives the local store builds its reads, writes and deletes on.
"""

from __future__ import annotations

import errno
import gc
import hashlib
import marshal
import os
import stat
import struct
import sys
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Any

#: Record kinds in a directory's batch (see :func:`walk_dirs`).
FILE, LINK, SKIPPED, DEFER, UNCHANGED, DATA = 0, 1, 2, 3, 4, 5

#: How a file the walk reads ahead is opened: never through a symlink, never
#: blocking (a FIFO swapped in), its type checked on the open descriptor.
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)

#: How a directory is opened (its entries are then read relative to it): never through a symlink.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)

#: ``(st_dev, st_ino)`` of a directory, as its parent's listing saw it (``None``: not known).
Ident = tuple[int, int]

#: The scanned root as the walk needs it: its path, its :data:`Ident`, and the
#: absolute spellings of its path an absolute symlink may use (the path as given,
#: and with its own symlinks resolved).
Root = tuple[str, int, int, tuple[str, ...]]

#: Frames are flushed to the pipe once they hold this many records.
FRAME_RECORDS = 4096

#: A record: ``(FILE, name, size, mtime)``, ``(DATA, name, size, mtime, data)``,
#: ``(LINK, name, size, mtime, target)``, ``(SKIPPED, name, reason)``,
#: ``(DEFER, name, path, ident)`` or ``(UNCHANGED, name)``.
Record = tuple[Any, ...]

#: The stamps a walk checks itself: a directory's key (no trailing ``/``) ->
#: ``(stamp, dirs)`` as :func:`tree_stamp` makes them.
Stamps = dict[str, tuple[str, tuple[str, ...]]]

#: The files a walk reads ahead: their names, and the most bytes read of one.
Reads = tuple[frozenset[str], int]

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


def stamp_token(key: str, d: str, st: os.stat_result) -> str:
    """The :func:`dir_token` of the directory ``d`` (relative to ``key``, ``""``
    for ``key`` itself; ``key`` without a trailing ``/``, ``""`` for the root)
    from its ``lstat``: one definition, so that taking a stamp and checking it
    name each directory alike."""
    top = key + "/" if key else ""
    return dir_token(f"{top}{d}/" if d else top, st.st_mtime_ns, st.st_nlink)


def digest(entries: int, tokens: Iterable[str]) -> str:
    """The stamp of a tree: the top directory's number of entries, then the
    :func:`dir_token` of each of its directories, sorted (whatever order
    they come in)."""
    text = "\0".join([str(entries), *sorted(tokens)])
    return hashlib.sha1(text.encode("utf-8", "surrogateescape"), usedforsecurity=False).hexdigest()


def tree_stamp(fd: int, key: str, dirs: Sequence[str]) -> str | None:
    """The stamp the directory ``key`` (no trailing ``/``; ``""`` for the
    root), open as ``fd``, and its subdirectories ``dirs`` (relative to it,
    ``""`` for itself) have now; None when one of them is gone or is not a
    directory.

    One ``fstat`` of ``fd``, one ``fstatat(AT_SYMLINK_NOFOLLOW)`` relative to
    ``fd`` per subdirectory (a deeper one reached through :func:`open_below`,
    never through a link), and one read of ``fd``'s entries for their
    number. Shared by :meth:`~ckptier.storage.local.LocalStore.check_stamp`
    and a walk that checks stamps itself (:func:`walk_dirs`), so both give
    the same stamp to the byte."""
    tokens: list[str] = []
    try:
        for d in dirs:
            if not d:
                st = os.fstat(fd)
            elif "/" in d:
                st = stat_below(fd, d)
            else:
                st = os.stat(d, dir_fd=fd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                return None
            tokens.append(stamp_token(key, d, st))
        entries = len(os.listdir(fd))
    except OSError:
        return None
    return digest(entries, tokens)


class WalkError(Exception):
    """An entry of the walk could not be read: ``rel`` is its key (a
    directory's with a trailing ``/``, ``""`` for the start), ``error`` the
    ``OSError``."""

    def __init__(self, rel: str, error: OSError) -> None:
        super().__init__(f"{rel or '.'}: {error}")
        self.rel = rel
        self.error = error


def open_below(top: int, parts: Sequence[str]) -> int:
    """A new descriptor of the directory ``top/parts[0]/parts[1]/...``, each
    component opened relative to the one before with ``O_NOFOLLOW``: a
    symlink anywhere on the way raises ``OSError`` (``ELOOP``, or
    ``ENOTDIR`` for something that is not a directory), as does a missing
    component (``ENOENT``). The caller closes it."""
    fd = os.open(".", DIR_FLAGS, dir_fd=top)
    try:
        for part in parts:
            inner = os.open(part, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def stat_below(top: int, key: str) -> os.stat_result:
    """The ``lstat`` of ``key`` (``/``-separated, relative to the directory
    ``top``), reached without following any symlink (:func:`open_below`)."""
    head, _, name = key.rpartition("/")
    if not head:
        return os.stat(name, dir_fd=top, follow_symlinks=False)
    fd = open_below(top, head.split("/"))
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    finally:
        os.close(fd)


def resolve_link(key: str, target: str, roots: Sequence[str], is_dir: Callable[[str], bool]) -> str | None:
    """The key inside the scanned root that the symlink at ``key`` (whose
    text is ``target``) names, or None when it names something outside
    the root (or the root itself, or nothing).

    Resolved by its text, as the kernel would walk it, without following
    anything: a relative ``target`` from the link's own directory, an
    absolute one only below one of ``roots`` (the root's absolute
    spellings). A component that a later ``..`` takes back must be a real
    directory (``is_dir(key)``, checked without following): through a
    symlinked one, the kernel's ``..`` goes elsewhere.
    """
    if not target or "\x00" in target:
        return None
    if target.startswith("/"):
        clean = target.rstrip("/")
        for root in roots:
            if clean.startswith(root.rstrip("/") + "/"):
                parts: list[str] = []
                todo = clean[len(root.rstrip("/")) + 1:].split("/")
                break
        else:
            return None
    else:
        parts = key.split("/")[:-1]  # the link's directory: real directories, the walk came through them
        todo = target.split("/")
    fixed = len(parts)
    for part in todo:
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                return None  # above the root
            if len(parts) > fixed and not is_dir("/".join(parts)):
                return None
            parts.pop()
            fixed = min(fixed, len(parts))
        else:
            parts.append(part)
    return "/".join(parts) or None


def link_record(root: Root, root_fd: int, name: str, key: str, target: str) -> Record:
    """The record of the symlink ``name`` at ``key`` whose text is ``target``:
    a :data:`LINK` to a regular file inside ``root`` (open as ``root_fd``),
    or :data:`SKIPPED` with why not."""
    shown = target if len(target) <= 200 else target[:200] + "..."

    def is_dir(k: str) -> bool:
        try:
            return stat.S_ISDIR(stat_below(root_fd, k).st_mode)
        except OSError:
            return False

    resolved = resolve_link(key, target, root[3], is_dir)
    if resolved is None:
        return (SKIPPED, name, f"symlink to {shown!r}, outside the scanned root: not followed")
    if resolved == key:
        return (SKIPPED, name, "symlink loop (a link to itself): not followed")
    try:
        st = stat_below(root_fd, resolved)
    except FileNotFoundError:
        return (SKIPPED, name, f"dangling symlink (its target {shown!r} does not exist): not followed")
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            return (SKIPPED, name, f"symlink to {shown!r}, through a symlink or a file: not followed")
        return (SKIPPED, name, f"symlink that cannot be resolved ({exc.strerror or exc}): not followed")
    if stat.S_ISLNK(st.st_mode):
        return (SKIPPED, name, f"symlink to a symlink ({resolved}), a chain or a loop: not followed")
    if stat.S_ISDIR(st.st_mode):
        return (SKIPPED, name, "symlink to a directory: not followed (scan the directory itself)")
    if not stat.S_ISREG(st.st_mode):
        return (SKIPPED, name, "symlink to something that is not a file: not followed")
    return (LINK, name, st.st_size, st.st_mtime, resolved)


def walk_dirs(
    stack: list[tuple[str, str, Ident | None]],
    prefix: str,
    temp_prefix: str,
    enter: Callable[[str], bool | None],
    root: Root,
    stamps: Stamps | None = None,
    reads: Reads | None = None,
) -> Generator[tuple[str, list[Record], DirFacts], None, None]:
    """Walk depth-first from ``stack`` (``(path, rel, ident)`` triples, ``rel``
    the directory's key with a trailing ``/`` or ``""``, ``ident`` what its
    parent's listing saw of it; popped from the end, subdirectories pushed as
    found), yielding ``(rel, records, facts)`` for each directory read
    (``facts``: :data:`DirFacts`), its entries in ``scandir`` order:

    * ``(FILE, name, size, mtime)``: a regular file (``lstat``);
    * ``(LINK, name, size, mtime, target)``: a symlink to a regular file
      inside ``root``: ``target`` is that file's key, the size and mtime
      its own (see :func:`link_record`);
    * ``(SKIPPED, name, reason)``: any other symlink (outside the root,
      loop, dangling, chain, to a directory...);
    * ``(DEFER, name, path, ident)``: a subdirectory ``enter(key)`` returned
      None for (the caller decides, and walks it itself if it wants it);
    * ``(UNCHANGED, name)``: a subdirectory whose key is in ``stamps`` and
      whose stamp now (:func:`tree_stamp`, relative to this directory's
      descriptor, the subdirectory opened with ``O_NOFOLLOW``) is the one
      given: not entered, ``enter`` not asked. A subdirectory of ``stamps``
      whose stamp differs (or cannot be taken) is entered, ``enter`` not
      asked either;
    * ``(DATA, name, size, mtime, data)``: a regular file named in
      ``reads`` (``(names, limit)``) of 1 to ``limit`` bytes, read here
      (opened relative to this directory with ``O_NOFOLLOW|O_NONBLOCK``, its
      type checked on the open descriptor): ``data``, its bytes. A file that
      cannot be read so, is no longer a regular file, or now holds more than
      ``limit`` bytes is a plain ``FILE`` record (its reader reads it later,
      and meets what stopped this read).

    Each directory is opened with ``O_NOFOLLOW`` and entered only when it is
    still the directory its parent listed (same ``ident``): one replaced
    since by a symlink, or reached through a parent replaced by one, is left
    out as a directory that vanished is (and logged by the caller's
    listing as nothing: a rescan sees what is there).

    Only entries whose key starts with ``prefix`` are recorded (and only
    directories on the way to it entered); names starting with
    ``temp_prefix`` are left out. A directory ``enter`` returns False for is
    not entered. Directories and files that vanish while walking are left
    out; any other error reading a directory or a file's status raises
    :class:`WalkError`.
    ``stack`` is left holding exactly the directories not yet read, so a
    caller may stop after any batch and go on elsewhere.
    """
    opened: list[int] = []

    def root_fd() -> int:
        """The root, opened once for the links of this walk (and checked to be the root listed)."""
        if not opened:
            try:
                fd = os.open(root[0], DIR_FLAGS)
            except OSError as exc:
                raise WalkError("", exc) from exc
            st = os.fstat(fd)
            opened.append(fd)
            if (st.st_dev, st.st_ino) != (root[1], root[2]):
                raise WalkError("", OSError(errno.ESTALE, "the scanned root was replaced while it was listed"))
        return opened[0]

    try:
        while stack:
            path, rel, ident = stack.pop()
            try:
                fd = os.open(path, DIR_FLAGS)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    continue  # replaced by a symlink since its parent was read: never entered
                raise WalkError(rel, exc) from exc
            try:
                read = _read_dir(fd, path, rel, ident, stack, prefix, temp_prefix, enter, root, root_fd, stamps,
                                 reads)
            finally:
                os.close(fd)
            if read is not None:
                yield read
    finally:
        for fd in opened:
            os.close(fd)


def _read_dir(
    fd: int,
    path: str,
    rel: str,
    ident: Ident | None,
    stack: list[tuple[str, str, Ident | None]],
    prefix: str,
    temp_prefix: str,
    enter: Callable[[str], bool | None],
    root: Root,
    root_fd: Callable[[], int],
    stamps: Stamps | None = None,
    reads: Reads | None = None,
) -> tuple[str, list[Record], DirFacts] | None:
    """One directory of :func:`walk_dirs`, open as ``fd``: its batch, its
    subdirectories to enter pushed on ``stack``; None when the directory
    open is not the one its parent listed (``ident``).

    Read through the descriptor: the directory whose entries are read is the
    one whose status is taken, and each entry's ``lstat`` is relative to it
    (``scandir`` keeps using ``fd``, which must stay open until this returns).
    The status is taken before the entries are read: an entry added while
    they are read moves the mtime past it, so a stamp made of these facts no
    longer matches the directory.
    """
    try:
        st = os.fstat(fd)
        if ident is not None and (st.st_dev, st.st_ino) != ident:
            return None  # a path swapped under the walk: not the directory that was listed
        entries = os.scandir(fd)
    except OSError as exc:
        raise WalkError(rel, exc) from exc
    records: list[Record] = []
    subdirs: list[str] = []
    count = 0
    everything = not prefix  # every key starts with "": no key to build for a file
    read_names, read_limit = reads if reads is not None else (frozenset(), 0)
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
                    stamped = stamps.get(key) if stamps else None
                    if stamped is not None:
                        if _stamp_holds(fd, name, key, stamped):
                            records.append((UNCHANGED, name))
                            continue
                        go: bool | None = True
                    else:
                        go = enter(key)
                    if go or go is None:
                        try:
                            dst = entry.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue  # deleted while listing
                        except OSError as exc:
                            raise WalkError(key + "/", exc) from exc
                        if not stat.S_ISDIR(dst.st_mode):
                            continue  # swapped since readdir said it was a directory
                        sub = (dst.st_dev, dst.st_ino)
                        if go:
                            stack.append((f"{path}/{name}", key + "/", sub))
                        else:
                            records.append((DEFER, name, f"{path}/{name}", sub))
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
                size = fst.st_size
                if name in read_names and 0 < size <= read_limit:
                    data = _read_small(fd, name, read_limit)
                    if data is not None:
                        records.append((DATA, name, size, fst.st_mtime, data))
                        continue
                records.append((FILE, name, size, fst.st_mtime))
            elif entry.is_symlink():
                try:
                    target = os.readlink(name, dir_fd=fd)
                except FileNotFoundError:
                    continue  # deleted while listing
                except OSError as exc:
                    if exc.errno == errno.EINVAL:
                        continue  # no longer a symlink: replaced while listing, the next scan sees it
                    raise WalkError(rel + name, exc) from exc
                records.append(link_record(root, root_fd(), name, rel + name, target))
    mtime_ns = st.st_mtime_ns
    return rel, records, (mtime_ns, count, subdirs, dir_token(rel, mtime_ns, st.st_nlink))


def _stamp_holds(fd: int, name: str, key: str, stamped: tuple[str, tuple[str, ...]]) -> bool:
    """Whether the subdirectory ``name`` (key ``key``) of the directory open as
    ``fd`` still has the stamp ``stamped`` (``(stamp, dirs)``), opened
    relative to ``fd`` with ``O_NOFOLLOW`` (a symlink there: it does not)."""
    try:
        sub = os.open(name, DIR_FLAGS, dir_fd=fd)
    except OSError:
        return False
    try:
        return tree_stamp(sub, key, stamped[1]) == stamped[0]
    finally:
        os.close(sub)


def _read_small(fd: int, name: str, limit: int) -> bytes | None:
    """The bytes of the regular file ``name`` in the directory open as ``fd``
    (opened with ``O_NOFOLLOW|O_NONBLOCK``, its type checked on the open
    descriptor), or None when it cannot be read so or holds more than
    ``limit`` bytes."""
    try:
        rfd = os.open(name, READ_FLAGS, dir_fd=fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(rfd).st_mode):
            return None
        chunks: list[bytes] = []
        got = 0
        while got <= limit:
            chunk = os.read(rfd, limit + 1 - got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError:
        return None
    finally:
        os.close(rfd)
    return None if got > limit else b"".join(chunks)


def _write_frame(out: Any, obj: Any) -> None:
    data = marshal.dumps(obj)
    out.write(struct.pack("<I", len(data)))
    out.write(data)


def main() -> int:
    """The helper process: one request on stdin, frames on stdout (module docstring)."""
    gc.disable()  # the walk makes no cycles; collections would only cost time
    stack, prefix, temp_prefix, deferred, root, stamps, reads = marshal.loads(sys.stdin.buffer.read())
    deferred = frozenset(deferred)
    if reads is not None:
        reads = (frozenset(reads[0]), reads[1])
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
        for batched in walk_dirs(stack, prefix, temp_prefix, enter, root, stamps, reads):
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
