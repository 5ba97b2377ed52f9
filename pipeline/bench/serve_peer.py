"""The serving peer of `bench serve --peer llama-server`: llama.cpp's own OpenAI-compatible server, on the Q8_0 GGUF
of the same imported checkpoint that `bench peers` built, sized like our server: continuous batching with as many
slots as our build's max_batch_size, our LLM model's thread count, and a context of slots x max_seq_len (every slot
holds a whole sequence, as our engine does). Requests carry `cache_prompt: false` and the server keeps no prompt
cache in RAM (`--cache-ram 0`): it recomputes every prompt. Its threads poll for work as llama.cpp's default has
them. Both servers are asked over the same interface, `/v1/completions`, one after the other.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from pipeline.bench.peers import PeerManifest, peer_environment
from pipeline.errors import PipelineError
from pipeline.triton.server import _die_with_parent, free_port

PEERS = ("llama-server",)
GGUF = "llama.cpp Q8_0"  # the manifest's engine whose model llama-server serves
# per request: llama-server's token count in every chunk (timings.predicted_n), its prompt cache not reused
LLAMA_SERVER_FIELDS = {"stream_options": {"include_usage": True}, "timings_per_token": True, "cache_prompt": False}
BUILD_HINT = "build it with `trtllm-pipeline bench peers CONFIG --peer llama.cpp` (make peers)"


class PeerMissing(PipelineError):
    """The peer cannot run here; the message says why and how to build it."""


def llama_server_files(output: Path) -> tuple[Path, Path]:
    """(llama-server, the Q8_0 GGUF) as `bench peers` listed them for the build in `output`."""
    manifest = PeerManifest.read(output)
    binary, engine = manifest.tools.get("llama-server"), manifest.engine(GGUF)
    if binary is None or engine is None:
        why = manifest.unavailable.get("llama.cpp") or manifest.unavailable.get("all peers")
        why = why or f"{PeerManifest.path(output)} lists no llama-server and {GGUF} model"
        raise PeerMissing(why if "bench peers" in why else f"{why}; {BUILD_HINT}")
    for path in (Path(binary), Path(engine.model)):
        if not path.is_file():
            raise PeerMissing(f"{path} (named in {PeerManifest.path(output)}) does not exist; {BUILD_HINT}")
    return Path(binary), Path(engine.model)


class LlamaServer:
    """llama-server on a free loopback port; a context manager. It dies with the thread that started it (the main
    thread: with the process), and `stop` ends its process group however the run ends."""

    def __init__(self, binary: Path, model: Path, *, parallel: int, threads: int, context: int, log_file: Path):
        self.binary, self.model, self.log_file = binary, model, log_file
        self.port = free_port()
        self.command = [
            str(binary),
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--parallel",
            str(parallel),
            "--cont-batching",
            "--threads",
            str(threads),
            "--threads-batch",
            str(threads),
            "--ctx-size",
            str(context),
            "--cache-ram",
            "0",
        ]
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> "LlamaServer":
        """Start it and wait until /health says the model is loaded."""
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        main = threading.current_thread() is threading.main_thread()  # a death signal is bound to the forking thread
        with open(self.log_file, "wb") as log:
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=peer_environment(),
                preexec_fn=_die_with_parent(os.getpid()) if main else None,
            )
        try:
            self._wait_ready(timeout)
        except BaseException:  # Ctrl-C included: nothing started here outlives the call
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PipelineError(f"llama-server exited with code {self.process.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except OSError:  # not listening yet, or 503 while the model loads
                pass
            time.sleep(0.25)
        raise PipelineError(f"llama-server was not ready after {timeout:.0f} s: {self.log_tail()}")

    def log_tail(self, lines: int = 8) -> str:
        tail = self.log_file.read_text(errors="replace").strip().splitlines()[-lines:]
        return f"its log ({self.log_file}) ends: " + " | ".join(tail) if tail else f"its log {self.log_file} is empty"

    def call(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            raise PipelineError(f"llama-server {path}: HTTP {exc.code} {exc.read().decode(errors='replace')}") from None

    def check_prompts(self, prompts: list[str], tokenizer) -> None:
        """Refuse to measure unless llama-server reads every prompt as the ids our server reads (its GGUF's
        tokenizer may differ from the checkpoint's): otherwise the two would not do the same work."""
        for index, prompt in enumerate(prompts):
            ours, theirs = tokenizer.encode(prompt), self.tokenize(prompt)
            if theirs != ours:
                raise PipelineError(
                    f"llama-server reads prompt {index} as other token ids than ours ({len(theirs)} vs {len(ours)} "
                    f"tokens, first {theirs[:6]} vs {ours[:6]}): its GGUF {self.model} does not carry the checkpoint's "
                    "tokenizer, so it was not measured"
                )

    def tokenize(self, text: str) -> list[int]:
        """The prompt's ids as /v1/completions reads it: special tokens added and parsed."""
        try:
            return self.call("/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"]
        except PipelineError as exc:
            raise PipelineError(
                f"llama-server cannot tokenize the prompts ({exc}): is {self.model}'s tokenizer the checkpoint's?"
            ) from None

    def stop(self, grace: float = 10.0) -> None:
        if self.process is None:
            return
        for stop_signal in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, stop_signal)
            except ProcessLookupError:
                break
            try:
                self.process.wait(grace)
                break
            except subprocess.TimeoutExpired:
                continue
        self.process.wait()
        self.process = None

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
