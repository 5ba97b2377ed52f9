"""Tabulate the facts of Triton's `llmapi` python model (NVIDIA/TensorRT-LLM
`triton_backend/all_models/llmapi/tensorrt_llm/`: config.pbtxt, 1/model.yaml, 1/model.py, 1/helpers.py) for each
TensorRT-LLM release with a PyTorch-backend (LLM API) path.

Maintainer tool, run by scripts/dev/tabulate_all.py. One entry per release:

- `source`: every file read, with its commit (none is a release's own: `release_commit` says which to read).
- `config`: config.pbtxt parsed with Triton's ModelConfig protobuf (backend, max_batch_size if set,
  instance_group, inputs and outputs with name, data_type, dims, optional).
- `model_yaml`: the template model.yaml's keys and values; `model_yaml_path`: how model.py finds it.
- `triton_config`: each key model.py reads from model.yaml's `triton_config`, the Python conversion it applies,
  its default when absent (`required` when it has none) and what model.py does with it.
- `llm_kwargs`: how the rest of model.yaml becomes the LLM's arguments (keys excluded, keys model.py sets itself
  and under which conditions).
- `config_parameters`: config.pbtxt `parameters` model.py reads.
- `sampling_inputs` / `output_config_inputs` / `streaming_input`: what helpers.py makes of each request tensor.
- `required_model_yaml_keys`: model.yaml keys read without a fallback (dotted for nested keys).
- `container`: where tensorrtllm_backend's Dockerfile puts the model in the `-trtllm-python-py3` image and how
  its docs/llmapi.md launches it.
"""

from __future__ import annotations

import ast
import re

import yaml
from google.protobuf import json_format, text_format
from tabulate_trtllm_serving import launch_line_facts
from tritonclient.grpc import model_config_pb2 as mc
from upstream_source import REPO, Upstream, cite, complete_statements, stored_releases

PREFIX = "triton_backend/all_models/llmapi/tensorrt_llm/"
FILES = {"config": "config.pbtxt", "model_yaml": "1/model.yaml", "model_py": "1/model.py", "helpers": "1/helpers.py"}
BACKEND_REPO = "triton-inference-server/tensorrtllm_backend"
DOCKERFILE = "dockerfile/Dockerfile.triton.trt_llm_backend"
DOC = "docs/llmapi.md"

B35 = "b35ac1b64368513d215c57d2ed01d62d910df8da"  # model.py; tensorrt_llm/version.py there: 1.2.0rc2
C044 = "044a90d209e380c95e23e8ae42f3583fa05ada78"  # model.py with multi-instance gpu_device_ids
CFG = "c8c6df08bd0ead54cd47f7973e1e425c28a174cd"  # config.pbtxt and model.yaml
HELPERS = "fab2f90bc62bcf0ca72d7dffbf31c3ddee6f948e"

RELEASES = {
    "1.0": {
        "files": {"config": CFG, "model_yaml": CFG, "model_py": B35, "helpers": HELPERS},
        "release_commit": "ae8270b713446948246f16fadf4e2a32e35d0f62",
        "backend": {"ref": "r25.10", "commit": "e2e72dc83f7255a36738b080446570f32b466781"},
        "note": "Approximate: the nearest copies with the interface 1.0's docs describe (perf-metric outputs); "
        "its cancellation loop and `stop` input may be later than 1.0.",
    },
    "1.1": {
        "files": {"config": CFG, "model_yaml": CFG, "model_py": B35, "helpers": HELPERS},
        "release_commit": "48b7b5d8b7ed1e6bff57aecc6ff7d1533288bed8",
        "backend": {"ref": "r26.02", "commit": "47c80a359531952f58e74ae8e891c010b7663d76"},
        "note": "Approximate: model.py from the main line just after 1.1 branched; 1.1's docs describe the same "
        "interface.",
    },
    "1.2": {
        "files": {"config": CFG, "model_yaml": CFG, "model_py": C044, "helpers": HELPERS},
        "release_commit": "36e34eeffce6af28b60719a0be7dff7c7ebe01a7",
        "backend": {"ref": "r26.07", "commit": "3bc115373ce1fde1d94891964b492449402e3a68"},
        "note": "Approximate: the model.py copy nearest 1.2 (multi-instance gpu_device_ids, as 1.2's docs "
        "describe; none of the later image_url / lora_* inputs).",
    },
}


# ---------------------------------------------------------------- config.pbtxt, model.yaml


def _tensor(t, with_optional: bool) -> dict:
    out = {"name": t.name, "data_type": mc.DataType.Name(t.data_type), "dims": list(t.dims)}
    if with_optional:
        out["optional"] = bool(t.optional)
    return out


