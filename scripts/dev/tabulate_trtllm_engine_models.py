"""Tabulate which model families TensorRT-LLM's engine workflow builds and what their checkpoints must hold, and
what ModelOpt's TensorRT-LLM checkpoint exporter does per family, as JSON facts.

Maintainer tool, not run by the pipeline. Reads with `ast` (never runs):
- verbatim excerpts of NVIDIA/TensorRT-LLM (tests/fixtures/upstream/, each headed with its path and commit or
  index id; cached the same way under /work/upstream-cache/NVIDIA+TensorRT-LLM/<commit or index-id-N>/):
  `tensorrt_llm/models/__init__.py` MODEL_MAP (HF architecture -> TensorRT-LLM class) of every stored version,
  with gemma/config.py's architecture constants it keys on; for the classes the pipeline builds, the config class
  (`config_class = ...`), its `__init__` defaults (attn_bias, mlp_bias: what a config.json without them means),
  what `from_hugging_face` derives a key from (QWenConfig: `qwen_type = hf_config.model_type`), the decoder
  layer's Attention / MLP bias arguments and the config attributes it branches on (`config.qwen_type == ...`,
  which PretrainedConfig only has when config.json names them: unnamed keys become attributes by setattr);
- the installed ModelOpt's export sources: `model_utils.MODEL_NAME_TO_TYPE` (the decoder type ModelOpt gives a
  model class) and `tensorrt_llm_utils.convert_to_tensorrt_llm_config` (the decoder types whose checkpoint config
  it writes without tensorrt_llm installed; the rest raise NotImplementedError there).

Which stored version stands for which release: the index does not store the release commits (the tensorrtllm_backend
mirror's tensorrt_llm submodule pointers, v0.18.2 5aec7af4, v0.19.0 c6f7d423, v1.0.0 ae8270b7: "stored, but not at
that commit"). MODEL_MAP is ordered by content: 2489028756 (no Gemma 3, Qwen3, DeepseekV2) < 820782731 and 02267d3d
(Gemma 3 and Qwen3 added). An entry present in every stored version is taken to hold for every release 0.18-1.2; for
an entry only the newer versions have, the release notes (docs/source/release-notes.md, excerpt) name the release that
added it ("Added Gemma3 text-only model support" in 0.19, "Added Qwen3 support" in 0.20; 0.18.x is 0.17 plus
dependency updates). Usage:
    python scripts/dev/tabulate_trtllm_engine_models.py tests/fixtures/upstream \
        /work/main/.venv/lib/python3.11/site-packages/modelopt pipeline/trtllm_engine_models.json
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

REPO = "NVIDIA/TensorRT-LLM"
MODEL_MAPS = (
    "models_init_2489028756_model_map.py.txt",
    "models_init_820782731_model_map.py.txt",
    "models_init_02267d3d_model_map.py.txt",
)
GEMMA_CONSTANTS = "gemma_config_397088162_architectures.py.txt"
CONFIG_CLASSES = ("qwen_config_0428c188_config.py.txt", "llama_config_04100fd0_config.py.txt")
MODEL_CLASSES = ("qwen_model_04a2cacb_decoder_layer.py.txt", "llama_model_663997685_decoder_layer.py.txt")
CONFIG_KWARGS = "modeling_utils_01ea6d79_config_kwargs.py.txt"
RELEASE_NOTES = "release_notes_683127886_model_support.md.txt"
RELEASE_HEADING = re.compile(r"## TensorRT-LLM Release (\d+\.\d+)\.\d+")
ADDED = re.compile(r"\s*- Added (\w+)\b")
HEADER = re.compile(
    r"# Excerpt of (\S+/\S+) (\S+) at "
    r"(?:commit (\w+) \(index id (\d+)\)|the version the search index stores as id (\d+))"
)


def read_excerpt(path: Path) -> tuple[dict, ast.Module]:
    """The source record named by an excerpt's first header line, and the excerpt parsed."""
    lines = path.read_text().splitlines()
    match = HEADER.match(lines[0])
    if match is None:
        raise ValueError(f"{path}: first line does not name the repository, path and commit or index id")
    repo, file, commit, commit_id, bare_id = match.groups()
    source = {"repo": repo, "path": file, "commit": commit, "index_id": commit_id or bare_id, "excerpt": path.name}
    return source, ast.parse("\n".join(lines[3:]))


