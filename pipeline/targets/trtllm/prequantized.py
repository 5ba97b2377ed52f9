"""Already-quantized checkpoints (GPTQ, AWQ, compressed-tensors) on the trtllm target: whether the configured
release's backend loads one as it is, per upstream/trtllm_prequantized.json, and the tensors it then reads.

Where the backend does not, `checkpoint_quantization: keep` cannot work there and validate says so, naming the
release, what its loader lacks (with the source read) and the way out: dequantize the checkpoint and let ModelOpt
re-quantize it (AWQ). Where it does (the engine workflow), the quantize stage is skipped and the export stage runs no
ModelOpt: `tensor_problems` checks the checkpoint's own safetensors (import/quantized/) against what the loader reads,
from their headers only, and `export_kept` then stops with the release's convert_checkpoint.py command and the
trtllm-build one, since the converter is TensorRT-LLM's own code (GPU, source tree) and no checkpoint is faked.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import BuildStepError
from pipeline.prequantized import QUANTIZED_DIR, CheckpointQuantization, kept, of_config
from pipeline.safetensors_files import tensor_headers
from pipeline.targets.trtllm.dtypes import deployed_dtype
from pipeline.upstream import facts

TABLE = "trtllm_prequantized"
ALTERNATIVE = (
    "set quantization.checkpoint_quantization: dequantize with method: awq (weights: int4) to re-quantize with "
    "ModelOpt AWQ"
)
PACKED_DTYPE = "I32"  # 32-bit words of 32 // bits codes: the packing both loaders unpack
SCALE_DTYPES = ("F16", "BF16", "F32")
_UNSET = object()


def verdict(release: str, backend: str, method: str) -> dict | None:
    """The tabulated verdict for `method` on `backend` at `release`; None where the table has no such block."""
    block = facts(TABLE)["releases"].get(release) or {}
    return (block.get(backend) or {}).get(method)


def _cited(source: dict | list) -> str:
    sources = source if isinstance(source, list) else [source]
    return "; ".join(f"{s['repo']} {s['path']}@{s['commit'][:12]}" for s in sources)


def _detected(cfg) -> CheckpointQuantization | None:
    """The checkpoint's quantization; None for a float one, another source, or an unreadable block (which the
    target-neutral checks name)."""
    found = of_config(cfg)
    return found if isinstance(found, CheckpointQuantization) else None


def unmet(facts_: dict, detected: CheckpointQuantization) -> list[str]:
    """The loader's requirements the checkpoint does not meet (bits, act-order, packing), in words."""
    requires = facts_.get("requires", {})
    out = []
    if "bits" in requires and detected.bits != requires["bits"]:
        out.append(f"it loads {requires['bits']}-bit weights only (QuantAlgo {facts_['quant_algo']})")
    if requires.get("desc_act") is False and detected.desc_act:
        out.append("it refuses act-order (desc_act: true) and reads no g_idx")
    if "packing" in requires and detected.packing != requires["packing"]:
        out.append(f"it reads the {requires['packing']} packing (zero points as that packing stores them)")
    return out


def config_problems(cfg, detected=_UNSET) -> list[tuple[tuple[str, ...], str]]:
    """(loc, message) pairs for the configured backend and release: method gptq without a GPTQ checkpoint kept as
    it is, and a checkpoint kept as it is that the release's loader does not take."""
    from pipeline.targets.trtllm.backend import backend_of

    q = cfg.quantization
    keep = getattr(q, "checkpoint_quantization", "keep") == "keep"
    if detected is _UNSET:
        detected = _detected(cfg)
    out = []
    if q.method == "gptq" and not (keep and detected is not None and detected.method == "gptq"):
        out.append(
            (
                ("quantization", "method"),
                "gptq on trtllm describes an imported GPTQ checkpoint kept as it is (checkpoint_quantization: keep); "
                "GPTQ calibration is the onnxruntime target's. Use method: awq (ModelOpt) or rtn",
            )
        )
    if detected is None or not keep:
        return out
    backend, release = backend_of(cfg).name, cfg.target.trtllm_version
    found = verdict(release, backend, detected.method)
    if found is None:
        return out  # a release this backend does not tabulate: the adapter names the releases it has
    where = f"TensorRT-LLM {release}'s {backend} backend"
    if not found["loads"]:
        reasons = [f"{found['lacks']} ({_cited(found['source'])})"]
    else:
        reasons = [f"{reason} ({_cited(found['source'])})" for reason in unmet(found, detected)]
    if reasons:
        out.append(
            (
                ("quantization", "checkpoint_quantization"),
                f"{where} does not load the checkpoint's {detected.describe()} weights as they are: "
                f"{'; '.join(reasons)}. {ALTERNATIVE[0].upper()}{ALTERNATIVE[1:]}",
            )
        )
    elif q.kv_cache != "none" or q.modelopt_recipe:
        field = "kv_cache" if q.kv_cache != "none" else "modelopt_recipe"
        out.append(
            (
                ("quantization", field),
                "needs ModelOpt calibration, but the checkpoint's quantized weights are kept as they are (no "
                "quantize stage runs); remove it, or set checkpoint_quantization: dequantize",
            )
        )
    return out


