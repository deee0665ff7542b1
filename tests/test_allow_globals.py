"""Allowing a class (``--allow-global`` / ``allow_globals``) never lets a
checkpoint run code or touch files.

The probe list names classes across the standard library, numpy, torch and
classes of one's own, each with its verdict. For the dangerous ones a hostile
checkpoint does what an attacker would do with the class allowed; a child
process proves each one works (torch's own weights-only unpickler with the
class forced into its allowlist runs the payload), and the tests prove that
through ckptier nothing runs: the allow is refused, the load is refused, the
canary never appears.
"""

from __future__ import annotations

import enum
import gc
import json
import os
import select
import socket
import subprocess
import sys
import textwrap
import time
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

import pytest

from ckptier.storage.errors import ConfigError
from ckptier.tasks.allowlist import (
    ALREADY_ALLOWED,
    allow_global_check,
    check_allow_globals,
    import_global,
    plain_class_problem,
)
from ckptier.tasks.config import load_config
from ckptier.tasks.confine import landlock_abi
from ckptier.formats.safe_load import DEFAULT_ALLOWLIST, UnsafeCheckpoint, _allowed_names, safe_torch_load
from tests.fixtures.hostile import Build, Call, Global, New, Pairs, dumps, torch_file

HERE = __name__
REPO_ROOT = Path(__file__).resolve().parents[1]
CANARY_ENV = "ALLOW_TEST_CANARY_DIR"
T = TypeVar("T")


# --- plain data classes of one's own: allowed -----------------------------------


class Notes:
    """Rebuilt from its __dict__ alone (NEWOBJ + BUILD)."""

    def summary(self) -> str:  # an ordinary method: nothing in unpickling calls it
        return str(vars(self))


@dataclass
class TrainConfig:
    lr: float
    tags: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class FrozenSlots:
    lr: float
    name: str = "run"


@dataclass
class Box(Generic[T]):
    item: T


class Point(NamedTuple):
    x: float
    y: float


Pair = namedtuple("Pair", "left right")


class Color(enum.Enum):
    RED = 1
    BLUE = 2


class Planet(enum.Enum):
    EARTH = (5.97e24, 6.37e6)

    def __init__(self, mass: float, radius: float) -> None:  # runs once, when the class is made
        self.mass, self.radius = mass, radius


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


# --- classes of one's own that run code when unpickled: refused --------------------


def _touch(path: object) -> None:
    if isinstance(path, str) and path:
        Path(path).touch()


@dataclass
class PostInit:
    path: str

    def __post_init__(self) -> None:
        _touch(self.path)


class CustomInit:
    def __init__(self, path: str) -> None:
        _touch(path)


class CustomSetState:
    def __setstate__(self, state: dict[str, Any]) -> None:
        _touch(state.get("path"))


class CustomSetAttr:
    def __setattr__(self, key: str, value: Any) -> None:
        _touch(value)
        object.__setattr__(self, key, value)


class PropertySetter:
    @property
    def path(self) -> str:
        return ""

    @path.setter
    def path(self, value: str) -> None:
        _touch(value)


class Finalizer:
    def __del__(self) -> None:
        _touch(self.__dict__.get("path"))


class Hashed:
    def __hash__(self) -> int:
        _touch(self.__dict__.get("path"))
        return 0


class Compared:
    def __eq__(self, other: object) -> bool:
        _touch(self.__dict__.get("path"))
        return False

    __hash__ = object.__hash__


class LooksUp:
    def __getattr__(self, name: str) -> Any:
        _touch(self.__dict__.get("path"))
        raise AttributeError(name)


class CallingMeta(type):
    def __call__(cls, *args: Any) -> Any:
        _touch(args[0] if args else None)
        return super().__call__()


class WithMeta(metaclass=CallingMeta):
    pass


def _touch_from_env() -> list[str]:
    directory = os.environ.get(CANARY_ENV)
    if directory:
        _touch(str(Path(directory) / "factory"))
    return []


@dataclass
class CodeFactory:
    items: list[str] = field(default_factory=_touch_from_env)


class Missing(enum.Enum):
    A = 1

    @classmethod
    def _missing_(cls, value: object) -> Any:
        _touch(value)
        return None


class Reduced:
    def __reduce__(self) -> Any:
        return (Reduced, ())


class NoMembers(enum.Enum):
    pass


class DictLike(dict):  # type: ignore[type-arg]
    pass


class TupleLike(tuple):  # type: ignore[type-arg]
    pass


# --- the probe list -----------------------------------------------------------------


