#!/usr/bin/env python3
"""The ``ckptier`` command line in a child process that can SIGKILL itself at a named point.

usage: python bench/chaos_child.py
       then, on stdin, one line: {"point": POINT, "n": N, "argv": [ARGS...], "cwd": DIR,
                                  "swap": {"point": POINT, "n": N, "moves": [[PATH, ASIDE, LINK_TARGET], ...]}}

Used by ``bench/chaos.py``, which keeps one child started ahead of time.
Imports ckptier (and boto3), prints ``ready``, waits for its orders (one JSON
line on stdin), then runs ``ckptier ARGS...`` (the real
``ckptier.flows.cli.main``) in ``DIR`` and exits with its status. The last
line on stdout is ``chaos-child: <seconds> <json hit counts>``.

``POINT`` is where it kills itself, with SIGKILL, on the ``N``-th time it is
reached; ``none`` never kills (the parent may still kill it after a random
delay). Nothing in ckptier is changed: the points are wrappers around the
real stores' and catalog's methods, installed here only:

==============  ================================================================
``canary``      right after an S3 store's start-up canary object was written
``lease``       right after a lease was claimed (nothing done under it yet)
``upload``      right after an archive data object (``*.ckz``) was written
``part``        right after one part of an S3 multipart upload was sent
``manifest``    between the read-back of an archive copy and its manifest (commit marker)
``committed``   right after the manifest was written, before the catalog records the copy
``recorded``    right after the catalog recorded an archive copy
``proof``       right after a keeper's proof was recorded
``intent``      between the delete intent and the first deleted file
``mid-delete``  half-way through a delete batch (the first half of its keys deleted)
``deleted``     after a batch was deleted, before the tombstone
``tombstone``   right after the tombstone was recorded
``restored``    (rebuild) right after a job's catalog backup was restored
``scanned``     (rebuild) right after a hot location was scanned
``rebuilt``     (rebuild) right after a job's archive copies were recorded
==============  ================================================================

``swap`` (optional) is what an attacker, or a careless operator, does to the
hot tree while the apply runs: on the ``N``-th arrival at its point (any of
the above, or ``list``: right after a live listing of a checkpoint's keys,
or ``stat``: right after a file was stat'ed), each ``PATH`` is renamed to
``ASIDE`` and a symlink to ``LINK_TARGET`` takes its place. Nothing is
killed then; the apply goes on.

With ``CHAOS_SMALL_PARTS=1`` S3 stores switch to multipart above 5 MiB (parts
of 5 MiB, S3's minimum) instead of 64 MiB, so that small test data crosses
the threshold.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

POINTS = ("canary", "lease", "upload", "part", "manifest", "committed", "recorded", "proof", "intent", "mid-delete",
          "deleted", "tombstone", "restored", "scanned", "rebuilt")
#: Points a swap may happen at besides the kill points.
SWAP_POINTS = (*POINTS, "list", "stat")
SMALL_PART = 5 << 20

hits: Counter[str] = Counter()
_target: tuple[str, int] | None = None
#: (point, n, moves) of the swap to make (see the module docstring), or None.
_swap: tuple[str, int, list[list[str]]] | None = None
swapped: list[str] = []


def swap(moves: list[list[str]]) -> None:
    """Each ``path`` aside, a symlink to ``target`` in its place."""
    for path, aside, target in moves:
        if os.path.lexists(path):
            os.rename(path, aside)
        os.symlink(target, path)
        swapped.append(path)


def reached(point: str) -> None:
    """Count one arrival at ``point``; SIGKILL this process when it is the chosen one, make the
    swap when it is the swap's."""
    hits[point] += 1
    if _swap is not None and (_swap[0], _swap[1]) == (point, hits[point]):
        swap(_swap[2])
    if _target is not None and _target == (point, hits[point]):
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def small_parts() -> Callable[[], None]:
    """Make every S3Store created from now on use 5 MiB multipart thresholds and parts;
    returns what puts the defaults back."""
    from ckptier.storage.s3 import S3Store

    defaults = S3Store.__init__.__kwdefaults__
    assert defaults is not None
    saved = {k: defaults[k] for k in ("multipart_threshold", "part_size")}
    defaults["multipart_threshold"] = SMALL_PART
    defaults["part_size"] = SMALL_PART
    return lambda: defaults.update(saved)


def _after(cls: Any, name: str, point: str, when: Callable[..., bool] = lambda *a, **k: True) -> None:
    real = getattr(cls, name)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = real(self, *args, **kwargs)
        if when(result, *args, **kwargs):
            reached(point)
        return result

    setattr(cls, name, wrapper)