# ---------------------------------------------------------------- the tensors the loader reads


def _linear_shapes(detected: CheckpointQuantization, qweight: list[int]) -> tuple[int, int]:
    """(in, out) features of a linear from its qweight: GPTQ packs along the input rows, AWQ's GEMM packing along
    the output columns."""
    per_word = 32 // detected.bits
    if detected.packing == "awq_gemm":
        return qweight[0], qweight[1] * per_word
    return qweight[0] * per_word, qweight[1]


def linear_problems(name: str, headers: dict, detected: CheckpointQuantization, suffixes: list[str]) -> list[str]:
    """One linear's tensors against the packing: present, integer words where packed, float scales, and shapes
    that agree with one another and with the group size."""
    missing = [f"{name}.{suffix}" for suffix in suffixes if f"{name}.{suffix}" not in headers]
    if missing:
        return [f"{', '.join(missing)} missing (the loader reads {', '.join(suffixes)} for each linear)"]
    out = []
    (qweight_dtype, qweight), (zeros_dtype, zeros), (scales_dtype, scales) = (
        headers[f"{name}.{suffix}"] for suffix in ("qweight", "qzeros", "scales")
    )
    for suffix, dtype in (("qweight", qweight_dtype), ("qzeros", zeros_dtype)):
        if dtype != PACKED_DTYPE:
            out.append(f"{name}.{suffix} is {dtype}; the loader unpacks {PACKED_DTYPE} words")
    if scales_dtype not in SCALE_DTYPES:
        out.append(f"{name}.scales is {scales_dtype}; expected a float ({', '.join(SCALE_DTYPES)})")
    if len(qweight) != 2 or len(zeros) != 2 or len(scales) != 2:
        return out + [f"{name}: qweight, qzeros and scales must be 2-D"]
    rows, cols = _linear_shapes(detected, qweight)
    groups = 1 if detected.group_size == -1 else rows // detected.group_size
    if detected.group_size != -1 and rows % detected.group_size:
        out.append(f"{name}: {rows} input features are not a multiple of group_size {detected.group_size}")
    per_word = 32 // detected.bits
    wanted = {"scales": [groups, cols], "qzeros": [groups, cols // per_word]}
    for suffix, shape in (("scales", scales), ("qzeros", zeros)):
        if shape != wanted[suffix]:
            out.append(
                f"{name}.{suffix} has shape {shape}; a {rows}x{cols} linear in groups of {detected.group_size} "
                f"({detected.packing}) has {wanted[suffix]}"
            )
    return out


def tensor_problems(hf_dir: Path, detected: CheckpointQuantization, release: str, backend: str) -> list[str]:
    """What in the checkpoint's safetensors the release's loader would not read as the checkpoint means it: each
    layer's tabulated linears (qweight/qzeros/scales), a linear the checkpoint left unquantized that the loader
    reads packed, and the float tensors around them."""
    found = verdict(release, backend, detected.method)
    if found is None or not found["loads"]:
        lacks = found["lacks"] if found else "not tabulated"
        return [f"TensorRT-LLM {release}'s {backend} backend does not load {detected.method} checkpoints: {lacks}"]
    headers = tensor_headers(hf_dir)
    if not headers:
        return [f"{hf_dir} has no *.safetensors file (the loader reads safetensors)"]
    prefix = found["layer_prefix"]
    head = prefix.split("{layer}")[0]
    layers = sorted({int(n[len(head) :].split(".")[0]) for n in headers if n.startswith(head)})
    if not layers:
        return [f"no tensor is named {prefix.format(layer='N')}...: not the layer naming the loader reads"]
    out = []
    skipped = set(detected.skipped_modules)
    for layer in layers:
        for module in found["modules"]:
            name = prefix.format(layer=layer) + module
            if name in skipped or f"{name}.weight" in headers:
                out.append(
                    f"{name} is left unquantized in the checkpoint, but the loader reads every linear packed "
                    f"({', '.join(found['tensors'])})"
                )
                continue
            out += linear_problems(name, headers, detected, found["tensors"])
    config = json.loads((hf_dir / "config.json").read_text()) if (hf_dir / "config.json").is_file() else {}
    model = head.split("layers.")[0]
    floats = [f"{model}embed_tokens.weight", f"{model}norm.weight"]
    floats += [
        prefix.format(layer=layers[0]) + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight")
    ]
    if not config.get("tie_word_embeddings"):
        floats.append("lm_head.weight")
    out += [f"{name} missing (the loader reads it as a float tensor)" for name in floats if name not in headers]
    return out


# ---------------------------------------------------------------- the engine workflow's converter


def converter_command(cfg, detected: CheckpointQuantization, quantized_dir: Path, checkpoint_dir: Path) -> list[str]:
    """The release's convert_checkpoint.py invocation turning the kept checkpoint into a TensorRT-LLM one: its
    quantization comes from the checkpoint's config.json (the table's quantization_from_checkpoint_config), so the
    flags name only where, which dtype and how many ranks; each is one the tabulated argparse defines, within its
    choices."""
    release, p = cfg.target.trtllm_version, cfg.parallel
    converter = verdict(release, "tensorrt", detected.method)["converter"]
    values = {
        "model_dir": quantized_dir,
        "output_dir": checkpoint_dir,
        "dtype": deployed_dtype(cfg, quantized_dir),
        "tp_size": p.tp_size,
        "pp_size": p.pp_size,
        "workers": p.tp_size * p.pp_size,
    }
    for flag, value in values.items():
        defined = converter["arguments"].get(flag)
        if defined is None or ("choices" in defined and value not in defined["choices"]):
            raise BuildStepError(
                f"TensorRT-LLM {release}'s {converter['script']} takes no --{flag}={value} "
                f"({_cited(converter['source'])}); re-tabulate upstream/{TABLE}.json"
            )
    return ["python3", converter["script"], *(f"--{flag}={value}" for flag, value in values.items())]


def kept_commands(cfg, output: Path) -> tuple[list[str], list[str]] | None:
    """(convert_checkpoint.py, trtllm-build) for a kept checkpoint on the engine workflow, with absolute paths under
    `output`; None where no checkpoint is kept there."""
    from pipeline.targets.trtllm.tensorrt_backend import trtllm_build_command

    detected = kept(cfg)
    if detected is None or cfg.target.trtllm_backend != "tensorrt":
        return None
    if not (verdict(cfg.target.trtllm_version, "tensorrt", detected.method) or {}).get("loads"):
        return None  # validate refuses it (config_problems)
    output = output.resolve()
    checkpoint = output / "export" / "trtllm_checkpoint"  # where the engine stage reads it (deployed_checkpoint)
    return (
        converter_command(cfg, detected, output / "import" / QUANTIZED_DIR, checkpoint),
        trtllm_build_command(cfg, checkpoint, output / "engine"),
    )


def export_kept(cfg, ctx, detected: CheckpointQuantization, backend: str) -> dict:
    """The export stage for a kept checkpoint: its tensors checked against what the release's loader reads, then a
    stop naming the commands that convert it and build the engine (TargetUnavailable), as the engine stage stops."""
    import shlex

    from pipeline.errors import TargetUnavailable
    from pipeline.targets.trtllm.image import container, nvidia_image
    from pipeline.targets.trtllm.tensorrt_backend import missing_for_engine

    release, quantized = cfg.target.trtllm_version, ctx.upstream("import") / QUANTIZED_DIR
    problems = tensor_problems(quantized, detected, release, backend)
    if problems:
        raise BuildStepError(
            f"{quantized} does not conform to what TensorRT-LLM {release}'s {backend} backend reads:\n  "
            + "\n  ".join(problems)
        )
    ctx.log(
        f"{quantized.name}/ ({detected.describe()}) conforms to what TensorRT-LLM {release}'s {backend} backend reads"
    )
    convert, build = kept_commands(cfg, ctx.output)
    missing = missing_for_engine()
    why = f"needs {' and '.join(missing)}" if missing else "is an example script this pipeline does not run"
    version = container(release)["tensorrt_llm"]
    raise TargetUnavailable(
        f"the checkpoint is kept as it is ({detected.describe()}); its tensors conform to what TensorRT-LLM "
        f"{release}'s convert_checkpoint.py reads ({quantized}). Converting them is TensorRT-LLM's own code, which "
        f"{why}; nothing was written. On a GPU machine, in NVIDIA's container {nvidia_image(release)}, from the root "
        f"of TensorRT-LLM {version}'s source tree (the script is one of its examples), run:\n  "
        f"{shlex.join(convert)}\nthen build the engine:\n  {shlex.join(build)}"
    )
