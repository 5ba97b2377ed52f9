"""The trtllm target's `pytorch` backend: TensorRT-LLM's default since 1.0, deployed through the LLM API.

What users deploy is the (ModelOpt-quantized) unified Hugging Face checkpoint plus one LLM-API options YAML:
`trtllm-serve MODEL --extra_llm_api_options FILE`, or Triton's `llmapi` python model, whose `model.yaml` carries the
same options next to a `triton_config` section. So the engine stage writes no engine: it lays out `engine/model/`
(the unified checkpoint, checked against what the PyTorch loader of the targeted release reads, with the
tokenizer) and `engine/llm_api_options.yaml`, every key of which is checked against that release's `TorchLlmArgs`
(tabulated from llm_args.py by scripts/dev/tabulate_trtllm_llm_args.py). The Triton repository holds the llmapi
model's `config.pbtxt` and `model.yaml` (its model.py comes from NVIDIA's container when served, never from here)
and an ensemble that keeps our clients' tensor names.

LoRA: the options get `lora_config` (lora_conversion.py); trtllm-serve then takes an adapter per request
(`lora_request`). Triton's llmapi model declares no LoRA input in any tabulated release, so through it no request
picks an adapter. No tabulated release replays a CUDA graph with LoRA parameters (upstream/trtllm_pytorch_features.json,
`lora_with_cuda_graph`), so a lora config gets `cuda_graph_config: null` (and a memory plan without graphs) unless it
sets runtime.cuda_graph_mode, which is then refused. Guided decoding is always on, so runtime.speculative is refused
where the release refuses a guided decoder with that speculative mode (`guided_with_speculative`).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeline import upstream
from pipeline.errors import BuildStepError, TargetUnavailable
from pipeline.models import SERVED_TOKENIZER_FILES
from pipeline.targets import Problem, given_fields
from pipeline.targets.trtllm import lora_conversion
from pipeline.targets.trtllm.backend import (
    CHECKPOINT_FIELDS,
    GATEWAY_DEPLOY_FIELDS,
    GPU_DEPLOY_FIELDS,
    link_or_copy,
)
from pipeline.targets.trtllm.guided import GUIDED_DECODING_BACKEND
from pipeline.targets.trtllm.image import transformers_conflict, whole_config_commands
from pipeline.targets.trtllm.llm_api_options import LLM_API_RELEASES, has_option, options_problems, serve_options_flag
from pipeline.targets.trtllm.llm_api_serving import (
    ENGINE_RECORD,
    MODEL_DIR,
    OPTIONS_FILE,
    Deployment,
    LlmApiRunner,
    missing_for_llm_api,
)
from pipeline.targets.trtllm.torch_checkpoint import MODELS as TORCH_MODELS
from pipeline.targets.trtllm.torch_checkpoint import RELEASES as TORCH_LOADER_RELEASES
from pipeline.targets.trtllm.torch_checkpoint import (
    cited,
    fused_split_refusal,
    ignored_window,
    torch_loader_problems,
    unsupported_quantization,
)
from pipeline.targets.trtllm.triton_llmapi_model import LLMAPI_RELEASES, llmapi_model, model_yaml_problems

# The releases all three of the backend's tables cover: LLM-API options, the llmapi model, the PyTorch loader.
RELEASES = tuple(r for r in LLM_API_RELEASES if r in LLMAPI_RELEASES and r in TORCH_LOADER_RELEASES)
# Build config values -> TensorRT-LLM's CapacitySchedulerPolicy names.
SCHEDULER_POLICIES = {"max_utilization": "MAX_UTILIZATION", "guaranteed_no_evict": "GUARANTEED_NO_EVICT"}
# Our client tensors (interface.CLIENT_INPUTS) -> the llmapi model's inputs (its config.pbtxt). Client inputs
# missing here have no llmapi input: README "Which TensorRT-LLM?" documents them.
CLIENT_TO_LLMAPI = {
    "text_input": "text_input",
    "max_tokens": "sampling_param_max_tokens",
    "stream": "streaming",
    "temperature": "sampling_param_temperature",
    "top_k": "sampling_param_top_k",
    "top_p": "sampling_param_top_p",
    "presence_penalty": "sampling_param_presence_penalty",
    "frequency_penalty": "sampling_param_frequency_penalty",
    "random_seed": "sampling_param_seed",
    "stop_words": "sampling_param_stop",
    "exclude_input_in_output": "sampling_param_exclude_input_from_output",
}
LLMAPI_TO_CLIENT_OUTPUTS = {"text_output": "text_output"}
# runtime.speculative.type -> the LLM API's speculative_config.decoding_type
SPECULATIVE_DECODING_TYPES = {"ngram": "NGram"}
# runtime.speculative.type -> TensorRT-LLM's SpeculativeDecodingMode (its from_string: the decoding type upper-cased)
SPECULATIVE_MODES = {"ngram": "NGRAM"}


@dataclass(frozen=True)
class Option:
    """One LLM-API option and the config field it comes from (so a release lacking it names that field)."""

    key: tuple[str, ...]
    value: object
    field: str


def cuda_graph_batch_sizes(max_batch_size: int) -> list[int]:
    """Powers of two below max_batch_size, then max_batch_size: every decode batch pads to a captured graph."""
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return [*sizes, max_batch_size]


def all_options(cfg) -> list[Option]:
    """Every LLM-API option the build config sets, before the targeted release is consulted."""
    b, r, q, p = cfg.build, cfg.runtime, cfg.quantization, cfg.parallel
    options = [
        Option(("max_batch_size",), b.max_batch_size, "build.max_batch_size"),
        Option(("max_num_tokens",), b.max_num_tokens, "build.max_num_tokens"),
        Option(("max_seq_len",), b.max_seq_len, "build.max_seq_len"),
        Option(("max_input_len",), b.max_input_len, "build.max_input_len"),
        Option(("max_beam_width",), b.max_beam_width, "build.max_beam_width"),
        Option(("tensor_parallel_size",), p.tp_size, "parallel.tp_size"),
        Option(("pipeline_parallel_size",), p.pp_size, "parallel.pp_size"),
        Option(("enable_chunked_prefill",), r.enable_chunked_context, "runtime.enable_chunked_context"),
        Option(
            ("scheduler_config", "capacity_scheduler_policy"),
            SCHEDULER_POLICIES[r.batch_scheduler_policy],
            "runtime.batch_scheduler_policy",
        ),
        Option(
            ("kv_cache_config", "free_gpu_memory_fraction"),
            r.kv_cache_free_gpu_mem_fraction,
            "runtime.kv_cache_free_gpu_mem_fraction",
        ),
        Option(("kv_cache_config", "enable_block_reuse"), r.enable_kv_cache_reuse, "runtime.enable_kv_cache_reuse"),
        Option(("kv_cache_config", "dtype"), "fp8" if q.kv_cache == "fp8" else "auto", "quantization.kv_cache"),
        Option(("kv_cache_config", "tokens_per_block"), b.tokens_per_block, "build.tokens_per_block"),
    ]
    if r.max_tokens_in_paged_kv_cache:
        options.append(
            Option(
                ("kv_cache_config", "max_tokens"),
                r.max_tokens_in_paged_kv_cache,
                "runtime.max_tokens_in_paged_kv_cache",
            )
        )
    if r.speculative is not None:  # NGramDecodingConfig, chosen by decoding_type in every tabulated release
        speculative = {
            "decoding_type": SPECULATIVE_DECODING_TYPES[r.speculative.type],
            "max_draft_len": r.speculative.max_draft_len,
            "max_matching_ngram_size": r.speculative.max_matching_ngram_size,
        }
        options.append(Option(("speculative_config",), speculative, "runtime.speculative"))
    graphs = {"batch_sizes": cuda_graph_batch_sizes(b.max_batch_size), "enable_padding": True}
    options.append(Option(("cuda_graph_config",), graphs if cuda_graphs_on(cfg) else None, "runtime.cuda_graph_mode"))
    # Guided decoding (structured outputs) on wherever the release has the option: without a backend the LLM
    # refuses a request's guide. No config field sets it, so a release lacking it just goes without.
    options.append(Option(("guided_decoding_backend",), GUIDED_DECODING_BACKEND, "target.trtllm_version"))
    if cfg.lora is not None:  # its fields are lora_conversion.LLM_API_FIELDS, which engine_reads adds
        options.append(Option(("lora_config",), lora_conversion.llm_api_lora_config(cfg), "lora.target_modules"))
    return options


def release_features(release: str) -> dict | None:
    """The release's row of upstream/trtllm_pytorch_features.json (None: not tabulated)."""
    return upstream.facts("trtllm_pytorch_features")["releases"].get(release)


