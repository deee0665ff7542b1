"""A store over a local or POSIX-mounted directory.

Every operation works relative to a descriptor of the root, opened with
``O_NOFOLLOW``, and opens each directory on the way to a key with
``O_NOFOLLOW`` relative to the one before (``openat``), then acts on the last
name relative to its directory (``fstatat(AT_SYMLINK_NOFOLLOW)``,
``openat(O_NOFOLLOW)``, ``unlinkat``, ``renameat``), the discipline of
``rm -r``'s fts: no symlink is ever followed, so nothing outside the root is
read, written or deleted whatever is swapped in the tree, and at any moment.
A symlink is an object of its own (:attr:`~.base.ObjectInfo.link`): one to a
regular file inside the root is read by the key it points at, never through
the link; any other one is not an object at all.
"""

from __future__ import annotations

import builtins
import errno
import logging
import os
import marshal
import secrets
import selectors
import stat
import struct
import subprocess
import sys
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from . import walker
from .base import DeleteResult, ObjectInfo, WalkedDirs, as_stream, key_problem, listed_file, validate_key
from .errors import (
    AlreadyExists,
    InvalidKey,
    NotFollowed,
    NotFound,
    StoreError,
    Unavailable,
    environment_fault,
)
from .walker import (
    DATA,
    DIR_FLAGS,
    FILE,
    LINK,
    SKIPPED,
    UNCHANGED,
    DirFacts,
    Ident,
    Reads,
    Record,
    Root,
    Stamps,
    WalkError,
    digest,
    link_record,
    open_below,
    stamp_token,
    stat_below,
    tree_stamp,
    walk_dirs,
)

log = logging.getLogger(__name__)

#: Prefix of the temporary files ``write`` creates beside their target.
TEMP_PREFIX = ".ckptier-tmp-"
#: Files :meth:`LocalStore.list` lists itself before a helper process walks the
#: rest (starting one costs ~20 ms, as much as listing ~3,000 files here).
HANDOFF_FILES = 5_000
#: Helper processes a big tree is shared among (round robin over the
#: directories left when the walk is handed off): two, one per core here, as
#: the listing process itself mostly waits for them while they walk.
HELPERS = 2
#: Directories per helper :meth:`LocalStore.list` wants left to share before it
#: hands off (it reads the shallowest ones itself until there are, listing at
#: most 4 x :data:`HANDOFF_FILES` files here).
SPREAD = 64


