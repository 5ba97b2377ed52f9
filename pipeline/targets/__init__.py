"""Targets: the backends a build compiles for, as registered adapters behind one small protocol.

A stage never asks which target it runs for; it calls `target_of(cfg)` and the adapter does the
backend's part (llama.cpp's `ModelBase.register` registry, TensorRT-LLM's one build config). Each
adapter also says which config fields it honours, so a setting it would ignore is a `validate`
error instead of a silently different engine, and which sources and tools shape each stage's
output, so the build lock sees all the code a stage executes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Protocol

from pipeline.errors import PipelineError
from pipeline.plugins import TARGETS_GROUP, Registry

if TYPE_CHECKING:
    from pipeline.adapter_registry import ServedAdapters
    from pipeline.config import BuildConfig
    from pipeline.quality import Model
    from pipeline.triton.model_config import ModelSpec
    from pipeline.triton.validate import ModelCheck, RepoReport

Problem = tuple[tuple[str, ...], str]  # (config field path, message with the fix)
Log = Callable[[str], None]


class Target(Protocol):
    """What a backend provides to the stages. Methods get the whole typed config; none re-reads YAML."""

    name: ClassVar[str]
    summary: ClassVar[str]
    # Config fields (dotted paths; a section name covers its fields) this target reads under any of its options
    # (`fields_read` says which a given config's build reads). Any other field set in a config for this target
    # is a `validate` error naming the field and the target.
    honours: ClassVar[frozenset[str]]
    # Per stage: the Python modules (dotted) and copied files (paths) the target executes there, and the
    # distributions whose versions shape the output. Both are hashed into the stage's lock entry. The adapter's
    # module is hashed through its module-level imports only (`pipeline.lock_sources`), so `sources` names every
    # module its methods import inside themselves for the stage (tests/test_lock_per_target.py checks it).
    sources: ClassVar[dict[str, tuple[str | Path, ...]]]
    tools: ClassVar[dict[str, tuple[str, ...]]]
    # The stage whose output the quality gate (`pipeline.quality`) scores, in that stage and in `verify`: the
    # last one this machine can run (onnxruntime: "engine"; trtllm: "export", the checkpoint on CPU).
    gated_stage: ClassVar[str]

    def unavailable(self) -> str | None:
        """Why this machine cannot build and run this target's engines (None when it can)."""

    def fields_read(self, cfg: BuildConfig) -> frozenset[str]:
        """The fields a build of this config reads (a subset of `honours` when the target has options)."""

    def option_reading(self, cfg: BuildConfig, field: str) -> str | None:
        """The target option (e.g. `target.trtllm_backend: tensorrt`) under which it would read `field`."""

    def stage_reads(self, stage: str, cfg: BuildConfig) -> tuple[str, ...]:
        """Config paths `stage` reads for this config beyond the stage's own READS (hashed into its lock entry)."""

    def variants(self) -> list[dict[str, str]]:
        """The `target` section settings that change what it can build (e.g. backend and release), one dict per
        combination; [{}] when it has none (`trtllm-pipeline architectures` tabulates support over them)."""

    def architecture_support(self, cfg: BuildConfig) -> dict[str, str | None]:
        """Every registered architecture (pipeline.architectures) -> None when this config's build takes it, else
        why not (the release or graph that lacks it, and the fix)."""

    def config_problems(self, cfg: BuildConfig) -> list[Problem]:
        """The target's own rules over the config (values it cannot honour, combinations it cannot build)."""

    def skips(self, stage: str, cfg: BuildConfig) -> str | None:
        """Why `stage` does nothing for this config on this target (None when it runs)."""

    def writes(self, stage: str, cfg: BuildConfig) -> str:
        """What `stage` writes for this target, for `plan`."""

    def quantize(self, cfg: BuildConfig, ctx) -> dict:
        """Calibrate and quantize the imported checkpoint into ctx.out_dir (stage `quantize`)."""

    def export(self, cfg: BuildConfig, ctx) -> dict:
        """The imported (and quantized) checkpoint in the backend's input format, checked (stage `export`)."""

    def convert_adapters(self, cfg: BuildConfig, ctx) -> dict:
        """What the target's runtime needs of the LoRA adapters beyond the PEFT directories the `lora` stage copies
        into ctx.out_dir (one per adapter name); returns metrics ({} when nothing)."""

    def scored_adapter(
        self, cfg: BuildConfig, output: Path, name: str, adapter_dir: Path
    ) -> tuple[Model, Model] | None:
        """(the engine decoding with LoRA adapter `name`, its fp32 reference) for the quality gate of the `lora`
        stage; None where this machine cannot run the target's engine."""

    def build_engine(self, cfg: BuildConfig, ctx) -> dict:
        """The engine and its `config.json` in ctx.out_dir (stage `engine`)."""

    def triton_models(self, cfg: BuildConfig, engine_dir: Path, engine: dict) -> list[ModelSpec]:
        """Every model of the Triton repository serving the engine (`repo.inflight_batcher_models` lays out
        tensorrtllm_backend's, around the target's LLM model)."""

    def load_runner(self, engine_dir: Path, *, num_threads: int | None, runtime: Any, thread_spinning: bool | None):
        """A runner with ModelRunnerCpp's calling conventions for a built engine (`run`, benchmarks)."""

    def scored(self, cfg: BuildConfig, output: Path, built: Path, log: Log) -> tuple[Model, Model]:
        """(what `gated_stage` built in `built`, its fp32 reference) as this machine runs them for the quality gate;
        `output` holds the build's other stages. Raises PipelineError naming the build step when `built` lacks it."""

    def build_phases(self, stage: str, cfg: BuildConfig, shape: Any) -> tuple[dict, int] | None:
        """What stage `stage` holds at a time, {phase: (bytes, the setting lowering them)}, and the bytes it writes,
        for the build's memory plan (`pipeline.host_memory`, whose CheckpointShape `shape` is: the registry sits
        below it); None for a stage writing configs and tokenizer files."""

    def plan_notes(self, cfg: BuildConfig, output: Path) -> list[str]:
        """Extra lines for `plan` (e.g. the exact engine command, a memory plan)."""

    # Serving hooks: `pipeline.triton` and `pipeline.serving` know no target and ask every registered one.

    def repository_checks(self, options: Mapping[str, Any]) -> list[ModelCheck]:
        """Checks of this target's models in any Triton repository (`pipeline.triton.validate`), given the `target`
        settings the repository was built for (e.g. `trtllm_version`; absent when unknown)."""

    def serve_without_triton(
        self, repo: Path, host: str, port: int, openai_port: int | None, launcher: tuple[str, ...] = ()
    ) -> OwnServer | None:
        """Where this target serves such a repository with a server of its own (trtllm's PyTorch backend:
        trtllm-serve): without the OpenAI gateway (`openai_port` None) become that server on host:port; with it,
        return how that server runs on loopback port `port` behind the gateway on `openai_port` (which `serve`
        runs: `pipeline.serving.lifecycle.FrontedServing`). `launcher` goes before the server's command (mpirun
        starting its ranks over several nodes). Where this machine lacks what the server needs, raise
        TargetUnavailable with the exact commands for one that has it. None for any other repository."""

    def triton_launch(self, repo: Path, report: RepoReport) -> Callable[[list[str]], list[str]] | None:
        """The tritonserver command serving `repo` (given its address arguments) where this target's models need a
        server of their own (NVIDIA's container); None where the CPU tritonserver of `pipeline.triton.server` does."""

    def served_adapters(self, report: RepoReport) -> ServedAdapters | None:
        """What the repository's LLM model of this target takes of LoRA adapters added while serving (None: the
        repository has no such model, or its engine takes none)."""