def lora_without_graphs(cfg) -> bool:
    """Whether the config serves LoRA on a release whose CUDA graph replay carries no LoRA parameters."""
    features = release_features(cfg.target.trtllm_version)
    return cfg.lora is not None and features is not None and not features["lora_with_cuda_graph"]["supported"]


def cuda_graphs_on(cfg) -> bool:
    """Whether the options capture CUDA graphs: runtime.cuda_graph_mode, except left at its default by a lora config
    on a release without LoRA under graphs (set true there, feature_problems refuses it)."""
    explicit = ("runtime", "cuda_graph_mode") in given_fields(cfg)
    return cfg.runtime.cuda_graph_mode and (explicit or not lora_without_graphs(cfg))


def feature_problems(cfg) -> list[Problem]:
    """Feature pairs the targeted release cannot run: LoRA with an explicit runtime.cuda_graph_mode: true where the
    graph replay carries no LoRA, and runtime.speculative where creating the executor refuses a guided decoder with
    that speculative mode (guided decoding is on wherever the release has guided_decoding_backend)."""
    release, r = cfg.target.trtllm_version, cfg.runtime
    features = release_features(release)
    if features is None:
        return []
    read = {  # the copy each fact was read from; a fork's named with its repository
        f["path"].rsplit("/", 1)[-1]: ("" if f["repo"] == "NVIDIA/TensorRT-LLM" else f"{f['repo']} ") + cited(f)
        for f in features["source"]["files"]
        if "/" in f["path"]
    }
    out: list[Problem] = []
    if lora_without_graphs(cfg) and r.cuda_graph_mode and ("runtime", "cuda_graph_mode") in given_fields(cfg):
        refreshed = ", ".join(features["lora_with_cuda_graph"]["inputs_refreshed"])
        having = [
            x
            for x in upstream.releases("trtllm_pytorch_features")
            if release_features(x)["lora_with_cuda_graph"]["supported"]
        ]
        out.append(
            (
                ("runtime", "cuda_graph_mode"),
                f"TensorRT-LLM {release}'s PyTorch backend runs no LoRA under CUDA graphs: a captured graph replays "
                f"with only {refreshed} copied in ({read['cuda_graph_runner.py']}), no LoRA parameters, so decode "
                "steps would not apply the request's adapter as eager ones do (TensorRT-LLM PR #5480: the outputs "
                "differ; LoRA-aware graphs came with PR #8279); set runtime.cuda_graph_mode: false (left unset, a "
                "lora config gets cuda_graph_config: null)"
                + (f", or target TensorRT-LLM {having[0]}" if having else "; no tabulated release has it"),
            )
        )
    if r.speculative is not None and has_option(release, ("guided_decoding_backend",)):
        mode, guided = SPECULATIVE_MODES[r.speculative.type], features["guided_with_speculative"]
        if mode not in guided["allowed_modes"]:
            allowing = [
                x
                for x in upstream.releases("trtllm_pytorch_features")
                if mode in release_features(x)["guided_with_speculative"]["allowed_modes"]
            ]
            out.append(
                (
                    ("runtime", "speculative"),
                    f"TensorRT-LLM {release}'s PyTorch backend refuses a guided decoder with {mode} speculative "
                    f"decoding: creating the executor raises {guided['raises']} ({read['py_executor_creator.py']}), "
                    f"and guided decoding is always on here (guided_decoding_backend: {GUIDED_DECODING_BACKEND}); "
                    "remove runtime.speculative"
                    + (
                        f", or target TensorRT-LLM {allowing[0]}, which allows it (TensorRT-LLM's TRTLLM-7028: "
                        "PR #6948 and the two-model part before it)"
                        if allowing
                        else ""
                    ),
                )
            )
    return out


