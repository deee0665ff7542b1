"""Bad input never ends in a traceback: a table of wrong invocations through the
real ``ckptier`` console script.

Each row runs the installed script in a subprocess (as a user would) and
must exit non-zero with a short message on stderr (at most three lines; in
practice one) that names the problem, never a Python traceback and never
the command line's last-resort "unexpected error" (which would mean a case
nobody handled). The catalog, checkpoints and files the rows point at are
made once for the module.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

#: The longest message a bad invocation may print on stderr.
MAX_LINES = 3


def ckptier_script() -> str:
    """The console script installed next to this interpreter (else the one on PATH)."""
    local = Path(sys.executable).parent / "ckptier"
    found = str(local) if local.exists() else shutil.which("ckptier")
    assert found, "the ckptier console script is not installed (pip install -e .)"
    return found


@dataclass(frozen=True)
class Case:
    name: str
    argv: tuple[str, ...]
    needle: str
    env: dict[str, str | None] = field(default_factory=dict)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """A scanned and verified demo run, a policy, and things that are in the way."""
    from ckptier.flows.cli import main
    from ckptier.tasks.demo import train_demo_run

    root = tmp_path_factory.mktemp("bad-input")
    hot = root / "hot"
    train_demo_run(hot, steps=100, every=25)
    catalog = root / "catalog.db"
    config = root / "policy.toml"  # not ./ckptier.toml: rows run here and some must find no config
    config.write_text(f'[[policy]]\njobs = "*"\nkeep_last = 2\nmilestones = "log"\narchive = "{(root / "archive").as_uri()}"\n')
    (root / "a-file").write_text("not a directory\n")
    (root / "full").mkdir()
    (root / "full" / "x").write_text("x")
    (root / "empty.toml").write_text("")
    (root / "jobs-only.toml").write_text('[[policy]]\njobs = "*"\n')
    (root / "broken.toml").write_text("[[policy]\njobs = \n")
    (root / "typo.toml").write_text('[[policy]]\njobs = "*"\nkeep_lats = 3\n')
    shim = root / "no-psycopg" / "psycopg"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'psycopg'\", name='psycopg')\n")
    url = f"sqlite:///{catalog}"
    assert main(["scan", str(hot), "--catalog", url, "--json"]) == 0
    assert main(["verify", "--catalog", url, "--json", "--no-prefect"]) == 0
    yield {"root": root, "hot": hot, "catalog": catalog, "config": config}


def cases(w: dict[str, Path]) -> list[Case]:
    from ckptier.tasks.drill_inputs import cuda_problem

    root = w["root"]
    file_, full, new = str(root / "a-file"), str(root / "full"), str(root / "new-dest")
    missing = f"sqlite:///{root / 'no' / 'such' / 'dir' / 'c.db'}"
    rows = [
        # the parser
        Case("no-command", (), "COMMAND"),
        Case("unknown-command", ("nosuchcommand",), "invalid choice"),
        Case("unknown-global-option", ("--bogus", "ls"), "--bogus"),
        Case("unknown-option", ("ls", "--bogus"), "--bogus"),
        Case("option-without-value", ("ls", "--job"), "--job"),
        Case("latest-without-job", ("latest",), "--job"),
        Case("resume-without-job", ("resume",), "--job"),
        Case("resume-stats-with-dest", ("resume", "--job", "demo-run", "--stats", "--dest", new), "--dest"),
        Case("fetch-without-step", ("fetch", "--job", "demo-run", new), "--step"),
        Case("fetch-without-job", ("fetch", "--step", "50", new), "--job"),
        Case("fetch-step-not-a-number", ("fetch", "--job", "demo-run", "--step", "x", new), "--step"),
        Case("fetch-negative-step", ("fetch", "--job", "demo-run", "--step", "-5", new), "--step"),
        Case("fetch-step-too-large", ("fetch", "--job", "demo-run", "--step", "99999999999999999999999", new),
             "--step: '99999999999999999999999' is out of range: a step number from 0 to 9,223,372,036,854,775,807"),
        Case("abbreviated-option", ("ls", "--al"), "unrecognized arguments: --al"),
        Case("abbreviated-global-option", ("ls", "--cat", "sqlite://"), "--cat"),
        Case("global-option-before-command", ("--catalog", missing, "ls"), "ckptier scan"),
        Case("json-before-a-command-without-it", ("--json", "demo"), "no JSON output"),
        Case("completion-unknown-shell", ("completion", "tcsh"), "invalid choice"),
        Case("advise-interval-negative", ("advise", "--params", "7e9", "--interval", "-1h"), "--interval: '-1h' is negative"),
        Case("advise-params-negative", ("advise", "--params", "-7e9"), "'-7e9'"),
        Case("advise-run-length-too-long", ("advise", "--params", "7e9", "--run-length", "99999d"), "to 3650d"),
        Case("advise-ranks-negative", ("advise", "--params", "7e9", "--ranks", "-2"), "--ranks: '-2' is out of range"),
        Case("drill-world-size-negative", ("drill", "--world-size", "-2"), "--world-size: '-2' is out of range"),
        Case("dashboard-port-too-large", ("dashboard", "--port", "70000"), "from 1 to 65,535"),
        Case("report-step-too-large", ("report", "--job", "demo-run", "--step", "99999999999999999999999"), "--step"),
        Case("scan-without-url", ("scan",), "URL"),
        # verify
        Case("verify-workers-0", ("verify", "--workers", "0"), "--workers"),
        Case("verify-workers-negative", ("verify", "--workers", "-1"), "--workers"),
        Case("verify-workers-word", ("verify", "--workers", "many"), "--workers"),
        Case("verify-sample-k-above-n", ("verify", "--sample", "9/7"), "--sample"),
        Case("verify-sample-k-zero", ("verify", "--sample", "0/7"), "--sample"),
        Case("verify-sample-word", ("verify", "--sample", "x"), "--sample"),
        Case("verify-sample-auto-zero", ("verify", "--sample", "auto/0"), "--sample"),
        Case("verify-sample-auto-word", ("verify", "--sample", "auto/x"), "--sample"),
        Case("verify-unknown-job", ("verify", "--job", "nope"), "nope"),
        # drill: refused before anything is fetched
        Case("drill-steps-word", ("drill", "--steps", "x"), "--steps"),
        Case("drill-steps-0", ("drill", "--steps", "0"), "--steps"),
        Case("drill-steps-negative", ("drill", "--steps", "-3"), "--steps"),
        Case("drill-device-unknown", ("drill", "--device", "gpu"), "--device"),
        Case("drill-no-such-module", ("drill", "--model", "nosuchmod:f"), "nosuchmod"),
        Case("drill-no-such-function", ("drill", "--model", "ckptier.tasks.drill_models:nosuchfunc"), "nosuchfunc"),
        Case("drill-no-such-submodule", ("drill", "--model", "json.nope:f"), "json.nope"),
        Case("drill-spec-malformed", ("drill", "--model", "not a spec"), "module:function"),
        Case("drill-no-such-file", ("drill", "--model", "/nonexistent/models.py:build"), "does not exist"),
        Case("drill-timeout-0", ("drill", "--timeout", "0"), "--timeout"),
        Case("drill-world-size-0", ("drill", "--world-size", "0"), "--world-size"),
        Case("drill-world-size-word", ("drill", "--world-size", "two"), "--world-size"),
        Case("drill-timeout-negative", ("drill", "--timeout", "-1"), "--timeout"),
        Case("drill-timeout-word", ("drill", "--timeout", "soon"), "--timeout"),
        Case("drill-step-word", ("drill", "--step", "x"), "--step"),
        Case("drill-allow-unsafe-global", ("drill", "--allow-global", "os.system"), "os"),
        Case("drill-allow-undotted-global", ("drill", "--allow-global", "notdotted"), "module.Name"),
        Case("drill-unknown-job", ("drill", "--job", "nope"), "nope"),
        # janitor
        Case("janitor-older-than-0", ("janitor", "--older-than", "0s"), "--older-than"),
        Case("janitor-older-than-word", ("janitor", "--older-than", "soon"), "--older-than"),
        Case("janitor-older-than-negative", ("janitor", "--older-than", "-1h"), "'-1h' is negative"),
        Case("janitor-older-than-too-long", ("janitor", "--older-than", "99999999999d"), "from 1s to 36500d"),
        # demo
        Case("demo-dir-is-a-file", ("demo", "--dir", file_), "is a file"),
        Case("demo-steps-0", ("demo", "--steps", "0"), "--steps"),
        Case("demo-steps-too-few", ("demo", "--steps", "10"), "--steps"),
        Case("demo-steps-word", ("demo", "--steps", "x"), "--steps"),
        # scan
        Case("scan-a-file", ("scan", file_), "is a file"),
        Case("scan-missing-dir", ("scan", "/definitely/not/here"), "does not exist"),
        Case("scan-unknown-scheme", ("scan", "ftp://host/x"), "unsupported scheme"),
        Case("scan-s3-no-bucket", ("scan", "s3://"), "no bucket"),
        Case("scan-s3-bad-bucket-name", ("scan", "s3://B/x"), "bucket name"),
        Case("scan-s3-endpoint-not-a-url", ("scan", "s3://bucket-x/x"), "AWS_ENDPOINT_URL",
             env={"AWS_ENDPOINT_URL": "notaurl"}),
        Case("scan-s3-unknown-profile", ("scan", "s3://bucket-x/x"), "nosuchprofile",
             env={"AWS_PROFILE": "nosuchprofile"}),
        Case("scan-into-a-directory-catalog", ("scan", str(w["hot"]), "--catalog", f"sqlite:///{full}"), "directory"),
        # catalogs
        Case("catalog-sqlite-with-host", ("ls", "--catalog", "sqlite://relative.db"), "sqlite:///relative.db"),
        Case("catalog-unknown-dialect", ("ls", "--catalog", "nosuchdialect://x"), "nosuchdialect"),
        Case("catalog-not-a-url", ("ls", "--catalog", "not a url"), "not a database URL"),
        Case("catalog-mysql", ("ls", "--catalog", "mysql://h/db"), "mysql"),
        Case("ls-missing-catalog", ("ls", "--catalog", missing), "ckptier scan"),
        Case("latest-missing-catalog", ("latest", "--job", "x", "--catalog", missing), "ckptier scan"),
        Case("resume-missing-catalog", ("resume", "--job", "x", "--catalog", missing), "ckptier scan"),
        Case("plan-missing-catalog", ("plan", "--catalog", missing), "ckptier scan"),
        Case("default-catalog-missing", ("ls", "--catalog", ""), "ckptier scan", env={"CKPTIER_CATALOG_URL": None}),
        Case("catalog-is-a-directory", ("ls", "--catalog", f"sqlite:///{full}"), "directory"),
        Case("catalog-not-sqlite", ("ls", "--catalog", f"sqlite:///{file_}"), "not a SQLite"),
        Case("catalog-postgres-unreachable", ("ls", "--catalog", "postgresql://u:secret@127.0.0.1:1/x"), "***"),
        Case("catalog-postgres-without-psycopg", ("ls", "--catalog", "postgresql://u@127.0.0.1:1/x"),
             "pip install 'ckptier[postgres]'", env={"PYTHONPATH": str(root / "no-psycopg")}),
        # jobs and steps
        Case("ls-unknown-job", ("ls", "--job", "nope"), "nope"),
        Case("ls-empty-job", ("ls", "--job", ""), "--job: '' is empty"),
        Case("plan-empty-job", ("plan", "--job", " "), "is empty"),
        Case("latest-unknown-job", ("latest", "--job", "nope"), "nope"),
        Case("plan-unknown-job", ("plan", "--job", "nope"), "nope"),
        Case("fetch-unknown-job", ("fetch", "--job", "nope", "--step", "1", new), "nope"),
        Case("fetch-unknown-step", ("fetch", "--job", "demo-run", "--step", "999", new), "999"),
        Case("fetch-into-a-file", ("fetch", "--job", "demo-run", "--step", "50", file_), "is a file"),
        Case("resume-unknown-job", ("resume", "--job", "nope"), "nope"),
        Case("resume-dest-a-file", ("resume", "--job", "demo-run", "--dest", file_), "is a file"),
        Case("fetch-into-a-full-dir", ("fetch", "--job", "demo-run", "--step", "50", full), "not empty"),
        # config files
        Case("config-missing", ("plan", "--config", "/nonexistent/ckptier.toml"), "does not exist"),
        Case("config-is-a-directory", ("plan", "--config", full), f"is a directory; give the file itself, e.g. '{full}/ckptier.toml'"),
        Case("scan-into-memory", ("scan", str(w["hot"]), "--catalog", "sqlite://"), "in-memory database"),
        Case("scan-into-memory-path", ("scan", str(w["hot"]), "--catalog", "sqlite:///:memory:"), "in-memory database"),
        Case("rebuild-into-memory", ("rebuild", str(w["hot"]), "--catalog", "sqlite://"), "in-memory database"),
        Case("config-env-missing", ("ls",), "CKPTIER_CONFIG",
             env={"CKPTIER_CONFIG": "/nonexistent/ckptier.toml", "CKPTIER_CATALOG_URL": None}),
        Case("config-not-toml", ("plan", "--config", str(root / "broken.toml")), "TOML"),
        Case("config-typo", ("plan", "--config", str(root / "typo.toml")), "keep_lats"),
        Case("apply-without-config", ("apply",), "[[policy]]", env={"CKPTIER_CONFIG": None}),
        Case("apply-empty-config", ("apply", "--config", str(root / "empty.toml")), "[[policy]]"),
        Case("apply-jobs-only-policy", ("apply", "--config", str(root / "jobs-only.toml")), "retention rule"),
        # forget, advise, lifecycle, report, dashboard
        Case("forget-without-missing", ("forget", "--job", "demo-run"), "--missing"),
        Case("forget-unknown-job", ("forget", "--job", "nope", "--missing"), "nope"),
        Case("forget-older-than-word", ("forget", "--job", "demo-run", "--missing", "--older-than", "soon"), "soon"),
        Case("advise-without-params", ("advise",), "--params"),
        Case("advise-params-word", ("advise", "--params", "lots"), "--params"),
        Case("advise-unknown-job", ("advise", "--params", "7e9", "--job", "nope"), "nope"),
        Case("lifecycle-without-job", ("lifecycle",), "--job"),
        Case("lifecycle-unknown-job", ("lifecycle", "--job", "nope"), "nope"),
        Case("report-unknown-job", ("report", "--job", "nope"), "nope"),
        Case("report-unknown-format", ("report", "--format", "xml"), "--format"),
        Case("report-missing-catalog", ("report", "--catalog", missing), "ckptier scan"),
        Case("dashboard-open-bind-without-token", ("dashboard", "--host", "0.0.0.0"), "--token"),
        Case("dashboard-port-word", ("dashboard", "--port", "x"), "--port"),
        # Prefect
        Case("deploy-api-down", ("deploy",), "PREFECT_API_URL", env={"PREFECT_API_URL": "http://127.0.0.1:9/api"}),
        Case("scan-api-down", ("scan", str(w["hot"])), "PREFECT_API_URL", env={"PREFECT_API_URL": "http://127.0.0.1:9/api"}),
    ]
    if cuda_problem() is not None:
        rows.append(Case("drill-cuda-without-gpu", ("drill", "--device", "cuda"), "--device cuda"))
    return rows


def _run(case: Case, base_env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(base_env)
    for key, value in case.env.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return subprocess.run([ckptier_script(), *case.argv], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=120, check=False)


def test_bad_invocations_fail_in_one_short_line(world: dict[str, Path]) -> None:
    root = world["root"]
    home = root / "home"
    home.mkdir(exist_ok=True)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTIER_", "PREFECT_", "AWS_"))}
    base_env.update(HOME=str(home), PREFECT_HOME=str(home / ".prefect"), XDG_DATA_HOME=str(home / "data"),
                    CKPTIER_CATALOG_URL=f"sqlite:///{world['catalog']}", CKPTIER_CONFIG=str(world["config"]),
                    AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                    AWS_CONFIG_FILE=str(root / "none"), AWS_SHARED_CREDENTIALS_FILE=str(root / "none"),
                    AWS_EC2_METADATA_DISABLED="true", AWS_MAX_ATTEMPTS="1")
    table = cases(world)
    assert len(table) >= 60 and len({c.name for c in table}) == len(table)
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda c: (c, _run(c, base_env, root)), table))
    failures = []
    for case, proc in results:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        problems = []
        if proc.returncode == 0:
            problems.append("exit status 0")
        if "Traceback" in proc.stderr + proc.stdout:
            problems.append("a traceback")
        if not lines or len(lines) > MAX_LINES:
            problems.append(f"{len(lines)} lines on stderr")
        if "unexpected error" in proc.stderr:
            problems.append("the last-resort handler (a case nobody handled)")
        if case.needle not in proc.stderr:
            problems.append(f"no {case.needle!r} in the message")
        if "secret" in proc.stderr + proc.stdout:
            problems.append("a password shown")
        if problems:
            failures.append(f"{case.name} {' '.join(case.argv)!r}: {', '.join(problems)}:\n{proc.stderr[-600:]}")
    assert not failures, f"{len(failures)} of {len(table)} bad invocations misbehave:\n" + "\n".join(failures)
    # Read-only commands pointed at a typo created nothing.
    assert not (root / "no").exists()
    assert not (home / "data").exists() and not (home / ".local").exists()


# ------------------------------------------------------------------ what the fixes must still let through


def _script(*argv: str, env: dict[str, str] | None = None, cwd: Path | None = None,
            timeout: int = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ckptier_script(), *argv], capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, **(env or {})}, cwd=cwd)


def test_global_options_go_before_or_after_the_command(world: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """``ckptier --catalog URL --json ls`` is ``ckptier ls --catalog URL --json``; after the command wins."""
    import json

    from ckptier.flows.cli import main

    url = f"sqlite:///{world['catalog']}"
    assert main(["ls", "--catalog", url, "--json"]) == 0
    after = json.loads(capsys.readouterr().out)
    assert main(["--catalog", url, "--json", "ls"]) == 0
    before = json.loads(capsys.readouterr().out)
    assert before == after and len(after) >= 3
    assert main(["--catalog", "sqlite:////nonexistent/x.db", "ls", "--catalog", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == after
    assert main(["-q", "--config", str(world["config"]), "plan", "--catalog", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)


def test_a_config_with_a_byte_order_mark_reads_as_without(world: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from ckptier.flows.cli import main

    bom = world["root"] / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf" + world["config"].read_bytes())
    url = f"sqlite:///{world['catalog']}"
    assert main(["plan", "--catalog", url, "--config", str(world["config"]), "--json"]) == 0
    plain = [(r["step"], r["action"]) for r in json.loads(capsys.readouterr().out)]
    assert main(["plan", "--catalog", url, "--config", str(bom), "--json"]) == 0
    assert [(r["step"], r["action"]) for r in json.loads(capsys.readouterr().out)] == plain
    assert any(action == "promote" for _, action in plain)  # the policy of the file was read, not the default


@pytest.fixture(scope="module")
def copied_tree(world: dict[str, Path]) -> str:
    """A job copied in one go (``cp -r``): 60 checkpoints whose files are milliseconds apart."""
    import json

    from ckptier.flows.cli import main

    src = world["hot"] / "demo-run" / "step-00000025"
    job = world["root"] / "copied" / "job-copied"
    job.mkdir(parents=True)
    for i in range(1, 61):
        d = job / f"step-{i * 25:08d}"
        shutil.copytree(src, d)
        meta = json.loads((d / "metadata.json").read_text())
        (d / "metadata.json").write_text(json.dumps({**meta, "step": i * 25}))
    url = f"sqlite:///{world['root'] / 'copied.db'}"
    assert main(["scan", str(job.parent), "--catalog", url, "--json"]) == 0
    return url


@pytest.mark.parametrize("argv", [
    ("advise", "--params", "7e9", "--job", "job-copied"),
    ("advise", "--params", "7e9", "--interval", "1s"),
    ("advise", "--params", "7e9", "--interval", "1s", "--run-length", "3650d", "--json"),
], ids=["copied-tree", "interval-1s", "ten-years-of-1s"])
def test_advise_ends_at_once_whatever_the_interval(copied_tree: str, argv: tuple[str, ...], tmp_path: Path) -> None:
    """Saves 0.2 ms apart once meant billions of simulated saves (it never ended): the
    simulation is bounded and says how it approximated. The timeout is generous (a slow
    CI machine); a run that finishes at all proves the bound."""
    proc = _script(*argv, "--catalog", copied_tree, cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "approximation: " in proc.stdout and "standing for" in proc.stdout


def test_bash_completion_is_made_from_the_parser(tmp_path: Path) -> None:
    from ckptier.flows.arguments import subparsers
    from ckptier.flows.cli import build_parser

    proc = _script("completion", "bash", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    commands = subparsers(build_parser())
    assert {"scan", "ls", "advise", "rebuild", "completion"} <= set(commands)
    for name in commands:
        assert f" {name} " in proc.stdout or f"        {name})" in proc.stdout, name
    script = tmp_path / "ckptier.bash"
    script.write_text(proc.stdout)
    shell = subprocess.run(
        ["bash", "-c", f'source {script} && declare -F _ckptier && complete -p ckptier && '
                       'COMP_WORDS=(ckptier drill --device ""); COMP_CWORD=3; _ckptier; echo "${COMPREPLY[*]}"; '
                       'COMP_WORDS=(ckptier lat); COMP_CWORD=1; _ckptier; echo "${COMPREPLY[*]}"'],
        capture_output=True, text=True, timeout=30, check=False)
    assert shell.returncode == 0, shell.stderr
    lines = shell.stdout.splitlines()
    assert lines[0] == "_ckptier" and "-F _ckptier ckptier" in lines[1]
    assert lines[2] == "auto cpu cuda" and lines[3] == "latest"
    for shell_name in ("zsh", "fish"):
        out = _script("completion", shell_name, cwd=tmp_path).stdout
        assert all(name in out for name in commands), shell_name


def test_the_exit_codes_table_is_the_code() -> None:
    """docs/cli.md's table lists exactly :data:`EXIT_CODES`, and every ``EXIT_*`` constant is in it."""
    import re

    from ckptier.flows import cli

    doc = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    table = dict(re.findall(r"^\| (\d+) \| (.+) \|$", doc, flags=re.MULTILINE))
    assert {int(k): v for k, v in table.items()} == cli.EXIT_CODES
    constants = {v for k, v in vars(cli).items() if k.startswith("EXIT_") and isinstance(v, int)}
    assert constants <= set(cli.EXIT_CODES) and 0 in cli.EXIT_CODES


