"""Tabulate what TensorRT-LLM takes of a LoRA adapter, per release, into pipeline/upstream/trtllm_lora.json.

Maintainer tool, run by scripts/dev/tabulate_all.py. Facts:
- `request`: what the C++ runtime behind the `tensorrtllm` Triton backend reads as one adapter (a request's
  `lora_weights` / `lora_config` tensors, or a prefetched task's .npy files). Not per release: the copies in
  `REQUEST_SOURCES` were read, none at a release's own commit (`pinned` false).
  - `module_ids` (loraModule.h): each module name `toModuleType` knows -> its ModuleType enum value, the id a
    `lora_config` row names.
  - `modules` (loraModule.cpp `createLoraModules`): per module, its in/out dimension as an expression over `locals`
    (themselves expressions over the function's parameters), whether in/out dimension comes first in its weights,
    and the tensor-parallel split dimensions; the runtime splits full (unsplit) weights itself.
  - `validation` (loraUtils.cpp `loraValidateRequestTensorDims` / `loraValidateRequestTensors`): the batch size and
    rank of both tensors, the `lora_config` data type, and that `lora_weights` must have the model's data type and
    adapter sizes at most the engine's max LoRA rank.
  - `converter` (examples/hf_lora_convert.py, what the release's docs/lora.md has users run): HF module -> TensorRT-LLM
    module; the `lora_config` row columns; a `lora_weights` row as the flattened parts in order (in = lora_A, out =
    lora_B), which part is scaled and by which adapter_config.json keys; rows padded to the longest; the leading batch
    dimension; the file written per tensor; the storage types it offers.
  - `npy_types` (numpyUtils.cpp `typeFromNumpyDesc`): the .npy type codes the runtime's loader reads -> data type.
- `releases`, per release of the engine workflow (the releases of scripts/dev/tabulate_trtllm_backend.py, whose
  backend sources and docs are read here too):
  - `cache_parameters`: the LoRA / PEFT cache parameters model_instance_state.cc `getPeftCacheConfigFromParams`
    reads, each with the C++ type and the value the backend uses when the parameter is absent (null: left to the
    executor); every version of the file read must agree.
  - `prefetch`: the release's docs/lora.md layout of `lora_prefetch_dir` (example task folders and the files in each),
    null where the docs describe none.
  - `llm_api`, for the releases of `LLM_API` (the PyTorch backend's LLM-API `lora_config`): the LoraConfig class of
    tensorrt_llm/lora_helper.py (dataclass or pydantic, its fields with type and default) and its default
    TensorRT-LLM -> HF module mapping; null before 1.0.
"""

from __future__ import annotations

import ast
import re

from tabulate_trtllm_backend import BACKEND_REPO, RELEASES, release_files
from upstream_source import REPO, UnrecognizedSource, Upstream, cite, complete_statements, find_def, stored_releases

LORA_MODULE_H = "cpp/include/tensorrt_llm/runtime/loraModule.h"
LORA_MODULE_CPP = "cpp/tensorrt_llm/runtime/loraModule.cpp"
LORA_UTILS_CPP = "cpp/tensorrt_llm/runtime/loraUtils.cpp"
NUMPY_UTILS_CPP = "cpp/tensorrt_llm/runtime/utils/numpyUtils.cpp"
CONVERTER = "examples/hf_lora_convert.py"
LORA_HELPER = "tensorrt_llm/lora_helper.py"
LORA_DOC = "docs/lora.md"
# The copies read for `request` (none at a release commit; the LoRA request format is the same in all of them).
REQUEST_SOURCES = {
    LORA_MODULE_H: "0ccc36f72d7e04eb37ef72b4739030e1bc541e05",
    LORA_MODULE_CPP: "2a9abd9536aa62ad3e4b9314be9286b1b1be523b",
    LORA_UTILS_CPP: "2a9abd9536aa62ad3e4b9314be9286b1b1be523b",
    NUMPY_UTILS_CPP: "05316d3313360012536ace46c781518f5afae75e",
    CONVERTER: "05316d3313360012536ace46c781518f5afae75e",
}
# The lora_helper.py copies read per LLM-API release, chosen by content (neither is a release's own commit).
LLM_API = {
    "1.0": "037d4ba10931fbb9777d52fba06a9aef4b41acdd",
    "1.1": "037d4ba10931fbb9777d52fba06a9aef4b41acdd",
    "1.2": "585c756579dc4d01f21fc13c2f604cdb461ac4f0",
}
NOTE = (
    "request: the C++ runtime's LoRA request format (Triton inputs lora_weights / lora_config, or lora_prefetch_dir "
    "files), read from copies at the cited commits, not the releases' own. llm_api: LoraConfig of lora_helper.py, "
    "chosen by content: 1.0 and 1.1 from a dataclass copy (its last field, swap_gate_up_proj, was renamed "
    "swap_gate_up_proj_lora_b_weight before a release: low confidence for that field), 1.2 from a pydantic copy; "
    "the fields lora_dir, lora_ckpt_source, max_lora_rank, lora_target_modules, trtllm_modules_to_hf_modules, "
    "max_loras and max_cpu_loras have the same types and defaults in every copy read."
)


