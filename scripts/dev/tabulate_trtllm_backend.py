"""Tabulate the C++ `tensorrtllm` Triton backend and its `inflight_batcher_llm` model templates, per TensorRT-LLM
release, into pipeline/upstream/tensorrtllm_backend.json (run by scripts/dev/tabulate_all.py; needs the `dev` extra:
tree-sitter, tree-sitter-cpp).

Each release's facts:
- `models`: for each template config.pbtxt of `MODELS`, its inputs (name, data_type, dims, optional,
  allow_ragged_batch, reshape), outputs and parameter keys; the ensemble also gets its steps. A data type that is a
  template variable stays that variable ("${logits_datatype}"): the consumer fills it.
- `required_parameters` (name -> C++ type the backend reads it as): parameters some `GetParameter` call reads
  outside the body of any `try` (a read in a `catch` handler is unguarded). The backend throws when such a key is
  absent, so a config lacking one does not load. `optional_parameters`: read only inside a `try`.
  `variable_parameter_reads`: reads whose name is a variable, resolved to the string literal last assigned to it in
  the same function (the `GetParameter` specialisations' own delegating calls are skipped).
- `renamed_from_docs`, `docs_disagreements`: the template input names reconciled with the release's
  docs/model_config.md (`reconcile`); renames are applied from 0.20 on only, where the templates were not read at
  the release's own commit.
- `guide_types`: the sorted strings the backend accepts in the `tensorrt_llm` model's `guided_decoding_guide_type`
  input, the keys of the map in utils.cc's `getGuidedDecodingParamsFromTensors` (`guide_types`). These are the C++
  `tensorrtllm` backend's, the one the pipeline deploys, not those of the python model.py of the same templates.
  The backend compares the string exactly and drops the guide of any other type without an error, so a client
  must send one of these. An empty list where the release has no such function (0.18: no guided decoding).
- `guided_decoding_backends`, `tokenizer_info` (`guided_decoding_config`): in model_instance_state.cc's
  `getGuidedDecodingConfigFromParams`, the strings the `guided_decoding_backend` parameter's value is compared with
  (template placeholders `${...}` left out: they mean "off"), and the keys the backend reads from the JSON file
  the `xgrammar_tokenizer_info_path` parameter names, each with the C++ type it reads the value as. The C++ backend
  ignores `tokenizer_dir` for guided decoding. Where several versions of the file were read (0.20 on), the
  backends every one accepts and the keys any one reads. Empty where there is no such function (0.18).
- `source`: every file read, as `cite` records.

Where the files are read: 0.18 and 0.19 from tensorrtllm_backend at the release tag. From 0.20 on the backend
lives in NVIDIA/TensorRT-LLM triton_backend/, whose release commits (`RELEASES`, the tensorrtllm_backend submodule
pointer) were not readable when this was tabulated: the files were read at the commits in `READ_FROM_0_20`, cited
unpinned, and every release >= 0.20 shares those templates and the union of the required parameters of every
backend version read (a superset is safe: the backend ignores parameters it does not read).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from upstream_source import UnrecognizedSource, Upstream, cite, stored_releases

MODELS = ("tensorrt_llm", "preprocessing", "postprocessing", "ensemble", "tensorrt_llm_bls")
CPP_FILES = ("model_instance_state.cc", "model_state.cc", "utils.cc")
BACKEND_REPO = "triton-inference-server/tensorrtllm_backend"
TRTLLM_REPO = "NVIDIA/TensorRT-LLM"
TEMPLATES = "all_models/inflight_batcher_llm"
BACKEND_SOURCES = "inflight_batcher_llm/src"
MOVED_TO = "triton_backend/"  # where NVIDIA/TensorRT-LLM keeps the backend from 0.20 on
DOC_PATH = "docs/model_config.md"
SUBMODULE = "tensorrt_llm"  # tensorrtllm_backend's submodule pointing to the NVIDIA/TensorRT-LLM release commit


@dataclass(frozen=True)
class Release:
    backend_commit: str  # tensorrtllm_backend: the release tag's commit, or the commit whose submodule is the release
    tag: str | None = None  # the tensorrtllm_backend tag the templates and backend are read at (up to 0.19)
    release_commit: str | None = None  # NVIDIA/TensorRT-LLM's release commit, the submodule pointer (0.20 on)


RELEASES = {
    "0.18": Release("c575d8cb980883efca12fe89ba918499c29459be", tag="v0.18.2"),
    "0.19": Release("c1e19638304d287f554f738c1411746555ed348c", tag="v0.19.0"),
    "0.20": Release(
        "40ab7b32e539d410cf29bc3f0463cb17be3fe50b", release_commit="7965842954628b0b5456a2f7d59786d3dcd41647"
    ),
    "0.21": Release(
        "2710a1ff62a700dbe01ae67f56d200102c249c46", release_commit="b4b1185af320f109f4cb73b1505832dbc63042d7"
    ),
    "1.0": Release(
        "efb8a497eac3e16acf6f3ad250565465c80e6f0a", release_commit="ae8270b713446948246f16fadf4e2a32e35d0f62"
    ),
    "1.1": Release(
        "4688330ae9f308467bbe75970650c3c423c4c12a", release_commit="48b7b5d8b7ed1e6bff57aecc6ff7d1533288bed8"
    ),
    "1.2": Release(
        "854b3493d19db5391b5e183f05c4a27df7d4986d", release_commit="36e34eeffce6af28b60719a0be7dff7c7ebe01a7"
    ),
}
# The NVIDIA/TensorRT-LLM commits the files of every release >= 0.20 were read at (not the release commits). The
# tensorrt_llm template of 2a9abd95 rather than of 0c8de69a: same tensors, and 0c8de69a only adds a parameter key
# that every backend version reads inside a try.
READ_FROM_0_20 = {
    "templates": {
        "tensorrt_llm": "2a9abd9536aa62ad3e4b9314be9286b1b1be523b",
        "preprocessing": "08dc37e368e4718ae680bdb9be8da24ebd420a53",
        "postprocessing": "89fd9b74ab7ae753b4c6b3db25a400dca7ea54a0",
        "ensemble": "2a9abd9536aa62ad3e4b9314be9286b1b1be523b",
        "tensorrt_llm_bls": "0193dbd4189221d0fd5e9f20cdb384d3da8dbc24",
    },
    "backend": {
        "model_instance_state.cc": [
            "0c8de69a1ca6213eebb20a51873890ff128666c2",
            "c8c6df08bd0ead54cd47f7973e1e425c28a174cd",
        ],
        "model_state.cc": ["5cdd69218f8815d6c8c101ca1facf2ec4ac4b622"],
        "utils.cc": ["c8c6df08bd0ead54cd47f7973e1e425c28a174cd"],
    },
}


def tabulate(upstream: Upstream) -> dict:
    """The whole table, releases stored once where they share their facts."""
    described, described_at = descriptions(upstream)
    blocks = {release: release_block(upstream, release, described, described_at) for release in RELEASES}
    return {"releases": stored_releases(blocks)}


def release_files(release: str) -> tuple[dict[str, dict], list[dict]]:
    """A release's template sources {model: cite} and backend sources [cite]."""
    facts = RELEASES[release]
    if facts.tag is not None:
        templates = {m: cite(BACKEND_REPO, f"{TEMPLATES}/{m}/config.pbtxt", facts.backend_commit) for m in MODELS}
        backend = [cite(BACKEND_REPO, f"{BACKEND_SOURCES}/{name}", facts.backend_commit) for name in CPP_FILES]
        return templates, backend
    templates = {
        model: cite(TRTLLM_REPO, f"{MOVED_TO}{TEMPLATES}/{model}/config.pbtxt", commit, pinned=False)
        for model, commit in READ_FROM_0_20["templates"].items()
    }
    backend = [
        cite(TRTLLM_REPO, f"{MOVED_TO}{BACKEND_SOURCES}/{name}", commit, pinned=False)
        for name, commits in READ_FROM_0_20["backend"].items()
        for commit in commits
    ]
    return templates, backend


