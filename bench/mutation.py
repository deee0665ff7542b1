#!/usr/bin/env python3
"""Seeded mutation gate over ckptier's pure decision modules.

A mutant is one small change to one module, generated from its ``ast``;
the module's focused tests must fail on it ("killed"). The modules:

* ``storage/transitions.py`` (every function),
* ``tasks/retention.py`` (every function),
* ``tasks/apply.py``: its pure functions only (``delete_refusal``,
  ``intent_progress``, ``link_refusal``, ``_batches`` and ``ApplyReport``'s
  methods); the rest does I/O and is exercised by slower tests.

Mutations: comparison swaps (``<``/``<=``, ``>``/``>=``, ``==``/``!=``,
``is``/``is not``, ``in``/``not in``), ``and``/``or``, ``not`` removed,
``+``/``-`` (also ``+=``/``-=``), an integer constant plus or minus one,
``True``/``False``, the two branches of ``x if c else y`` swapped, and the
``key=`` argument of ``min``/``max`` dropped. Nothing inside an f-string is
mutated (the positions of its parts are not reliable), nor docstrings or
annotations.

How a mutant is run: the tracked files of this checkout are copied once
into a temporary directory, with the ``ckptier.*`` packages laid out as
``view/ckptier/...`` (real copies, so the tests' own check that they test
this tree holds) and ``PYTHONPATH`` pointing at ``view``. The mutated text
replaces the node's source segment in that copy only; the real files are
never written. The focused tests (files under ``tests/`` that import the
module and are named after it, plus the explicit extras below, less the
slow ones listed with a reason) run once unmutated first (the baseline
must pass), then once per mutant with ``pytest -x -q -p no:cacheprovider``,
a fixed Hypothesis seed and a timeout of ``--timeout-factor`` times the
baseline's time plus 10 s (a run past it is run again with three times as
long; a second timeout counts as killed, and is reported apart).

Equivalent mutants (no test can tell them apart from the original) are
listed in :data:`EQUIVALENT`, each with its reason; the kill rate is taken
over the others. ``--limit N`` samples N mutants per module with
``--seed`` (fixed by default, so that two runs run the same mutants); the
output says when a module was sampled.

Cost, on the shared 2-core machine: 3-6 s per mutant (a killed one stops
at its first failing test; a survivor runs the whole focused set). About
170 mutants of transitions, 70 of apply's pure functions, 480 of
retention: every one of them takes longer than the 30-40 minutes a gate
may take, so by default at most ``--limit 300`` mutants per module are run,
sampled with ``--seed 30`` (only retention has more: it is sampled, and
its line says so). ``--limit 0`` runs every mutant. Figures:
docs/benchmarks.md.

    python bench/mutation.py [--module transitions|retention|apply] [--limit 300] [--seed 30] [--jobs 1]
                             [--list] [--only FILE:LINE] [--tests PATH] [-v]

This is a bench, not a test: pytest does not collect it (it lives in
``bench/``, outside ``testpaths``).
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Target:
    """One module under mutation: its file, the functions mutated (``None``:
    all), and test files added to or removed from the focused set."""

    path: str
    functions: frozenset[str] | None = None
    extra_tests: tuple[str, ...] = ()
    slow_tests: tuple[tuple[str, str], ...] = ()  # (file or node id, reason): left out


TARGETS: dict[str, Target] = {
    "transitions": Target(
        "storage/transitions.py",
        extra_tests=("tests/test_proof.py", "tests/test_latest_drill.py"),
        slow_tests=(("tests/test_verify.py", "70 s a run: stores, catalogs and real files; test_transitions.py "
                                             "holds the table tests of on_verification"),),
    ),
    "retention": Target(
        "tasks/retention.py",
        extra_tests=("tests/test_latest_drill.py",),
        slow_tests=(
            ("tests/test_retention_catalog.py", "60 s a run: real catalogs"),
            ("tests/test_retention_metrics.py", "10 s a run: catalogs and metrics tables"),
            ("tests/test_retention.py::test_in_flight_never_counts_toward_keep_last",
             "property test, 20 s a run"),
            ("tests/test_retention.py::test_pure_and_order_independent", "property test, 8 s a run"),
            ("tests/test_retention.py::test_milestones_never_slide_when_a_holder_loses_its_hot_copy",
             "property test, 7 s a run"),
            ("tests/test_retention.py::test_invariants", "property test, 7 s a run"),
        ),
    ),
    "apply": Target(
        "tasks/apply.py",
        functions=frozenset({"delete_refusal", "intent_progress", "link_refusal", "_batches",
                             "ApplyReport._with", "ApplyReport.promoted", "ApplyReport.deleted",
                             "ApplyReport.held", "ApplyReport.failures", "ApplyReport.ok",
                             "ApplyReport.bytes_freed", "ApplyReport.summary"}),
        extra_tests=("tests/test_apply_crash.py",),
        slow_tests=(
            ("tests/test_apply_proofs.py", "70 s a run: real stores and catalogs"),
            ("tests/test_apply_faults.py", "70 s a run: fault-injecting stores"),
            ("tests/test_apply_crash.py::test_a_rerun_finishes_a_killed_delete_and_takes_over_the_dead_runs_lease",
             "child processes killed mid-delete, 6 s a run"),
            ("tests/test_apply_crash.py::test_a_live_runs_lease_is_kept_alive_by_its_heartbeat", "waits on leases, 3 s"),
            ("tests/test_apply_crash.py::test_a_run_that_skips_work_held_by_a_live_run_names_it_and_exits_75",
             "a second process, 2 s"),
        ),
    ),
}

#: (file, function, the line's text, mutation) -> why no test can kill it. Keep it short
#: and honest: a mutant that changes what any caller could observe is not equivalent.
EQUIVALENT: dict[tuple[str, str, str, str], str] = {
    ("tasks/retention.py", "Milestones._at_or_after_keeps", "held_up_to = -1  # every milestone at or below this "
     "step has its holder", "int+1: `1` -> `(2)`"):
        "held_up_to -2 for -1: between(lo, hi) answers the same for every lo < 0 (max(lo, 0), bisection, hi < 0)",
    ("tasks/retention.py", "Milestones.cadence_warning", "if len(steps) < 2:", "int-1: `2` -> `(1)`"):
        "one step leaves the gcd d = 0, and `d <= 1` answers None as `len(steps) < 2` did",
    ("tasks/retention.py", "Milestones.cadence_warning", "r = steps[0] % d", "int+1: `0` -> `(1)`"):
        "d divides every gap between steps, so every step has the same residue mod d",
    ("tasks/retention.py", "Milestones.cadence_warning", "r = steps[0] % d", "int-1: `0` -> `(-1)`"):
        "d divides every gap between steps, so every step has the same residue mod d",
    ("tasks/retention.py", "<module>", "_LOG_SERIES = tuple(_log_series(2**63 - 1))", "int+1: `1` -> `(2)`"):
        "2**63 - 2 for 2**63 - 1: no step of the 1-2-5 series lies between them",
    ("tasks/retention.py", "<module>", "_LOG_SERIES = tuple(_log_series(2**63 - 1))", "int-1: `1` -> `(0)`"):
        "2**63 for 2**63 - 1: no step of the 1-2-5 series lies between them",
    ("tasks/retention.py", "<module>", "_LOG_SERIES = tuple(_log_series(2**63 - 1))", "arith: `2**63 - 1` -> `(2 ** 63 + 1)`"):
        "2**63 + 1 for 2**63 - 1: no step of the 1-2-5 series lies between them",
    ("tasks/retention.py", "<module>", "_LOG_SERIES = tuple(_log_series(2**63 - 1))", "int+1: `2` -> `(3)`"):
        "3**63 for 2**63: the longer series reaches past every signed 64-bit step (the catalog's), so no answer changes",
    ("tasks/retention.py", "<module>", "_LOG_SERIES = tuple(_log_series(2**63 - 1))", "int+1: `63` -> `(64)`"):
        "2**64 for 2**63: the longer series reaches past every signed 64-bit step (the catalog's), so no answer changes",
    ("tasks/retention.py", "newest_drilled", "return _newest_first(passed)[:n] if n > 0 else []", "int-1: `0` -> `(-1)`"):
        "n > -1 for n > 0 differs only at n = 0, where [:0] is [] as well",
    ("tasks/retention.py", "KeepBest.warning", "if not verified or not without:", "boolop: `not verified or not without` -> `(not verified and (not without))`"):
        "with no checkpoint without the metric, neither later test can hold (0 * 2 > n, 0 == n), so None either way",
    ("tasks/retention.py", "AbsentFloor.apply", 'if d.action == "delete":  # unreachable by construction; belt and braces',
     "compare: `d.action == \"delete\"` -> `(d.action != 'delete')`"):
        "every earlier stage keeps a checkpoint missing from hot storage, so both set keep on a keep",
}


# -- mutants ------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutant:
    """One change: the node's source segment and its replacement."""

    path: str
    function: str
    line: int
    col: int
    end_line: int
    end_col: int
    original: str
    replacement: str
    what: str
    context: str  # the source line the mutant is on, stripped

    @property
    def key(self) -> tuple[str, str, str, str]:
        """How :data:`EQUIVALENT` names it: file, function, its line's text, the mutation."""
        return self.path, self.function, self.context, self.what

    def __str__(self) -> str:
        return f"{self.path}:{self.line} ({self.function}) {self.what}"


