"""Processes of a real `serve --openai` killed with SIGKILL, as a hostile user (or the OOM killer) does it.

Found: a dead model process was never noticed (in-flight streams hung, later requests got 400, health stayed 200,
and killing the BLS left the other model processes zombies); a killed `serve` left tritonserver and its model
processes running with their ports open, and its /dev/shm regions and temp directory behind; `--host 127.0.0.2`
or `::1` never got ready. Each test starts the real CLI in a subprocess on the SmolLM2 build and kills real
processes; the times it measures are printed (pytest -s).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from pipeline.triton.server import (
    OWNER,
    SHM_PREFIX,
    STUB,
    WORK_PREFIX,
    Ports,
    dial_address,
    free_ports,
    reclaim_orphans,
)
from tests.conftest import REPO, spawn_cli

PROMPT = "Once upon a time"
ERROR_WITHIN = 5.0  # seconds from a kill to every in-flight client's error (measured 0.1 s)
EXIT_WITHIN = 10.0  # ... to serve's exit (measured 1.4-1.8 s)
GONE_WITHIN = 10.0  # ... of serve to tritonserver and its model processes gone (measured 0.02 s and 0.5-2.6 s)


class Serve:
    """`python -m pipeline.cli serve REPO --openai` in a session of its own (a test kills it alone), output kept."""

    def __init__(self, repo: Path, log_file: Path, host: str = "127.0.0.1"):
        http, grpc, metrics, self.openai_port = free_ports(4)
        self.host, self.ports = host, Ports(http, grpc, metrics)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "serve", str(repo), "--host", host, "--log-file", str(log_file),
             "--http-port", str(self.ports.http), "--grpc-port", str(self.ports.grpc),
             "--metrics-port", str(self.ports.metrics), "--openai", "--openai-port", str(self.openai_port)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, "COLUMNS": "200"},
        )  # fmt: skip
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self.reader.start()

    def output(self) -> str:
        return "".join(self.lines)

    def wait_serving(self, timeout: float = 180) -> "Serve":
        deadline = time.monotonic() + timeout
        while "Ctrl-C stops the server" not in self.output():
            assert self.process.poll() is None and time.monotonic() < deadline, self.output()
            time.sleep(0.2)
        return self

    def processes(self) -> list[psutil.Process]:
        """tritonserver and its model processes."""
        return psutil.Process(self.process.pid).children(recursive=True)

    def model_process(self, model: str) -> psutil.Process:
        """A model's python-backend stub: its command line names <repo>/<model>/1/model.py."""
        return next(p for p in self.processes() if p.name() == STUB and any(f"/{model}/" in arg for arg in p.cmdline()))

    def url(self, path: str) -> str:
        return f"http://{dial_address(self.host, self.openai_port)}{path}"

    def finish(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.reader.join(10)


class Streams:
    """Streaming completions through the gateway, one thread each, until the server ends them."""

    def __init__(self, serve: Serve, count: int):
        self.model = httpx.get(serve.url("/v1/models"), timeout=30).json()["data"][0]["id"]
        self.results: list[dict] = [{"events": []} for _ in range(count)]
        self.threads = [threading.Thread(target=self._stream, args=(serve, r), daemon=True) for r in self.results]
        for thread in self.threads:
            thread.start()

    def _stream(self, serve: Serve, result: dict) -> None:
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": 1500, "min_tokens": 1500, "stream": True}
        try:
            with httpx.stream("POST", serve.url("/v1/completions"), json=body, timeout=60) as response:
                result["status"] = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        result["events"].append(line.removeprefix("data: "))
        except httpx.HTTPError as exc:
            result["exception"] = repr(exc)
        result["ended"] = time.monotonic()

    def wait_first_tokens(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not all(r["events"] or "ended" in r for r in self.results):
            assert time.monotonic() < deadline, self.results
            time.sleep(0.1)
        assert not any("ended" in r for r in self.results), self.results

    def join(self, timeout: float) -> None:
        for thread in self.threads:
            thread.join(timeout)


def failed(result: dict) -> bool:
    """The stream ended with an error: refused because `serve` had already exited (a stream that starts after the
    others brought the server down), a status >= 500, or after the 200 an error event (then [DONE])."""
    if result.get("status", 0) >= 500 or result.get("exception", "").startswith("ConnectError("):
        return True
    return any("error" in json.loads(event) for event in result["events"] if event != "[DONE]")


def exited(process: psutil.Process) -> bool:
    """Gone, or a zombie (its exit is done; reaping is its parent's business)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(condition, limit: float) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < limit, f"not within {limit} s"
        time.sleep(0.02)
    return time.monotonic() - started


def listening(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        return s.connect_ex((host, port)) == 0


@pytest.fixture
def repo(smollm2_build) -> Path:
    return smollm2_build / "triton_repo"


@pytest.mark.parametrize("model", ["tensorrt_llm", "tensorrt_llm_bls"])
def test_a_killed_model_process_fails_in_flight_streams_and_serve_exits_naming_it(repo, tmp_path, model):
    """tensorrt_llm is the LLM (the onnxruntime Triton model's scheduler), which the gateway streams from;
    tensorrt_llm_bls the BLS that Triton clients may call."""
    serve = Serve(repo, tmp_path / "tritonserver.log").wait_serving()
    try:
        server = serve.processes()
        streams = Streams(serve, 4)
        streams.wait_first_tokens()
        victim = serve.model_process(model)
        killed = time.monotonic()
        victim.kill()
        streams.join(ERROR_WITHIN + 30)
        errors_after = [round(r["ended"] - killed, 2) for r in streams.results if "ended" in r]
        assert len(errors_after) == 4 and all(map(failed, streams.results)), streams.results
        assert max(errors_after) < ERROR_WITHIN, errors_after
        serve.process.wait(EXIT_WITHIN)
        exit_after = time.monotonic() - killed
        print(f"\nkill -9 {model}: clients' errors after {errors_after} s, serve's exit after {exit_after:.2f} s")
        assert serve.process.returncode == 1, serve.output()
        assert f"the process of model '{model}' (pid {victim.pid}) died" in serve.output()
        assert not [p for p in server if p.is_running()]  # none left, not even a zombie: serve reaped them
    finally:
        serve.finish()


# Appended to a copy of the LLM model's model.py: the scheduler thread's metrics update raises once a row runs (a
# failure step() does not contain), so the thread dies after the first token.
FAILING_METRICS = """

_Model = TritonPythonModel


class TritonPythonModel(_Model):
    def initialize(self, args):
        super().initialize(args)
        forward = self.scheduler.on_metrics

        def failing(increments, levels):
            if levels.get("active_rows"):
                raise RuntimeError("injected: the metrics update failed")
            forward(increments, levels)

        self.scheduler.on_metrics = failing
"""


def test_a_dead_scheduler_thread_fails_its_requests_and_serve_exits_naming_the_model(repo, tmp_path):
    """Found by reading: the thread died on any error outside the engine step, and every request then hung."""
    private = Path(shutil.copytree(repo, tmp_path / "triton_repo"))
    with open(private / "tensorrt_llm" / "1" / "model.py", "a") as model:
        model.write(FAILING_METRICS)
    serve = Serve(private, tmp_path / "tritonserver.log").wait_serving()
    try:
        started = time.monotonic()
        streams = Streams(serve, 3)
        streams.join(ERROR_WITHIN + 30)
        assert all("ended" in r and failed(r) for r in streams.results), streams.results
        assert max(r["ended"] for r in streams.results) - started < ERROR_WITHIN, streams.results
        serve.process.wait(EXIT_WITHIN)
        assert serve.process.returncode == 1 and "the process of model 'tensorrt_llm'" in serve.output()
        log = (tmp_path / "tritonserver.log").read_text()
        assert "the scheduler stopped: RuntimeError('injected: the metrics update failed')" in log
    finally:
        serve.finish()


def test_killing_serve_leaves_no_process_or_open_port_and_the_next_serve_reclaims_the_rest(repo, tmp_path):
    """kill -9 of `serve` alone, with streams in flight: tritonserver dies with it (parent-death signal), the reaper
    kills its model processes (a busy one outlived its server by 20 s on its own) and removes the /dev/shm regions
    and temp directory. Killed all at once, reaper included (as by the OOM killer), processes die but regions and
    directory stay: the next `serve` reclaims them."""
    alone, at_once = (Serve(repo, tmp_path / f"{name}.log") for name in ("alone", "at-once"))
    try:
        leftovers = {}
        for serve in (alone.wait_serving(), at_once.wait_serving()):
            tritonserver = next(p for p in serve.processes() if p.name() == "tritonserver")
            args = dict(arg.split("=", 1) for arg in tritonserver.cmdline() if arg.startswith("--"))
            work = Path(args["--backend-directory"]).parent
            token = work.name.removeprefix(WORK_PREFIX)
            assert args["--backend-config"] == f"python,shm-region-prefix-name={SHM_PREFIX}{token}_"
            leftovers[serve] = (serve.processes(), work, token)

        processes, work, token = leftovers[alone]
        tritonserver = next(p for p in processes if p.name() == "tritonserver")
        streams = Streams(alone, 4)
        streams.wait_first_tokens()
        alone.process.kill()
        tritonserver_gone = wait_until(lambda: exited(tritonserver), GONE_WITHIN)
        all_gone = wait_until(lambda: all(map(exited, processes)), GONE_WITHIN)
        print(f"\nkill -9 serve: tritonserver gone after {tritonserver_gone:.2f} s, its model processes after "
              f"{all_gone:.2f} s")  # fmt: skip
        ports = [*vars(alone.ports).values(), alone.openai_port]
        alone.process.wait(GONE_WITHIN)  # its exit closes the gateway's socket (busy with streams, it takes a moment)
        # Waited for, not read at once: a killed process's main thread reads as a zombie while its other threads
        # still exit, and the last one frees the address space before it closes the sockets (seen once in CI:
        # tritonserver's three ports still open right after serve's exit).
        closed = wait_until(lambda: not [port for port in ports if listening("127.0.0.1", port)], GONE_WITHIN)
        print(f"every port closed {closed:.2f} s after serve's exit")
        wait_until(lambda: not work.exists(), GONE_WITHIN)
        assert not list(Path("/dev/shm").glob(f"{SHM_PREFIX}{token}_*"))
        streams.join(ERROR_WITHIN)

        processes, work, token = leftovers[at_once]
        for process in [*processes, at_once.process]:  # the reaper before serve, whose death would wake it
            os.kill(process.pid, signal.SIGKILL)
        wait_until(lambda: all(map(exited, processes)), GONE_WITHIN)
        assert work.is_dir()

        following = Serve(repo, tmp_path / "following.log").wait_serving()
        following.finish()
        assert following.process.returncode == 0, following.output()
        for _, work, token in leftovers.values():  # (or by another test's serve starting meanwhile)
            assert not work.exists(), following.output()
            assert not list(Path("/dev/shm").glob(f"{SHM_PREFIX}{token}_*"))
    finally:
        for serve in (alone, at_once):
            serve.finish()


def test_reclaiming_orphans_never_touches_a_live_server(tmp_path):
    """Owner dead: its processes are killed, regions and directory removed. Owner alive, or no owner file on a
    young directory (a server being created): untouched. Tests run several servers at once."""
    tmp = Path(tempfile.gettempdir())
    dead_owner = subprocess.Popen(["true"])
    dead = {"pid": dead_owner.pid, "create_time": psutil.Process(dead_owner.pid).create_time()}
    dead_owner.wait()
    live = {"pid": os.getpid(), "create_time": psutil.Process().create_time()}
    servers = {"dead": dead, "live": live, "young": None}
    tokens = {name: f"test{os.getpid():x}{name}" for name in servers}
    leftover = None
    try:
        for name, owner in servers.items():
            work = tmp / f"{WORK_PREFIX}{tokens[name]}"
            work.mkdir()
            if owner:
                (work / OWNER).write_text(json.dumps(owner))
            (Path("/dev/shm") / f"{SHM_PREFIX}{tokens[name]}_region").write_bytes(b"x")
        # a model process the dead owner's server left: its command line names the server's region
        leftover = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)", f"{SHM_PREFIX}{tokens['dead']}_stub"]
        )
        reclaim_orphans(log=lambda message: None)
        assert leftover.poll() is not None  # killed (and reaped by reclaim's wait)
        for name in servers:
            kept = name != "dead"
            assert (tmp / f"{WORK_PREFIX}{tokens[name]}").exists() == kept, name
            assert (Path("/dev/shm") / f"{SHM_PREFIX}{tokens[name]}_region").exists() == kept, name
    finally:
        if leftover and leftover.poll() is None:
            leftover.kill()
        for token in tokens.values():
            shutil.rmtree(tmp / f"{WORK_PREFIX}{token}", ignore_errors=True)
            (Path("/dev/shm") / f"{SHM_PREFIX}{token}_region").unlink(missing_ok=True)


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.2",  # Linux routes all of 127/8 to lo
        pytest.param("::1", marks=pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 on lo")),
    ],
)
def test_serve_on_another_address_gets_ready_and_answers_there(repo, tmp_path, host):
    serve = Serve(repo, tmp_path / "tritonserver.log", host=host).wait_serving()
    try:
        model = httpx.get(serve.url("/v1/models"), timeout=30).json()["data"][0]["id"]
        reply = httpx.post(
            serve.url("/v1/completions"),
            json={"model": model, "prompt": "The capital of France is", "max_tokens": 4},
            timeout=60,
        )
        assert reply.status_code == 200 and "Paris" in reply.json()["choices"][0]["text"]
        ready = httpx.get(f"http://{dial_address(host, serve.ports.http)}/v2/health/ready", timeout=10)
        assert ready.status_code == 200
        assert not listening("127.0.0.1", serve.ports.http)  # bound where it was told, not on 127.0.0.1 too
        assert f"http://{dial_address(host, serve.ports.http)}" in serve.output()
    finally:
        serve.finish()
    assert serve.process.returncode == 0, serve.output()


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (" ", "the API key is only whitespace"),  # refused before anything starts, not taken for a key
        ("", "TRTLLM_PIPELINE_API_KEY is set but empty"),  # served without a key, but said so
    ],
)
def test_serve_names_an_api_key_that_protects_nothing(tmp_path, key, expected):
    result = spawn_cli(
        "serve", str(tmp_path / "no-repo"), "--openai", env={"TRTLLM_PIPELINE_API_KEY": key}, timeout=120
    )
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode != 0 and expected in output, output
