"""Tabulate, per TensorRT-LLM release, the dtype a model runs in when nothing asks for another (`dtype: auto`),
from copies of its source (pipeline/upstream/trtllm_dtype.json; pipeline/targets/trtllm/dtypes.py is tested
against it).

Maintainer tool, run by scripts/dev/tabulate_all.py. Reads with `ast`, and runs only single defs compiled from it:

- `engine` (0.21-1.2, the engine workflow): tensorrt_llm/models/convert_utils.py `infer_dtype`, run for `auto` with
  each HF `torch_dtype` as transformers gives it (a torch dtype, or None when config.json names none) and for every
  dtype name its branches compare with; the `torch_dtype_to_str` it imports from tensorrt_llm/_utils.py (the inverse
  of `_str_to_torch_dtype_dict`, run on real torch dtypes); tensorrt_llm/models/llama/config.py
  LLaMAConfig.from_hugging_face: its `dtype` default and the HF config attribute it passes `infer_dtype`.
- `pytorch` (1.0-1.2, the PyTorch backend): tensorrt_llm/_torch/model_config.py, the `torch_dtype` property of
  ModelConfig (the model's dtype): the pretrained (HF) config attribute it returns and the torch dtype it falls back
  to when that is None; requirements.txt's transformers pin (the transformers that parses config.json).
- `llm_api` (1.0-1.2): tensorrt_llm/llmapi/llm_args.py `validate_dtype`, the validator of the LLM API's `dtype`
  (default `auto`, tabulated in llm_args.json), run for each dtype name below and at the compute capability it tests.

The sources directory may hold a whole file or a contiguous slice of it holding the block read (the copies the index
serves); every block is found by its header and indentation, so both read alike. No copy is at a release's own commit
(`pinned` false, `release_commit` names it); where two copies of a file are read, their facts must agree.
"""

from __future__ import annotations
import __future__

import ast
import re
import textwrap

from upstream_source import REPO, UnrecognizedSource, Upstream, cite, complete_statements, stored_releases

