"""Tabulate how TensorRT-LLM 1.0, 1.1 and 1.2 are served, for the Kubernetes manifests (issue #16).

Maintainer tool, run by scripts/dev/tabulate_all.py. One entry per release:

- `trtllm_serve` (PyTorch backend): the HTTP routes OpenAIServer registers (path, methods, handler method,
  condition), the Prometheus mount, and the `serve` command's CLI options (name, aliases, default).
- `llmapi_launch`: what `trtllm-llmapi-launch` reads from the environment, exports and runs on rank 0 / others.
- `triton_engine`: the mpirun command `launch_triton_server.py` builds (evaluated for two ranks from the source's
  `get_cmd`, with its helpers), the `nv_trt_llm_*` metric families and labels of the C++ backend's
  custom_metrics_reporter.cc, and those the release's tensorrtllm_backend README documents.
- `triton_core`: the Triton core metric the autoscaling alternatives name (docs/user_guide/metrics.md).
- `source`: every file read, with its commit.

None of the NVIDIA/TensorRT-LLM copies read is at a release's own commit (`pinned` false; `release_commit` says
which commit to read to pin them).
"""

from __future__ import annotations

import ast
import re
from types import SimpleNamespace

from tabulate_trtllm_llm_args import flag_type
from upstream_source import REPO, UnrecognizedSource, Upstream, cite, complete_statements, stored_releases

BACKEND_REPO = "triton-inference-server/tensorrtllm_backend"
TRITON_REPO = "triton-inference-server/server"
SERVE = "tensorrt_llm/commands/serve.py"
OPENAI = "tensorrt_llm/serve/openai_server.py"
LAUNCHER = "tensorrt_llm/llmapi/trtllm-llmapi-launch"
LAUNCH_SCRIPT = "triton_backend/scripts/launch_triton_server.py"
METRICS_CC = "triton_backend/inflight_batcher_llm/src/custom_metrics_reporter/custom_metrics_reporter.cc"
TRITON_METRICS_DOC = "docs/user_guide/metrics.md"
LLMAPI_DOC = "docs/llmapi.md"
SERVE_OPTIONS = ("--host", "--port", "--backend", "--tp_size", "--pp_size", "--config", "--extra_llm_api_options")

# The commits read. Only serve.py differs between releases; the other copies are the newest ones found.
COMMITS = {
    OPENAI: "e7f7345e31e574b5d0918b756b871882c7346b3c",
    LAUNCHER: "020c89e64e49f24102f1b62be96a1a68283cdf7a",
    LAUNCH_SCRIPT: "0a2e2c1f1268b34586393794045691b666ba28be",
    METRICS_CC: "0d5352f5fc5f39ee2eaed948e67236e64ff68e2a",
}
TRITON_METRICS_COMMIT = None  # the copy read has no known commit
RELEASES = {
    "1.0": {
        "serve": "4c05a74891e4df8066f08ed4ce14b0972abe4e25",
        "release_commit": "ae8270b713446948246f16fadf4e2a32e35d0f62",
        "backend": {"ref": "r25.10", "commit": "e2e72dc83f7255a36738b080446570f32b466781"},
    },
    "1.1": {
        "serve": "4c05a74891e4df8066f08ed4ce14b0972abe4e25",
        "release_commit": "48b7b5d8b7ed1e6bff57aecc6ff7d1533288bed8",
        "backend": {"ref": "r26.02", "commit": "47c80a359531952f58e74ae8e891c010b7663d76"},
    },
    "1.2": {
        "serve": "00209af149e7774406881a37283dce303571eb11",
        "release_commit": "36e34eeffce6af28b60719a0be7dff7c7ebe01a7",
        "backend": {"ref": "r26.07", "commit": "3bc115373ce1fde1d94891964b492449402e3a68"},
    },
}
NOTE = (
    "Approximate: the TensorRT-LLM files were read at main-line commits near the releases, the same for all three "
    "except serve.py (1.1 uses 1.0's)."
)


# ---------------------------------------------------------------- trtllm-serve


