"""A store over a local or POSIX-mounted directory."""

from __future__ import annotations

import builtins
import errno
import hashlib
import logging
import os
import marshal
import selectors
import stat
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from . import walker
from .base import DeleteResult, ObjectInfo, WalkedDirs, as_stream, listed_file, validate_key
from .errors import (
    AccessDenied,
    AlreadyExists,
    InvalidKey,
    NotFound,
    StoreError,
    Unavailable,
)
from .walker import FILE, LINK, SKIPPED, DirFacts, Record, WalkError, dir_token, walk_dirs

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


def _translate(exc: OSError, url: str, key: str | None) -> StoreError:
    where = f"{url}/{key}" if key else url
    if isinstance(exc, FileNotFoundError) or exc.errno == errno.ENOTDIR:
        return NotFound(f"{where}: no such file or directory", url=url, key=key)
    if exc.errno == errno.ELOOP:
        return NotFound(f"{where}: a symlink loop, not a file", url=url, key=key)
    if isinstance(exc, PermissionError):
        return AccessDenied(f"{where}: permission denied; check the file's owner and mode", url=url, key=key)
    if exc.errno in (errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN):
        return Unavailable(f"{where}: {exc.strerror} (I/O error; retry or check the mount)", url=url, key=key)
    return StoreError(f"{where}: {exc.strerror or exc}", url=url, key=key)


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

    def _info(self, key: str, st: os.stat_result) -> ObjectInfo:
        return ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime, etag=None)

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

        Symlinks are never followed into directories, so no loop can trap the
        walk; a symlink to a file is listed as that file (and ``on_link(key)``
        is told). Every other symlink
        (a loop, a dangling one, one to a directory or to something that is
        not a file) is skipped, and ``on_skip(key, reason)`` is told about it
        (else it is logged). A directory for whose key (no trailing ``/``)
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
        unentered, and ``skip_dir`` is asked here. Where no helper can start,
        the walk goes on here.

        Processes, not threads: walking subtrees in 4 threads took twice as
        long here (1M files, 2 cores: 15 s against 7.5 s), the stat calls
        contending in the kernel rather than overlapping, and one walking
        thread beside recognition gained nothing (its Python between the
        stat calls waits for the GIL).
        """
        if not self.root.is_dir():
            raise NotFound(f"{self.url}: directory does not exist; check the path", url=self.url)
        # Start the walk at the deepest directory the prefix names.
        head, _, _ = prefix.rpartition("/")
        start = self.root / head if head else self.root
        stack = [(str(start), head + "/" if head else "")]
        candidates: Collection[str] | None = (
            frozenset() if skip_dir is None else getattr(skip_dir, "candidates", None)
        )

        def enter(key: str) -> bool:
            return skip_dir is None or not skip_dir(key)

        listed = 0
        walk = walk_dirs(stack, prefix, TEMP_PREFIX, enter)
        try:
            for rel, records, facts in walk:
                if walked is not None:
                    walked[rel] = facts
                yield from self._listed(rel, records, prefix, on_skip, skip_dir, on_link, walked)
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
        helper = self._start_helper(stack, prefix, candidates or ())
        if helper is None:  # no helper process: go on here
            yield from self.list_stack(stack, prefix, on_skip=on_skip, skip_dir=skip_dir, on_link=on_link,
                                       walked=walked)
            return
        try:
            for rel, records, facts in helper:
                if walked is not None:
                    walked[rel] = facts
                for record in records:
                    if record[0] == FILE:  # the common case, without a call per entry
                        yield listed_file(rel + record[1], record[2], record[3])
                    else:
                        yield from self._listed(rel, [record], prefix, on_skip, skip_dir, on_link, walked)
        except WalkError as failed:
            raise _translate(failed.error, self.url, failed.rel.rstrip("/") or None) from failed.error

    def list_stack(
        self,
        stack: builtins.list[tuple[str, str]],
        prefix: str,
        *,
        on_skip: Callable[[str, str], None] | None = None,
        skip_dir: Callable[[str], bool] | None = None,
        on_link: Callable[[str], None] | None = None,
        walked: WalkedDirs | None = None,
    ) -> Iterator[ObjectInfo]:
        """:meth:`list` of the directories ``stack`` (``(path, key + "/")``
        pairs), walked here, no helper."""

        def enter(key: str) -> bool:
            return skip_dir is None or not skip_dir(key)

        try:
            for rel, records, facts in walk_dirs(stack, prefix, TEMP_PREFIX, enter):
                if walked is not None:
                    walked[rel] = facts
                yield from self._listed(rel, records, prefix, on_skip, skip_dir, on_link, walked)
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
    ) -> Iterator[ObjectInfo]:
        """The objects of one directory's batch from :func:`.walker.walk_dirs`,
        telling ``on_skip`` and ``on_link``; a deferred subdirectory is
        walked here unless ``skip_dir`` skips it."""
        for record in records:
            kind = record[0]
            if kind == FILE:
                yield listed_file(rel + record[1], record[2], record[3])
                continue
            key = rel + record[1]
            if kind == LINK:
                if on_link is not None:
                    on_link(key)
                yield ObjectInfo(key, record[2], record[3])
            elif kind == SKIPPED:
                if on_skip is not None:
                    on_skip(key, record[2])
                else:
                    log.warning("%s/%s: %s", self.url, key, record[2])
            elif skip_dir is None or not skip_dir(key):  # DEFER
                yield from self.list_stack([(record[2], key + "/")], prefix, on_skip=on_skip, skip_dir=skip_dir,
                                           on_link=on_link, walked=walked)

    def _start_helper(
        self, stack: builtins.list[tuple[str, str]], prefix: str, deferred: Iterable[str]
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
        requests = [marshal.dumps((share, prefix, TEMP_PREFIX, wanted)) for share in shares]
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
            return self._digest(seen.entries, seen.tokens), seen.dirs
        base = os.path.join(self.root, key) if key else str(self.root)
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
        # Each lstat relative to the open top directory (one path component for
        # the kernel to resolve, not the whole path): a first scan stamps every
        # directory of every checkpoint.
        try:
            fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            lstat = os.lstat
            while pending:
                d = pending.pop()
                try:
                    st = lstat(d or ".", dir_fd=fd)
                except OSError:
                    return None
                if not stat.S_ISDIR(st.st_mode) or st.st_mtime_ns >= limit:
                    return None
                stats[d] = st
                if st.st_nlink != 2 + children.get(d, 0):
                    try:
                        with os.scandir(f"{base}/{d}" if d else base) as it:
                            for entry in it:
                                sub = f"{d}/{entry.name}" if d else entry.name
                                if sub not in dirs and entry.is_dir(follow_symlinks=False):
                                    dirs.add(sub)
                                    children[d] = children.get(d, 0) + 1
                                    pending.append(sub)
                    except OSError:
                        return None
            covered = tuple(sorted(dirs))
            try:
                entries = len(os.listdir(fd))
            except OSError:
                return None
        finally:
            os.close(fd)
        return self._digest(entries, self._tokens(key, covered, stats)), covered

    def check_stamp(self, key: str, dirs: Sequence[str]) -> str | None:
        """The stamp the directory ``key`` and its subdirectories ``dirs`` have now
        (as :meth:`take_stamp` computes it), or None when one is gone.

        One ``fstatat`` per directory, relative to the open top directory (no
        ``pathlib``, no walk from the root for each: this runs for every
        checkpoint of every rescan)."""
        try:
            fd = os.open(os.path.join(self.root, key) if key else self.root, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return None
        try:
            lstat = os.lstat
            stats = {d: lstat(d or ".", dir_fd=fd) for d in dirs}
            entries = len(os.listdir(fd))
        except OSError:
            return None
        finally:
            os.close(fd)
        if not all(stat.S_ISDIR(st.st_mode) for st in stats.values()):
            return None
        return self._digest(entries, self._tokens(key, dirs, stats))

    @staticmethod
    def _tokens(key: str, dirs: Sequence[str], stats: Mapping[str, os.stat_result]) -> builtins.list[str]:
        """The :func:`.walker.dir_token` of each directory of ``dirs`` (relative
        to ``key``), from its ``lstat``."""
        top = key + "/" if key else ""
        return [dir_token(f"{top}{d}/" if d else top, stats[d].st_mtime_ns, stats[d].st_nlink) for d in dirs]

    @staticmethod
    def _digest(entries: int, tokens: Iterable[str]) -> str:
        """The stamp of a tree: the top directory's number of entries, then the
        token (key, mtime in ns, link count) of each of its directories,
        sorted (whatever order they come in)."""
        text = "\0".join([str(entries), *sorted(tokens)])
        return hashlib.sha1(text.encode("utf-8", "surrogateescape"), usedforsecurity=False).hexdigest()

    def stat(self, key: str) -> ObjectInfo:
        path = self._path(key)
        try:
            st = path.stat()
        except OSError as exc:
            raise _translate(exc, self.url, key) from exc
        if not stat.S_ISREG(st.st_mode):
            raise NotFound(f"{self.url}/{key}: not a file", url=self.url, key=key)
        return self._info(key, st)

    def open_read(self, key: str) -> BinaryIO:
        """Open the regular file at ``key`` (or the file a symlink there leads to).

        Anything else at the key (a FIFO, a device such as ``/dev/zero``, a
        directory, a socket, a symlink loop) is :class:`NotFound`, as
        :meth:`stat` and :meth:`list` see it, and opening never blocks: the
        file is opened non-blocking (a FIFO would otherwise wait for a
        writer) and its type checked on the open descriptor, so a file
        swapped after the check cannot slip through.
        """
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise _translate(exc, self.url, key) from exc
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise NotFound(f"{self.url}/{key}: not a regular file ({_file_kind(mode)}); ckptier reads only "
                               f"files", url=self.url, key=key)
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    def write(self, key: str, data: bytes | BinaryIO, *, if_absent: bool = False) -> ObjectInfo:
        path = self._path(key)
        src = as_stream(data)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if if_absent and path.exists():
                raise AlreadyExists(f"{self.url}/{key}: already exists", url=self.url, key=key)
            fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as out:
                    _copy(src, out)
                    out.flush()
                    os.fsync(out.fileno())
                if if_absent:
                    try:
                        os.link(tmp, path)
                    except FileExistsError:
                        raise AlreadyExists(f"{self.url}/{key}: already exists", url=self.url, key=key) from None
                    os.unlink(tmp)
                else:
                    os.replace(tmp, path)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
            return self._info(key, path.stat())
        except _SourceFailed as failed:
            raise failed.error from failed.error.__cause__
        except OSError as exc:
            raise _translate(exc, self.url, key) from exc

    def delete_many(self, keys: Sequence[str]) -> DeleteResult:
        result = DeleteResult()
        for key in keys:
            try:
                path = self._path(key)
                os.unlink(path)
            except FileNotFoundError:
                result.deleted.append(key)
            except (OSError, StoreError) as exc:
                result.failed[key] = str(exc.strerror if isinstance(exc, OSError) else exc)
            else:
                result.deleted.append(key)
                self._prune_empty_dirs(path.parent)
        return result

    def local_path(self, key: str) -> Path:
        """The file holding object ``key`` (:class:`~.base.LocalPaths`); validates the key, no I/O."""
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
        seconds), as paths relative to the root. Never lists anything else."""
        stale: builtins.list[str] = []
        for directory, _dirs, files in os.walk(self.root):
            for name in files:
                if not name.startswith(TEMP_PREFIX):
                    continue
                path = os.path.join(directory, name)
                try:
                    if os.lstat(path).st_mtime < older_than:
                        stale.append(os.path.relpath(path, self.root))
                except FileNotFoundError:
                    continue
        return sorted(stale)

    def remove_temp_file(self, key: str) -> None:
        """Remove one file :meth:`stale_temp_files` listed; refuses any other name."""
        path = self._path(key)
        if not path.name.startswith(TEMP_PREFIX):
            raise InvalidKey(f"{self.url}/{key}: not a ckptier temporary file; refusing to remove it", key=key)
        path.unlink(missing_ok=True)

    def _prune_empty_dirs(self, directory: Path) -> None:
        """Remove directories left empty by a delete, up to (not including) root."""
        while directory != self.root and self.root in directory.parents:
            try:
                directory.rmdir()
            except OSError:
                return
            directory = directory.parent
