"""The build lock hashes the code a build runs for its own target and no other's: editing a module of one target leaves
every stage of the other target's build up to date (`plan`), and re-runs a stage of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.lock import hash_paths
from pipeline.plan import WILL_RUN, inputs_from, plan, stage_inputs
from pipeline.stages import STAGES
from pipeline.validation import load_config
from tests.conftest import write_config

PACKAGE = Path(__file__).resolve().parents[1] / "pipeline"
CONFIGS = {
    "onnxruntime": "target:\n  name: onnxruntime\nquantization:\n  weights: int8\n",
    "trtllm": "target:\n  name: trtllm\n  trtllm_version: '1.2'\nquantization:\n  weights: fp8\n",
}


def built_output(cfg, output: Path) -> dict:
    """A lock and outputs as a finished build of `cfg` leaves them, stage by stage (each output one file)."""
    lock = {"format": 1, "stages": {}}
    for name, stage in STAGES.items():
        if stage.applies(cfg) is not None:
            continue
        upstream = {
            prior: lock["stages"][prior]["output_hash"] for prior in inputs_from(name) if prior in lock["stages"]
        }
        inputs = stage_inputs(stage, cfg, None, upstream)
        (output / name).mkdir(parents=True)
        (output / name / "out").write_text(name)
        files, output_hash = hash_paths([output / name], root=output / name)
        lock["stages"][name] = inputs | {"files": files, "output_hash": output_hash}
    return lock


def edited(monkeypatch, folder: Path) -> None:
    """Every file under `folder` reads back one byte longer, as if each were edited."""
    read_bytes = Path.read_bytes
    monkeypatch.setattr(
        Path, "read_bytes", lambda path: read_bytes(path) + (b"\n" if path.is_relative_to(folder) else b"")
    )


@pytest.mark.parametrize(("built", "edited_target"), [("onnxruntime", "trtllm"), ("trtllm", "onnxruntime")])
def test_editing_one_targets_modules_leaves_the_other_targets_build_up_to_date(
    tmp_path, tiny_llama, monkeypatch, built, edited_target
):
    configs = {
        name: load_config(
            write_config(tmp_path / f"{name}.yaml", f"model:\n  source: hf\n  path: {tiny_llama}\n{body}")
        )
        for name, body in CONFIGS.items()
    }
    locks = {name: built_output(cfg, tmp_path / name) for name, cfg in configs.items()}
    for name, cfg in configs.items():
        assert not [d.stage for d in plan(cfg, tmp_path / name, locks[name]) if d.status == WILL_RUN], name

    edited(monkeypatch, PACKAGE / "targets" / edited_target)
    untouched = plan(configs[built], tmp_path / built, locks[built])
    assert [(d.stage, d.reasons) for d in untouched if d.status == WILL_RUN] == []
    own = plan(configs[edited_target], tmp_path / edited_target, locks[edited_target])
    reasons = [reason for d in own for reason in d.reasons]
    assert any(reason.startswith(f"code changed: pipeline/targets/{edited_target}/") for reason in reasons), reasons
