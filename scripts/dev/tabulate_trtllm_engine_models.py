"""Tabulate which model families TensorRT-LLM's engine workflow builds and what their checkpoints must hold, and what
ModelOpt's TensorRT-LLM checkpoint exporter does per family (pipeline/upstream/trtllm_engine_models.json).

Maintainer tool, run by scripts/dev/tabulate_all.py. Reads with `ast` (never runs):
- NVIDIA/TensorRT-LLM: `tensorrt_llm/models/__init__.py` MODEL_MAP (HF architecture -> TensorRT-LLM class) of each
  version read, with gemma/config.py's architecture constants it keys on; for the classes the pipeline builds, the
  config class (`config_class = ...`), its `__init__` defaults (attn_bias, mlp_bias: what a config.json without them
  means), which HF config attribute `from_hugging_face` takes a key from (QWenConfig's qwen_type: model_type), the
  decoder layer's Attention / MLP bias arguments and the config attributes it compares with literals (which
  PretrainedConfig only has when config.json names them: unnamed keys become attributes);
- NVIDIA/Model-Optimizer (the files of the installed 0.47.0 are those of the 0.46.0 tag's commit, read there):
  `model_utils.MODEL_NAME_TO_TYPE` (the decoder type ModelOpt gives a model class) and
  `tensorrt_llm_utils.convert_to_tensorrt_llm_config` (the decoder types whose checkpoint config it writes without
  tensorrt_llm installed; the rest raise there).

Which MODEL_MAP stands for which release: the versions read are ordered by content (the oldest lacks Gemma 3, Qwen3
and DeepseekV2; the newer two have them). An entry in every version is taken to hold for every release 0.18-1.2; for
an entry only the newer versions have, the release notes (docs/source/release-notes.md) give the earliest release
whose model-support list adds it (0.18.x is 0.17 plus dependency updates, so it has what the oldest version has).
None of the copies read is at a release's own commit (`pinned` false); several have no known commit (`commit` null).
"""

from __future__ import annotations

import ast
import re

from upstream_source import REPO, UnrecognizedSource, Upstream, cite, dotted_name, find_def

MODELOPT_REPO = "NVIDIA/Model-Optimizer"
MODELOPT_VERSION = "0.47.0"
MODELOPT_COMMIT = "43fd41a58d52c4e6e5dec1d1ff5989ecc737ae1a"  # both files byte-identical to the 0.47.0 wheel's
MODELOPT_NAMES = "modelopt/torch/export/model_utils.py"
MODELOPT_WRITER = "modelopt/torch/export/tensorrt_llm_utils.py"
MODELS_INIT = "tensorrt_llm/models/__init__.py"
# The commits read (None: a copy whose commit is not known); MODEL_MAP versions oldest first.
MODEL_MAP_COMMITS = (None, None, "02267d3d4fd886c3ad036f6580beb0847eac6e4b")
GEMMA_CONSTANTS = ("tensorrt_llm/models/gemma/config.py", None)
CONFIG_CLASSES = (
    ("tensorrt_llm/models/qwen/config.py", "0428c18828880e7c60c13cc5cc0794bbbc05c0a3"),
    ("tensorrt_llm/models/llama/config.py", "04100fd0a70976e86e0ac117f34942d06c21545d"),
)
MODEL_CLASSES = (
    ("tensorrt_llm/models/qwen/model.py", "04a2cacbfd3b9ac76191bd8498ad871607b63a04"),
    ("tensorrt_llm/models/llama/model.py", None),
)
PRETRAINED_CONFIG = ("tensorrt_llm/models/modeling_utils.py", "01ea6d79d454bb3ab10c7510a6f706ba039090c2")
RELEASE_NOTES = ("docs/source/release-notes.md", None)
RELEASE_HEADING = re.compile(r"## TensorRT-LLM Release (\d+\.\d+)\.\d+")
ADDED = re.compile(r"\s*- Added (\w+)\b")


def module_constants(tree: ast.Module) -> dict[str, str]:
    return {
        s.targets[0].id: s.value.value
        for s in tree.body
        if isinstance(s, ast.Assign) and isinstance(s.targets[0], ast.Name) and isinstance(s.value, ast.Constant)
    }


def model_map(tree: ast.Module, constants: dict[str, str]) -> dict[str, str]:
    """MODEL_MAP's entries: architecture name (constants resolved) -> class name."""
    for s in tree.body:
        if isinstance(s, ast.Assign) and [dotted_name(t) for t in s.targets] == ["MODEL_MAP"]:
            return {
                (k.value if isinstance(k, ast.Constant) else constants[k.id]): dotted_name(v)
                for k, v in zip(s.value.keys, s.value.values)
            }
    raise UnrecognizedSource("no MODEL_MAP assignment")