def _read(upstream: Upstream, source: dict) -> str:
    return upstream.read(source["repo"], source["path"], source["commit"])


def release_block(upstream: Upstream, release: str, described: dict[str, str], described_at: dict[str, str]) -> dict:
    """One release's facts (see the module docstring)."""
    facts = RELEASES[release]
    templates, backend = release_files(release)
    models = {model: template_interface(_read(upstream, source)) for model, source in templates.items()}
    reads = [r for source in backend for r in parameter_reads(_read(upstream, source), source["path"].split("/")[-1])]
    required, optional = classify(reads)
    docs = documented_inputs(upstream.read(BACKEND_REPO, DOC_PATH, facts.backend_commit))
    renamed, disagreements = reconcile(models, docs, described)
    docs_source = cite(BACKEND_REPO, DOC_PATH, facts.backend_commit)
    used = sorted({name for renames in renamed.values() for name in renames})
    if used:
        docs_source["template_names_described_by"] = {name: described_at[name] for name in used}
    if facts.tag is not None:  # templates read at the release itself: the docs are only a check
        for model, renames in renamed.items():
            print(f"{release}: the docs would rename {model} {renames} (not applied)", file=sys.stderr)
        renamed = {}
    apply_renames(models, renamed)
    for problem in consistency_problems(models):
        print(f"{release}: inconsistent templates: {problem}", file=sys.stderr)
    if facts.tag is not None:
        source = {"tag": facts.tag}
    else:
        source = {
            "release_commit": facts.release_commit,
            "release_commit_from": cite(BACKEND_REPO, SUBMODULE, facts.backend_commit),
        }
    source |= {"files": [*templates.values(), *backend], "docs": docs_source}
    return {
        "source": source,
        "models": models,
        "required_parameters": required,
        "optional_parameters": optional,
        "variable_parameter_reads": variable_reads(reads),
        "renamed_from_docs": renamed,
        "docs_disagreements": disagreements,
        "guide_types": guide_types(_read(upstream, next(f for f in backend if f["path"].endswith("/utils.cc")))),
        **guided_decoding_configs(
            [_read(upstream, f) for f in backend if f["path"].endswith("/model_instance_state.cc")]
        ),
    }