def serve_options(text: str) -> dict:
    """The `serve` command's click options: {option: {aliases, dest, default, type or choices, is_flag}}."""
    function = next(
        (s for s in complete_statements(text) if isinstance(s, ast.FunctionDef) and s.name == "serve"), None
    )
    if function is None:
        raise UnrecognizedSource("no serve() in this serve.py text")
    options = {}
    for dec in function.decorator_list:
        if not (isinstance(dec, ast.Call) and ast.unparse(dec.func) == "click.option"):
            continue
        names = [a.value for a in dec.args if isinstance(a, ast.Constant)]
        flags = [n for n in names if n.startswith("-")]
        kw = {k.arg: k.value for k in dec.keywords}
        entry = {"aliases": flags[1:], "dest": next((n for n in names if not n.startswith("-")), None)}
        if not set(flags) & set(SERVE_OPTIONS):  # only the options the pipeline passes are typed
            options[flags[0]] = entry
            continue
        if "default" in kw:
            entry["default"] = ast.literal_eval(kw["default"])
        if "type" in kw:  # a choice's aliases are values, not flag names
            entry |= {("choice_aliases" if k == "aliases" else k): v for k, v in flag_type(kw["type"]).items()}
        if "is_flag" in kw:
            entry["is_flag"] = ast.literal_eval(kw["is_flag"])
        options[flags[0]] = entry
    wanted = {k: v for k, v in options.items() if k in SERVE_OPTIONS or set(v["aliases"]) & set(SERVE_OPTIONS)}
    metrics_flags = sorted(k for k in options if re.search("metric|prometheus", k))
    return {
        "options": wanted,
        "options_missing_from_source": [
            o for o in SERVE_OPTIONS if o not in wanted and not any(o in v["aliases"] for v in wanted.values())
        ],
        "metrics_or_prometheus_flags": metrics_flags,
        "all_option_names": sorted(options),
    }


def _condition(node, parents, stop) -> str | dict:
    """ "always", or the LLM-API option whose truth makes OpenAIServer run `node` ({"llm_arg": name})."""
    conditions, current = [], node
    while current in parents and current is not stop:
        current = parents[current]
        if isinstance(current, ast.If):
            conditions.append(current.test)
    if not conditions:
        return "always"
    test = ast.unparse(conditions[0])
    if len(conditions) == 1 and test.startswith("self.llm.args.") and test.count(".") == 3:
        return {"llm_arg": test.rsplit(".", 1)[1]}
    raise UnrecognizedSource(f"a route condition this tabulator cannot state: {test}")


def _handler(node: ast.expr) -> dict:
    """The OpenAIServer method serving a route; one chosen by a flag: the method when the flag is set, too."""
    if isinstance(node, ast.Attribute):
        return {"handler": node.attr}
    if isinstance(node, ast.IfExp) and isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not):
        return {"handler": node.body.attr, "handler_when": {node.test.operand.attr: node.orelse.attr}}
    raise UnrecognizedSource(f"a route handler this tabulator cannot state: {ast.unparse(node)}")


def openai_routes(text: str) -> dict:
    """Routes of OpenAIServer's route-registering methods, the Prometheus mount and what /health answers."""
    statements = complete_statements(text)
    cls = next(s for s in statements if isinstance(s, ast.ClassDef) and s.name == "OpenAIServer")
    parents = {c: p for p in ast.walk(cls) for c in ast.iter_child_nodes(p)}
    methods = {m.name: m for m in cls.body if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef)}
    out = {}
    for name in ("register_routes", "register_mm_encoder_routes"):
        routes = []
        for node in ast.walk(methods[name]):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "self.app.add_api_route":
                kw = {k.arg: k.value for k in node.keywords}
                routes.append(
                    {"path": node.args[0].value, "methods": ast.literal_eval(kw["methods"])}
                    | _handler(node.args[1])
                    | {"when": _condition(node, parents, methods[name])}
                )
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in methods:
                routes.append({"calls": node.func.attr, "when": _condition(node, parents, methods[name])})
        out[name] = routes
    mount = methods.get("mount_metrics")
    if mount:
        called = {ast.unparse(n.func).rsplit(".", 1)[-1] for n in ast.walk(mount) if isinstance(n, ast.Call)}
        out["mount_metrics"] = {
            "mount_paths": [
                n.args[0].value for n in ast.walk(mount) if isinstance(n, ast.Call) and ast.unparse(n.func) == "Mount"
            ],
            "prometheus_asgi_app": "make_asgi_app" in called,
            "multiprocess_registry": "MultiProcessCollector" in called,
            "fastapi_instrumentator": "Instrumentator" in called,
        }
    health = methods.get("health")
    if health:
        returned = health.body[-1].value
        status = next(k.value for k in returned.keywords if k.arg == "status_code")
        out["health_status"] = ast.literal_eval(status)
    return out


# ---------------------------------------------------------------- trtllm-llmapi-launch


