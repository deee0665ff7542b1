"""Generated hostile input for ``bench/chaos.py``: trees, archive manifests and S3 keys.

Each *case* is one generated thing, and cases go through the real command
line (in the bench's process) in batches:

* a **tree**: one job directory of 1-3 checkpoints under a local scan root,
  each either well formed (a guide-layout checkpoint of real ``torch.save``
  files with a ``metadata.json`` listing sizes and sha256s) or hostile:
  hostile archives (a ``.pt`` that is a zip bomb: a deflated member of
  512 MiB of zeros in half a megabyte, honest or lying about its size; a pickle bomb in
  its ``data.pkl`` or in a DCP ``.metadata``: a few bytes of opcodes per
  object built), broken ``metadata.json`` (truncated, garbage, deeply nested, wrong types,
  NaN, duplicate keys, another step), steps at the edges (0, 2^31, 2^63-1,
  2^63, 10^20, unicode digits, padding that makes duplicates), empty data
  files, files listed but missing, wrong hashes, odd unicode and control
  characters in job and file names, names that are not UTF-8, symlinks (to
  files, loops, dangling, to directories, to /dev/zero), FIFOs, Hugging Face,
  Lightning and DCP look-alikes, ckptier's own reserved names; some have a
  file swapped after the scan (FIFO, /dev/zero, truncated, grown, gone, a
  directory);
* a **manifest**: the archive copy of a promoted checkpoint, mangled after
  the promotion (manifest truncated, garbage, nested, wrong sizes and hashes,
  paths that climb out, a data object flipped, truncated, deleted, swapped,
  turned into a FIFO...), before an apply that deletes hot copies;
* an **S3 key set**: one job's objects in a moto bucket, with keys S3 allows
  and filesystems do not (``a//b``, ``./x``, trailing ``/``, a key that is
  also the "directory" of others, 1,000-byte keys, control characters).

A batch: write the cases, ``scan`` (plus the tampering), ``verify``,
``plan``, ``apply`` (milestones promoted, hot copies kept), the manifest
damage, ``verify --deep``, ``apply`` again with hot copies deleted after
archiving, a rescan and a last ``apply``, then ``fetch`` of every cataloged
checkpoint the generator planted. Oracles: no command crashes, hangs or
prints a traceback; no batch grows the process's peak memory by more than
400 MiB (the bombs inflate to 512 MiB); ``scan`` exits 0; every well-formed checkpoint is
cataloged and verified with exactly its files; every well-formed checkpoint
the plan keeps fetches bit-exactly (whatever happened to its archive copy);
any fetch that succeeds returns exactly the bytes that were written at those
keys; nothing is written outside a fetch's DEST; the newest verified
checkpoint of a job is never deleted; no lease or delete intent is left.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

MAX_STEP = 2**63 - 1
#: Seconds any one command may take before it counts as a hang.
HANG_SECONDS = 120
#: Cases per batch (one scan root, one catalog).
BATCH = 100
#: Every how many batches one goes to S3 (key sets) instead of a local tree.
S3_EVERY = 20
#: Inputs that hit defects known and reported but not fixed yet (in code other work is
#: rewriting). The bench generates them by default, so that its figures tell the truth;
#: ``skip_open`` (the short run in the test suite) leaves them out. Remove an entry once fixed.
OPEN_DEFECTS: dict[str, str] = {}
#: Share of the cataloged checkpoints that are not well formed which are fetched too
#: (every well-formed one is).
FETCH_OTHERS = 0.2
#: What a zip bomb inflates to (about a thousandth of it on disk).
BOMB_BYTES = 512 << 20
#: Most this process's peak memory may grow in one batch: a bomb decoded whole would take more.
MAX_BATCH_GROWTH = 400 << 20

_NAMES = [
    "llm", "run 1", "ünïcode", "e\u0301t\u00e9", "\u00e9t\u00e9", "\u202egnp.exe", "zero\u200bwidth", "emoji🚀",
    "tab\tname", "new\nline", "back\\slash", "quote'\"", "percent%2Fx", "-dash", ".hidden", "...", "a" * 180,
    "日本語の実験", "CON", " lead", "trail ", "step-00000007", "checkpoint-7", "rank-0000", ".ckptier",
    "ckptier-manifest.json", "epoch=1-step=5.ckpt", "\x7fdel", "\x01ctl", "#frag?q=1", "*glob[1]", "ﬁ-ligature",
]
_BAD_BYTES_NAMES = [b"\xff\xfe-latin1", b"caf\xe9", b"\xc3\x28"]
#: Names of :data:`OPEN_DEFECTS` whose inputs are not generated (set by :func:`fuzz`).
SKIP: set[str] = set()
_STEPS_EDGE = [0, 1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, MAX_STEP, MAX_STEP + 1, 10**20]


# ------------------------------------------------------------------------------ what was written


@dataclass
class Planted:
    """One checkpoint-like thing the generator wrote.

    ``prefix``: its key relative to the scan root (a directory, or the file of
    a single-file checkpoint); ``files``: relpath -> bytes; ``valid``: well
    formed, so it must be cataloged, verified and fetched bit-exactly;
    ``step``/``job``: what a correct scan catalogs it as."""

    case: str
    job: str
    step: int
    prefix: str
    files: dict[str, bytes]
    valid: bool
    tampered: bool = False
    archived_damage: str | None = None


@dataclass
class Batch:
    """One batch's scan root, its cases and everything the oracles need."""

    root: Path
    scan_url: str
    planted: list[Planted] = field(default_factory=list)
    known: dict[str, bytes] = field(default_factory=dict)  # key under the scan root -> bytes written
    fifos: list[Path] = field(default_factory=list)
    url_chars: bool = False
    cases: int = 0
    manifests: int = 0
    keys: int = 0


# ------------------------------------------------------------------------------ generators