def install() -> None:
    """Wrap the stores' and the catalog's methods with the crash points."""
    from ckptier.storage.catalog.api import Catalog
    from ckptier.storage.local import LocalStore
    from ckptier.storage.manifest import MANIFEST_NAME
    from ckptier.storage.s3 import CANARY_PREFIX, S3Store

    for cls in (LocalStore, S3Store):
        real_write = cls.write

        def write(self: Any, key: str, data: Any, *, if_absent: bool = False, _real: Any = real_write) -> Any:
            manifest = key.endswith(MANIFEST_NAME)
            if manifest:
                reached("manifest")
            result = _real(self, key, data, if_absent=if_absent)
            if manifest:
                reached("committed")
            elif key.endswith(".ckz"):
                reached("upload")
            elif key.startswith(CANARY_PREFIX):
                reached("canary")
            return result

        cls.write = write  # type: ignore[method-assign]
        real_delete = cls.delete_many

        def delete_many(self: Any, keys: Any, _real: Any = real_delete) -> Any:
            keys = list(keys)
            if len(keys) > 1 and _target is not None and _target == ("mid-delete", hits["mid-delete"] + 1):
                _real(self, keys[: len(keys) // 2])
            reached("mid-delete")
            result = _real(self, keys)
            reached("deleted")
            return result

        cls.delete_many = delete_many  # type: ignore[method-assign]
        real_proven = cls.delete_proven

        def delete_proven(self: Any, proven: Any, _real: Any = real_proven) -> Any:
            proven = list(proven)
            if len(proven) > 1 and _target is not None and _target == ("mid-delete", hits["mid-delete"] + 1):
                _real(self, proven[: len(proven) // 2])
            reached("mid-delete")
            result = _real(self, proven)
            reached("deleted")
            return result

        cls.delete_proven = delete_proven  # type: ignore[method-assign]
        real_list = cls.list

        def listing(self: Any, *args: Any, _real: Any = real_list, **kwargs: Any) -> Any:
            yield from _real(self, *args, **kwargs)
            reached("list")

        cls.list = listing  # type: ignore[method-assign]
        _after(cls, "stat", "stat")

    real_call = S3Store._call

    def call(self: Any, method: str, key: str | None = None, **kwargs: Any) -> Any:
        result = real_call(self, method, key, **kwargs)
        if method == "upload_part":
            reached("part")
        return result

    S3Store._call = call  # type: ignore[method-assign]
    _after(Catalog, "claim", "lease", lambda gen, *a, **k: gen is not None)
    _after(Catalog, "add_copy", "recorded")
    _after(Catalog, "record_verification", "proof")
    _after(Catalog, "record_delete_intent", "intent", lambda ok, *a, **k: bool(ok))
    _after(Catalog, "mark_deleted", "tombstone", lambda ok, *a, **k: bool(ok))
    _after(Catalog, "mark_hot_copy_deleted", "tombstone", lambda ok, *a, **k: bool(ok))
    from ckptier.tasks import rebuild, scan

    for module, name, point in ((rebuild, "import_job", "restored"), (scan, "scan_url", "scanned"),
                                (rebuild, "record_rebuilt_copies", "rebuilt")):
        _after_function(module, name, point)


def _after_function(module: Any, name: str, point: str) -> None:
    """Wrap a module's function (looked up by name where it is called) with a crash point after it."""
    real = getattr(module, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        reached(point)
        return result

    setattr(module, name, wrapper)


def main() -> int:
    global _target, _swap
    from ckptier.flows.cli import main as ckptier
    from ckptier.storage import s3  # noqa: F401 - imported before "ready", as apply would
    from ckptier.tasks import apply, archive, pipeline, rebuild, verify  # noqa: F401

    if os.environ.get("CHAOS_SMALL_PARTS") == "1":
        small_parts()
    install()
    print("ready", flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # not needed after all
    orders = json.loads(line)
    point, n, args = orders["point"], int(orders["n"]), list(orders["argv"])
    if point != "none" and point not in POINTS:
        print(f"chaos_child: unknown point {point!r} (none, {', '.join(POINTS)})", file=sys.stderr)
        return 2
    _target = None if point == "none" else (point, n)
    if orders.get("swap"):
        sw = orders["swap"]
        if sw["point"] not in SWAP_POINTS:
            print(f"chaos_child: unknown swap point {sw['point']!r} ({', '.join(SWAP_POINTS)})", file=sys.stderr)
            return 2
        _swap = (sw["point"], int(sw["n"]), [list(m) for m in sw["moves"]])
    os.chdir(orders.get("cwd") or ".")
    t0 = time.monotonic()
    code = ckptier(args)
    print(f"chaos-child: {time.monotonic() - t0:.3f} {json.dumps(dict(hits))}", flush=True)
    if _swap is not None:
        print(f"chaos-child-swapped: {json.dumps(swapped)}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
