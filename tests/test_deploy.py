"""`trtllm-pipeline deploy`: Kubernetes manifests validated offline, refused with the field named when wrong, and the
CPU manifest's server run for real (its command, probes, Service ports, secret and stop), as far as a machine without
a cluster allows."""

from __future__ import annotations

import copy
import fcntl
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from pipeline.k8s import APP_DIR, CLI, CONFIG_DIR, checks, serving_of
from pipeline.k8s.manifests import plan_deployment, render
from pipeline.validation import load_config
from tests.conftest import REPO, dev_script, llama_shape, run_cli

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
    service = objects["Service"]  # the gateway, behind its key, is the only door: Triton's ports carry no key
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["openai"] and "annotations" not in service[
        "metadata"
    ]
    opened = run_cli("deploy", CPU_CONFIG, "deploy.expose_triton_ports=true", "--output", str(tmp_path / "open"))
    assert opened.returncode == 0, opened.stdout + opened.stderr
    service = written(tmp_path / "open")["Service"]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http", "grpc", "metrics", "openai"]
    said = service["metadata"]["annotations"]["trtllm-pipeline/unauthenticated-ports"]
    assert "no request loads files or registers an adapter" in said
    overridden = run_cli("deploy", CPU_CONFIG, "quantization.group_size=128", "--output", str(tmp_path / "other"))
    assert overridden.returncode != 0 and "the pods would build other quantization values" in overridden.stderr
    again = run_cli("deploy", CPU_CONFIG, "--output", str(tmp_path))
    assert again.returncode == 0 and "deploy: up to date" in again.stdout


def deploy_llama(tmp_path: Path, config: str, size: str) -> tuple[Path, str, dict[str, dict]]:
    """`deploy` of a Llama example config on its published shape: (the model directory, stdout, the objects)."""
    model = llama_shape(tmp_path, size)
    result = run_cli("deploy", f"build_configs/{config}.yaml", f"model.path={model}", "--output", str(tmp_path / "out"))
    assert result.returncode == 0, result.stdout + result.stderr
    return model, result.stdout, written(tmp_path / "out")


