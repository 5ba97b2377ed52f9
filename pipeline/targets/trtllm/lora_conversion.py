"""LoRA on TensorRT-LLM, both backends, as each release takes it (upstream/trtllm_lora.json, tabulated from the
sources by scripts/dev/tabulate_trtllm_lora.py; the Triton inputs and parameters are upstream/tensorrtllm_backend.json).

`tensorrt` (0.19-1.2): trtllm-build gets `--lora_plugin` (the checkpoint dtype), `--lora_target_modules` (the
TensorRT-LLM names of lora.target_modules) and `--max_lora_rank`; build.py takes `--lora_dir` only to infer target
modules when none are given, so the engine never depends on the adapters. The C++ runtime takes an adapter as two
tensors: `lora_config` [1, rows, 3] int32 (module id, layer, adapter size per row) and `lora_weights` [1, rows,
width] in the model's data type, each row lora_A [r, in] then lora_B [out, r] flattened, B scaled, rows zero-padded
to the longest (examples/hf_lora_convert.py lays them out so; loraModule.cpp says which dimension comes first). The
lora stage writes them per adapter as the .npy files the converter names, and links each into
`<output>/lora/prefetch/<task id>/`, the `lora_prefetch_dir` the backend loads at start-up, so a request needs only
`lora_task_id`. The .npy loader reads f2/f4 only and the release templates declare `lora_weights` TYPE_FP16, so the
engine must be float16.

`pytorch` (1.0-1.2): the LLM-API options get `lora_config` (target modules, max rank, max_loras GPU-resident and
max_cpu_loras CPU-cached); TensorRT-LLM loads each adapter itself from the PEFT directory a request names
(trtllm-serve's `lora_request: {lora_name, lora_int_id, lora_path}`). Its loader scales by adapter_config's lora_alpha
alone, so an adapter with alpha_pattern is refused there.
"""

from __future__ import annotations

import ast
import operator
from pathlib import Path

import numpy as np

from pipeline import peft_adapters
from pipeline.errors import BuildStepError, PipelineError
from pipeline.models import ModelFacts
from pipeline.peft_adapters import LINEAR_MODULES, Adapter
from pipeline.targets import Problem
from pipeline.targets.trtllm.backend import link_or_copy
from pipeline.targets.trtllm.dtypes import deployed_dtype
from pipeline.targets.trtllm.triton_cpp_backend import template
from pipeline.upstream import facts, release_facts, releases

TABLE = "trtllm_lora"
PREFETCH_DIR = "prefetch"  # <output>/lora/prefetch/<task id>/: the tensorrt_llm model's lora_prefetch_dir
# The C++ data type each checkpoint dtype runs as, and its numpy type (the .npy code the runtime's loader reads).
NUMPY_DTYPES = {"float16": np.float16, "float32": np.float32}
TRITON_DTYPES = {"float16": "TYPE_FP16", "float32": "TYPE_FP32", "bfloat16": "TYPE_BF16"}
# The config fields each backend's engine stage reads of the lora section (never the adapters: they come later).
ENGINE_FIELDS = ("lora.target_modules", "lora.max_lora_rank")
LLM_API_FIELDS = (*ENGINE_FIELDS, "lora.max_loras", "lora.max_cpu_loras")
# The template inputs a tensorrt_llm model takes an adapter by (declared in every tabulated release).
REQUEST_INPUTS = ("lora_task_id", "lora_weights", "lora_config")


def request_facts() -> dict:
    return facts(TABLE)["request"]


def release_lora(release: str) -> dict:
    return release_facts(TABLE, release, "LoRA on TensorRT-LLM")


def trtllm_modules(hf_modules: list[str]) -> list[str]:
    """TensorRT-LLM's names of HF linear modules (q_proj -> attn_q, gate_proj -> mlp_h_to_4h, up_proj -> mlp_gate)."""
    mapping = request_facts()["converter"]["hf_modules"]
    return [mapping[module] for module in hf_modules]


def _evaluate(expression: str, names: dict[str, int]) -> int:
    """An arithmetic expression of the table (names, integers, + - * /) over `names`."""
    operations = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.floordiv}

    def value(node: ast.expr) -> int:
        if isinstance(node, ast.BinOp):
            return operations[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.Name):
            return names[node.id]
        return int(node.value)

    return value(ast.parse(expression, mode="eval").body)


def module_dims(model: ModelFacts) -> dict[str, tuple[int, int]]:
    """(in, out) of every TensorRT-LLM LoRA module for the model's whole (unsplit) layer, as createLoraModules computes
    them from the engine's per-rank sizes at tp 1."""
    table = request_facts()
    names = {
        "hiddenSize": model.hidden_size,
        "mlpHiddenSize": model.intermediate_size,
        "numAttentionHeads": model.num_attention_heads,
        "numKvAttentionHeads": model.num_key_value_heads,
        "attentionHeadSize": model.head_size,
        "tpSize": 1,
        "numExperts": 0,
    }
    for name, expression in table["module_locals"].items():
        names[name] = _evaluate(expression, names)
    return {
        module: (_evaluate(spec["in_dim"], names), _evaluate(spec["out_dim"], names))
        for module, spec in table["modules"].items()
    }


