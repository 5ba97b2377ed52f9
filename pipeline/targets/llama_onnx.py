"""A fused ONNX Runtime graph for Llama-family checkpoints, built from the safetensors directly.

Written by hand because no exporter usable here emits it: optimum-onnx exports ~40 unfused ops per
layer (the CPU decode is call-overhead bound), and onnxruntime-genai's builder, which emits this kind
of graph, needs transformers 5 (this environment pins 4.57 for optimum, ModelOpt and the GGUF import).

Per layer: SkipSimplifiedLayerNormalization, one fused QKV MatMul, GroupQueryAttention (rotary inside,
KV cache updated in place in a caller-owned buffer), o_proj, a fused gate/up MatMul, SiLU, down_proj.
Every linear is a plain MatMul on a constant weight, so the engine stage quantizes it like any export.

Interface (see `pipeline.runtime.model_runner.SharedCache`, the runner side):
  input_ids              int64 [batch, seq]          new tokens, right-padded
  seqlens_k              int32 [batch]               per row: tokens in the cache after this step - 1
  total_sequence_length  int32 []                    max over rows of seqlens_k + 1
  logits_index           int64 [n]                   flat indices into batch*seq whose logits to return
  past_key_values.{i}.key/value  float [batch, kv_heads, capacity, head_dim]
  -> logits float [n, vocab], present.{i}.key/value (the same buffers when bound to them)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pipeline.errors import BuildStepError
from pipeline.models import ModelFacts

ARCHITECTURES = ("LlamaForCausalLM",)
OPSET = 23  # RMSNormalization


def supports(hf_dir: Path) -> str | None:
    """None when the checkpoint can be built as a fused graph, else why not."""
    config = json.loads((hf_dir / "config.json").read_text())
    architectures = config.get("architectures") or []
    if not set(architectures) & set(ARCHITECTURES):
        return f"architecture {architectures} is not one of {list(ARCHITECTURES)}"
    head_dim = ModelFacts.from_hf_config(config).head_size
    if head_dim % 16:
        return f"head_dim {head_dim} is not a multiple of 16 (GroupQueryAttention on CPU needs it)"
    if config.get("hidden_act", "silu") != "silu":
        return f"hidden_act {config['hidden_act']!r} is not silu"
    return None


def rotary_cache(hf_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [max_position, head_dim/2], with transformers' own rope-scaling variants."""
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(hf_dir)
    rope_type = (getattr(config, "rope_scaling", None) or {}).get("rope_type", "default")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    angles = np.outer(np.arange(config.max_position_embeddings, dtype=np.float64), inv_freq.double().numpy())
    return (np.cos(angles) * scaling).astype(np.float32), (np.sin(angles) * scaling).astype(np.float32)


