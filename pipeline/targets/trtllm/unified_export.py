"""The unified HF checkpoint written for TensorRT-LLM's PyTorch backend: ModelOpt's export of the calibrated model in
its dtype, then the repairs that make it load (`torch_checkpoint` checks it against what the loader reads)."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.safetensors_files import tensor_headers
from pipeline.targets.trtllm.torch_checkpoint import MODELS, VANILLA


def export_unified(model, dtype, unified_dir: Path) -> list[str]:
    """ModelOpt's unified HF checkpoint of the calibrated `model` in `dtype` (a torch dtype); returns what the
    repairs added: identity pre_quant_scale tensors (int4 round-to-nearest, repair_pre_quant_scale) and
    `config.json:<key>` entries (repair_config).

    export_hf_checkpoint's dtype only casts the weights it quantizes: everything else (norms, embeddings, lm_head,
    pre_quant_scale) and config.json's dtype are saved as the model holds them, float32 after the CPU calibration.
    So the model is cast first. This mutates `model` (as export_hf_checkpoint itself does): call it after the
    TensorRT-LLM checkpoint export."""
    from modelopt.torch.export import export_hf_checkpoint

    model.to(dtype)
    export_hf_checkpoint(model, dtype, unified_dir)
    return repair_pre_quant_scale(unified_dir) + repair_config(unified_dir)


def period(layer_types: list[str]) -> int | None:
    """The N of `bool((i + 1) % N)` (sliding unless every N-th layer) that reproduces `layer_types`, if any."""
    return next(
        (
            n
            for n in range(2, len(layer_types) + 2)
            if all((kind == "sliding_attention") == bool((i + 1) % n) for i, kind in enumerate(layer_types))
        ),
        None,
    )


def repair_config(unified_dir: Path) -> list[str]:
    """Write the config.json keys a tabulated release's model reads without a fallback (upstream/trtllm_torch_models
    config_required) that config.json lacks, from what the checkpoint itself says: attention_bias (Phi-3's attention
    reads it; whether q/k/v biases are present) and sliding_window_pattern (Gemma 3 before 1.2 reads it; the period
    of layer_types). Whether this process's transformers would default a key does not matter: the release's own
    transformers parses the file (4.56 answers sliding_window_pattern from layer_types, while 1.0's 4.53.1 has the
    attribute only where config.json holds it). Returns `config.json:<key>` per key written.

    Also `torch_dtype` beside the `dtype` transformers 4.56+ writes: the containers' older transformers read only
    `torch_dtype`, and the PyTorch backend's model dtype is the pretrained config's `torch_dtype`, bfloat16 where
    that is None (ModelConfig.torch_dtype per release: upstream/trtllm_dtype.json `pytorch`): without it a float16
    checkpoint would run in bfloat16."""
    file = unified_dir / "config.json"
    config = json.loads(file.read_text())
    arch = (config.get("architectures") or [""])[0]
    required = {key for r in MODELS.values() if (m := r["architectures"].get(arch)) for key in m["config_required"]}
    absent = required - set(config)
    added = {}
    if "attention_bias" in absent:
        added["attention_bias"] = any(n.endswith(("q_proj.bias", "qkv_proj.bias")) for n in tensor_headers(unified_dir))
    if "sliding_window_pattern" in absent and config.get("layer_types") and period(config["layer_types"]):
        added["sliding_window_pattern"] = period(config["layer_types"])
    if "torch_dtype" not in config and config.get("dtype"):
        added["torch_dtype"] = config["dtype"]
    if added:
        file.write_text(json.dumps(config | added, indent=2, sort_keys=True) + "\n")
    return [f"config.json:{key}" for key in added]


def repair_pre_quant_scale(unified_dir: Path) -> list[str]:
    """Write the identity pre_quant_scale (ones, in the model dtype of config.json, which W4A8_AWQ_LinearMethod
    asserts) that ModelOpt leaves out for int4 round-to-nearest on the linears the W4A16_AWQ loader reads it from;
    returns the tensors written. export_checkpoints calls it on `hf_unified/` right after export_hf_checkpoint."""
    import torch
    from safetensors.torch import load_file, save_file

    quant_file = unified_dir / "hf_quant_config.json"
    if not quant_file.is_file():
        return []
    quant = json.loads(quant_file.read_text()).get("quantization", {})
    if quant.get("quant_algo") not in ("W4A16_AWQ", "W4A8_AWQ"):
        return []
    config = json.loads((unified_dir / "config.json").read_text())
    dtype = getattr(torch, config.get("torch_dtype") or config.get("dtype") or "float16")
    written = []
    for file in sorted(unified_dir.glob("*.safetensors")):
        tensors = load_file(file)
        for name in list(tensors):
            prefix = name.removesuffix(".weight_scale")
            if (
                name.endswith(".weight_scale")
                and prefix.rsplit(".", 1)[-1] in VANILLA
                and f"{prefix}.pre_quant_scale" not in tensors
            ):
                packed = tensors[f"{prefix}.weight"]
                tensors[f"{prefix}.pre_quant_scale"] = torch.ones(packed.shape[1], dtype=dtype)
                written.append(f"{prefix}.pre_quant_scale")
        if written:
            save_file(tensors, file, metadata={"format": "pt"})
    return written
