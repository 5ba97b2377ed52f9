"""Soak a real `trtllm-pipeline serve --openai` on loopback: streams, cancellations, disconnects and malformed
requests from several clients at once, for a bounded time. Reports requests served, rejections and failures by
kind, the server's RSS and /dev/shm before and after, and whether stopping it left anything behind.

Exit code 0 only when no request failed unexpectedly (a 5xx, a reset connection, a stream cut without [DONE]),
the server answered promptly afterwards with nothing left running or queued, and SIGTERM left no process or
shared-memory region. Usage (the default config built first, e.g. by `make build-engine`):
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
import subprocess
import sys
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


class Soak:
    def __init__(self, gateway: str, http: str, model: str, seed: int):
        self.gateway, self.http, self.model = gateway, http, model
        self.client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=API_KEY, max_retries=0, timeout=300)
        self.counts: Counter = Counter()  # "served:<kind>", "rejected:<kind>:<status>", "failed:<kind>:<why>"
        self.lock = threading.Lock()
        self.random = random.Random(seed)

    def count(self, key: str) -> None:
        with self.lock:
            self.counts[key] += 1

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
        self.count("served:chat-stream" if finishes and finishes[-1] else "failed:chat-stream:no-finish")

    def completion(self) -> None:
        reply = self.client.completions.create(
            model=self.model, prompt=self.random.choice(PROMPTS), max_tokens=self.random.randint(4, 32)
        )
        self.count("served:completion" if reply.choices[0].finish_reason else "failed:completion:no-finish")

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
            kind, expected, httpx.post(f"{self.gateway}/v1/completions", content=body, headers=self.auth(), timeout=120)
        )

    def unauthenticated(self) -> None:
        self.expect("no-api-key", 401, httpx.get(f"{self.gateway}/v1/models", timeout=30))

    def triton_bad_sampling(self) -> None:
        bad = self.random.choice(TRITON_BAD)
        reply = httpx.post(
            f"{self.http}/v2/models/ensemble/generate", json={"text_input": "hi", "max_tokens": 4, **bad}, timeout=60
        )
        self.expect(f"triton-{next(iter(bad))}", 400, reply)

    def triton_stream(self) -> None:
        body = {"text_input": self.random.choice(PROMPTS), "max_tokens": 16, "stream": True}
        with httpx.stream(
            "POST", f"{self.http}/v2/models/tensorrt_llm_bls/generate_stream", json=body, timeout=120
        ) as r:
            events = [line for line in r.iter_lines() if line.startswith("data:")]
        ok = r.status_code == 200 and events and all('"text_output"' in e for e in events)
        self.count("served:triton-stream" if ok else f"failed:triton-stream:{r.status_code}")

    # ------------------------------------------------------------ bookkeeping

    @staticmethod
    def auth() -> dict:
        return {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}

    def expect(self, kind: str, status: int, reply: httpx.Response) -> None:
        openai_shaped = "/v1/" not in str(reply.request.url) or "error" in reply.json()
        if reply.status_code == status and openai_shaped:
            self.count(f"rejected:{kind}:{status}")
        else:
            self.count(f"failed:{kind}:got-{reply.status_code}")

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
            except Exception as exc:  # every unexpected failure is counted by kind, never hidden
                self.count(f"failed:{action}:{type(exc).__name__}")


def server_processes(serve: psutil.Process, repo: Path) -> list[psutil.Process]:
    """`serve` (with the gateway) plus the tritonserver serving `repo` and its python-backend stubs."""
    found = [serve]
    for process in psutil.process_iter(["cmdline"]):
        if process.pid != serve.pid and any(str(repo) in arg for arg in process.info["cmdline"] or []):
            found.append(process)
    return found


def rss_mb(processes: list[psutil.Process]) -> float:
    return sum(p.memory_info().rss for p in processes if p.is_running()) / 2**20


def shm() -> dict[str, int]:
    return {p.name: p.stat().st_size for p in Path("/dev/shm").iterdir() if p.is_file()}


def metric(metrics_url: str, name: str) -> float:
    text = httpx.get(f"{metrics_url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a build config (serves its output's triton_repo) or a repository directory")
    parser.add_argument("--output", help="the build's output directory (default: artifacts/CONFIG-NAME)")
    parser.add_argument("--minutes", type=float, default=10.0, help="how long clients send requests (default 10)")
    parser.add_argument("--clients", type=int, default=6, help="concurrent clients (default 6)")
    parser.add_argument("--port", type=int, default=18000, help="first of four loopback ports used (default 18000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request mix (default 0)")
    parser.add_argument("--report", type=Path, help="also write the report here as JSON")
    args = parser.parse_args()

    http_port, grpc_port, metrics_port, openai_port = args.port, args.port + 1, args.port + 2, args.port + 3
    ports = {
        "--http-port": http_port,
        "--grpc-port": grpc_port,
        "--metrics-port": metrics_port,
        "--openai-port": openai_port,
    }
    command = [sys.executable, "-m", "pipeline.cli", "serve", args.source, "--openai"]
    command += [str(item) for option in ports.items() for item in option]
    if args.output:
        command += ["--output", args.output]
    shm_before = shm()
    serve = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TRTLLM_PIPELINE_API_KEY": API_KEY},
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(serve.stdout), daemon=True).start()
    while not any("Ctrl-C stops" in line for line in lines):
        if serve.poll() is not None:
            print("".join(lines))
            return 1
        time.sleep(0.5)
    repo = Path(next(line for line in lines if "serving" in line).split()[1]).resolve()
    gateway, http, metrics = (f"http://127.0.0.1:{port}" for port in (openai_port, http_port, metrics_port))
    model = httpx.get(f"{gateway}/v1/models", headers=Soak.auth()).json()["data"][0]["id"]
    processes = server_processes(psutil.Process(serve.pid), repo)
    soak = Soak(gateway, http, model, args.seed)
    soak.chat_stream()  # warm up before the first measurement
    rss_before, shm_serving = rss_mb(processes), shm()

    print(f"soaking {repo} for {args.minutes:g} min with {args.clients} clients ...", flush=True)
    started = time.monotonic()
    deadline = started + args.minutes * 60
    clients = [threading.Thread(target=soak.worker, args=(deadline,)) for _ in range(args.clients)]
    for client in clients:
        client.start()
    for client in clients:
        client.join()
    elapsed = time.monotonic() - started

    time.sleep(3)  # let cancelled rows retire
    probe = time.monotonic()
    healthy = httpx.get(f"{gateway}/v1/models", headers=Soak.auth(), timeout=10).status_code == 200
    report = {
        "minutes": round(elapsed / 60, 2),
        "clients": args.clients,
        "requests": sum(soak.counts.values()),
        "served": sum(v for k, v in soak.counts.items() if k.startswith("served:")),
        "rejected as expected": sum(v for k, v in soak.counts.items() if k.startswith("rejected:")),
        "failed": sum(v for k, v in soak.counts.items() if k.startswith("failed:")),
        "by kind": dict(sorted(soak.counts.items())),
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
    serve.send_signal(signal.SIGTERM)
    serve.wait(timeout=120)
    time.sleep(1)
    report["stop (s)"] = round(time.monotonic() - stop_started, 1)
    report["serve exit code"] = serve.returncode
    report["processes left"] = [p.pid for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    report["/dev/shm regions left"] = sorted(set(shm()) - set(shm_before))

    print(json.dumps(report, indent=2))
    if args.report:
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    clean = not report["processes left"] and not report["/dev/shm regions left"] and serve.returncode == 0
    quiet = report["active rows after"] == 0 and report["queued after"] == 0
    return 0 if report["failed"] == 0 and healthy and clean and quiet else 1


if __name__ == "__main__":
    sys.exit(main())