def test_verbosity_reaches_prefect_and_ckptier_and_is_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    from ckptier.flows.arguments import apply_verbosity

    monkeypatch.delenv("PREFECT_LOGGING_LEVEL", raising=False)
    logger = logging.getLogger("ckptier")
    level = logger.level
    undo = apply_verbosity(-1)
    assert os.environ["PREFECT_LOGGING_LEVEL"] == "ERROR" == os.environ["PREFECT_SERVER_LOGGING_LEVEL"]
    assert logger.level == logging.ERROR
    undo()
    assert "PREFECT_LOGGING_LEVEL" not in os.environ and logger.level == level
    undo = apply_verbosity(2)
    assert os.environ["PREFECT_LOGGING_LEVEL"] == "DEBUG" and logger.level == logging.DEBUG
    undo()
    assert apply_verbosity(0) is not None and "PREFECT_LOGGING_LEVEL" not in os.environ


def test_every_option_of_every_command_is_checked_by_the_shared_layer() -> None:
    """No parser takes abbreviations, every --job refuses '', and no option is a bare int or float
    (unbounded: 99999999999999999999999 reached the catalog and ended in exit 70)."""
    from ckptier.flows.arguments import JOB, _walk
    from ckptier.flows.cli import build_parser

    for parser in _walk(build_parser()):
        assert parser.allow_abbrev is False, parser.prog
        for action in parser._actions:
            assert action.type not in (int, float), f"{parser.prog} {action.option_strings}"
            if action.dest == "job" and action.option_strings:
                assert action.type is JOB, parser.prog
