"""`trtllm-pipeline deploy`: Kubernetes manifests validated offline, refused with the field named when wrong, and the
CPU manifest's server run for real (its command, probes, Service ports, secret and stop), as far as a machine without
a cluster allows."""

from __future__ import annotations

import copy
import fcntl
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from pipeline.config import load_config
from pipeline.k8s import APP_DIR, CLI, CONFIG_DIR, checks, serving_of
from pipeline.k8s.manifests import plan_deployment, render
from tests.conftest import REPO, llama_shape, run_cli

CPU_CONFIG = "build_configs/smollm2-135m-cpu.yaml"


def rendered(config: str, *overrides: str):
    cfg = load_config(REPO / config, list(overrides))
    dep = plan_deployment(cfg, serving_of(cfg), Path(config).stem)
    return cfg, dep, render(cfg, dep)


def written(output: Path) -> dict[str, dict]:
    """The objects `deploy` wrote, by kind (kustomization.yaml lists every file)."""
    k8s = output / "deploy" / "k8s"
    files = yaml.safe_load((k8s / "kustomization.yaml").read_text())["resources"]
    objects = [yaml.safe_load((k8s / name).read_text()) for name in files]
    return {obj["kind"]: obj for obj in objects}


def server_of(pod_spec: dict) -> dict:
    return next(c for c in pod_spec["containers"] if c["name"] == "server")


