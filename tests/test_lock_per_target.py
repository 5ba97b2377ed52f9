"""The build lock hashes the code a build runs for its own target and no other's: editing a module of one target leaves
every stage of the other target's build up to date (`plan`), and re-runs a stage of its own."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from pipeline.lock import hash_paths
from pipeline.lock_sources import module_file, modules_imported_by, source_files
from pipeline.plan import WILL_RUN, inputs_from, plan, stage_inputs
from pipeline.stages import STAGES
from pipeline.targets import TARGETS
from pipeline.upstream import facts
from pipeline.validation import load_config

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "pipeline"
# The default config (`make build-engine`) and the trtllm config of the same model
CONFIGS = {"onnxruntime": "build_configs/smollm2-135m-cpu.yaml", "trtllm": "build_configs/smollm2-135m-fp8.yaml"}


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
    tmp_path, smollm2_gguf, monkeypatch, built, edited_target
):
    configs = {name: load_config(REPO / path) for name, path in CONFIGS.items()}
    locks = {name: built_output(cfg, tmp_path / name) for name, cfg in configs.items()}
    for name, cfg in configs.items():
        assert not [d.stage for d in plan(cfg, tmp_path / name, locks[name]) if d.status == WILL_RUN], name

    edited(monkeypatch, PACKAGE / "targets" / edited_target)
    untouched = plan(configs[built], tmp_path / built, locks[built])
    assert [(d.stage, d.reasons) for d in untouched if d.status == WILL_RUN] == []
    own = plan(configs[edited_target], tmp_path / edited_target, locks[edited_target])
    reasons = [reason for d in own for reason in d.reasons]
    assert any(reason.startswith(f"code changed: pipeline/targets/{edited_target}/") for reason in reasons), reasons


def test_no_stage_of_the_default_build_hashes_a_table_of_tensorrt_llm_releases(smollm2_gguf):
    """Tabulating another TensorRT-LLM release rewrites only tables keyed by release: no CPU build re-runs."""
    cfg = load_config(REPO / CONFIGS["onnxruntime"])
    hashed = {path for name, stage in STAGES.items() if stage.applies(cfg) is None for path in code_of(stage, cfg)}
    tables = {path for path in hashed if path.startswith("pipeline/upstream/") and path.endswith(".json")}
    assert "pipeline/upstream/cpu_llm_interface.json" in tables  # the guide types the CPU model takes
    assert [path for path in tables if "releases" in facts(Path(path).stem)] == []


def code_of(stage, cfg) -> dict[str, str]:
    return stage_inputs(stage, cfg, None, {})["code"]


def called_on_the_target(module: Path) -> set[str]:
    """The target's methods a module calls (`target.x(...)`, `target_of(cfg).x(...)`)."""
    called = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if (isinstance(owner, ast.Name) and owner.id == "target") or (
                isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "target_of"
            ):
                called.add(node.func.attr)
    return called


def imports_run_by(adapter: type, methods: set[str]) -> set[str]:
    """The `pipeline` modules imported inside `methods` of `adapter` and inside every function of its module they
    call (by name, or as `self.`/`cls.`/the class's attribute), transitively."""
    tree = ast.parse(Path(sys.modules[adapter.__module__].__file__).read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    (cls,) = (node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == adapter.__name__)
    own = {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}
    pending, seen, modules = [own[m] for m in methods if m in own], set(), set()
    while pending:
        function = pending.pop()
        if id(function) in seen:
            continue
        seen.add(id(function))
        modules |= modules_imported_by(ast.walk(function))
        for node in ast.walk(function):
            if isinstance(node, ast.Name) and node.id in functions:
                pending.append(functions[node.id])
            elif (
                isinstance(node, ast.Attribute)
                and node.attr in own
                and getattr(node.value, "id", None)
                in (
                    "self",
                    "cls",
                    adapter.__name__,
                )
            ):
                pending.append(own[node.attr])
    return modules


@pytest.mark.parametrize("target_name", sorted(TARGETS))
def test_each_stage_hashes_every_module_the_target_methods_it_calls_import(target_name):
    """The adapter is hashed as a facade (its module-level imports): the modules its methods import inside
    themselves reach a stage's lock only through the target's `sources` for that stage, so those must cover them.
    Read statically from the stage module's calls; a call from deeper down is tested on its own (deploy's below)."""
    target = TARGETS[target_name]
    adapter = type(target).__module__
    missing = {}
    for name, stage in STAGES.items():
        own = (adapter, *target.sources[name]) if name in target.sources else ()
        hashed = set(source_files((stage.__name__, *stage.SOURCES, *own), frozenset({adapter})))
        run = imports_run_by(type(target), called_on_the_target(Path(stage.__file__)))
        missing[name] = sorted(m for m in run if module_file(m) and module_file(m) not in hashed)
    assert not any(missing.values()), f"add to {type(target).__name__}.sources: {missing}"


def test_the_import_stage_hashes_no_target_and_deploy_hashes_what_it_asks_the_target_through_shared_code(
    smollm2_gguf,
):
    """deploy's manifests carry the build Job's memory request (`host_memory` asks the target's `build_phases`) and
    are validated by `validation.load_config` (the target's `config_problems`, `architecture_support`, ...)."""
    asked = called_on_the_target(PACKAGE / "host_memory.py") | called_on_the_target(PACKAGE / "validation.py")
    assert {"build_phases", "config_problems", "architecture_support"} <= asked
    for cfg in (load_config(REPO / path) for path in CONFIGS.values()):
        assert [path for path in code_of(STAGES["import"], cfg) if path.startswith("pipeline/targets/")] == []
        deployed = {REPO / path for path in code_of(STAGES["deploy"], cfg)}
        run = imports_run_by(type(TARGETS[cfg.target.name]), asked)
        assert sorted(m for m in run if module_file(m) and module_file(m) not in deployed) == [], cfg.target.name