def release_options(cfg) -> tuple[dict, list[Problem]]:
    """(the options YAML for the targeted release, problems naming config field and release).

    An option the release lacks is left out when its field keeps its default (the release's own default then
    applies), and is a problem when the config sets it: a setting must never be dropped silently.
    """
    release, explicit = cfg.target.trtllm_version, {".".join(path) for path in given_fields(cfg)}
    nested: dict = {}
    fields: dict[tuple[str, ...], str] = {}
    problems: list[Problem] = []
    for option in all_options(cfg):
        dotted = ".".join(option.key)
        if not has_option(release, option.key):
            if option.field in explicit:
                problems.append(
                    (
                        tuple(option.field.split(".")),
                        f"TensorRT-LLM {release}'s LLM API has no option {dotted}, which this field sets; remove "
                        "it, or target a release that has it",
                    )
                )
            continue
        node = nested
        for part in option.key[:-1]:
            node = node.setdefault(part, {})
        node[option.key[-1]] = option.value
        fields[option.key] = option.field
    for key, message in options_problems(nested, release):
        field = next((f for k, f in fields.items() if key[: len(k)] == k), "target.trtllm_version")
        problems.append((tuple(field.split(".")), message))
    return nested, problems


# ---------------------------------------------------------------- the Triton llmapi repository


