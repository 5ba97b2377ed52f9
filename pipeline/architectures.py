"""The model families the pipeline builds: one registered entry per Hugging Face `architectures` name.

llama.cpp's converter registry is the model (`ModelBase.register("Qwen2ForCausalLM")`): an architecture is
supported when an entry says so, and the entry says what sets the family apart. Which architectures a build
can take is each target's answer (`Target.architecture_support`): the ONNX graph the CPU target builds, the
classes the targeted TensorRT-LLM release registers for its backend. `validate` names the architecture, the
target and the supported list for anything else.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import PipelineError


@dataclass(frozen=True)
class Architecture:
    name: str  # Hugging Face config.json architectures[0]
    family: str  # short name, used in tables and messages
    model_type: str  # config.json model_type
    gguf: tuple[str, ...]  # GGUF general.architecture values that import as this architecture
    traits: str  # what sets the family apart from Llama, for `trtllm-pipeline architectures` and docs/architectures.md


ARCHITECTURES: dict[str, Architecture] = {}


def register_architecture(arch: Architecture) -> Architecture:
    if arch.name in ARCHITECTURES:
        raise ValueError(f"architecture {arch.name} registered twice")
    ARCHITECTURES[arch.name] = arch
    return arch


for _arch in (
    Architecture("LlamaForCausalLM", "Llama", "llama", ("llama",), "the reference layout; Llama 3.x rope scaling"),
    Architecture("Qwen2ForCausalLM", "Qwen2/2.5", "qwen2", ("qwen2",), "q/k/v projection biases"),
    Architecture("Qwen3ForCausalLM", "Qwen3", "qwen3", ("qwen3",), "per-head q/k RMSNorm; head_dim 128"),
    Architecture("MistralForCausalLM", "Mistral", "mistral", (), "sliding-window attention"),
    Architecture(
        "Gemma3ForCausalLM",
        "Gemma 3",
        "gemma3_text",
        ("gemma3",),
        "scaled embeddings, (1 + w) RMSNorm before and after attention and MLP, q/k norm, GELU-tanh, "
        "sliding/global layers with their own RoPE bases, head_dim 256, optional logit soft-capping",
    ),
    Architecture(
        "Phi3ForCausalLM", "Phi-3/Phi-4-mini", "phi3", ("phi3",), "fused qkv_proj and gate_up_proj; partial rotary"
    ),
):
    register_architecture(_arch)
del _arch

# GGUF general.architecture -> HF architecture (llama.cpp writes Mistral checkpoints as "llama").
GGUF_ARCHITECTURES = {gguf: arch.name for arch in ARCHITECTURES.values() for gguf in arch.gguf}


def architecture(name: str) -> Architecture:
    """The registered entry for an HF architecture name.

    Raises:
        PipelineError: naming the architecture and the registered ones.
    """
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise PipelineError(f"architecture {name} is not supported (supported: {', '.join(ARCHITECTURES)})") from None


def support_problem(name: str, target: str, support: dict[str, str | None]) -> str | None:
    """The `validate` message for an architecture a target's build cannot take, None when it can.

    `support` is the target's answer for this config: architecture -> None (supported) or why not."""
    supported = [arch for arch, why_not in support.items() if why_not is None]
    if name not in ARCHITECTURES:
        return f"architecture {name} is not supported (supported on target {target}: {', '.join(supported)})"
    why_not = support.get(name, "no adapter for it")
    if why_not is None:
        return None
    return (
        f"architecture {name} is not supported on target {target}: {why_not} (supported there: {', '.join(supported)})"
    )