def config_facts(text: str) -> dict:
    """config.pbtxt parsed with Triton's ModelConfig protobuf."""
    config = text_format.Parse(text, mc.ModelConfig())
    facts = {"name": config.name, "backend": config.backend}
    if config.max_batch_size:
        facts["max_batch_size"] = config.max_batch_size
    facts["instance_group"] = [
        json_format.MessageToDict(g, preserving_proto_field_name=True) for g in config.instance_group
    ]
    if config.HasField("model_transaction_policy"):
        facts["decoupled"] = config.model_transaction_policy.decoupled
    if config.parameters:
        facts["parameters"] = {k: v.string_value for k, v in config.parameters.items()}
    facts["inputs"] = [_tensor(t, True) for t in config.input]
    facts["outputs"] = [_tensor(t, False) for t in config.output]
    return facts


def model_yaml_facts(text: str) -> dict:
    return yaml.safe_load(text)


# ---------------------------------------------------------------- model.py


def _str(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _subscript_key(node, container: str) -> str | None:
    """`container["key"]` -> "key"."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == container:
        return _str(node.slice)
    return None


def _parents(tree: ast.AST) -> dict:
    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    return parents


def _method(cls: ast.ClassDef, name: str):
    return next((m for m in cls.body if isinstance(m, ast.FunctionDef) and m.name == name), None)


def _use(node, parents) -> str | None:
    """What the value read at `node` feeds: the method it is passed to, or the attribute it is stored in."""
    current = node
    while current in parents:
        parent = parents[current]
        if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Attribute):
            return parent.func.attr
        if isinstance(parent, (ast.Assign, ast.AnnAssign)):
            target = parent.targets[0] if isinstance(parent, ast.Assign) else parent.target
            return f"attribute {target.attr}" if isinstance(target, ast.Attribute) else f"variable {target.id}"
        if isinstance(parent, ast.stmt):
            return None
        current = parent
    return None


def condition_facts(test: ast.expr) -> list[dict]:
    """A condition as the list of what must all hold: a flag (a variable or attribute), or a call's result
    compared with a literal."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return [fact for value in test.values for fact in condition_facts(value)]
    if isinstance(test, ast.Name):
        return [{"flag": test.id}]
    if isinstance(test, ast.Attribute):
        return [{"flag": test.attr}]
    if (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.left, ast.Call)
        and isinstance(test.left.func, ast.Name)
    ):
        operator = {ast.Eq: "==", ast.Gt: ">", ast.Lt: "<", ast.GtE: ">=", ast.LtE: "<="}[type(test.ops[0])]
        return [{"call": test.left.func.id, "op": operator, "value": ast.literal_eval(test.comparators[0])}]
    raise ValueError(f"a condition this tabulator cannot state: {ast.unparse(test)}")


def value_facts(node: ast.expr) -> dict:
    """A value model.py sets: a variable, or the length of an attribute."""
    if isinstance(node, ast.Name):
        return {"variable": node.id}
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "len" and isinstance(node.args[0], ast.Attribute):
        return {"length_of": node.args[0].attr}
    raise ValueError(f"a value this tabulator cannot state: {ast.unparse(node)}")


def _conditions(node, parents, stop) -> list[dict]:
    conditions, current = [], node
    while current in parents and current is not stop:
        current = parents[current]
        if isinstance(current, ast.If):
            conditions[:0] = condition_facts(current.test)
    return conditions


