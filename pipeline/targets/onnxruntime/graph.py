"""A fused ONNX Runtime graph for every registered decoder family, built from the safetensors directly.

Written by hand because no exporter usable here emits it: optimum-onnx exports ~40 unfused ops per
layer (the CPU decode is call-overhead bound), and onnxruntime-genai's builder, which emits this kind
of graph, needs transformers 5 (this environment pins 4.57 for optimum, ModelOpt and the GGUF import).

Per layer: SkipSimplifiedLayerNormalization, one fused QKV MatMul, GroupQueryAttention (rotary inside,
KV cache updated in place in a caller-owned buffer), o_proj, a fused gate/up MatMul, the activation,
down_proj. Every linear is a plain MatMul on a constant weight, so the engine stage quantizes it like any
export. What sets a family apart is read from its config.json and weights, as transformers 4.57 reads them:
q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3, Gemma 3: q, k and v then enter GQA apart), sliding
windows per layer (`layer_types` / `sliding_window` -> GQA local_window_size), partial rotary (Phi-3: a
narrower cos/sin cache), fused HF projections (Phi-3 qkv_proj, gate_up_proj), GELU-tanh, norms after
attention and MLP, attention scale and final logit soft-capping (Gemma 3); `FAMILIES` holds the rest.

Interface (see `runtime.kv_layouts.SharedCache`, the runner side):
  input_ids              int64 [batch, seq]          new tokens, right-padded
  seqlens_k              int32 [batch]               per row: tokens in the cache after this step - 1
  total_sequence_length  int32 []                    max over rows of seqlens_k + 1
  logits_index           int64 [n]                   flat indices into batch*seq whose logits to return
  past_key_values.{i}.key/value  float [batch, kv_heads, capacity, head_dim]
  lora.{i}.{linear}.a/b  float [in, width] / [width, out]  with LoRA: the bound slots' weights side by side
  lora_mask.{parts}      bool [batch, 1, width]   true on the columns of the row's slot (`runtime.lora_slots`)
  -> logits float [n, vocab], present.{i}.key/value (the same buffers when bound to them)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from pipeline.errors import BuildStepError
from pipeline.models import ModelFacts
from pipeline.targets.onnxruntime.external_data import DataWriter
from pipeline.targets.onnxruntime.runtime import lora_slots as lora

OPSET = 23  # RMSNormalization
# The graph's fused linears and the HF modules each concatenates along its output axis.
FUSED_LINEARS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fused_parts(module: str) -> list[str]:
    """'model.layers.0.self_attn.qkv_proj' -> its q/k/v_proj modules; any other linear is its own part."""
    prefix, dot, name = module.rpartition(".")
    return [f"{prefix}{dot}{part}" for part in FUSED_LINEARS.get(name, (name,))]


@dataclass(frozen=True)
class Family:
    """What a family does that its config.json and weight names do not say."""

    norm_offset: float = 0.0  # RMSNorm scales by (offset + w): Gemma stores w - 1
    embed_scale: bool = False  # token embeddings times sqrt(hidden_size)
    local_rope_base: str | None = None  # config key of the sliding layers' own RoPE base (default rope, no scaling)


FAMILIES = {
    "LlamaForCausalLM": Family(),
    "Qwen2ForCausalLM": Family(),
    "Qwen3ForCausalLM": Family(),
    "MistralForCausalLM": Family(),
    "Phi3ForCausalLM": Family(),
    "Gemma3ForCausalLM": Family(norm_offset=1.0, embed_scale=True, local_rope_base="rope_local_base_freq"),
}
# config hidden_activation / hidden_act -> ONNX Gelu's `approximate`, or None for SiLU (Sigmoid * x)
ACTIVATIONS = {"silu": None, "gelu_pytorch_tanh": "tanh"}
# RoPE variants whose frequencies depend on the sequence length at run time: a fixed cos/sin cache cannot hold them.
# longrope switches tables at original_max_position_embeddings, and transformers' Phi-3 `generate` then recomputes
# the whole KV cache with the long factors (Phi3ForCausalLM.prepare_inputs_for_generation): an in-place cache cannot.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
LORA_ZERO = "lora_zero"  # the scalar the LoRA branches put in other slots' columns


def supports(hf_dir: Path) -> str | None:
    """None when the checkpoint can be built as a fused graph, else why not."""
    from transformers import AutoConfig

    raw = json.loads((hf_dir / "config.json").read_text())
    architectures = raw.get("architectures") or []
    if not set(architectures) & set(FAMILIES):
        return f"architecture {architectures} is not one of {list(FAMILIES)}"
    config = AutoConfig.from_pretrained(hf_dir)  # with the family's defaults for what config.json leaves out
    head_dim = ModelFacts.from_hf_config(raw).head_size
    if head_dim % 16:
        return f"head_dim {head_dim} is not a multiple of 16 (GroupQueryAttention on CPU needs it)"
    if activation(config) not in ACTIVATIONS:
        return f"activation {activation(config)!r} is not one of {list(ACTIVATIONS)}"
    rotary_half = int(head_dim * getattr(config, "partial_rotary_factor", 1.0)) // 2
    if rotary_half % 8:
        return (
            f"the rotary part of each head ({2 * rotary_half} of head_dim {head_dim}) is not a multiple of 16 "
            "(GroupQueryAttention's cos/sin cache on CPU needs it)"
        )
    if rope_type(config) in LENGTH_DEPENDENT_ROPE:
        return (
            f"rope_scaling type {rope_type(config)!r} switches its frequencies with the sequence length "
            "(transformers' Phi-3 generate then recomputes the KV cache), which one fixed cos/sin cache cannot do; "
            f"optimum-onnx's export is exact up to {exact_length(hf_dir)} tokens (original_max_position_embeddings)"
        )
    if getattr(config, "attn_logit_softcapping", None):  # Gemma 3 checkpoints leave it unset
        return (
            "attn_logit_softcapping is set: GroupQueryAttention's softcap on CPU (ORT 1.32) does not reproduce "
            "transformers' capped attention scores (measured: logits off by 1.5, 0.08 with the scale folded in)"
        )
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention is set (GroupQueryAttention is causal)"
    return None


def exact_length(hf_dir: Path) -> int | None:
    """The longest sequence an ONNX graph with one fixed cos/sin cache computes exactly for a checkpoint whose RoPE
    depends on the sequence length (either graph: optimum's export holds one table too); None when unbounded."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    if rope_type(config) not in LENGTH_DEPENDENT_ROPE:
        return None
    return getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings


def rope_type(config) -> str:
    """The RoPE variant, under either key transformers accepts (older configs, Phi-3's, say `type`)."""
    scaling = getattr(config, "rope_scaling", None) or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def activation(config) -> str:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "silu"


def rotary_cache(config, local_base: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [max_position, rotary_dim/2], with transformers' own rope-scaling variants and partial
    rotary; `local_base` gives Gemma 3's sliding layers their default-rope table."""
    import copy

    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if local_base is not None:
        config = copy.deepcopy(config)
        config.rope_theta, config.rope_scaling = local_base, {"rope_type": "default"}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type(config)](config, torch.device("cpu"))
    angles = np.outer(np.arange(config.max_position_embeddings, dtype=np.float64), inv_freq.double().numpy())
    return (np.cos(angles) * scaling).astype(np.float32), (np.sin(angles) * scaling).astype(np.float32)


def sliding_windows(config) -> list[int]:
    """Per layer: the sliding window (0: full attention), from `layer_types` where the config has them."""
    window = getattr(config, "sliding_window", None) or 0
    types = getattr(config, "layer_types", None)
    if types is None:
        return [window] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else 0 for kind in types]


