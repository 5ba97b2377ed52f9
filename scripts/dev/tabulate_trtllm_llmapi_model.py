"""Tabulate, from the real upstream sources, the facts of Triton's `llmapi` python model (NVIDIA/TensorRT-LLM
`triton_backend/all_models/llmapi/tensorrt_llm/`: config.pbtxt, 1/model.yaml, 1/model.py, 1/helpers.py) for each
TensorRT-LLM release with a PyTorch-backend (LLM API) path, into `pipeline/triton/llmapi_model.json`.

Maintainer tool, not run by the pipeline. One entry per release:

- `source`: every file read, with the commit (or index id) it was read at, and a note on how that stored
  version was tied to the release (the search index holds several versions of each file but no release commit).
- `config`: config.pbtxt parsed with Triton's ModelConfig protobuf (backend, max_batch_size if set,
  instance_group, inputs and outputs with name, data_type, dims, optional).
- `model_yaml`: the template model.yaml's keys and values; `model_yaml_path`: how model.py finds it.
- `triton_config`: each key model.py reads from model.yaml's `triton_config`, the Python conversion it applies,
  its default when absent (`required` when it has none) and what model.py does with it.
- `llm_kwargs`: how the rest of model.yaml becomes `LLM(**kwargs)` (keys excluded, keys model.py sets itself).
- `config_parameters`: config.pbtxt `parameters` model.py reads.
- `sampling_inputs` / `output_config_inputs` / `streaming_input`: what helpers.py makes of each request tensor.
- `required_model_yaml_keys`: model.yaml keys read without a fallback (dotted for nested keys).
- `container`: where tensorrtllm_backend's Dockerfile puts the model in the `-trtllm-python-py3` image and how
  its docs/llmapi.md launches it, read with `git show` from a tensorrtllm_backend clone or bare mirror (`--git`).

model.py and helpers.py are parsed with `ast` (model.py was cached as a prefix through `initialize`, so
`upstream_source.complete_statements` keeps only whole statements).

    python scripts/dev/tabulate_trtllm_llmapi_model.py --git <tensorrtllm_backend mirror> \\
        --cache /work/upstream-cache/NVIDIA+TensorRT-LLM --out pipeline/triton/llmapi_model.json
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import yaml
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

sys.path.insert(0, str(Path(__file__).parent))
from upstream_source import REPO, cached_versions, complete_statements, source_record  # noqa: E402

PREFIX = "triton_backend/all_models/llmapi/tensorrt_llm/"
FILES = {"config": "config.pbtxt", "model_yaml": "1/model.yaml", "model_py": "1/model.py", "helpers": "1/helpers.py"}
BACKEND_REPO = "triton-inference-server/tensorrtllm_backend"
DOCKERFILE = "dockerfile/Dockerfile.triton.trt_llm_backend"
DOC = "docs/llmapi.md"

B35 = "b35ac1b64368513d215c57d2ed01d62d910df8da"  # model.py; tensorrt_llm/version.py there: 1.2.0rc2
C044 = "044a90d209e380c95e23e8ae42f3583fa05ada78"  # model.py with multi-instance gpu_device_ids
CFG = "c8c6df08bd0ead54cd47f7973e1e425c28a174cd"  # config.pbtxt and model.yaml
HELPERS = "fab2f90bc62bcf0ca72d7dffbf31c3ddee6f948e"

_COMMON = (
    "The index holds no release commit of these files (model.py at the submodule commits ae8270b7 (v1.0.0), "
    "48b7b5d8 (backend v1.1.0 release), 36e34eef (release/1.2 update) and ca88df0a (r26.07, release/1.2.1) "
    "answers 'stored, but not at that commit'). Versions read: model.py {b35} (version.py 1.2.0rc2), {c044} "
    "(adds multi-instance gpu_device_ids; version.py not stored there) and index id 3832147733 (no commit given; "
    "older: picks tensorrt_llm._tensorrt_engine.LLM or the PyTorch LLM by model.yaml `backend`, no cancellation, "
    "no `stop` input, no perf-metric outputs); config.pbtxt {cfg} and 0a710573 (newer: adds image_url and "
    "lora_* inputs, which neither model.py read handles); model.yaml {cfg} and 0ebb1536 (newer: only a "
    "commented logits_post_processors block more); helpers.py {helpers} (the only version read). config.pbtxt "
    "{cfg}, model.yaml {cfg} and helpers.py {helpers} are the versions consistent with both model.py versions "
    "tabulated (the inputs helpers.py reads are those config.pbtxt declares; the outputs model.py writes are "
    "those it declares)."
).format(b35=B35[:8], c044=C044[:8], cfg=CFG[:8], helpers=HELPERS[:8])
RELEASES = {
    "1.0": {
        "files": {"config": CFG, "model_yaml": CFG, "model_py": B35, "helpers": HELPERS},
        "backend_ref": "r25.10",
        "note": "APPROXIMATE. " + _COMMON + " 1.0's own docs (tensorrtllm_backend r25.10, whose submodule is "
        "v1.0.0 ae8270b7) already document sampling_param_return_perf_metrics and the perf-metric outputs, which "
        "the older id-3832147733 model.py lacks, so the nearest stored version matching 1.0's documented interface "
        "is model.py b35ac1b6 (a later 1.2.0rc2 snapshot); its cancellation loop and `stop` input may postdate 1.0.",
    },
    "1.1": {
        "files": {"config": CFG, "model_yaml": CFG, "model_py": B35, "helpers": HELPERS},
        "backend_ref": "r26.02",
        "note": "APPROXIMATE. " + _COMMON + " model.py b35ac1b6 is 1.2.0rc2, the main line just after 1.1 branched; "
        "1.1's docs (r26.02, submodule 39b3c229; identical docs/llmapi.md to r25.10) describe the same interface "
        "(perf metrics, multi-node trtllm-llmapi-launch, no multi-instance).",
    },
    "1.2": {
        "files": {"config": CFG, "model_yaml": CFG, "model_py": C044, "helpers": HELPERS},
        "backend_ref": "r26.07",
        "note": "APPROXIMATE. " + _COMMON + " model.py 044a90d2 adds multi-instance gpu_device_ids, which the "
        "docs first describe at the release/1.2 submodule update (tensorrtllm_backend 854b3493, submodule "
        "36e34eef) and still do at r26.07 (release/1.2.1, ca88df0a); it reads neither image_url nor lora_* "
        "(the newer config 0a710573), so it is the stored version nearest 1.2. The chars 32000-35524 of it "
        "were not read.",
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


def _use(node, parents) -> str:
    """What the value read at `node` feeds: the chain of calls / the assignment target around it."""
    steps, current = [], node
    while current in parents:
        parent = parents[current]
        if isinstance(parent, ast.Call):
            steps.append(ast.unparse(parent.func) + "(" + (steps.pop() if steps else "...") + ")")
        elif isinstance(parent, ast.keyword):
            steps.append(f"{parent.arg}=...")
        elif isinstance(parent, (ast.Assign, ast.AnnAssign)):
            targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
            steps.append("-> " + ", ".join(ast.unparse(t) for t in targets))
            break
        elif isinstance(parent, (ast.Expr, ast.Return, ast.stmt)):
            break
        current = parent
    return " ".join(steps)


def model_py_facts(text: str, cut_start: bool = False, cut_end: bool = False) -> dict:
    """What model.py's TritonPythonModel reads from model.yaml and config.pbtxt, and how it builds LLM kwargs."""
    statements = complete_statements(text, cut_start, cut_end)
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
                    "relative_to": "pb_utils.get_model_dir() (the model's directory)",
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
                        conditions, current = [], node
                        while current in parents and current is not method:
                            current = parents[current]
                            if isinstance(current, ast.If):
                                conditions.append(ast.unparse(current.test))
                        llm["set_by_model"][_str(target.slice)] = {
                            "value": ast.unparse(node.value),
                            "when": " and ".join(reversed(conditions)) or "always",
                        }
            # self.params.get("gpu_device_ids", {}).get("string_value", "")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and ast.unparse(node.func.value) == "self.params"
            ):
                name = _str(node.args[0])
                conditions, current = [], node
                while current in parents and current is not method:
                    current = parents[current]
                    if isinstance(current, ast.If):
                        conditions.append(ast.unparse(current.test))
                config_parameters[name] = {
                    "read_in": method.name,
                    "when": " and ".join(reversed(conditions)) or "always",
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
                        "read_as": "tensor (" + ast.unparse(node.value.func) + ")",
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


def git_show(git_dir: Path, rev: str, path: str) -> str:
    return subprocess.run(
        ["git", f"--git-dir={git_dir}" if (git_dir / "HEAD").exists() else f"--git-dir={git_dir / '.git'}", "show",
         f"{rev}:{path}"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip


def git_rev(git_dir: Path, rev: str) -> str:
    return subprocess.run(
        ["git", f"--git-dir={git_dir}", "rev-parse", rev], check=True, capture_output=True, text=True
    ).stdout.strip()


def submodule_commit(git_dir: Path, rev: str) -> str:
    out = subprocess.run(
        ["git", f"--git-dir={git_dir}", "ls-tree", rev, "tensorrt_llm"], check=True, capture_output=True, text=True
    ).stdout.split()
    return out[2]


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


def doc_launch_commands(text: str) -> list[str]:
    """The shell lines of docs/llmapi.md that copy or launch the llmapi model (continuations joined)."""
    joined = re.sub(r"\\\n\s*", " ", text)
    keep = ("launch_triton_server.py", "trtllm-llmapi-launch", "all_models/llmapi")
    lines = [line.strip() for line in joined.splitlines() if any(k in line for k in keep) and "`" not in line]
    return list(dict.fromkeys(re.sub(r"\s+", " ", line) for line in lines))


def container_facts(git_dir: Path, ref: str) -> dict:
    facts = dockerfile_facts(git_show(git_dir, ref, DOCKERFILE))
    return {
        "source": {
            "repo": BACKEND_REPO,
            "ref": ref,
            "commit": git_rev(git_dir, ref),
            "tensorrt_llm_submodule": submodule_commit(git_dir, ref),
            "files": [DOCKERFILE, DOC],
        },
        **facts,
        "launch_commands": doc_launch_commands(git_show(git_dir, ref, DOC)),
        "note": "Paths are those tensorrtllm_backend's own Dockerfile.triton.trt_llm_backend gives the image (WORKDIR "
        "/app; COPY of the TensorRT-LLM clone's triton_backend/ dirs at TENSORRTLLM_REPO_TAG, a release branch, "
        "not a tag). That NVIDIA's published nvcr.io image is built with this Dockerfile is not shown by any "
        "source read. docs/llmapi.md itself copies the model from a tensorrtllm_backend checkout's tensorrt_llm "
        "submodule (tensorrt_llm/triton_backend/all_models/llmapi/), not from the image.",
    }


# ---------------------------------------------------------------- one release


def _cached(cache: Path, commit: str, path: str) -> dict:
    found = [v for v in cached_versions(cache, path) if v["version"] == commit]
    if not found:
        raise FileNotFoundError(f"{cache}/{commit}/{path} is not cached")
    return found[0]


def release_entry(cache: Path, git_dir: Path | None, release: str) -> dict:
    spec = RELEASES[release]
    files, texts = {}, {}
    for role, commit in spec["files"].items():
        path = PREFIX + FILES[role]
        texts[role] = _cached(cache, commit, path)
        files[FILES[role]] = source_record(cache, commit, path)
    py = model_py_facts(texts["model_py"]["text"], texts["model_py"]["cut_start"], texts["model_py"]["cut_end"])
    helpers = helpers_facts(texts["helpers"]["text"])
    config = config_facts(texts["config"]["text"])
    required = [k for k, v in py["model_yaml_top_level_reads"].items() if v["required"]]
    required += [f"triton_config.{k}" for k, v in py["triton_config"].items() if v["required"]]
    entry = {
        "source": {"repo": REPO, "path": PREFIX, "files": files, "note": spec["note"]},
        "config": config,
        "model_yaml": model_yaml_facts(texts["model_yaml"]["text"]),
        "model_yaml_path": py["model_yaml_path"],
        "triton_config": py["triton_config"],
        "llm_kwargs": py["llm_kwargs"]
        | {
            "from_model_yaml": "every model.yaml key except those excluded, passed through "
            f"{py['llm_kwargs'].get('built_with')}({{}}, ...) and then to LLM(**kwargs) on MPI rank 0",
        },
        "config_parameters": py["config_parameters"],
        "model_py_input_reads": py["input_reads"],
        **helpers,
        "required_model_yaml_keys": required,
    }
    if git_dir is not None:
        entry["container"] = container_facts(git_dir, spec["backend_ref"])
    return entry


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, required=True, help="<cache>/<commit>/<path> of NVIDIA/TensorRT-LLM")
    parser.add_argument("--git", type=Path, help="a bare mirror or clone of tensorrtllm_backend (container facts)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("releases", nargs="*", help="default: all of " + ", ".join(RELEASES))
    args = parser.parse_args(argv)
    table = json.loads(args.out.read_text()) if args.out.exists() else {}
    for release in args.releases or list(RELEASES):
        print(f"{release}:")
        table[release] = release_entry(args.cache, args.git, release)
    table = dict(sorted(table.items(), key=lambda kv: list(RELEASES).index(kv[0])))
    args.out.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
