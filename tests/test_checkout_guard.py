"""The tests refuse to run another checkout's code (tests/conftest.py, ``checkout_problem``).

An editable install resolves ``ckptier.storage`` to whichever checkout ran
``pip install -e`` last; a second checkout's tests would then pass or fail on
the first one's code without a word.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import ckptier.storage

from .conftest import ROOT, checkout_problem


def test_this_checkout_tests_its_own_code() -> None:
    assert checkout_problem() is None
    assert Path(ckptier.storage.__file__).resolve().is_relative_to(ROOT)


def test_a_copy_whose_import_resolves_elsewhere_stops_with_the_fix(tmp_path: Path) -> None:
    copy = tmp_path / "other-checkout"
    (copy / "tests").mkdir(parents=True)
    for name in ("__init__.py", "conftest.py"):
        shutil.copy(ROOT / "tests" / name, copy / "tests" / name)
    (copy / "tests" / "test_anything.py").write_text("def test_anything() -> None:\n    pass\n")
    # This interpreter imports ckptier from ROOT, not from the copy.
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                            cwd=copy, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 4, output
    root = copy.resolve()
    line = next(x for x in output.splitlines() if "ckptier.storage is imported from" in x)
    assert line == (f"ERROR: ckptier.storage is imported from {ROOT / 'storage'}, not from this checkout ({root}), "
                    f"so these tests would test another checkout's code; fix: cd {root} && pip install -e . "
                    "(or activate this checkout's venv)")
    assert "passed" not in output and "Traceback" not in output