@dataclass(frozen=True)
class Canary:
    """What a payload leaves behind when it runs: a file that appears
    (``file``, or any file matching ``glob`` in its directory), a directory
    that disappears (``dir``), or a connection to a listening socket
    (``connect``)."""

    kind: str
    path: Path
    listener: socket.socket | None = None

    def fired(self) -> bool:
        if self.kind == "file":
            return self.path.exists()
        if self.kind == "glob":
            return any(self.path.parent.glob(self.path.name + "*"))
        if self.kind == "dir":
            return not self.path.exists()
        assert self.listener is not None
        return bool(select.select([self.listener], [], [], 0)[0])


Payload = Callable[[Path, socket.socket], tuple[Any, Canary]]


def _call_with_path(name: str, *extra: Any) -> Payload:
    def make(d: Path, _: socket.socket) -> tuple[Any, Canary]:
        canary = d / "canary"
        return Call(Global(name), (str(canary), *extra)), Canary("file", canary)
    return make


def _timer(d: Path, _: socket.socket) -> tuple[Any, Canary]:
    # timeit.Timer compiles its setup into a function; a carriage return is a
    # line break to the compiler but not to Timer's re-indenting, so the line
    # after it runs at module level, inside Timer.__init__.
    canary = d / "canary"
    setup = f"pass\rimport os; os.system('touch {canary}')\rdef g(_it, _timer):\r    pass"
    return Call(Global("timeit.Timer"), ("pass", setup)), Canary("file", canary)


def _popen(name: str) -> Payload:
    def make(d: Path, _: socket.socket) -> tuple[Any, Canary]:
        canary = d / "canary"
        return Call(Global(name), (["touch", str(canary)],)), Canary("file", canary)
    return make


def _shelf(d: Path, _: socket.socket) -> tuple[Any, Canary]:
    return Call(Global("shelve.DbfilenameShelf"), (str(d / "shelf"),)), Canary("glob", d / "shelf")


def _dumbdbm(d: Path, _: socket.socket) -> tuple[Any, Canary]:
    return Call(Global("dbm.dumb._Database"), (str(d / "db"), 0o666, "c")), Canary("glob", d / "db")


def _smtp(d: Path, listener: socket.socket) -> tuple[Any, Canary]:
    port = listener.getsockname()[1]
    return Call(Global("smtplib.SMTP"), ("127.0.0.1", port, None, 1.0)), Canary("connect", d, listener)


def _exec(d: Path, _: socket.socket) -> tuple[Any, Canary]:
    canary = d / "canary"
    return Call(Global("builtins.exec"), (f"open({str(canary)!r}, 'w').close()",)), Canary("file", canary)


def _memmap(d: Path, _: socket.socket) -> tuple[Any, Canary]:
    canary = d / "canary"
    return New(Global("numpy.memmap"), (str(canary), "uint8", "w+", 0, (4,))), Canary("file", canary)


def _datasource(d: Path, _: socket.socket) -> tuple[Any, Canary]:
    # DataSource.__del__ removes its "temporary" directory: any directory the file names.
    victim = d / "victim"
    victim.mkdir(exist_ok=True)
    (victim / "precious.txt").write_text("keep me")
    return Build(New(Global("numpy.lib.npyio.DataSource")), {"_istmpdest": True, "_destpath": str(victim)}), Canary("dir", victim)


def _own(name: str, make_node: Callable[[str], Any]) -> Payload:
    def make(d: Path, _: socket.socket) -> tuple[Any, Canary]:
        canary = d / "canary"
        return make_node(str(canary)), Canary("file", canary)
    return make


def _code_factory(d: Path, _: socket.socket) -> tuple[Any, Canary]:
    return Call(Global(f"{HERE}.CodeFactory"), ()), Canary("file", d / "factory")


@dataclass(frozen=True)
class Probe:
    """``name`` with its verdict (``ok``); ``payload`` builds a hostile
    checkpoint for a dangerous one; ``structural`` says the plain-data-class
    rule alone refuses it too, not only its module's name (a class behind an
    import with side effects is never imported to find out)."""

    name: str
    ok: bool
    payload: Payload | None = None
    structural: bool = True


def _mine(name: str) -> str:
    return f"{HERE}.{name}"