CONVERT_UTILS = "tensorrt_llm/models/convert_utils.py"
UTILS = "tensorrt_llm/_utils.py"
LLAMA_CONFIG = "tensorrt_llm/models/llama/config.py"
MODEL_CONFIG = "tensorrt_llm/_torch/model_config.py"
LLM_ARGS = "tensorrt_llm/llmapi/llm_args.py"
REQUIREMENTS = "requirements.txt"
READ_FOR = {
    CONVERT_UTILS: ["infer_dtype"],
    UTILS: ["torch_dtype_to_str"],
    LLAMA_CONFIG: ["LLaMAConfig.from_hugging_face"],
    MODEL_CONFIG: ["ModelConfig.torch_dtype"],
    LLM_ARGS: ["validate_dtype"],
    REQUIREMENTS: ["transformers"],
}
# (repository, commit) of each copy read. The engine workflow's files: one main-line reading, applied to every release
# (no copy of a release's own engine files was readable; the notes say so).
ENGINE = {
    CONVERT_UTILS: [
        (REPO, "7ed07f0691dff2c1c89196adee670ce9f4f15f67"),
        ("shpgy-shpgy/TensorRT-LLM", "1b7450f1cb4a761839b9c9c0ea771f1822eed5f8"),
    ],
    UTILS: [(REPO, "b35ac1b64368513d215c57d2ed01d62d910df8da")],
    LLAMA_CONFIG: [(REPO, "89fd9b74ab7ae753b4c6b3db25a400dca7ea54a0")],
}
ENGINE_NOTE = (
    "Engine workflow: convert_utils.py from a recent main-line commit (the torch 2.9 era) and from an older fork copy "
    "(without that commit's safetensors loading fallback), whose infer_dtype read alike; _utils.py from main at "
    "1.2.0rc2; llama/config.py from a main-line copy that reads the mistral3 text config. One reading applied to "
    "every release from 0.21 to 1.2, none of them a release's own file: medium confidence."
)
LLM_API = {LLM_ARGS: (REPO, "1a0dc5f70054f66d892df6a964996fc5ead6f81e")}
RELEASES = {
    "0.21": {"release_commit": "b4b1185af320f109f4cb73b1505832dbc63042d7", "pytorch": None, "note": ENGINE_NOTE},
    "1.0": {
        "release_commit": "ae8270b713446948246f16fadf4e2a32e35d0f62",
        "pytorch": {
            MODEL_CONFIG: ("lfr-0531/TensorRT-LLM", "1fa339b6b5e3d0531d7b6db78c690d30ed086bf4"),
            REQUIREMENTS: (REPO, "10bfbb57a9af872c052e503bbed3494a39b7dae5"),
        },
        "note": ENGINE_NOTE
        + " model_config.py: a fork's copy from before the DeepSeek-V3.2 sparse-attention hook and the "
        "config file lock, attributed to 1.0 by content; requirements.txt: main before 1.0. llm_args.py: the 1.1 copy.",
    },
    "1.1": {
        "release_commit": "48b7b5d8b7ed1e6bff57aecc6ff7d1533288bed8",
        "pytorch": {
            MODEL_CONFIG: (REPO, "1a0dc5f70054f66d892df6a964996fc5ead6f81e"),
            REQUIREMENTS: (REPO, "b35ac1b64368513d215c57d2ed01d62d910df8da"),
        },
        "note": ENGINE_NOTE
        + " model_config.py and llm_args.py: main between 1.0 and 1.2.0rc2 (the DeepSeek-V3.2 hook with "
        "DSASparseAttentionConfig); requirements.txt: main at 1.2.0rc2, just after 1.1 branched.",
    },
    "1.2": {
        "release_commit": "36e34eeffce6af28b60719a0be7dff7c7ebe01a7",
        "pytorch": {
            MODEL_CONFIG: (REPO, "b35ac1b64368513d215c57d2ed01d62d910df8da"),
            REQUIREMENTS: (REPO, "000867d9b1ad62f3de1e54e111c094da492a5626"),
        },
        "note": ENGINE_NOTE + " model_config.py: main at 1.2.0rc2. requirements.txt: the CUDA 13 / torch 2.9 line. "
        "llm_args.py: the 1.1 copy.",
    },
}
# The HF config dtypes `auto` is run with (config.json's torch_dtype; None where it names none).
SOURCE_DTYPES = ("bfloat16", "float16", "float32")
UNKNOWN_NAME = "float64"  # a dtype name no release accepts, for what an unaccepted one raises
LLM_API_VALUES = ("auto", "bfloat16", "float16", "float32")
TRANSFORMERS_PIN = re.compile(r"^transformers\s*(==|~=|>=|<=)\s*([0-9][^\s;#,]*)", re.M)


def blocks(text: str, header: str) -> list[str]:
    """Every statement whose first line matches `header` (a regex), with every following line indented deeper (or
    blank), dedented: found alike in a whole file and in a slice of one."""
    lines, found = text.splitlines(), []
    for start in (i for i, line in enumerate(lines) if re.match(header, line)):
        indent = len(lines[start]) - len(lines[start].lstrip())
        end = start + 1
        while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
            end += 1
        found.append(textwrap.dedent("\n".join(lines[start:end])) + "\n")
    if not found:
        raise UnrecognizedSource(f"no line matches {header!r}")
    return found


def function(text: str, name: str, path: str, only=None) -> ast.FunctionDef:
    """The def `name` (at any indentation) of `text`, without its decorators; where there are several, the one
    `only` (a test on the def) accepts."""
    found = [ast.parse(b).body[0] for b in blocks(text, rf"\s*def {name}\(")]
    found = [f for f in found if isinstance(f, ast.FunctionDef) and (only is None or only(f))]
    if len(found) != 1:
        raise UnrecognizedSource(f"{path}: {len(found)} defs {name} of the form read")
    found[0].decorator_list = []
    return found[0]