def module_constants(tree: ast.Module) -> dict[str, str]:
    return {
        s.targets[0].id: s.value.value
        for s in tree.body
        if isinstance(s, ast.Assign) and isinstance(s.targets[0], ast.Name) and isinstance(s.value, ast.Constant)
    }


def model_map(tree: ast.Module, constants: dict[str, str]) -> dict[str, str]:
    """MODEL_MAP's entries: architecture name (constants resolved) -> class name."""
    for s in tree.body:
        if isinstance(s, ast.Assign) and [ast.unparse(t) for t in s.targets] == ["MODEL_MAP"]:
            return {
                (k.value if isinstance(k, ast.Constant) else constants[k.id]): ast.unparse(v)
                for k, v in zip(s.value.keys, s.value.values)
            }
    raise ValueError("no MODEL_MAP assignment")


def find_class(tree: ast.Module, name: str | None = None) -> list[ast.ClassDef]:
    return [s for s in tree.body if isinstance(s, ast.ClassDef) and (name is None or s.name == name)]


def method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(s for s in cls.body if isinstance(s, ast.FunctionDef) and s.name == name)


def config_class(cls: ast.ClassDef) -> dict:
    """__init__'s keyword defaults, and the keys from_hugging_face derives from the HF config by a plain
    assignment it then passes on (`qwen_type = hf_config.model_type` ... `qwen_type=qwen_type`)."""
    init = method(cls, "__init__")
    defaults = {a.arg: ast.literal_eval(d) for a, d in zip(init.args.kwonlyargs, init.args.kw_defaults) if d}
    derived = {}
    reader = next((s for s in cls.body if isinstance(s, ast.FunctionDef) and s.name == "from_hugging_face"), None)
    if reader is not None:
        assigned = {
            s.targets[0].id: ast.unparse(s.value)
            for s in reader.body
            if isinstance(s, ast.Assign) and isinstance(s.targets[0], ast.Name)
        }
        for call in (n for n in ast.walk(reader) if isinstance(n, ast.Call) and ast.unparse(n.func) == "cls"):
            for keyword in call.keywords:
                if isinstance(keyword.value, ast.Name) and keyword.value.id in assigned:
                    derived[keyword.arg] = assigned[keyword.value.id]
    return {"init_defaults": defaults, "from_hugging_face": derived}


def decoder_layer(cls: ast.ClassDef) -> dict:
    """The bias arguments of the layer's Attention and MLP, and the config attributes it compares to literals."""
    init = method(cls, "__init__")
    calls = {}
    for node in ast.walk(init):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("Attention", "ClsMLP"):
            calls[ast.unparse(node.func)] = {
                k.arg: ast.unparse(k.value) for k in node.keywords if k.arg and k.arg.endswith("bias")
            }
    selectors: dict[str, set] = {}
    for node in ast.walk(init):
        if (
            isinstance(node, ast.Compare)
            and isinstance(node.ops[0], ast.Eq)
            and isinstance(node.comparators[0], ast.Constant)
        ):
            left = ast.unparse(node.left)
            if left.startswith(("config.", "self.config.")):
                selectors.setdefault(left.rsplit(".", 1)[1], set()).add(node.comparators[0].value)
    return {
        "attention": calls["Attention"],
        "mlp": calls["ClsMLP"],
        "compares": {k: sorted(v) for k, v in sorted(selectors.items())},
    }


def engine_facts(fixtures: Path) -> dict:
    constants = module_constants(read_excerpt(fixtures / GEMMA_CONSTANTS)[1])
    maps = []
    for name in MODEL_MAPS:
        source, tree = read_excerpt(fixtures / name)
        maps.append({"source": source, "classes": model_map(tree, constants)})
    configs, models, layers = {}, {}, {}
    for name in CONFIG_CLASSES:
        source, tree = read_excerpt(fixtures / name)
        for cls in find_class(tree):
            configs[cls.name] = {"source": source, **config_class(cls)}
    for name in MODEL_CLASSES:
        source, tree = read_excerpt(fixtures / name)
        classes = find_class(tree)
        layer = next(c for c in classes if c.name.endswith("DecoderLayer"))
        for cls in classes:
            for s in cls.body:
                if isinstance(s, ast.Assign) and [ast.unparse(t) for t in s.targets] == ["config_class"]:
                    models[cls.name] = {"config_class": s.value.id, "decoder_layer": layer.name, "source": source}
        layers[layer.name] = {"source": source, **decoder_layer(layer)}
    kwargs_source, kwargs_tree = read_excerpt(fixtures / CONFIG_KWARGS)
    init = method(find_class(kwargs_tree, "PretrainedConfig")[0], "__init__")
    sets_unnamed = any(
        isinstance(n, ast.For)
        and ast.unparse(n.iter) == "kwargs.items()"
        and "setattr(self, key, value)" in ast.unparse(n)
        for n in ast.walk(init)
    )
    return {
        "added_in_release": added_in_release(fixtures / RELEASE_NOTES, maps),
        "model_map": maps,
        "model_classes": models,
        "config_classes": configs,
        "decoder_layers": layers,
        "pretrained_config": {"unnamed_keys_become_attributes": sets_unnamed, "source": kwargs_source},
    }