PROBES: list[Probe] = [
    # the standard library
    Probe("timeit.Timer", False, _timer),
    Probe("_sqlite3.Connection", False, _call_with_path("_sqlite3.Connection")),
    Probe("sqlite3.Connection", False, _call_with_path("sqlite3.Connection")),
    Probe("shelve.DbfilenameShelf", False, _shelf),
    Probe("shelve.Shelf", False),
    Probe("smtplib.SMTP", False, _smtp),
    Probe("socketserver.TCPServer", False),
    Probe("socketserver.UnixStreamServer", False, _call_with_path("socketserver.UnixStreamServer", None)),
    Probe("http.server.HTTPServer", False),
    Probe("subprocess.Popen", False, _popen("subprocess.Popen")),
    Probe("commands.Popen", False, _popen("commands.Popen"), structural=False),  # the Python 2 name of subprocess.Popen
    Probe("os.system", False),
    Probe("builtins.exec", False, _exec),
    Probe("builtins.eval", False),
    Probe("tempfile.TemporaryDirectory", False),
    Probe("logging.FileHandler", False, _call_with_path("logging.FileHandler")),
    Probe("zipfile.ZipFile", False, _call_with_path("zipfile.ZipFile", "w")),
    Probe("io.FileIO", False, _call_with_path("io.FileIO", "w")),
    Probe("mailbox.mbox", False, _call_with_path("mailbox.mbox")),
    Probe("dbm.dumb._Database", False, _dumbdbm),
    Probe("threading.Thread", False),
    Probe("weakref.finalize", False),
    Probe("functools.partial", False),
    Probe("copyreg._reconstructor", False),
    Probe("ctypes.CDLL", False),
    Probe("code.InteractiveConsole", False),
    Probe("pathlib.Path", False),
    Probe("uuid.UUID", False),
    Probe("decimal.Decimal", False),
    Probe("datetime.datetime", False),
    Probe("fractions.Fraction", False),
    Probe("string.Template", False),
    Probe("antigravity.Thing", False, structural=False),  # importing it opens a web browser
    Probe("this.Zen", False, structural=False),  # importing it prints
    Probe("idlelib.idle.Shell", False, structural=False),  # importing it starts IDLE
    Probe("argparse.Namespace", True),  # reviewed: Lightning saves hyper-parameters in one
    Probe("http.HTTPStatus", True),
    Probe("uuid.SafeUUID", True),
    Probe("re.RegexFlag", True),
    Probe("urllib.parse.SplitResult", True),
    Probe("collections.OrderedDict", True),  # already allowed by default
    # numpy
    Probe("numpy.memmap", False, _memmap),
    Probe("numpy.lib.npyio.DataSource", False, _datasource),
    Probe("numpy.lib.npyio.NpzFile", False),
    Probe("numpy.matrix", False),
    Probe("numpy.ma.MaskedArray", False),
    Probe("numpy.recarray", False),
    Probe("numpy.poly1d", False),
    Probe("numpy.vectorize", False),
    Probe("numpy.random.RandomState", False),
    Probe("numpy.dtypes.ObjectDType", False),
    Probe("numpy.ndarray", True),  # already allowed by default
    # torch
    Probe("torch.nn.Linear", False),
    Probe("torch.nn.Module", False),
    Probe("torch.optim.SGD", False),
    Probe("torch.Generator", False),
    Probe("torch.utils.data.DataLoader", False),
    Probe("torch.package.PackageExporter", False, _call_with_path("torch.package.PackageExporter")),
    Probe("torch.nn.utils.rnn.PackedSequence", False),
    Probe("torch.utils.hooks.RemovableHandle", False),
    Probe("torch.distributions.Normal", False),
    Probe("torch.distributed.checkpoint.metadata.TensorProperties", False),
    Probe("torch.distributed.checkpoint.metadata.ChunkStorageMetadata", True),
    Probe("torch.distributed.checkpoint.metadata.StorageMeta", True),
    Probe("torch.Size", True),  # already allowed by default
    # one's own
    Probe(_mine("Notes"), True),
    Probe(_mine("TrainConfig"), True),
    Probe(_mine("FrozenSlots"), True),
    Probe(_mine("Box"), True),
    Probe(_mine("Point"), True),
    Probe(_mine("Pair"), True),
    Probe(_mine("Color"), True),
    Probe(_mine("Planet"), True),
    Probe(_mine("Level"), True),
    Probe(_mine("PostInit"), False, _own("PostInit", lambda c: Call(Global(_mine("PostInit")), (c,)))),
    Probe(_mine("CustomInit"), False, _own("CustomInit", lambda c: Call(Global(_mine("CustomInit")), (c,)))),
    Probe(_mine("CustomSetState"), False, _own("CustomSetState", lambda c: Build(New(Global(_mine("CustomSetState"))), {"path": c}))),
    Probe(_mine("CustomSetAttr"), False, _own("CustomSetAttr", lambda c: Build(New(Global(_mine("CustomSetAttr"))), (None, {"path": c})))),
    Probe(_mine("PropertySetter"), False, _own("PropertySetter", lambda c: Build(New(Global(_mine("PropertySetter"))), (None, {"path": c})))),
    Probe(_mine("Finalizer"), False, _own("Finalizer", lambda c: Build(New(Global(_mine("Finalizer"))), {"path": c}))),
    Probe(_mine("Hashed"), False, _own("Hashed", lambda c: Pairs(((Build(New(Global(_mine("Hashed"))), {"path": c}), 1),)))),
    Probe(_mine("Compared"), False, _own("Compared", lambda c: Call(Build(New(Global(_mine("Compared"))), {"path": c}), ()))),
    Probe(_mine("LooksUp"), False, _own("LooksUp", lambda c: Build(Build(New(Global(_mine("LooksUp"))), {"path": c}), {"x": 1}))),
    Probe(_mine("WithMeta"), False, _own("WithMeta", lambda c: Call(Global(_mine("WithMeta")), (c,)))),
    Probe(_mine("CodeFactory"), False, _code_factory),
    Probe(_mine("Missing"), False, _own("Missing", lambda c: Call(Global(_mine("Missing")), (c,)))),
    Probe(_mine("Reduced"), False),
    Probe(_mine("NoMembers"), False),
    Probe(_mine("DictLike"), False),
    Probe(_mine("TupleLike"), False),
]