def file_mode() -> int:
    """Mode for new files: 0o666 less the process umask (``mkstemp`` alone gives 0o600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _translate(exc: OSError, url: str, key: str | None, *, doing: str = "") -> StoreError:
    """``exc`` as the storage error it means for ``key``: ``NotFound`` (also for
    a symlink or a file where a directory was on the way: nothing is followed),
    ``Unavailable`` for a mount that stopped answering, an
    :class:`~.errors.EnvironmentFault` naming the path and the fix for what the
    machine refused (no space, read-only, permissions, ...), else ``StoreError``."""
    where = f"{url}/{key}" if key else url
    if isinstance(exc, FileNotFoundError) and not doing:
        return NotFound(f"{where}: no such file or directory", url=url, key=key)
    if exc.errno in (errno.ENOTDIR, errno.ELOOP):
        return NotFollowed(f"{where}: a symlink (or a file) on the way, where a directory should be: not "
                           "followed", url=url, key=key)
    if exc.errno in (errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN):
        return Unavailable(f"{where}: {exc.strerror} (I/O error; retry or check the mount)", url=url, key=key)
    fault = environment_fault(exc, _local(url, key), doing=doing)
    if fault is not None:
        fault.url, fault.key = url, key
        if fault.errno == errno.EIO:
            return Unavailable(str(fault), url=url, key=key)
        return fault
    return StoreError(f"{where}: {exc.strerror or exc}", url=url, key=key)


def _local(url: str, key: str | None) -> str:
    """The local path of ``key`` under the root ``url`` (a ``file://`` URL), for messages."""
    from urllib.parse import unquote, urlparse

    root = unquote(urlparse(url).path)
    return f"{root.rstrip('/')}/{key}" if key else root


def identity_of(st: os.stat_result, link_text: str | None = None) -> str:
    """The :attr:`~.base.ObjectInfo.identity` of the name whose ``lstat`` is
    ``st``: a regular file's device, inode, size and mtime (ns); a symlink's
    device, inode and text (retargeting a link makes a new inode anyway)."""
    if link_text is not None:
        return f"link:{st.st_dev}:{st.st_ino}:{link_text}"
    return f"file:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def _describe(st: os.stat_result) -> str:
    """What the ``lstat`` ``st`` shows, for a "not the object proven" reason."""
    if stat.S_ISLNK(st.st_mode):
        return "now a symlink"
    if not stat.S_ISREG(st.st_mode):
        return f"now {_file_kind(st.st_mode)}"
    return f"now {st.st_size} bytes, inode {st.st_ino}, mtime_ns {st.st_mtime_ns}"


class _Dirs:
    """The directories of one operation, each opened once with ``O_NOFOLLOW``
    relative to its parent, from the root down (:func:`.walker.open_below`,
    one component at a time); closed together at the end."""

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd
        self._fds: dict[str, int] = {"": root_fd}

    def get(self, rel: str, *, create: bool = False) -> int:
        """The descriptor of directory ``rel`` (``""``: the root). ``create``
        makes the missing ones (``mkdirat``, mode 0o777 less the umask).
        Raises ``OSError`` (``ELOOP``/``ENOTDIR`` for a symlink or a file on the way)."""
        fd = self._fds.get(rel)
        if fd is not None:
            return fd
        head, _, name = rel.rpartition("/")
        parent = self.get(head, create=create)
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise
            try:
                os.mkdir(name, 0o777, dir_fd=parent)
            except FileExistsError:
                pass  # made meanwhile (by another writer): opened below, as any directory
            fd = os.open(name, DIR_FLAGS, dir_fd=parent)
        self._fds[rel] = fd
        return fd

    def forget(self, rel: str) -> None:
        """Close ``rel``'s descriptor (it was removed)."""
        fd = self._fds.pop(rel, None)
        if fd is not None and rel:
            os.close(fd)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()



class _Hooks:
    """What a listing's ``skip_dir`` may ask of the walk besides skipping
    (read from its attributes; a plain callable asks nothing more):

    * ``stamps``: a ``dict`` of directory key (no trailing ``/``) ->
      ``(stamp, dirs)`` (:func:`.walker.tree_stamp`'s), which the walk (here
      or in a helper) checks itself, relative to the open parent directory,
      instead of asking ``skip_dir``: an unchanged one is not entered and
      ``skip_dir.stamp_unchanged(key)`` is told; any other is entered. Its keys
      are left out of what a helper hands back for ``skip_dir`` to decide.
    * ``reads``: ``(names, limit)``: regular files of those names of 1 to
      ``limit`` bytes are read by the walk as it lists them
      (:func:`.walker.walk_dirs`, ``DATA``), and
      ``skip_dir.read_ahead(key, data)`` is handed each file's bytes before
      its object is yielded. What cannot be read so is listed as any file.
    """

    __slots__ = ("stamps", "reads", "unchanged", "read_ahead")

    def __init__(self, skip_dir: Callable[[str], bool] | None) -> None:
        self.stamps: Stamps | None = getattr(skip_dir, "stamps", None)
        self.unchanged: Callable[[str], None] = getattr(skip_dir, "stamp_unchanged", None) or _nothing
        if self.stamps is not None and self.unchanged is _nothing:
            self.stamps = None  # nobody to tell: skip_dir decides, as without stamps
        reads = getattr(skip_dir, "reads", None)
        self.read_ahead: Callable[[str, bytes], None] = getattr(skip_dir, "read_ahead", None) or _nothing
        self.reads: Reads | None = (
            None if reads is None or self.read_ahead is _nothing else (frozenset(reads[0]), int(reads[1]))
        )


def _nothing(*_: object) -> None:
    """No hook: nothing to tell."""


def _file_kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a file"


class _SourceFailed(Exception):
    """Carries an error raised by the caller's data stream past the OSError translation."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _copy(src: BinaryIO, out: BinaryIO, chunk_size: int = 8 << 20) -> None:
    """Copy ``src`` to EOF (a short read is not EOF; only an empty one is).

    Errors raised by ``src`` are the caller's, not the store's: they leave
    wrapped in :class:`_SourceFailed` so ``write`` re-raises them unchanged.
    """
    while True:
        try:
            chunk = src.read(chunk_size)
        except Exception as exc:
            raise _SourceFailed(exc) from exc
        if not chunk:
            return
        out.write(chunk)


def _frames(buf: bytearray) -> tuple[builtins.list[Any], int]:
    """The complete frames at the start of ``buf`` (see :mod:`.walker`) and the bytes they took."""
    frames: builtins.list[Any] = []
    at = 0
    while len(buf) - at >= 4:
        (size,) = struct.unpack_from("<I", buf, at)
        if len(buf) - at - 4 < size:
            break
        frames.append(marshal.loads(bytes(buf[at + 4 : at + 4 + size])))
        at += 4 + size
    return frames, at


class LocalStore:
    """Objects are files below ``root``; keys are their relative paths.

    Writes go to a temporary file in the target directory, are fsynced and
    renamed into place, so readers never see a partial file. ``if_absent``
    uses ``link()``, which fails atomically when the target exists.
    Temporary files (``.ckptier-tmp-*``) are skipped by ``list``.

    Capabilities (:mod:`.base`): :class:`~.base.LocalPaths`,
    :class:`~.base.ListingSkips`, :class:`~.base.TempFiles`,
    :class:`~.base.DirectoryStamps`.
    """

    #: Files :meth:`list` lists in this process before handing the rest of a
    #: big tree to a helper process (small trees never start one).
    handoff_files = HANDOFF_FILES

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()
        self.url = self.root.as_uri()

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        return self.root / validate_key(key)

    def _info(self, key: str, st: os.stat_result, *, link: str | None = None, text: str | None = None,
              target: os.stat_result | None = None) -> ObjectInfo:
        """The info of ``key`` from its ``lstat`` ``st``; for a link, the file it
        points at (``link``, its ``lstat`` ``target``) gives size and mtime."""
        shown = target if target is not None else st
        return ObjectInfo(key=key, size=shown.st_size, mtime=shown.st_mtime, etag=None, link=link,
                          identity=identity_of(st, text))

    def _open_root(self) -> int:
        """The root, opened with ``O_NOFOLLOW``: ``NotFound`` when it does not exist,
        ``StoreError`` when it is a symlink (ckptier never follows one)."""
        try:
            return os.open(self.root, DIR_FLAGS)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise StoreError(f"{self.url}: the root is a symlink (to {os.path.realpath(self.root)}); ckptier "
                                 "never follows one: use the directory it points to", url=self.url) from exc
            if isinstance(exc, FileNotFoundError) or exc.errno == errno.ENOTDIR:
                raise NotFound(f"{self.url}: directory does not exist; check the path", url=self.url) from exc
            raise _translate(exc, self.url, None) from exc

    @contextmanager
    def _dirs(self) -> Iterator[_Dirs]:
        dirs = _Dirs(self._open_root())
        try:
            yield dirs
        finally:
            dirs.close()

    def _root_facts(self, fd: int) -> Root:
        """The root as the walk needs it (:data:`.walker.Root`), ``fd`` open on it."""
        st = os.fstat(fd)
        spellings = {str(self.root), os.path.realpath(self.root)}
        return (str(self.root), st.st_dev, st.st_ino, tuple(sorted(spellings)))

    def _lookup(self, dirs: _Dirs, key: str) -> tuple[int, str, os.stat_result]:
        """``key``'s directory (open), its name and its ``lstat``; raises ``OSError``."""
        head, _, name = key.rpartition("/")
        d = dirs.get(head)
        return d, name, os.stat(name, dir_fd=d, follow_symlinks=False)

    def _link(self, dirs: _Dirs, key: str, d: int, name: str) -> tuple[str, str]:
        """The key a symlink at ``key`` points to inside the root, and its text;
        ``NotFound`` saying why when it is no object (outside the root, dangling...)."""
        try:
            text = os.readlink(name, dir_fd=d)
        except OSError as exc:
            raise _translate(exc, self.url, key) from exc
        record = link_record(self._root_facts(dirs.root_fd), dirs.root_fd, name, key, text)
        if record[0] != LINK:
            raise NotFound(f"{self.url}/{key}: {record[2]}", url=self.url, key=key)
        return str(record[4]), text

    def list(
        self,
        prefix: str = "",
        *,
        on_skip: Callable[[str, str], None] | None = None,
        skip_dir: Callable[[str], bool] | None = None,
        on_link: Callable[[str], None] | None = None,
        walked: WalkedDirs | None = None,
    ) -> Iterator[ObjectInfo]:
        """Walk the tree below ``prefix`` (see the :class:`Store` contract),
        depth first, one directory at a time. Files and directories that
        vanish while listing are skipped.

        No symlink is ever followed, so no loop can trap the walk and nothing
        outside the root is listed: a symlink to a regular file inside the
        root is listed as a link (:attr:`~.base.ObjectInfo.link` names that
        file, whose size and mtime it carries; ``on_link(key)`` is told).
        Every other symlink (outside the root, a loop, a dangling one, a
        chain, one to a directory or to something that is not a file) is
        skipped, and ``on_skip(key, reason)`` is told about it (else it is
        logged). A directory for whose key (no trailing ``/``)
        ``skip_dir`` returns True is not entered: nothing below it is listed.
        Each directory read is noted in ``walked`` (see
        :class:`~.base.WalkedDirs`).

        A big tree is walked by helper processes (:mod:`.walker`): after
        :attr:`handoff_files` files listed here, the directories still to
        read are shared among :data:`HELPERS` runs of ``python -I -S
        walker.py``, whose ``stat`` calls then run on the other core while
        this process works on what it has received (a first scan:
        recognition). The same entries (in no particular order), skipped
        symlinks, links and errors as walking here. Only when ``skip_dir`` is
        None or carries a ``candidates`` attribute (a collection of the only
        keys it may return True for): the helpers hand those directories back
        unentered, and ``skip_dir`` is asked here, unless ``skip_dir``
        carries their stamps, which the walk then checks itself, and reads
        the small files it names as it lists them (:class:`_Hooks`). Where
        no helper can start, the walk goes on here.

        Processes, not threads: walking subtrees in 4 threads took twice as
        long here (1M files, 2 cores: 15 s against 7.5 s), the stat calls
        contending in the kernel rather than overlapping, and one walking
        thread beside recognition gained nothing (its Python between the
        stat calls waits for the GIL).
        """
        # Start the walk at the deepest directory the prefix names, reached from the
        # root without following any link (a symlink on the way: nothing is listed).
        head, _, _ = prefix.rpartition("/")
        root_fd = self._open_root()
        try:
            root = self._root_facts(root_fd)
            try:
                start_fd = open_below(root_fd, head.split("/") if head else [])
            except OSError as exc:
                if isinstance(exc, FileNotFoundError) or exc.errno in (errno.ENOTDIR, errno.ELOOP):
                    return
                raise _translate(exc, self.url, head or None) from exc
            try:
                st = os.fstat(start_fd)
            finally:
                os.close(start_fd)
        finally:
            os.close(root_fd)
        start = self.root / head if head else self.root
        stack: builtins.list[tuple[str, str, Ident | None]] = [(str(start), head + "/" if head else "",
                                                                (st.st_dev, st.st_ino))]
        candidates: Collection[str] | None = (
            frozenset() if skip_dir is None else getattr(skip_dir, "candidates", None)
        )
        hooks = _Hooks(skip_dir)

        def enter(key: str) -> bool:
            return skip_dir is None or not skip_dir(key)

        listed = 0
        walk = walk_dirs(stack, prefix, TEMP_PREFIX, enter, root, hooks.stamps, hooks.reads)
        try:
            for rel, records, facts in walk:
                if walked is not None:
                    walked[rel] = facts
                yield from self._listed(rel, records, prefix, on_skip, skip_dir, on_link, walked, root, hooks)
                listed += len(records)
                if listed >= self.handoff_files and stack and candidates is not None:
                    if len(stack) >= SPREAD * HELPERS or listed >= 4 * self.handoff_files:
                        break
                    # Too few directories left to share evenly: read the shallowest
                    # next (walk_dirs pops from the end), so that the helpers get
                    # many directories of similar size rather than a few big ones.
                    stack.sort(key=lambda entry: -entry[1].count("/"))
            else:
                return
        except WalkError as failed:
            raise _translate(failed.error, self.url, failed.rel.rstrip("/") or None) from failed.error
        finally:
            walk.close()
        stamped = hooks.stamps or {}
        helper = self._start_helper(stack, prefix, [k for k in candidates or () if k not in stamped], root, hooks)
        if helper is None:  # no helper process: go on here
            yield from self.list_stack(stack, prefix, on_skip=on_skip, skip_dir=skip_dir, on_link=on_link,
                                       walked=walked, root=root, hooks=hooks)
            return
        try:
            for rel, records, facts in helper:
                if walked is not None:
                    walked[rel] = facts
                for record in records:
                    if record[0] == FILE:  # the common case, without a call per entry
                        yield listed_file(rel + record[1], record[2], record[3])
                    else:
                        yield from self._listed(rel, [record], prefix, on_skip, skip_dir, on_link, walked, root,
                                                hooks)
        except WalkError as failed:
            raise _translate(failed.error, self.url, failed.rel.rstrip("/") or None) from failed.error

    def list_stack(
        self,
        stack: builtins.list[tuple[str, str, Ident | None]],
        prefix: str,
        *,
        on_skip: Callable[[str, str], None] | None = None,
        skip_dir: Callable[[str], bool] | None = None,
        on_link: Callable[[str], None] | None = None,
        walked: WalkedDirs | None = None,
        root: Root,
        hooks: _Hooks | None = None,
    ) -> Iterator[ObjectInfo]:
        """:meth:`list` of the directories ``stack`` (``(path, key + "/",
        ident)`` triples, see :func:`.walker.walk_dirs`), walked here, no helper."""

        def enter(key: str) -> bool:
            return skip_dir is None or not skip_dir(key)

        hooks = hooks if hooks is not None else _Hooks(skip_dir)
        try:
            for rel, records, facts in walk_dirs(stack, prefix, TEMP_PREFIX, enter, root, hooks.stamps, hooks.reads):
                if walked is not None:
                    walked[rel] = facts
                yield from self._listed(rel, records, prefix, on_skip, skip_dir, on_link, walked, root, hooks)
        except WalkError as failed:
            raise _translate(failed.error, self.url, failed.rel.rstrip("/") or None) from failed.error

    def _listed(
        self,
        rel: str,
        records: builtins.list[Record],
        prefix: str,
        on_skip: Callable[[str, str], None] | None,
        skip_dir: Callable[[str], bool] | None,
        on_link: Callable[[str], None] | None,
        walked: WalkedDirs | None,
        root: Root,
        hooks: _Hooks,
    ) -> Iterator[ObjectInfo]:
        """The objects of one directory's batch from :func:`.walker.walk_dirs`,
        telling ``on_skip`` and ``on_link`` (and ``skip_dir``'s hooks, see
        :class:`_Hooks`); a deferred subdirectory is walked here unless
        ``skip_dir`` skips it."""
        for record in records:
            kind = record[0]
            if kind == FILE:
                yield listed_file(rel + record[1], record[2], record[3])
                continue
            key = rel + record[1]
            if kind == DATA:
                hooks.read_ahead(key, record[4])
                yield listed_file(key, record[2], record[3])
            elif kind == UNCHANGED:
                hooks.unchanged(key)
            elif kind == LINK:
                if on_link is not None:
                    on_link(key)
                yield ObjectInfo(key, record[2], record[3], link=record[4])
            elif kind == SKIPPED:
                if on_skip is not None:
                    on_skip(key, record[2])
                else:
                    log.warning("%s/%s: %s", self.url, key, record[2])
            elif skip_dir is None or not skip_dir(key):  # DEFER
                yield from self.list_stack([(record[2], key + "/", record[3])], prefix, on_skip=on_skip,
                                           skip_dir=skip_dir, on_link=on_link, walked=walked, root=root,
                                           hooks=hooks)

    def _start_helper(
        self, stack: builtins.list[tuple[str, str, Ident | None]], prefix: str, deferred: Iterable[str], root: Root,
        hooks: _Hooks | None = None,
    ) -> Iterator[tuple[str, builtins.list[Record], DirFacts]] | None:
        """The batches of :data:`HELPERS` helper processes walking ``stack``
        between them (see :meth:`list`), in the order they arrive, or None
        when none can start. The processes are ended when the iterator is."""
        script = walker.__file__
        if not sys.executable or not script or not os.path.isfile(script):
            return None
        # Dealt round robin, shallowest first: each helper gets as many directories
        # of each depth as the next (give or take one).
        stack = sorted(stack, key=lambda entry: entry[1].count("/"))
        shares = [stack[i::HELPERS] for i in range(min(HELPERS, len(stack)))]
        procs: builtins.list[subprocess.Popen[bytes]] = []
        try:
            for _ in shares:
                procs.append(subprocess.Popen(
                    [sys.executable, "-I", "-S", "-B", script],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True,
                ))
        except OSError as exc:
            for proc in procs:
                proc.kill()
                proc.communicate()
            log.info("%s: walking here, the helper process did not start (%s)", self.url, exc)
            return None
        wanted = sorted(deferred)
        stamps = hooks.stamps if hooks is not None else None
        reads = None if hooks is None or hooks.reads is None else (sorted(hooks.reads[0]), hooks.reads[1])
        requests = [marshal.dumps((share, prefix, TEMP_PREFIX, wanted, root, stamps, reads)) for share in shares]
        return self._helper_batches(procs, requests)

    def _helper_batches(
        self, procs: builtins.list[subprocess.Popen[bytes]], requests: builtins.list[bytes]
    ) -> Iterator[tuple[str, builtins.list[Record], DirFacts]]:
        """Frames from the helpers ``procs`` as they come (each a pipe read
        whenever it has data); raises what a helper reports, or
        :class:`StoreError` for one that ends without its ``end`` frame."""
        running: dict[int, tuple[subprocess.Popen[bytes], bytearray]] = {}
        ended: set[int] = set()  # pids of the helpers that sent their end frame
        broken: subprocess.Popen[bytes] | None = None
        failed: tuple[int | None, str] | None = None
        try:
            with selectors.DefaultSelector() as sel:
                for proc, request in zip(procs, requests, strict=True):
                    assert proc.stdin is not None and proc.stdout is not None
                    try:
                        proc.stdin.write(request)
                        proc.stdin.close()
                    except BrokenPipeError:
                        broken = proc
                        break
                    fd = proc.stdout.fileno()
                    running[fd] = (proc, bytearray())
                    sel.register(fd, selectors.EVENT_READ)
                while running and broken is None:
                    for sk, _ in sel.select():
                        fd = int(sk.fd)
                        proc, buf = running[fd]
                        chunk = os.read(fd, 1 << 20)
                        buf += chunk
                        frames, used = _frames(buf)
                        del buf[:used]
                        for frame in frames:
                            if isinstance(frame, tuple):
                                if frame[0] == "end":
                                    ended.add(proc.pid)
                                    sel.unregister(fd)
                                    del running[fd]
                                    break
                                _, code, message, rel = frame
                                raise WalkError(rel, OSError(code, message))
                            yield from frame
                        else:
                            if not chunk:  # the pipe ended without an end frame
                                broken = proc
                                break
        finally:
            for proc in procs:
                assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
                if proc.pid not in ended:
                    proc.kill()
                if not proc.stdin.closed:
                    try:
                        proc.stdin.close()
                    except BrokenPipeError:
                        pass
                proc.stdout.close()
                error = proc.stderr.read().decode("utf-8", "replace").strip()
                proc.stderr.close()
                code = proc.wait()
                if proc is broken:
                    failed = (code, error)
        if failed is not None:
            code, error = failed
            raise StoreError(f"{self.url}: the listing's helper process ({sys.executable} {walker.__file__}) "
                             f"exited {code} before the end of the walk: {error.splitlines()[-1:] or 'no message'}; "
                             "run the scan again", url=self.url)

    # -- directory stamps: what an unchanged rescan may skip -------------------

    def take_stamp(self, key: str, relpaths: Iterable[str], *, changed_before: float,
                   walked: WalkedDirs | None = None) -> tuple[str, tuple[str, ...]] | None:
        """The stamp of the directory ``key`` holding the files ``relpaths``
        (relative to it), and the subdirectories it covers (``""`` is the
        directory itself); None when it cannot be trusted.

        The stamp digests the directory's mtime, link count and number of
        entries, and the mtime and link count of every directory below it:
        those holding the files, and any other one (an empty directory) a
        link count gives away (or, where directories' link counts mean
        nothing, as on btrfs, that reading the directory finds). Adding,
        removing or renaming an entry anywhere in the tree changes some
        directory's mtime, and adding a subdirectory its parent's link count;
        rewriting a file in place changes neither. None when any of these
        directories was modified at or after ``changed_before`` (epoch
        seconds: a change made while the scan ran, or too close to its start
        for a coarse filesystem clock to order), or is not a directory.

        With ``walked`` holding every directory of the tree (this scan's
        listing read them all), the stamp is made of what the listing saw
        and no directory is read again: the listing took those facts after
        the scan started, so a change since then either shows as a
        modification at or after ``changed_before`` or changes what
        :meth:`check_stamp` will find. Otherwise ``relpaths`` says where to
        look, and the directories are read here.
        """
        seen = walked.tree(key) if walked is not None else None
        if seen is not None:
            if seen.newest_ns >= int(changed_before * 1_000_000_000):
                return None
            return digest(seen.entries, seen.tokens), seen.dirs
        dirs: set[str] = {""}
        for rel in relpaths:
            head = rel.rpartition("/")[0]
            while head and head not in dirs:
                dirs.add(head)
                head = head.rpartition("/")[0]
        children: dict[str, int] = {}
        for d in dirs:
            if d:
                parent = d.rpartition("/")[0]
                children[parent] = children.get(parent, 0) + 1
        limit = int(changed_before * 1_000_000_000)
        stats: dict[str, os.stat_result] = {}
        pending = sorted(dirs)
        # Each lstat relative to the open top directory (reached from the root
        # without following a link; one path component for the kernel to resolve
        # below it, not the whole path): a first scan stamps every directory of
        # every checkpoint.
        fd = self._open_dir(key)
        if fd is None:
            return None
        try:
            while pending:
                d = pending.pop()
                try:
                    st = stat_below(fd, d) if d else os.fstat(fd)
                except OSError:
                    return None
                if not stat.S_ISDIR(st.st_mode) or st.st_mtime_ns >= limit:
                    return None
                stats[d] = st
                if st.st_nlink != 2 + children.get(d, 0):
                    try:
                        sub_fd = open_below(fd, d.split("/") if d else [])
                        try:
                            with os.scandir(sub_fd) as it:
                                for entry in it:
                                    sub = f"{d}/{entry.name}" if d else entry.name
                                    if sub not in dirs and entry.is_dir(follow_symlinks=False):
                                        dirs.add(sub)
                                        children[d] = children.get(d, 0) + 1
                                        pending.append(sub)
                        finally:
                            os.close(sub_fd)
                    except OSError:
                        return None
            covered = tuple(sorted(dirs))
            try:
                entries = len(os.listdir(fd))
            except OSError:
                return None
        finally:
            os.close(fd)
        return digest(entries, [stamp_token(key, d, stats[d]) for d in covered]), covered

    def check_stamp(self, key: str, dirs: Sequence[str]) -> str | None:
        """The stamp the directory ``key`` and its subdirectories ``dirs`` have now
        (as :meth:`take_stamp` computes it), or None when one is gone.

        One ``fstatat`` per directory, relative to the open top directory (no
        ``pathlib``, no walk from the root for each: this runs for every
        checkpoint of every rescan), and nothing through a symlink."""
        fd = self._open_dir(key)
        if fd is None:
            return None
        try:
            return tree_stamp(fd, key, dirs)
        finally:
            os.close(fd)

    def _open_dir(self, key: str) -> int | None:
        """The directory ``key`` opened from the root without following a link, or None."""
        try:
            root_fd = self._open_root()
        except StoreError:
            return None
        try:
            return open_below(root_fd, key.split("/") if key else [])
        except OSError:
            return None
        finally:
            os.close(root_fd)

    def stat(self, key: str) -> ObjectInfo:
        """The info of ``key``, from an ``fstatat(AT_SYMLINK_NOFOLLOW)`` relative to
        its directory (reached without following a link), with its ``identity``.

        A symlink to a regular file inside the root is the link
        (``link`` = the key it points at; size and mtime that file's; the
        identity the link's own); any other symlink, and anything that is not
        a regular file, is :class:`NotFound` saying what it is."""
        validate_key(key)
        with self._dirs() as dirs:
            try:
                d, name, st = self._lookup(dirs, key)
            except OSError as exc:
                raise _translate(exc, self.url, key) from exc
            if stat.S_ISREG(st.st_mode):
                return self._info(key, st)
            if stat.S_ISLNK(st.st_mode):
                target, text = self._link(dirs, key, d, name)
                try:
                    tst = stat_below(dirs.root_fd, target)
                except OSError as exc:
                    raise _translate(exc, self.url, key) from exc
                if not stat.S_ISREG(tst.st_mode):
                    raise NotFound(f"{self.url}/{key}: its target {target} is no longer a file", url=self.url,
                                   key=key)
                return self._info(key, st, link=target, text=text, target=tst)
        raise NotFound(f"{self.url}/{key}: not a file ({_file_kind(st.st_mode)})", url=self.url, key=key)

    def open_read(self, key: str) -> BinaryIO:
        """Open the regular file at ``key``, relative to its directory, never
        through a symlink: a link to a regular file inside the root is read by
        the key it points at (:attr:`~.base.ObjectInfo.link`), reached the
        same way; any other link is :class:`NotFound`.

        Anything else at the key (a FIFO, a device, a directory, a socket) is
        :class:`NotFound`, as :meth:`stat` and :meth:`list` see it, and opening
        never blocks: the file is opened non-blocking (a FIFO would otherwise
        wait for a writer) and its type checked on the open descriptor, so a
        file swapped after the check cannot slip through. The stream reads
        with the kernel told the access is sequential; ``fileno()`` is the
        open file, whose ``fstat`` is the identity of what is read.
        """
        validate_key(key)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        with self._dirs() as dirs:
            head, _, name = key.rpartition("/")
            try:
                d = dirs.get(head)
            except OSError as exc:
                raise _translate(exc, self.url, key) from exc
            try:
                fd = os.open(name, flags, dir_fd=d)
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise _translate(exc, self.url, key) from exc
                try:
                    is_link = stat.S_ISLNK(os.stat(name, dir_fd=d, follow_symlinks=False).st_mode)
                except OSError:
                    is_link = False
                if not is_link:
                    raise _translate(exc, self.url, key) from exc
                target, _ = self._link(dirs, key, d, name)
                thead, _, tname = target.rpartition("/")
                try:
                    fd = os.open(tname, flags, dir_fd=dirs.get(thead))
                except OSError as inner:
                    raise _translate(inner, self.url, key) from inner
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise NotFound(f"{self.url}/{key}: not a regular file ({_file_kind(mode)}); ckptier reads only "
                               f"files", url=self.url, key=key)
            os.set_blocking(fd, True)
            if hasattr(os, "posix_fadvise"):
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                except OSError:
                    pass  # advice only; some filesystems refuse it
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    def write(self, key: str, data: bytes | BinaryIO, *, if_absent: bool = False) -> ObjectInfo:
        """Write ``data`` to a temporary file beside ``key`` (created relative to
        its directory, ``O_EXCL|O_NOFOLLOW``), fsync it, and rename it into
        place (``renameat``, which replaces a symlink at ``key`` rather than
        writing through it); ``if_absent`` links it instead (``linkat``), which
        fails atomically when ``key`` exists. Missing directories are made on
        the way, none through a link. Nothing is left behind on failure."""
        validate_key(key)
        src = as_stream(data)
        head, _, name = key.rpartition("/")
        if not self.root.is_dir() and not self.root.is_symlink():
            try:  # a new store's root: made as the path says (a write makes what it needs)
                os.makedirs(self.root, exist_ok=True)
            except OSError as exc:
                raise _translate(exc, self.url, None, doing="create") from exc
        try:
            with self._dirs() as dirs:
                d = dirs.get(head, create=True)
                if if_absent and _exists(name, d):
                    raise AlreadyExists(f"{self.url}/{key}: already exists", url=self.url, key=key)
                tmp = f"{TEMP_PREFIX}{secrets.token_hex(8)}"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=d)
                try:
                    with os.fdopen(fd, "wb") as out:
                        _copy(src, out)
                        out.flush()
                        os.fsync(out.fileno())
                    if if_absent:
                        try:
                            os.link(tmp, name, src_dir_fd=d, dst_dir_fd=d, follow_symlinks=False)
                        except FileExistsError:
                            raise AlreadyExists(f"{self.url}/{key}: already exists", url=self.url,
                                                key=key) from None
                        os.unlink(tmp, dir_fd=d)
                    else:
                        os.replace(tmp, name, src_dir_fd=d, dst_dir_fd=d)
                except BaseException:
                    try:
                        os.unlink(tmp, dir_fd=d)
                    except FileNotFoundError:
                        pass
                    raise
                return self._info(key, os.stat(name, dir_fd=d, follow_symlinks=False))
        except _SourceFailed as failed:
            raise failed.error from failed.error.__cause__
        except OSError as exc:
            raise _translate(exc, self.url, key, doing="write") from exc

    def delete_many(self, keys: Sequence[str]) -> DeleteResult:
        """Delete each key: ``unlinkat`` relative to its directory, reached from
        the root without following a link (a symlink at the key is removed as
        itself, never its target), then remove the directories left empty, up
        to the root (``rmdir`` relative to each parent)."""
        return self._delete([(key, None) for key in keys])

    def delete_proven(self, proven: Sequence[ObjectInfo]) -> DeleteResult:
        """:meth:`delete_many` of each info's key, only while what is there is the
        object :meth:`stat` proved: the same identity (device, inode, size, mtime
        in ns; for a link, the same link), compared on an ``fstatat`` relative to
        the same open directory the ``unlinkat`` then acts in
        (:class:`~.base.ProvenDeletes`)."""
        result = DeleteResult()
        pairs: builtins.list[tuple[str, str | None]] = []
        for info in proven:
            if info.identity is None:
                result.failed[info.key] = "no identity proven (stat it first); not deleted"
            else:
                pairs.append((info.key, info.identity))
        result.merge(self._delete(pairs))
        return result

    def _delete(self, pairs: Sequence[tuple[str, str | None]]) -> DeleteResult:
        result = DeleteResult()
        emptied: set[str] = set()
        with self._dirs() as dirs:
            for key, expect in pairs:
                problem = key_problem(key)
                if problem is not None:
                    result.failed[key] = problem
                    continue
                head, _, name = key.rpartition("/")
                try:
                    d = dirs.get(head)
                    st = os.stat(name, dir_fd=d, follow_symlinks=False)
                except FileNotFoundError:
                    result.deleted.append(key)  # absent: deletes are idempotent
                    continue
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        why = "a symlink or a file on the way to it: not followed, not deleted"
                        if expect is not None:
                            result.changed[key] = why
                        else:
                            result.failed[key] = why
                    else:
                        result.failed[key] = str(exc.strerror or exc)
                    continue
                if stat.S_ISDIR(st.st_mode):
                    result.failed[key] = "a directory, not a file: not deleted"
                    continue
                link = stat.S_ISLNK(st.st_mode)
                if expect is not None:
                    try:
                        now = identity_of(st, os.readlink(name, dir_fd=d) if link else None)
                    except OSError as exc:
                        result.failed[key] = str(exc.strerror or exc)
                        continue
                    if now != expect:
                        result.changed[key] = f"not the object proven: {_describe(st)}"
                        continue
                try:
                    os.unlink(name, dir_fd=d)
                except FileNotFoundError:
                    pass  # gone meanwhile: deleted all the same
                except OSError as exc:
                    result.failed[key] = str(exc.strerror or exc)
                    continue
                result.deleted.append(key)
                if link or st.st_nlink > 1:
                    result.shared.append(key)
                emptied.add(head)
            self._prune_empty_dirs(dirs, emptied)
        return result

    def local_path(self, key: str) -> Path:
        """The path naming object ``key`` (:class:`~.base.LocalPaths`); validates the
        key, no I/O. Never opened by ckptier (see :class:`~.base.LocalPaths`)."""
        return self._path(key)

    def list_with_skips(self, prefix: str, on_skip: Callable[[str, str], None]) -> Iterator[ObjectInfo]:
        """:meth:`list`, telling ``on_skip(key, reason)`` about every symlink it
        leaves out (:class:`~.base.ListingSkips`)."""
        return self.list(prefix, on_skip=on_skip)

    def list_pruned(self, prefix: str, skip_dir: Callable[[str], bool], on_skip: Callable[[str, str], None],
                    on_link: Callable[[str], None], walked: WalkedDirs | None = None) -> Iterator[ObjectInfo]:
        """:meth:`list`, not entering the directories ``skip_dir`` names, telling
        ``on_skip`` and ``on_link`` and noting in ``walked`` each directory it
        reads (:class:`~.base.DirectoryStamps`)."""
        return self.list(prefix, on_skip=on_skip, skip_dir=skip_dir, on_link=on_link, walked=walked)

    def stale_temp_files(self, older_than: float) -> builtins.list[str]:
        """This store's own temporary files (``.ckptier-tmp-*``, left by an
        interrupted ``write``) last modified before ``older_than`` (epoch
        seconds), as paths relative to the root. Never lists anything else,
        and nothing through a symlink (``fwalk`` without following)."""
        stale: builtins.list[str] = []
        root_fd = self._open_root()
        try:
            for directory, _dirs, files, dfd in os.fwalk(".", dir_fd=root_fd, follow_symlinks=False):
                for name in files:
                    if not name.startswith(TEMP_PREFIX):
                        continue
                    try:
                        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISREG(st.st_mode) and st.st_mtime < older_than:
                        stale.append(os.path.normpath(os.path.join(directory, name)))
        finally:
            os.close(root_fd)
        return sorted(stale)

    def remove_temp_file(self, key: str) -> None:
        """Remove one file :meth:`stale_temp_files` listed (relative to its
        directory, never through a link); refuses any other name."""
        validate_key(key)
        head, _, name = key.rpartition("/")
        if not name.startswith(TEMP_PREFIX):
            raise InvalidKey(f"{self.url}/{key}: not a ckptier temporary file; refusing to remove it", key=key)
        with self._dirs() as dirs:
            try:
                os.unlink(name, dir_fd=dirs.get(head))
            except FileNotFoundError:
                return
            except OSError as exc:
                raise _translate(exc, self.url, key) from exc

    @staticmethod
    def _prune_empty_dirs(dirs: _Dirs, emptied: Iterable[str]) -> None:
        """Remove the directories ``emptied`` (keys) and their parents while they are
        empty, up to (not including) the root: ``rmdir`` of each name relative
        to its parent's open descriptor, so a directory swapped for a link is
        never removed through it (``rmdir`` of a link fails)."""
        for rel in sorted(emptied, key=lambda r: -r.count("/")):
            while rel:
                head, _, name = rel.rpartition("/")
                try:
                    parent = dirs.get(head)
                    dirs.forget(rel)
                    os.rmdir(name, dir_fd=parent)
                except OSError:
                    break
                rel = head


def _exists(name: str, d: int) -> bool:
    """Whether anything (a dangling symlink too) is at ``name`` in directory ``d``."""
    try:
        os.stat(name, dir_fd=d, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True
