"""Tabulate, from the real upstream sources, the facts of the C++ `tensorrtllm` Triton backend and its
`inflight_batcher_llm` model templates for each TensorRT-LLM release, into
`pipeline/triton/tensorrt_llm_templates.json`.

Maintainer tool, not run by the pipeline (it needs the `dev` extra: tree-sitter, tree-sitter-cpp). One entry
per release:

- `source`: the repository, the release's tag or submodule commit, a note on how the files tie to the release,
  and every file read with the exact commit it was read at.
- `models`: for `tensorrt_llm`, `preprocessing`, `postprocessing`, `ensemble`, `tensorrt_llm_bls`: the inputs
  (name, data_type, dims, optional, allow_ragged_batch, reshape), outputs and parameter keys of the template
  `config.pbtxt`; a `${var}` data type is kept as written ("${logits_datatype}"); the ensemble also gets its
  steps (model_name, input_map, output_map).
- `required_parameters` (name -> C++ type of the `GetParameter<T>` template argument): every parameter the
  backend (model_instance_state.cc, model_state.cc, utils.cc) reads with a `GetParameter` call whose first
  argument is a string literal, and that is not lexically inside the body of a `try` (a call inside a `catch`
  handler counts as unguarded). `ModelState::GetParameter` throws "Cannot find parameter with name" when the
  key is absent, so a config without one of these fails to load. `optional_parameters`: read only inside `try`.
  Reads whose name is a variable are resolved to the string literal last assigned to it in the same function
  (printed, and listed in `variable_parameter_reads`); the `GetParameter` specialisations' own delegating calls
  are skipped.

Sources:
- 0.18, 0.19: triton-inference-server/tensorrtllm_backend at tags v0.18.2 and v0.19.0, read with `git show`
  from a local clone or bare mirror (`--git`).
- 0.20 and later: the backend moved to NVIDIA/TensorRT-LLM `triton_backend/`. That repository is too large
  to clone here; its files were read through a search index that stores several versions of each file, but
  not at the release commits (the commits tensorrtllm_backend's `tensorrt_llm` submodule points to at its
  release tags answer "stored, but not at that commit"). The versions read are cached by commit under
  `--cache` (`<cache>/<commit>/<path>`; PROVENANCE-triton-backend.md there says how each was read; two
  model_instance_state.cc versions are verbatim excerpts, chars 0-32000, holding every GetParameter call).
  `STORED` below names them. Every release >= 0.20 therefore gets the same entry, built from those versions:
  `required_parameters` is the UNION over every stored backend version read (a superset is safe: the backend
  ignores parameters it does not read), and the models come from one consistent set of stored templates
  (checked by `consistency_problems`: every ensemble step maps only tensors its model declares). The release's
  own commit (from the submodule pointer) is recorded for reference. See `STORED_NOTE`.

Tensor names reconciled with the release's docs (every release; renames applied only for >= 0.20):
- `docs/model_config.md` of tensorrtllm_backend at the release's commit (the tag, or the commit the submodule
  pointer was read at; `source.docs`) lists, under "Model Input and Output", the input tensors of the
  `tensorrt_llm` and `tensorrt_llm_bls` models in markdown tables (Name | Shape | Type | Description): "Common
  Inputs" (with the LoRA table below it) for both, "Unique Inputs for tensorrt_llm model", "Unique Inputs for
  tensorrt_llm_bls model". No table lists the ensemble's inputs; the ensemble is compared with the
  `tensorrt_llm_bls` lists (both are the client-facing interface: text_input, max_tokens, top_k, ...).
- For each input of the `tensorrt_llm`, `ensemble`, `tensorrt_llm_bls` templates that the release's docs do not
  list, the documented inputs the template lacks are candidates. A template input has no description of its
  own; it is given the description of the newest docs (of all releases, `descriptions`) that list its name.
  It is renamed to the candidate whose description is the same text, when exactly one is; failing that, to the
  candidate with the same dims and data type whose description is "Sampling Config param: `X`" with X sharing
  a camelCase word with the template input's own "Sampling Config param" (`minTokens` ~ `minLength`, `seed` ~
  `randomSeed`), when exactly one is. Renames are applied to the inputs and to the ensemble steps' input_map
  (keys for a renamed model input, values for a renamed ensemble tensor), recorded in `renamed_from_docs`
  {model: {template name: docs name}}; `docs_disagreements` lists, per model, the documented inputs still
  absent from the template (`documented_not_in_template`) and the template inputs still absent from the docs
  (`template_not_documented`). For 0.18/0.19 (templates read at the release tag, exact) the comparison is only
  a check: nothing is renamed, and a rename it would make is printed.

Usage:
    python scripts/dev/tabulate_trtllm_backend.py --git <tensorrtllm_backend clone or bare mirror> \\
        --cache <NVIDIA/TensorRT-LLM files by commit> --out pipeline/triton/tensorrt_llm_templates.json [RELEASE...]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

MODELS = ("tensorrt_llm", "preprocessing", "postprocessing", "ensemble", "tensorrt_llm_bls")
CPP_FILES = ("model_instance_state.cc", "model_state.cc", "utils.cc")
BACKEND_REPO = "triton-inference-server/tensorrtllm_backend"
TRTLLM_REPO = "NVIDIA/TensorRT-LLM"
# releases tabulated from tensorrtllm_backend tags
TAGS = {"0.18": "v0.18.2", "0.19": "v0.19.0"}
# releases >= 0.20: how tensorrtllm_backend's `tensorrt_llm` submodule pointer names the release commit
RELEASE_POINTERS = {
    "0.20": ("tag", "v0.20.0"),
    "0.21": ("tag", "v0.21.0"),
    "1.0": ("tag", "v1.0.0"),
    "1.1": ("subject", "TensorRT-LLM Backend v1.1.0 release"),
    "1.2": ("subject", "Update TensorRT-LLM submodule to release/1.2@"),
}
# the stored NVIDIA/TensorRT-LLM versions used for every release >= 0.20 (commit each file was read at)
PREFIX = "triton_backend/"
STORED = {
    "models": {
        # 2a9abd95 rather than the other stored tensorrt_llm template 0c8de69a: their tensors are identical, and
        # 0c8de69a only adds an uncommented `enable_trt_overlap` key, which every backend version reads in a try.
        "tensorrt_llm": "2a9abd9536aa62ad3e4b9314be9286b1b1be523b",
        "preprocessing": "08dc37e368e4718ae680bdb9be8da24ebd420a53",
        "postprocessing": "89fd9b74ab7ae753b4c6b3db25a400dca7ea54a0",
        "ensemble": "2a9abd9536aa62ad3e4b9314be9286b1b1be523b",
        "tensorrt_llm_bls": "0193dbd4189221d0fd5e9f20cdb384d3da8dbc24",
    },
    "cpp": {
        "model_instance_state.cc": [
            "0c8de69a1ca6213eebb20a51873890ff128666c2",
            "c8c6df08bd0ead54cd47f7973e1e425c28a174cd",
        ],
        "model_state.cc": ["5cdd69218f8815d6c8c101ca1facf2ec4ac4b622"],
    },
}
STORED_NOTE = (
    "The backend and templates live in NVIDIA/TensorRT-LLM triton_backend/ from 0.20 on. The release commit "
    "(release_commit, tensorrtllm_backend's tensorrt_llm submodule pointer: {pointer}) is NOT stored in the search "
    "index this was read from, which holds other versions of each file; their history is not available, so no "
    "stored version could be tied to a release. Every release >= 0.20 gets this same entry. required_parameters "
    "is the UNION over every stored backend version read (model_instance_state.cc at 0c8de69a and c8c6df08, "
    "verbatim excerpts chars 0-32000 holding every GetParameter call; model_state.cc at 5cdd6921) -- a superset "
    "is safe, the backend ignores parameters it does not read. The models are the stored templates listed in "
    "files (one consistent set: every ensemble step maps only tensors its model declares). Their input tensor "
    "names (tensorrt_llm, ensemble, tensorrt_llm_bls) were reconciled with the release's own docs: "
    "tensorrtllm_backend docs/model_config.md at the release's backend commit (source.docs), the only per-release "
    "evidence of tensor names read; renamed_from_docs lists the stored names renamed to the documented ones "
    "(the stored templates use min_tokens and seed, which the docs list only from the release/1.2 submodule "
    "update on; before, min_length and random_seed, as in tensorrtllm_backend v0.19.0), docs_disagreements "
    "what still differs; the ensemble steps follow the renames. utils.cc "
    "(stored version 19290813, first 16000 chars read) reads no model parameters; v0.18.2/v0.19.0 utils.cc has "
    "no GetParameter call."
)


# ---------------------------------------------------------------- templates (config.pbtxt)

PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")
TYPED = re.compile(r'name:\s*"(\w+)"\s*,?\s*data_type:\s*(\$\{\w+\})')


def tabulate(text: str) -> dict:
    """The interface of one template config.pbtxt: inputs, outputs, parameter keys (and ensemble steps)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    # data types that are template variables keep the variable, e.g. "${logits_datatype}"
    typed = dict(TYPED.findall(text))
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
    line: int
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
        reads.append(Read(file, node.start_point[0] + 1, function_name, cpp_type, name, variable, _guarded(node)))
    return reads