# ---------------------------------------------------------------- loraModule.h / loraModule.cpp


def module_members(header: str) -> dict[str, str]:
    """{module name: ModuleType member}, from `toModuleType`'s name comparisons."""
    names = dict(re.findall(r'name\s*==\s*"(\w+)"\s*\)\s*return\s+ModuleType::(k\w+)\s*;', header))
    if not names:
        raise UnrecognizedSource('no `name == "...") return ModuleType::k...` in toModuleType')
    return names


def module_ids(header: str) -> dict[str, int]:
    """{module name: ModuleType value}: `toModuleType`'s names joined with the enum's values."""
    enum = re.search(r"enum class ModuleType\b[^{]*\{(.*?)\};", header, re.S)
    if enum is None:
        raise UnrecognizedSource("no `enum class ModuleType` in loraModule.h")
    values = {k: int(v) for k, v in re.findall(r"\b(k\w+)\s*=\s*(-?\d+)", enum.group(1))}
    return {name: values[member] for name, member in module_members(header).items()}


def _arguments(text: str) -> list[str]:
    """The comma-separated arguments of a call's argument text, split at top level only."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    return [*parts, current.strip()]


def _arithmetic(expression: str) -> str | None:
    """`expression` normalized (ast.unparse) when it is arithmetic over names and integers, else None."""
    try:
        tree = ast.parse(expression, mode="eval").body
    except SyntaxError:
        return None
    allowed = (ast.BinOp, ast.Name, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Load)
    if all(isinstance(node, allowed) for node in ast.walk(tree)):
        return ast.unparse(tree)
    return None


def module_dimensions(source: str) -> dict:
    """createLoraModules: {"locals": {name: expression}, "by_module": {ModuleType member: {in_dim, out_dim,
    in_dim_first, out_dim_first, in_tp_split_dim, out_tp_split_dim}}}, the dimensions being expressions over the
    locals and the function's parameters."""
    function = re.search(r"LoraModule::createLoraModules\((.*?)\)\s*\{(.*)\n\}", source, re.S)
    if function is None:
        raise UnrecognizedSource("no LoraModule::createLoraModules definition in loraModule.cpp")
    body = function.group(2)
    local = {
        name: normalized
        for name, expression in re.findall(r"auto const (\w+)\s*=\s*([^;]+);", body)
        if (normalized := _arithmetic(expression))
    }
    switch = re.search(r"switch \(t\)\s*\{(.*)\n\s*\}", body, re.S)
    if switch is None:
        raise UnrecognizedSource("no `switch (t)` over the module types in createLoraModules")
    modules, pending = {}, []
    for case, call in re.findall(r"case ModuleType::(k\w+):|modules\.emplace_back\((.*?)\);", switch.group(1), re.S):
        if case:
            pending.append(case)
            continue
        args = _arguments(" ".join(call.split()))
        if len(args) != 7 or args[0] != "t":
            raise UnrecognizedSource(
                f"emplace_back({call}) is not LoraModule(t, in, out, inFirst, outFirst, split, split)"
            )
        spec = {
            "in_dim": _arithmetic(args[1]),
            "out_dim": _arithmetic(args[2]),
            "in_dim_first": args[3] == "true",
            "out_dim_first": args[4] == "true",
            "in_tp_split_dim": int(args[5]),
            "out_tp_split_dim": int(args[6]),
        }
        if spec["in_dim"] is None or spec["out_dim"] is None:
            raise UnrecognizedSource(f"a module dimension that is not arithmetic: {call}")
        modules |= {member: spec for member in pending}
        pending = []
    return {"locals": local, "by_module": modules}


def modules_by_name(header: str, dimensions: dict) -> dict[str, dict]:
    """The dimensions keyed by module name (the header's toModuleType pairs name and enum member)."""
    by_member = dimensions["by_module"]
    return {name: by_member[member] for name, member in module_members(header).items() if member in by_member}