def added_in_release(notes: Path, maps: list[dict]) -> dict[str, dict]:
    """For each architecture the oldest stored MODEL_MAP lacks and the newest has: the earliest release whose notes
    say "Added <name without ForCausalLM>" (0.18.x is 0.17 plus dependency updates, so it has what the oldest
    stored version has)."""
    new = [a for a in maps[-1]["classes"] if a not in maps[0]["classes"]]
    found, release = {}, None
    lines = notes.read_text().splitlines()
    for line in lines[3:]:
        heading = RELEASE_HEADING.match(line)
        if heading:
            release = heading.group(1)
            continue
        added = ADDED.match(line)
        for arch in new:
            if added and added.group(1) == arch.removesuffix("ForCausalLM"):
                if arch not in found or _key(release) < _key(found[arch]["release"]):
                    found[arch] = {"release": release, "line": line.strip()}
    source = re.match(r"# Excerpt of (\S+/\S+) (\S+)", lines[0]).groups()
    return {
        arch: entry | {"source": {"repo": source[0], "path": source[1], "index_id": "683127886"}}
        for arch, entry in found.items()
    }


def _key(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.split("."))


# ---------------------------------------------------------------- ModelOpt


def modelopt_facts(package: Path) -> dict:
    """ModelOpt's decoder type per model-class name, in its order (get_model_type takes the first name contained in
    the class name), and the decoder types its TensorRT-LLM config writer takes."""
    export = package / "torch" / "export"
    utils = ast.parse((export / "model_utils.py").read_text())
    name_to_type = next(
        ast.literal_eval(s.value)
        for s in utils.body
        if isinstance(s, ast.Assign) and [ast.unparse(t) for t in s.targets] == ["MODEL_NAME_TO_TYPE"]
    )
    writer = next(
        s
        for s in ast.parse((export / "tensorrt_llm_utils.py").read_text()).body
        if isinstance(s, ast.FunctionDef) and s.name == "convert_to_tensorrt_llm_config"
    )
    chain = next(
        n for n in ast.walk(writer) if isinstance(n, ast.If) and ast.unparse(n.test).startswith("decoder_type in")
    )
    taken, otherwise = [], None
    while chain is not None:
        test = chain.test
        if isinstance(test, ast.Compare) and ast.unparse(test.left) == "decoder_type":
            right = test.comparators[0]
            taken += ast.literal_eval(right) if isinstance(right, ast.List) else [right.value]
        else:
            taken.append(f"<{ast.unparse(test)}>")
        tail = chain.orelse
        chain = tail[0] if len(tail) == 1 and isinstance(tail[0], ast.If) else None
        if chain is None and tail and isinstance(tail[0], ast.Raise):
            otherwise = ast.unparse(tail[0].exc.func)
    dist = sorted(package.parent.glob("nvidia_modelopt-*.dist-info"))
    return {
        "version": dist[0].name.removeprefix("nvidia_modelopt-").removesuffix(".dist-info") if dist else None,
        "model_name_to_type": list(name_to_type.items()),
        "config_writer_decoder_types": taken,
        "config_writer_otherwise_raises": otherwise,
        "sources": ["modelopt/torch/export/model_utils.py", "modelopt/torch/export/tensorrt_llm_utils.py"],
    }


def main(fixtures: str, modelopt: str, out: str) -> None:
    facts = engine_facts(Path(fixtures)) | {"modelopt": modelopt_facts(Path(modelopt))}
    Path(out).write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