# What a target's own server is, as `serve --openai` puts the OpenAI gateway (pipeline.serving) in front of it
# (`Target.serve_without_triton`). Here, with the hook, so that neither side imports the other.


@dataclass(frozen=True)
class Dialect:
    """What an OpenAI-compatible server takes of a /v1/completions request, where such servers differ."""

    server: str  # the server as errors name it, e.g. "trtllm-serve of TensorRT-LLM 1.1"
    # the gateway's guide (guided_decoding_guide_type, guided_decoding_guide) as the request's response_format;
    # ValueError saying why where the server would not enforce it
    response_format: Callable[[tuple[str, str]], dict]
    chosen_logprobs: int | None  # the `logprobs` that returns the chosen token's log-probability; None: none comes
    takes: frozenset[str] | None = None  # the request fields it has (None: every field the gateway sends)


@dataclass(frozen=True)
class OwnServer:
    """A server of a target's own that `serve --openai` runs on loopback with the gateway in front of it: its
    command, where it listens, and what the gateway needs to front it."""

    command: list[str]
    url: str  # its base URL on loopback, e.g. http://127.0.0.1:8000
    model: str  # the model name its requests give
    tokenizer_dir: str  # the tokenizer the gateway renders chat templates and counts prompts with
    limits_dir: str  # the directory whose config.json holds the engine's limits (`serving.app.engine_limits`)
    dialect: Dialect
    description: str  # the server as messages name it, e.g. "trtllm-serve (TensorRT-LLM 1.2)"
    # the LoRA adapters it serves, each a model of the gateway's own: model name -> the request fields that pick it
    # (e.g. trtllm-serve's `lora_request`), all from the build, none from a client
    adapters: dict[str, dict] = field(default_factory=dict)


