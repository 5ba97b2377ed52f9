"""Tabulate, from the real kubernetes-sigs/lws sources, the LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) facts the
Kubernetes manifest generator needs, into `leaderworkerset.json`.

Maintainer tool, not run by the pipeline. Everything is read with `git show <commit>:<path>` from a clone or bare
mirror of kubernetes-sigs/lws (`--git`); nothing upstream is copied except facts:

- `source`: repo, commit, commit date and the files read.
- `group` / `version` / `kind` / `plural` / `scope` / `short_names`: from the generated CRD.
- `schema`: the v1 `openAPIV3Schema` with every `description` keyword removed (property names are kept, even one
  called `description`), so pod templates can be validated offline; `schema_keywords` counts what a JSON-schema
  validator meets in it (OpenAPI-only keys such as `x-kubernetes-int-or-string`, `format: int32`).
- `env`: env vars the pod webhook injects (constants used as `corev1.EnvVar` names under `pkg/`), with the constant,
  the file defining it, the function and file injecting it, and the value expression.
- `labels`: `leaderworkerset.sigs.k8s.io/*` constants, label or annotation, and the `pkg/` files writing them.
- `naming`: pod/statefulset/service naming the controller uses (for hostnames such as LWS_LEADER_ADDRESS).
- `example_tensorrt_llm`: facts of `docs/examples/tensorrt-llm` (lws.yaml, build/, rbac.yaml, the site page).

    python scripts/dev/tabulate_lws.py --git <lws mirror> --out <dir>/leaderworkerset.json
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
from collections import Counter
from pathlib import Path

import yaml

REPO = "kubernetes-sigs/lws"
CRD = "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml"
TYPES = "api/leaderworkerset/v1/leaderworkerset_types.go"
POD_WEBHOOK = "pkg/webhooks/pod_webhook.go"
LWS_CONTROLLER = "pkg/controllers/leaderworkerset_controller.go"
POD_CONTROLLER = "pkg/controllers/pod_controller.go"
EXAMPLE = "docs/examples/tensorrt-llm"
SITE_PAGE = "site/content/en/docs/examples/tensorrt-llm.md"
LABEL_PREFIX = "leaderworkerset.sigs.k8s.io/"
# Keys of a structural schema that are not JSON-schema keywords, or that a JSON-schema validator treats differently.
OPENAPI_ONLY = ("x-kubernetes-", "nullable", "format")


def git(git_dir: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(git_dir), *args], capture_output=True, text=True, check=True).stdout


def show(git_dir: Path, commit: str, path: str) -> str:
    return git(git_dir, "show", f"{commit}:{path}")


def strip_descriptions(node):
    """Drop the `description` keyword at every schema position; children of `properties` are names, not keywords."""
    if isinstance(node, list):
        return [strip_descriptions(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "description":
            continue
        if key == "properties":
            out[key] = {name: strip_descriptions(sub) for name, sub in value.items()}
        else:
            out[key] = strip_descriptions(value)
    return out


def count_keywords(node, counts: Counter) -> Counter:
    """Count schema keywords (and `format` values) so the validator knows what it must handle."""
    if isinstance(node, list):
        for item in node:
            count_keywords(item, counts)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key == "properties":
                for sub in value.values():
                    count_keywords(sub, counts)
                continue
            counts[f"format: {value}" if key == "format" else key] += 1
            if key not in ("enum", "default", "required", "x-kubernetes-list-map-keys"):
                count_keywords(value, counts)
    return counts


def crd_facts(git_dir: Path, commit: str) -> dict:
    crd = yaml.safe_load(show(git_dir, commit, CRD))
    spec = crd["spec"]
    (version,) = [v for v in spec["versions"] if v["name"] == "v1"]
    schema = strip_descriptions(version["schema"]["openAPIV3Schema"])
    counts = count_keywords(schema, Counter())
    return {
        "group": spec["group"],
        "version": version["name"],
        "kind": spec["names"]["kind"],
        "plural": spec["names"]["plural"],
        "short_names": spec["names"].get("shortNames", []),
        "scope": spec["scope"],
        "served": version["served"],
        "storage": version["storage"],
        "subresources": sorted(version.get("subresources", {})),
        "controller_gen": crd["metadata"]["annotations"].get("controller-gen.kubebuilder.io/version"),
        "schema_keywords": {k: n for k, n in sorted(counts.items()) if k.startswith(OPENAPI_ONLY)},
        "schema": schema,
    }


def go_files(git_dir: Path, commit: str, under: str) -> list[str]:
    names = git(git_dir, "ls-tree", "-r", "--name-only", commit, under).split()
    return [n for n in names if n.endswith(".go") and not n.endswith("_test.go")]


CONST_RE = re.compile(r"^\s*([A-Z]\w*)\s+(?:[\w.]+\s+)?=\s*(?:[\w.]+\()?\"([^\"]*)\"", re.M)


def go_constants(text: str) -> dict[str, str]:
    """String constants (`Name [type] = "value"`) of the `const (...)` blocks of one Go file."""
    consts = {}
    for block in re.findall(r"^const \((.*?)^\)", text, re.M | re.S):
        consts.update(CONST_RE.findall(block))
    return consts


def enclosing_func(text: str, pos: int) -> str:
    funcs = [m.group(1) for m in re.finditer(r"^func (?:\([^)]*\) )?(\w+)", text[:pos], re.M)]
    return funcs[-1] if funcs else ""


def env_and_labels(git_dir: Path, commit: str) -> tuple[dict, dict, dict]:
    sources = {p: show(git_dir, commit, p) for p in [TYPES, *go_files(git_dir, commit, "pkg")]}
    consts = {}  # identifier -> (value, defining file); api constants are referenced as leaderworkerset.<Name>
    for path, text in sources.items():
        for name, value in go_constants(text).items():
            consts.setdefault(name, (value, path))
    env = {}
    for path, text in sources.items():
        if path == TYPES:
            continue
        for m in re.finditer(r"EnvVar\{\s*Name:\s*(?:leaderworkerset\.)?(\w+),\s*Value:\s*(.+?),?\n", text):
            if m.group(1) not in consts:
                continue
            value, defined_in = consts[m.group(1)]
            entry = env.setdefault(value, {"const": m.group(1), "defined_in": defined_in, "injected_by": []})
            entry["injected_by"].append({"file": path, "func": enclosing_func(text, m.start()), "value": m.group(2)})
    labels = {}
    for name, (value, defined_in) in sorted(consts.items(), key=lambda kv: kv[1][0]):
        if not value.startswith(LABEL_PREFIX):
            continue
        ref = rf"(?:leaderworkerset\.)?\b{name}\b"
        kinds = set()
        written_in = []
        for path, text in sources.items():
            if "Label" in name or re.search(rf"Labels\[{ref}\]", text):
                kinds.add("label")
            if "Annotation" in name or re.search(rf"Annotations\[{ref}\]", text):
                kinds.add("annotation")
            if path != TYPES and re.search(rf"\[{ref}\]\s*=[^=]|^\s*{ref}:\s", text, re.M):
                written_in.append(path)
        labels[value] = {"const": name, "defined_in": defined_in, "kind": sorted(kinds), "written_in": written_in}
    return env, labels, sources


def naming(sources: dict[str, str]) -> dict:
    """Names the controller gives pods, statefulsets and the headless service, and the leader address format."""
    types = sources[TYPES]
    leader = re.search(r"name the leader pod of each group in the following format:\s*//\s*(\S+?)\.\s", types)
    worker = re.search(r"Worker pods are named using the format: (\S+?)\.\s", types)
    pod_utils = sources["pkg/utils/pod/pod_utils.go"]
    addr = re.search(
        r"Name:\s*leaderworkerset\.LwsLeaderAddress,\s*Value:\s*fmt\.Sprintf\(\"([^\"]+)\", ([^)]+)\)", pod_utils
    )
    lws_sts = re.search(
        r"appsapplyv1\.StatefulSet\(([^,]+),.*?WithServiceName\(([^)]+)\)", sources[LWS_CONTROLLER], re.S
    )
    wk = sources[POD_CONTROLLER]
    worker_sts = re.search(
        r"appsapplyv1\.StatefulSet\(([^,]+),.*?WithServiceName\(([^)]+)\).*?WithReplicas\(([^)]+)\).*?"
        r"WithOrdinals\(appsapplyv1\.StatefulSetOrdinals\(\)\.WithStart\((\d+)\)",
        wk,
        re.S,
    )
    service_shared = re.search(r"serviceName := (\S+)\n\s*if (.+?) \{\n\s*serviceName = (\S+)\n", wk)
    headless = re.search(
        r"func \(r \*LeaderWorkerSetReconciler\) reconcileHeadlessServices.*?\n\s*if (.+?) \{\n.*?"
        r"CreateHeadlessServiceIfNotExists\(ctx, r\.Client, r\.Scheme, lws, ([^,]+), ([^,]+?), lws\)",
        sources[LWS_CONTROLLER],
        re.S,
    )
    unique = re.search(
        r"if (.*SubdomainUniquePerReplica\)) \{\n\s*pod\.Spec\.Subdomain = (\S+)\n", sources[POD_WEBHOOK]
    )
    return {
        "leader_pod": leader.group(1),
        "worker_pod": worker.group(1),
        "leader_address_env": {"sprintf": addr.group(1), "args": [a.strip() for a in addr.group(2).split(",")]},
        "headless_service": {
            "when": headless.group(1),
            "name": headless.group(2),
            "selector": headless.group(3),
            "file": LWS_CONTROLLER,
        },
        "leader_statefulset": {"name": lws_sts.group(1), "service_name": lws_sts.group(2), "file": LWS_CONTROLLER},
        "worker_statefulset": {
            "name": worker_sts.group(1),
            "service_name": worker_sts.group(2),
            "service_name_choice": (
                f"{service_shared.group(3)} if {service_shared.group(2)} else {service_shared.group(1)}"
            ),
            "replicas": worker_sts.group(3),
            "ordinals_start": int(worker_sts.group(4)),
            "file": POD_CONTROLLER,
        },
        "leader_subdomain_unique_per_replica": {
            "when": unique.group(1),
            "subdomain": unique.group(2),
            "file": POD_WEBHOOK,
        },
    }


def container_facts(container: dict) -> dict:
    return {
        "name": container["name"],
        "image": container["image"],
        "command": container.get("command", []),
        "args": container.get("args", []),
        "env": {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])},
        "resources": container.get("resources", {}),
        "ports": container.get("ports", []),
        "volume_mounts": container.get("volumeMounts", []),
        "readiness_probe": container.get("readinessProbe", "not set"),
    }


def string_lists(func: ast.FunctionDef) -> list[list[str]]:
    """Every list literal of string constants / f-strings in a function, in source order (argv skeletons)."""
    lists = []
    for node in ast.walk(func):
        if isinstance(node, ast.List) and node.elts:
            items = [ast.unparse(e) if not isinstance(e, ast.Constant) else e.value for e in node.elts]
            lists.append((node.lineno, items))
    return [items for _, items in sorted(lists, key=lambda x: x[0])]


def example_facts(git_dir: Path, commit: str, schema: dict) -> tuple[dict, list[str]]:
    files = [f"{EXAMPLE}/lws.yaml", f"{EXAMPLE}/build/Dockerfile", f"{EXAMPLE}/build/server.py"]
    files += [f"{EXAMPLE}/build/install_model.sh", f"{EXAMPLE}/rbac.yaml", SITE_PAGE]
    docs = list(yaml.safe_load_all(show(git_dir, commit, files[0])))
    (lws,) = [d for d in docs if d["kind"] == "LeaderWorkerSet"]
    services = [d for d in docs if d["kind"] == "Service"]
    tmpl = lws["spec"]["leaderWorkerTemplate"]
    spec_schema = schema["properties"]["spec"]["properties"]
    startup_default = spec_schema["startupPolicy"].get("default")

    def pod(key: str) -> dict:
        p = tmpl[key]
        return {
            "labels": p.get("metadata", {}).get("labels", {}),
            "service_account": p["spec"].get("serviceAccountName"),
            "containers": [container_facts(c) for c in p["spec"]["containers"]],
            "volumes": p["spec"].get("volumes", []),
        }

    dockerfile = show(git_dir, commit, files[1])
    build_tree = git(git_dir, "ls-tree", "--name-only", commit, f"{EXAMPLE}/build/").split()
    copies = re.findall(r"^COPY (?:--\S+ )*(\S+) ", dockerfile, re.M)
    server = ast.parse(show(git_dir, commit, files[2]))
    funcs = {n.name: n for n in server.body if isinstance(n, ast.FunctionDef)}
    leader_lists = string_lists(funcs["do_leader"])
    mpi_opts = next(li for li in leader_lists if "plm_rsh_agent" in li)
    slots = next(
        ast.unparse(n.value)
        for n in ast.walk(funcs["do_leader"])
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "workers_with_mpi_slots"
    )
    install = show(git_dir, commit, files[3])
    rbac = [d for d in yaml.safe_load_all(show(git_dir, commit, files[4])) if d]
    site = show(git_dir, commit, files[5])
    return {
        "files": files,
        "replicas": lws["spec"].get("replicas"),
        "size": tmpl["size"],
        "startupPolicy": lws["spec"].get("startupPolicy", f"not set (CRD default {startup_default})"),
        "leader": pod("leaderTemplate"),
        "worker": pod("workerTemplate"),
        "services": [
            {"name": s["metadata"]["name"], "ports": s["spec"]["ports"], "selector": s["spec"]["selector"]}
            for s in services
        ],
        "image_base": re.search(r"^ARG BASE_CONTAINER_IMAGE=(\S+)", dockerfile, re.M).group(1),
        "image_note": "lws.yaml image is a placeholder; image is built from build/Dockerfile FROM "
        "${BASE_CONTAINER_IMAGE}",
        "dockerfile_apt_installs_kubectl": "kubectl" in re.findall(r"^\s+(\S+) \\?$", dockerfile, re.M),
        "dockerfile_copies": copies,
        "dockerfile_copies_missing_from_repo": [c for c in copies if f"{EXAMPLE}/build/{c}" not in build_tree],
        "dockerfile_entrypoint": re.search(r"^ENTRYPOINT (.+)$", dockerfile, re.M).group(1),
        "server_py_modes": next(
            [e.value for e in kw.value.elts]
            for c in ast.walk(funcs["parse_arguments"])
            if isinstance(c, ast.Call)
            for kw in c.keywords
            if kw.arg == "choices"
        ),
        "server_py_options": [
            c.args[0].value
            for c in ast.walk(funcs["parse_arguments"])
            if isinstance(c, ast.Call) and getattr(c.func, "attr", "") == "add_argument"
        ],
        "leader_waits_for_workers_with": string_lists(funcs["wait_for_workers"])[0],
        "leader_mpirun": next(li for li in leader_lists if li[0].endswith("/mpirun")),
        "leader_mpirun_options": mpi_opts,
        "mpi_launcher": f"-mca plm_rsh_agent {mpi_opts[mpi_opts.index('plm_rsh_agent') + 1]}",
        "mpi_hosts": f"--host {mpi_opts[mpi_opts.index('--host') + 1]}; workers_with_mpi_slots = {slots}",
        "per_rank_command": next(li for li in leader_lists if "tritonserver" in li),
        "rank_separator": next(li for li in leader_lists if li == [":"]),
        "rank0_extra": next(li for li in leader_lists if "--allow-metrics=true" in li),
        "rank_n_extra": next(li for li in leader_lists if "--allow-http=false" in li),
        "world_size": ast.unparse(
            next(
                n.value
                for n in ast.walk(funcs["do_leader"])
                if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "world_size"
            )
        ),
        "worker_behaviour": "signal.pause() until SIGINT/SIGTERM"
        if "signal.pause" in ast.unparse(funcs["do_worker"])
        else ast.unparse(funcs["do_worker"]),
        "sshd_mentioned": "sshd" in dockerfile or "sshd" in ast.unparse(server),
        "install_model": {
            "tensorrtllm_backend_clone": re.search(r"git clone (\S+) -b (\S+)", install).groups(),
            "hf_model": re.search(r"huggingface-cli download (\S+)", install).group(1),
            "convert_checkpoint": dict(re.findall(r"--(tp_size|pp_size|dtype) (\S+)", install)),
            "trtllm_build": dict(re.findall(r"--(\w+)[ =](\S+)", install[install.index("trtllm-build") :][:600])),
        },
        "rbac": [{"kind": d["kind"], "name": d["metadata"]["name"], "rules": d.get("rules")} for d in rbac],
        "site_request_path": re.search(r"curl -X POST \S+?(/v2/\S+)", site).group(1),
        "site_port_forward": re.search(r"kubectl port-forward (.+)", site).group(1),
    }, files


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--git", type=Path, required=True, help="clone or bare mirror of kubernetes-sigs/lws")
    parser.add_argument("--rev", default="HEAD")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    commit, date = git(args.git, "log", "-1", "--format=%H %cs", args.rev).split()
    crd = crd_facts(args.git, commit)
    env, labels, sources = env_and_labels(args.git, commit)
    example, example_files = example_facts(args.git, commit, crd["schema"])
    facts = {
        "source": {
            "repo": REPO,
            "commit": commit,
            "date": date,
            "crd": CRD,
            "example": f"{EXAMPLE}/lws.yaml",
            "go_files": sorted(sources),
            "example_files": example_files,
        },
        **{k: crd[k] for k in ("group", "version", "kind", "plural", "short_names", "scope", "served", "storage")},
        **{k: crd[k] for k in ("subresources", "controller_gen", "schema_keywords", "schema")},
        "env": env,
        "labels": labels,
        "naming": naming(sources),
        "example_tensorrt_llm": example,
    }
    args.out.write_text(json.dumps(facts, indent=1) + "\n")
    print(f"{args.out}: {args.out.stat().st_size} bytes, {len(env)} env vars, {len(labels)} label/annotation keys")


if __name__ == "__main__":
    main()
