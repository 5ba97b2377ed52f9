"""What TensorRT-LLM's two backends share: the protocol each implements, the fields every backend reads and the
upstream tables they are checked against."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import ClassVar, Protocol

from pipeline.plugins import TRTLLM_BACKENDS_GROUP, Registry
from pipeline.targets import DEPLOY_FIELDS, VERIFY_FIELDS, Problem
from pipeline.upstream import TABLES


def multi_node(cfg) -> bool:
    """Whether a replica spreads over several pods: deploy.gpus_per_node below its tp x pp GPUs."""
    per_node = cfg.deploy.gpus_per_node
    return per_node is not None and per_node < cfg.parallel.tp_size * cfg.parallel.pp_size


# ---------------------------------------------------------------- backends


class TrtllmBackend(Protocol):
    """How a trtllm build is deployed: what the engine stage writes, the Triton models serving it, the runner.

    Quantization and the verified checkpoints are the target's, shared by every backend; a backend is chosen
    by `target.trtllm_backend` and registered like a target, so no stage asks which one it runs.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    releases: ClassVar[tuple[str, ...]]  # the TensorRT-LLM releases whose facts are tabulated for this backend
    honours: ClassVar[frozenset[str]]  # every config field a build with this backend reads
    group_gateway: ClassVar[bool]  # whether a multi-node group's leader runs the OpenAI gateway (`serve --openai`)

    def engine_reads(self, cfg) -> tuple[str, ...]:
        """Config paths its engine stage reads for `cfg` beyond the stage's READS (hashed into the lock)."""

    def missing(self) -> list[str]:
        """What this machine lacks to build and run this backend's output (empty on a GPU machine with it)."""

    def architecture_support(self, cfg) -> dict[str, str | None]:
        """Registered architecture -> None when this backend of the config's release takes it, else why not."""

    def config_problems(self, cfg) -> list[Problem]:
        """The backend's own rules over the config (for the targeted release)."""

    def writes(self, stage: str, cfg) -> str:
        """What `stage` writes with this backend (export, engine, triton_repo), for `plan`."""

    def export_problems(self, cfg, hf_dir: Path, export_dir: Path) -> list[str]:
        """What makes the exported checkpoint this backend deploys differ from what the release loads."""

    def deployed_checkpoint(self, export_dir: Path) -> tuple[Path, str]:
        """(the exported checkpoint this backend deploys, its `reference.checkpoint_model` kind): the one
        the quality gate scores."""

    def build_engine(self, cfg, ctx) -> dict:
        """The engine stage's output: what the backend deploys, in ctx.out_dir."""

    def triton_models(self, cfg, engine_dir: Path, engine: dict) -> list:
        """The Triton repository's models (Target.triton_models)."""

    def load_runner(self, engine_dir: Path, engine: dict, runtime):
        """A runner with ModelRunnerCpp's calling conventions for an engine directory this backend wrote."""

    def plan_notes(self, cfg, output: Path) -> list[str]:
        """The exact commands to run on a GPU machine, for `plan`."""

    def memory_plan(self, cfg, facts):
        """gpu_memory's plan for this backend's runtime on `target.gpu`."""


# The upstream facts the backends generate and check against (tabulated by scripts/dev/tabulate_trtllm_*.py).
BACKEND_TABLES = (
    TABLES / "tensorrtllm_backend.json",
    TABLES / "llm_args.json",
    TABLES / "llmapi_model.json",
    TABLES / "trtllm_torch_loader.json",
    TABLES / "trtllm_torch_models.json",
    TABLES / "trtllm_lora.json",
)


def link_or_copy(source: Path, target: Path) -> None:
    """A hard link where the filesystem allows (an 8B checkpoint is not copied twice), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def lacking(*requirements: tuple[str, object]) -> list[str]:
    """The descriptions of the (description, present) requirements that are not present."""
    return [what for what, present in requirements if not present]


# Fields every backend reads: the model, quantization and the verified checkpoint.
CHECKPOINT_FIELDS = (
    frozenset(
        {
            "model",
            "verify.reference_dtype",
            "target.name",
            "target.trtllm_version",
            "target.trtllm_backend",
            "target.gpu",
            "quantization.weights",
            "quantization.method",
            "quantization.group_size",
            "quantization.exclude_modules",
            "quantization.kv_cache",
            "quantization.calibration",
            "quantization.modelopt_recipe",
            "parallel",
        }
    )
    | VERIFY_FIELDS
)
GPU_DEPLOY_FIELDS = DEPLOY_FIELDS | {"deploy.gpus_per_node"}
# The OpenAI gateway `serve --openai` runs in front of tritonserver (one node) or trtllm-serve.
GATEWAY_DEPLOY_FIELDS = frozenset({"deploy.ports.openai", "deploy.openai_gateway", "deploy.api_key_secret"})


def fields_for(backend, cfg) -> frozenset[str]:
    """The fields a build of `cfg` with `backend` reads: its own, less the gateway's where the config's group
    (deploy.gpus_per_node below tp x pp) runs no gateway with that backend."""
    if multi_node(cfg) and not backend.group_gateway:
        return backend.honours - GATEWAY_DEPLOY_FIELDS
    return backend.honours


# The backends declared under the `trtllm_pipeline.trtllm_backends` entry points (pyproject.toml), loaded on first use:
# the config offers `target.trtllm_backend`'s choices without importing a backend.
BACKENDS: Registry[TrtllmBackend] = Registry(
    TRTLLM_BACKENDS_GROUP, "trtllm backend", ("summary", "releases", "honours")
)
# Their modules, which the build lock hashes for the stages a backend runs (pipeline.lock_sources).
BACKEND_MODULES = ("pipeline.targets.trtllm.pytorch_backend", "pipeline.targets.trtllm.tensorrt_backend")


def backend_of(cfg) -> TrtllmBackend:
    return BACKENDS[cfg.target.trtllm_backend]


def engine_backend(engine: dict) -> TrtllmBackend:
    """The backend that wrote an engine directory's `config.json` (trtllm-build's own has no `backend` key)."""
    return BACKENDS[engine.get("backend", "tensorrt")]