def classify(reads: list[Read]) -> tuple[dict[str, str], list[str]]:
    """(required name -> C++ type, optional names): required when any read of the name is unguarded."""
    required: dict[str, set[str]] = {}
    for r in reads:
        if r.name is not None and not r.guarded:
            required.setdefault(r.name, set()).add(r.cpp_type or "?")
    optional = sorted({r.name for r in reads if r.name is not None} - set(required))
    return {k: " | ".join(sorted(v)) for k, v in sorted(required.items())}, optional


# ---------------------------------------------------------------- sources and entries


def git_show(git_dir: Path, rev: str, path: str) -> str | None:
    result = subprocess.run(["git", "-C", str(git_dir), "show", f"{rev}:{path}"], capture_output=True, text=True)
    return result.stdout if result.returncode == 0 else None


def git_commit(git_dir: Path, rev: str) -> str:
    return subprocess.run(
        ["git", "-C", str(git_dir), "rev-parse", f"{rev}^{{commit}}"], capture_output=True, text=True, check=True
    ).stdout.strip()


def backend_commit(git_dir: Path, release: str) -> str:
    """The tensorrtllm_backend commit of a release >= 0.20: its tag, or the oldest commit with that subject."""
    kind, value = RELEASE_POINTERS[release]
    if kind == "tag":
        return git_commit(git_dir, value)
    log = subprocess.run(
        ["git", "-C", str(git_dir), "log", "--all", "--format=%H %s", f"--grep={value}", "--fixed-strings"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    return log[-1].split()[0]


def release_pointer(git_dir: Path, release: str) -> dict:
    """The NVIDIA/TensorRT-LLM commit tensorrtllm_backend's submodule points to for a release >= 0.20."""
    kind, value = RELEASE_POINTERS[release]
    commit = backend_commit(git_dir, release)
    if kind == "tag":
        how = f"tensorrtllm_backend tag {value} ({commit})"
    else:
        how = f"tensorrtllm_backend commit {commit} '{value}...'"
    tree = subprocess.run(
        ["git", "-C", str(git_dir), "ls-tree", commit, "tensorrt_llm"], capture_output=True, text=True, check=True
    ).stdout.split()
    return {"release_commit": tree[2], "release_commit_from": how}


def entry(files: dict[str, tuple[str, str]], cpp: list[tuple[str, str, str]], source: dict) -> dict:
    """One release's entry from its templates {model: (path, text)} and backend sources [(path, commit, text)]."""
    models = {model: tabulate(text) for model, (_, text) in files.items()}
    reads = [r for path, commit, text in cpp for r in parameter_reads(text, f"{path}@{commit[:8]}")]
    required, optional = classify(reads)
    for r in reads:
        if r.variable is not None:
            print(f"  {r.file}:{r.line} {r.function}: GetParameter({r.variable}) -> {r.name or 'UNRESOLVED'}")
    for problem in consistency_problems(models):
        print(f"  inconsistent templates: {problem}", file=sys.stderr)
    variable_reads = sorted(
        {
            (r.file.split("@")[0].rsplit("/", 1)[-1], r.function, r.variable, r.name or "", r.guarded)
            for r in reads
            if r.variable is not None
        }
    )
    return {
        "source": source,
        "models": models,
        "required_parameters": required,
        "optional_parameters": optional,
        "variable_parameter_reads": [
            {"file": f, "function": fn, "variable": v, "resolved": n or None, "guarded": g}
            for f, fn, v, n, g in variable_reads
        ],
    }


def tagged_entry(git_dir: Path, release: str) -> dict:
    """A release <= 0.19 from tensorrtllm_backend at its tag."""
    tag = TAGS[release]
    commit = git_commit(git_dir, tag)
    files, cpp, read = {}, [], []
    for model in MODELS:
        path = f"all_models/inflight_batcher_llm/{model}/config.pbtxt"
        files[model] = (path, git_show(git_dir, commit, path))
        read.append({"path": path, "commit": commit})
    for name in CPP_FILES:
        path = f"inflight_batcher_llm/src/{name}"
        text = git_show(git_dir, commit, path)
        if text is not None:
            cpp.append((path, commit, text))
            read.append({"path": path, "commit": commit})
    source = {"repo": BACKEND_REPO, "tag": tag, "commit": commit, "files": read}
    return entry(files, cpp, source)


def stored_entry(cache: Path, git_dir: Path, release: str) -> dict:
    """A release >= 0.20 from the stored NVIDIA/TensorRT-LLM versions (see STORED_NOTE)."""
    files, cpp, read = {}, [], []
    for model, commit in STORED["models"].items():
        path = f"{PREFIX}all_models/inflight_batcher_llm/{model}/config.pbtxt"
        files[model] = (path, (cache / commit / path).read_text())
        read.append({"path": path, "commit": commit})
    for name, commits in STORED["cpp"].items():
        path = f"{PREFIX}inflight_batcher_llm/src/{name}"
        for commit in commits:
            cpp.append((path, commit, (cache / commit / path).read_text()))
            read.append(
                {"path": path, "commit": commit, **({"excerpt": "chars 0-32000"} if "instance" in name else {})}
            )
    pointer = release_pointer(git_dir, release)
    source = {
        "repo": TRTLLM_REPO,
        **pointer,
        "note": STORED_NOTE.format(pointer=pointer["release_commit_from"]),
        "files": read,
    }
    return entry(files, cpp, source)


# ---------------------------------------------------------------- docs/model_config.md (documented inputs)

DOC_PATH = "docs/model_config.md"
RECONCILED = ("tensorrt_llm", "ensemble", "tensorrt_llm_bls")
# which docs lists describe a template's inputs: the docs have none for the ensemble (see the module docstring)
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
    some docs read give it, for the template inputs these docs do not list. Does not change `models`."""
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


def docs_commits(git_dir: Path) -> dict[str, str]:
    """release -> the tensorrtllm_backend commit whose docs/model_config.md describes it."""
    commits = {release: git_commit(git_dir, tag) for release, tag in TAGS.items()}
    return commits | {release: backend_commit(git_dir, release) for release in RELEASE_POINTERS}


def descriptions(git_dir: Path, commits: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(name -> description, name -> commit): every documented input's description in the newest docs (of
    `commits`, in release order) that list it."""
    described, where = {}, {}
    for commit in reversed(list(commits.values())):
        for rows in documented_inputs(git_show(git_dir, commit, DOC_PATH)).values():
            for name, row in rows.items():
                if name not in described:
                    described[name], where[name] = row.description, commit
    return described, where


def with_docs(facts: dict, git_dir: Path, release: str, apply: bool) -> dict:
    """The entry `facts` with its tensor names reconciled with the release's docs (see the module docstring)."""
    commits = docs_commits(git_dir)
    described, where = descriptions(git_dir, commits)
    docs = documented_inputs(git_show(git_dir, commits[release], DOC_PATH))
    renamed, disagreements = reconcile(facts["models"], docs, described)
    used = sorted({name for renames in renamed.values() for name in renames})
    facts["source"]["docs"] = {
        "repo": BACKEND_REPO,
        "path": DOC_PATH,
        "commit": commits[release],
        **({"template_names_described_by": {name: where[name] for name in used}} if used else {}),
    }
    if not apply:
        for model, renames in renamed.items():
            print(f"  check: the docs would rename {model} {renames} (not applied)", file=sys.stderr)
        renamed = {}
    apply_renames(facts["models"], renamed)
    for problem in consistency_problems(facts["models"]):
        print(f"  inconsistent templates after renames: {problem}", file=sys.stderr)
    for model, renames in renamed.items():
        print(f"  renamed from docs: {model} {renames}")
    return facts | {"renamed_from_docs": renamed, "docs_disagreements": disagreements}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--git", type=Path, required=True, help="a clone or bare mirror of tensorrtllm_backend")
    parser.add_argument("--cache", type=Path, help="<cache>/<commit>/<path> of the stored NVIDIA/TensorRT-LLM files")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("releases", nargs="*", help="default: all of " + ", ".join([*TAGS, *RELEASE_POINTERS]))
    args = parser.parse_args(argv)
    table = json.loads(args.out.read_text()) if args.out.exists() else {}
    for release in args.releases or [*TAGS, *RELEASE_POINTERS]:
        print(f"{release}:")
        if release in TAGS:
            table[release] = with_docs(tagged_entry(args.git, release), args.git, release, apply=False)
        else:
            if args.cache is None:
                parser.error(f"{release} needs --cache")
            table[release] = with_docs(stored_entry(args.cache, args.git, release), args.git, release, apply=True)
    order = [*TAGS, *RELEASE_POINTERS]
    table = dict(sorted(table.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
    args.out.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