class CheckpointTensors(Mapping[str, np.ndarray]):
    """The checkpoint's tensors by name, each read from its safetensors file as float32 when asked for: the graph
    is fp32, the checkpoint may be bf16, and no more than one weight is in memory at a time. A float32 tensor may be
    a private mapping of the file: never change one in place."""

    def __init__(self, hf_dir: Path):
        from safetensors import safe_open

        self.files = {}
        for file in sorted(hf_dir.glob("*.safetensors")):
            handle = safe_open(file, "pt")  # torch: reads bf16/fp16 tensors (numpy has no bfloat16)
            self.files |= {name: handle for name in handle.keys()}

    def __getitem__(self, name: str) -> np.ndarray:
        return self.files[name].get_tensor(name).float().numpy()

    def __iter__(self):
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def build(hf_dir: Path, out_path: Path, lora_modules: Sequence[str] = ()) -> dict:
    """Write the fused graph for the checkpoint in hf_dir to out_path (weights in out_path + '.data'), with a
    multi-LoRA branch on the linears holding `lora_modules` (`runtime.lora_slots`)."""
    import onnx
    from onnx import helper
    from transformers import AutoConfig

    why_not = supports(hf_dir)
    if why_not:
        raise BuildStepError(f"{hf_dir}: cannot build the fused graph: {why_not}; set target.onnx_graph: optimum")
    config = AutoConfig.from_pretrained(hf_dir)  # with derived fields (layer_types) and the family's defaults
    facts = ModelFacts.from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    graph = FusedGraph(config, facts, CheckpointTensors(hf_dir), out_path.with_name(out_path.name + ".data"))
    graph.lora_branches = lora.branch_parts(list(lora_modules))
    x = graph.embeddings()
    residual = None
    for layer in range(facts.num_hidden_layers):
        x, residual = graph.decoder_layer(layer, x, residual)
    graph.logits(x, residual)
    inputs, outputs = graph.interface()
    model = helper.make_model(
        helper.make_graph(graph.nodes, "fused_gqa", inputs, outputs, graph.initializers),
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)],
        producer_name="trtllm-pipeline",
    )
    graph.data.close()
    onnx.save(model, str(out_path))  # the weights are in the data file already
    return {
        "graph": "fused_gqa",
        "layers": facts.num_hidden_layers,
        "opset": OPSET,
        "nodes": len(graph.nodes),
        "lora_branches": sum(name.endswith(".a") for name in graph.lora_inputs),
    }


