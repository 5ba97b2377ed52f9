"""Tabulate, from the real upstream sources, how TensorRT-LLM 1.0, 1.1 and 1.2 are served, for the Kubernetes
manifests (issue #16), into `trtllm_serving.json`.

Maintainer tool, not run by the pipeline. One entry per release:

- `trtllm_serve` (PyTorch backend): the HTTP routes OpenAIServer registers (path, methods, handler, condition),
  the Prometheus mount, and the `serve` command's CLI options (name, aliases, default) from its click decorators.
- `llmapi_launch`: what `trtllm-llmapi-launch` reads from the environment, exports and runs on rank 0 / others.
- `triton_engine`: the mpirun command `launch_triton_server.py` builds (evaluated for two ranks from the cached
  source's `get_cmd`, with its helpers), the `nv_trt_llm_*` metric families and labels of the C++ backend's
  custom_metrics_reporter.cc, and those the release's tensorrtllm_backend README documents (`--git`).
- `source`: every file read, with its commit (or index id) and how the version was tied to the release.

NVIDIA/TensorRT-LLM files come from the search index (cache layout of `upstream_source`); the index holds no
release commit of them, so each release names the stored version used and why. Reads are described by the
cache's READS file, or by `--reads` (a file of the same shape) for reads not yet merged into it.

    python scripts/dev/tabulate_trtllm_serving.py --cache /work/upstream-cache/NVIDIA+TensorRT-LLM \\
        --git <tensorrtllm_backend mirror> --out trtllm_serving.json
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))
from upstream_source import READS, REPO, complete_statements, source_record  # noqa: E402

BACKEND_REPO = "triton-inference-server/tensorrtllm_backend"
SERVE = "tensorrt_llm/commands/serve.py"
OPENAI = "tensorrt_llm/serve/openai_server.py"
LAUNCHER = "tensorrt_llm/llmapi/trtllm-llmapi-launch"
LAUNCH_SCRIPT = "triton_backend/scripts/launch_triton_server.py"
METRICS_CC = "triton_backend/inflight_batcher_llm/src/custom_metrics_reporter/custom_metrics_reporter.cc"
EXCERPT = " (excerpt)"
SERVE_OPTIONS = ("--host", "--port", "--backend", "--tp_size", "--pp_size", "--config", "--extra_llm_api_options")

S1_0 = "index-id-901178132"  # serve.py, commit 4c05a748 (read_file with that commit returns this id)
S1_2 = "00209af149e7774406881a37283dce303571eb11"
OPENAI_V = "e7f7345e31e574b5d0918b756b871882c7346b3c"
LAUNCHER_V = "020c89e64e49f24102f1b62be96a1a68283cdf7a"
LAUNCH_V = "0a2e2c1f1268b34586393794045691b666ba28be"
METRICS_V = "0d5352f5fc5f39ee2eaed948e67236e64ff68e2a"

_COMMON = (
    "APPROXIMATE. No release commit of these files is stored in the index. openai_server.py {o} (index id "
    "456200087) imports MultimodalEncoder, has the DeepSeek-V3.2 config workaround and the Responses API: a "
    "main-line version of the 1.1/1.2 period (version.py is not stored at that commit); the only other version "
    "read (00057725, VisualGen, post-1.2) registers the same /health, /health_generate, /version, /v1/models "
    "first (the rest of it was not read). trtllm-llmapi-launch {l}, launch_triton_server.py {t} and "
    "custom_metrics_reporter.cc {c} are the versions read_file returns without a commit (newest stored); "
    "none is tied to a release."
).format(o=OPENAI_V[:8], l=LAUNCHER_V[:8], t=LAUNCH_V[:8], c=METRICS_V[:8])
RELEASES = {
    "1.0": {
        "serve": S1_0,
        "backend_ref": "r25.10",
        "note": _COMMON + " serve.py: index id 901178132 (commit 4c05a748), the version tabulate_trtllm_llm_args.py "
        "ties to 1.0 (only --extra_llm_api_options, no stability tags); medium confidence.",
    },
    "1.1": {
        "serve": S1_0,
        "backend_ref": "r26.02",
        "note": _COMMON + " serve.py: no version tied to 1.1 was found; the 1.0 one is used, as in "
        "tabulate_trtllm_llm_args.py.",
    },
    "1.2": {
        "serve": S1_2,
        "backend_ref": "r26.07",
        "note": _COMMON + " serve.py: commit 00209af1, the version tabulate_trtllm_llm_args.py ties to 1.2 "
        "(--config with --extra_llm_api_options as alias); its cached excerpt elides --host and --port.",
    },
}


# ---------------------------------------------------------------- cache


def cached_text(cache: Path, version: str, path: str) -> str:
    for name in (path, path + EXCERPT):
        file = cache / version / name
        if file.exists():
            return file.read_text()
    raise FileNotFoundError(f"{cache}/{version}/{path} is not cached")


def record(cache: Path, version: str, path: str, reads: list) -> dict:
    out = source_record(cache, version, path, reads)
    if out["commit"] is None:  # a later read_file named the commit of this index id
        out["commit"] = next((r["commit"] for r in reads if r["id"] == out["index_id"] and r.get("commit")), None)
    out["excerpt"] = (cache / version / (path + EXCERPT)).exists()
    if out["excerpt"]:  # "<path> (excerpt)" in READS marks an excerpt we cut, not a path the index left unnamed
        out.pop("path_inferred", None)
    return out


# ---------------------------------------------------------------- trtllm-serve


def serve_options(text: str) -> dict:
    """The `serve` command's click options: {option: {aliases, default, type, is_flag}}."""
    start, end = text.index('@click.command("serve")'), text.index("def serve(")
    block = "\n".join(line for line in text[start:end].splitlines() if not line.strip().startswith("#"))
    fn = ast.parse(block + "\ndef serve():\n    pass\n").body[0]
    options = {}
    for dec in fn.decorator_list:
        if not (isinstance(dec, ast.Call) and ast.unparse(dec.func) == "click.option"):
            continue
        names = [a.value for a in dec.args if isinstance(a, ast.Constant)]
        flags = [n for n in names if n.startswith("-")]
        kw = {k.arg: k.value for k in dec.keywords}
        entry = {"aliases": flags[1:], "dest": next((n for n in names if not n.startswith("-")), None)}
        for key in ("default", "type", "is_flag"):
            if key in kw:
                try:
                    entry[key] = ast.literal_eval(kw[key])
                except ValueError:
                    entry[key] = ast.unparse(kw[key])
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