def _layout() -> dict:
    """The converter's row layout, checked to be the one `request_tensors` writes: lora_A [r, in] (in dimension last),
    lora_B [out, r] (out dimension first), in that order, B scaled."""
    table = request_facts()
    converter, modules = table["converter"], table["modules"]
    linear = [modules[m] for m in trtllm_modules(list(LINEAR_MODULES))]
    if (
        converter["row_parts"] != ["in", "out"]
        or converter["scaled_part"] != "out"
        or any(m["in_dim_first"] or not m["out_dim_first"] for m in linear)
        or not converter["rows_padded_to_longest"]
        or not converter["leading_batch_dim"]
    ):
        raise BuildStepError(
            f"upstream/{TABLE}.json describes a LoRA row layout request_tensors does not write; update "
            "pipeline/targets/trtllm/lora_conversion.py"
        )
    return converter


def request_tensors(adapter: Adapter, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(lora_weights [1, rows, width] in `dtype`, lora_config [1, rows, columns] int32) of an adapter: a row per
    (layer, module) it adapts, lora_A then lora_B with PEFT's scale (alpha_pattern and rank_pattern included) folded
    into B, zero-padded to the longest row."""
    converter, ids = _layout(), request_facts()["module_ids"]
    rows, config = [], []
    for (layer, module), (a, b) in adapter.weights.items():
        rows.append(np.concatenate([a.reshape(-1), b.reshape(-1)]))
        values = {"module_id": ids[trtllm_modules([module])[0]], "layer_idx": layer, "adapter_size": a.shape[0]}
        config.append([values[column] for column in converter["config_columns"]])
    width = max(len(row) for row in rows)
    weights = np.stack([np.pad(row, (0, width - len(row))) for row in rows]).astype(NUMPY_DTYPES[dtype])
    return weights[None], np.asarray(config, dtype=np.int32)[None]


def read_request(weights: np.ndarray, config: np.ndarray, model: ModelFacts) -> dict:
    """{(layer, HF module): (lora_A [r, in], lora_B [out, r])} as the C++ runtime reads the two tensors (LoraCache
    slices each row by the module's dimensions, in then out), float32: the inverse of `request_tensors`."""
    table = request_facts()
    columns = table["converter"]["config_columns"]
    by_id = {number: name for name, number in table["module_ids"].items()}
    to_hf = {trt: hf for hf, trt in zip(LINEAR_MODULES, trtllm_modules(list(LINEAR_MODULES)))}
    dims = module_dims(model)
    out = {}
    for row, values in enumerate(config[0]):
        entry = dict(zip(columns, (int(v) for v in values)))
        module, size = by_id[entry["module_id"]], entry["adapter_size"]
        fan_in, fan_out = dims[module]
        flat = weights[0, row].astype(np.float32)
        a = flat[: size * fan_in].reshape(size, fan_in)
        b = flat[size * fan_in : size * (fan_in + fan_out)].reshape(fan_out, size)
        out[entry["layer_idx"], to_hf[module]] = (a, b)
    return out


def write_request_files(adapter: Adapter, directory: Path, dtype: str) -> int:
    """Write the adapter's lora_weights / lora_config as the .npy files the converter names into `directory`; the
    bytes written."""
    table = request_facts()
    weights, config = request_tensors(adapter, dtype)
    for key, array in (("lora_weights", weights), ("lora_config", config)):
        code = array.dtype.str.lstrip("<>|=")
        if code not in table["npy_types"]:
            raise BuildStepError(f"{key}: TensorRT-LLM's .npy loader reads {sorted(table['npy_types'])}, not {code}")
        np.save(directory / table["converter"]["files"][key], array)
    return weights.nbytes + config.nbytes


def link_prefetch(lora_dir: Path, task_ids: dict[str, int]) -> Path:
    """`lora_dir/PREFETCH_DIR/<task id>/` holding each adapter's request files (hard links where possible): the
    layout lora_prefetch_dir takes, one folder named by digits per task."""
    prefetch = lora_dir / PREFETCH_DIR
    files = request_facts()["converter"]["files"].values()
    for name, task_id in task_ids.items():
        (prefetch / str(task_id)).mkdir(parents=True)
        for file in files:
            link_or_copy(lora_dir / name / file, prefetch / str(task_id) / file)
    return prefetch


# ---------------------------------------------------------------- the engine workflow (tensorrt)


def build_flags(cfg) -> list[str]:
    """trtllm-build's LoRA flags (upstream/trtllm_build_flags.json): the plugin in the checkpoint dtype, the modules
    (nargs '+', one argument each), the largest rank."""
    if cfg.lora is None:
        return []
    lora = cfg.lora
    return [
        f"--lora_plugin={deployed_dtype(cfg)}",
        "--lora_target_modules",
        *trtllm_modules(lora.target_modules),
        f"--max_lora_rank={lora.max_lora_rank}",
    ]


def engine_parameters(cfg, engine_dir: Path) -> dict[str, object]:
    """The tensorrt_llm model's LoRA parameters: cache pages sized for max_lora_rank (the backend clamps both sizes
    to the engine's rank; its defaults are 64 and 8) and the prefetch folder of the lora stage, beside the engine.
    The GPU fraction and host bytes keep the release's defaults."""
    if cfg.lora is None:
        return {}
    rank = cfg.lora.max_lora_rank
    defaults = release_lora(cfg.target.trtllm_version)["cache_parameters"]
    return {
        "lora_cache_max_adapter_size": rank,
        "lora_cache_optimal_adapter_size": min(rank, defaults["lora_cache_optimal_adapter_size"]["default"]),
        "lora_prefetch_dir": engine_dir.parent / "lora" / PREFETCH_DIR,
    }


def _engine_problems(cfg, dtype: str) -> list[Problem]:
    release = cfg.target.trtllm_version
    facts_ = release_lora(release)
    out: list[Problem] = []
    inputs = {row["name"]: row for row in template(release)["inputs"]}
    if missing := [name for name in REQUEST_INPUTS if name not in inputs]:
        return [(("target", "trtllm_version"), f"TensorRT-LLM {release}'s tensorrt_llm template lacks {missing}")]
    if "lora_prefetch_dir" not in facts_["cache_parameters"] or facts_["prefetch"] is None:
        having = [r for r in releases(TABLE) if release_lora(r)["prefetch"]]
        out.append(
            (
                ("target", "trtllm_version"),
                f"TensorRT-LLM {release}'s tensorrtllm backend reads no lora_prefetch_dir, so every adapter would "
                f"have to travel in a request; target {', '.join(having)}",
            )
        )
    declared = inputs["lora_weights"]["data_type"]
    if TRITON_DTYPES.get(dtype) != declared or dtype not in NUMPY_DTYPES:
        out.append(
            (
                ("model", "dtype"),
                f"the engine would be {dtype}, but TensorRT-LLM {release}'s tensorrt_llm template declares "
                f"lora_weights {declared}, and its runtime takes adapter weights only in the model's data type (its "
                ".npy loader reads no bfloat16): set model.dtype: float16, or target.trtllm_backend: pytorch",
            )
        )
    columns = len(request_facts()["converter"]["config_columns"])
    if inputs["lora_config"]["dims"][-1] != columns:
        out.append(
            (
                ("target", "trtllm_version"),
                f"TensorRT-LLM {release}'s tensorrt_llm template declares lora_config dims "
                f"{inputs['lora_config']['dims']}, not rows of {columns}; update lora_conversion.py",
            )
        )
    return out


# ---------------------------------------------------------------- the PyTorch backend (LLM API)


def llm_api_lora_config(cfg) -> dict:
    """The LLM-API `lora_config`: no lora_dir (the PyTorch backend loads lora_dir only when it names exactly one
    adapter, to infer modules; requests bring their own path), so the modules are given."""
    lora = cfg.lora
    return {
        "lora_target_modules": trtllm_modules(lora.target_modules),
        "max_lora_rank": lora.max_lora_rank,
        "max_loras": lora.max_loras,
        "max_cpu_loras": lora.cpu_loras(),
    }


def _holds(value, annotation: str) -> bool:
    """Whether a YAML value is one of the LoraConfig field types the table records."""
    inner = annotation.removeprefix("Optional[").removesuffix("]") if annotation.startswith("Optional[") else None
    if inner is not None:
        return value is None or _holds(value, inner)
    if annotation in ("List[str]", "list[str]"):
        return isinstance(value, list) and all(isinstance(item, str) for item in value)
    if annotation == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    raise ValueError(f"no YAML check for LoraConfig's type {annotation}: add one to _holds")


def lora_config_problems(options: dict, release: str) -> list[str]:
    """What the release's LoraConfig refuses of a `lora_config` mapping: keys it has no field for, values of the
    wrong type."""
    fields = release_lora(release)["llm_api"]["fields"]
    out = []
    for key, value in options.items():
        if key not in fields:
            out.append(
                f"lora_config.{key} is no LoraConfig field in TensorRT-LLM {release} (it has {', '.join(fields)})"
            )
        elif not _holds(value, fields[key]["type"]):
            out.append(f"lora_config.{key}: {value!r} is not {fields[key]['type']} in TensorRT-LLM {release}")
    return out


def _llm_api_problems(cfg) -> list[Problem]:
    from pipeline.targets.trtllm.llm_api_options import has_option

    release = cfg.target.trtllm_version
    if release_lora(release)["llm_api"] is None or not has_option(release, ("lora_config",)):
        having = [r for r in releases(TABLE) if release_lora(r)["llm_api"]]
        return [(("lora",), f"TensorRT-LLM {release}'s LLM API has no lora_config; target {', '.join(having)}")]
    out: list[Problem] = [(("lora",), problem) for problem in lora_config_problems(llm_api_lora_config(cfg), release)]
    for position, section in enumerate(cfg.lora.adapters):
        path = cfg.resolve_path(section.path)
        try:
            config = peft_adapters.read_config(path)
        except PipelineError:
            continue  # config validation names an unreadable adapter
        out += [(("lora", "adapters", position, "path"), p) for p in loader_problems(path, config)]
    return out


def loader_problems(adapter_dir: Path, config: dict) -> list[str]:
    """Why TensorRT-LLM's own PEFT loader would scale this adapter differently from PEFT: it scales every module by
    adapter_config.json's lora_alpha (over the rank, or its square root with use_rslora), as the converter's `scale`
    in upstream/trtllm_lora.json reads it (and tensorrt_llm/lora_manager.py load_from_hf @ 007e181b, the PyTorch
    backend's loader), so a per-module alpha_pattern is lost; rank_pattern is not, the rank being the weights'."""
    read = {
        node.id
        for formula in request_facts()["converter"]["scale"].values()
        for node in ast.walk(ast.parse(formula, mode="eval"))
        if isinstance(node, ast.Name)
    }
    if config.get("alpha_pattern") and "alpha_pattern" not in read:
        return [
            f"{adapter_dir / peft_adapters.ADAPTER_CONFIG} sets alpha_pattern {config['alpha_pattern']}, which "
            f"TensorRT-LLM's PEFT loader ignores (its scale reads only {sorted(read - {'np'})} of the file); "
            "fold the per-module alphas into lora_B and drop alpha_pattern, or use target.trtllm_backend: tensorrt"
        ]
    return []


# ---------------------------------------------------------------- both


def config_problems(cfg) -> list[Problem]:
    """What the targeted release and backend cannot do of the lora section and its adapters' settings, naming the
    field and the fix."""
    if cfg.lora is None:
        return []
    release = cfg.target.trtllm_version
    if release not in releases(TABLE):
        return [
            (
                ("target", "trtllm_version"),
                f"LoRA on TensorRT-LLM {release} is not tabulated (upstream/{TABLE}.json has "
                f"{', '.join(releases(TABLE))}); target one of those",
            )
        ]
    mapping, ids = request_facts()["converter"]["hf_modules"], request_facts()["module_ids"]
    unknown = [m for m in cfg.lora.target_modules if mapping.get(m) not in ids]
    if unknown:
        return [(("lora", "target_modules"), f"{unknown} have no TensorRT-LLM LoRA module; remove them")]
    if cfg.target.trtllm_backend == "tensorrt":
        return _engine_problems(cfg, deployed_dtype(cfg))
    return _llm_api_problems(cfg)


def backend_fields(backend: str) -> frozenset[str]:
    """The lora fields a backend honours (the tensorrt backend sizes its cache in memory, not in adapters)."""
    return frozenset({"lora.adapters", *(LLM_API_FIELDS if backend == "pytorch" else ENGINE_FIELDS)})


def convert_adapters(cfg, ctx) -> dict:
    """The lora stage's TensorRT-LLM part: for the engine workflow, each adapter's request tensors beside its PEFT
    files and the prefetch folder; for the PyTorch backend, which reads the PEFT files itself, the loader check."""
    names = [section.name for section in cfg.lora.adapters]  # the stage's copies: ctx.out_dir / name
    if cfg.target.trtllm_backend != "tensorrt":
        problems = [
            p for n in names for p in loader_problems(ctx.out_dir / n, peft_adapters.read_config(ctx.out_dir / n))
        ]
        if problems:
            raise BuildStepError("; ".join(problems))
        return {}
    dtype = deployed_dtype(cfg)
    written = 0
    for name in names:
        written += write_request_files(peft_adapters.load(ctx.out_dir / name), ctx.out_dir / name, dtype)
    link_prefetch(ctx.out_dir, dict(zip(names, cfg.lora.task_ids())))
    ctx.log(f"wrote {dtype} lora_weights / lora_config for {len(names)} adapters and {PREFETCH_DIR}/<task id>/")
    return {"trtllm_lora_request_bytes": written}