def run(node: ast.stmt | list[ast.stmt], path: str, namespace: dict) -> dict:
    """Run statements compiled from the ast in `namespace` (annotations left unevaluated); the namespace after."""
    module = ast.Module(body=node if isinstance(node, list) else [node], type_ignores=[])
    flags = __future__.annotations.compiler_flag
    exec(compile(ast.fix_missing_locations(module), path, "exec", flags=flags, dont_inherit=True), namespace)  # noqa: S102
    return namespace


def outcome(call) -> str | dict:
    """What a call returns, or {"raises": the exception's class name}."""
    try:
        return call()
    except Exception as error:  # noqa: BLE001 - the upstream code's own exception is the fact
        return {"raises": type(error).__name__}


# ---------------------------------------------------------------- engine workflow


def torch_dtype_to_str(utils: str):
    """_utils.py's torch_dtype_to_str, run with the statements it reads (`_str_to_torch_dtype_dict` and its
    inverse), on real torch dtypes."""
    import torch

    wanted = {"_str_to_torch_dtype_dict", "_torch_dtype_to_str_dict", "torch_dtype_to_str"}
    statements = [
        s
        for s in ast.parse(utils).body
        if (isinstance(s, ast.FunctionDef) and s.name in wanted)
        or (isinstance(s, ast.Assign) and {getattr(t, "id", None) for t in s.targets} & wanted)
    ]
    namespace = run(statements, UTILS, {"torch": torch})
    if not wanted <= set(namespace):
        raise UnrecognizedSource(f"{UTILS}: no {sorted(wanted - set(namespace))}")
    return namespace["torch_dtype_to_str"]


class _Logger:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def imports_from_utils(convert_utils: str, name: str) -> bool:
    """Whether convert_utils.py (the file, or a slice from its start) imports `name` from tensorrt_llm/_utils.py
    (`from .._utils import ...`)."""
    return any(
        isinstance(node, ast.ImportFrom)
        and node.level == 2
        and node.module == "_utils"
        and name in {alias.name for alias in node.names}
        for node in complete_statements(convert_utils, cut_end=True)
    )


def infer_dtype(convert_utils: str, utils: str) -> dict:
    """What infer_dtype gives for `auto` with each HF torch_dtype (as transformers gives it: a torch dtype, or None)
    and for each dtype name its branches accept, and what it raises for another."""
    import torch

    node = function(convert_utils, "infer_dtype", CONVERT_UTILS)
    if not imports_from_utils(convert_utils, "torch_dtype_to_str"):
        raise UnrecognizedSource(f"{CONVERT_UTILS}: torch_dtype_to_str is not imported from _utils")
    namespace = {"torch": torch, "logger": _Logger(), "torch_dtype_to_str": torch_dtype_to_str(utils)}
    infer = run(node, CONVERT_UTILS, namespace)["infer_dtype"]
    names = sorted(
        {
            c.value
            for test in ast.walk(node)
            if isinstance(test, ast.Compare) and ast.unparse(test.left) == "dtype"
            for comparator in test.comparators
            for c in ast.walk(comparator)
            if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value != "auto"
        }
    )
    if not names or UNKNOWN_NAME in names:
        raise UnrecognizedSource(f"{CONVERT_UTILS}: infer_dtype compares dtype with {names}")
    auto = {"absent": outcome(lambda: infer("auto", None))}
    auto |= {name: outcome(lambda name=name: infer("auto", getattr(torch, name))) for name in SOURCE_DTYPES}
    return {
        "auto": auto,
        "explicit": {name: outcome(lambda name=name: infer(name)) for name in names},
        "unaccepted": outcome(lambda: infer(UNKNOWN_NAME)),
    }


