"""A CPU reference forward of a TensorRT-LLM checkpoint of a LLaMA-layout family (Llama, Mistral, Qwen2): quality
is measured before GPU hours.

Every rank's tensors are read back, tensor-parallel shards merged (column-parallel layers along
outputs, with duplicated KV heads taken once; row-parallel ones along inputs; pipeline stages by
layer), each weight dequantized by TensorRT-LLM's scaling-factor semantics, and the result loaded
into the transformers model of the HF config's own family (so Qwen2's q/k/v biases are loaded and
Mistral's sliding window is in the forward, as the engine applies it with max_attention_window_size).
Activation quantization (FP8, INT8 SmoothQuant, W4A8) and `prequant_scaling_factor` are applied by
forward pre-hooks, and a quantized KV cache by fake-quantizing the key/value projections' outputs
(before RoPE; TensorRT-LLM quantizes after, a rotation that keeps per-tensor ranges close). Written by
hand: no library reads TensorRT-LLM checkpoints without a GPU.

`load_unified_reference` does the same for ModelOpt's unified HF checkpoint (`export/hf_unified/`) with the
semantics of TensorRT-LLM's PyTorch backend, which deploys that checkpoint: its LinearMethods' loaders
(tensorrt_llm/_torch/modules/linear.py, the versions tabulated in upstream/trtllm_torch_loader.json) and its TRTLLM
attention backend. `checkpoint_model(..., kind=)` runs either kind for the quality gate the same way, with a LoRA
adapter added where given (`with_lora`; `adapter_models` scores it against PEFT's merge).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

FP8_MAX = 448.0


def _fake_quant(x: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "fp8":
        return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype) * scale
    return (x / scale).round().clamp(-128, 127) * scale


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[out/2, in] int8 holding two signed int4 along the output dimension -> [out, in] (low nibble first)."""
    low = (packed.to(torch.int16) << 12 >> 12).to(torch.int8)  # sign-extend bits 0-3
    high = (packed.to(torch.int16) << 8 >> 12).to(torch.int8)  # sign-extend bits 4-7
    return torch.stack([low, high], dim=1).reshape(-1, packed.shape[1])


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed int4 [out/2, in] (TensorRT-LLM's int8 or ModelOpt's unified uint8: the same nibble layout) times
    per-group scales [out, in/group]."""
    values = unpack_int4(packed).float()
    return values * scale.float().repeat_interleave(values.shape[1] // scale.shape[1], dim=1)


def loader_int8_weight_only(weight: torch.Tensor) -> torch.Tensor:
    """What TensorRT-LLM's loader makes of a float W8A16 weight [out, in], dequantized: symmetric_quantize
    (cpp/tensorrt_llm/kernels/cutlass_kernels/cutlass_preprocessors.cpp @ 05316d3) scales each output channel
    by its max |w| / 128, stored in the checkpoint dtype, rounds and clips to [-128, 127]."""
    w = weight.float()
    col_max = w.abs().amax(dim=1, keepdim=True) / 128
    scaled = w / torch.where(col_max > 0, col_max, torch.ones_like(col_max))
    q = (scaled.sign() * (scaled.abs() + 0.5).floor()).clamp(-128, 127)  # C's round(): halves away from zero
    return q * col_max.to(weight.dtype).float()


def dequantize(tensors: Mapping[str, torch.Tensor], prefix: str, algo: str | None) -> torch.Tensor:
    weight = tensors[f"{prefix}.weight"]
    scale = tensors.get(f"{prefix}.weights_scaling_factor")
    if algo == "W8A16":
        return loader_int8_weight_only(weight)
    if scale is None:  # unquantized (no algorithm, or an excluded module)
        return weight.float()
    if algo == "FP8":
        return weight.float() * scale.float()
    if algo == "W8A8_SQ_PER_CHANNEL":
        return weight.float() * scale.float()[:, None]
    return dequantize_int4(weight, scale)  # W4A16_AWQ / W4A8_AWQ: scale [out, in/group]


def all_finite(tensor: torch.Tensor) -> bool:
    """Checked 4M values at a time, in float32 (torch has no isfinite for FP8): the check of a 128K-vocabulary
    embedding holds no float32 copy of it."""
    return all(bool(torch.isfinite(part.float()).all()) for part in tensor.reshape(-1).split(1 << 22))


class StoredTensors(Mapping):
    """The tensors of safetensors files by name, each read from its file when asked for, so that a reference holds the
    model it builds and not the checkpoint beside it."""

    def __init__(self, files: list[Path]):
        from safetensors import safe_open

        self._files = {file: safe_open(file, "pt") for file in files}
        self._file_of = {name: file for file, f in self._files.items() for name in f.keys()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._files[self._file_of[name]].get_tensor(name)

    def __contains__(self, name) -> bool:
        return name in self._file_of

    def __iter__(self):
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


def load_ranks(checkpoint: Path) -> tuple[dict, list[StoredTensors]]:
    config = json.loads((checkpoint / "config.json").read_text())
    files = [checkpoint / f"rank{r}.safetensors" for r in range(config["mapping"]["world_size"])]
    return config, [finite(file, StoredTensors([file])) for file in files]


def finite(file: Path, tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """`tensors`, as read from `file`, each checked once; CheckpointError names the first holding NaN or an infinity:
    the reference (transformers' SDPA attention) may compute finite logits from it (`nonfinite.nonfinite_weight`)."""
    from pipeline.errors import CheckpointError
    from pipeline.nonfinite import nonfinite_tensor

    for name, tensor in tensors.items():
        if (
            tensor.is_floating_point()
            and not all_finite(tensor)
            and (problem := nonfinite_tensor(name, tensor.float().numpy()))
        ):
            raise CheckpointError(
                f"{file}: {problem}. Rebuild with quantization.weights: none to tell whether the quantization wrote "
                "it or the imported checkpoint holds it"
            )
    return tensors


def load_reference(checkpoint: Path, hf_dir: Path):
    """The transformers model of the HF config's family (float32) computing what the checkpoint's engine would
    compute."""
    from transformers import AutoConfig

    config, ranks = load_ranks(checkpoint)
    tp, pp = config["mapping"]["tp_size"], config["mapping"]["pp_size"]
    quant = config.get("quantization") or {}
    algo, kv_algo = quant.get("quant_algo"), quant.get("kv_cache_quant_algo")
    hf_config = AutoConfig.from_pretrained(hf_dir)
    hf_config.tie_word_embeddings = False  # the checkpoint has its own lm_head
    layers, heads, kv_heads = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    head_size, vocab = config["head_size"], hf_config.vocab_size
    q_rows, kv_per_rank = heads * head_size // tp, max(1, kv_heads // tp) * head_size
    kv_owner = max(1, tp // kv_heads)  # with duplicated KV heads, every kv_owner-th rank holds a new one
    state, hooks = {}, {}

    def stage_ranks(pp_rank: int) -> list[StoredTensors]:
        return ranks[pp_rank * tp : (pp_rank + 1) * tp]

    first, last = stage_ranks(0), stage_ranks(pp - 1)
    state["model.embed_tokens.weight"] = (
        torch.cat([r["transformer.vocab_embedding.weight"] for r in first])[:vocab].float()
        if config.get("use_parallel_embedding")
        else first[0]["transformer.vocab_embedding.weight"][:vocab].float()
    )
    state["lm_head.weight"] = torch.cat([r["lm_head.weight"] for r in last])[:vocab].float()
    state["model.norm.weight"] = last[0]["transformer.ln_f.weight"].float()
    per_stage = layers // pp
    for index in range(layers):
        shard, local = stage_ranks(index // per_stage), f"transformer.layers.{index % per_stage}"
        hf = f"model.layers.{index}"
        state[f"{hf}.input_layernorm.weight"] = shard[0][f"{local}.input_layernorm.weight"].float()
        state[f"{hf}.post_attention_layernorm.weight"] = shard[0][f"{local}.post_layernorm.weight"].float()
        fused = {"weight": [dequantize(r, f"{local}.attention.qkv", algo) for r in shard]}
        if f"{local}.attention.qkv.bias" in shard[0]:  # Qwen2's q/k/v biases, fused and split like the weight
            fused["bias"] = [r[f"{local}.attention.qkv.bias"].float() for r in shard]
        for kind, parts in fused.items():
            state[f"{hf}.self_attn.q_proj.{kind}"] = torch.cat([w[:q_rows] for w in parts])
            state[f"{hf}.self_attn.k_proj.{kind}"] = torch.cat(
                [w[q_rows : q_rows + kv_per_rank] for t, w in enumerate(parts) if t % kv_owner == 0]
            )
            state[f"{hf}.self_attn.v_proj.{kind}"] = torch.cat(
                [w[q_rows + kv_per_rank :] for t, w in enumerate(parts) if t % kv_owner == 0]
            )
        state[f"{hf}.self_attn.o_proj.weight"] = torch.cat(
            [dequantize(r, f"{local}.attention.dense", algo) for r in shard], dim=1
        )
        state[f"{hf}.mlp.gate_proj.weight"] = torch.cat([dequantize(r, f"{local}.mlp.fc", algo) for r in shard])
        state[f"{hf}.mlp.up_proj.weight"] = torch.cat([dequantize(r, f"{local}.mlp.gate", algo) for r in shard])
        state[f"{hf}.mlp.down_proj.weight"] = torch.cat(
            [dequantize(r, f"{local}.mlp.proj", algo) for r in shard], dim=1
        )
        for trt, targets, split_dim in (
            ("attention.qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), None),
            ("attention.dense", ("self_attn.o_proj",), 0),
            ("mlp.fc", ("mlp.gate_proj",), None),
            ("mlp.gate", ("mlp.up_proj",), None),
            ("mlp.proj", ("mlp.down_proj",), 0),
        ):
            prequant = [r.get(f"{local}.{trt}.prequant_scaling_factor") for r in shard]
            act = shard[0].get(f"{local}.{trt}.activation_scaling_factor")
            if prequant[0] is None and act is None:
                continue
            # row-parallel layers see their input split across ranks: their per-channel factors concatenate
            factor = None if prequant[0] is None else (torch.cat(prequant) if split_dim == 0 else prequant[0]).float()
            kind = "int8" if algo == "W8A8_SQ_PER_CHANNEL" else "fp8"
            for target in targets:
                hooks[f"{hf}.{target}"] = (factor, None if act is None else act.float(), kind)
        if kv_algo:
            attention = {
                k.rsplit(".", 1)[-1]: shard[0][k]
                for k in shard[0]
                if k.startswith(f"{local}.attention.") and "cache_scaling" in k
            }
            scale = (
                torch.max(
                    attention["k_cache_scaling_factor"], attention["v_cache_scaling_factor"]
                )  # as preprocess_weights does
                if "k_cache_scaling_factor" in attention
                else attention["kv_cache_scaling_factor"]
            ).float()
            for target in ("self_attn.k_proj", "self_attn.v_proj"):
                hooks[f"{hf}.{target}:out"] = (scale, "fp8" if kv_algo == "FP8" else "int8")

    return build_reference(hf_config, state, hooks)


def build_reference(hf_config, state: dict[str, torch.Tensor], hooks: dict):
    """The HF config's model (float32) made of `state` (HF names, dequantized weights), with `hooks`: module name ->
    (prequant factor or None, activation scale or None, "fp8"|"int8") applied to its input, and
    "module:out" -> (scale, "fp8"|"int8") fake-quantizing its output. The model is made without weights (its
    parameters on the meta device, its buffers such as RoPE's computed) and takes `state`'s tensors as its parameters
    (`assign`), so the weights are held once."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if [m for m in missing if "rotary" not in m] or unexpected:
        raise ValueError(f"reference model does not match the checkpoint: missing {missing}, unexpected {unexpected}")
    modules = dict(model.named_modules())
    for name, spec in hooks.items():
        if name.endswith(":out"):
            scale, kind = spec
            modules[name[:-4]].register_forward_hook(lambda m, args, out, s=scale, k=kind: _fake_quant(out, s, k))
        else:
            factor, act, kind = spec

            def pre(m, args, f=factor, a=act, k=kind):
                x = args[0] if f is None else args[0] * f
                return (x if a is None else _fake_quant(x, a, k),)

            modules[name].register_forward_pre_hook(pre)
    return model


# ---------------------------------------------------------------- the unified HF checkpoint, as TensorRT-LLM's
# PyTorch backend loads it

# TRTLLM attention backend (tensorrt_llm/_torch/attention_backend/trtllm.py) quantizes an FP8 KV cache with its
# kv_cache_scaling_factor, a constant 1.0; the checkpoint's k_scale / v_scale reach qkv_proj.kv_scales, which
# modules/attention.py passes to the kernel only for an FP4 KV cache. So k_scale / v_scale do not change an FP8 KV
# cache, which is stored at scale 1.0, as the TensorRT-LLM checkpoint's kv_cache_scaling_factor (ModelOpt clamps
# it to >= 1.0 there) also says.
TORCH_FP8_KV_SCALE = 1.0
TORCH_ALGOS = ("FP8", "W4A16_AWQ", "W4A8_AWQ")
SCALES = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "k_scale", "v_scale")


def _fp8_round(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def unified_linears(
    tensors: Mapping[str, torch.Tensor],
    prefix: str,
    group: tuple[str, ...],
    algo: str | None,
    dtype: torch.dtype,
    fused: bool | None = None,
) -> tuple[list[torch.Tensor], tuple | None]:
    """The dequantized weights of the linears `group` (one fused PyTorch-backend linear, or one vanilla linear) of
    layer `prefix` and the input hook spec they share, as the backend's LinearMethod for `algo` loads and runs them.
    `dtype` is the model dtype, the precision the loaders cast scales and rescaled weights to. `fused`: whether the
    backend loads the group through a fused loader (default: when it has more than one linear; a checkpoint-fused
    Phi-3 qkv_proj / gate_up_proj is one tensor the backend splits and loads fused)."""
    fused = len(group) > 1 if fused is None else fused
    names = [f"{prefix}.{m}" for m in group]
    weights = [tensors[f"{n}.weight"] for n in names]
    if algo is None or not all(f"{n}.weight_scale" in tensors for n in names):  # unquantized or excluded
        return [w.float() for w in weights], None
    scales = [tensors[f"{n}.weight_scale"].float() for n in names]
    pqs = tensors.get(f"{names[0]}.pre_quant_scale")  # the loaders read it from the group's first linear
    if algo == "FP8":  # FP8QDQLinearMethod: a fused linear requantizes its parts, in `dtype`, to the largest scale
        top = torch.stack([s.reshape(()) for s in scales]).max()
        out = [
            _fp8_round(w.to(dtype) * s.to(dtype) / top.to(dtype)) * top if fused else w.float() * s
            for w, s in zip(weights, scales)
        ]
        inputs = [tensors[f"{n}.input_scale"].float().reshape(()) for n in names if f"{n}.input_scale" in tensors]
        if not inputs:
            raise ValueError(f"{names[0]}: no input_scale; dynamic FP8 activation quantization is not modelled")
        return out, (None, torch.stack(inputs).max(), "fp8")
    if algo == "W4A16_AWQ":  # W4A16_AWQ_LinearMethod: pre_quant_scale read by load_weights_vanilla only
        out = [dequantize_int4(w, s.to(dtype).float()) for w, s in zip(weights, scales)]
        factor = pqs.float() if pqs is not None and not fused else None
        return out, None if factor is None else (factor, None, "fp8")
    if algo == "W4A8_AWQ":  # W4A8_AWQ_LinearMethod: int4 x fp16(weight_scale / weight_scale_2) -> fp8 GEMM
        scale_2 = tensors[f"{names[0]}.weight_scale_2"].float().reshape(())
        out = [_fp8_round(dequantize_int4(w, (s / scale_2).half().float())) * scale_2 for w, s in zip(weights, scales)]
        act = tensors[f"{names[0]}.input_scale"].float().reshape(())
        return out, (None if pqs is None else pqs.float(), act, "fp8")
    raise ValueError(f"quant_algo {algo!r}: TensorRT-LLM's PyTorch backend semantics are modelled for {TORCH_ALGOS}")


def unified_checkpoint(unified_dir: Path) -> tuple[dict, torch.dtype, StoredTensors]:
    """A unified HF checkpoint's config.json, its dtype and its *.safetensors' tensors (read when asked for)."""
    config = json.loads((unified_dir / "config.json").read_text())
    files = sorted(unified_dir.glob("*.safetensors"))
    for file in files:
        finite(file, StoredTensors([file]))
    tensors = StoredTensors(files)
    return config, getattr(torch, config.get("torch_dtype") or config.get("dtype") or "float16"), tensors


def load_unified_reference(unified_dir: Path, hf_dir: Path, release: str | None = None):
    """transformers' model of the family (float32) computing what TensorRT-LLM `release`'s PyTorch backend (default:
    the newest tabulated) would compute from the unified HF checkpoint `unified_dir` (hf_quant_config.json +
    *.safetensors, HF tensor names). Where that release's model (upstream/trtllm_torch_models.json) reads less than
    transformers does, the reference follows the release: config keys it never names (Gemma's logit
    soft-capping) are dropped, a sliding window its attention takes no window for is dropped (Mistral: full
    attention), a literal sliding-layer RoPE base and q/k-norm eps are used. Phi-3's qkv_proj / gate_up_proj stay
    fused, as in transformers and the checkpoint."""
    from transformers import AutoConfig

    from pipeline.models import ModelFacts
    from pipeline.targets.trtllm.torch_checkpoint import RELEASES, family, loader_groups

    config, dtype, tensors = unified_checkpoint(unified_dir)
    release = release or RELEASES[-1]
    if release not in RELEASES:
        raise ValueError(f"TensorRT-LLM {release}: no PyTorch-backend facts tabulated (have {', '.join(RELEASES)})")
    row = family(config, release)  # what the release's model reads (upstream/trtllm_torch_models.json)
    if row is None:
        raise ValueError(f"TensorRT-LLM {release} registers no PyTorch model for {config.get('architectures')}")
    quant_file = unified_dir / "hf_quant_config.json"
    quant = json.loads(quant_file.read_text()).get("quantization", {}) if quant_file.is_file() else {}
    algo, kv_algo = quant.get("quant_algo"), quant.get("kv_cache_quant_algo")
    if kv_algo not in (None, "FP8"):
        raise ValueError(f"kv_cache_quant_algo {kv_algo!r}: only an FP8 KV cache is modelled for the PyTorch backend")
    hf_config = AutoConfig.from_pretrained(hf_dir)
    hf_config.tie_word_embeddings = False
    attention = row["attention"] or {}
    for key in row["never_names"]:
        setattr(hf_config, key, None)
    if attention.get("attention_window") is None and getattr(hf_config, "sliding_window", None):
        hf_config.sliding_window = None
    if isinstance(attention.get("sliding_rope_theta"), (int, float)):
        hf_config.rope_local_base_freq = attention["sliding_rope_theta"]
    vocab = hf_config.vocab_size
    embed = tensors["model.embed_tokens.weight"][:vocab].float()
    state = {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": tensors["lm_head.weight"][:vocab].float() if "lm_head.weight" in tensors else embed,
    }
    checkpoint_fused = row["fused_checkpoint_linears"]  # Phi-3's qkv_proj / gate_up_proj: loaded whole
    groups = loader_groups(checkpoint_fused)
    hooks, kv_slices = {}, {}
    for index in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{index}"
        for group in groups:
            weights, hook = unified_linears(
                tensors, prefix, group, algo, dtype, fused=len(group) > 1 or group[0] in checkpoint_fused
            )
            for module, weight in zip(group, weights):
                state[f"{prefix}.{module}.weight"] = weight
                if hook is not None:
                    hooks[f"{prefix}.{module}"] = hook
        if kv_algo == "FP8" and "self_attn.qkv_proj" in checkpoint_fused:
            facts = ModelFacts.from_hf_config(config)
            kv_slices[f"{prefix}.self_attn.qkv_proj"] = facts.num_attention_heads * facts.head_size
        elif kv_algo == "FP8":
            for module in ("self_attn.k_proj", "self_attn.v_proj"):
                hooks[f"{prefix}.{module}:out"] = (torch.tensor(TORCH_FP8_KV_SCALE), "fp8")
    for name in tensors:  # norms, q/k norms, biases: copied as they are
        if name not in state and name.rsplit(".", 1)[-1] not in SCALES and not name.endswith("proj.weight"):
            state[name] = tensors[name].float()
    model = build_reference(hf_config, state, hooks)
    scale = torch.tensor(TORCH_FP8_KV_SCALE)
    for name, q_rows in kv_slices.items():  # the k/v part of a checkpoint-fused qkv_proj's output
        model.get_submodule(name).register_forward_hook(
            lambda m, args, out, q=q_rows: torch.cat([out[..., :q], _fake_quant(out[..., q:], scale, "fp8")], -1)
        )
    for norm, spec in (attention.get("qk_norm") or {}).items():
        if isinstance(spec["eps"], float):  # a literal eps in place of config.rms_norm_eps (Qwen3's own q/k norms)
            for name, module in model.named_modules():
                if name.endswith(f"self_attn.{norm}"):
                    module.variance_epsilon = spec["eps"]
    return model


def with_lora(model, deltas: dict):
    """`model` (a transformers decoder) adding x @ A.T @ B.T to each adapted linear module's output, `deltas` being
    {(layer, HF module): (lora_A [r, in], lora_B [out, r] with the scale folded in)}, as TensorRT-LLM's LoRA plugin
    adds the adapter beside the (quantized) base weight rather than merging it."""
    from pipeline.peft_adapters import ATTENTION_MODULES

    modules = dict(model.named_modules())
    for (layer, module), (a, b) in deltas.items():
        block = "self_attn" if module in ATTENTION_MODULES else "mlp"
        a_t, b_t = torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32)
        modules[f"model.layers.{layer}.{block}.{module}"].register_forward_hook(
            lambda m, args, out, a=a_t, b=b_t: out + args[0] @ a.T @ b.T
        )
    return model


def adapter_deltas(cfg, adapter_dir: Path, facts) -> dict:
    """The adapter as the backend's runtime takes it: the engine workflow's lora_weights / lora_config (written by the
    lora stage) read back as the C++ runtime slices them; for the PyTorch backend, which loads the PEFT files itself,
    their weights with PEFT's scale (lora_conversion.loader_problems refuses the adapters its loader would scale
    otherwise)."""
    import numpy as np

    from pipeline import peft_adapters
    from pipeline.targets.trtllm import lora_conversion

    if cfg.target.trtllm_backend != "tensorrt":
        return peft_adapters.load(adapter_dir).weights
    files = lora_conversion.request_facts()["converter"]["files"]
    return lora_conversion.read_request(
        np.load(adapter_dir / files["lora_weights"]), np.load(adapter_dir / files["lora_config"]), facts
    )


def adapter_models(cfg, hf_dir: Path, checkpoint: Path, kind: str, name: str, adapter_dir: Path, log=print):
    """(the deployed checkpoint's reference forward with adapter `name` as the runtime takes it, PEFT's fp32 merge)
    for the lora stage's quality gate."""
    from dataclasses import replace

    from pipeline.models import facts_from_hf_dir
    from pipeline.torch_models import peft_reference

    deltas = adapter_deltas(cfg, adapter_dir, facts_from_hf_dir(hf_dir))

    model = checkpoint_model(cfg, hf_dir, checkpoint, kind, log, deltas=deltas)
    return replace(model, name=f"{model.name} with adapter {name}"), peft_reference(hf_dir, adapter_dir, name)


def checkpoint_model(cfg, hf_dir: Path, checkpoint: Path, kind: str = "trtllm", log=print, deltas: dict | None = None):
    """A checkpoint's reference forward as the quality gate (`pipeline.quality`) runs it, loaded on first use and
    dropped by the Model's `release`, with a greedy sample of it in its notes once loaded. `kind`: "trtllm" (a
    TensorRT-LLM checkpoint, as its engine runs it) or "unified" (ModelOpt's unified HF checkpoint, as TensorRT-LLM's
    PyTorch backend runs it); `deltas`: a LoRA adapter (`with_lora`)."""
    from pipeline import quality, torch_models

    notes = {}

    def load():
        from transformers import AutoTokenizer

        log(f"loading the {kind} checkpoint's reference forward")
        if kind == "unified":  # as the targeted release's model reads it
            reference = load_unified_reference(checkpoint, hf_dir, cfg.target.trtllm_version)
        else:
            reference = load_reference(checkpoint, hf_dir)
        if deltas:
            with_lora(reference, deltas)
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        prompt = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
        with torch.no_grad():
            sample = reference.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        notes["greedy_sample"] = tokenizer.decode(sample[0, prompt.shape[1] :], skip_special_tokens=True)
        return reference

    reference = quality.Loaded(load)
    return quality.Model(
        f"{checkpoint.name} checkpoint",
        checkpoint,
        lambda ids: torch_models.torch_logits_fn(reference())(ids),
        lambda prompt, max_new_tokens, end: torch_models.torch_greedy(reference(), prompt, max_new_tokens, end),
        notes=notes,
        release=reference.release,
    )