def launcher_facts(text: str) -> dict:
    """The env vars the launcher reads and exports, where it takes the rank from (the first set of a chain of
    variables, else a default), and the modules each rank runs."""
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    reads = sorted(set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", body)) - {"task_with_command", "free_port"})
    exports = sorted(set(re.findall(r"export\s+([A-Za-z_][A-Za-z0-9_]*)=", body)))
    rank = re.search(r"^mpi_rank=(.+)$", body, re.M).group(1)
    size = re.findall(r'-n "\$([A-Z_]+)"', body)
    leader, worker = body.split("\nelse\n", 1)
    blacklist = re.search(r"mpi_blacklist=\(\s*(.*?)\)", body, re.S).group(1).split()
    return {
        "rank_from": re.findall(r"\$\{(\w+):-", rank),
        "rank_default": int(re.search(r":-(\d+)\}", rank).group(1)),
        "world_size_from": size,
        "world_size_default": 1,
        "env_read": reads,
        "env_exported": exports,
        "rank0": {
            "runs_in_background": "the wrapped command",
            "background_env_unset_prefixes": blacklist,
            "runs_in_foreground": re.findall(r"python3 -m (\S+)\s*$", leader, re.M)[-1],
            "stops_with": {"module": "tensorrt_llm.llmapi.mgmn_leader_node", "action": "stop"},
        },
        "other_ranks": re.findall(r"python3 -m (\S+)", worker),
    }


# ---------------------------------------------------------------- launch_triton_server.py


def triton_command(text: str, world_size: int = 2, model_name: str = "tensorrt_llm") -> dict:
    """The mpirun command get_cmd builds, evaluated from the source (helpers stubbed: no GPU query)."""
    statements = [s for s in complete_statements(text) if isinstance(s, ast.FunctionDef)]
    namespace = {
        "args": SimpleNamespace(multi_model=False, disable_spawn_processes=False),
        "number_of_gpus": lambda: 1,
        "check_triton_version": lambda v: True,
    }
    exec(compile(ast.Module(body=statements, type_ignores=[]), LAUNCH_SCRIPT, "exec"), namespace)  # noqa: S102
    cmd = namespace["get_cmd"](
        world_size,
        "/opt/tritonserver/bin/tritonserver",
        "8001",
        "8000",
        "8002",
        "<model_repo>",
        False,
        "triton_log.txt",
        model_name,
        False,
        0,
        False,
        False,
    )
    ranks, current = [], []
    for arg in cmd[2:]:
        if arg == ":":
            ranks.append(current)
            current = []
        else:
            current.append(arg)
    main_block = next((s for s in complete_statements(text) if isinstance(s, ast.If)), None)
    env = (
        sorted(
            {
                ast.unparse(n.targets[0].slice).strip("'\"")
                for n in ast.walk(main_block)
                if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Subscript)
            }
        )
        if main_block
        else []
    )
    return {
        "example": {"world_size": world_size, "tensorrt_llm_model_name": model_name},
        "prefix": cmd[:2],
        "per_rank_args": ranks,
        "multi_model_env": env,
        "multi_model_extra_args_per_rank": {
            "args": namespace["add_multi_model_config"](
                [], SimpleNamespace(multi_model=True, disable_spawn_processes=False)
            ),
            "when": "--multi-model, NVIDIA_TRITON_SERVER_VERSION > 24.06 and no --disable-spawn-processes; the "
            "--cuda-memory-pool-byte-size arg repeats for each GPU nvidia-smi lists (one GPU assumed here)",
        },
    }


# ---------------------------------------------------------------- metrics


def metrics_from_cc(text: str) -> dict:
    labels = dict(re.findall(r"CustomMetricsReporter::(\w+)_labels_\{\s*(.*?)\};", text, re.S))
    labels = {k: re.findall(r'"([^"]+)"', v) for k, v in labels.items()}
    families = {}
    for name, category, var in re.findall(
        r'TritonMetricGroup>\(\s*"(\w+)",\s*"[^"]*",\s*"(\w+)",\s*\w+?_keys_,\s*(\w+?)_labels_\)', text, re.S
    ):
        families[name] = {"label": category, "values": labels[var]}
    for kind in ("v1", "inflight_batcher"):
        var = "v1_specific" if kind == "v1" else "IFB_specific"
        families[f"nv_trt_llm_{kind}_metrics"] = {"label": f"{kind}_specific_metric", "values": labels[var]}
    counters = re.findall(r"(\w+)_metric_family_->CreateGroup\([^)]*METRIC_KIND_COUNTER", text)
    histograms = re.findall(r"(\w+)_metric_family_->CreateGroup\([^)]*METRIC_KIND_HISTOGRAM", text)
    return {
        "families": families,
        "common_labels": re.findall(r'TRITONSERVER_ParameterNew\("(\w+)"', text) or ["model", "version"],
        "counter_groups": counters,
        "histogram_groups": histograms,
        "other_groups": "gauge",
    }