def classes(tree: ast.Module) -> list[ast.ClassDef]:
    return [s for s in tree.body if isinstance(s, ast.ClassDef)]


def method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return find_def(cls.body, name)


def config_class(cls: ast.ClassDef) -> dict:
    """__init__'s keyword defaults, and the keys from_hugging_face takes from an HF config attribute by a plain
    assignment it then passes on (`qwen_type = hf_config.model_type` ... `qwen_type=qwen_type`)."""
    init = method(cls, "__init__")
    defaults = {a.arg: ast.literal_eval(d) for a, d in zip(init.args.kwonlyargs, init.args.kw_defaults) if d}
    derived = {}
    reader = method(cls, "from_hugging_face")
    if reader is not None:
        attributes = {
            s.targets[0].id: dotted_name(s.value).removeprefix("hf_config.")
            for s in reader.body
            if isinstance(s, ast.Assign)
            and isinstance(s.targets[0], ast.Name)
            and (dotted_name(s.value) or "").startswith("hf_config.")
        }
        for call in (n for n in ast.walk(reader) if isinstance(n, ast.Call) and dotted_name(n.func) == "cls"):
            for keyword in call.keywords:
                if isinstance(keyword.value, ast.Name) and keyword.value.id in attributes:
                    derived[keyword.arg] = {"hf_config": attributes[keyword.value.id]}
    return {"init_defaults": defaults, "from_hugging_face": derived}


def bias_argument(node: ast.expr):
    """A bias argument: a literal as itself, `config.X` (or `self.config.X`) as {"config": "X"}."""
    name = dotted_name(node) or ""
    if name.startswith(("config.", "self.config.")):
        return {"config": name.rsplit(".", 1)[1]}
    try:
        return ast.literal_eval(node)
    except ValueError as error:
        raise UnrecognizedSource("a bias argument that is neither a literal nor a config attribute") from error


def decoder_layer(cls: ast.ClassDef) -> dict:
    """The bias arguments of the layer's Attention and MLP, and the config attributes it compares to literals."""
    init = method(cls, "__init__")
    calls = {}
    for node in ast.walk(init):
        if isinstance(node, ast.Call) and dotted_name(node.func) in ("Attention", "ClsMLP"):
            calls[dotted_name(node.func)] = {
                k.arg: bias_argument(k.value) for k in node.keywords if k.arg and k.arg.endswith("bias")
            }
    selectors: dict[str, set] = {}
    for node in ast.walk(init):
        if (
            isinstance(node, ast.Compare)
            and isinstance(node.ops[0], ast.Eq)
            and isinstance(node.comparators[0], ast.Constant)
        ):
            left = dotted_name(node.left) or ""
            if left.startswith(("config.", "self.config.")):
                selectors.setdefault(left.rsplit(".", 1)[1], set()).add(node.comparators[0].value)
    return {
        "attention": calls["Attention"],
        "mlp": calls["ClsMLP"],
        "compares": {k: sorted(v) for k, v in sorted(selectors.items())},
    }


def sets_unnamed_keys(tree: ast.Module) -> bool:
    """Whether PretrainedConfig.__init__ sets every keyword it does not name as an attribute of itself (a loop over
    kwargs.items() calling setattr on self)."""
    init = method(next(c for c in classes(tree) if c.name == "PretrainedConfig"), "__init__")
    return any(
        isinstance(loop, ast.For)
        and isinstance(loop.iter, ast.Call)
        and dotted_name(loop.iter.func) == "kwargs.items"
        and any(
            isinstance(n, ast.Call) and dotted_name(n.func) == "setattr" and dotted_name(n.args[0]) == "self"
            for n in ast.walk(loop)
        )
        for loop in ast.walk(init)
    )


def added_in_release(notes: str, oldest: dict[str, str], newest: dict[str, str]) -> dict[str, str]:
    """{architecture: release} for each architecture the oldest MODEL_MAP lacks and the newest has: the earliest
    release whose notes add "<name without ForCausalLM>"."""
    new = [a for a in newest if a not in oldest]
    found, release = {}, None
    for line in notes.splitlines():
        heading = RELEASE_HEADING.match(line)
        if heading:
            release = heading.group(1)
            continue
        added = ADDED.match(line)
        for arch in new:
            if added and added.group(1) == arch.removesuffix("ForCausalLM"):
                if arch not in found or release_key(release) < release_key(found[arch]):
                    found[arch] = release
    return found