def test_llama_8b_fp8_deploys_the_gateway_in_front_of_trtllm_serve_built_on_a_claim(tmp_path):
    """One node: `serve --openai` runs trtllm-serve on the pod's loopback and the OpenAI gateway in front of it; the
    container declares, the Service exposes and the probes ask only the gateway's port."""
    model, _, objects = deploy_llama(tmp_path, "llama-3.1-8b-fp8-h100", "8b")
    assert sorted(objects) == ["ConfigMap", "Deployment", "Job", "PersistentVolumeClaim", "Service"]
    assert objects["Deployment"]["spec"]["replicas"] == 2
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    server, build = server_of(pod), objects["Job"]["spec"]["template"]["spec"]["containers"][0]
    wait = pod["initContainers"][0]  # the pods wait for the build Job with a small request
    assert "plan" in wait["command"][2] and "--check" in wait["command"][2] and wait["resources"]["limits"]
    assert build["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert server["image"] == "trtllm-pipeline:gpu-1.2" and server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    output = "/artifacts/llama-3.1-8b-fp8-h100"
    assert server["command"] == [
        CLI, "serve", f"{CONFIG_DIR}/llama-3.1-8b-fp8-h100.yaml", "--output", output, "--host", "0.0.0.0",
        "--http-port", "8000", "--openai", "--openai-port", "9000", "--allow-unauthenticated",
    ]  # fmt: skip
    assert [(p["name"], p["containerPort"]) for p in server["ports"]] == [("openai", 9000)]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["httpGet"] == {"path": "/health", "port": "openai"}, probe
    service = objects["Service"]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["openai"] and "annotations" not in service[
        "metadata"
    ]
    assert (
        build["command"][1:3] == ["build", f"{CONFIG_DIR}/llama-3.1-8b-fp8-h100.yaml"] and "--wait" in build["command"]
    )
    assert "llm_api_options.yaml" not in objects["ConfigMap"]["data"]  # serve reads the build's own options file
    mounts = {m["name"]: m["mountPath"] for m in server["volumeMounts"]}
    assert mounts["models"] == str(model) and mounts["artifacts"] == "/artifacts"
    assert objects["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]


def test_the_engine_backends_triton_ports_leave_the_service_unless_opted_in_and_then_say_what_a_client_can_do(
    tmp_path,
):
    """TensorRT-LLM's C++ tensorrt_llm model takes lora_weights per request by design: with the gateway in front,
    the Service exposes the gateway alone; exposing Triton's ports is an opt-in whose annotation says so."""
    model = llama_shape(tmp_path, "8b")
    config, engine = "build_configs/llama-3.1-8b-fp8-h100.yaml", "target.trtllm_backend=tensorrt"
    for opted_in, ports in ((False, ["openai"]), (True, ["http", "grpc", "metrics", "openai"])):
        _, _, objects = rendered(config, f"model.path={model}", engine, f"deploy.expose_triton_ports={opted_in}")
        service = next(obj for obj in objects if obj["kind"] == "Service")
        assert [p["targetPort"] for p in service["spec"]["ports"]] == ports
        said = service["metadata"].get("annotations", {}).get("trtllm-pipeline/unauthenticated-ports")
        assert (said is not None) == opted_in
    assert "lora_weights" in said and "every later request" in said


def test_70b_tp4_spreads_over_two_nodes_as_a_leader_worker_set_with_the_gateway_on_the_leader(tmp_path):
    """The leader runs `serve --openai` as on one node, handing it the mpirun that starts trtllm-serve's four ranks
    over the group (rank 0 on the leader's loopback) as --launcher: a group serves the same OpenAI surface, key and
    probes as one pod."""
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
    *wait, last = script.strip().splitlines()
    assert 'kubectl wait --for=condition=Ready --timeout=60s "pod/$leader-$i"' in "\n".join(wait)
    serve = shlex.split(last)  # the shell expands $hosts inside the quoted launcher
    assert serve[:3] == ["exec", CLI, "serve"] and serve[serve.index("--launcher") + 1] == (
        "/opt/hpcx/ompi/bin/mpirun --allow-run-as-root -mca plm_rsh_agent /opt/trtllm-pipeline/scripts/kubessh "
        "--host $hosts -n 4 trtllm-llmapi-launch"
    )
    assert ["--http-port", "8000", "--openai", "--openai-port", "9000"] == serve[8:13]
    assert sorted(objects["ConfigMap"]["data"]) == ["llama-3.1-70b-fp8-tp4.yaml"]  # serve reads the build's options
    assert [p["name"] for p in server_of(leader)["ports"]] == ["openai"]
    assert server_of(leader)["readinessProbe"]["httpGet"] == {"path": "/health", "port": "openai"}
    assert [p["targetPort"] for p in objects["Service"]["spec"]["ports"]] == ["openai"]
    assert objects["Service"]["spec"]["selector"] == {  # the leaders; the group's own headless Service is the LWS's
        "leaderworkerset.sigs.k8s.io/name": "llama-3-1-70b-fp8-tp4-group",
        "leaderworkerset.sigs.k8s.io/worker-index": "0",
    }
    assert objects["Service"]["metadata"]["name"] == "llama-3-1-70b-fp8-tp4"
    rules = objects["Role"]["rules"]
    assert {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["get", "create"]} in rules


def test_an_engine_group_asked_for_the_gateway_is_refused_naming_the_backend_whose_group_has_it():
    """An engine group's leader runs tritonserver's ranks under mpirun, not `serve`: its gateway fields are not read."""
    from pipeline.errors import ConfigError

    group = ["parallel.tp_size=2", "deploy.gpus_per_node=1", "deploy.openai_gateway=true"]
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "build_configs/smollm2-135m-int4-awq.yaml", group)
    (problem,) = [p for p in info.value.problems if ": deploy.openai_gateway: " in p]
    assert "is not honoured by target trtllm" in problem and "target.trtllm_backend: pytorch" in problem


def test_a_groups_gateway_is_checked_as_one_pods_is(tmp_path):
    """The 70B group's leader runs the gateway: exposed without a key, or on trtllm-serve's port, it is refused."""
    from pipeline.errors import ConfigError

    model = llama_shape(tmp_path, "70b")
    exposed = [f"model.path={model}", "deploy.service_type=LoadBalancer", "deploy.ports.openai=8000"]
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "build_configs/llama-3.1-70b-fp8-tp4.yaml", exposed)
    said = "\n".join(info.value.problems)
    assert "deploy.ports.openai: 8000 is also deploy.ports.http" in said
    assert "deploy.api_key_secret: service_type LoadBalancer exposes the OpenAI gateway" in said


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
    # trtllm-serve opens no gRPC port: grpc's number is free
    exposed = run_cli(
        "validate", "build_configs/llama-3.1-8b-fp8-h100.yaml", f"model.path={llama_shape(tmp_path, '8b')}",
        "deploy.ports.http=8001",
    )  # fmt: skip
    assert exposed.returncode == 0, exposed.stderr