class FusedGraph:
    """The nodes and initializers of one fused graph as they are added, each weight written to the data file as it
    is read (so the checkpoint is held one tensor at a time), named after the Hugging Face module it computes."""

    def __init__(self, config, facts: ModelFacts, weights: CheckpointTensors, data_path: Path):
        self.config, self.weights = config, weights
        self.family = FAMILIES[next(a for a in config.architectures if a in FAMILIES)]
        self.hidden, self.heads, self.kv_heads = facts.hidden_size, facts.num_attention_heads, facts.num_key_value_heads
        self.head_dim, self.layers = facts.head_size, facts.num_hidden_layers
        self.eps = float(config.rms_norm_eps)
        self.gelu = ACTIVATIONS[activation(config)]
        self.scale = float(getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        self.windows = sliding_windows(config)
        self.nodes, self.initializers = [], []
        self.data = DataWriter(data_path)
        self.lora_branches: dict[str, list[str]] = {}
        self.lora_inputs = {}  # name -> value info of the graph input (the masks shared by branches of one width: once)

    # ------------------------------------------------------------ building blocks

    def weight(self, name: str, array: np.ndarray, dtype=np.float32) -> str:
        self.initializers.append(self.data.add(name, np.asarray(array, dtype=dtype)))
        return name

    def node(self, op: str, inputs: list[str], name: str, outputs: int = 1, domain: str = "", **attrs) -> list[str]:
        from onnx import helper

        names = [f"{name}/output_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, names, name=name, domain=domain, **attrs))
        return names

    @staticmethod
    def path(module: str) -> str:
        return "/" + module.replace(".", "/")

    def norm_weight(self, module: str) -> str:
        return self.weight(f"{module}.weight", self.weights[f"{module}.weight"] + self.family.norm_offset)

    def rms_norm(self, x: str, module: str) -> str:
        return self.node(
            "RMSNormalization", [x, self.norm_weight(module)], self.path(module), axis=-1, epsilon=self.eps
        )[0]

    def skip_norm(self, x: str, skip: str, module: str) -> tuple[str, str]:
        """RMSNorm(x + skip) and x + skip, the residual stream."""
        normed, _, _, total = self.node(
            "SkipSimplifiedLayerNormalization",
            [x, skip, self.norm_weight(module)],
            self.path(module),
            outputs=4,
            domain="com.microsoft",
            epsilon=self.eps,
        )
        return normed, total

    def linear(self, x: str, module: str, parts: list[str], layer: int) -> str:
        """x @ W for the HF modules `parts` concatenated along the output axis (+ bias when they have one, + the
        rows' LoRA deltas when the engine carries LoRA there); a module the checkpoint already stores fused
        (Phi-3's qkv_proj) is read as it is."""
        weights, path = self.weights, self.path(module)
        if f"{module}.weight" in weights:
            parts = [module]
        matrix = np.concatenate([weights[f"{p}.weight"] for p in parts], axis=0).T  # HF stores [out, in]
        out = self.node("MatMul", [x, self.weight(f"{module}.weight_t", matrix)], f"{path}/MatMul")[0]
        if all(f"{p}.bias" in weights for p in parts):
            bias = np.concatenate([weights[f"{p}.bias"] for p in parts])
            out = self.node("Add", [out, self.weight(f"{module}.bias", bias)], f"{path}/Add")[0]
        branch = module.rsplit(".", 1)[1]
        if branch not in self.lora_branches:
            return out
        return self.lora_delta(x, out, module, branch, layer, matrix.shape)

    def lora_delta(self, x: str, out: str, module: str, branch: str, layer: int, shape: tuple[int, int]) -> str:
        """out + the rows' LoRA deltas: x @ A, masked to each row's slot, @ B (`runtime.lora_slots`)."""
        from onnx import TensorProto, helper

        a_name, b_name = lora.input_names(layer, branch)
        fan_in, fan_out = shape
        parts_carried = len(self.lora_branches[branch])
        width, mask = f"lora_width_{parts_carried}", lora.mask_name(parts_carried)
        self.lora_inputs[a_name] = helper.make_tensor_value_info(a_name, TensorProto.FLOAT, [fan_in, width])
        self.lora_inputs[b_name] = helper.make_tensor_value_info(b_name, TensorProto.FLOAT, [width, fan_out])
        self.lora_inputs[mask] = helper.make_tensor_value_info(mask, TensorProto.BOOL, ["batch", 1, width])
        if not any(i.name == LORA_ZERO for i in self.initializers):
            self.weight(LORA_ZERO, np.zeros((), np.float32))
        path = self.path(module)
        down = self.node("MatMul", [x, a_name], f"{path}/lora/MatMul")[0]
        # Where, not a multiply by the mask: another slot's columns become exact zeros even where a row's own
        # adapter overflowed them to inf or NaN (0 x inf is NaN), so no row's values reach another row
        masked = self.node("Where", [mask, down, LORA_ZERO], f"{path}/lora/Where")[0]
        delta = self.node("MatMul", [masked, b_name], f"{path}/lora/MatMul_1")[0]
        return self.node("Add", [out, delta], f"{path}/lora/Add")[0]

    def head_norm(self, x: str, module: str) -> str:
        """RMSNorm over each head of x [batch, seq, n * head_dim] (Qwen3 and Gemma 3 q_norm / k_norm)."""
        heads_view = self.node("Reshape", [x, "head_shape"], f"{self.path(module)}/Reshape")[0]
        return self.node(
            "Reshape", [self.rms_norm(heads_view, module), "flat_shape"], f"{self.path(module)}/Reshape_1"
        )[0]

    # ------------------------------------------------------------ the model, in order

    def embeddings(self) -> str:
        """The token embeddings of input_ids, and the tables every layer shares (rotary caches, head shapes)."""
        table = self.weights["model.embed_tokens.weight"]
        if self.family.embed_scale:  # scaled once here, not per token (a new array: the read one may map the file)
            table = table * np.float32(self.hidden**0.5)
        embedded = self.weight("model.embed_tokens.weight", table)
        x = self.node("Gather", [embedded, "input_ids"], "/model/embed_tokens/Gather")[0]
        del table
        caches = {"": rotary_cache(self.config)}
        if self.family.local_rope_base:
            caches["local_"] = rotary_cache(self.config, float(getattr(self.config, self.family.local_rope_base)))
        for prefix, (cos, sin) in caches.items():
            self.weight(f"{prefix}cos_cache", cos)
            self.weight(f"{prefix}sin_cache", sin)
        if any(name.endswith(".q_norm.weight") for name in self.weights):
            self.weight("head_shape", np.array([0, 0, -1, self.head_dim]), np.int64)
            self.weight("flat_shape", np.array([0, 0, -1]), np.int64)
        return x

    def decoder_layer(self, i: int, x: str, residual: str | None) -> tuple[str, str]:
        """Layer i on x and the residual stream (None before the first layer): its output and the new stream."""
        prefix = f"model.layers.{i}"
        if residual is None:
            normed, residual = self.rms_norm(x, f"{prefix}.input_layernorm"), x
        else:
            normed, residual = self.skip_norm(x, residual, f"{prefix}.input_layernorm")
        attn_out = self.attention(i, normed)
        if f"{prefix}.post_feedforward_layernorm.weight" in self.weights:  # Gemma: norms after attention and MLP too
            attn_out = self.rms_norm(attn_out, f"{prefix}.post_attention_layernorm")
            normed, residual = self.skip_norm(attn_out, residual, f"{prefix}.pre_feedforward_layernorm")
        else:
            normed, residual = self.skip_norm(attn_out, residual, f"{prefix}.post_attention_layernorm")
        x = self.mlp(i, normed)
        if f"{prefix}.post_feedforward_layernorm.weight" in self.weights:
            x = self.rms_norm(x, f"{prefix}.post_feedforward_layernorm")
        return x, residual

    def attention(self, i: int, normed: str) -> str:
        """Layer i's attention: fused QKV, GroupQueryAttention over the in-place KV cache, o_proj."""
        attn = f"model.layers.{i}.self_attn"
        qkv = self.linear(normed, f"{attn}.qkv_proj", fused_parts(f"{attn}.qkv_proj"), i)
        if f"{attn}.q_norm.weight" in self.weights:
            sizes = np.array([self.heads, self.kv_heads, self.kv_heads]) * self.head_dim
            q, k, v = self.node(
                "Split",
                [qkv, self.weight(f"{attn}.qkv_split", sizes, np.int64)],
                f"{self.path(attn)}/Split",
                outputs=3,
                axis=-1,
            )
            qkv_inputs = [self.head_norm(q, f"{attn}.q_norm"), self.head_norm(k, f"{attn}.k_norm"), v]
        else:
            qkv_inputs = [qkv, "", ""]
        rope = "local_" if self.windows[i] and self.family.local_rope_base else ""
        context, _, _ = self.node(
            "GroupQueryAttention",
            [
                *qkv_inputs,
                f"past_key_values.{i}.key",
                f"past_key_values.{i}.value",
                "seqlens_k",
                "total_sequence_length",
                f"{rope}cos_cache",
                f"{rope}sin_cache",
            ],
            f"{self.path(attn)}/GroupQueryAttention",
            outputs=3,
            domain="com.microsoft",
            num_heads=self.heads,
            kv_num_heads=self.kv_heads,
            do_rotary=1,
            rotary_interleaved=0,
            scale=self.scale,
            local_window_size=self.windows[i] or -1,
        )
        self.nodes[-1].output[1:] = [f"present.{i}.key", f"present.{i}.value"]
        return self.linear(context, f"{attn}.o_proj", [f"{attn}.o_proj"], i)

    def mlp(self, i: int, normed: str) -> str:
        """Layer i's gated MLP: fused gate/up, SiLU or tanh-GELU, down_proj."""
        mlp = f"model.layers.{i}.mlp"
        path = self.path(mlp)
        gate_up = self.linear(normed, f"{mlp}.gate_up_proj", fused_parts(f"{mlp}.gate_up_proj"), i)
        gate, up = self.node("Split", [gate_up], f"{path}/Split", outputs=2, axis=-1, num_outputs=2)
        if self.gelu:
            act = self.node("Gelu", [gate], f"{path}/Gelu", approximate=self.gelu)[0]
        else:
            act = self.node("Mul", [gate, self.node("Sigmoid", [gate], f"{path}/Sigmoid")[0]], f"{path}/SiLU")[0]
        return self.linear(self.node("Mul", [act, up], f"{path}/Mul")[0], f"{mlp}.down_proj", [f"{mlp}.down_proj"], i)

    def logits(self, x: str, residual: str) -> None:
        """The final norm and lm_head at the rows logits_index picks, as the graph's `logits` output."""
        final, _ = self.skip_norm(x, residual, "model.norm")
        shape = self.weight("hidden_shape", np.array([-1, self.hidden]), np.int64)
        flat = self.node("Reshape", [final, shape], "/model/norm/Reshape")[0]
        picked = self.node("Gather", [flat, "logits_index"], "/model/logits_index/Gather", axis=0)[0]
        # tied embeddings: lm_head gets its own copy, quantizable apart
        weights = self.weights
        lm_head = weights["lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"]
        logits = self.node("MatMul", [picked, self.weight("lm_head.weight_t", lm_head.T)], "/lm_head/MatMul")[0]
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:  # Gemma: tanh(logits / cap) * cap
            divided = self.node("Div", [logits, self.weight("final_softcap", np.array(cap))], "/softcap/Div")[0]
            capped = self.node("Tanh", [divided], "/softcap/Tanh")[0]
            self.node("Mul", [capped, "final_softcap"], "/softcap/Mul")
        self.nodes[-1].output[0] = "logits"

    def interface(self) -> tuple[list, list]:
        """The graph's inputs (ids, positions, the rows to score, the KV cache, the LoRA tables) and outputs."""
        from onnx import TensorProto, helper

        cache = ["batch", self.kv_heads, "cache_capacity", self.head_dim]
        inputs = [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
            helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
            helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
            helper.make_tensor_value_info("logits_index", TensorProto.INT64, ["tokens"]),
        ]
        outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["tokens", self.config.vocab_size])]
        for i in range(self.layers):
            for kind in ("key", "value"):
                inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", TensorProto.FLOAT, cache))
                outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", TensorProto.FLOAT, cache))
        return inputs + list(self.lora_inputs.values()), outputs
