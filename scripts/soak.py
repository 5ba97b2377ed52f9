"""Soak a real `trtllm-pipeline serve --openai` on loopback: streams, cancellations, disconnects and malformed
requests from several clients at once, for a bounded time, with faults injected on the way: a model process killed
with SIGKILL (the LLM model's, then the BLS's) and `serve` itself killed with SIGKILL. After each fault the soak
restarts `serve`, as a supervisor (Kubernetes' restartPolicy) would. Reports requests served, rejections and
failures by kind, each fault's timings, the server's RSS and /dev/shm, and whether stopping it left anything behind.

A failure is expected only while the server is down: from a fault until the restarted server is ready. Exit code 0
only when nothing failed outside those windows (a 5xx, a reset connection, a stream cut without [DONE]) and no
request hung (each has a 60 s timeout); each fault was noticed (a killed model process: `serve` exits non-zero
naming the model; a killed `serve`: tritonserver and its model processes gone, its ports closed, and its /dev/shm
regions and temp directory reclaimed by the next `serve`); the server answered promptly afterwards with nothing left
running or queued; and SIGTERM left no process or shared-memory region. Usage (the default config built first,
e.g. by `make build-engine`):
    python scripts/soak.py build_configs/smollm2-135m-cpu.yaml --minutes 10 --clients 6 --report soak.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
import psutil

API_KEY = "soak-key"
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "Count to ten:", "What is 2+2?"]
# (what it is, request body or raw bytes, the status a correct server answers)
MALFORMED = [
    ("bad-json", b'{"model": ', 400),
    ("not-utf8", b'{"model": "m", "prompt": "\xff\xfe"}', 400),
    ("lone-surrogate", json.dumps({"prompt": "abc \ud800", "max_tokens": 4}).encode(), 400),
    ("seed-2**64", {"prompt": "hi", "seed": 2**64}, 400),
    ("max-tokens-overflow", {"prompt": "hi", "max_tokens": 4294967301}, 400),
    ("temperature-negative", {"prompt": "hi", "temperature": -1}, 400),
    ("unknown-model", {"model": "no-such-model", "prompt": "hi"}, 404),
    ("body-too-large", {"prompt": "word " * 3_000_000}, 413),
]
TRITON_BAD = [
    {"temperature": -1},
    {"top_p": 2},
    {"top_k": -5},
    {"end_id": -7},
    {"repetition_penalty": 0},
    {"max_tokens": 0},
]


REQUEST_TIMEOUT = 60.0  # a request still unanswered after this hung: a failure, down or not


class Soak:
    def __init__(self, gateway: str, http: str, model: str, seed: int):
        self.gateway, self.http, self.model = gateway, http, model
        self.client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=API_KEY, max_retries=0, timeout=REQUEST_TIMEOUT)
        # "served:<kind>", "rejected:<kind>:<status>", "interrupted:<kind>:<why>" (while down), "failed:<kind>:<why>"
        self.counts: Counter = Counter()
        self.lock = threading.Lock()
        self.random = random.Random(seed)
        self.down_since: float | None = None  # set from a fault until the restarted server is ready
        self.up_again = 0.0  # when the server last came back: failures just after it still belong to the outage

    def count(self, key: str) -> None:
        with self.lock:
            self.counts[key] += 1

    def fail(self, kind: str, why: str) -> None:
        """A failure: expected while the server is down (a fault was injected), unexpected otherwise, and never
        expected when the request hung."""
        outage = self.down_since is not None or time.monotonic() < self.up_again + OUTAGE_GRACE_S
        expected = outage and why not in ("APITimeoutError", "ReadTimeout", "TimeoutException")
        self.count(f"{'interrupted' if expected else 'failed'}:{kind}:{why}")
        if outage:
            time.sleep(0.2)  # no busy loop against a closed port

    # ------------------------------------------------------------ what clients do

    def chat_stream(self) -> None:
        stream = self.client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": self.random.choice(PROMPTS)}],
            max_tokens=self.random.randint(4, 48),
            temperature=self.random.choice([0, 0.7, 1.0]),
            stream=True,
        )
        finishes = [c.choices[0].finish_reason for c in stream if c.choices]
        if finishes and finishes[-1]:
            self.count("served:chat-stream")
        else:
            self.fail("chat-stream", "no-finish")

    def completion(self) -> None:
        reply = self.client.completions.create(
            model=self.model, prompt=self.random.choice(PROMPTS), max_tokens=self.random.randint(4, 32)
        )
        if reply.choices[0].finish_reason:
            self.count("served:completion")
        else:
            self.fail("completion", "no-finish")

    def cancelled_stream(self) -> None:
        stream = self.client.completions.create(
            model=self.model, prompt=self.random.choice(PROMPTS), max_tokens=400, stream=True
        )
        for index, _ in enumerate(stream):
            if index == 2:
                break
        stream.close()
        self.count("served:cancelled-stream")

    def disconnect(self) -> None:
        """A client that sends a request and hangs up before the answer."""
        connection = http.client.HTTPConnection(*self.gateway.removeprefix("http://").split(":"), timeout=30)
        body = json.dumps({"model": self.model, "prompt": self.random.choice(PROMPTS), "max_tokens": 300})
        connection.request(
            "POST",
            "/v1/completions",
            body,
            {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
        )
        time.sleep(self.random.uniform(0.05, 1.0))
        connection.close()
        self.count("served:disconnect")

    def malformed(self) -> None:
        kind, body, expected = self.random.choice(MALFORMED)
        if isinstance(body, dict):
            body = json.dumps({"model": self.model, **body}).encode()
        self.expect(
            kind,
            expected,
            httpx.post(f"{self.gateway}/v1/completions", content=body, headers=self.auth(), timeout=REQUEST_TIMEOUT),
        )

    def unauthenticated(self) -> None:
        self.expect("no-api-key", 401, httpx.get(f"{self.gateway}/v1/models", timeout=30))

    def triton_bad_sampling(self) -> None:
        bad = self.random.choice(TRITON_BAD)
        reply = httpx.post(
            f"{self.http}/v2/models/ensemble/generate",
            json={"text_input": "hi", "max_tokens": 4, **bad},
            timeout=REQUEST_TIMEOUT,
        )
        self.expect(f"triton-{next(iter(bad))}", 400, reply)

    def triton_stream(self) -> None:
        body = {"text_input": self.random.choice(PROMPTS), "max_tokens": 16, "stream": True}
        with httpx.stream(
            "POST", f"{self.http}/v2/models/tensorrt_llm_bls/generate_stream", json=body, timeout=REQUEST_TIMEOUT
        ) as r:
            events = [line for line in r.iter_lines() if line.startswith("data:")]
        if r.status_code == 200 and events and all('"text_output"' in e for e in events):
            self.count("served:triton-stream")
        else:
            self.fail("triton-stream", str(r.status_code))

    # ------------------------------------------------------------ bookkeeping

    @staticmethod
    def auth() -> dict:
        return {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}

    def expect(self, kind: str, status: int, reply: httpx.Response) -> None:
        openai_shaped = "/v1/" not in str(reply.request.url) or "error" in reply.json()
        if reply.status_code == status and openai_shaped:
            self.count(f"rejected:{kind}:{status}")
        else:
            self.fail(kind, f"got-{reply.status_code}")

    ACTIONS = {  # action -> weight
        "chat_stream": 4,
        "completion": 3,
        "cancelled_stream": 2,
        "disconnect": 2,
        "malformed": 3,
        "unauthenticated": 1,
        "triton_bad_sampling": 2,
        "triton_stream": 2,
    }

    def worker(self, deadline: float) -> None:
        names, weights = zip(*self.ACTIONS.items())
        while time.monotonic() < deadline:
            action = self.random.choices(names, weights)[0]
            try:
                getattr(self, action)()
            except Exception as exc:  # every failure is counted by kind, never hidden
                self.fail(action, type(exc).__name__)


OUTAGE_GRACE_S = 5.0  # failures this long after the server is back still belong to the outage (requests in flight)
NOTICE_LIMIT_S = 15.0  # a fault must be noticed (serve exits, processes gone) within this
MODEL_PROCESS = "triton_python_backend_stub"


class Serve:
    """The `serve --openai` subprocess under test; restarted after each fault, as a supervisor would."""

    def __init__(self, command: list[str]):
        self.command, self.process, self.lines = command, None, []

    def start(self) -> Path:
        """Start serve and wait until it serves; returns the repository it serves."""
        self.lines = []
        self.process = subprocess.Popen(
            self.command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "TRTLLM_PIPELINE_API_KEY": API_KEY},
        )
        lines, stdout = self.lines, self.process.stdout
        threading.Thread(target=lambda: lines.extend(stdout), daemon=True).start()
        while not any("Ctrl-C stops" in line for line in lines):
            if self.process.poll() is not None:
                time.sleep(0.5)
                raise RuntimeError("serve did not start:\n" + "".join(lines))
            time.sleep(0.2)
        return Path(next(line for line in lines if line.startswith("serving")).split()[1]).resolve()

    def output(self) -> str:
        return "".join(self.lines)


def server_processes(serve: psutil.Process, repo: Path) -> list[psutil.Process]:
    """`serve` (with the gateway) plus the tritonserver serving `repo` and its python-backend stubs, zombies aside."""
    found = [serve]
    for process in psutil.process_iter(["cmdline", "status"]):
        if process.info["status"] == psutil.STATUS_ZOMBIE or process.pid == serve.pid:
            continue
        if any(str(repo) in arg for arg in process.info["cmdline"] or []):
            found.append(process)
    return found


def alive(processes: list[psutil.Process]) -> list[int]:
    """The pids still running (a zombie counts: serve should have reaped it)."""
    return [p.pid for p in processes if p.is_running()]


def running(processes: list[psutil.Process]) -> list[int]:
    """The pids still running, zombies aside: the orphans of a killed serve are reaped by init, if at all."""
    return [p.pid for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def model_process(processes: list[psutil.Process], model: str) -> psutil.Process:
    """The python-backend stub running `model` (its model.py is on the stub's command line)."""
    for process in processes:
        cmdline = process.cmdline()
        if process.name() == MODEL_PROCESS and any(f"/{model}/" in arg for arg in cmdline):
            return process
    raise RuntimeError(f"no {MODEL_PROCESS} process runs the model {model}")


def rss_mb(processes: list[psutil.Process]) -> float:
    return sum(p.memory_info().rss for p in processes if p.is_running()) / 2**20


def shm() -> dict[str, int]:
    return {p.name: p.stat().st_size for p in Path("/dev/shm").iterdir() if p.is_file()}


def server_token(processes: list[psutil.Process]) -> str:
    """The token naming a server's temp directory and /dev/shm regions (its stubs run from that directory), so
    that what other servers on the machine hold is never counted as left behind by this one."""
    for process in processes:
        try:
            cmdline = process.cmdline()
        except psutil.Error:  # gone meanwhile, or a zombie
            continue
        for arg in cmdline:
            if found := re.search(r"trtllm-pipeline-serve-([0-9a-f]+)/", arg):
                return found.group(1)
    raise RuntimeError("no process of the server runs from a trtllm-pipeline-serve-* directory")


def left_behind(token: str) -> list[str]:
    """The /dev/shm regions and the temp directory of the server named `token` that still exist."""
    regions = [p.name for p in Path("/dev/shm").glob(f"trtllm_pipeline_{token}_*")]
    return regions + [p.name for p in Path(tempfile.gettempdir()).glob(f"trtllm-pipeline-serve-{token}")]


def metric(metrics_url: str, name: str) -> float:
    text = httpx.get(f"{metrics_url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_until(condition, limit: float) -> float | None:
    """Seconds until `condition()` held, or None when it did not within `limit`."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        if condition():
            return round(time.monotonic() - started, 2)
        time.sleep(0.1)
    return None


def kill_model(serve: Serve, repo: Path, model: str) -> dict:
    """SIGKILL the model's process: serve must notice, stop serving and exit non-zero naming the model."""
    processes = server_processes(psutil.Process(serve.process.pid), repo)
    model_process(processes, model).kill()
    exited = wait_until(lambda: serve.process.poll() is not None, NOTICE_LIMIT_S)
    time.sleep(0.5)  # the output's last lines
    left = alive(processes[1:])
    return {
        "fault": f"kill -9 of the {model} model process",
        "serve exited after (s)": exited,
        "serve exit code": serve.process.returncode,
        "serve named the model": model in serve.output().split("Ctrl-C stops")[-1],
        "processes left": left,
        "noticed": exited is not None and serve.process.returncode not in (0, None) and not left,
    }


def kill_serve(serve: Serve, repo: Path, ports: list[int]) -> dict:
    """SIGKILL serve itself: tritonserver and its model processes must die with it and close their ports."""
    processes = server_processes(psutil.Process(serve.process.pid), repo)
    token = server_token(processes)
    serve.process.kill()
    serve.process.wait()
    gone = wait_until(lambda: not running(processes[1:]), NOTICE_LIMIT_S)
    closed = wait_until(lambda: not any(listening(p) for p in ports), NOTICE_LIMIT_S)
    return {
        "fault": "kill -9 of serve",
        "tritonserver and model processes gone after (s)": gone,
        "ports closed after (s)": closed,
        "noticed": gone is not None and closed is not None,
        "orphaned": token,  # its regions and directory: reclaimed once the next serve is up
    }


def serve_command(source: str, first_port: int, output: str | None = None) -> tuple[list[str], dict[str, int]]:
    """`serve --openai` of `source` on four loopback ports from `first_port`: (the command, option -> port)."""
    flags = ("--http-port", "--grpc-port", "--metrics-port", "--openai-port")
    ports = dict(zip(flags, range(first_port, first_port + 4)))
    command = [sys.executable, "-m", "pipeline.cli", "serve", source, "--openai"]
    command += [str(item) for option in ports.items() for item in option]
    return command + (["--output", output] if output else []), ports


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a build config (serves its output's triton_repo) or a repository directory")
    parser.add_argument("--output", help="the build's output directory (default: artifacts/CONFIG-NAME)")
    parser.add_argument("--minutes", type=float, default=10.0, help="how long clients send requests (default 10)")
    parser.add_argument("--clients", type=int, default=6, help="concurrent clients (default 6)")
    parser.add_argument("--port", type=int, default=18000, help="first of four loopback ports used (default 18000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request mix (default 0)")
    parser.add_argument(
        "--no-faults", action="store_true", help="no kills: only the request mix (default: three faults, see above)"
    )
    parser.add_argument("--report", type=Path, help="also write the report here as JSON")
    args = parser.parse_args()

    command, ports = serve_command(args.source, args.port, args.output)
    http_port, openai_port, metrics_port = ports["--http-port"], ports["--openai-port"], ports["--metrics-port"]
    shm_before = shm()
    serve = Serve(command)
    try:
        repo = serve.start()
    except RuntimeError as exc:
        print(exc)
        return 1
    gateway, http, metrics = (f"http://127.0.0.1:{port}" for port in (openai_port, http_port, metrics_port))
    model = httpx.get(f"{gateway}/v1/models", headers=Soak.auth()).json()["data"][0]["id"]
    soak = Soak(gateway, http, model, args.seed)
    soak.chat_stream()  # warm up before the first measurement
    processes = server_processes(psutil.Process(serve.process.pid), repo)
    rss_before, shm_serving = rss_mb(processes), shm()

    print(f"soaking {repo} for {args.minutes:g} min with {args.clients} clients ...", flush=True)
    started = time.monotonic()
    deadline = started + args.minutes * 60
    clients = [threading.Thread(target=soak.worker, args=(deadline,)) for _ in range(args.clients)]
    for client in clients:
        client.start()
    faults = [] if args.no_faults else [("model", "tensorrt_llm"), ("serve", None), ("model", "tensorrt_llm_bls")]
    results = []
    for number, (kind, target) in enumerate(faults, 1):
        time.sleep(max(0.0, started + number * args.minutes * 60 / (len(faults) + 1) - time.monotonic()))
        soak.down_since = time.monotonic()
        if kind == "model":
            result = kill_model(serve, repo, target)
        else:
            result = kill_serve(serve, repo, list(ports.values()))
        if serve.process.poll() is None:  # not noticed: stop it so the soak goes on
            serve.process.kill()
            serve.process.wait()
        restarted = time.monotonic()
        serve.start()
        result["restarted in (s)"] = round(time.monotonic() - restarted, 1)
        orphaned = result.pop("orphaned", None)
        if orphaned:
            result["left by the killed serve, after the next one started"] = left_behind(orphaned)
            result["noticed"] = result["noticed"] and not left_behind(orphaned)
        soak.up_again, soak.down_since = time.monotonic(), None
        results.append(result)
        print(json.dumps(result), flush=True)
    for client in clients:
        client.join()
    elapsed = time.monotonic() - started

    time.sleep(3)  # let cancelled rows retire
    processes = server_processes(psutil.Process(serve.process.pid), repo)
    token = server_token(processes)
    probe = time.monotonic()
    healthy = httpx.get(f"{gateway}/v1/models", headers=Soak.auth(), timeout=10).status_code == 200
    report = {
        "minutes": round(elapsed / 60, 2),
        "clients": args.clients,
        "requests": sum(soak.counts.values()),
        "served": sum(v for k, v in soak.counts.items() if k.startswith("served:")),
        "rejected as expected": sum(v for k, v in soak.counts.items() if k.startswith("rejected:")),
        "interrupted by a fault": sum(v for k, v in soak.counts.items() if k.startswith("interrupted:")),
        "failed": sum(v for k, v in soak.counts.items() if k.startswith("failed:")),
        "by kind": dict(sorted(soak.counts.items())),
        "faults": results,
        "healthy after": healthy,
        "models answer after (ms)": round((time.monotonic() - probe) * 1000, 1),
        "active rows after": metric(metrics, "trtllm_pipeline_active_rows"),
        "queued after": metric(metrics, "trtllm_pipeline_queued_requests"),
        "rss MB (serve + tritonserver + stubs)": {"before": round(rss_before, 1), "after": round(rss_mb(processes), 1)},
        "/dev/shm MB (all)": {
            "before serve": round(sum(shm_before.values()) / 2**20, 1),
            "serving": round(sum(shm_serving.values()) / 2**20, 1),
            "after soak": round(sum(shm().values()) / 2**20, 1),
        },
    }
    stop_started = time.monotonic()
    serve.process.send_signal(signal.SIGTERM)
    serve.process.wait(timeout=120)
    time.sleep(1)
    report["stop (s)"] = round(time.monotonic() - stop_started, 1)
    report["serve exit code"] = serve.process.returncode
    report["processes left"] = alive(processes)
    report["/dev/shm regions and temp directory left"] = left_behind(token)

    print(json.dumps(report, indent=2))
    if args.report:
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    clean = not (report["processes left"] or report["/dev/shm regions and temp directory left"])
    quiet = report["active rows after"] == 0 and report["queued after"] == 0
    noticed = all(result["noticed"] for result in results)
    return (
        0 if report["failed"] == 0 and healthy and clean and quiet and noticed and serve.process.returncode == 0 else 1
    )


if __name__ == "__main__":
    sys.exit(main())