def build(hf_dir: Path, out_path: Path) -> dict:
    """Write the fused graph for the checkpoint in hf_dir to out_path (weights in out_path + '.data')."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from safetensors.torch import load_file  # torch: reads bf16/fp16 checkpoints too (numpy has no bfloat16)

    why_not = supports(hf_dir)
    if why_not:
        raise BuildStepError(f"{hf_dir}: cannot build the fused graph: {why_not}; set target.onnx_graph: optimum")
    config = json.loads((hf_dir / "config.json").read_text())
    weights: dict[str, np.ndarray] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        weights.update({name: tensor.float().numpy() for name, tensor in load_file(file).items()})  # the graph is fp32
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    eps = float(config.get("rms_norm_eps", 1e-6))

    nodes, initializers = [], []

    def weight(name: str, array: np.ndarray, dtype=np.float32) -> str:
        initializers.append(numpy_helper.from_array(np.ascontiguousarray(array, dtype=dtype), name))
        return name

    def node(op: str, inputs: list[str], name: str, outputs: int = 1, domain: str = "", **attrs) -> list[str]:
        names = [f"{name}/output_{i}" for i in range(outputs)]
        nodes.append(helper.make_node(op, inputs, names, name=name, domain=domain, **attrs))
        return names

    def linear(x: str, module: str, parts: list[str]) -> str:
        """x @ W for the HF modules `parts` concatenated along the output axis (+ bias when they have one)."""
        matrix = np.concatenate([weights[f"{p}.weight"] for p in parts], axis=0).T  # HF stores [out, in]
        out = node("MatMul", [x, weight(f"{module}.weight_t", matrix)], f"/{module.replace('.', '/')}/MatMul")[0]
        if all(f"{p}.bias" in weights for p in parts):
            bias = np.concatenate([weights[f"{p}.bias"] for p in parts])
            out = node("Add", [out, weight(f"{module}.bias", bias)], f"/{module.replace('.', '/')}/Add")[0]
        return out

    embed = weights["model.embed_tokens.weight"]
    x = node("Gather", [weight("model.embed_tokens.weight", embed), "input_ids"], "/model/embed_tokens/Gather")[0]
    cos, sin = rotary_cache(hf_dir)
    weight("cos_cache", cos)
    weight("sin_cache", sin)
    residual = None
    for i in range(layers):
        prefix = f"model.layers.{i}"
        norm_w = weight(f"{prefix}.input_layernorm.weight", weights[f"{prefix}.input_layernorm.weight"])
        if residual is None:
            normed = node("RMSNormalization", [x, norm_w], f"/{prefix}/input_layernorm", axis=-1, epsilon=eps)[0]
            residual = x
        else:
            normed, _, _, residual = node(
                "SkipSimplifiedLayerNormalization",
                [x, residual, norm_w],
                f"/{prefix}/input_layernorm",
                outputs=4,
                domain="com.microsoft",
                epsilon=eps,
            )
        attn = f"{prefix}.self_attn"
        qkv = linear(normed, f"{attn}.qkv_proj", [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"])
        context, present_k, present_v = node(
            "GroupQueryAttention",
            [
                qkv,
                "",
                "",
                f"past_key_values.{i}.key",
                f"past_key_values.{i}.value",
                "seqlens_k",
                "total_sequence_length",
                "cos_cache",
                "sin_cache",
            ],
            f"/{prefix}/self_attn/GroupQueryAttention",
            outputs=3,
            domain="com.microsoft",
            num_heads=heads,
            kv_num_heads=kv_heads,
            do_rotary=1,
            rotary_interleaved=0,
            scale=float(head_dim) ** -0.5,
        )
        nodes[-1].output[1:] = [f"present.{i}.key", f"present.{i}.value"]
        attn_out = linear(context, f"{attn}.o_proj", [f"{attn}.o_proj"])
        post_w = weight(
            f"{prefix}.post_attention_layernorm.weight", weights[f"{prefix}.post_attention_layernorm.weight"]
        )
        normed, _, _, residual = node(
            "SkipSimplifiedLayerNormalization",
            [attn_out, residual, post_w],
            f"/{prefix}/post_attention_layernorm",
            outputs=4,
            domain="com.microsoft",
            epsilon=eps,
        )
        mlp = f"{prefix}.mlp"
        gate_up = linear(normed, f"{mlp}.gate_up_proj", [f"{mlp}.gate_proj", f"{mlp}.up_proj"])
        gate, up = node("Split", [gate_up], f"/{mlp.replace('.', '/')}/Split", outputs=2, axis=-1, num_outputs=2)
        silu = node(
            "Mul",
            [gate, node("Sigmoid", [gate], f"/{mlp.replace('.', '/')}/Sigmoid")[0]],
            f"/{mlp.replace('.', '/')}/SiLU",
        )[0]
        x = linear(
            node("Mul", [silu, up], f"/{mlp.replace('.', '/')}/Mul")[0], f"{mlp}.down_proj", [f"{mlp}.down_proj"]
        )
    final_w = weight("model.norm.weight", weights["model.norm.weight"])
    final, _, _, _ = node(
        "SkipSimplifiedLayerNormalization",
        [x, residual, final_w],
        "/model/norm",
        outputs=4,
        domain="com.microsoft",
        epsilon=eps,
    )
    flat = node("Reshape", [final, weight("hidden_shape", np.array([-1, hidden]), np.int64)], "/model/norm/Reshape")[0]
    picked = node("Gather", [flat, "logits_index"], "/model/logits_index/Gather", axis=0)[0]
    lm_head = weights.get("lm_head.weight", embed)  # tied embeddings: lm_head gets its own copy, quantizable apart
    node("MatMul", [picked, weight("lm_head.weight_t", lm_head.T)], "/lm_head/MatMul")
    nodes[-1].output[0] = "logits"

    cache = ["batch", kv_heads, "cache_capacity", head_dim]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
        helper.make_tensor_value_info("logits_index", TensorProto.INT64, ["tokens"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["tokens", config["vocab_size"]])]
    for i in range(layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", TensorProto.FLOAT, cache))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", TensorProto.FLOAT, cache))
    graph = helper.make_graph(nodes, "llama_gqa", inputs, outputs, initializers)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)],
        producer_name="trtllm-pipeline",
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(
        model,
        str(out_path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=out_path.name + ".data",
        size_threshold=1024,
    )
    return {"graph": "fused_gqa", "layers": layers, "opset": OPSET, "nodes": len(nodes)}