_CMP_SWAP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
    ast.In: ast.NotIn, ast.NotIn: ast.In,
}


def _short(text: str, width: int = 70) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _variants(node: ast.AST) -> Iterator[tuple[ast.AST, str]]:
    """(mutated copy of ``node``, label) for each mutation that applies to it."""
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            swap = _CMP_SWAP.get(type(op))
            if swap is not None:
                cmp = copy.deepcopy(node)
                cmp.ops[i] = swap()
                yield cmp, "compare"
    elif isinstance(node, ast.BoolOp):
        boolop = copy.deepcopy(node)
        boolop.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield boolop, "boolop"
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield copy.deepcopy(node.operand), "not removed"
    elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        binop = copy.deepcopy(node)
        binop.op = ast.Sub() if isinstance(node.op, ast.Add) else ast.Add()
        yield binop, "arith"
    elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
        yield ast.Constant(not node.value), "bool"
    elif isinstance(node, ast.Constant) and isinstance(node.value, int):
        yield ast.Constant(node.value + 1), "int+1"
        yield ast.Constant(node.value - 1), "int-1"
    elif isinstance(node, ast.IfExp):
        ifexp = copy.deepcopy(node)
        ifexp.body, ifexp.orelse = node.orelse, node.body
        yield ifexp, "ifexp swapped"
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max")
          and any(k.arg == "key" for k in node.keywords)):
        call = copy.deepcopy(node)
        call.keywords = [k for k in node.keywords if k.arg != "key"]
        yield call, "key dropped"