HOSTILE = [p for p in PROBES if p.payload is not None]


def test_the_probe_list_is_broad() -> None:
    tops = {p.name.split(".", 1)[0] for p in PROBES}
    assert len(PROBES) >= 40 and {"numpy", "torch", "tests"} <= tops
    assert sum(1 for p in PROBES if p.name.split(".", 1)[0] in sys.stdlib_module_names) >= 20
    assert len(HOSTILE) >= 20


@pytest.mark.parametrize("probe", PROBES, ids=lambda p: p.name)
def test_probe_verdict(probe: Probe) -> None:
    problem = allow_global_check(probe.name)
    if probe.ok:
        assert problem is None, problem
        return
    assert problem is not None
    assert "\n" not in problem and "--allow-global" not in problem  # one line, never advice to allow something
    if probe.structural:
        # The plain-data-class rule alone refuses it: a module missing from the
        # name list would not let it through.
        assert plain_class_problem(import_global(probe.name)) is not None


def test_modules_with_import_side_effects_are_never_imported() -> None:
    for name in ("antigravity.Thing", "this.Zen", "idlelib.idle.Shell", "__phello__.spam", "mypkg.__main__.Cli"):
        assert allow_global_check(name) is not None
    assert not {"antigravity", "this", "idlelib", "__phello__", "mypkg"} & set(sys.modules)


def test_refusals_say_why_in_one_line() -> None:
    assert "module 'timeit' can run code" in (allow_global_check("timeit.Timer") or "")
    assert "memmap defines __new__" in (allow_global_check("numpy.memmap") or "")
    assert "Python 2 name of subprocess.Popen" in (allow_global_check("commands.Popen") or "")
    assert "PostInit defines __post_init__" in (allow_global_check(_mine("PostInit")) or "")
    assert "default_factory" in (allow_global_check(_mine("CodeFactory")) or "")
    assert "without members" in (allow_global_check(_mine("NoMembers")) or "")
    assert "setter" in (allow_global_check(_mine("PropertySetter")) or "")


def test_names_allowed_by_default_really_load_by_default() -> None:
    allowed = _allowed_names(DEFAULT_ALLOWLIST)
    assert allowed is not None and ALREADY_ALLOWED <= allowed


# --- hostile checkpoints ----------------------------------------------------------------


@pytest.fixture
def listener() -> Any:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield sock
    sock.close()


def _hostile_file(probe: Probe, d: Path, listener: socket.socket) -> tuple[Path, Canary]:
    assert probe.payload is not None
    d.mkdir(parents=True, exist_ok=True)
    node, canary = probe.payload(d, listener)
    return torch_file(d / "evil.pt", dumps({"weight": 1.0, "payload": node})), canary


@pytest.mark.parametrize("probe", HOSTILE, ids=lambda p: p.name)
def test_hostile_checkpoint_never_runs_through_ckptier(
    probe: Probe, tmp_path: Path, listener: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CANARY_ENV, str(tmp_path))
    path, canary = _hostile_file(probe, tmp_path, listener)
    with pytest.raises(ConfigError) as allowed:
        safe_torch_load(path, extra_allowlist=[probe.name])
    assert probe.name in str(allowed.value) and "\n" not in str(allowed.value)
    with pytest.raises(UnsafeCheckpoint) as refused:
        safe_torch_load(path)
    message = str(refused.value)
    assert refused.value.global_name == probe.name and probe.name in message and "\n" not in message
    assert "--allow-global" not in message  # never suggested for a class that fails the rule
    gc.collect()
    assert not canary.fired(), f"{probe.name} ran"