def release_key(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.split("."))


def modelopt_facts(names_source: str, writer_source: str) -> dict:
    """ModelOpt's decoder type per model-class name, in its order (get_model_type takes the first name contained in
    the class name), and the decoder types its TensorRT-LLM config writer takes."""
    name_to_type = next(
        ast.literal_eval(s.value)
        for s in ast.parse(names_source).body
        if isinstance(s, ast.Assign) and [dotted_name(t) for t in s.targets] == ["MODEL_NAME_TO_TYPE"]
    )
    writer = find_def(ast.parse(writer_source).body, "convert_to_tensorrt_llm_config")
    chain = next(
        n
        for n in ast.walk(writer)
        if isinstance(n, ast.If) and isinstance(n.test, ast.Compare) and dotted_name(n.test.left) == "decoder_type"
    )
    taken, also_when, otherwise = [], [], None
    while chain is not None:
        test = chain.test
        if isinstance(test, ast.Compare) and dotted_name(test.left) == "decoder_type":
            right = test.comparators[0]
            taken += ast.literal_eval(right) if isinstance(right, ast.List) else [right.value]
        elif dotted_name(test):
            also_when.append(dotted_name(test))
        else:
            raise UnrecognizedSource("a branch of the config writer on neither decoder_type nor a flag")
        tail = chain.orelse
        chain = tail[0] if len(tail) == 1 and isinstance(tail[0], ast.If) else None
        if chain is None and tail and isinstance(tail[0], ast.Raise):
            otherwise = dotted_name(tail[0].exc.func)
    return {
        "version": MODELOPT_VERSION,
        "model_name_to_type": list(name_to_type.items()),
        "config_writer_decoder_types": taken,
        "config_writer_also_when": also_when,
        "config_writer_otherwise_raises": otherwise,
        "sources": [
            cite(MODELOPT_REPO, MODELOPT_NAMES, MODELOPT_COMMIT, pinned=False),
            cite(MODELOPT_REPO, MODELOPT_WRITER, MODELOPT_COMMIT, pinned=False),
        ],
    }


def tabulate(upstream: Upstream) -> dict:
    def read(path: str, commit: str | None) -> tuple[dict, ast.Module]:
        return cite(REPO, path, commit, pinned=False), ast.parse(upstream.read(REPO, path, commit))

    constants = module_constants(read(*GEMMA_CONSTANTS)[1])
    maps = []
    for commit in MODEL_MAP_COMMITS:
        source, tree = read(MODELS_INIT, commit)
        maps.append({"source": source, "classes": model_map(tree, constants)})
    configs, models, layers = {}, {}, {}
    for path, commit in CONFIG_CLASSES:
        source, tree = read(path, commit)
        for cls in classes(tree):
            configs[cls.name] = {"source": source, **config_class(cls)}
    for path, commit in MODEL_CLASSES:
        source, tree = read(path, commit)
        layer = next(c for c in classes(tree) if c.name.endswith("DecoderLayer"))
        for cls in classes(tree):
            for s in cls.body:
                if isinstance(s, ast.Assign) and [dotted_name(t) for t in s.targets] == ["config_class"]:
                    models[cls.name] = {"config_class": s.value.id, "decoder_layer": layer.name, "source": source}
        layers[layer.name] = {"source": source, **decoder_layer(layer)}
    kwargs_source, kwargs_tree = read(*PRETRAINED_CONFIG)
    notes_source = cite(REPO, *RELEASE_NOTES, pinned=False)
    added = added_in_release(upstream.read(REPO, *RELEASE_NOTES), maps[0]["classes"], maps[-1]["classes"])
    modelopt = modelopt_facts(
        upstream.read(MODELOPT_REPO, MODELOPT_NAMES, MODELOPT_COMMIT),
        upstream.read(MODELOPT_REPO, MODELOPT_WRITER, MODELOPT_COMMIT),
    )
    return {
        "added_in_release": {arch: {"release": release, "source": notes_source} for arch, release in added.items()},
        "config_classes": configs,
        "decoder_layers": layers,
        "model_classes": models,
        "model_map": maps,
        "modelopt": modelopt,
        "pretrained_config": {
            "source": kwargs_source,
            "unnamed_keys_become_attributes": sets_unnamed_keys(kwargs_tree),
        },
    }