def converter(llama_config: str) -> dict:
    """LLaMAConfig.from_hugging_face: its `dtype` default, the HF config attribute (and getattr default) it passes
    infer_dtype as the source dtype, and whether the config it returns takes infer_dtype's result."""
    node = function(llama_config, "from_hugging_face", LLAMA_CONFIG)
    arguments = node.args.args + node.args.kwonlyargs
    defaults = dict(zip([a.arg for a in node.args.args][-len(node.args.defaults) :], node.args.defaults))
    defaults |= {a.arg: d for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None}
    if "dtype" not in {a.arg for a in arguments}:
        raise UnrecognizedSource(f"{LLAMA_CONFIG}: from_hugging_face takes no dtype")
    calls = [
        s
        for s in ast.walk(node)
        if isinstance(s, ast.Assign)
        and isinstance(s.value, ast.Call)
        and ast.unparse(s.value.func) == "infer_dtype"
        and [ast.unparse(t) for t in s.targets] == ["dtype"]
    ]
    if len(calls) != 1:
        raise UnrecognizedSource(f"{LLAMA_CONFIG}: {len(calls)} `dtype = infer_dtype(...)` in from_hugging_face")
    source = calls[0].value.args[1]
    if not (isinstance(source, ast.Call) and ast.unparse(source.func) == "getattr" and len(source.args) == 3):
        raise UnrecognizedSource(f"{LLAMA_CONFIG}: infer_dtype's source dtype is {ast.unparse(source)}")
    returned = [
        k
        for s in ast.walk(node)
        if isinstance(s, ast.Return) and isinstance(s.value, ast.Call) and ast.unparse(s.value.func) == "cls"
        for k in s.value.keywords
        if k.arg == "dtype" and ast.unparse(k.value) == "dtype"
    ]
    return {
        "method": "LLaMAConfig.from_hugging_face",
        "dtype_default": ast.literal_eval(defaults["dtype"]) if "dtype" in defaults else None,
        "source_dtype": {
            "attribute": ast.literal_eval(source.args[1]),
            "when_absent": ast.literal_eval(source.args[2]),
        },
        "config_dtype_is_inferred": bool(returned),
    }


# ---------------------------------------------------------------- PyTorch backend and LLM API


def model_dtype(model_config: str) -> dict:
    """ModelConfig's torch_dtype property: `<pretrained_config>.<attribute> or torch.<fallback>`."""
    found = blocks(model_config, r"\s*def torch_dtype\(self\)")
    if len(found) != 1:
        raise UnrecognizedSource(f"{MODEL_CONFIG}: {len(found)} defs torch_dtype")
    text = found[0]
    header = model_config.splitlines()
    at = next(i for i, line in enumerate(header) if re.match(r"\s*def torch_dtype\(self\)", line))
    decorator = next((line.strip() for line in reversed(header[:at]) if line.strip()), "")
    node = ast.parse(text).body[0]
    returns = [s for s in node.body if isinstance(s, ast.Return)]
    value = returns[0].value if len(returns) == 1 else None
    if decorator != "@property" or not (
        isinstance(value, ast.BoolOp) and isinstance(value.op, ast.Or) and len(value.values) == 2
    ):
        raise UnrecognizedSource(f"{MODEL_CONFIG}: torch_dtype is not a property returning `<attr> or <fallback>`")
    read, fallback = value.values
    chain = ast.unparse(read).split(".")
    if chain[:2] != ["self", "pretrained_config"] or len(chain) != 3 or ast.unparse(fallback)[:6] != "torch.":
        raise UnrecognizedSource(f"{MODEL_CONFIG}: torch_dtype returns {ast.unparse(value)}")
    return {
        "property": "ModelConfig.torch_dtype",
        "pretrained_config_attribute": chain[2],
        "fallback": ast.unparse(fallback).removeprefix("torch."),
    }


def transformers_pin(requirements: str) -> dict:
    found = TRANSFORMERS_PIN.search(requirements)
    if found is None:
        raise UnrecognizedSource(f"{REQUIREMENTS}: no transformers requirement")
    return {"op": found.group(1), "version": found.group(2)}


class _Device:
    def __init__(self, major: int):
        self.major = major


def _capability_tests(node: ast.FunctionDef) -> list[ast.Compare]:
    """The `<...>.major < N` tests of a def (N a constant)."""
    return [
        c
        for c in ast.walk(node)
        if isinstance(c, ast.Compare)
        and ast.unparse(c.left).endswith(".major")
        and isinstance(c.ops[0], ast.Lt)
        and isinstance(c.comparators[0], ast.Constant)
    ]