def _aug_variants(node: ast.AugAssign) -> Iterator[tuple[str, str]]:
    if isinstance(node.op, (ast.Add, ast.Sub)):
        new = copy.deepcopy(node)
        new.op = ast.Sub() if isinstance(node.op, ast.Add) else ast.Add()
        yield ast.unparse(new), "aug arith"


class _Collector(ast.NodeVisitor):
    """Walks a module, keeping track of the enclosing function and of the
    parts never mutated (docstrings, annotations, f-strings)."""

    def __init__(self, path: str, source: str, functions: frozenset[str] | None) -> None:
        self.path, self.source, self.functions = path, source, functions
        self.lines = source.splitlines(keepends=True)
        self.scope: list[str] = []
        self.mutants: list[Mutant] = []

    @property
    def function(self) -> str:
        return ".".join(self.scope) or "<module>"

    def _wanted(self) -> bool:
        if self.functions is None:
            return True
        return self.function in self.functions

    def _scoped(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)  # decorators are declarations, not decisions: never mutated
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]  # the docstring
        if not isinstance(node, ast.ClassDef):
            for default in [*node.args.defaults, *node.args.kw_defaults]:
                if default is not None:
                    self.visit(default)
        for stmt in body:
            self.visit(stmt)
        self.scope.pop()

    visit_ClassDef = _scoped
    visit_FunctionDef = _scoped
    visit_AsyncFunctionDef = _scoped

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)  # never the annotation

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        return  # f-strings: positions of their parts are not reliable

    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return  # a bare string (docstring of a module or attribute)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if self._wanted():
            for replacement, label in _aug_variants(node):
                self._add(node, replacement, label)
        self.generic_visit(node)

    def generic_visit(self, node: ast.AST) -> None:
        if self._wanted() and isinstance(node, ast.expr):
            for new, label in _variants(node):
                self._add(node, f"({ast.unparse(new)})", label)
        super().generic_visit(node)

    def _add(self, node: ast.expr | ast.AugAssign, replacement: str, label: str) -> None:
        original = ast.get_source_segment(self.source, node)
        if original is None:
            return
        # The prefix of the same source: ignore a no-op (a mutation unparse writes the same).
        if replacement.strip("()") == original.strip("()"):
            return
        what = f"{label}: `{_short(original)}` -> `{_short(replacement)}`"
        assert node.end_lineno is not None and node.end_col_offset is not None
        self.mutants.append(Mutant(self.path, self.function, node.lineno, node.col_offset, node.end_lineno,
                                   node.end_col_offset, original, replacement, what,
                                   self.lines[node.lineno - 1].strip()))