def test_the_gateway_in_front_of_trtllm_serve_takes_the_key_of_the_secret(tmp_path):
    """deploy.api_key_secret becomes the gateway's key (TRTLLM_PIPELINE_API_KEY from the Secret), so the command
    drops --allow-unauthenticated; the manifests pass the offline checks."""
    cfg = load_config(REPO / "build_configs/llama-3.1-8b-fp8-h100.yaml", [f"model.path={llama_shape(tmp_path, '8b')}"])
    cfg.deploy.api_key_secret = "llm-key"
    dep = plan_deployment(cfg, serving_of(cfg), "llama-3.1-8b-fp8-h100")
    objects = render(cfg, dep)
    server = server_of(next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"])
    assert "--allow-unauthenticated" not in server["command"] and "--openai" in server["command"]
    secret = {"secretKeyRef": {"name": "llm-key", "key": "api-key"}}
    assert {"name": "TRTLLM_PIPELINE_API_KEY", "valueFrom": secret} in server["env"]
    assert checks.manifest_problems(objects, dep, cfg, None) == []


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
    # the core schema (kubernetes-validate's) checks the pod templates, which the CRD's leaves open
    assert f"{worker}.terminationGracePeriodSeconds: 'soon' is not of type 'integer', 'null'" in problems
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
    from pipeline.triton.server import free_ports

    ports = dict(zip(("http", "grpc", "metrics", "openai"), free_ports(4)))
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
        assert InferenceServerClient(f"127.0.0.1:{container_ports['grpc']}").is_server_ready()
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


@pytest.mark.parametrize("config", ["build_configs/smollm2-135m-fp8.yaml", "build_configs/smollm2-135m-int4-awq.yaml"])
def test_a_release_no_image_of_ours_holds_is_refused_before_a_manifest_names_that_image(tmp_path, config):
    """TensorRT-LLM 1.0's container pins a transformers below ours, so its Dockerfile stage only exits 1: manifests
    whose pods and build Job ran `trtllm-pipeline:gpu-1.0` would never start. deploy says why and what to target."""
    result = run_cli("deploy", config, 'target.trtllm_version="1.0"', "-o", str(tmp_path))
    said = " ".join(result.stderr.split())
    assert result.returncode == 1 and "target.trtllm_version: deploy runs our GPU image" in said
    assert "holds transformers 4.53.1" in said and "target 1.1 or 1.2" in said
    assert not (tmp_path / "deploy" / "k8s").exists()


@pytest.mark.parametrize("config", [CPU_CONFIG, "build_configs/smollm2-135m-int4-awq.yaml"])
def test_only_the_deploy_stage_hashes_the_deployment_code(config):
    """Editing how an output is deployed must not re-run the stages that built it."""
    from pipeline.plan import stage_inputs
    from pipeline.stages import STAGES

    cfg = load_config(REPO / config)
    for name, stage in STAGES.items():
        code = stage_inputs(stage, cfg, None, {})["code"]
        deployment = sorted(path for path in code if "/k8s/" in path or path.endswith("/deployment.py"))
        assert bool(deployment) == (name == "deploy"), (name, deployment)
        if name == "deploy":
            serving = f"pipeline/targets/{cfg.target.name}/deployment.py"
            assert serving in code and "pipeline/upstream/leaderworkerset.json" in code


def test_tabulated_deployment_facts_name_the_upstream_commit_they_were_read_at():
    from pipeline.targets.trtllm.llm_api_options import LLM_API_RELEASES
    from pipeline.upstream import facts, releases

    commit = re.compile(r"[0-9a-f]{40}")
    sources = [*facts("leaderworkerset")["sources"], facts("prometheus_adapter")["source"]]
    assert all(commit.fullmatch(source["commit"]) and source["pinned"] for source in sources), sources
    # every release the pytorch backend builds can be deployed (tests/test_upstream_facts.py checks its citations)
    assert set(LLM_API_RELEASES) <= set(releases("trtllm_serving"))


def test_the_lws_table_holds_what_the_manifests_rely_on():
    """The API, labels and env variables the manifests and the leader's script name, the workers' pod names, and
    pod templates left to the core schema."""
    from pipeline.k8s.manifests import LWS_API, LWS_NAME_LABEL, LWS_WORKER_INDEX_LABEL
    from pipeline.targets.trtllm.deployment import mpi_group_command
    from pipeline.upstream import facts

    lws = facts("leaderworkerset")
    assert LWS_API == f"{lws['group']}/{lws['version']}" and lws["kind"] == "LeaderWorkerSet"
    assert lws["labels"][LWS_NAME_LABEL]["kind"] == lws["labels"][LWS_WORKER_INDEX_LABEL]["kind"] == ["label"]
    script = mpi_group_command("mpirun", [["a"]], 1)[2]
    assert set(re.findall(r"\bLWS_\w+", script)) == {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE"} <= set(lws["env"])
    # the script takes the leader's pod name (the set's name, the group's index) as the address's first DNS label
    address = lws["env"]["LWS_LEADER_ADDRESS"]["value"]
    assert address[: address.index(".")] == [{"label": LWS_NAME_LABEL}, "-", {"label": lws_label("group-index")}]
    assert lws["worker_pods"] == {"statefulset_named_after": "leader pod", "first_ordinal": 1}  # $leader-1 ...
    assert lws["pod_templates"] == [
        "spec.leaderWorkerTemplate.leaderTemplate",
        "spec.leaderWorkerTemplate.workerTemplate",
    ]
    for path in lws["pod_templates"]:
        node = lws["schema"]
        for key in path.split("."):
            node = node["properties"][key]
        assert node == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    assert "description" not in json.dumps(lws["schema"])  # no prose


def lws_label(name: str) -> str:
    return f"leaderworkerset.sigs.k8s.io/{name}"


def test_an_unknown_field_of_a_pod_template_is_refused_where_it_sits():
    cfg, dep, objects = rendered(
        "build_configs/smollm2-135m-int4-awq.yaml", "parallel.tp_size=3", "deploy.gpus_per_node=1"
    )
    group = copy.deepcopy(next(o for o in objects if o["kind"] == "LeaderWorkerSet"))
    group["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]["imagePullPolicee"] = "Always"
    group["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labelz"] = {}
    name = "LeaderWorkerSet/smollm2-135m-int4-awq-group: spec.leaderWorkerTemplate"
    assert checks.schema_problems([group], "1.33") == [
        f"{name}.leaderTemplate.spec.containers[0]: Additional properties are not allowed ('imagePullPolicee' was "
        "unexpected)",
        f"{name}.workerTemplate.metadata: Additional properties are not allowed ('labelz' was unexpected)",
    ]


# A CRD as controller-gen writes one, with names of our own: prose everywhere, a property called `description`,
# a nested object with a required list, an int-or-string and a pod template (an object of metadata and a spec with
# containers) that the tabulator leaves to the core schema.
WIDGET_CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  annotations:
    controller-gen.kubebuilder.io/version: v0.1.0
  name: widgets.example.org
spec:
  group: example.org
  names:
    kind: Widget
    plural: widgets
  scope: Cluster
  versions:
  - name: v1alpha1
    served: false
    storage: false
  - name: v1
    served: true
    storage: true
    subresources:
      status: {}
    schema:
      openAPIV3Schema:
        description: A widget.
        type: object
        properties:
          spec:
            description: What the widget should be.
            type: object
            required:
            - parts
            properties:
              description:
                description: A property that happens to be called so.
                type: string
              parts:
                type: object
                properties:
                  count:
                    format: int32
                    type: integer
                  spare:
                    anyOf:
                    - type: integer
                    - type: string
                    x-kubernetes-int-or-string: true
              podSpecLike:
                type: object
                properties:
                  metadata:
                    type: object
                  spec:
                    type: object
                    properties:
                      containers:
                        description: The containers.
                        type: array
"""


def test_the_lws_tabulator_keeps_the_crd_schema_without_prose_or_pod_templates():
    tab = dev_script("tabulate_lws")
    crd = tab.crd_facts(WIDGET_CRD)
    schema = crd.pop("schema")
    assert crd == {
        "group": "example.org",
        "version": "v1",
        "kind": "Widget",
        "plural": "widgets",
        "short_names": [],
        "scope": "Cluster",
        "served": True,
        "storage": True,
        "subresources": ["status"],
        "controller_gen": "v0.1.0",
        "pod_templates": ["spec.podSpecLike"],
        "schema_keywords": {
            "format: int32": 1,
            "x-kubernetes-int-or-string": 1,
            "x-kubernetes-preserve-unknown-fields": 1,
        },
    }
    assert schema == {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "required": ["parts"],
                "properties": {
                    "description": {"type": "string"},
                    "parts": {
                        "type": "object",
                        "properties": {
                            "count": {"format": "int32", "type": "integer"},
                            "spare": {
                                "anyOf": [{"type": "integer"}, {"type": "string"}],
                                "x-kubernetes-int-or-string": True,
                            },
                        },
                    },
                    "podSpecLike": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                },
            }
        },
    }


# The Go a pod webhook injects env variables with (names of our own): values from the pod's labels, annotations and
# fields, one joined by fmt.Sprintf; a constant of another prefix, and one no EnvVar names.
GADGET_TYPES = """
const (
	// The set's name.
	SetLabel string = "gadgets.example.org/set"
	IndexLabel string = "gadgets.example.org/index"
	CountAnnotationKey string = "gadgets.example.org/count"
	HashKey string = "gadgets.example.org/hash"
	HostEnv string = "GADGET_HOST"
	CountEnv string = "GADGET_COUNT"
	UnusedEnv string = "GADGET_UNUSED"
)
"""
GADGET_WEBHOOK = """
func AddGadgetVariables(pod *corev1.Pod) error {
	set, found := pod.Labels[gadgets.SetLabel]
	index, found := pod.Labels[gadgets.IndexLabel]
	host := corev1.EnvVar{
		Name:  gadgets.HostEnv,
		Value: fmt.Sprintf("%s-%s.%s.svc", set, index, pod.ObjectMeta.Namespace),
	}
	count, found := pod.Annotations[gadgets.CountAnnotationKey]
	countVar := corev1.EnvVar{
		Name:  gadgets.CountEnv,
		Value: count,
	}
	other := corev1.EnvVar{Name: "LITERAL", Value: "x"}
	return nil
}

func workers(leaderPod *corev1.Pod) {
	sts := appsapplyv1.StatefulSet(leaderPod.Name, leaderPod.Namespace).
		WithSpec(appsapplyv1.StatefulSetSpec().
			WithOrdinals(appsapplyv1.StatefulSetOrdinals().WithStart(1)).
			WithTemplate(x))
	pod.Labels[gadgets.HashKey] = hash
}
"""


def test_the_lws_tabulator_reads_env_values_as_the_labels_and_fields_they_join():
    tab = dev_script("tabulate_lws")
    consts = tab.go_string_constants(GADGET_TYPES)
    assert consts["SetLabel"] == "gadgets.example.org/set" and len(consts) == 7
    assert tab.env_facts(GADGET_WEBHOOK, consts) == {
        "GADGET_HOST": {
            "const": "HostEnv",
            "value": [
                {"label": "gadgets.example.org/set"},
                "-",
                {"label": "gadgets.example.org/index"},
                ".",
                {"field": "metadata.namespace"},
                ".svc",
            ],
        },
        "GADGET_COUNT": {"const": "CountEnv", "value": [{"annotation": "gadgets.example.org/count"}]},
    }
    assert tab.label_kinds(consts, [GADGET_WEBHOOK], "gadgets.example.org/") == {
        "gadgets.example.org/count": {"const": "CountAnnotationKey", "kind": ["annotation"]},
        "gadgets.example.org/hash": {"const": "HashKey", "kind": ["label"]},  # by the map it indexes
        "gadgets.example.org/index": {"const": "IndexLabel", "kind": ["label"]},
        "gadgets.example.org/set": {"const": "SetLabel", "kind": ["label"]},
    }
    assert tab.worker_pod_facts(GADGET_WEBHOOK) == {"statefulset_named_after": "leader pod", "first_ordinal": 1}
    with pytest.raises(ValueError, match="the layout changed"):
        tab.worker_pod_facts(GADGET_WEBHOOK.replace("leaderPod.Name", "set.Name"))
    with pytest.raises(ValueError, match="the layout changed"):
        tab.env_facts(GADGET_WEBHOOK.replace("Value: count,", "Value: strconv.Itoa(n),"), consts)


# Go structs with yaml tags (names of our own): comments between fields, a pointer, a slice, a map of structs,
# json before yaml in the tag, a field with no yaml tag, and a struct with no tagged field.
KNOB_CONFIG = """
type MetricsDiscoveryConfig struct {
	// Rules are applied one by one.
	Rules []DiscoveryRule `json:"rules" yaml:"rules"`
	Extra *Extra `json:"extra,omitempty" yaml:"extra,omitempty"`
}

type DiscoveryRule struct {
	Query string `yaml:"query"`
	Groups map[string]Group `json:"groups,omitempty" yaml:"groups,omitempty"`
	internal int
	JSONOnly string `json:"jsonOnly"`
}

type Extra struct {
	cache map[string]string
}
"""


def test_the_adapter_tabulator_reads_each_structs_yaml_keys():
    tab = dev_script("tabulate_prometheus_adapter")
    assert tab.struct_fields(KNOB_CONFIG) == {
        "MetricsDiscoveryConfig": {
            "rules": {"field": "Rules", "type": "[]DiscoveryRule", "omitempty": False},
            "extra": {"field": "Extra", "type": "*Extra", "omitempty": True},
        },
        "DiscoveryRule": {
            "query": {"field": "Query", "type": "string", "omitempty": False},
            "groups": {"field": "Groups", "type": "map[string]Group", "omitempty": True},
        },
        "Extra": {},
    }
    with pytest.raises(ValueError, match="the layout changed"):
        tab.struct_fields(KNOB_CONFIG.replace("DiscoveryRule struct", "Rule struct"))


def test_the_adapter_table_knows_every_key_of_the_rule_deploy_writes():
    from pipeline.k8s.manifests import adapter_config
    from pipeline.upstream import facts

    structs = facts("prometheus_adapter")["structs"]
    assert {"MetricsDiscoveryConfig", "DiscoveryRule", "ResourceMapping", "NameMapping"} <= set(structs)
    cfg, dep, _ = rendered(
        "build_configs/smollm2-135m-int4-awq.yaml",
        "deploy.autoscaling={min_replicas: 1, max_replicas: 3, queued_requests_per_replica: 0.5}",
    )
    config = adapter_config(cfg, dep)
    assert config is not None and checks.adapter_problems(config) == []
    config["rules"][0]["seriesQueery"] = "x"
    assert checks.adapter_problems(config)[0].startswith("prometheus-adapter config: rules.seriesQueery: unknown key")


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