# ---------------------------------------------------------------- loraUtils.cpp


def _found(pattern: str, source: str, what: str) -> re.Match:
    match = re.search(pattern, source)
    if match is None:
        raise UnrecognizedSource(f"loraUtils.cpp no longer {what}")
    return match


def validation(source: str) -> dict:
    """What loraValidateRequestTensorDims / loraValidateRequestTensors require of a request's LoRA tensors."""
    constant = r"SizeType32 constexpr {} = (\d+);"
    return {
        "batch_size": int(_found(constant.format("expectedBatchSize"), source, "fixes the batch size").group(1)),
        "weights_rank": int(_found(constant.format("expectedWeightsDims"), source, "fixes the weights' rank").group(1)),
        "config_rank": int(_found(constant.format("expectedKeysDims"), source, "fixes the config's rank").group(1)),
        "config_data_type": _found(
            r"keys->getDataType\(\) == nvinfer1::DataType::k(\w+)", source, "checks the config's data type"
        ).group(1),
        "weights_data_type": "model"
        if _found(r"weights->getDataType\(\) == modelConfig\.getDataType\(\)", source, "checks the weights' data type")
        else None,
        "max_adapter_size": "max_lora_rank"
        if _found(r"maxAdapterSize = modelConfig\.getMaxLoraRank\(\)", source, "bounds the adapter size")
        and _found(r"adapterSize <= maxAdapterSize", source, "bounds the adapter size")
        else None,
    }


# ---------------------------------------------------------------- hf_lora_convert.py


def _function(statements: list[ast.stmt], name: str) -> ast.FunctionDef:
    function = find_def(statements, name)
    if not isinstance(function, ast.FunctionDef):
        raise UnrecognizedSource(f"no {name}() in the converter")
    return function


def _config_keys(function: ast.FunctionDef) -> dict[str, str]:
    """Local variable -> adapter_config.json key, from `var = config.get("key"[, default])`."""
    keys = {}
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute)
            and node.value.func.attr == "get"
            and isinstance(node.value.args[0], ast.Constant)
        ):
            keys[node.targets[0].id] = node.value.args[0].value
    return keys


def _in_keys(node: ast.expr, keys: dict[str, str]) -> str:
    """An expression's text with its local variables renamed to the config keys they hold."""
    renamed = ast.parse(ast.unparse(node), mode="eval").body
    for name in ast.walk(renamed):
        if isinstance(name, ast.Name) and name.id in keys:
            name.id = keys[name.id]
    return ast.unparse(renamed)


def _scale(function: ast.FunctionDef, keys: dict[str, str]) -> dict:
    """`scale` as the converter computes it: {"default": expr, "<flag key>": expr} over adapter_config.json keys."""
    for node in ast.walk(function):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id in keys:
            branches = {}
            for key, body in ((keys[node.test.id], node.body), ("default", node.orelse)):
                assign = next((s for s in body if isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "scale"))
                branches[key] = _in_keys(assign.value, keys)
            return branches
    raise UnrecognizedSource("the converter no longer computes `scale` under an adapter_config flag")


def _row_parts(function: ast.FunctionDef) -> tuple[list[str], str]:
    """(the weight parts in row order, the part multiplied by `scale`)."""
    for node in ast.walk(function):
        if isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple):
            parts = [element.elts[1].value for element in node.iter.elts]
            for inner in ast.walk(node):
                if (
                    isinstance(inner, ast.If)
                    and isinstance(inner.test, ast.Compare)
                    and "* scale" in ast.unparse(inner.body[0])
                ):
                    return parts, inner.test.comparators[0].value
    raise UnrecognizedSource("the converter no longer loops over (in, out) weight parts scaling one")


def _config_columns(function: ast.FunctionDef) -> list[str]:
    """The names of the values appended as one lora_config row (a lookup in a *_module_id map is `module_id`)."""
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) == "converted_config.append"
            and isinstance(node.args[0], ast.List)
        ):
            columns = []
            for element in node.args[0].elts:
                if isinstance(element, ast.Subscript) and ast.unparse(element.value).endswith("module_id"):
                    columns.append("module_id")
                elif isinstance(element, ast.Name):
                    columns.append(element.id)
                else:
                    raise UnrecognizedSource(f"a lora_config column that is neither a name nor an id lookup: {element}")
            return columns
    raise UnrecognizedSource("no converted_config.append([...]) in the converter")


