"""Benchmark peers: the engines CPU users pick (llama.cpp, OpenVINO GenAI, onnxruntime-genai), built from their own
packages in their own environments by `trtllm-pipeline bench peers` and driven as worker processes
(`protocol`), so that every engine, ours included, is timed and scored the same way.

The peers of a build are listed in OUTPUT/peers/manifest.json: each engine's worker command and model, the tools
a peer brings (llama-server), and the peers that could not be built, with the reason.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[3]  # PYTHONPATH of every worker: they import pipeline.bench.peers


@dataclass(frozen=True)
class EngineSpec:
    """How to start one engine's worker, and what it runs."""

    name: str  # "llama.cpp Q8_0": the engine and its precision, as reports show it
    engine: str  # "llama.cpp"
    precision: str  # "Q8_0"
    python: str  # the interpreter of the engine's environment
    module: str  # the worker module, run with `python -m`
    model: str  # the model file or directory the worker loads
    env: dict = field(default_factory=dict)  # extra environment (e.g. where llama.cpp's libraries are)
    options: dict = field(default_factory=dict)  # worker --option KEY=VALUE pairs

    def command(self, threads: int) -> list[str]:
        options = [f"--option={k}={v}" for k, v in self.options.items()]
        return [self.python, "-m", self.module, "--model", self.model, "--threads", str(threads), *options]

    def environment(self) -> dict:
        """`peer_environment()` with the engine's own additions, and the checkout on the path."""
        return {**peer_environment(), **self.env, "PYTHONPATH": str(CHECKOUT)}

    @property
    def model_bytes(self) -> int:
        path = Path(self.model)
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        return sum(p.stat().st_size for p in files)


def peer_environment() -> dict:
    """Ours without OMP_WAIT_POLICY (the Makefile's PASSIVE, for the test suite), so that a peer threads as its
    library does by default (llama.cpp's OpenMP threads spin between steps)."""
    return {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}


@dataclass
class PeerManifest:
    engines: list[EngineSpec] = field(default_factory=list)
    tools: dict[str, str] = field(default_factory=dict)  # "llama-server" -> its path
    unavailable: dict[str, str] = field(default_factory=dict)  # peer -> why it was not built

    @staticmethod
    def path(output: Path) -> Path:
        return output / "peers" / "manifest.json"

    @classmethod
    def read(cls, output: Path) -> PeerManifest:
        path = cls.path(output)
        if not path.is_file():
            return cls(unavailable={"all peers": f"{path} not found: run `trtllm-pipeline bench peers CONFIG`"})
        data = json.loads(path.read_text())
        return cls([EngineSpec(**e) for e in data["engines"]], data["tools"], data["unavailable"])

    def write(self, output: Path) -> None:
        path = self.path(output)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**asdict(self), "engines": [asdict(e) for e in self.engines]}, indent=1))
        tmp.replace(path)

    def engine(self, name: str) -> EngineSpec | None:
        return next((e for e in self.engines if e.name == name), None)