def _condition(node, parents, stop) -> str:
    conditions, current = [], node
    while current in parents and current is not stop:
        current = parents[current]
        if isinstance(current, ast.If):
            conditions.append(ast.unparse(current.test))
    return " and ".join(reversed(conditions)) or "always"


def _comment_above(lines: list[str], lineno: int) -> str | None:
    above = lines[lineno - 2].strip() if lineno >= 2 else ""
    return above.lstrip("# ") if above.startswith("#") else None


def openai_routes(text: str) -> dict:
    """Routes of OpenAIServer's route-registering methods, and the Prometheus mount."""
    statements = complete_statements(text)
    cls = next(s for s in statements if isinstance(s, ast.ClassDef) and s.name == "OpenAIServer")
    lines = text.splitlines()
    parents = {c: p for p in ast.walk(cls) for c in ast.iter_child_nodes(p)}
    methods = {m.name: m for m in cls.body if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef)}
    out = {}
    for name in ("register_routes", "register_mm_encoder_routes"):
        routes = []
        for node in ast.walk(methods[name]):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "self.app.add_api_route":
                kw = {k.arg: k.value for k in node.keywords}
                routes.append(
                    {
                        "path": node.args[0].value,
                        "methods": ast.literal_eval(kw["methods"]),
                        "handler": ast.unparse(node.args[1]),
                        "when": _condition(node, parents, methods[name]),
                        "comment": _comment_above(lines, node.lineno),
                    }
                )
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in methods:
                routes.append({"calls": node.func.attr, "when": _condition(node, parents, methods[name])})
        out[name] = routes
    mount = methods.get("mount_metrics")
    if mount:
        src = ast.unparse(mount)
        out["mount_metrics"] = {
            "mount_paths": [
                n.args[0].value for n in ast.walk(mount) if isinstance(n, ast.Call) and ast.unparse(n.func) == "Mount"
            ],
            "served_by": "prometheus_client.make_asgi_app(registry) over a multiprocess CollectorRegistry"
            if "make_asgi_app" in src and "MultiProcessCollector" in src
            else None,
            "format": "Prometheus text exposition (prometheus_client ASGI app)" if "make_asgi_app" in src else None,
            "instrumentator": "prometheus_fastapi_instrumentator.Instrumentator(...).expose(self.app)"
            if "Instrumentator" in src
            else None,
        }
    health = methods.get("health")
    if health:
        out["health_returns"] = ast.unparse(health.body[-1])
    return out