def _files(statements: list[ast.stmt], function: ast.FunctionDef) -> dict[str, str]:
    """Tensor key -> file name: save_val's f-string with the .npy suffix, for every key saved with write_npy."""
    saver = _function(statements, "save_val")
    save = next(n for n in ast.walk(saver) if isinstance(n, ast.Call) and ast.unparse(n.func) == "np.save")
    template = next(n for n in ast.walk(save.args[0]) if isinstance(n, ast.JoinedStr))
    npy = next(n.body.value for n in ast.walk(saver) if isinstance(n, ast.IfExp) and ast.unparse(n.test) == "write_npy")
    pattern = "".join(
        part.value if isinstance(part, ast.Constant) else "{" + ast.unparse(part.value) + "}"
        for part in template.values
    )
    files = {}
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "save_val":
            options = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            if options.get("write_npy") and options.get("tp_num") is None:
                key = ast.literal_eval(node.args[2])
                files[key] = pattern.format(key=key, suffix=npy)
    return files


def converter(source: str) -> dict:
    statements = complete_statements(source)
    module = {
        s.targets[0].id: s.value
        for s in statements
        if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)
    }
    if "hf_modules_to_trtllm_modules" not in module:
        raise UnrecognizedSource("no hf_modules_to_trtllm_modules mapping in the converter")
    function = _function(statements, "convert_hf_model")
    keys = _config_keys(function)
    parts, scaled = _row_parts(function)
    text = ast.unparse(function)
    storage = next(
        (
            {k.arg: ast.literal_eval(k.value) for k in n.keywords if k.arg in ("choices", "default")}
            for n in ast.walk(ast.Module(body=statements, type_ignores=[]))
            if isinstance(n, ast.Call)
            and n.args
            and isinstance(n.args[0], ast.Constant)
            and n.args[0].value == "--storage-type"
        ),
        None,
    )
    if storage is None:
        raise UnrecognizedSource("no --storage-type argument in the converter")
    return {
        "hf_modules": ast.literal_eval(module["hf_modules_to_trtllm_modules"]),
        "config_columns": _config_columns(function),
        "row_parts": parts,
        "scaled_part": scaled,
        "scale": _scale(function, keys),
        "rows_padded_to_longest": "torch.nn.functional.pad" in text,
        "leading_batch_dim": text.count(".unsqueeze(0)") >= 2,
        "files": _files(statements, function),
        "storage_types": storage["choices"],
        "default_storage_type": storage["default"],
    }


# ---------------------------------------------------------------- numpyUtils.cpp


def npy_types(source: str) -> dict[str, str]:
    """The .npy type codes typeFromNumpyDesc maps to a data type (any other code is refused)."""
    function = re.search(r"typeFromNumpyDesc\(std::string type\)\s*\{(.*?)\n\}", source, re.S)
    if function is None:
        raise UnrecognizedSource("no typeFromNumpyDesc in numpyUtils.cpp")
    return dict(re.findall(r'\{"([^"]+)",\s*dt::k(\w+)\}', function.group(1)))


# ---------------------------------------------------------------- model_instance_state.cc


def cache_parameters(source: str) -> dict[str, dict]:
    """{parameter: {"type": C++ type, "default": value or None}} of getPeftCacheConfigFromParams."""
    function = re.search(r"getPeftCacheConfigFromParams\(\)\s*\{(.*?)\n\}", source, re.S)
    if function is None:
        raise UnrecognizedSource("no getPeftCacheConfigFromParams in model_instance_state.cc")
    body = function.group(1)
    defaults = {}
    for name, value in re.findall(r"^\s*(?:SizeType32|std::optional<[\w:]+>)\s+(\w+)\s*=\s*([^;]+);", body, re.M):
        defaults[name] = None if value.strip() == "std::nullopt" else ast.literal_eval(value.strip())
    reads = re.findall(
        r'fieldName = "(\w+)";\s*try\s*\{\s*(\w+) = model_state_->GetParameter<([\w:]+)>\(fieldName\);', body
    )
    if not reads:
        raise UnrecognizedSource("getPeftCacheConfigFromParams no longer reads fieldName in try blocks")
    return {parameter: {"type": cpp_type, "default": defaults[variable]} for parameter, variable, cpp_type in reads}


# ---------------------------------------------------------------- docs/lora.md