# The quality gate's fields (pipeline.quality), honoured by every target, which gates one of its stages.
VERIFY_FIELDS = frozenset(
    {
        "verify.eval_text",
        "verify.eval_tokens",
        "verify.max_perplexity_increase",
        "verify.max_kl_divergence",
        "verify.min_top1_agreement",
        "verify.min_chat_answer_match",
        "verify.chat_max_new_tokens",
    }
)
# Fields every target honours: the model, the engine's limits, the Triton repository and the quality gate.
COMMON_FIELDS = (
    frozenset(
        {
            "model",
            "target.name",
            "triton",
            "quantization.weights",
            "quantization.method",
            "quantization.group_size",
            "quantization.exclude_modules",
            "quantization.checkpoint_quantization",
            "build.max_batch_size",
            "build.max_input_len",
            "build.max_seq_len",
            "build.max_num_tokens",
            "build.max_beam_width",
            "runtime.batch_scheduler_policy",
            "runtime.enable_chunked_context",
            "runtime.max_queue_delay_microseconds",
            "runtime.exclude_input_in_output",
            "runtime.max_tokens_in_paged_kv_cache",
        }
    )
    | VERIFY_FIELDS
)
# Deploy fields every target honours (`trtllm-pipeline deploy`).
DEPLOY_FIELDS = frozenset(
    {
        "deploy.name",
        "deploy.namespace",
        "deploy.kubernetes_version",
        "deploy.image",
        "deploy.artifacts",
        "deploy.replicas",
        "deploy.cpus",
        "deploy.autoscaling",
        "deploy.node_selector",
        "deploy.tolerations",
        "deploy.service_type",
        "deploy.ports.http",
        "deploy.storage",
    }
)
COMMON_FIELDS |= DEPLOY_FIELDS
# Deploy fields of outputs `trtllm-pipeline serve` runs under tritonserver (with the OpenAI gateway).
TRITON_DEPLOY_FIELDS = frozenset(
    {
        "deploy.ports.grpc",
        "deploy.ports.metrics",
        "deploy.ports.openai",
        "deploy.openai_gateway",
        "deploy.expose_triton_ports",
        "deploy.api_key_secret",
    }
)


# The targets declared under the `trtllm_pipeline.targets` entry points, loaded on first use: the config offers their
# names without importing any adapter, and an adapter imports the config, never the other way round.
TARGETS: Registry[Target] = Registry(TARGETS_GROUP, "target", ("summary", "honours", "sources", "tools", "gated_stage"))


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise PipelineError(f"unknown target {name!r}; registered: {', '.join(TARGETS)}") from None


def target_of(cfg: BuildConfig) -> Target:
    return get_target(cfg.target.name)


def repository_checks(options: Mapping[str, Any]) -> list[ModelCheck]:
    """Every target's checks of its models in a Triton repository built with the `target` settings `options`."""
    return [check for target in TARGETS.values() for check in target.repository_checks(options)]


def engine_target(engine_config: dict) -> str:
    """The target that built an engine directory, from its `config.json`.

    Our engines record `target`; a TensorRT-LLM engine's config.json is written by trtllm-build itself,
    which knows no such key.
    """
    return engine_config.get("target", "trtllm")


def honoured(path: str, fields: frozenset[str]) -> bool:
    """Whether dotted `path` is one of `fields` or lies inside a section listed there."""
    parts = path.split(".")
    return any(".".join(parts[:depth]) in fields for depth in range(1, len(parts) + 1))


def given_fields(section, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Paths of the leaf fields set explicitly (in the YAML or an override) in a pydantic config."""
    from pydantic import BaseModel

    paths = []
    for name in section.model_fields_set:
        value = getattr(section, name)
        if isinstance(value, BaseModel) and value.model_fields_set:
            paths += given_fields(value, (*prefix, name))
        elif not isinstance(value, BaseModel):
            paths.append((*prefix, name))
    return sorted(paths)


def unhonoured_problems(cfg: BuildConfig) -> list[Problem]:
    """A field set for a target that does not read it is an error: the engine would differ from the config."""
    target = target_of(cfg)
    fields = target.fields_read(cfg)
    problems = []
    for path in given_fields(cfg):
        dotted = ".".join(path)
        if honoured(dotted, fields):
            continue
        option = target.option_reading(cfg, dotted)
        others = [name for name, other in TARGETS.items() if name != target.name and honoured(dotted, other.honours)]
        fixes = ([option] if option else []) + ([f"target.name: {' or '.join(others)}"] if others else [])
        fix = f"remove it, or use {' or '.join(fixes)}" if fixes else "remove it"
        problems.append(
            (path, f"is not honoured by target {target.name}, so the engine would not be what the config says; {fix}")
        )
    return problems


def load_runner(engine_dir: Path, num_threads: int | None = None, runtime=None, thread_spinning: bool | None = None):
    """The runner of the target that built the engine (ours for onnxruntime, ModelRunnerCpp for trtllm).

    `runtime` (the config's RuntimeSection, when known) passes the target's runtime settings (KV cache and CUDA
    graphs to ModelRunnerCpp, thread spinning to ours unless `thread_spinning` is given).
    """
    config_file = engine_dir / "config.json"
    if not config_file.is_file():
        raise PipelineError(f"{config_file} not found: build the engine first (trtllm-pipeline build CONFIG)")
    target = get_target(engine_target(json.loads(config_file.read_text())))
    return target.load_runner(engine_dir, num_threads=num_threads, runtime=runtime, thread_spinning=thread_spinning)