def mutants_of(target: Target, root: Path = ROOT) -> list[Mutant]:
    """Every mutant of ``target``'s module, in source order, each compiling."""
    source = (root / target.path).read_text()
    collector = _Collector(target.path, source, target.functions)
    collector.visit(ast.parse(source))
    found = []
    seen: set[tuple[str, str, str, int, int]] = set()
    for m in collector.mutants:
        ident = (m.function, m.what, m.replacement, m.line, m.col)
        if ident in seen:
            continue
        seen.add(ident)
        try:
            compile(apply_mutant(source, m), target.path, "exec")
        except SyntaxError:
            continue
        found.append(m)
    return found


def apply_mutant(source: str, m: Mutant) -> str:
    """``source`` with ``m``'s segment replaced (positions are UTF-8 byte offsets, as ``ast`` gives them)."""
    lines = source.splitlines(keepends=True)
    start = len("".join(lines[: m.line - 1]).encode()) + m.col
    end = len("".join(lines[: m.end_line - 1]).encode()) + m.end_col
    data = source.encode()
    return (data[:start] + m.replacement.encode() + data[end:]).decode()


# -- running ------------------------------------------------------------------------


def package_dirs(root: Path = ROOT) -> dict[str, str]:
    """pyproject.toml's ``package-dir``: ``ckptier.storage`` -> ``storage``."""
    import tomllib

    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {str(k): str(v) for k, v in mapping.items()}


def build_tree(dest: Path, root: Path = ROOT) -> Path:
    """Copy the tracked files of ``root`` into ``dest``, the mapped packages laid out
    under ``dest/view`` as ``ckptier.*`` resolves them; returns ``dest``."""
    files = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], check=True, capture_output=True).stdout
    mapping = package_dirs(root)
    folder_to_package = sorted(((v, k) for k, v in mapping.items()), key=lambda kv: -len(kv[0]))
    for name in files.decode().split("\0"):
        if not name or not (root / name).is_file():
            continue
        target = dest / name
        for folder, package in folder_to_package:
            if name == folder or name.startswith(folder + "/"):
                target = dest / "view" / Path(*package.split(".")) / name[len(folder) + 1:]
                break
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target)
    return dest


def module_path_in_tree(tree: Path, path: str, root: Path = ROOT) -> Path:
    folder, _, rest = path.partition("/")
    package = {v: k for k, v in package_dirs(root).items()}[folder]
    return tree / "view" / Path(*package.split(".")) / rest


def focused_tests(name: str, target: Target, root: Path = ROOT) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """(test files, deselected node ids, left out with reasons) for ``target``: the files
    under tests/ that import the module and are named after it (``test_<stem>*.py``), or
    are the module's explicit extras; less its slow ones."""
    stem = Path(target.path).stem
    package = {v: k for k, v in package_dirs(root).items()}[target.path.split("/")[0]]
    dotted = re.escape(f"{package}.{stem}")
    pattern = re.compile(rf"(from\s+{dotted}\s+import|import\s+{dotted}\b|from\s+{re.escape(package)}\s+import"
                         rf"[^\n]*\b{stem}\b)")
    files = []
    for f in sorted((root / "tests").glob("test_*.py")):
        rel = f"tests/{f.name}"
        imports = bool(pattern.search(f.read_text()))
        if rel in target.extra_tests or (imports and f.name.startswith(f"test_{stem}")):
            files.append(rel)
    slow_files = {s for s, _ in target.slow_tests if "::" not in s}
    files = sorted((f for f in files if f not in slow_files),
                   key=lambda f: (not Path(f).name.startswith(f"test_{stem}"), f))  # the module's own tests first
    deselect = [s for s, _ in target.slow_tests if "::" in s]
    return files, deselect, list(target.slow_tests)


