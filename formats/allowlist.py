"""Which classes a user may allow the safe loader to unpickle (``--allow-global``).

Allowing a class lets a checkpoint make torch's weights-only unpickler call
it. For an allowed class ``C`` that unpickler runs, with values the file
chooses: ``C(*args)`` (REDUCE: the metaclass's ``__call__``, ``__new__``,
``__init__``), ``C.__new__(C, *args)`` (NEWOBJ), ``inst.__setstate__(state)``
or ``inst.__dict__.update(state)`` and ``setattr(inst, k, v)`` (BUILD, after
``hasattr(inst, "__setstate__")``, which reaches ``__getattr__``), ``hash``
and ``==`` (dict keys, its allowlist look-ups), and later Python runs
``__del__``, ``copy.deepcopy`` runs ``__reduce_ex__``/``__deepcopy__``.
So a class is allowed only when none of that runs code of its own:

* a ``@dataclass`` (methods it generates are fine; no ``__post_init__``,
  default factories only plain types),
* a ``NamedTuple`` / ``collections.namedtuple``,
* an ``Enum`` with members (calling it looks a member up),
* or a plain class rebuilt from its ``__dict__`` (no construction hooks),

each through every class of its MRO, with metaclass ``type``, ``ABCMeta`` or
``EnumType``, and no data descriptor with a setter. Everything else is refused
with the reason (:func:`plain_class_problem`, pure over a class object).

Importing a module to inspect a class runs the module's code, so
:func:`allow_global_check` first refuses, by name alone, modules that run
code or touch files (:func:`ckptier.formats.names.allow_global_problem`),
including those whose import itself has side effects, and never imports a
name a checkpoint chose. :func:`ckptier.tasks.allowlist.check_allow_globals`
imports the user's own modules in a separate, confined, credential-free process.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import enum
import importlib
import os
import reprlib
import sys
import types
import typing
from typing import Any

from ckptier.formats.names import allow_global_problem, unsafe_global_reason
from ckptier.storage.errors import ConfigError

ALREADY_ALLOWED = frozenset(
    {
        "collections.OrderedDict", "collections.Counter", "torch.Size", "torch.Tensor", "torch.device",
        "torch.nn.parameter.Parameter", "numpy.ndarray", "numpy.dtype", "pathlib.PosixPath", "pathlib.PurePosixPath",
    }
)
"""Classes the safe loader admits without being asked (torch's own
allowlist and ``DEFAULT_ALLOWLIST``): allowing them again changes nothing."""

REVIEWED = {
    "argparse.Namespace": "__init__ only sets keyword arguments (an unpickler passes none), "
    "__eq__ compares __dict__, __contains__ looks a key up",
}
"""Standard-library classes with hooks that were read and found to run no
code of their own on loaded data (Lightning saves hyper-parameters as an
``argparse.Namespace``)."""

LIBRARIES = frozenset({"numpy", "torch"})
"""Top-level packages besides the standard library that are trusted to be
imported in-process to inspect a class (they are imported by the drill anyway)."""

_TRUSTED_BASES: frozenset[type] = frozenset(
    {object, abc.ABC, typing.Generic, enum.Enum, enum.ReprEnum, enum.IntEnum, enum.StrEnum, enum.Flag, enum.IntFlag}
)
_ENUM_MIXINS: frozenset[type] = frozenset({int, str, float, bytes})
_TRUSTED_METACLASSES: frozenset[type] = frozenset({type, abc.ABCMeta, enum.EnumType})
_TUPLEGETTER: type = type(collections.namedtuple("_Probe", "field").field)  # type: ignore[attr-defined]
_SAFE_FACTORIES: frozenset[type] = frozenset(
    {list, dict, set, frozenset, tuple, str, bytes, bytearray, int, float, complex, bool,
     collections.OrderedDict, collections.defaultdict, collections.deque, collections.Counter}
)

_CALLED_WITH_FILE_ARGS = "the unpickler calls it with the file's arguments"
_CALLED_ON_FILE_DATA = "BUILD calls it with the file's data"
_REBUILT_BY_CODE = "the class is saved and rebuilt by calling code, not from its __dict__"
HOOKS: dict[str, str] = {
    "__new__": _CALLED_WITH_FILE_ARGS,
    "__init__": _CALLED_WITH_FILE_ARGS,
    "__post_init__": "the dataclass __init__ the unpickler calls runs it",
    "__call__": "an instance equal to an allowed global would be called",
    "__setstate__": _CALLED_ON_FILE_DATA,
    "__setattr__": _CALLED_ON_FILE_DATA,
    "__delattr__": "it runs on the file's objects",
    "__getattr__": "the unpickler's hasattr(obj, '__setstate__') runs it",
    "__getattribute__": "every attribute look-up of the unpickler runs it",
    "__reduce__": _REBUILT_BY_CODE,
    "__reduce_ex__": _REBUILT_BY_CODE,
    "__getstate__": _REBUILT_BY_CODE,
    "__getnewargs__": _REBUILT_BY_CODE,
    "__getnewargs_ex__": _REBUILT_BY_CODE,
    "__copy__": "copy.copy of loaded state runs it",
    "__deepcopy__": "copy.deepcopy of loaded state runs it",
    "__del__": "it runs on every object the file creates, with the file's data",
    "__hash__": "dict keys and set members from the file run it",
    "__eq__": "the unpickler's allowlist look-ups and dict keys run it",
    "__ne__": "comparisons of loaded objects run it",
    "__repr__": "error messages about loaded objects run it",
    "__str__": "error messages about loaded objects run it",
    "__format__": "error messages about loaded objects run it",
    "__bool__": "BUILD tests the truth of the file's state",
    "__len__": "BUILD tests the truth of the file's state",
    "__iter__": "dict.update in BUILD iterates the file's state",
    "__getitem__": "dict.update in BUILD indexes the file's state",
    "keys": "dict.update in BUILD calls it on the file's state",
    "items": "BUILD calls it on the file's slot state",
    "__contains__": "the loader tests membership in loaded objects",
    "__index__": "number conversions of loaded values run it",
    "__int__": "number conversions of loaded values run it",
    "__float__": "number conversions of loaded values run it",
    "__fspath__": "path conversions of loaded values run it",
    "_missing_": "calling the Enum with a value the file chooses runs it",
}
"""Methods that unpickling (or the loader, right after) can reach on an
allowed class, with how. A plain data class may define none of them itself;
those generated by ``dataclasses``/``namedtuple``/``enum`` are fine."""

_RULE = "only plain data classes can be allowed: a @dataclass, NamedTuple or Enum, or a class without construction hooks"


def _code_file(code: types.CodeType) -> str:
    return os.path.normcase(os.path.abspath(code.co_filename))


_DATACLASSES_FILE, _ENUM_FILE, _COLLECTIONS_FILE, _REPRLIB_FILE = (
    os.path.normcase(os.path.abspath(m.__file__ or "")) for m in (dataclasses, enum, collections, reprlib)
)


def _is_generated(fn: Any, *, is_enum: bool) -> bool:
    """Made by the standard library's class machinery, never written by hand:
    a dataclass method (compiled from a string in ``__create_fn__``, or
    dataclasses' own slot-state and recursive-repr helpers around one),
    namedtuple's methods, or ``enum``'s own functions in an Enum."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return False
    qualname = code.co_qualname
    if code.co_filename == "<string>":
        return qualname.startswith("__create_fn__.<locals>.") or str(
            getattr(fn, "__globals__", {}).get("__name__", "")
        ).startswith("namedtuple_")
    where = _code_file(code)
    if where == _DATACLASSES_FILE and qualname in ("_dataclass_getstate", "_dataclass_setstate"):
        return True
    if (where == _DATACLASSES_FILE and qualname.startswith("_recursive_repr.")) or (
        where == _REPRLIB_FILE and qualname.startswith("recursive_repr.")
    ):
        wrapped = getattr(fn, "__wrapped__", None)
        return wrapped is not None and _is_generated(wrapped, is_enum=is_enum)
    if where == _COLLECTIONS_FILE and qualname.startswith("namedtuple.<locals>."):
        return True
    return is_enum and where == _ENUM_FILE


def _trusted_builtin(value: Any) -> bool:
    """A C-level method of object or of an Enum mixin type (tuple, int, str...)."""
    return any(value is v for base in (object, tuple, *_ENUM_MIXINS) for v in vars(base).values())


def _describe(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _hook_problem(klass: type, name: str, value: Any, *, is_enum: bool) -> str | None:
    if name not in HOOKS or value is None:
        return None
    if is_enum and name == "__init__":
        return None  # members are built once, when the class is created; a call only looks one up
    if _is_generated(value, is_enum=is_enum) or _trusted_builtin(value):
        return None
    in_c = "" if isinstance(getattr(value, "__func__", value), types.FunctionType) else " in C"
    return f"{klass.__qualname__} defines {name}{in_c} ({HOOKS[name]})"


def _descriptor_problem(klass: type, name: str, value: Any) -> str | None:
    kind = type(value)
    if not (hasattr(kind, "__set__") or hasattr(kind, "__delete__")):
        return None
    if isinstance(value, (types.MemberDescriptorType, types.GetSetDescriptorType, _TUPLEGETTER)):
        return None  # __slots__ members, __dict__/__weakref__, namedtuple fields (read-only): plain storage
    if isinstance(value, (property, enum.property)) and getattr(value, "fset", None) is None and getattr(value, "fdel", None) is None:
        return None
    return f"{klass.__qualname__}.{name} is a {kind.__name__} with a setter (BUILD's setattr runs it with the file's data)"


def _factory_problem(cls: type, seen: set[type]) -> str | None:
    for f in dataclasses.fields(cls):
        factory = f.default_factory
        if factory is dataclasses.MISSING or factory in _SAFE_FACTORIES:
            continue
        if isinstance(factory, type):
            inner = _class_problem(factory, seen)
            if inner is None:
                continue
            return f"field {f.name!r} of {cls.__qualname__} has default_factory {_describe(factory)}, which is not plain data: {inner}"
        return (f"field {f.name!r} of {cls.__qualname__} has default_factory {getattr(factory, '__qualname__', factory)!r}, "
                "code the generated __init__ calls; use a plain type such as list or dict")
    return None


def plain_class_problem(cls: object) -> str | None:
    """Why ``cls`` is not a plain data class that may be unpickled, or None; pure.

    See the module docstring for the rule. The reason is one line and never
    suggests allowing anything else.
    """
    return _class_problem(cls, set())


def _class_problem(cls: object, seen: set[type]) -> str | None:
    if not isinstance(cls, type):
        return f"it is a {type(cls).__name__}, not a class (a function named by a pickle is called while loading)"
    if cls in seen:
        return None
    seen.add(cls)
    if cls in _TRUSTED_BASES or cls in _ENUM_MIXINS or cls is tuple:
        return f"{cls.__qualname__} is a built-in base class, not a data class of yours"
    meta = type(cls)
    if meta not in _TRUSTED_METACLASSES:
        return f"its metaclass {_describe(meta)} is not type, ABCMeta or EnumType (calling the class runs the metaclass's code)"
    is_enum = issubclass(cls, enum.Enum)
    if is_enum and not len(cls.__members__):  # type: ignore[attr-defined]
        return f"{cls.__qualname__} is an Enum without members (calling it creates a new Enum class)"
    mro = cls.__mro__
    if tuple in mro and not (hasattr(cls, "_fields") and _is_generated(cls.__new__, is_enum=False)):
        return f"{cls.__qualname__} subclasses tuple without being a NamedTuple (tuple subclasses are rebuilt by calling them)"
    for klass in mro:
        if klass in _TRUSTED_BASES or klass is tuple:
            continue
        if klass in _ENUM_MIXINS:
            if is_enum:
                continue
            return f"{cls.__qualname__} subclasses {klass.__name__}, a built-in type rebuilt by calling it"
        if not klass.__flags__ & (1 << 9):  # Py_TPFLAGS_HEAPTYPE: a static C type
            return f"{'its base ' if klass is not cls else ''}{klass.__qualname__} is a built-in type implemented in C (its construction cannot be inspected)"
        for name, value in vars(klass).items():
            problem = _hook_problem(klass, name, value, is_enum=is_enum) or _descriptor_problem(klass, name, value)
            if problem:
                return problem
    if dataclasses.is_dataclass(cls):
        return _factory_problem(cls, seen)
    return None


# --- from a name -------------------------------------------------------------


def is_library_global(name: str) -> bool:
    """True when ``name`` is in the standard library, numpy or torch: code that
    is safe to import in-process once :func:`allow_global_problem` passed it."""
    top = name.split(".", 1)[0]
    return top in sys.stdlib_module_names or top in LIBRARIES


def import_global(name: str) -> object:
    """Import ``module.Name`` (``module.Outer.Inner`` too) and return the object.

    Attributes are read from ``vars()``, so no module ``__getattr__`` runs.
    Raises :class:`ConfigError` naming what is missing.
    """
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj: object = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            missing = exc.name or module_name
            if module_name == missing or module_name.startswith(missing + "."):
                continue  # not a module: maybe a class path, try a shorter prefix
            raise ConfigError(f"cannot import module {module_name!r} ({exc}); install what it needs") from None
        except Exception as exc:  # noqa: BLE001 - the module's own code failed: say so, never crash
            raise ConfigError(f"cannot import module {module_name!r} ({type(exc).__name__}: {exc}); fix the module or the name") from None
        for attr in parts[i:]:
            namespace = vars(obj) if isinstance(obj, (types.ModuleType, type)) else {}
            if attr not in namespace:
                raise ConfigError(f"{_name_of(obj)} has no attribute {attr!r}; fix the name (a pickle names a class by its defining module)")
            obj = namespace[attr]
        return obj
    raise ConfigError(f"cannot import module {'.'.join(parts[:-1])!r} (no module named {parts[0]!r}); install it or fix the name")


def _name_of(obj: object) -> str:
    if isinstance(obj, types.ModuleType):
        return f"module {obj.__name__!r}"
    return f"class {getattr(obj, '__qualname__', obj)!r}"


def allow_global_check(name: object) -> str | None:
    """Why ``name`` may not be allowed, or None: the name rule
    (:func:`allow_global_problem`), then import and the plain-data-class rule
    (:func:`plain_class_problem`), also for the class's real name when
    ``name`` is an alias. Imports ``name``'s module: call it in-process only
    for :func:`is_library_global` names or in the isolated drill processes.
    """
    problem = allow_global_problem(name)
    if problem is not None:
        return problem
    assert isinstance(name, str)
    if name in ALREADY_ALLOWED:
        return None
    try:
        obj = import_global(name)
    except ConfigError as exc:
        return str(exc)
    problem = class_problem(name, obj)
    return None if problem is None else f"refused: {problem}; {_RULE}"


def class_problem(name: str, obj: object) -> str | None:
    """Why ``obj``, found under ``name``, may not be allowed (one clause), or None."""
    if isinstance(obj, type):
        real = _describe(obj)
        if real != name and (problem := unsafe_global_reason(real)) is not None:
            return f"it is {real}: {problem}"
        if real in REVIEWED or name in REVIEWED:
            return None
    return plain_class_problem(obj)


def check_if_loaded(name: str) -> tuple[bool, str | None]:
    """``(decided, problem)`` for ``name`` using only what is already imported:
    never imports anything (for names a checkpoint chose)."""
    problem = allow_global_problem(name)
    if problem is not None or name in ALREADY_ALLOWED:
        return True, problem
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        obj: object = sys.modules.get(".".join(parts[:i]))
        if obj is None:
            continue
        for attr in parts[i:]:
            namespace = vars(obj) if isinstance(obj, (types.ModuleType, type)) else {}
            if attr not in namespace:
                return False, None
            obj = namespace[attr]
        return True, class_problem(name, obj)
    return False, None


def allowed_class(name: str) -> type:
    """The class ``name`` names, when it may be allowed; raises
    :class:`ConfigError` (``allow-global 'name': reason``) otherwise."""
    problem = allow_global_check(name)
    if problem is not None:
        raise ConfigError(f"allow-global {name!r}: {problem}")
    obj = import_global(name)
    assert isinstance(obj, type)
    return obj