def _tensor(rnd: random.Random, nbytes: int) -> bytes:
    import numpy as np
    import torch

    gen = np.random.default_rng(rnd.getrandbits(64))
    buf = io.BytesIO()
    torch.save({"w": torch.from_numpy(gen.standard_normal(max(1, nbytes // 4), dtype=np.float32))}, buf)
    return buf.getvalue()


def guide_files(rnd: random.Random, step: int | None, *, names: tuple[str, ...] = ("rank-0000/model.pt",),
                listed: bool = True) -> dict[str, bytes]:
    """A well-formed guide checkpoint's files; ``metadata.json`` lists sizes and sha256s
    (``listed``) and the step (when not None)."""
    files = {n: _tensor(rnd, rnd.randrange(300, 3000)) for n in names}
    meta: dict[str, Any] = {"loss": round(rnd.uniform(0.1, 4), 3)}
    if step is not None:
        meta["step"] = step
    if listed:
        meta["files"] = {k: {"size": len(v), "sha256": hashlib.sha256(v).hexdigest()} for k, v in files.items()}
    files["metadata.json"] = json.dumps(meta).encode()
    return files


_BOMBS: dict[tuple[int, bool], bytes] = {}


def zip_bomb(inflated: int, *, lie: bool) -> bytes:
    """A torch-style zip whose one deflated member holds ``inflated`` bytes of zeros (a few
    hundred times smaller on disk); with ``lie`` its headers say it holds 1,000 bytes. Made once."""
    import struct
    import zipfile

    made = _BOMBS.get((inflated, lie))
    if made is None:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            zf.writestr(zipfile.ZipInfo("archive/data.pkl"), b"\x80\x02}q\x00.", compress_type=zipfile.ZIP_STORED)
            member = zipfile.ZipInfo("archive/data/0")
            member.compress_type = zipfile.ZIP_DEFLATED  # a ZipInfo is stored unless told
            with zf.open(member, "w") as fh:
                zero = bytes(1 << 20)
                for _ in range(inflated >> 20):
                    fh.write(zero)
        data = bytearray(buf.getvalue())
        if lie:
            at = data.find(b"PK\x03\x04", 1)
            struct.pack_into("<I", data, at + 22, 1000)
            cd = data.rfind(b"PK\x01\x02")
            struct.pack_into("<I", data, cd + 24, 1000)
        made = _BOMBS[(inflated, lie)] = bytes(data)
    return made


def pickle_bomb(objects: int) -> bytes:
    """A pickle that builds ``objects`` objects from four bytes of opcodes each."""
    return b"\x80\x02cdcp.bomb\nX\nq\x00]q\x01(" + b"h\x00)R" * objects + b"e."


def hostile_data(rnd: random.Random) -> bytes:
    """A data file whose bytes look like a format the codec reads for hints, and lie; or a bomb."""
    import struct
    import zipfile

    def safetensors(header: bytes) -> bytes:
        return struct.pack("<Q", len(header)) + header + rnd.randbytes(rnd.randrange(0, 500))

    good = _tensor(rnd, 600)
    options: list[Callable[[], bytes]] = [
        lambda: safetensors(b'{"a":' * 30_000 + b"1" + b"}" * 30_000),
        lambda: safetensors(b'{"w": {"dtype": "F32", "data_offsets": [0, ' + b"9" * 5000 + b"]}}"),
        lambda: safetensors(b'{"w": {"dtype": "BF16", "data_offsets": [100, 2]}, "x": {"dtype": "F32", '
                            b'"data_offsets": [0, 99999999]}}'),
        lambda: struct.pack("<Q", 2**63) + b"{" + rnd.randbytes(100),
        lambda: good[: rnd.randrange(1, len(good))],
        lambda: good[:30] + rnd.randbytes(200) + good[230:],
        lambda: b"PK\x03\x04" + struct.pack("<HHHHHIIIHH", 20, 8, 0, 0, 0, 0, 0xFFFFFFFF, 0, 65535, 65535)
        + rnd.randbytes(300),
        lambda: b"PK\x03\x04" * 1000,
        lambda: zip_bomb(BOMB_BYTES, lie=False),
        lambda: zip_bomb(BOMB_BYTES, lie=True),
        lambda: _stored_zip({"archive/data.pkl": pickle_bomb(rnd.choice([100_000, 1_000_000])),
                             "archive/data/0": rnd.randbytes(64)}, zipfile),
    ]
    return rnd.choice(options)()


def _stored_zip(members: dict[str, bytes], zipfile: Any) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def hostile_metadata(rnd: random.Random, step: int, files: dict[str, bytes]) -> bytes:
    """A ``metadata.json`` that is broken, odd or lying."""
    good = json.dumps({"step": step, "files": {k: {"size": len(v), "sha256": hashlib.sha256(v).hexdigest()}
                                               for k, v in files.items()}}).encode()
    options: list[Callable[[], bytes]] = [
        lambda: b"",
        lambda: good[: rnd.randrange(1, len(good))],
        lambda: rnd.randbytes(rnd.randrange(1, 400)),
        lambda: b"\xef\xbb\xbf" + good,
        lambda: good.decode().encode("utf-16"),
        lambda: rnd.choice([b"[]", b"null", b'"step"', b"42", b"true", b"{}"]),
        lambda: json.dumps({"step": rnd.choice([str(step), f" {step}", "0x10", "-1", "1e3", "١٢", "", "NaN"])}).encode(),
        lambda: b'{"step": %s}' % rnd.choice([b"1e308", b"-5", b"true", b"null", b"[1]", b"NaN", b"Infinity",
                                              str(10**30).encode(), str(step + 1).encode(),
                                              b"1" * 5000]),
        lambda: b'{"step": %d, "step": %d}' % (step, step + 1),
        lambda: b"[" * rnd.choice([1000, 100_000]) + b"]" * rnd.choice([0, 1000]),
        lambda: b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
        lambda: json.dumps({"step": step, "files": {rnd.choice(["../../etc/passwd", "/abs/x", "a\\b", "", ".",
                                                                 "rank-0000/../x", "x" * 3000]): "0" * 64}}).encode(),
        lambda: json.dumps({"step": step, "files": [{"path": "rank-0000/model.pt", "size": rnd.choice(
            [-1, "12", 1e20, None, [], 10**40]), "sha256": rnd.choice(["zz", "SHA256:" + "A" * 64, 5, None])}]}).encode(),
        lambda: json.dumps({"step": step, "loss": "nan", "sha256": {"rank-0000/model.pt": "f" * 64}}).encode(),
        lambda: json.dumps({"step": step, "files": {f"f{i}": {"size": i} for i in range(5000)}}).encode(),
        lambda: b" " * (2 << 20) + good,
    ]
    return rnd.choice(options)()


def well_formed_keys(prefix: str, files: dict[str, bytes]) -> bool:
    """True when every key is one a scan must catalog: safe, not ckptier's own (``.ckptier/``,
    manifests, temp files), and no directory above the checkpoint looks like a checkpoint itself."""
    from ckptier.storage.base import key_problem
    from ckptier.formats import is_own_file

    keys = [f"{prefix}/{rel}" for rel in files]
    if any(key_problem(k) is not None or is_own_file(k) for k in keys):
        return False
    above = prefix.split("/")[:-1]
    return not any(part.startswith(("step-", "checkpoint-", "rank-")) or "step=" in part or part.endswith(".ckpt")
                   for part in above)


#: Characters that URL parsing treats specially (catalog locations are URLs).
URL_CHARS = frozenset("%#?\n\t\r")


def _name(rnd: random.Random, url_chars: bool) -> str | bytes:
    """A path component: plain, hostile, or not UTF-8; with ``url_chars`` also ones holding
    characters that URL parsing eats (``%``, ``#``, ``?``, tab, newline)."""
    if rnd.random() < 0.05:
        return rnd.choice(_BAD_BYTES_NAMES)
    if rnd.random() < 0.5:
        return rnd.choice(["llm", "run", "exp-1", "m"]) + str(rnd.randrange(10))
    return rnd.choice([n for n in _NAMES if url_chars or not URL_CHARS & set(n)])


def _step(rnd: random.Random) -> int:
    r = rnd.random()
    if r < 0.15:
        return rnd.choice(_STEPS_EDGE)
    return rnd.randrange(1, 3000)


def _step_dir(rnd: random.Random, step: int) -> str:
    return rnd.choice([f"step-{step:08d}", f"step-{step:08d}", f"step-{step}", f"step-{step:020d}"])


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or (path.exists() and not path.is_file()):
        return  # never write through a FIFO or symlink the generator made
    path.write_bytes(data)


def _join(*parts: str | bytes) -> bytes:
    return b"/".join(p if isinstance(p, bytes) else os.fsencode(p) for p in parts)


class TreeWriter:
    """Writes tree cases under a batch's scan root."""

    def __init__(self, batch: Batch, rnd: random.Random) -> None:
        self.b, self.rnd = batch, rnd

    def file(self, key: bytes, data: bytes) -> None:
        path = Path(os.fsdecode(os.path.join(os.fsencode(self.b.root), key)))
        _write(path, data)
        with contextlib.suppress(UnicodeDecodeError):
            self.b.known[key.decode()] = data

    def case(self, name: str, archive: bool) -> None:
        """One job directory of 1-5 checkpoints."""
        rnd = self.rnd
        job_parts: list[str | bytes] = [name, _name(rnd, self.b.url_chars)]
        if rnd.random() < 0.2:
            job_parts.append(_name(rnd, self.b.url_chars))
        jobb = _join(*job_parts)
        safe_job = all(isinstance(p, str) for p in job_parts)
        job = jobb.decode() if safe_job else ""
        from ckptier.storage.base import key_problem

        if safe_job and key_problem(job + "/x") is not None:
            safe_job = False
        steps: list[int] = []
        if archive:  # around the milestone (1000) so that one holds it
            base = sorted(rnd.sample(range(100, 2000, 100), rnd.randrange(2, 4)))
        else:
            base = [_step(rnd) for _ in range(rnd.randrange(1, 3))]
        for step in base:
            if steps and rnd.random() < 0.08:
                step = rnd.choice(steps)  # a duplicate step in another spelling
            steps.append(step)
            self.checkpoint(jobb, job if safe_job else None, name, step)
        if rnd.random() < 0.3:
            self.job_clutter(jobb)

    def checkpoint(self, jobb: bytes, job: str | None, case: str, step: int) -> None:
        rnd = self.rnd
        kind = rnd.choices(
            ["valid", "valid-unlisted", "valid-ranks", "valid-names", "valid-symlink", "meta", "empty-data",
             "no-meta", "missing-listed", "wrong-hash", "wrong-size", "extra-file", "fifo", "symlink-bad",
             "hf", "lightning", "dcp", "odd-step", "nested", "own-names", "hostile-data"],
            weights=[10, 2, 2, 2, 1, 6, 1, 1, 1, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1, 2])[0]
        sdir = _step_dir(rnd, step)
        prefix = jobb + b"/" + sdir.encode()
        if os.path.lexists(os.path.join(os.fsencode(self.b.root), prefix)):
            return  # the same spelling of a step twice: one directory
        valid = kind.startswith("valid") and job is not None and step <= MAX_STEP
        files: dict[str, bytes]
        if kind == "valid-names":
            names = tuple(sorted({f"rank-0000/{rnd.choice(['model', 'mödel €', 'a b', 'x' * 100, '日本'])}.pt",
                                  "rank-0000/optimizer.pt"}))
            files = guide_files(rnd, step, names=names)
        elif kind == "valid-ranks":
            files = guide_files(rnd, step, names=tuple(f"rank-{r:04d}/model.pt" for r in range(rnd.randrange(2, 5))))
        elif kind == "valid-unlisted":
            files = guide_files(rnd, step if rnd.random() < 0.5 else None, listed=False)
        elif kind in ("hf", "lightning", "dcp"):
            self.other_format(jobb, kind, step)
            return
        elif kind == "odd-step":
            sdir = rnd.choice(["step-١٢٣", "step--1", "step-1e3", "step-", "step-0x10", "step-12a", "step- 12",
                               "step-１２", "Step-00000012", "step-00000012.tmp"])
            prefix = jobb + b"/" + sdir.encode()
            if os.path.lexists(os.path.join(os.fsencode(self.b.root), prefix)):
                return
            files = guide_files(rnd, None)
        elif kind == "nested":
            inner = f"step-{_step(rnd):08d}"
            files = {f"{inner}/metadata.json": b"{}", "rank-0000/model.pt": _tensor(rnd, 500),
                     "metadata.json": json.dumps({"step": step}).encode()}
        elif kind == "own-names":
            files = guide_files(rnd, step)
            files[rnd.choice([".ckptier/upload.json", "ckptier-manifest.json", ".ckptier-tmp-abc",
                              "rank-0000/ckptier-manifest.json"])] = b'{"ckptier": "upload", "keys": ["../x"]}'
        else:
            files = guide_files(rnd, step)
            if kind == "meta":
                files["metadata.json"] = hostile_metadata(rnd, step, files)
            elif kind == "empty-data":
                files["rank-0000/model.pt"] = b""
            elif kind == "no-meta":
                del files["metadata.json"]
            elif kind == "missing-listed":
                del files["rank-0000/model.pt"]
            elif kind == "wrong-hash":
                meta = json.loads(files["metadata.json"])
                meta["files"]["rank-0000/model.pt"]["sha256"] = "0" * 64
                files["metadata.json"] = json.dumps(meta).encode()
            elif kind == "wrong-size":
                meta = json.loads(files["metadata.json"])
                meta["files"]["rank-0000/model.pt"]["size"] += 1
                files["metadata.json"] = json.dumps(meta).encode()
            elif kind == "extra-file":
                files["rank-0000/notes.txt"] = b"extra"
            elif kind == "hostile-data":
                files["rank-0000/model.pt"] = hostile_data(rnd)
                meta = json.loads(files["metadata.json"])
                meta["files"]["rank-0000/model.pt"] = {"size": len(files["rank-0000/model.pt"]), "sha256": hashlib.sha256(
                    files["rank-0000/model.pt"]).hexdigest()}
                files["metadata.json"] = json.dumps(meta).encode()
        for rel, data in files.items():
            self.file(prefix + b"/" + rel.encode(), data)
        if kind == "valid-symlink":  # a file that is a symlink to a file outside the checkpoint
            target = Path(os.fsdecode(os.path.join(os.fsencode(self.b.root), jobb))) / f"target-{step}.bin"
            data = _tensor(rnd, 700)
            _write(target, data)
            link = Path(os.fsdecode(os.path.join(os.fsencode(self.b.root), prefix))) / "rank-0000" / "extra.pt"
            os.symlink(target, link)
            files["rank-0000/extra.pt"] = data
            with contextlib.suppress(UnicodeDecodeError):
                self.b.known[(prefix + b"/rank-0000/extra.pt").decode()] = data
        if kind in ("fifo", "symlink-bad"):
            where = Path(os.fsdecode(os.path.join(os.fsencode(self.b.root), prefix))) / "rank-0000"
            self.special(where / rnd.choice(["optimizer.pt", "model.pt", "extra.pt"]), fifo=kind == "fifo")
        try:
            pfx = prefix.decode()
        except UnicodeDecodeError:
            pfx, valid = "", False
        if valid and not well_formed_keys(pfx, files):
            valid = False
        self.b.planted.append(Planted(case, job or "", step, pfx, files, valid))

    def special(self, path: Path, *, fifo: bool) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        if fifo:
            os.mkfifo(path)
            self.b.fifos.append(path)
            return
        target = self.rnd.choice(["/dev/zero", str(path), str(path.parent), str(path) + ".nowhere", "/proc/self/mem"])
        os.symlink(target, path)

    def other_format(self, jobb: bytes, kind: str, step: int) -> None:
        rnd = self.rnd
        job = jobb.decode(errors="replace")
        if kind == "hf":
            d = jobb + f"/checkpoint-{step}".encode()
            self.b.planted.append(Planted(job.split("/")[0], job, step, d.decode(errors="replace"), {}, False))
            state = rnd.choice([json.dumps({"global_step": step, "log_history": [{"loss": 1.0}]}).encode(),
                                json.dumps({"global_step": step + 1}).encode(), b"{", b"[]",
                                json.dumps({"global_step": str(step)}).encode()])
            self.file(d + b"/trainer_state.json", state)
            self.file(d + b"/" + rnd.choice([b"model.safetensors", b"pytorch_model.bin"]),
                      _tensor(rnd, 800) if rnd.random() < 0.5 else hostile_data(rnd))
            if rnd.random() < 0.5:
                self.file(d + b"/model.safetensors.index.json",
                          rnd.choice([b"{}", b'{"weight_map": {"a": "../x.safetensors"}}', b"\x00"]))
        elif kind == "lightning":
            name = rnd.choice([f"epoch=0-step={step}.ckpt", f"step={step}.ckpt", "last.ckpt", "step=abc.ckpt",
                               f"epoch=0-step={step}-v1.ckpt", f"step={step}.ckpt.tmp"])
            key = jobb + b"/" + name.encode()
            self.file(key, _tensor(rnd, 900) if rnd.random() < 0.8 else b"")
            self.b.planted.append(Planted(job.split("/")[0], job, step, key.decode(errors="replace"), {}, False))
            path = os.path.join(os.fsencode(self.b.root), key)
            old = time.time() - 3600
            os.utime(path, (old, old))
        else:
            d = jobb + f"/step-{step}".encode()
            self.b.planted.append(Planted(job.split("/")[0], job, step, d.decode(errors="replace"), {}, False))
            self.file(d + b"/__0_0.distcp", rnd.randbytes(600))
            if rnd.random() < 0.2:  # a pickle bomb where DCP keeps its metadata
                self.file(d + b"/.metadata", pickle_bomb(rnd.choice([100_000, 2_000_000])))
            elif rnd.random() < 0.7:
                self.file(d + b"/.metadata", rnd.randbytes(rnd.randrange(0, 200)))

    def job_clutter(self, jobb: bytes) -> None:
        rnd = self.rnd
        root = Path(os.fsdecode(os.path.join(os.fsencode(self.b.root), jobb)))
        choice = rnd.choice(["readme", "loop", "dir-link", "empty-dir", "fifo", "own"])
        if choice == "readme":
            self.file(jobb + b"/README", b"hello")
        elif choice == "loop":
            root.mkdir(parents=True, exist_ok=True)
            os.symlink(root, root / "loop")
        elif choice == "dir-link":
            root.mkdir(parents=True, exist_ok=True)
            os.symlink("/", root / "rootfs")
        elif choice == "empty-dir":
            (root / "step-00000999").mkdir(parents=True, exist_ok=True)
        elif choice == "fifo":
            self.special(root / "metadata.json", fifo=True)
        else:
            self.file(jobb + b"/.ckptier/upload.json", b"[")


# ------------------------------------------------------------------------------ S3 key sets


#: S3's limit on a key's length, in bytes of UTF-8.
S3_KEY_MAX = 1024


def s3_case(b: Batch, rnd: random.Random, s3: Any, bucket: str, base: str, name: str) -> None:
    """One job's objects in S3: a well-formed checkpoint or two, and keys only S3 allows."""
    job = f"{name}/{rnd.choice(['llm', 'ünï', 'a b', 'x' * 200])}"
    for _ in range(rnd.randrange(1, 3)):
        step = rnd.randrange(1, 3000)
        prefix = f"{job}/step-{step:08d}"
        files = guide_files(rnd, step)
        hostile = rnd.random() < 0.6
        # The longest key S3 allows (1,024 bytes of UTF-8; real servers refuse longer ones).
        longest = "rank-0000/" + "y" * (S3_KEY_MAX - len(f"{base}/{prefix}/rank-0000/.pt".encode())) + ".pt"
        if hostile:
            extra = rnd.choice([
                "rank-0000//model.pt", "./rank-0000/model.pt", "rank-0000/./x.pt", "rank-0000/../model.pt",
                "rank-0000/", "rank-0000/model.pt/", "rank-0000/model.pt/inner.pt", "rank-0000",
                "rank-0000\\model.pt", "rank-0000/\x01ctl.pt", longest,
                "rank-0000/e\u0301.pt", "rank-0000/\u00e9.pt", ".ckptier-canary/zz", "ckptier-manifest.json",
                "rank-0000/.ckptier-tmp-1", "metadata.json/x",
            ])
            files[extra] = b"" if extra.endswith("/") else _tensor(rnd, 300)
        for rel, data in files.items():
            key = f"{base}/{prefix}/{rel}"
            s3.put_object(Bucket=bucket, Key=key, Body=data)
            b.known[f"{prefix}/{rel}"] = data
        from ckptier.storage.base import key_problem

        valid = not hostile and key_problem(prefix) is None
        b.planted.append(Planted(name, job, step, prefix, files, valid))


# ------------------------------------------------------------------------------ archive damage


def damage_copy(adir: Path, rnd: random.Random, b: Batch, other: Path | None) -> str:
    """Mangle the archive copy in directory ``adir``; return what was done."""
    mpath = adir / "ckptier-manifest.json"
    doc = json.loads(mpath.read_bytes())
    datas = sorted(p for p in adir.rglob("*.ckz") if p.is_file())
    what = rnd.choice([
        "manifest-truncated", "manifest-garbage", "manifest-empty", "manifest-nested", "manifest-crc",
        "manifest-size", "manifest-relpath-climb", "manifest-stored-climb", "manifest-stored-absolute",
        "manifest-duplicate", "manifest-extra-file", "manifest-missing-file", "manifest-version",
        "manifest-huge-size", "manifest-types", "manifest-nan", "manifest-gone", "manifest-dir", "manifest-loop",
        "manifest-fifo", "data-flip", "data-truncate", "data-gone", "data-empty", "data-swap", "data-fifo",
        "data-zero", "data-dir", "stray-object", "marker-garbage", "marker-nested",
    ])
    f0 = doc["files"][0]
    if what == "manifest-truncated":
        mpath.write_bytes(mpath.read_bytes()[: rnd.randrange(1, mpath.stat().st_size)])
    elif what == "manifest-garbage":
        mpath.write_bytes(rnd.randbytes(300))
    elif what == "manifest-empty":
        mpath.write_bytes(b"")
    elif what == "manifest-nested":
        mpath.write_bytes(b"[" * 100_000)
    elif what == "manifest-crc":
        f0["crc64nvme"] = "AAAAAAAAAAA="
    elif what == "manifest-size":
        f0["size"] += 1
    elif what == "manifest-relpath-climb":
        f0["relpath"] = "../../../../escaped-" + str(rnd.randrange(10**6))
    elif what == "manifest-stored-climb" and f0.get("stored"):
        f0["stored"]["key"] = "../../../../outside.ckz"
    elif what == "manifest-stored-absolute" and f0.get("stored"):
        f0["stored"]["key"] = "/etc/passwd"
    elif what == "manifest-duplicate":
        doc["files"].append(dict(f0))
    elif what == "manifest-extra-file":
        doc["files"].append({**f0, "relpath": "zz-extra.pt"})
    elif what == "manifest-missing-file":
        doc["files"] = doc["files"][1:] or []
    elif what == "manifest-version":
        doc["ckptier_manifest"] = 2
    elif what == "manifest-huge-size":
        f0["size"] = 10**20
    elif what == "manifest-types":
        f0["size"] = str(f0["size"])
    elif what == "manifest-nan":
        mpath.write_bytes(mpath.read_bytes().replace(b'"size": ', b'"size": NaN, "x": ', 1))
    elif what == "manifest-gone":
        mpath.unlink()
    elif what == "manifest-dir":
        mpath.unlink()
        mpath.mkdir()
    elif what == "manifest-loop":
        mpath.unlink()
        os.symlink(mpath, mpath)
    elif what == "manifest-fifo":
        mpath.unlink()
        os.mkfifo(mpath)
        b.fifos.append(mpath)
    elif what.startswith("data-") and datas:
        d = rnd.choice(datas)
        raw = bytearray(d.read_bytes())
        if what == "data-flip" and raw:
            raw[rnd.randrange(len(raw))] ^= 1 << rnd.randrange(8)
            d.write_bytes(bytes(raw))
        elif what == "data-truncate":
            d.write_bytes(bytes(raw[: len(raw) // 2]))
        elif what == "data-gone":
            d.unlink()
        elif what == "data-empty":
            d.write_bytes(b"")
        elif what == "data-swap" and other is not None:
            donors = sorted(p for p in other.rglob("*.ckz") if p.is_file())
            if donors:
                shutil.copyfile(rnd.choice(donors), d)
        elif what == "data-fifo":
            d.unlink()
            os.mkfifo(d)
            b.fifos.append(d)
        elif what == "data-zero":
            d.unlink()
            os.symlink("/dev/zero", d)
        elif what == "data-dir":
            d.unlink()
            d.mkdir()
    elif what == "stray-object":
        (adir / "stray.ckz").write_bytes(b"not ours")
    elif what == "marker-garbage":
        (adir / ".ckptier").mkdir(exist_ok=True)
        (adir / ".ckptier" / "upload.json").write_bytes(rnd.randbytes(50))
    elif what == "marker-nested":
        (adir / ".ckptier").mkdir(exist_ok=True)
        (adir / ".ckptier" / "upload.json").write_bytes(b"[" * 100_000)
    if what.startswith("manifest-") and what not in ("manifest-truncated", "manifest-garbage", "manifest-empty",
                                                      "manifest-nested", "manifest-nan", "manifest-gone",
                                                      "manifest-dir", "manifest-loop", "manifest-fifo"):
        mpath.write_bytes(json.dumps(doc).encode())
    return what


# ------------------------------------------------------------------------------ tampering after the scan


def tamper(b: Batch, p: Planted, rnd: random.Random) -> None:
    """Swap one of ``p``'s files after the scan."""
    rels = sorted(r for r in p.files if r != "metadata.json")
    if not rels or not p.prefix:
        return
    path = b.root / p.prefix / rnd.choice(rels)
    if not path.is_file() or path.is_symlink():
        return
    how = rnd.choice(["fifo", "zero", "truncate", "grow", "gone", "dir", "loop"])
    data = path.read_bytes()
    path.unlink()
    if how == "fifo":
        os.mkfifo(path)
        b.fifos.append(path)
    elif how == "zero":
        os.symlink("/dev/zero", path)
    elif how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "grow":
        path.write_bytes(data + b"\0" * 100)
    elif how == "dir":
        path.mkdir()
    elif how == "loop":
        os.symlink(path, path)
    p.tampered = True


# ------------------------------------------------------------------------------ running a batch


class Hang(Exception):
    """A command ran past :data:`HANG_SECONDS`."""


@contextlib.contextmanager
def watchdog(b: Batch, seconds: int = HANG_SECONDS) -> Iterator[None]:
    """Raise :class:`Hang` in this (main) thread after ``seconds``, first waking any reader
    blocked on one of the batch's FIFOs. A timer thread sends SIGUSR1 to the main thread (a
    real signal interrupts a blocking call; SIGALRM stays free for pytest-timeout)."""
    main = threading.main_thread().ident
    assert main is not None and threading.get_ident() == main, "the watchdog guards the main thread"

    def on_signal(signum: int, frame: Any) -> None:
        raise Hang(f"still running after {seconds} s")

    def fire() -> None:
        release_fifos(b)
        signal.pthread_kill(main, signal.SIGUSR1)

    old = signal.signal(signal.SIGUSR1, on_signal)
    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, old)


def release_fifos(b: Batch) -> None:
    """Wake any reader blocked on one of the batch's FIFOs (opening a FIFO for writing does)."""
    for path in b.fifos:
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


class Fuzz:
    """Runs batches and records what the oracles find in the chaos bench's ``Findings``."""

    def __init__(self, findings: Any, rnd: random.Random, root: Path, s3: Any, bucket: str,
                 log: Callable[[str], None]) -> None:
        from chaos import cli, traceback_in

        self.cli, self.traceback_in = cli, traceback_in
        self.f, self.rnd, self.root, self.s3, self.bucket, self.log = findings, rnd, root, s3, bucket, log
        self.stats = findings.fuzz
        self.timing: dict[str, float] = {}
        findings.tally("fuzz")

    def bad(self, what: str, line: str) -> None:
        if what == "hang":
            self.stats["hangs"] = self.stats.get("hangs", 0) + 1
            what = "crash"
        self.f.add("fuzz", what, line)

    def command(self, b: Batch, label: str, *argv: str, ok: tuple[int, ...] = (0,)) -> Any:
        run = None
        t0 = time.monotonic()
        try:
            with watchdog(b):
                run = self.cli(*argv)
            self.timing[argv[0]] = self.timing.get(argv[0], 0.0) + time.monotonic() - t0
        except Hang as exc:
            self.bad("hang", f"{label}: ckptier {argv[0]} {exc}")
            return None
        if self.traceback_in(run):
            hang = "Hang: still running" in run.err
            self.bad("hang" if hang else "crash", f"{label}: {run.line()}\n{run.err[-2500:]}")
        elif run.rc not in ok:
            self.bad("violation", f"{label}: {run.line()}\n{run.out[-800:]}")
        return run

    def batch(self, n: int, *, s3: bool) -> Batch:
        t0 = time.monotonic()
        try:
            return self._batch(n, s3=s3)
        finally:
            self.timing["generate"] = self.timing.get("generate", 0.0) + time.monotonic() - t0

    def _batch(self, n: int, *, s3: bool) -> Batch:
        root = self.root / f"batch-{n:04d}"
        (root / "hot").mkdir(parents=True)
        rnd = self.rnd
        if s3:
            base = f"fuzz-{n:04d}/hot"
            b = Batch(root / "hot", f"s3://{self.bucket}/{base}")
            for i in range(BATCH):
                s3_case(b, rnd, self.s3, self.bucket, base, f"{'a' if rnd.random() < 0.3 else 'k'}{n:04d}{i:03d}")
                b.keys += 1
        else:
            b = Batch(root / "hot", str(root / "hot"), url_chars=rnd.random() < 0.2 and "url-chars" not in SKIP)
            w = TreeWriter(b, rnd)
            for i in range(BATCH):
                archive = rnd.random() < 0.3
                w.case(f"{'a' if archive else 'k'}{n:04d}{i:03d}", archive)
        b.cases = BATCH
        return b

    def config(self, b: Batch, hot_after: str) -> Path:
        path = b.root.parent / f"ckptier-{hot_after}.toml"
        path.write_text(
            "[[policy]]\n"
            'jobs = "a*"\n'
            "keep_last = 1\n"
            "min_verified = 1\n"
            "milestones = [1000]\n"
            f'hot_after_archive = "{hot_after}"\n'
            f'archive = "{b.root.parent / "archive"}"\n'
            "\n[[policy]]\n"
            'jobs = "*"\n'
            "keep_last = 2\n"
            "min_verified = 1\n"
        )
        return path

    def run_batch(self, n: int, *, s3: bool) -> Batch:
        """One batch through every command and oracle; returns it (for its counts and directory).
        Its hostile archives must not grow this process's peak memory by more than
        :data:`MAX_BATCH_GROWTH`."""
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
        try:
            return self._run_batch(n, s3=s3)
        finally:
            grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - peak
            if grown > MAX_BATCH_GROWTH:
                self.bad("violation", f"fuzz batch {n}: peak memory grew by {grown >> 20} MiB (over "
                                      f"{MAX_BATCH_GROWTH >> 20} MiB): something decoded a bomb whole")

    def _run_batch(self, n: int, *, s3: bool) -> Batch:
        b = self.batch(n, s3=s3)
        label = f"fuzz batch {n} ({'S3 keys' if s3 else 'trees'})"
        catalog = f"sqlite:///{b.root.parent / 'catalog.db'}"
        keep, delete = self.config(b, "keep"), self.config(b, "delete")

        def args(cmd: str, *more: str, config: Path = keep) -> list[str]:
            return [cmd, "--catalog", catalog, "--config", str(config), *more]

        scan = self.command(b, label, *args("scan", "--no-prefect", "--json", b.scan_url))
        if scan is None or scan.rc != 0:
            release_fifos(b)
            return b
        if not s3:
            for p in b.planted:
                if self.rnd.random() < 0.06:
                    tamper(b, p, self.rnd)
        self.command(b, label, *args("verify", "--no-prefect"), ok=(0, 1))
        self.cataloged(b, label, catalog)
        self.command(b, label, *args("plan", "--json"))
        self.command(b, label, *args("apply", "--no-prefect"), ok=(0, 1))
        if not s3:
            self.damage(b, catalog)
        self.command(b, label, *args("verify", "--no-prefect", "--deep"), ok=(0, 1))
        self.command(b, label, *args("apply", "--no-prefect", config=delete), ok=(0, 1))
        self.command(b, label, *args("scan", "--no-prefect", b.scan_url))
        self.command(b, label, *args("apply", "--no-prefect", config=delete), ok=(0, 1))
        self.command(b, label, *args("ls", "--json", "--all"))
        self.command(b, label, *args("janitor", "--older-than", "1h", config=delete))
        self.fetch_all(b, label, catalog, delete)
        self.leftovers(b, label, catalog)
        release_fifos(b)
        return b

    # -- oracles

    def cataloged(self, b: Batch, label: str, catalog: str) -> None:
        """Every well-formed checkpoint is cataloged and verified, with exactly its files."""
        from ckptier.storage.catalog.api import Catalog

        groups: dict[tuple[str, int], int] = {}
        for p in b.planted:
            groups[(p.job, p.step)] = groups.get((p.job, p.step), 0) + 1
        with Catalog.open(catalog) as cat:
            records = {(r.job, r.step): r for r in cat.checkpoints(include_deleted=True)}
        self.stats["checkpoints"] = self.stats.get("checkpoints", 0) + len(records)
        for p in b.planted:
            if not p.valid or p.tampered or groups[(p.job, p.step)] > 1:
                continue
            r = records.get((p.job, p.step))
            if r is None:
                self.bad("violation", f"{label}: well-formed {p.prefix!r} was not cataloged as job {p.job!r} "
                                      f"step {p.step}")
                continue
            if r.state.value != "verified":
                self.bad("violation", f"{label}: well-formed {p.prefix!r} is {r.state.value}: {r.state_reason}")
            got = {f.relpath: f.size for f in r.files}
            want = {rel: len(data) for rel, data in p.files.items()}
            if got != want:
                self.bad("violation", f"{label}: {p.prefix!r} cataloged with files {sorted(got)[:5]}, "
                                      f"wrote {sorted(want)[:5]}")

    def damage(self, b: Batch, catalog: str) -> None:
        """Mangle some committed archive copies of well-formed checkpoints (manifest cases)."""
        from ckptier.storage.catalog.api import Catalog

        archive = b.root.parent / "archive"
        with Catalog.open(catalog) as cat:
            copies = {(r.job, r.step): r for r in cat.checkpoints() if r.archive_copy() is not None}
        dirs = []
        for p in b.planted:
            if (p.job, p.step) in copies and p.valid:
                d = archive / p.job / f"step-{p.step:08d}"
                if (d / "ckptier-manifest.json").is_file():
                    dirs.append((p, d))
        self.rnd.shuffle(dirs)
        for i, (p, d) in enumerate(dirs[: max(1, len(dirs) * 2 // 3)]):
            other = dirs[(i + 1) % len(dirs)][1] if len(dirs) > 1 else None
            manifest = d / "ckptier-manifest.json"
            if manifest.is_symlink() or not manifest.is_file():
                continue  # already mangled as another copy's neighbour (a swap, a loop): once is enough
            p.archived_damage = damage_copy(d, self.rnd, b, other)
            b.manifests += 1

    def fetch_all(self, b: Batch, label: str, catalog: str, config: Path) -> None:
        """Fetch every cataloged checkpoint the generator planted; check bytes and where they went."""
        from ckptier.storage.catalog.api import Catalog

        with Catalog.open(catalog) as cat:
            records = {(r.job, r.step): r for r in cat.checkpoints()}
            newest: dict[str, int] = {}
            for r in cat.checkpoints(include_deleted=True, with_files=False):
                if r.state.value in ("verified", "deleted") and r.step > newest.get(r.job, -1):
                    newest[r.job] = r.step
        from ckptier.storage.url import open_store
        from ckptier.tasks.archive import prefix_from_location

        hot = open_store(b.scan_url, client=self.s3) if b.scan_url.startswith("s3://") else open_store(b.scan_url)
        groups: dict[tuple[str, int], int] = {}
        for p in b.planted:
            groups[(p.job, p.step)] = groups.get((p.job, p.step), 0) + 1
        outside_before = _snapshot(b.root.parent)
        out = b.root.parent / "fetch"
        out.mkdir()
        seen: set[tuple[str, int]] = set()
        for i, p in enumerate(b.planted):
            key = (p.job, p.step)
            r = records.get(key)
            if r is None or key in seen:
                continue
            seen.add(key)
            try:
                base = prefix_from_location(hot, r.location)
            except Exception:  # noqa: BLE001 - a location outside the scanned store: compare nothing
                base = None
            must = p.valid and not p.tampered and groups[key] == 1 and r.state.value == "verified"
            if not must and self.rnd.random() > FETCH_OTHERS:
                continue
            dest = out / str(i)
            run = self.command(b, label, "fetch", "--catalog", catalog, "--config", str(config), "--job", p.job,
                               "--step", str(p.step), str(dest), ok=(0, 1, 2))
            self.stats["fetches"] = self.stats.get("fetches", 0) + 1
            if run is None or run.rc is None:
                continue
            fetched = _files_under(dest)
            if run.rc == 0 and base is not None:
                if r.format.value == "lightning" or (len(r.files) == 1 and base.endswith(r.files[0].relpath)):
                    base = base.rpartition("/")[0]
                for rel, data in fetched.items():
                    want = b.known.get(f"{base}/{rel}" if base else rel)
                    if want is not None and want != data:
                        self.bad("violation", f"{label}: fetch of {p.job!r} step {p.step} gave {rel} "
                                              f"({len(data)} bytes) that is not what was written ({len(want)} bytes)")
            if must and run.rc != 0:
                self.bad("violation", f"{label}: well-formed {p.prefix!r} (archive: {p.archived_damage or 'intact'}) "
                                      f"cannot be fetched: {run.line()}")
            elif must and fetched != p.files:
                self.bad("violation", f"{label}: fetch of well-formed {p.prefix!r} is not bit-exact: wrote "
                                      f"{ {k: len(v) for k, v in fetched.items()} }, expected "
                                      f"{ {k: len(v) for k, v in p.files.items()} }")
        outside_after = _snapshot(b.root.parent)
        new = sorted(k for k in outside_after - outside_before if k != "fetch" and not k.startswith("fetch/"))
        if new:
            self.bad("violation", f"{label}: fetch wrote outside its DEST: {new[:3]}")
        for job, step in newest.items():
            r = records.get((job, step))
            if r is None:  # the newest verified (or deleted) one was deleted: was it verified and newest?
                with Catalog.open(catalog) as cat:
                    rec = cat.get(job, step)
                if rec is not None and rec.state.value == "deleted" and not any(
                        x.job == job and x.step > step for x in records.values()):
                    self.bad("violation", f"{label}: job {job!r}: its newest checkpoint (step {step}) was deleted")

    def leftovers(self, b: Batch, label: str, catalog: str) -> None:
        from ckptier.storage.catalog.api import Catalog
        from ckptier.tasks.leases import holder_is_gone

        now = datetime.now(UTC)
        with Catalog.open(catalog) as cat:
            for r in cat.checkpoints(include_deleted=True, with_files=False):
                h = cat.lease_holder(r.id, now=now)
                if h is not None and not holder_is_gone(h):
                    self.f.add("fuzz", "stuck", f"{label}: {r.job!r} step {r.step}: lease held by {h.describe()}")
            for intent in cat.delete_intents():
                self.f.add("fuzz", "stuck", f"{label}: {intent.job!r} step {intent.step}: delete intent left")


def _files_under(dest: Path) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    if not dest.is_dir():
        return out
    for p in dest.rglob("*"):
        if p.is_file() and not p.is_symlink():
            out[p.relative_to(dest).as_posix()] = p.read_bytes()
    return out


def _snapshot(root: Path) -> set[str]:
    """Every path under ``root`` (relative), not following symlinks; and what sits beside ``root``."""
    seen = {f"../{p.name}" for p in root.parent.iterdir()}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for name in dirnames + filenames:
            seen.add(os.path.normpath(os.path.join(rel, name)))
    return seen


def fuzz(cases: int, *, seed: int, root: Path, findings: Any, bucket: str, s3: Any,
         log: Callable[[str], None], skip_open: bool = False) -> None:
    """Run at least ``cases`` generated cases (trees, manifests, S3 key sets) from ``seed``.

    Each batch's directory (and S3 prefix) is removed afterwards, unless the
    batch found a problem: then it stays for a post-mortem, named in a line
    of ``findings.problems``."""
    rnd = random.Random(seed)
    SKIP.clear()
    if skip_open:
        SKIP.update(OPEN_DEFECTS)
    root.mkdir(parents=True, exist_ok=True)
    fz = Fuzz(findings, rnd, root, s3, bucket, log)
    st = findings.fuzz
    st["seed"] = seed
    t0 = time.monotonic()
    n = 0
    while st.get("cases", 0) < cases:
        s3_batch = n % S3_EVERY == 1  # the second batch, then every S3_EVERY-th
        before = len(findings.problems)
        b = fz.run_batch(n, s3=s3_batch)
        for k, v in (("trees", 0 if s3_batch else b.cases), ("keys", b.keys), ("manifests", b.manifests)):
            st[k] = st.get(k, 0) + v
        st["cases"] = st.get("trees", 0) + st.get("keys", 0) + st.get("manifests", 0)
        if len(findings.problems) == before:
            shutil.rmtree(b.root.parent, ignore_errors=True)
            if s3_batch:
                from chaos import empty_prefix

                empty_prefix(s3, f"fuzz-{n:04d}/")
        else:
            findings.problems.append(f"[fuzz] batch {n} kept for a post-mortem: {b.root.parent}")
        n += 1
        if n % 5 == 0:
            log(f"chaos fuzz: {st['cases']} cases in {n} batches, {time.monotonic() - t0:.0f}s; "
                f"problems so far {len(findings.problems)}; seconds by step: "
                + ", ".join(f"{k} {v:.0f}" for k, v in sorted(fz.timing.items(), key=lambda kv: -kv[1])))
    st["batches"] = n