# ---------------------------------------------------------------- templates (config.pbtxt)

PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")
TYPED = re.compile(r'name:\s*"(\w+)"\s*,?\s*data_type:\s*(\$\{\w+\})')


def template_interface(text: str) -> dict:
    """The interface of one template config.pbtxt: inputs, outputs, parameter keys (and ensemble steps)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    typed = dict(TYPED.findall(text))  # data types that are template variables keep the variable
    config = mc.ModelConfig()
    text_format.Parse(PLACEHOLDER.sub("1", re.sub(r"data_type:\s*\$\{\w+\}", "data_type: TYPE_FP32", text)), config)

    def tensor(t, is_input):
        row = {"name": t.name, "data_type": typed.get(t.name, mc.DataType.Name(t.data_type)), "dims": list(t.dims)}
        if is_input:
            row |= {"optional": t.optional, "allow_ragged_batch": t.allow_ragged_batch}
        if t.HasField("reshape"):
            row["reshape"] = list(t.reshape.shape)
        return row

    spec = {
        "inputs": [tensor(t, True) for t in config.input],
        "outputs": [tensor(t, False) for t in config.output],
        "parameters": sorted(config.parameters),
    }
    if config.HasField("ensemble_scheduling"):
        spec["steps"] = [
            {
                "model_name": step.model_name,
                "input_map": dict(sorted(step.input_map.items())),
                "output_map": dict(sorted(step.output_map.items())),
            }
            for step in config.ensemble_scheduling.step
        ]
    return spec


def consistency_problems(models: dict) -> list[str]:
    """Ensemble steps that map a tensor their model does not declare, or read an ensemble tensor nobody makes."""
    problems = []
    ensemble = models.get("ensemble")
    if not ensemble:
        return problems
    made = {t["name"] for t in ensemble["inputs"]}
    for step in ensemble["steps"]:
        made |= set(step["output_map"].values())
    for step in ensemble["steps"]:
        model = models.get(step["model_name"])
        if model is None:
            problems.append(f"ensemble step {step['model_name']}: no such model tabulated")
            continue
        inputs, outputs = {t["name"] for t in model["inputs"]}, {t["name"] for t in model["outputs"]}
        problems += [f"ensemble -> {step['model_name']}: no input {k}" for k in step["input_map"] if k not in inputs]
        problems += [f"ensemble <- {step['model_name']}: no output {k}" for k in step["output_map"] if k not in outputs]
        problems += [
            f"ensemble -> {step['model_name']}: {v} is not produced"
            for v in step["input_map"].values()
            if v not in made
        ]
    return problems


# ---------------------------------------------------------------- backend C++ (GetParameter reads)


@dataclass
class Read:
    file: str
    function: str
    cpp_type: str | None
    name: str | None  # the parameter name, when known
    variable: str | None  # the identifier passed instead of a literal
    guarded: bool  # lexically inside a try body


def _parser():
    import tree_sitter_cpp
    from tree_sitter import Language, Parser

    return Parser(Language(tree_sitter_cpp.language()))


def _walk(node):
    yield node
    for child in node.children:
        yield from _walk(child)


def _guarded(node) -> bool:
    while node.parent is not None:
        parent = node.parent
        if parent.type == "try_statement" and parent.child_by_field_name("body") == node:
            return True
        node = parent
    return False


def _enclosing_function(node):
    while node is not None and node.type not in ("function_definition", "lambda_expression"):
        node = node.parent
    return node


def _function_name(function) -> str:
    if function is None:
        return "<file scope>"
    if function.type == "lambda_expression":
        return f"<lambda in {_function_name(_enclosing_function(function.parent))}>"
    declarator = function.child_by_field_name("declarator")
    while declarator is not None and declarator.type != "function_declarator":
        declarator = declarator.child_by_field_name("declarator")
    name = declarator.child_by_field_name("declarator") if declarator is not None else None
    return name.text.decode() if name is not None else "<function>"


def _literal(node) -> str | None:
    if node.type == "string_literal":
        return "".join(c.text.decode() for c in node.children if c.type in ("string_content", "escape_sequence"))
    if node.type == "concatenated_string":
        parts = [_literal(c) for c in node.children if c.type == "string_literal"]
        return "".join(parts) if all(p is not None for p in parts) else None
    return None


def _resolve(variable: str, call, function) -> str | None:
    """The string literal last given to `variable` before `call` in the same function, if any."""
    if function is None:
        return None
    found = None
    for node in _walk(function):
        if node.start_byte >= call.start_byte:
            break
        target = value = None
        if node.type == "init_declarator":
            target, value = node.child_by_field_name("declarator"), node.child_by_field_name("value")
        elif node.type == "assignment_expression":
            target, value = node.child_by_field_name("left"), node.child_by_field_name("right")
        if (
            target is not None
            and value is not None
            and target.type == "identifier"
            and target.text == variable.encode()
        ):
            found = _literal(value)
    return found


def parameter_reads(source: str, file: str) -> list[Read]:
    """Every `GetParameter` call of `source`: its name (literal or resolved variable), type and guard."""
    tree = _parser().parse(source.encode())
    reads = []
    for node in _walk(tree.root_node):
        if node.type != "call_expression":
            continue
        callee = node.child_by_field_name("function")
        template = callee
        if callee is not None and callee.type == "field_expression":
            template = callee.child_by_field_name("field")
        if template is None:
            continue
        if template.type in ("template_function", "template_method"):
            base = template.child_by_field_name("name")
            arguments = template.child_by_field_name("arguments")
            cpp_type = arguments.text.decode()[1:-1].strip() if arguments is not None else None
        else:
            base, cpp_type = template, None
        if base is None or not base.text.decode().endswith("GetParameter"):
            continue
        args = [a for a in node.child_by_field_name("arguments").named_children if a.type != "comment"]
        if not args:
            continue
        function = _enclosing_function(node)
        function_name = _function_name(function)
        name, variable = _literal(args[0]), None
        if name is None:
            variable = args[0].text.decode()
            if "GetParameter" in function_name:  # a specialisation delegating to GetParameter<std::string>(name)
                continue
            name = _resolve(variable, node, function)
        reads.append(Read(file, function_name, cpp_type, name, variable, _guarded(node)))
    return reads


GUIDE_PARSER = "getGuidedDecodingParamsFromTensors"


def guide_types(source: str) -> list[str]:
    """The guide type strings of utils.cc: in `GUIDE_PARSER`, the string keys of the `{"name", ...GuideType::k...}`
    pairs its map is initialised with; [] where there is no such function."""
    function = _function(_parser().parse(source.encode()), GUIDE_PARSER)
    if function is None:
        return []
    found = set()
    for node in _walk(function):
        items = node.named_children if node.type == "initializer_list" else []
        if len(items) == 2 and "GuideType::" in items[1].text.decode() and _literal(items[0]) is not None:
            found.add(_literal(items[0]))
    if not found:
        raise UnrecognizedSource(f"{GUIDE_PARSER} maps no string to a GuideType: read it and update guide_types")
    return sorted(found)


GUIDED_CONFIG = "getGuidedDecodingConfigFromParams"
BACKEND_PARAMETER = "guided_decoding_backend"


def _function(tree, name: str):
    """The definition of the function or method `name` (last `::` part), or None."""
    return next(
        (
            node
            for node in _walk(tree.root_node)
            if node.type == "function_definition" and _function_name(node).split("::")[-1] == name
        ),
        None,
    )


def guided_decoding_config(source: str) -> dict:
    """`GUIDED_CONFIG`'s facts in model_instance_state.cc: {"guided_decoding_backends": the literals the variable
    read from `BACKEND_PARAMETER` is compared with by ==, "tokenizer_info": {JSON key: C++ type of its `get<T>`}}."""
    function = _function(_parser().parse(source.encode()), GUIDED_CONFIG)
    if function is None:
        return {"guided_decoding_backends": [], "tokenizer_info": {}}
    holders, backends, keys = set(), set(), {}
    for node in _walk(function):
        if node.type == "init_declarator" and (value := node.child_by_field_name("value")) is not None:
            literals = [_literal(n) for n in _walk(value) if n.type == "string_literal"]
            if "GetParameter" in value.text.decode() and BACKEND_PARAMETER in literals:
                holders.add(node.child_by_field_name("declarator").text.decode())
    for node in _walk(function):
        if node.type == "binary_expression" and node.child_by_field_name("operator").type == "==":
            left, right = node.child_by_field_name("left"), node.child_by_field_name("right")
            literal = _literal(right)
            if left.text.decode() in holders and literal is not None and not literal.startswith("${"):
                backends.add(literal)
        if node.type == "subscript_expression":
            index = [c for c in _walk(node) if c.type == "string_literal"][:1]
            call = node.parent
            while call is not None and call.type != "call_expression":
                call = call.parent
            types = [c for c in _walk(call) if c.type == "template_argument_list"] if call is not None else []
            if index and types:
                keys[_literal(index[0])] = types[0].text.decode()[1:-1].strip()
    if not backends or not keys:
        raise UnrecognizedSource(f"{GUIDED_CONFIG}: no backend string or tokenizer info key found: read it")
    return {"guided_decoding_backends": sorted(backends), "tokenizer_info": dict(sorted(keys.items()))}


def guided_decoding_configs(sources: list[str]) -> dict:
    """`guided_decoding_config` over several versions of the file: backends every version accepts, keys any reads
    (a generated file must hold them all; two versions reading one key as different types is a new shape)."""
    found = [guided_decoding_config(source) for source in sources]
    backends = set.intersection(*(set(f["guided_decoding_backends"]) for f in found))
    keys: dict[str, str] = {}
    for f in found:
        for key, cpp_type in f["tokenizer_info"].items():
            if keys.setdefault(key, cpp_type) != cpp_type:
                raise UnrecognizedSource(f"{GUIDED_CONFIG}: {key!r} is read as {keys[key]} and as {cpp_type}")
    return {"guided_decoding_backends": sorted(backends), "tokenizer_info": dict(sorted(keys.items()))}


def classify(reads: list[Read]) -> tuple[dict[str, str], list[str]]:
    """(required name -> C++ type, optional names): required when any read of the name is unguarded."""
    required: dict[str, set[str]] = {}
    for r in reads:
        if r.name is not None and not r.guarded:
            required.setdefault(r.name, set()).add(r.cpp_type or "?")
    optional = sorted({r.name for r in reads if r.name is not None} - set(required))
    return {k: " | ".join(sorted(v)) for k, v in sorted(required.items())}, optional


def variable_reads(reads: list[Read]) -> list[dict]:
    """The reads whose parameter name is a variable: where, which variable, the name it resolves to, and guard."""
    found = sorted({(r.file, r.function, r.variable, r.name or "", r.guarded) for r in reads if r.variable is not None})
    return [
        {"file": file, "function": function, "variable": variable, "resolved": name or None, "guarded": guarded}
        for file, function, variable, name, guarded in found
    ]


# ---------------------------------------------------------------- docs/model_config.md (documented inputs)

RECONCILED = ("tensorrt_llm", "ensemble", "tensorrt_llm_bls")
# which docs lists describe a template's inputs: none lists the ensemble's, whose client-facing inputs are the BLS's
DOC_MODEL = {"tensorrt_llm": "tensorrt_llm", "ensemble": "tensorrt_llm_bls", "tensorrt_llm_bls": "tensorrt_llm_bls"}
DOC_TYPES = {
    "int32": "TYPE_INT32",
    "int64": "TYPE_INT64",
    "uint64": "TYPE_UINT64",
    "float": "TYPE_FP32",
    "float32": "TYPE_FP32",
    "float16": "TYPE_FP16",
    "bool": "TYPE_BOOL",
    "string": "TYPE_STRING",
}
SAMPLING = re.compile(r"^Sampling Config param: `(\w+)`$")


@dataclass
class DocInput:
    name: str
    dims: list | str  # [1], [-1], [2, -1]; a symbolic shape is kept as written
    data_type: str | None  # TYPE_*; None for "(model data type)" or an unknown spelling
    description: str


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _doc_type(text: str) -> str | None:
    if "model data type" in text:
        return None
    word = text.strip().strip("`").split("`")[0].strip()
    word = re.sub(r"^(u?int\d+)_?t$", r"\1", word)  # int32_t, int32t, uint64_t
    return DOC_TYPES.get(word)


def _doc_dims(text: str) -> list | str:
    inner = text.strip().removeprefix("[").removesuffix("]")
    try:
        return [int(d) for d in inner.split(",")]
    except ValueError:
        return text.strip()


def documented_inputs(text: str) -> dict[str, dict[str, DocInput]]:
    """{"tensorrt_llm": {name: DocInput}, "tensorrt_llm_bls": {...}}: the input tables of model_config.md,
    by the heading above them ("Common Inputs": both models; "Unique Inputs for <model> model": that one)."""
    found: dict[str, dict[str, DocInput]] = {"tensorrt_llm": {}, "tensorrt_llm_bls": {}}
    heading, header = "", None
    for line in text.splitlines():
        if line.startswith("#"):
            heading, header = line.lstrip("#").strip(), None
            continue
        if not line.lstrip().startswith("|"):
            header = None
            continue
        cells = _cells(line)
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if set("".join(cells)) <= set(":- "):  # the alignment row
            continue
        if header != ["name", "shape", "type", "description"] or "Inputs" not in heading:
            continue
        if heading == "Common Inputs":
            models = list(found)
        else:
            match = re.fullmatch(r"Unique Inputs for (\w+) model", heading)
            if match is None or match[1] not in found:
                raise ValueError(f"{DOC_PATH}: input table under an unknown heading {heading!r}")
            models = [match[1]]
        row = DocInput(cells[0].strip("`"), _doc_dims(cells[1]), _doc_type(cells[2]), cells[3])
        for model in models:
            found[model][row.name] = row
    return found


def _words(camel: str) -> set[str]:
    return {w.lower() for w in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", camel)}


def reconcile(models: dict, docs: dict[str, dict[str, DocInput]], described: dict[str, str]) -> tuple[dict, dict]:
    """(renamed {model: {template name: docs name}}, disagreements {model: {...}}) of the templates `models`
    against the documented inputs `docs` (from `documented_inputs`); `described`: name -> the description
    some docs read give it, for the template inputs these docs do not list. Does not change `models`.

    A template input these docs do not list is renamed to the documented input the template lacks whose description
    is the same text, when exactly one is; failing that, to the one with the same dims and data type whose
    description names a sampling config parameter sharing a camelCase word with the one its own description names
    (minTokens ~ minLength), when exactly one is. A template input has no description of its own: `described`
    lends it the one newer docs give its name."""
    renamed, disagreements = {}, {}
    for model in RECONCILED:
        if model not in models:
            continue
        documented = docs[DOC_MODEL[model]]
        inputs = {t["name"]: t for t in models[model]["inputs"]}
        missing = [n for n in documented if n not in inputs]
        renames = {}
        for name, tensor in inputs.items():
            if name in documented:
                continue
            description = described.get(name)
            same_text = [m for m in missing if description is not None and documented[m].description == description]
            own = SAMPLING.match(description or "")
            related = [
                m
                for m in missing
                if own is not None
                and documented[m].dims == tensor["dims"]
                and documented[m].data_type == tensor["data_type"]
                and (theirs := SAMPLING.match(documented[m].description)) is not None
                and _words(own[1]) & _words(theirs[1])
            ]
            for candidates in (same_text, related):
                if len(candidates) == 1:
                    renames[name] = candidates[0]
                    missing.remove(candidates[0])
                    break
        if renames:
            renamed[model] = renames
        after = [renames.get(n, n) for n in inputs]
        disagreements[model] = {
            "documented_not_in_template": missing,
            "template_not_documented": [n for n in after if n not in documented],
        }
    return renamed, disagreements


def apply_renames(models: dict, renamed: dict) -> None:
    """Rename the template inputs in place, and the ensemble steps' input_map entries that name them."""
    for model, renames in renamed.items():
        for tensor in models[model]["inputs"]:
            tensor["name"] = renames.get(tensor["name"], tensor["name"])
    ensemble = models.get("ensemble")
    if ensemble is None:
        return
    own = renamed.get("ensemble", {})
    for step in ensemble["steps"]:
        keys = renamed.get(step["model_name"], {})
        step["input_map"] = dict(sorted((keys.get(k, k), own.get(v, v)) for k, v in step["input_map"].items()))
        step["output_map"] = dict(sorted((k, own.get(v, v)) for k, v in step["output_map"].items()))


def descriptions(upstream: Upstream) -> tuple[dict[str, str], dict[str, str]]:
    """(name -> description, name -> tensorrtllm_backend commit): every documented input's description in the
    newest release docs that list it."""
    described, described_at = {}, {}
    for release in reversed(RELEASES):
        commit = RELEASES[release].backend_commit
        for rows in documented_inputs(upstream.read(BACKEND_REPO, DOC_PATH, commit)).values():
            for name, row in rows.items():
                if name not in described:
                    described[name], described_at[name] = row.description, commit
    return described, described_at
