"""Loading untrusted checkpoints: nothing in a checkpoint may run code.

docs/failure-scenarios.md, hostile pickles: a malicious pickle never runs (directly, via the
DCP reader, or through the drill subprocess); an unknown global fails naming
it; .pt2 is refused; a tensor that does not fit the model fails clearly; the
numpy RNG state of Hugging Face's rng_state.pth loads.
"""

from __future__ import annotations

import copyreg
import io
import json
import os
import pickle
import random
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptier.storage.errors import ConfigError
from ckptier.tasks.drill import DrillRequest
from ckptier.tasks.drill_launch import run_drill_subprocess
from ckptier.tasks.drill_worker import run_request
from ckptier.tasks.drill_models import demo_model
from ckptier.formats.safe_load import (
    exactly_these_globals,
    CheckpointLoadError,
    UnsafeCheckpoint,
    load_checkpoint_dir,
    load_dcp_tensors,
    read_dcp_metadata,
    refused_global,
    safe_torch_load,
)
from tests.fixtures.hostile import Call, Global, New, dumps, torch_file


class Canary:
    """Unpickling this creates ``path`` (through os.system) - if it ever runs."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.path}",))


@dataclass
class TrainConfig:
    lr: float
    name: str


def _guide(root: Path, model_obj: object, optimizer_obj: object | None = None) -> Path:
    step_dir = root / "job" / "step-00000010"
    (step_dir / "rank-0000").mkdir(parents=True)
    torch.save(model_obj, step_dir / "rank-0000" / "model.pt")
    if optimizer_obj is not None:
        torch.save(optimizer_obj, step_dir / "rank-0000" / "optimizer.pt")
    (step_dir / "metadata.json").write_text(json.dumps({"step": 10}))
    return step_dir


def test_malicious_pickle_is_refused_and_never_runs(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    path = tmp_path / "evil.pt"
    torch.save({"weight": torch.zeros(2), "payload": Canary(canary)}, path)
    with pytest.raises(UnsafeCheckpoint) as info:
        safe_torch_load(path)
    assert info.value.global_name in ("posix.system", "os.system")
    assert "hostile" in str(info.value) and "\n" not in str(info.value)
    assert "--allow-global" not in str(info.value)  # no advice to allow os.system
    assert not canary.exists()


def test_malicious_pickle_through_the_drill_subprocess(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    state = demo_model().model.state_dict()
    step_dir = _guide(tmp_path / "hot", {**state, "payload": Canary(canary)})
    result = run_drill_subprocess(
        step_dir, "guide", factory="ckptier.tasks.drill_models:demo_model", scratch=tmp_path / "scratch", steps=2, timeout=120
    )
    assert result.unsafe and result.error_stage == "load", result
    assert "system" in (result.error or "")
    assert not canary.exists()


def test_dcp_metadata_is_not_unpickled_blindly(tmp_path: Path) -> None:
    # torch's FileSystemReader calls pickle.load on .metadata; ours admits only DCP classes.
    canary = tmp_path / "canary"
    ckpt = tmp_path / "step-5"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(pickle.dumps(Canary(canary)))
    with pytest.raises(UnsafeCheckpoint, match="system"):
        read_dcp_metadata(ckpt)
    with pytest.raises(UnsafeCheckpoint):
        load_checkpoint_dir(ckpt, "dcp")
    assert not canary.exists()


def test_dcp_non_tensor_entries_are_never_unpickled(tmp_path: Path) -> None:
    # DCP stores non-tensors with torch.save and reads them back with weights_only=False.
    import torch.distributed.checkpoint as dcp

    canary = tmp_path / "canary"
    ckpt = tmp_path / "step-7"
    dcp.save({"model": {"w": torch.arange(4.0)}, "train_state": {"evil": Canary(canary)}}, checkpoint_id=str(ckpt))
    tensors = load_dcp_tensors(ckpt)
    assert set(tensors) == {"model.w"}
    assert torch.equal(tensors["model.w"], torch.arange(4.0))
    assert not canary.exists()


def test_unknown_global_fails_naming_it_and_loads_once_allowed(tmp_path: Path) -> None:
    path = tmp_path / "with_config.pt"
    torch.save({"weight": torch.ones(3), "config": TrainConfig(lr=0.1, name="run")}, path)
    with pytest.raises(UnsafeCheckpoint) as info:
        safe_torch_load(path)
    name = f"{__name__}.TrainConfig"
    assert info.value.global_name == name
    assert f"--allow-global {name}" in str(info.value)
    loaded = safe_torch_load(path, extra_allowlist=[name])
    assert loaded["config"] == TrainConfig(lr=0.1, name="run")
    assert torch.equal(loaded["weight"], torch.ones(3))


def test_allow_global_that_does_not_exist_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "w.pt"
    torch.save({"w": torch.ones(1)}, path)
    with pytest.raises(ConfigError, match="no_such_module_xyz"):
        safe_torch_load(path, extra_allowlist=["no_such_module_xyz.Thing"])


class Speaker:
    """Harmless, but its pickle calls a function (builtins.print) when loaded."""

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (print, ("unpickling ran code",))


def test_only_classes_outside_unsafe_modules_can_be_allowlisted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # torch runs any allowlisted callable, so allowlisting a function would let a pickle call it.
    path = tmp_path / "speaks.pt"
    torch.save({"w": torch.ones(1), "x": Speaker()}, path)
    with pytest.raises(UnsafeCheckpoint, match=r"calls __builtin__\.print: module 'builtins' can run code") as info:
        safe_torch_load(path)
    assert "--allow-global" not in str(info.value)  # never advise allowlisting a builtin
    with pytest.raises(ConfigError, match="'builtins'"):
        safe_torch_load(path, extra_allowlist=["builtins.print"])
    with pytest.raises(ConfigError, match="not a class"):
        safe_torch_load(path, extra_allowlist=["textwrap.dedent"])
    with pytest.raises(ConfigError, match="dotted module.Name"):
        safe_torch_load(path, extra_allowlist=["TrainConfig"])
    assert "unpickling ran code" not in capsys.readouterr().out


def test_pt2_is_refused_by_name_and_by_content(tmp_path: Path) -> None:
    named = tmp_path / "model.pt2"
    torch.save({"w": torch.ones(1)}, named)
    with pytest.raises(UnsafeCheckpoint, match=r"\.pt2"):
        safe_torch_load(named)
    disguised = tmp_path / "model.pt"
    with zipfile.ZipFile(disguised, "w") as archive:
        archive.writestr("model/archive_format", "pt2")
        archive.writestr("model/models/model.json", "{}")
    with pytest.raises(UnsafeCheckpoint, match="torch.export"):
        safe_torch_load(disguised)


def test_missing_file_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointLoadError, match="not found"):
        safe_torch_load(tmp_path / "absent.pt")


def test_shape_mismatch_is_a_clear_failure_not_a_crash(tmp_path: Path) -> None:
    state = demo_model().model.state_dict()
    state["net.2.weight"] = torch.zeros(32, 64)  # the model has [64, 64]
    step_dir = _guide(tmp_path, state)
    request = DrillRequest(str(step_dir), "guide", "ckptier.tasks.drill_models:demo_model", 2, "cpu", str(tmp_path / "r.json"))
    result = run_request(request)
    assert result.error_stage == "fit"  # the model does not fit the checkpoint: not judged, never blamed
    assert "net.2.weight" in (result.error or "")
    assert "[32, 64]" in (result.error or "") and "[64, 64]" in (result.error or "")


def test_hf_rng_state_with_numpy_state_loads(tmp_path: Path) -> None:
    path = tmp_path / "rng_state.pth"
    np.random.seed(3)
    states = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    torch.save(states, path)
    loaded = safe_torch_load(path)
    assert loaded["numpy"][0] == "MT19937"
    np.testing.assert_array_equal(loaded["numpy"][1], states["numpy"][1])
    assert loaded["python"] == states["python"]
    assert torch.equal(loaded["cpu"], states["cpu"])


def test_rng_state_written_under_numpy_1_loads(tmp_path: Path) -> None:
    # numpy 1.x names the array reconstructor numpy.core.multiarray._reconstruct.
    src = tmp_path / "new.pth"
    torch.save({"numpy": np.random.get_state()}, src)
    old = tmp_path / "rng_state_1.pth"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(old, "w", zipfile.ZIP_STORED) as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename.endswith("data.pkl"):
                assert b"numpy._core.multiarray" in data
                data = data.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
            zout.writestr(item, data)
    loaded = safe_torch_load(old)
    assert loaded["numpy"][1].dtype == np.uint32 and loaded["numpy"][1].shape == (624,)


def test_object_arrays_stay_refused(tmp_path: Path) -> None:
    path = tmp_path / "objects.pt"
    torch.save({"a": np.array([{"x": 1}], dtype=object)}, path)
    with pytest.raises(UnsafeCheckpoint):
        safe_torch_load(path)


@pytest.mark.parametrize(
    "message, expected",
    [
        ("WeightsUnpickler error: Unsupported global: GLOBAL foo.Bar was not an allowed global by default.", "foo.Bar"),
        ("Trying to call reduce for unrecognized function mod.fn", "mod.fn"),
        ("something else entirely", None),
    ],
)
def test_refused_global_parsing(message: str, expected: str | None) -> None:
    assert refused_global(message) == expected


def test_mmap_load_leaves_the_file_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torch.save({"w": torch.zeros(1000)}, path)
    before = path.read_bytes()
    loaded = safe_torch_load(path)
    loaded["w"].add_(1.0)  # copy-on-write mapping: the file must not see this
    del loaded
    assert path.read_bytes() == before
    assert io.BytesIO(before).getbuffer().nbytes > 0


# --- every refusal names the global, however the pickle spells it ----------------

class Outer:
    class Inner:
        """A plain class nested in another: pickles name it Outer.Inner."""


def _refused(path: Path) -> UnsafeCheckpoint:
    with pytest.raises(UnsafeCheckpoint) as info:
        safe_torch_load(path)
    message = str(info.value)
    assert "\n" not in message and "refused to load: ;" not in message
    return info.value


def _evil(tmp_path: Path, name: str, pickle_bytes: bytes) -> Path:
    return torch_file(tmp_path / f"{name}.pt", pickle_bytes)


def test_numpy_object_array_is_refused_naming_its_dtype(tmp_path: Path) -> None:
    path = tmp_path / "objects.pt"
    torch.save({"a": np.array([{"x": 1}], dtype=object)}, path)
    refused = _refused(path)
    assert refused.global_name == "numpy.dtypes.ObjectDType"
    assert "numpy.dtypes.ObjectDType (a numpy array of Python objects)" in str(refused)
    assert "can never be allowed" in str(refused) and "--allow-global" not in str(refused)


def test_stack_global_is_named_even_through_the_memo(tmp_path: Path) -> None:
    # protocol 4: module and name pushed as strings, memoized, fetched back, then STACK_GLOBAL
    hostile = b"\x80\x04\x8c\x02os\x94\x8c\x06system\x94h\x00h\x01\x93\x94\x8c\x04true\x94\x85\x94R\x94."
    refused = _refused(_evil(tmp_path, "stack-global", hostile))
    assert refused.global_name == "os.system"
    assert "STACK_GLOBAL" in str(refused) and "hostile" in str(refused)
    plain = pickle.dumps(TrainConfig(lr=0.1, name="x"), protocol=4)
    refused = _refused(_evil(tmp_path, "stack-global-plain", plain))
    assert refused.global_name == f"{__name__}.TrainConfig" and "STACK_GLOBAL" in str(refused)
    assert "--allow-global" not in str(refused)  # allowing it would not help: torch refuses the opcode


def test_inst_and_obj_are_named(tmp_path: Path) -> None:
    inst = _refused(_evil(tmp_path, "inst", b"(S'true'\nios\nsystem\n."))
    assert inst.global_name == "os.system" and "INST" in str(inst) and "hostile" in str(inst)
    obj = _refused(_evil(tmp_path, "obj", b"\x80\x02(csubprocess\ngetoutput\nX\x04\x00\x00\x00trueo."))
    assert obj.global_name == "subprocess.getoutput" and "hostile" in str(obj)


def test_extension_codes_are_named(tmp_path: Path) -> None:
    copyreg.add_extension("os", "system", 240)
    try:
        registered = _refused(_evil(tmp_path, "ext-os", b"\x80\x02\x82\xf0X\x04\x00\x00\x00true\x85R."))
    finally:
        copyreg.remove_extension("os", "system", 240)
    assert registered.global_name == "os.system" and "EXT1" in str(registered) and "hostile" in str(registered)
    unknown = _refused(_evil(tmp_path, "ext-unknown", b"\x80\x02\x82\x01)R."))
    assert "extension code 1" in str(unknown) and "EXT1" in str(unknown)


@pytest.mark.parametrize("name", ["mymod.f.<locals>.Config", "my-mod.Thing", "mod.", "Thing"])
def test_names_no_class_has_are_named_and_never_suggested(tmp_path: Path, name: str) -> None:
    module, _, attr = name.rpartition(".")
    refused = _refused(_evil(tmp_path, "odd", dumps(New(Global(module or name, attr if module else "")))))
    expected = f"{module}.{attr}" if module else f"{name}."
    assert refused.global_name == expected and repr(expected) in str(refused)
    assert "--allow-global" not in str(refused)


def test_nested_plain_class_is_named_and_loads_once_allowed(tmp_path: Path) -> None:
    name = f"{__name__}.Outer.Inner"
    path = _evil(tmp_path, "nested", dumps({"inner": New(Global(__name__, "Outer.Inner"))}))
    refused = _refused(path)
    assert refused.global_name == name and f"--allow-global {name}" in str(refused)
    assert isinstance(safe_torch_load(path, extra_allowlist=[name])["inner"], Outer.Inner)
    # torch.save (protocol 2) spells a nested class as getattr(Outer, "Inner"): a call of getattr.
    saved = tmp_path / "saved-nested.pt"
    torch.save({"inner": Outer.Inner()}, saved)
    refused = _refused(saved)
    assert refused.global_name == "__builtin__.getattr" and "builtins.getattr" in str(refused)


@pytest.mark.parametrize(
    "alias, target",
    [
        ("commands.Popen", "subprocess.Popen"),
        ("commands.getoutput", "subprocess.getoutput"),
        ("__builtin__.eval", "builtins.eval"),
        ("cPickle.loads", "pickle.loads"),
        ("SocketServer.TCPServer", "socketserver.TCPServer"),
        ("urllib.urlretrieve", "urllib.request.urlretrieve"),
        ("multiprocessing.forking.Popen", "module 'multiprocessing'"),
        ("copy_reg._reconstructor", "copyreg._reconstructor"),
        ("posix.system", "posix.system"),
        ("nt.system", "nt.system"),
    ],
)
def test_python2_aliases_of_dangerous_globals_are_hostile(tmp_path: Path, alias: str, target: str) -> None:
    canary = tmp_path / "canary"
    refused = _refused(_evil(tmp_path, "alias", dumps(Call(Global(alias), (["touch", str(canary)],)))))
    message = str(refused)
    assert refused.global_name == alias and alias in message and target in message
    assert "hostile" in message and "not allowlisted" not in message and "--allow-global" not in message
    assert not canary.exists()


def test_archive_member_escaping_the_archive_is_hostile(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, path)
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr("../../etc/evil.txt", b"x")
    refused = _refused(path)
    assert "'../../etc/evil.txt' points outside the archive" in str(refused) and "hostile" in str(refused)


def test_opcodes_torch_refuses_are_named(tmp_path: Path) -> None:
    refused = _refused(_evil(tmp_path, "frame", b"\x80\x04\x95\x01\x00\x00\x00\x00\x00\x00\x00N."))
    assert "FRAME" in str(refused)


def test_unreadable_torch_archive_is_a_load_error(tmp_path: Path) -> None:
    path = tmp_path / "torn.pt"
    torch.save({"w": torch.ones(4)}, path)
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(tmp_path / "renamed.pt", "w") as zout:
        for item in zin.infolist():
            zout.writestr("other/" + item.filename.split("/", 1)[1] if item.filename.endswith("version") else item.filename,
                          zin.read(item.filename))
    with pytest.raises(CheckpointLoadError, match="not a readable torch checkpoint"):
        safe_torch_load(tmp_path / "renamed.pt")


def test_archive_with_a_member_twice_is_hostile(tmp_path: Path) -> None:
    # Zip readers differ on which copy of a duplicated name they return: what was
    # checked need not be what torch loads.
    path = torch_file(tmp_path / "twice.pt", dumps({"w": 1.0}),
                      extra_members=[("archive/data.pkl", dumps(Call(Global("os.system"), ("true",))))])
    refused = _refused(path)
    assert "'archive/data.pkl' appears twice" in str(refused) and "hostile" in str(refused)


def test_a_class_another_library_allowlisted_for_the_process_is_still_refused(tmp_path: Path) -> None:
    """Libraries widen torch's process-wide weights-only list on import (megatron-core adds
    argparse.Namespace and its configs): the safe loader admits its own list and the caller's
    extra globals only, and leaves the process-wide list as it found it."""
    path = tmp_path / "with_config.pt"
    torch.save({"weight": torch.ones(3), "config": TrainConfig(lr=0.1, name="run")}, path)
    before = torch.serialization.get_safe_globals()  # torch's own (nested tensors, device meshes)
    torch.serialization.add_safe_globals([TrainConfig])
    try:
        with pytest.raises(UnsafeCheckpoint) as info:
            safe_torch_load(path)
        assert info.value.global_name == f"{__name__}.TrainConfig"
        # torch's weights-only unpickler itself refuses it too, past the name check
        with pytest.raises(pickle.UnpicklingError, match="TrainConfig"), exactly_these_globals([]):
            torch.load(path, weights_only=True)
        assert set(torch.serialization.get_safe_globals()) == {*before, TrainConfig}
        loaded = safe_torch_load(path, extra_allowlist=[f"{__name__}.TrainConfig"])
        assert loaded["config"] == TrainConfig(lr=0.1, name="run")
        assert set(torch.serialization.get_safe_globals()) == {*before, TrainConfig}
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def test_a_nested_tensor_torch_allowlists_for_itself_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "njt.pt"
    njt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    torch.save({"njt": njt}, path)
    with exactly_these_globals([]):
        loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["njt"].values(), njt.values())