# ---------------------------------------------------------------- trtllm-llmapi-launch


def launcher_facts(text: str) -> dict:
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    reads = sorted(set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", body)) - {"task_with_command", "free_port"})
    exports = sorted(set(re.findall(r"export\s+([A-Za-z_][A-Za-z0-9_]*)=", body)))
    rank = re.search(r"^mpi_rank=(.+)$", body, re.M).group(1)
    size = re.findall(r'-n "\$([A-Z_]+)"', body)
    leader, worker = body.split("\nelse\n", 1)
    blacklist = re.search(r"mpi_blacklist=\(\s*(.*?)\)", body, re.S).group(1).split()
    return {
        "rank_from": rank,
        "world_size_from": size + ["1 (default)"],
        "env_read": reads,
        "env_exported": exports,
        "rank0": {
            "runs_in_background": "the wrapped command (its arguments), with every env var of these prefixes "
            "unset: " + " ".join(blacklist) + "; then `python3 -m tensorrt_llm.llmapi.mgmn_leader_node --action stop`",
            "runs_in_foreground": re.findall(r"python3 -m (\S+)\s*$", leader, re.M)[-1],
        },
        "other_ranks": re.findall(r"python3 -m (\S+)", worker),
    }


# ---------------------------------------------------------------- launch_triton_server.py


def triton_command(text: str, world_size: int = 2, model_name: str = "tensorrt_llm") -> dict:
    """The mpirun command get_cmd builds, evaluated from the cached source (helpers stubbed: no GPU query)."""
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


def git(git_dir: Path, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True, text=True).stdout


def backend_facts(git_dir: Path, ref: str) -> dict:
    readme = git(git_dir, "show", f"{ref}:README.md")
    doc = git(git_dir, "show", f"{ref}:docs/llmapi.md")
    joined = re.sub(r"\\\n\s*", " ", doc)
    tags = [t for t in git(git_dir, "tag").split() if re.fullmatch(r"v[\d.]+", t)]
    holding = [t for t in tags if git(git_dir, "ls-tree", t, "scripts/launch_triton_server.py").strip()]
    return {
        "source": {
            "repo": BACKEND_REPO,
            "ref": ref,
            "commit": git(git_dir, "rev-parse", ref).strip(),
            "tensorrt_llm_submodule": git(git_dir, "ls-tree", ref, "tensorrt_llm").split()[2],
            "files": ["README.md", "docs/llmapi.md"],
        },
        "readme_metrics_endpoint": sorted(set(re.findall(r"curl (localhost:\d+/metrics)", readme))),
        "readme_documented_families": metrics_from_readme(readme),
        "llmapi_doc_launch_lines": list(
            dict.fromkeys(
                re.sub(r"\s+", " ", line.strip())
                for line in joined.splitlines()
                if ("trtllm-llmapi-launch" in line or "launch_triton_server.py" in line) and "`" not in line
            )
        ),
        "backend_tags_with_scripts_launch_triton_server": sorted(
            holding, key=lambda t: [int(x) for x in t[1:].split(".")]
        ),
    }


# ---------------------------------------------------------------- Triton core


def triton_metric_rows(text: str) -> dict:
    """Rows of a metrics.md table: {name: {metric, description, granularity, frequency}}."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 6 and cells[2].startswith("`nv_"):
            rows[cells[2].strip("`")] = {
                "metric": cells[1],
                "description": cells[3],
                "granularity": cells[4],
                "frequency": cells[5],
            }
    return rows


def triton_core(doc: Path) -> dict:
    head = doc.read_text().split("-->")[0]
    return {
        "source": {
            "repo": "triton-inference-server/server",
            "path": "docs/user_guide/metrics.md",
            "index_id": re.search(r"index id (\d+)", head).group(1),
            "commit": None,
            "excerpt": str(doc),
        },
        "metrics": triton_metric_rows(doc.read_text()),
        "note": "The index named no commit for this version; the version 067c1e96 (2018-2023 header) has no "
        "pending-request row, so the Triton release that added it is not established here.",
    }


# ---------------------------------------------------------------- one release


def release_entry(cache: Path, git_dir: Path | None, reads: list, release: str, triton_doc: Path | None) -> dict:
    spec = RELEASES[release]
    files = {
        SERVE: record(cache, spec["serve"], SERVE, reads),
        OPENAI: record(cache, OPENAI_V, OPENAI, reads),
        LAUNCHER: record(cache, LAUNCHER_V, LAUNCHER, reads),
        LAUNCH_SCRIPT: record(cache, LAUNCH_V, LAUNCH_SCRIPT, reads),
        METRICS_CC: record(cache, METRICS_V, METRICS_CC, reads),
    }
    cc = metrics_from_cc(cached_text(cache, METRICS_V, METRICS_CC))
    entry = {
        "source": {"repo": REPO, "files": files, "note": spec["note"]},
        "trtllm_serve": {
            "cli": serve_options(cached_text(cache, spec["serve"], SERVE)),
            "routes": openai_routes(cached_text(cache, OPENAI_V, OPENAI)),
        },
        "llmapi_launch": launcher_facts(cached_text(cache, LAUNCHER_V, LAUNCHER)),
        "triton_engine": {
            "launch_command": triton_command(cached_text(cache, LAUNCH_V, LAUNCH_SCRIPT)),
            "custom_metrics": cc,
            "queue_metric": {
                "active": 'nv_trt_llm_request_metrics{request_type="active"}',
                "queued": 'nv_trt_llm_request_metrics{request_type="waiting"}',
                "capacity": 'nv_trt_llm_request_metrics{request_type="max"}',
                "labels_also": cc["common_labels"],
                "from": "request_labels_ of custom_metrics_reporter.cc, paired with request_keys_ (the executor's "
                "'Active Request Count', 'Waiting Requests', 'Max Request Count' iteration-stats keys)",
            },
        },
    }
    if git_dir is not None:
        entry["triton_engine"]["backend_release"] = backend_facts(git_dir, spec["backend_ref"])
    if triton_doc is not None:
        entry["triton_core"] = triton_core(triton_doc)
    return entry


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, required=True, help="<cache>/<commit>/<path> of NVIDIA/TensorRT-LLM")
    parser.add_argument("--reads", type=Path, action="append", default=[], help="extra READS-shaped files")
    parser.add_argument("--git", type=Path, help="a bare mirror or clone of tensorrtllm_backend")
    parser.add_argument("--triton-metrics-doc", type=Path, help="a cached excerpt of Triton's metrics.md")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("releases", nargs="*", help="default: all of " + ", ".join(RELEASES))
    args = parser.parse_args(argv)
    reads = json.loads((args.cache / READS).read_text())["reads"]
    for extra in args.reads:
        reads = json.loads(extra.read_text())["reads"] + reads
    table = json.loads(args.out.read_text()) if args.out.exists() else {}
    for release in args.releases or list(RELEASES):
        print(f"{release}:")
        table[release] = release_entry(args.cache, args.git, reads, release, args.triton_metrics_doc)
    table = dict(sorted(table.items(), key=lambda kv: list(RELEASES).index(kv[0])))
    args.out.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
