"""The names users write are exported by ``ckptier`` and kept across moves.

``import ckptier`` stays free of torch, Prefect and SQLAlchemy; the drill
factory names resolve lazily to the objects of ``ckptier.tasks.drill_models``;
the old module ``ckptier.tasks.models`` still answers, with a deprecation
warning that names the new import.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

FACTORY_NAMES = ("DrillSpec", "demo_batch", "demo_loss", "demo_model", "hf_spec", "train_step", "trainer_optimizer")


def test_import_ckptier_loads_no_heavy_dependency() -> None:
    code = ("import sys, json, ckptier\n"
            "names = sorted(ckptier.__all__)\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'prefect', 'sqlalchemy'})\n"
            "print(json.dumps({'heavy': heavy, 'names': names}))\n")
    out = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                    text=True).stdout)
    assert out["heavy"] == []
    assert set(FACTORY_NAMES) <= set(out["names"])


@pytest.mark.parametrize("name", FACTORY_NAMES)
def test_factory_names_are_the_drill_models_objects(name: str) -> None:
    import ckptier
    from ckptier.tasks import drill_models

    assert getattr(ckptier, name) is getattr(drill_models, name)
    assert name in dir(ckptier)


def test_a_factory_written_with_the_top_level_names_builds_a_spec() -> None:
    from ckptier import DrillSpec, demo_model

    spec = demo_model()
    assert isinstance(spec, DrillSpec) and spec.batch is not None and spec.loss is not None


def test_the_old_module_path_works_with_a_warning() -> None:
    import ckptier

    with pytest.warns(DeprecationWarning, match=r"from ckptier import DrillSpec"):
        from ckptier.tasks.models import DrillSpec
    assert DrillSpec is ckptier.DrillSpec
    with pytest.warns(DeprecationWarning, match=r"from ckptier import demo_model"):
        from ckptier.tasks.models import demo_model
    assert demo_model is ckptier.demo_model


def test_the_old_module_path_refuses_names_it_never_held() -> None:
    import ckptier.tasks.models as old

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no attribute 'resolve_factory'.*import from 'ckptier'"):
            old.resolve_factory  # noqa: B018


def test_an_old_factory_file_still_drills_by_its_spec(tmp_path: object) -> None:
    """A user factory of last month, named by ``path.py:function``, resolves."""
    from pathlib import Path

    from ckptier.tasks.drill_models import DrillSpec, resolve_factory

    factory = Path(str(tmp_path)) / "old_factory.py"
    factory.write_text("from ckptier.tasks.models import DrillSpec, demo_model\n\n\n"
                       "def make():\n    spec = demo_model()\n    return DrillSpec(spec.model, spec.optimizer, spec.batch, spec.loss)\n")
    with pytest.warns(DeprecationWarning):
        spec = resolve_factory(f"{factory}:make")()
    assert isinstance(spec, DrillSpec)


def _python_blocks(path: str) -> list[str]:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / path).read_text()
    return [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]


def test_docs_drills_factory_snippet_imports_from_ckptier_and_builds_an_exact_spec() -> None:
    blocks = [b for b in _python_blocks("docs/drills.md") if "DrillSpec" in b]
    assert blocks, "docs/drills.md shows no factory written with DrillSpec"
    for block in blocks:
        assert "from ckptier import DrillSpec" in block and "ckptier.tasks" not in block
    namespace: dict[str, object] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        exec(compile(blocks[0], "docs/drills.md", "exec"), namespace)
    spec = namespace["exact"]()  # type: ignore[operator]
    from ckptier import DrillSpec

    assert isinstance(spec, DrillSpec) and spec.trajectory_rtol == 0.0


def test_docs_tell_users_the_top_level_import_not_the_internal_module() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for page in ("docs/drills.md", "docs/restore-drills.md"):
        text = (root / page).read_text()
        assert "ckptier.tasks.drill_models.DrillSpec" not in text, page
        assert "ckptier.tasks.models" not in text or "DeprecationWarning" in text, page
    assert "from ckptier import DrillSpec" in (root / "docs/restore-drills.md").read_text()