def llm_api_dtype(llm_args: str) -> dict:
    """validate_dtype (the one testing the compute capability: a KV-cache config may validate a dtype too), run for
    each value below and at the compute capability major version it tests."""
    node = function(llm_args, "validate_dtype", LLM_ARGS, only=lambda f: len(_capability_tests(f)) == 1)
    tests = _capability_tests(node)
    major = tests[0].comparators[0].value

    def at(capability: int) -> dict:
        cuda = type("cuda", (), {"get_device_properties": staticmethod(lambda index: _Device(capability))})
        validate = run(node, LLM_ARGS, {"torch": type("torch", (), {"cuda": cuda})})["validate_dtype"]
        return {value: outcome(lambda value=value: validate(None, value, None)) for value in LLM_API_VALUES}

    return {"field": "dtype", "below_major": major, "below": at(major - 1), "at_or_above": at(major)}


# ---------------------------------------------------------------- the table


def _agreeing(results: list[dict], path: str) -> dict:
    if any(r != results[0] for r in results[1:]):
        raise UnrecognizedSource(f"{path}: the copies read disagree: {results}")
    return results[0]


def engine_facts(upstream: Upstream) -> tuple[dict, list[tuple[str, str, str]]]:
    """The engine workflow's facts (every copy of a file read must give the same) and the files they come from."""
    texts = {path: [upstream.read(repo, path, commit) for repo, commit in copies] for path, copies in ENGINE.items()}
    (utils,) = texts[UTILS]
    facts = {
        "converter": _agreeing([converter(text) for text in texts[LLAMA_CONFIG]], LLAMA_CONFIG),
        "infer_dtype": _agreeing([infer_dtype(text, utils) for text in texts[CONVERT_UTILS]], CONVERT_UTILS),
    }
    return facts, [(repo, path, commit) for path, copies in ENGINE.items() for repo, commit in copies]


def release_entry(upstream: Upstream, release: str, engine: dict, engine_files: list) -> dict:
    spec = RELEASES[release]
    files = list(engine_files)
    pytorch = llm_api = None
    if spec["pytorch"] is not None:
        (mc_repo, mc_commit), (rq_repo, rq_commit) = spec["pytorch"][MODEL_CONFIG], spec["pytorch"][REQUIREMENTS]
        pytorch = {
            "model_dtype": model_dtype(upstream.read(mc_repo, MODEL_CONFIG, mc_commit)),
            "transformers": transformers_pin(upstream.read(rq_repo, REQUIREMENTS, rq_commit)),
        }
        la_repo, la_commit = LLM_API[LLM_ARGS]
        llm_api = llm_api_dtype(upstream.read(la_repo, LLM_ARGS, la_commit))
        files += [
            (mc_repo, MODEL_CONFIG, mc_commit),
            (rq_repo, REQUIREMENTS, rq_commit),
            (la_repo, LLM_ARGS, la_commit),
        ]
    return {
        "engine": engine,
        "llm_api": llm_api,
        "pytorch": pytorch,
        "release_commit": spec["release_commit"],
        "source": {
            "files": [
                cite(repo, path, commit, pinned=False)
                | {"release_commit": spec["release_commit"], "read_for": READ_FOR[path]}
                for repo, path, commit in files
            ],
            "note": spec["note"],
        },
    }


def tabulate(upstream: Upstream) -> dict:
    engine, engine_files = engine_facts(upstream)
    releases = {release: release_entry(upstream, release, engine, engine_files) for release in RELEASES}
    return {
        "note": "Per release, the dtype `auto` deploys a model in: the engine workflow's infer_dtype and the HF "
        "config attribute its Llama converter passes it; the PyTorch backend's model dtype (the pretrained config "
        "attribute ModelConfig.torch_dtype reads, its fallback) and the transformers that parses config.json; the "
        "LLM API's dtype validator.",
        "releases": stored_releases(releases),
    }