def model_py_facts(text: str) -> dict:
    """What model.py's TritonPythonModel reads from model.yaml and config.pbtxt, and how it builds LLM kwargs."""
    statements = complete_statements(text)
    module = ast.Module(body=statements, type_ignores=[])
    cls = next((s for s in statements if isinstance(s, ast.ClassDef) and s.name == "TritonPythonModel"), None)
    if cls is None:
        cls = next((s for s in statements if isinstance(s, ast.ClassDef)), None)
    if cls is None:
        raise ValueError("no TritonPythonModel class in the text")
    parents = _parents(module)
    facts: dict = {"triton_config": {}, "model_yaml_path": None, "model_yaml_top_level_reads": {}}
    llm: dict = {"excluded_model_yaml_keys": [], "set_by_model": {}}
    config_parameters: dict = {}
    for method in (m for m in cls.body if isinstance(m, ast.FunctionDef)):
        for node in ast.walk(method):
            # os.environ.get('LLM_CONFIG_PATH', 'model.yaml')
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) == "os.environ.get"
                and len(node.args) == 2
                and facts["model_yaml_path"] is None
            ):
                facts["model_yaml_path"] = {
                    "env": _str(node.args[0]),
                    "default": _str(node.args[1]),
                    "relative_to": "the model's directory",
                }
            # get_model_config(...)["triton_config"]: a top-level model.yaml key read without a fallback
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.value, ast.Call)
                and ast.unparse(node.value.func) == "get_model_config"
            ):
                key = _str(node.slice)
                facts["model_yaml_top_level_reads"].setdefault(key, {"required": True, "methods": []})
                if method.name not in facts["model_yaml_top_level_reads"][key]["methods"]:
                    facts["model_yaml_top_level_reads"][key]["methods"].append(method.name)
            # triton_config["k"], with or without `if "k" in triton_config else default`
            key = _subscript_key(node, "triton_config")
            if key is not None:
                entry = facts["triton_config"].setdefault(
                    key, {"required": True, "default": None, "conversion": None, "read_in": [], "used_for": []}
                )
                parent = parents.get(node)
                if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name):
                    entry["conversion"] = parent.func.id
                    outer = parent
                else:
                    outer = node
                holder = parents.get(outer)
                if (
                    isinstance(holder, ast.IfExp)
                    and isinstance(holder.test, ast.Compare)
                    and _str(holder.test.left) == key
                    and isinstance(holder.test.ops[0], ast.In)
                ):
                    entry["required"] = False
                    entry["default"] = ast.literal_eval(holder.orelse)
                    outer = holder
                if method.name not in entry["read_in"]:
                    entry["read_in"].append(method.name)
                use = _use(outer, parents)
                if use and use not in entry["used_for"]:
                    entry["used_for"].append(use)
            # self.llm_engine_args = update_llm_args_with_extra_dict({}, get_model_config(..., exclude_keys=[...]))
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "get_model_config":
                for kw in node.keywords:
                    if kw.arg == "exclude_keys":
                        llm["excluded_model_yaml_keys"] += [_str(e) for e in kw.value.elts]
                        outer = parents.get(node)
                        if isinstance(outer, ast.Call):
                            llm["built_with"] = ast.unparse(outer.func)
            # self.llm_engine_args["k"] = value
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if (
                        isinstance(target, ast.Subscript)
                        and ast.unparse(target.value) == "self.llm_engine_args"
                        and _str(target.slice)
                    ):
                        llm["set_by_model"][_str(target.slice)] = {
                            "value": value_facts(node.value),
                            "when": _conditions(node, parents, method),
                        }
            # self.params.get("gpu_device_ids", {}).get("string_value", "")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and ast.unparse(node.func.value) == "self.params"
            ):
                name = _str(node.args[0])
                config_parameters[name] = {
                    "read_in": method.name,
                    "when": _conditions(node, parents, method),
                    "missing": "raises ValueError"
                    if any(f"{name} parameter required" in (_str(n) or "") for n in ast.walk(method))
                    else "default",
                }
    imports = sorted(
        {
            f"{n.module}.{a.name}"
            for n in ast.walk(module)
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("tensorrt_llm")
            for a in n.names
        }
    )
    llm["tensorrt_llm_imports"] = imports
    facts["llm_kwargs"] = llm
    facts["config_parameters"] = config_parameters
    facts["input_reads"] = sorted(
        {
            _str(n.args[1])
            for n in ast.walk(cls)
            if isinstance(n, ast.Call)
            and ast.unparse(n.func) in ("get_input_scalar_by_name", "get_input_tensor_by_name")
            and len(n.args) > 1
            and _str(n.args[1])
        }
    )
    return facts


# ---------------------------------------------------------------- helpers.py


def _function(statements, name):
    return next((s for s in statements if isinstance(s, ast.FunctionDef) and s.name == name), None)


def _mapping_function(fn: ast.FunctionDef) -> dict:
    """{tensor name: {"field": kwarg name, "default_when_absent": value or None}} of one helpers function."""
    lists, defaults, prefix, out = {}, {}, None, {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if isinstance(node.value, ast.List):
                lists[name] = [_str(e) for e in node.value.elts]
            elif isinstance(node.value, ast.Dict) and name == "default_values":
                defaults = ast.literal_eval(node.value)
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript):
            target = node.targets[0]
            if ast.unparse(target.value) == "param_mappings":
                key = target.slice
                if isinstance(key, ast.JoinedStr):  # f"sampling_param_{arg}"
                    prefix = "".join(_str(v) or "" for v in key.values if isinstance(v, ast.Constant))
                else:
                    prefix = ""
            elif ast.unparse(target.value) == "kwargs" and isinstance(node.value, ast.Call):
                tensor = _str(node.value.args[1]) if len(node.value.args) > 1 else None
                if tensor:
                    out[tensor] = {
                        "field": _str(target.slice),
                        "default_when_absent": None,
                        "read_as": "tensor",
                    }
    for args in lists.values():
        for arg in args:
            tensor = f"{prefix or ''}{arg}"
            out.setdefault(
                tensor,
                {"field": arg, "default_when_absent": defaults.get(tensor), "read_as": "scalar"},
            )
    return out


