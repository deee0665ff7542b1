"""Which globals a pickle may name: rules by name alone, nothing imported.

Pure and torch-free, so that configuration parsing, the format plug-ins and
the safe loader share one rule (:func:`allow_global_problem`). Whether a name
that passes is a plain data class is decided by
:mod:`ckptier.formats.allowlist`.
"""

from __future__ import annotations

import _compat_pickle
import re
import sys

_GLOBAL_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")

_RUNS_CODE = (
    "builtins", "sys", "importlib", "runpy", "code", "codeop", "pdb", "bdb", "cmd", "doctest", "unittest",
    "timeit", "trace", "profile", "cProfile", "pydoc", "inspect", "types", "operator", "functools", "copyreg",
    "pickle", "pickletools", "marshal", "ctypes", "threading", "multiprocessing", "concurrent", "asyncio",
    "atexit", "gc", "weakref", "signal", "zipimport", "pkgutil", "site", "ensurepip", "venv", "distutils",
    "setuptools", "numpy.testing", "numpy.f2py", "numpy.distutils", "numpy.ctypeslib", "torch.hub",
    "torch.package", "torch.jit", "torch.fx", "torch.utils.cpp_extension", "torch._dynamo", "torch._inductor",
    "torch.compiler", "torch.export", "torch._export", "torch.onnx", "torch.multiprocessing", "torch.testing",
    "torch.serialization", "torch.distributed.elastic", "torch.distributed.run", "torch.utils.tensorboard",
)
_RUNS_COMMANDS = ("os", "posix", "nt", "subprocess", "pty", "webbrowser")
_TOUCHES_FILES = (
    "io", "shutil", "tempfile", "zipfile", "tarfile", "gzip", "bz2", "lzma", "logging", "sqlite3", "dbm",
    "shelve", "mailbox", "mmap", "fcntl", "fileinput", "linecache", "tkinter", "turtle", "readline", "syslog",
    "resource", "termios", "tty", "msvcrt", "winreg", "winsound",
)
_OPENS_CONNECTIONS = (
    "socket", "ssl", "select", "selectors", "socketserver", "smtplib", "smtpd", "asynchat", "asyncore", "ftplib",
    "poplib", "imaplib", "nntplib", "telnetlib", "http.server", "http.client", "urllib.request", "xmlrpc",
    "wsgiref",
)
_IMPORT_RUNS_CODE = ("antigravity", "this", "__hello__", "__phello__", "idlelib", "turtledemo", "test", "__main__")
"""Modules whose import alone does something (opens a browser, prints, starts
a GUI, runs tests or a program): never imported to inspect a class."""

UNSAFE_GLOBAL_MODULES: dict[str, str] = {
    **{m: "can run code when a pickle calls it" for m in _RUNS_CODE},
    **{m: "can run commands when a pickle calls it" for m in _RUNS_COMMANDS},
    **{m: "can touch files when a pickle calls it" for m in _TOUCHES_FILES},
    **{m: "opens network connections when a pickle calls it" for m in _OPENS_CONNECTIONS},
    **{m: "runs code as soon as it is imported" for m in _IMPORT_RUNS_CODE},
}
"""Modules (and their submodules) whose objects can run commands, run code,
open files or connections when a pickle calls them, or whose import has side
effects, with why: never allowlisted, never imported to find out. Internal C
modules of the standard library (``_sqlite3``, ``_io``...) are refused too.
Everything else must still pass the plain-data-class rule
(:mod:`ckptier.formats.allowlist`)."""


def python2_alias(name: str) -> str | None:
    """What an unpickler resolves the Python 2 name ``module.Name`` to
    (``commands.Popen`` -> ``subprocess.Popen``), or None; pure."""
    module, _, attr = name.rpartition(".")
    mapped = _compat_pickle.NAME_MAPPING.get((module, attr))
    if mapped is not None:
        return ".".join(mapped)
    if module in _compat_pickle.IMPORT_MAPPING:
        return f"{_compat_pickle.IMPORT_MAPPING[module]}.{attr}"
    return None


def _unsafe_module(name: str) -> str | None:
    parts = name.split(".")
    if "__main__" in parts:
        return "module '__main__' is a program, not a library: importing it runs the program"
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in UNSAFE_GLOBAL_MODULES:
            return f"module {prefix!r} {UNSAFE_GLOBAL_MODULES[prefix]}"
    top = parts[0]
    if top.startswith("_") and top in sys.stdlib_module_names:
        return f"module {top!r} is an internal C module of the standard library"
    return None


def unsafe_global_reason(name: str) -> str | None:
    """Why the global ``module.Name`` can run code or touch files, judged by
    its module (also under its Python 2 alias: ``commands.Popen`` is
    ``subprocess.Popen``), or None; pure, nothing imported."""
    alias = python2_alias(name)
    for candidate in (name, alias):
        if candidate is not None and (problem := _unsafe_module(candidate)) is not None:
            return problem + (f" ({name} is the Python 2 name of {alias})" if candidate == alias else "")
    return None


def allow_global_problem(name: object) -> str | None:
    """Why ``name`` cannot be an allowlisted global (``--allow-global`` /
    ``allow_globals``), or None; pure (nothing is imported).

    It must be a dotted ``module.Name`` outside :data:`UNSAFE_GLOBAL_MODULES`
    and the standard library's internal modules, also under the name an
    unpickler maps a Python 2 name to (:func:`unsafe_global_reason`).
    Whether it imports and is a plain data class is decided by
    :func:`ckptier.formats.allowlist.allow_global_check`.
    """
    if not isinstance(name, str) or not _GLOBAL_RE.match(name):
        return "must be a dotted module.Name, e.g. \"mypkg.config.TrainConfig\""
    problem = unsafe_global_reason(name)
    if problem is not None:
        return f"{problem}; allowlist only your own plain classes, e.g. \"mypkg.config.TrainConfig\""
    return None