CONTROL = textwrap.dedent(
    """
    import gc, json, sys, warnings
    import torch
    from ckptier.tasks.allowlist import import_global
    from ckptier.tasks.confine import confine_writes
    warnings.simplefilter("ignore")
    cases = json.loads(sys.argv[1])
    confine_writes([sys.argv[2]])  # the payloads only ever aim inside the test's directory
    for path, name, target in cases:
        obj = import_global(target)
        with torch.serialization.safe_globals([(obj, name)]):
            try:
                kept = torch.load(path, weights_only=True)
            except Exception:
                kept = None
        del kept
        gc.collect()
    """
)


@pytest.mark.slow
def test_each_hostile_checkpoint_really_runs_when_its_class_is_allowed(tmp_path: Path, listener: socket.socket) -> None:
    # The counterfactual that makes the test above mean something: torch's own
    # weights-only unpickler with the class forced into its allowlist runs every payload.
    aliases = {"commands.Popen": "subprocess.Popen"}
    cases, canaries = [], {}
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    for i, probe in enumerate(HOSTILE):
        directory = tmp_path / f"p{i}"
        path, canary = _hostile_file(probe, directory, listener)
        cases.append((str(path), probe.name, aliases.get(probe.name, probe.name)))
        canaries[probe.name] = canary
        if probe.name == _mine("CodeFactory"):
            env[CANARY_ENV] = str(directory)
    done = subprocess.run([sys.executable, "-c", CONTROL, json.dumps(cases), str(tmp_path)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    deadline = time.monotonic() + 10
    silent = [n for n, c in canaries.items() if not c.fired()]
    while silent and time.monotonic() < deadline:  # Popen's child may still be running
        time.sleep(0.1)
        silent = [n for n, c in canaries.items() if not c.fired()]
    assert not silent, f"payloads that did nothing even when allowed: {silent}"


# --- where allowing happens: config load, the command line, the drill's processes ----------


def test_config_refuses_a_library_class_that_is_not_plain_data(tmp_path: Path) -> None:
    config = tmp_path / "ckptier.toml"
    for name, why in [("timeit.Timer", "'timeit'"), ("numpy.memmap", "memmap defines __new__"),
                      ("commands.Popen", "subprocess.Popen")]:
        config.write_text(f'[[drill]]\nmodel = "m:f"\nallow_globals = ["{name}"]\n')
        with pytest.raises(ConfigError) as info:
            load_config(config)
        message = str(info.value)
        assert name in message and why in message and "\n" not in message and "--allow-global" not in message
    config.write_text('[[drill]]\nmodel = "m:f"\nallow_globals = ["http.HTTPStatus", "mypkg.config.TrainConfig"]\n')
    assert load_config(config).drills[0].allow_globals == ("http.HTTPStatus", "mypkg.config.TrainConfig")


def test_own_modules_are_checked_in_a_confined_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    outside = tmp_path / "written-on-import"
    (lib / "allow_probe_mod.py").write_text(textwrap.dedent(f"""
        from dataclasses import dataclass
        from pathlib import Path
        try:
            Path({str(outside)!r}).write_text("the module's import wrote outside")
        except OSError:
            pass

        @dataclass
        class Plain:
            lr: float

        class Hooked:
            def __init__(self, path):
                Path(path).touch()
    """))
    monkeypatch.setenv("PYTHONPATH", str(lib))
    verdicts = check_allow_globals(["allow_probe_mod.Plain", "allow_probe_mod.Hooked", "allow_probe_mod.Absent",
                                    "no_such_mod_xyz.Thing", "timeit.Timer"], workdir=tmp_path)
    assert verdicts["allow_probe_mod.Plain"] is None
    assert "Hooked defines __init__" in (verdicts["allow_probe_mod.Hooked"] or "")
    assert "has no attribute 'Absent'" in (verdicts["allow_probe_mod.Absent"] or "")
    assert "no_such_mod_xyz" in (verdicts["no_such_mod_xyz.Thing"] or "")
    assert "'timeit'" in (verdicts["timeit.Timer"] or "")
    assert "allow_probe_mod" not in sys.modules  # never imported into this process
    if landlock_abi()[0] is not None:
        assert not outside.exists()  # the child could write only to its own temporary directory