def prefetch_layout(doc: str) -> dict | None:
    """The lora_prefetch_dir layout the docs draw: {"task_folders": [...], "files": [...]}, None without one."""
    section = re.search(r"^#+ prefetch lora cache.*?\n```\w*\n(.*?)```", doc, re.S | re.M | re.I)
    if section is None:
        return None
    folders, files = [], set()
    for indent, name in re.findall(r"^((?:│   |    )*)(?:├── |└── )(.+)$", section.group(1), re.M):
        if indent:
            files.add(name.strip())
        else:
            folders.append(name.strip())
    if not folders or not files:
        raise UnrecognizedSource("the prefetch section's tree has no task folders or no files")
    return {"task_folders": folders, "files": sorted(files)}


# ---------------------------------------------------------------- lora_helper.py


def _default(node: ast.expr | None):
    """A field default: the literal, {"factory": name} for field/Field(default_factory=...), or "required"."""
    if node is None:
        return "required"
    if isinstance(node, ast.Call) and ast.unparse(node.func) in ("field", "Field"):
        keywords = {k.arg: k.value for k in node.keywords}
        if "default_factory" in keywords:
            return {"factory": ast.unparse(keywords["default_factory"])}
        return _default(keywords.get("default"))
    try:
        return ast.literal_eval(node)
    except ValueError as error:
        raise UnrecognizedSource(f"a LoraConfig default that is not a literal: {ast.unparse(node)}") from error


def lora_helper(source: str) -> dict:
    statements = complete_statements(source)
    config = find_def(statements, "LoraConfig")
    mapping = find_def(statements, "get_default_trtllm_modules_to_hf_modules")
    if not isinstance(config, ast.ClassDef) or mapping is None:
        raise UnrecognizedSource("lora_helper.py lacks LoraConfig or get_default_trtllm_modules_to_hf_modules")
    if any(ast.unparse(base) == "BaseModel" for base in config.bases):
        kind = "pydantic"
    elif any(ast.unparse(d) == "dataclass" for d in config.decorator_list):
        kind = "dataclass"
    else:
        raise UnrecognizedSource("LoraConfig is neither a pydantic BaseModel nor a dataclass")
    fields = {
        node.target.id: {"type": ast.unparse(node.annotation), "default": _default(node.value)}
        for node in config.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    returned = next(n.value for n in ast.walk(mapping) if isinstance(n, ast.Return))
    return {"kind": kind, "fields": fields, "trtllm_modules_to_hf_modules": ast.literal_eval(returned)}


# ---------------------------------------------------------------- the table


def request_facts(upstream: Upstream) -> dict:
    text = {path: upstream.read(REPO, path, commit) for path, commit in REQUEST_SOURCES.items()}
    dimensions = module_dimensions(text[LORA_MODULE_CPP])
    return {
        "source": [cite(REPO, path, commit, pinned=False) for path, commit in REQUEST_SOURCES.items()],
        "module_ids": module_ids(text[LORA_MODULE_H]),
        "module_locals": dimensions["locals"],
        "modules": modules_by_name(text[LORA_MODULE_H], dimensions),
        "validation": validation(text[LORA_UTILS_CPP]),
        "converter": converter(text[CONVERTER]),
        "npy_types": npy_types(text[NUMPY_UTILS_CPP]),
    }


def release_block(upstream: Upstream, release: str) -> dict:
    _, backend = release_files(release)
    states = [s for s in backend if s["path"].endswith("/model_instance_state.cc")]
    read = [cache_parameters(upstream.read(s["repo"], s["path"], s["commit"])) for s in states]
    if any(other != read[0] for other in read[1:]):
        raise UnrecognizedSource(f"{release}: the model_instance_state.cc versions read disagree on the LoRA cache")
    doc = cite(BACKEND_REPO, LORA_DOC, RELEASES[release].backend_commit)
    block = {
        "source": {"backend": states, "docs": doc},
        "cache_parameters": read[0],
        "prefetch": prefetch_layout(upstream.read(doc["repo"], doc["path"], doc["commit"])),
        "llm_api": None,
    }
    if release in LLM_API:
        helper = cite(REPO, LORA_HELPER, LLM_API[release], pinned=False)
        block["source"]["llm_api"] = helper
        block["llm_api"] = lora_helper(upstream.read(REPO, LORA_HELPER, LLM_API[release]))
    return block


def tabulate(upstream: Upstream) -> dict:
    releases = {release: release_block(upstream, release) for release in RELEASES}
    return {"note": NOTE, "request": request_facts(upstream), "releases": stored_releases(releases)}
