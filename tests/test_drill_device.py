"""Where a drill runs: a GPU where one is expected, CPU said loudly, and the [[drill]] values a run leaves alone."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from ckptier.storage.errors import ConfigError
from ckptier.tasks.config import DrillSettings, drill_values, parse_config
from ckptier.tasks.drill_inputs import decide_device

FAIL = "fail"
LOUD = "cpu, loudly"

#: device, [[drill]] require_gpu, GPU pool, GPUs visible -> the device it runs on, LOUD (CPU with the
#: report saying it fell back) or FAIL.
CASES = [
    ("cpu", None, None, 0, "cpu"),
    ("cpu", True, "ckptier-gpu", 0, "cpu"),  # asked for CPU: no GPU needed
    ("auto", None, None, 0, "auto"),  # a laptop: auto is CPU, nothing expected a GPU
    ("auto", None, "ckptier-gpu", 0, FAIL),  # the GPU pool expects one
    ("auto", True, None, 0, FAIL),
    ("auto", False, "ckptier-gpu", 0, LOUD),
    ("auto", False, None, 0, LOUD),
    ("auto", None, "ckptier-gpu", 1, "auto"),
    ("auto", True, None, 2, "auto"),
    ("cuda", False, None, 0, FAIL),  # cuda asked for: never CPU
    ("cuda", None, "ckptier-gpu", 1, "cuda"),
]


@pytest.mark.parametrize(("device", "require", "pool", "gpus", "expected"), CASES)
def test_a_drill_runs_where_a_gpu_is_expected_or_says_it_did_not(device: str, require: bool | None, pool: str | None,
                                                                  gpus: int, expected: str) -> None:
    environ = {"CUDA_VISIBLE_DEVICES": ""}
    if expected == FAIL:
        with pytest.raises(ConfigError) as info:
            decide_device(device, require_gpu=require, gpu_pool=pool, gpus=gpus, environ=environ)
        message = str(info.value)
        assert "no GPU visible on this worker (CUDA_VISIBLE_DEVICES='')" in message
        if device == "auto":
            assert "set [[drill]] require_gpu = false to drill on CPU" in message
        return
    choice = decide_device(device, require_gpu=require, gpu_pool=pool, gpus=gpus, environ=environ)
    if expected == LOUD:
        assert choice.device == "cpu" and choice.fallback is not None
        assert choice.fallback.startswith("FELL BACK TO CPU: no GPU visible on this worker")
    else:
        assert (choice.device, choice.fallback) == (expected, None)


def test_the_failure_names_an_unset_cuda_visible_devices_too() -> None:
    with pytest.raises(ConfigError, match=r"CUDA_VISIBLE_DEVICES unset\), and drills on work pool 'gpus' need one"):
        decide_device("auto", require_gpu=None, gpu_pool="gpus", gpus=0, environ={})


def test_require_gpu_is_read_from_the_drill_table() -> None:
    config = parse_config('[[drill]]\njobs = "a*"\nrequire_gpu = false\n[[drill]]\njobs = "*"\n')
    assert config.drill_for("abc").require_gpu is False
    assert config.drill_for("xyz").require_gpu is None
    with pytest.raises(ConfigError, match="require_gpu"):
        parse_config('[[drill]]\nrequire_gpu = "yes"\n')


@pytest.mark.parametrize(("asked", "expected"), [
    ((None, None, None), (50, "cpu", 60.0)),  # nothing asked: the job's [[drill]]
    ((10, "auto", 900.0), (50, "cpu", 60.0)),  # the built-in values (the Prefect form's defaults): the same
    ((3, "cuda", 30.0), (3, "cuda", 30.0)),  # anything else asked wins
])
def test_a_run_left_at_the_built_in_values_drills_as_the_job_says(asked: tuple, expected: tuple) -> None:
    table = DrillSettings(steps=50, device="cpu", timeout=timedelta(seconds=60))
    steps, device, timeout = asked
    assert drill_values(table, steps=steps, device=device, timeout=timeout) == expected
    assert drill_values(DrillSettings(), steps=None, device=None, timeout=None) == (10, "auto", 900.0)


def _report(ok: bool, stage: str | None, summary: str) -> Any:
    from datetime import UTC, datetime

    from ckptier.tasks.reports import DrillReport

    at = datetime(2026, 1, 1, tzinfo=UTC)
    return DrillReport(job="j", step=5, ok=ok, summary=summary, checks=(), started_at=at, finished_at=at, stage=stage)


@pytest.mark.parametrize(("reports", "state"), [
    ([(True, None, "j step 5: drill ok")], ("COMPLETED", "Completed", "j step 5: drill ok")),
    ([(False, "load", "j step 5: drill failed: load"), (True, None, "j step 4: drill ok")],
     ("FAILED", "Failed", "j step 5: drill failed: load")),
    ([(False, "fit", "j step 5: not judged: fit")], ("FAILED", "Not judged", "j step 5: not judged: fit")),
    ([(False, "fit", "k: not judged"), (False, "judge", "j: drill failed")], ("FAILED", "Failed", "j: drill failed; k: not judged")),
])
def test_the_drill_task_state_is_its_verdict(reports: list[tuple[bool, str | None, str]],
                                              state: tuple[str, str, str]) -> None:
    from ckptier.tasks.prefect_tasks import drill_state

    got = drill_state([_report(*r) for r in reports])
    assert (got.type.value, got.name, got.message) == state