def helpers_facts(text: str) -> dict:
    statements = complete_statements(text)
    facts = {}
    sampling = _function(statements, "get_sampling_params_from_request")
    if sampling:
        facts["sampling_inputs"] = _mapping_function(sampling)
    output = _function(statements, "get_output_config_from_request")
    if output:
        facts["output_config_inputs"] = _mapping_function(output)
    streaming = _function(statements, "get_streaming_from_request")
    if streaming:
        call = next(
            n for n in ast.walk(streaming) if isinstance(n, ast.Call) and ast.unparse(n.func).startswith("get_input")
        )
        holder = next((n for n in ast.walk(streaming) if isinstance(n, ast.BoolOp)), None)
        facts["streaming_input"] = {
            "tensor": _str(call.args[1]),
            "default_when_absent": ast.literal_eval(holder.values[-1]) if holder else None,
            "becomes": "the `streaming` argument of LLM.generate_async",
        }
    return facts


# ---------------------------------------------------------------- container and launch (tensorrtllm_backend)


def dockerfile_facts(text: str) -> dict:
    """Where the final stage of Dockerfile.triton.trt_llm_backend puts triton_backend/all_models."""
    facts = {}
    for key in ("BASE_IMAGE", "TENSORRTLLM_REPO_TAG"):
        m = re.search(rf"^ARG {key}=(\S+)", text, re.M)
        if m:
            facts[key] = m.group(1)
    workdir = None
    for line in text.splitlines():
        m = re.match(r"WORKDIR\s+(\S+)", line)
        if m:
            workdir = m.group(1)
        m = re.match(r"COPY --from=\S+ \S*/triton_backend/(all_models|scripts) (\S+)", line)
        if m:
            dest = m.group(2) if m.group(2).startswith("/") else f"{workdir}/{m.group(2)}"
            facts[f"{m.group(1)}_dir"] = dest
    if "all_models_dir" in facts:
        facts["llmapi_model_dir"] = facts["all_models_dir"] + "/llmapi/tensorrt_llm"
    if "scripts_dir" in facts:
        facts["launch_script"] = facts["scripts_dir"] + "/launch_triton_server.py"
    return facts


def container_facts(upstream: Upstream, release: str) -> dict:
    backend = RELEASES[release]["backend"]
    read = {path: upstream.read(BACKEND_REPO, path, backend["commit"]) for path in (DOCKERFILE, DOC)}
    return {
        "source": {
            "ref": backend["ref"],
            "files": [cite(BACKEND_REPO, path, backend["commit"], False) for path in read],
        },
        **dockerfile_facts(read[DOCKERFILE]),
        "doc_copies_model_from": "the tensorrt_llm submodule's triton_backend/all_models/llmapi/"
        if "tensorrt_llm/triton_backend/all_models/llmapi" in read[DOC]
        else None,
        "doc_launches": launch_line_facts(read[DOC]),
        "note": "Paths are those the backend's own Dockerfile gives the image; that NVIDIA's published image is "
        "built with it is not shown by the sources read.",
    }


# ---------------------------------------------------------------- one release


def release_entry(upstream: Upstream, release: str) -> dict:
    spec = RELEASES[release]
    texts = {role: upstream.read(REPO, PREFIX + FILES[role], commit) for role, commit in spec["files"].items()}
    files = {
        FILES[role]: cite(REPO, PREFIX + FILES[role], commit, pinned=False) | {"release_commit": spec["release_commit"]}
        for role, commit in spec["files"].items()
    }
    py = model_py_facts(texts["model_py"])
    required = [k for k, v in py["model_yaml_top_level_reads"].items() if v["required"]]
    required += [f"triton_config.{k}" for k, v in py["triton_config"].items() if v["required"]]
    return {
        "source": {"files": files, "note": spec["note"]},
        "config": config_facts(texts["config"]),
        "model_yaml": model_yaml_facts(texts["model_yaml"]),
        "model_yaml_path": py["model_yaml_path"],
        "triton_config": py["triton_config"],
        "llm_kwargs": py["llm_kwargs"]
        | {"from_model_yaml": "every model.yaml key but those excluded, merged by built_with into the LLM's arguments"},
        "config_parameters": py["config_parameters"],
        "model_py_input_reads": py["input_reads"],
        **helpers_facts(texts["helpers"]),
        "required_model_yaml_keys": required,
        "container": container_facts(upstream, release),
    }


def tabulate(upstream: Upstream) -> dict:
    return {"releases": stored_releases({release: release_entry(upstream, release) for release in RELEASES})}