def llmapi_config(cfg, release: str):
    """The llmapi model's config.pbtxt: the release's own tensors, named by triton.llm_model_name.

    max_batch_size and decoupled are left to model.yaml's triton_config, as upstream's config.pbtxt does
    (its model.py sets them in auto_complete_config; set in config.pbtxt they could not be overridden)."""
    from pipeline.triton.model_config import mc

    spec = llmapi_model(release)["config"]
    config = mc.ModelConfig(name=cfg.triton.llm_model_name, backend=spec["backend"])
    for group in spec["instance_group"]:
        config.instance_group.add(count=group["count"], kind=mc.ModelInstanceGroup.Kind.Value(group["kind"]))
    for table, add in ((spec["inputs"], config.input.add), (spec["outputs"], config.output.add)):
        for row in table:
            tensor = add(name=row["name"], data_type=mc.DataType.Value(row["data_type"]), dims=row["dims"])
            if row.get("optional"):
                tensor.optional = True
    return config


def model_yaml(cfg, engine_dir: Path, options: dict) -> dict:
    """model.yaml: the model directory, the backend, every LLM-API option, and the Triton-side settings."""
    return {
        "model": str(engine_dir / MODEL_DIR),
        "backend": "pytorch",
        **options,
        "triton_config": {"max_batch_size": 0, "decoupled": cfg.runtime.streaming},
    }


def llmapi_ensemble(cfg, llm):
    """An ensemble named like our other repositories' that takes our clients' tensors to the llmapi model's."""
    from pipeline.triton import interface
    from pipeline.triton.model_config import model_config

    declared = {tensor.name: tensor for tensor in llm.input}
    missing = sorted(theirs for theirs in CLIENT_TO_LLMAPI.values() if theirs not in declared)
    if missing:
        raise BuildStepError(
            f"the llmapi model of TensorRT-LLM {cfg.target.trtllm_version} has no input {', '.join(missing)}; "
            "update CLIENT_TO_LLMAPI in pipeline/targets/trtllm/pytorch_backend.py"
        )
    inputs = [row for row in interface.CLIENT_INPUTS if row[0] in CLIENT_TO_LLMAPI]
    outputs = [row for row in interface.CLIENT_OUTPUTS if row[0] in LLMAPI_TO_CLIENT_OUTPUTS]
    config = model_config(
        cfg.triton.ensemble_name, platform="ensemble", backend="", max_batch_size=0, inputs=inputs, outputs=outputs
    )
    config.ensemble_scheduling.step.add(
        model_name=llm.name,
        model_version=-1,
        input_map={CLIENT_TO_LLMAPI[name]: name for name, *_ in inputs},
        output_map={theirs: ours for theirs, ours in LLMAPI_TO_CLIENT_OUTPUTS.items()},
    )
    return config


# ---------------------------------------------------------------- running it (GPU)


def options_yaml(cfg, options: dict) -> str:
    """The options file trtllm-serve reads (engine/llm_api_options.yaml, and the deployment's ConfigMap)."""
    release = cfg.target.trtllm_version
    return (
        f"# LLM-API options for TensorRT-LLM {release} (PyTorch backend), written by "
        f"trtllm-pipeline; every key checked against that release's TorchLlmArgs.\n"
        f"# trtllm-serve {MODEL_DIR} {serve_options_flag(release)} {OPTIONS_FILE}\n"
        + yaml.safe_dump(options, sort_keys=False)
    )