def test_default_cpu_config_deploys_and_the_stage_is_locked(tmp_path):
    result = run_cli("deploy", CPU_CONFIG, "--output", str(tmp_path))
    out = " ".join(result.stdout.split())
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"kubectl apply -k {tmp_path}/deploy/k8s" in out and "valid for Kubernetes 1.33" in out
    objects = written(tmp_path)
    assert sorted(objects) == ["Deployment", "Service"]  # the image holds the build and its config
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    server = server_of(pod)
    assert server["image"] == "trtllm-pipeline:smollm2-135m-cpu" and "--build" in server["command"]
    assert server["command"][2] == f"{APP_DIR}/{CPU_CONFIG}" and "initContainers" not in pod
    assert server["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert [p["targetPort"] for p in objects["Service"]["spec"]["ports"]] == ["http", "grpc", "metrics", "openai"]
    overridden = run_cli("deploy", CPU_CONFIG, "quantization.weights=int4", "--output", str(tmp_path / "int4"))
    assert overridden.returncode != 0 and "the pods would build other quantization values" in overridden.stderr
    again = run_cli("deploy", CPU_CONFIG, "--output", str(tmp_path))
    assert again.returncode == 0 and "deploy: up to date" in again.stdout


def deploy_llama(tmp_path: Path, config: str, size: str) -> tuple[Path, str, dict[str, dict]]:
    """`deploy` of a Llama example config on its published shape: (the model directory, stdout, the objects)."""
    model = llama_shape(tmp_path, size)
    result = run_cli("deploy", f"build_configs/{config}.yaml", f"model.path={model}", "--output", str(tmp_path / "out"))
    assert result.returncode == 0, result.stdout + result.stderr
    return model, result.stdout, written(tmp_path / "out")


def test_llama_8b_fp8_deploys_trtllm_serve_built_on_a_claim(tmp_path):
    model, _, objects = deploy_llama(tmp_path, "llama-3.1-8b-fp8-h100", "8b")
    assert sorted(objects) == ["ConfigMap", "Deployment", "Job", "PersistentVolumeClaim", "Service"]
    assert objects["Deployment"]["spec"]["replicas"] == 2
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    server, build = server_of(pod), objects["Job"]["spec"]["template"]["spec"]["containers"][0]
    wait = pod["initContainers"][0]  # the pods wait for the build Job with a small request
    assert "plan" in wait["command"][2] and "--check" in wait["command"][2] and wait["resources"]["limits"]
    assert build["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert server["image"] == "trtllm-pipeline:gpu-1.2" and server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert server["command"][:2] == ["trtllm-serve", "/artifacts/llama-3.1-8b-fp8-h100/engine/model"]
    assert f"--config={CONFIG_DIR}/llm_api_options.yaml" in server["command"]
    assert server["livenessProbe"]["httpGet"]["path"] == "/health"
    assert (
        build["command"][1:3] == ["build", f"{CONFIG_DIR}/llama-3.1-8b-fp8-h100.yaml"] and "--wait" in build["command"]
    )
    options = yaml.safe_load(objects["ConfigMap"]["data"]["llm_api_options.yaml"])
    assert options["kv_cache_config"]["dtype"] == "fp8" and options["max_batch_size"] == 256
    mounts = {m["name"]: m["mountPath"] for m in server["volumeMounts"]}
    assert mounts["models"] == str(model) and mounts["artifacts"] == "/artifacts"
    assert objects["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]


def test_70b_tp4_spreads_over_two_nodes_as_a_leader_worker_set(tmp_path):
    _, out, objects = deploy_llama(tmp_path, "llama-3.1-70b-fp8-tp4", "70b")
    assert "2 pods of 2 GPUs per replica" in " ".join(out.split())
    assert {"LeaderWorkerSet", "ServiceAccount", "Role", "RoleBinding", "Service"} <= set(objects)
    group = objects["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    leader, worker = group["leaderTemplate"]["spec"], group["workerTemplate"]["spec"]
    assert group["size"] == 2
    assert [c["resources"]["limits"]["nvidia.com/gpu"] for c in (server_of(leader), worker["containers"][0])] == [
        "2",
        "2",
    ]
    script = server_of(leader)["command"][2]
    assert script.count("-n 1 ") == 4 and "plm_rsh_agent /opt/trtllm-pipeline/scripts/kubessh" in script
    assert script.count("trtllm-llmapi-launch trtllm-serve") == 4
    assert objects["Service"]["spec"]["selector"] == {  # the leaders; the group's own headless Service is the LWS's
        "leaderworkerset.sigs.k8s.io/name": "llama-3-1-70b-fp8-tp4-group",
        "leaderworkerset.sigs.k8s.io/worker-index": "0",
    }
    assert objects["Service"]["metadata"]["name"] == "llama-3-1-70b-fp8-tp4"
    rules = objects["Role"]["rules"]
    assert {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["get", "create"]} in rules


def test_engine_group_autoscales_on_the_backends_waiting_requests(tmp_path):
    cfg, dep, objects = rendered(
        "build_configs/smollm2-135m-int4-awq.yaml",
        "parallel.tp_size=3",
        "deploy.gpus_per_node=1",
        "deploy.storage.claim=shared-engines",
        "deploy.autoscaling={min_replicas: 1, max_replicas: 3, queued_requests_per_replica: 0.5}",
    )
    from pipeline.k8s.manifests import adapter_config

    assert checks.manifest_problems(objects, dep, cfg, adapter_config(cfg, dep)) == []
    by_kind = {o["kind"]: o for o in objects}
    hpa = by_kind["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"]["kind"] == "LeaderWorkerSet" and "replicas" not in by_kind["LeaderWorkerSet"]["spec"]
    metric = hpa["metrics"][0]["pods"]
    assert metric == {
        "metric": {"name": "nv_trt_llm_request_metrics_waiting"},
        "target": {"type": "AverageValue", "averageValue": "500m"},
    }
    rule = adapter_config(cfg, dep)["rules"][0]
    assert rule["seriesQuery"] == 'nv_trt_llm_request_metrics{request_type="waiting",namespace!="",pod!=""}'
    script = by_kind["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    ranks = script["command"][2].split(" : ")
    assert len(ranks) == 3 and "--http-port=8000" in ranks[0] and "--allow-http=false" in ranks[1]


@pytest.mark.parametrize(
    ("overrides", "field", "message"),
    [
        (["deploy.replicas=-1"], "deploy.replicas", "greater than or equal to 0"),
        (["deploy.gpus_per_node=3"], "deploy.gpus_per_node", "3 does not divide tp x pp = 4"),
        (["deploy.autoscaling={max_replicas: 2}", "deploy.replicas=2"], "deploy.replicas", "the autoscaler sets"),
    ],
)
def test_broken_deploy_values_are_refused_naming_the_field(tmp_path, overrides, field, message):
    result = run_cli(
        "validate", "build_configs/llama-3.1-70b-fp8-tp4.yaml", f"model.path={llama_shape(tmp_path, '70b')}", *overrides
    )
    error = " ".join(result.stderr.split())
    assert result.returncode == 2 and f"{field}: " in error and message in error, error


def test_ports_of_one_server_must_differ_but_unused_ones_are_not_checked(tmp_path):
    clash = run_cli("validate", CPU_CONFIG, "deploy.ports.metrics=8000")
    assert clash.returncode == 2 and "deploy.ports.metrics: 8000 is also deploy.ports.http" in clash.stderr
    # trtllm-serve opens one port and serves no gateway of ours: grpc's number is free, no gateway key is asked for
    exposed = run_cli(
        "validate",
        "build_configs/llama-3.1-8b-fp8-h100.yaml",
        f"model.path={llama_shape(tmp_path, '8b')}",
        "deploy.service_type=LoadBalancer",
        "deploy.ports.http=8001",
    )
    assert exposed.returncode == 0, exposed.stderr


def test_deploy_needs_what_the_pods_need(tmp_path):
    model = llama_shape(tmp_path, "8b")
    no_claim = run_cli(
        "deploy",
        "build_configs/llama-3.1-8b-fp8-h100.yaml",
        f"model.path={model}",
        "deploy.storage.models_claim=null",
        "-o",
        str(tmp_path),
    )
    assert no_claim.returncode != 0 and "deploy.storage.models_claim: the pods build from" in no_claim.stderr
    queue = run_cli(
        "deploy",
        "build_configs/llama-3.1-70b-fp8-tp4.yaml",
        f"model.path={llama_shape(tmp_path, '70b')}",
        "deploy.autoscaling={max_replicas: 4}",
        "-o",
        str(tmp_path),
    )
    assert queue.returncode != 0 and "exports no Prometheus gauge of waiting requests" in queue.stderr
    cpu_gpus = run_cli("validate", CPU_CONFIG, "deploy.gpus_per_node=2")
    assert cpu_gpus.returncode == 2 and "deploy.gpus_per_node: is not honoured by target onnxruntime" in " ".join(
        cpu_gpus.stderr.split()
    )


def test_cross_checks_name_the_broken_field_of_an_edited_manifest():
    cfg, dep, objects = rendered(CPU_CONFIG)
    assert checks.manifest_problems(objects, dep, cfg, None) == []
    broken = copy.deepcopy(objects)
    workload = next(o for o in broken if o["kind"] == "Deployment")
    server = server_of(workload["spec"]["template"]["spec"])
    server["readinessProbe"]["httpGet"]["port"] = 8080
    server["resources"]["limits"]["nvidia.com/gpu"] = "1"
    server["resources"]["requests"]["memory"] = "1Gi"
    server["command"][server["command"].index("--grpc-port") + 1] = "9001"
    next(o for o in broken if o["kind"] == "Service")["spec"]["ports"][0]["targetPort"] = "web"
    problems = "\n".join(checks.manifest_problems(broken, dep, cfg, None))
    containers = "Deployment/smollm2-135m-cpu: spec.template.spec.containers[0]"
    assert f"{containers}.readinessProbe.httpGet.port: 8080 is not the port serving /v2/health/ready" in problems
    assert f"{containers}.ports: port 'grpc' is 8001 but the command binds --grpc-port 9001" in problems
    assert f"{containers}.resources.limits.nvidia.com/gpu: one replica gets 1 GPUs but tp x pp is 0" in problems
    assert f"{containers}.resources.requests.memory: 1Gi is below the memory plan" in problems
    assert "Service/smollm2-135m-cpu: spec.ports[0].targetPort: web is no port of the server container" in problems
    workload["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    assert checks.manifest_problems(broken, dep, cfg, None) == [
        f"{containers}.ports[0].containerPort: 'http' is not of type 'integer'"
    ]


def test_the_tabulated_crd_schema_refuses_what_the_api_server_would():
    cfg, dep, objects = rendered(
        "build_configs/smollm2-135m-int4-awq.yaml", "parallel.tp_size=3", "deploy.gpus_per_node=1"
    )
    group = next(o for o in objects if o["kind"] == "LeaderWorkerSet")
    assert checks.schema_problems([group], "1.33") == []
    wrong = copy.deepcopy(group)
    wrong["spec"]["leaderWorkerTemplate"]["size"] = "two"
    wrong["spec"]["startupPolicy"] = "WhenReady"
    wrong["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["terminationGracePeriodSeconds"] = "soon"
    problems = checks.schema_problems([wrong], "1.33")
    name = "LeaderWorkerSet/smollm2-135m-int4-awq-group"
    assert f"{name}: spec.leaderWorkerTemplate.size: 'two' is not of type 'integer'" in problems
    assert any(p.startswith(f"{name}: spec.startupPolicy: 'WhenReady' is not one of") for p in problems)
    worker = f"{name}: spec.leaderWorkerTemplate.workerTemplate.spec"
    assert f"{worker}.terminationGracePeriodSeconds: 'soon' is not of type 'integer'" in problems
    typo = copy.deepcopy(group)
    typo["spec"]["leaderWorkerTemplate"]["sise"] = 3
    assert "Additional properties are not allowed ('sise' was unexpected)" in checks.schema_problems([typo], "1.33")[0]


def test_build_wait_queues_behind_a_running_build(smollm2_build):
    with open(smollm2_build / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        waiting = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "build", CPU_CONFIG, "--output", str(smollm2_build), "--wait"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        first = waiting.stdout.readline()  # blocks until it has reached the lock
        assert "waiting for the build running in" in first and waiting.poll() is None, first
    out, _ = waiting.communicate(timeout=120)
    assert waiting.returncode == 0 and "nothing to do" in out, out


def _pss_bytes(pid: int) -> int:
    """Proportional set size of a process tree (a shared page counted once, as the pod's memory cgroup does)."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            total += sum(
                int(line.split()[1]) * 1024
                for line in Path(f"/proc/{current}/smaps_rollup").read_text().splitlines()
                if line.startswith("Pss:")
            )
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += map(int, (task / "children").read_text().split())
        except OSError:
            continue
    return total


def _probe(port: int, path: str) -> int:
    """An HTTP probe as the kubelet runs it: success is a status from 200 to 399."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status
    except OSError as exc:
        return getattr(exc, "code", 0)


def test_the_cpu_manifest_serves_as_written(smollm2_build, tmp_path):
    """The Deployment's container run here as the kubelet would run it: its command (the image's paths mapped onto
    this machine), its env (the Secret's key), its probes, the Service's ports, its memory
    request, and SIGTERM within the grace period. What needs a cluster (scheduling, the image itself, DNS, the
    HPA's metrics pipeline) is not run here."""
    from openai import AuthenticationError, OpenAI
    from prometheus_client.parser import text_string_to_metric_families
    from tritonclient.grpc import InferenceServerClient

    from pipeline.build import cache_dir
    from pipeline.memory import MiB
    from pipeline.triton.server import free_port

    ports = {name: free_port() for name in ("http", "grpc", "metrics", "openai")}
    cfg, dep, objects = rendered(
        CPU_CONFIG, *(f"deploy.ports.{name}={port}" for name, port in ports.items()), "deploy.api_key_secret=llm-key"
    )
    by_kind = {o["kind"]: o for o in objects}
    pod = by_kind["Deployment"]["spec"]["template"]["spec"]
    server = server_of(pod)
    image_paths = {  # the image's files, here
        CLI: f"{sys.executable} -m pipeline.cli",
        f"{APP_DIR}/build_configs": str(REPO / "build_configs"),
        dep.paths.output: str(smollm2_build),
        f"{APP_DIR}/.cache": str(cache_dir()),
    }

    def local(arg: str) -> list[str]:
        for inside, here in image_paths.items():
            if arg.startswith(inside):
                return (here + arg[len(inside) :]).split(" ")
        return [arg]

    command = [part for arg in server["command"] for part in local(arg)]
    env = {**os.environ}
    for var in server["env"]:
        if "valueFrom" in var:
            assert var["valueFrom"]["secretKeyRef"] == {"name": "llm-key", "key": "api-key"}
            env[var["name"]] = "test-key"
        else:
            env[var["name"]] = local(var["value"])[0]
    log = (tmp_path / "server.log").open("w")
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        startup = server["startupProbe"]
        container_ports = {p["name"]: p["containerPort"] for p in server["ports"]}
        deadline = time.monotonic() + startup["periodSeconds"] * startup["failureThreshold"]
        while _probe(container_ports[startup["httpGet"]["port"]], startup["httpGet"]["path"]) != 200:
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(1)
        for probe in ("readinessProbe", "livenessProbe"):
            get = server[probe]["httpGet"]
            assert _probe(container_ports[get["port"]], get["path"]) == 200, probe
        started = (tmp_path / "server.log").read_text()
        assert "▶" not in started and "triton_repo: up to date" in started  # the image's build was current

        service = {p["name"]: container_ports[p["targetPort"]] for p in by_kind["Service"]["spec"]["ports"]}
        assert InferenceServerClient(f"127.0.0.1:{service['grpc']}").is_server_ready()
        scrape = by_kind["Deployment"]["spec"]["template"]["metadata"]["annotations"]
        with urllib.request.urlopen(
            f"http://127.0.0.1:{scrape['prometheus.io/port']}{scrape['prometheus.io/path']}"
        ) as metrics:
            samples = {s.name for f in text_string_to_metric_families(metrics.read().decode()) for s in f.samples}
        assert dep.serving.queue_metric.series in samples  # what the HPA scales on
        gateway = f"http://127.0.0.1:{service['openai']}/v1"
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=gateway, api_key="wrong").models.list()
        client = OpenAI(base_url=gateway, api_key="test-key")
        answer = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Hi"}], max_tokens=8
        )
        assert answer.choices[0].message.content
        request = server["resources"]["requests"]["memory"]
        assert _pss_bytes(process.pid) <= int(request.removesuffix("Mi")) * MiB
    finally:
        process.send_signal(signal.SIGTERM)  # the kubelet's stop: SIGTERM to the container's first process
        grace = pod["terminationGracePeriodSeconds"]
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail(f"the server outlived terminationGracePeriodSeconds ({grace} s)")
        finally:
            log.close()


def test_a_release_whose_serving_is_not_tabulated_is_refused_by_name(tmp_path):
    result = run_cli(
        "deploy", "build_configs/smollm2-135m-int4-awq.yaml", 'target.trtllm_version="0.20"', "-o", str(tmp_path)
    )
    said = "how trtllm-serve serves is not tabulated for TensorRT-LLM 0.20 (tabulated: 1.0, 1.1, 1.2"
    assert result.returncode == 1 and said in " ".join(result.stderr.split())


@pytest.mark.parametrize("config", [CPU_CONFIG, "build_configs/smollm2-135m-int4-awq.yaml"])
def test_only_the_deploy_stage_hashes_the_deployment_code(config):
    """Editing how an output is deployed must not re-run the stages that built it."""
    from pipeline.plan import stage_inputs
    from pipeline.stages import STAGES

    cfg = load_config(REPO / config)
    for name, stage in STAGES.items():
        code = stage_inputs(stage, cfg, None, {})["code"]
        deployment = sorted(path for path in code if "/k8s/" in path or path.endswith("_serving.py"))
        assert bool(deployment) == (name == "deploy"), (name, deployment)
        if name == "deploy":
            assert "pipeline/targets/trtllm_serving.py" in code and "pipeline/upstream/leaderworkerset.json" in code


def test_tabulated_deployment_facts_name_the_upstream_commit_they_were_read_at():
    import json
    import re

    from pipeline.targets.llm_api_args import LLM_API_RELEASES

    commit = re.compile(r"[0-9a-f]{40}")
    lws = json.loads((REPO / "pipeline/upstream/leaderworkerset.json").read_text())
    adapter = json.loads((REPO / "pipeline/upstream/prometheus_adapter.json").read_text())
    assert commit.fullmatch(lws["source"]["commit"]) and commit.fullmatch(adapter["source"]["commit"])
    assert {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE"} <= set(lws["env"]) and lws["version"] == "v1"
    serving = json.loads((REPO / "pipeline/upstream/trtllm_serving.json").read_text())["releases"]
    assert set(LLM_API_RELEASES) <= set(serving)  # every release the pytorch backend builds can be deployed
    for release, facts in serving.items():
        for record in facts["source"]["files"].values():
            assert commit.fullmatch(record.get("commit") or "") or record.get("index_id"), (release, record)


def test_a_config_named_with_non_ascii_letters_deploys_under_ascii_names(tmp_path):
    """`deploy` of smöllm-ç.yaml wrote objects named smöllm-ç (no DNS-1123 label) and reported them valid."""
    config = tmp_path / "smöllm-ç.yaml"
    config.write_text((REPO / CPU_CONFIG).read_text() + "deploy:\n  artifacts: volume\n")
    result = run_cli("deploy", str(config), "--output", str(tmp_path / "out"))
    assert result.returncode == 0, result.stdout + result.stderr
    k8s = tmp_path / "out" / "deploy" / "k8s"
    objects = [yaml.safe_load((k8s / name).read_text()) for name in sorted(os.listdir(k8s)) if name[0].isdigit()]
    names = {obj["kind"]: obj["metadata"]["name"] for obj in objects}
    assert names == {
        "ConfigMap": "smollm-c-config",
        "PersistentVolumeClaim": "smollm-c-artifacts",
        "Job": "smollm-c-build",
        "Deployment": "smollm-c",
        "Service": "smollm-c",
    }
    assert "smollm-c.yaml" in next(o for o in objects if o["kind"] == "ConfigMap")["data"]
    assert "trtllm-pipeline:smollm-c " in " ".join(result.stdout.split())  # a Docker tag is ASCII too


def test_the_offline_checks_refuse_names_namespaces_and_labels_kubernetes_would():
    cfg, dep, objects = rendered(CPU_CONFIG)
    assert checks.name_problems(objects) == []
    broken = copy.deepcopy(objects)
    workload = next(o for o in broken if o["kind"] == "Deployment")
    service = next(o for o in broken if o["kind"] == "Service")
    workload["metadata"]["name"] = "smöllm-ç"
    workload["metadata"]["namespace"] = "n" * 64
    workload["metadata"]["labels"]["bad key"] = "x"
    workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] = "-bad"
    workload["spec"]["template"]["spec"]["nodeSelector"] = {"a/b/c": "v"}
    service["metadata"]["name"] = "1.svc"
    problems = checks.name_problems(broken)
    deployment = "Deployment/smöllm-ç"
    assert problems == [
        f"{deployment}: metadata.name: 'smöllm-ç' is not a DNS-1123 subdomain: at most 253 lowercase letters, "
        "digits, '-' or '.', each part between dots starting and ending with a letter or digit",
        f"{deployment}: metadata.namespace: '{'n' * 64}' is not a DNS-1123 label: at most 63 lowercase letters, "
        "digits or '-', starting and ending with a letter or digit",
        f"{deployment}: metadata.labels.bad key: 'bad key' is not a label key ('bad key' is not a label name: at most "
        "63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit); write [PREFIX/]NAME",
        f"{deployment}: spec.template.metadata.labels.app.kubernetes.io/name: '-bad' is not a label value: empty, or "
        "at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit",
        f"{deployment}: spec.template.spec.nodeSelector.a/b/c: 'a/b/c' is not a label key ('a/b' is not a DNS-1123 "
        "subdomain: at most 253 lowercase letters, digits, '-' or '.', each part between dots starting and ending "
        "with a letter or digit); write [PREFIX/]NAME",
        "Service/1.svc: metadata.name: '1.svc' is not a DNS-1035 label: at most 63 lowercase letters, digits or '-', "
        "starting with a letter and ending with a letter or digit",
    ]
    assert checks.manifest_problems(broken, dep, cfg, None)[-len(problems) :] == problems