@dataclass
class Outcome:
    mutant: Mutant | None
    status: str  # killed / survived / timeout / error
    seconds: float
    detail: str = ""


class Runner:
    """A temporary copy of the checkout in which one mutant at a time is run."""

    def __init__(self, name: str, target: Target, tests: list[str], deselect: list[str], workdir: Path) -> None:
        self.name, self.target, self.tests, self.deselect = name, target, tests, deselect
        self.tree = build_tree(workdir)
        self.module = module_path_in_tree(self.tree, target.path)
        self.original = self.module.read_text()
        self.timeout = 300.0

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--hypothesis-seed=0",
               "-o", "timeout=0", *self.tests]
        for d in self.deselect:
            cmd += ["--deselect", d]
        return cmd

    def env(self, *, bytecode: bool) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(self.tree / "view") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.pop("PYTEST_ADDOPTS", None)
        if not bytecode:
            env["PYTHONDONTWRITEBYTECODE"] = "1"
        return env

    def _forget_bytecode(self) -> None:
        for pyc in (self.module.parent / "__pycache__").glob(f"{self.module.stem}.*.pyc"):
            pyc.unlink()
        shutil.rmtree(self.tree / ".hypothesis", ignore_errors=True)

    def run(self, m: Mutant | None, *, timeout: float | None = None, bytecode: bool = False) -> Outcome:
        """Run the focused tests on ``m`` (None: unmutated). A run past the timeout is run
        again with three times as long before it counts as a timeout: on a loaded machine
        a slow survivor must not pass for a mutant that hangs."""
        first = self._run(m, timeout=timeout or self.timeout, bytecode=bytecode)
        if first.status != "timeout":
            return first
        again = self._run(m, timeout=3 * (timeout or self.timeout), bytecode=bytecode)
        again.detail = f"timed out at {first.seconds:.0f} s, then {again.status} ({again.detail})"
        return again

    def _run(self, m: Mutant | None, *, timeout: float, bytecode: bool) -> Outcome:
        self._forget_bytecode()
        text = self.original if m is None else apply_mutant(self.original, m)
        self.module.write_text(text)
        start = time.monotonic()
        proc = subprocess.Popen(self.command(), cwd=self.tree, env=self.env(bytecode=bytecode),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return Outcome(m, "timeout", time.monotonic() - start)
        finally:
            self.module.write_text(self.original)
            self._forget_bytecode()
        seconds = time.monotonic() - start
        tail = out.decode(errors="replace").strip().splitlines()[-1:] or [""]
        if proc.returncode == 0:
            return Outcome(m, "survived", seconds, tail[0])
        if proc.returncode in (1, 2):  # tests failed; a mutant that breaks collection (import) is killed too
            return Outcome(m, "killed", seconds, tail[0])
        return Outcome(m, "error", seconds, f"pytest exit {proc.returncode}: {tail[0]}")

    def close(self) -> None:
        shutil.rmtree(self.tree, ignore_errors=True)


def run_module(name: str, args: argparse.Namespace) -> dict[str, object]:
    target = TARGETS[name]
    every = mutants_of(target)
    chosen = every
    if args.only:
        chosen = [m for m in every if f"{m.path}:{m.line}" in args.only or f"{Path(m.path).name}:{m.line}" in args.only]
    sampled = bool(args.limit) and len(chosen) > args.limit
    if sampled:
        chosen = sorted(random.Random(f"{args.seed}:{name}").sample(chosen, args.limit),
                        key=lambda m: (m.line, m.col, m.what))
    equivalent = [m for m in chosen if m.key in EQUIVALENT]
    to_run = [m for m in chosen if m.key not in EQUIVALENT]
    tests, deselect, left_out = focused_tests(name, target)
    if args.tests:
        tests, deselect, left_out = list(args.tests), [], [("the focused set", "replaced by --tests")]
    print(f"== {name}: {target.path}: {len(every)} mutants" + (f", {len(chosen)} sampled (seed {args.seed})"
                                                                if sampled else ""), flush=True)
    print(f"   tests: {' '.join(tests)}" + (f" (less {len(deselect)} deselected)" if deselect else ""))
    for what, why in left_out:
        print(f"   left out: {what}: {why}")
    if args.list:
        for m in chosen:
            print(f"   {m}" + ("  [equivalent]" if m.key in EQUIVALENT else ""))
        return {}
    workdir = Path(tempfile.mkdtemp(prefix=f"ckptier-mut-{name}-"))
    runners = [Runner(name, target, tests, deselect, workdir / str(i)) for i in range(args.jobs)]
    try:
        base = runners[0].run(None, timeout=900, bytecode=True)
        for r in runners[1:]:
            r.run(None, timeout=900, bytecode=True)
        if base.status != "survived":
            print(f"   baseline FAILED ({base.status}, {base.detail}): the focused tests must pass unmutated")
            return {"error": 1}
        timeout = max(10.0, args.timeout_factor * base.seconds + 10)
        for r in runners:
            r.timeout = timeout
        print(f"   baseline passed in {base.seconds:.1f} s ({base.detail}); per-mutant timeout {timeout:.0f} s",
              flush=True)
        outcomes: list[Outcome] = []
        free = list(runners)

        def one(m: Mutant) -> Outcome:
            r = free.pop()
            try:
                return r.run(m)
            finally:
                free.append(r)

        start = time.monotonic()
        pool = ThreadPoolExecutor(max_workers=args.jobs)
        try:
            for i, o in enumerate(pool.map(one, to_run), 1):
                outcomes.append(o)
                if args.verbose or o.status not in ("killed",):
                    retried = f"  [{o.detail}]" if o.detail.startswith("timed out") else ""
                    print(f"   [{i}/{len(to_run)}] {o.status:8} {o.seconds:5.1f} s  {o.mutant}{retried}", flush=True)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # Ctrl-C: the mutants not started are not run
        elapsed = time.monotonic() - start
    finally:
        for r in runners:
            r.close()
        shutil.rmtree(workdir, ignore_errors=True)
    counts = {s: sum(1 for o in outcomes if o.status == s) for s in ("killed", "survived", "timeout", "error")}
    judged = len(to_run) - counts["error"]
    rate = (counts["killed"] + counts["timeout"]) / judged if judged else 1.0
    print(f"   {name}: mutants {len(chosen)}, equivalent {len(equivalent)}, killed {counts['killed']}, "
          f"survived {counts['survived']}, timeouts {counts['timeout']}, errors {counts['error']}, "
          f"kill rate {rate:.1%} of {judged} non-equivalent ({elapsed:.0f} s)"
          + (f" [sampled {len(chosen)} of {len(every)}, seed {args.seed}]" if sampled else ""), flush=True)
    for o in outcomes:
        if o.status == "survived":
            print(f"   survivor: {o.mutant}")
    for o in outcomes:
        if o.status == "error":
            print(f"   error: {o.mutant}: {o.detail}")
    return {"rate": rate, **counts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--module", action="append", choices=sorted(TARGETS),
                        help="module to mutate (repeatable; default all three)")
    parser.add_argument("--limit", type=int, default=300,
                        help="sample at most N mutants per module with --seed (0: every mutant; default 300)")
    parser.add_argument("--seed", default="30", help="sampling seed (default 30)")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1; the machine has 2 cores)")
    parser.add_argument("--timeout-factor", type=float, default=6.0,
                        help="a mutant's timeout: this times the baseline's seconds, plus 10 (default 6: on the "
                             "shared machine a survivor took up to 4 times the baseline)")
    parser.add_argument("--only", action="append", default=[], metavar="FILE:LINE",
                        help="run only the mutants on this line (repeatable)")
    parser.add_argument("--tests", action="append", default=[], metavar="PATH",
                        help="run these test files or node ids instead of the focused set (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--target", type=float, default=0.95, help="kill rate to reach (exit 1 below; default 0.95)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every mutant's outcome")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: use 1 or more")
    ok = True
    for name in args.module or list(TARGETS):
        result = run_module(name, args)
        if result and ("error" in result and "rate" not in result or float(str(result.get("rate", 1))) < args.target):
            ok = False
    return 0 if ok or args.list else 1


if __name__ == "__main__":
    sys.exit(main())