class PytorchBackend:
    name = "pytorch"
    summary = "the PyTorch backend (unified checkpoint + LLM-API options: trtllm-serve, Triton llmapi model)"
    releases = RELEASES
    group_gateway = True  # a group's leader runs `serve --openai` with mpirun as its --launcher
    honours = (
        CHECKPOINT_FIELDS
        | GPU_DEPLOY_FIELDS
        | GATEWAY_DEPLOY_FIELDS
        | {
            "build.max_batch_size",
            "build.max_input_len",
            "build.max_seq_len",
            "build.max_num_tokens",
            "build.max_beam_width",
            "build.kv_cache_type",
            "build.tokens_per_block",
            "runtime.batching_strategy",
            "runtime.batch_scheduler_policy",
            "runtime.kv_cache_free_gpu_mem_fraction",
            "runtime.enable_kv_cache_reuse",
            "runtime.enable_chunked_context",
            "runtime.cuda_graph_mode",
            "runtime.streaming",
            "runtime.max_tokens_in_paged_kv_cache",
            "runtime.speculative",
            "triton.ensemble_name",
            "triton.llm_model_name",
        }
        | lora_conversion.backend_fields("pytorch")
    )

    def engine_reads(self, cfg) -> tuple[str, ...]:
        fields = [option.field for option in all_options(cfg)]  # every field the options YAML holds
        return tuple(dict.fromkeys([*fields, *(lora_conversion.LLM_API_FIELDS if cfg.lora is not None else ())]))

    def missing(self) -> list[str]:
        return missing_for_llm_api()

    def architecture_support(self, cfg) -> dict[str, str | None]:
        """What the targeted release's tensorrt_llm/_torch/models registers (upstream/trtllm_torch_models.json), and
        whether its model loads this quantization of the family's checkpoint-fused linears."""
        from pipeline.architectures import ARCHITECTURES

        release, q = cfg.target.trtllm_version, cfg.quantization
        if release not in TORCH_MODELS:
            return {name: f"TensorRT-LLM {release}: no PyTorch-backend model table" for name in ARCHITECTURES}
        table = TORCH_MODELS[release]
        files = "; ".join(cited(f) for f in table["source"]["files"] if "/models/modeling_" in f["path"])
        out = {}
        facts = cfg.model_facts()
        for name in ARCHITECTURES:
            if name not in table["architectures"]:
                having = [r for r in TORCH_MODELS if name in TORCH_MODELS[r]["architectures"]]
                fix = f"; set target.trtllm_version: {having[-1]}" if having else ""
                out[name] = (
                    f"TensorRT-LLM {release}'s tensorrt_llm/_torch/models registers no {name} (read: {files}){fix}"
                )
            else:
                own = facts if facts is not None and facts.architecture == name else None
                out[name] = fused_split_refusal(name, release, q.weights, q.method, q.exclude_modules, own)
        return out

    def config_problems(self, cfg) -> list[Problem]:
        b, r, q = cfg.build, cfg.runtime, cfg.quantization
        release = cfg.target.trtllm_version
        out: list[Problem] = []
        if cfg.lora is not None and not cfg.deploy.openai_gateway:
            out.append(
                (
                    ("lora",),
                    "without deploy.openai_gateway the deployment serves trtllm-serve alone on the pod's address, and "
                    "trtllm-serve loads whatever lora_path a request names: keep the gateway (deploy.openai_gateway: "
                    "true), which sends only the build's adapters",
                )
            )
        if b.kv_cache_type != "paged":
            out.append((("build", "kv_cache_type"), "the PyTorch backend's KV cache is always paged; remove it"))
        if r.batching_strategy != "inflight_fused_batching":
            out.append(
                (
                    ("runtime", "batching_strategy"),
                    "the PyTorch backend always batches in flight (V1 static batching is engine-only); remove it or "
                    "set target.trtllm_backend: tensorrt",
                )
            )
        if release not in RELEASES:
            return out  # the target already names the releases this backend has
        reason = unsupported_quantization(q.weights, q.method, q.kv_cache, release)
        if reason:
            out.append((("quantization", "weights"), reason))
        # a uniform window the family's model takes no window for: refused here, not after calibration (the export
        # stage's torch_loader_problems keeps the same check for a config.json validate cannot read)
        facts = cfg.model_facts()
        model = TORCH_MODELS[release]["architectures"].get(facts.architecture) if facts else None
        window = ignored_window(model, release, facts.sliding_window, b.max_seq_len) if model else None
        if window:
            out.append((("build", "max_seq_len"), window))
        out += release_options(cfg)[1]
        out += feature_problems(cfg)
        return out

    def writes(self, stage: str, cfg) -> str:
        return {
            "export": "unified HF checkpoint (hf_quant_config.json, safetensors; checked against the PyTorch loader)",
            "engine": f"runtime configuration: {MODEL_DIR}/ (unified checkpoint + tokenizer) and {OPTIONS_FILE} "
            f"(LLM-API options checked against TensorRT-LLM {cfg.target.trtllm_version})",
            "triton_repo": "Triton model repository: the llmapi model (config.pbtxt, model.yaml) and an ensemble "
            "taking our clients' tensors",
        }.get(stage, "")

    def export_problems(self, cfg, hf_dir: Path, export_dir: Path) -> list[str]:
        return torch_loader_problems(export_dir / "hf_unified", cfg.target.trtllm_version, cfg.build.max_seq_len)

    def deployed_checkpoint(self, export_dir: Path) -> tuple[Path, str]:
        return export_dir / "hf_unified", "unified"

    def build_engine(self, cfg, ctx) -> dict:
        options, problems = release_options(cfg)
        if problems:  # validate refuses these first; a build reaching here has a bug
            raise BuildStepError("; ".join(f"{'.'.join(field)}: {message}" for field, message in problems))
        unified = ctx.upstream("export") / "hf_unified"
        model_dir = ctx.out_dir / MODEL_DIR
        model_dir.mkdir()
        for file in sorted(unified.iterdir()):
            link_or_copy(file, model_dir / file.name)
        hf_dir = ctx.upstream("import")
        for name in SERVED_TOKENIZER_FILES:  # the LLM loads its tokenizer from the model directory
            if (hf_dir / name).exists() and not (model_dir / name).exists():
                shutil.copy2(hf_dir / name, model_dir / name)
        (ctx.out_dir / OPTIONS_FILE).write_text(options_yaml(cfg, options))
        hf_config = json.loads((unified / "config.json").read_text())
        record = {
            "target": "trtllm",
            "backend": self.name,
            "trtllm_version": cfg.target.trtllm_version,
            "build_config": {
                name: getattr(cfg.build, name)
                for name in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "max_beam_width")
            },
            "pretrained_config": {
                "architecture": (hf_config.get("architectures") or ["?"])[0],
                "dtype": hf_config.get("torch_dtype") or hf_config.get("dtype"),
                "mapping": {"tp_size": cfg.parallel.tp_size, "pp_size": cfg.parallel.pp_size},
            },
        }
        (ctx.out_dir / ENGINE_RECORD).write_text(json.dumps(record, indent=2))
        ctx.log(f"LLM-API options ({len(options)} keys) checked against TensorRT-LLM {cfg.target.trtllm_version}")
        return {"llm_api_options": options}

    def triton_models(self, cfg, engine_dir: Path, engine: dict) -> list:
        from pipeline.triton.model_config import ModelSpec

        release = cfg.target.trtllm_version
        options = yaml.safe_load((engine_dir / OPTIONS_FILE).read_text())
        llm = llmapi_config(cfg, release)
        text = yaml.safe_dump(model_yaml(cfg, engine_dir, options), sort_keys=False)
        problems = model_yaml_problems(yaml.safe_load(text), release)
        if problems:
            raise BuildStepError("model.yaml for the llmapi model:\n  " + "\n  ".join(problems))
        return [ModelSpec(llm, texts={"model.yaml": text}), ModelSpec(llmapi_ensemble(cfg, llm))]

    def load_runner(self, engine_dir: Path, engine: dict, runtime):
        missing = missing_for_llm_api()
        if missing:
            raise TargetUnavailable(
                f"{engine_dir} is configured for TensorRT-LLM's PyTorch backend; running it needs "
                f"{' and '.join(missing)}"
            )
        return LlmApiRunner.from_dir(engine_dir, engine)

    def plan_notes(self, cfg, output: Path) -> list[str]:
        output = output.resolve()
        deployment = Deployment(
            output / "engine" / MODEL_DIR,
            output / "engine" / OPTIONS_FILE,
            cfg.target.trtllm_version,
            output / "triton_repo",
            cfg.triton.llm_model_name,
        )
        release = cfg.target.trtllm_version
        trtllm_serve, triton = deployment.container_commands("127.0.0.1", 8000)
        served = (
            f"serve with the OpenAI gateway (trtllm-pipeline on the GPU machine) in front of trtllm-serve in NVIDIA's "
            f"container (TensorRT-LLM {release}: no image of ours holds the release, see below)"
            if transformers_conflict(release)
            else f"serve with the OpenAI gateway in front of trtllm-serve (TensorRT-LLM {release}, our GPU image)"
        )
        return [
            f"{served}:\n  {trtllm_serve}",
            f"or with Triton's llmapi model:\n  {triton}",
            f"or the whole config in NVIDIA's container:\n  {whole_config_commands(cfg)}",
        ]

    def memory_plan(self, cfg, facts):
        from pipeline.targets.trtllm.gpu_memory import plan_memory

        return plan_memory(cfg, facts, cuda_graph_batch=cfg.build.max_batch_size if cuda_graphs_on(cfg) else 0)