def metrics_from_readme(text: str) -> dict:
    out = {}
    for name, labels in re.findall(r"^(nv_trt_llm_\w+)\{([^}]*)\}", text, re.M):
        for key, val in re.findall(r'(\w+)="([^"]*)"', labels):
            if key not in ("model", "version"):
                out.setdefault(name, {"label": key, "values": []})["values"].append(val)
    types = dict(re.findall(r"^# TYPE (nv_trt_llm_\w+) (\w+)", text, re.M))
    return {k: v | {"type": types.get(k)} for k, v in out.items()}


# ---------------------------------------------------------------- tensorrtllm_backend


def launch_line_facts(doc: str) -> list[dict]:
    """The launch command lines of docs/llmapi.md (backslash continuations joined), each as its launcher and the
    long flags on the line."""
    joined = re.sub(r"\\\n\s*", " ", doc)
    lines = [
        line.split()
        for line in joined.splitlines()
        if ("trtllm-llmapi-launch" in line or "launch_triton_server.py" in line) and "`" not in line
    ]
    facts = []
    for tokens in lines:
        fact = {
            "launcher": next(t.rsplit("/", 1)[-1] for t in tokens if t.endswith(("trtllm-llmapi-launch", ".py"))),
            "flags": [t.split("=")[0] for t in tokens if t.startswith("--")],
        }
        if fact not in facts:
            facts.append(fact)
    return facts


def backend_facts(upstream: Upstream, release: str) -> dict:
    """What the tensorrtllm_backend release paired with `release` documents: the metrics endpoint and families of
    its README, and how docs/llmapi.md launches the llmapi model."""
    backend = RELEASES[release]["backend"]
    readme = upstream.read(BACKEND_REPO, "README.md", backend["commit"])
    doc = upstream.read(BACKEND_REPO, "docs/llmapi.md", backend["commit"])
    return {
        "source": {
            "ref": backend["ref"],
            "files": [cite(BACKEND_REPO, path, backend["commit"], pinned=False) for path in ("README.md", LLMAPI_DOC)],
        },
        "readme_metrics_endpoint": sorted(set(re.findall(r"curl (localhost:\d+/metrics)", readme))),
        "readme_documented_families": metrics_from_readme(readme),
        "llmapi_doc_launches": launch_line_facts(doc),
    }


# ---------------------------------------------------------------- Triton core


def triton_metric_rows(text: str) -> dict:
    """Rows of a metrics.md table: {name: {granularity, frequency}}."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 6 and cells[2].startswith("`nv_"):
            rows[cells[2].strip("`")] = {"granularity": cells[4], "frequency": cells[5]}
    return rows


# ---------------------------------------------------------------- one release


def release_entry(upstream: Upstream, release: str) -> dict:
    spec = RELEASES[release]
    commits = {SERVE: spec["serve"]} | COMMITS
    files = {
        path: cite(REPO, path, commit, pinned=False) | {"release_commit": spec["release_commit"]}
        for path, commit in commits.items()
    }
    cc = metrics_from_cc(upstream.read(REPO, METRICS_CC, commits[METRICS_CC]))
    return {
        "source": {"files": files, "note": NOTE},
        "trtllm_serve": {
            "cli": serve_options(upstream.read(REPO, SERVE, commits[SERVE])),
            "routes": openai_routes(upstream.read(REPO, OPENAI, commits[OPENAI])),
        },
        "llmapi_launch": launcher_facts(upstream.read(REPO, LAUNCHER, commits[LAUNCHER])),
        "triton_engine": {
            "launch_command": triton_command(upstream.read(REPO, LAUNCH_SCRIPT, commits[LAUNCH_SCRIPT])),
            "custom_metrics": cc,
            "queue_metric": {
                "active": 'nv_trt_llm_request_metrics{request_type="active"}',
                "queued": 'nv_trt_llm_request_metrics{request_type="waiting"}',
                "capacity": 'nv_trt_llm_request_metrics{request_type="max"}',
                "labels_also": cc["common_labels"],
                "from": "request_labels_ of custom_metrics_reporter.cc, paired with request_keys_ (the executor's "
                "'Active Request Count', 'Waiting Requests', 'Max Request Count' iteration-stats keys)",
            },
            "backend_release": backend_facts(upstream, release),
        },
        "triton_core": {
            "source": cite(TRITON_REPO, TRITON_METRICS_DOC, TRITON_METRICS_COMMIT, pinned=False),
            "metrics": triton_metric_rows(upstream.read(TRITON_REPO, TRITON_METRICS_DOC, TRITON_METRICS_COMMIT)),
        },
    }


def tabulate(upstream: Upstream) -> dict:
    return {"releases": stored_releases({release: release_entry(upstream, release) for release in RELEASES})}
