"""Decide, without running anything, which stages are up to date and why the others must run.

Cheapest checks first (DVC's order): applicability, lock entry, inputs, outputs. A stage's inputs are
the config values it reads, its input files, the tool versions and the source files it executes or
copies (`pipeline.lock_sources`), so editing a target module re-runs exactly the stages that run it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pipeline
from pipeline.config import BuildConfig, dump_value
from pipeline.lock import hash_paths, sha256_json
from pipeline.lock_sources import source_hashes
from pipeline.stages import STAGES, inputs_from, selected
from pipeline.targets import target_of

UP_TO_DATE, WILL_RUN, SKIPPED = "up to date", "will run", "skipped"


@dataclass
class Decision:
    stage: str
    status: str
    reasons: list[str] = field(default_factory=list)
    writes: str = ""
    inputs: dict = field(default_factory=dict)


def tool_versions(stage: ModuleType, cfg: BuildConfig) -> dict[str, str]:
    versions = {"trtllm-pipeline": pipeline.__version__}
    for dist in (*stage.TOOLS, *target_of(cfg).tools.get(stage.NAME, ())):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    return versions


def stage_inputs(stage: ModuleType, cfg: BuildConfig, lock_entry: dict | None, upstream: dict[str, str]) -> dict:
    """Everything the stage's output is a function of; its hash is the stage's input hash."""
    cached = (lock_entry or {}).get("deps_files", {})
    dep_files, dep_hash = hash_paths(stage.deps(cfg), cached)
    target = target_of(cfg)
    # the adapter is a facade, hashed where the target takes part in the stage, with the modules its methods run there
    adapter = type(target).__module__
    own = (adapter, *target.sources[stage.NAME]) if stage.NAME in target.sources else ()
    roots = (stage.__name__, *stage.SOURCES, *own)
    inputs = {
        "params": {path: dump_value(cfg, path) for path in (*stage.READS, *target.stage_reads(stage.NAME, cfg))},
        "tools": tool_versions(stage, cfg),
        "code": source_hashes(roots, frozenset({adapter})),
        "deps": dep_hash,
        "upstream": upstream,
    }
    inputs["input_hash"] = sha256_json(inputs)
    inputs["deps_files"] = dep_files
    return inputs


def _changes(old: dict, new: dict) -> list[str]:
    """Human reasons for an input hash mismatch, most specific first."""
    reasons = []
    old_params, new_params = old.get("params", {}), new["params"]
    for path in new_params:
        if old_params.get(path) != new_params[path]:
            a, b = old_params.get(path), new_params[path]
            if isinstance(a, dict) and isinstance(b, dict):
                for k in sorted(set(a) | set(b)):
                    if a.get(k) != b.get(k):
                        reasons.append(f"{path}.{k} changed: {a.get(k)!r} -> {b.get(k)!r}")
            else:
                reasons.append(f"{path} changed: {a!r} -> {b!r}")
    for dist, version in new["tools"].items():
        if old.get("tools", {}).get(dist) != version:
            reasons.append(f"{dist} version {old.get('tools', {}).get(dist)} -> {version}")
    old_code = old.get("code")
    if not isinstance(old_code, dict):  # a lock written before sources were tracked file by file
        reasons.append("stage code changed (the lock predates per-file source hashes)")
    else:
        for path in sorted(set(old_code) | set(new["code"])):
            if old_code.get(path) != new["code"].get(path):
                change = "added" if path not in old_code else "removed" if path not in new["code"] else "changed"
                reasons.append(f"code {change}: {path}")
    if old.get("deps") != new["deps"]:
        reasons.append("input files changed")
    for name, digest in new["upstream"].items():
        if old.get("upstream", {}).get(name) != digest:
            reasons.append(f"output of '{name}' changed")
    return reasons or ["inputs changed"]


def decide(name: str, cfg: BuildConfig, output: Path, lock: dict, force: bool = False) -> Decision:
    """The decision for one stage, given the current lock (upstream stages already decided/run)."""
    stage = STAGES[name]
    writes = stage.writes(cfg)
    skip = stage.applies(cfg)
    if skip:
        return Decision(name, SKIPPED, [skip])

    upstream = {}
    for prior in inputs_from(name):
        if STAGES[prior].applies(cfg) is None:
            entry = lock["stages"].get(prior)
            upstream[prior] = entry["output_hash"] if entry else "missing"
    entry = lock["stages"].get(name)
    inputs = stage_inputs(STAGES[name], cfg, entry, upstream)
    if force:
        return Decision(name, WILL_RUN, ["--force"], writes, inputs)
    if entry is None:
        return Decision(name, WILL_RUN, ["never built"], writes, inputs)
    if entry.get("input_hash") != inputs["input_hash"]:
        return Decision(name, WILL_RUN, _changes(entry, inputs), writes, inputs)
    out_dir = output / name
    if not out_dir.is_dir():
        return Decision(name, WILL_RUN, [f"output {out_dir} is missing"], writes, inputs)
    _, out_hash = hash_paths([out_dir], entry.get("files"), root=out_dir)
    if out_hash != entry.get("output_hash"):
        return Decision(name, WILL_RUN, [f"output {out_dir} was modified or left incomplete"], writes, inputs)
    return Decision(name, UP_TO_DATE, [], writes, inputs)


def plan(cfg: BuildConfig, output: Path, lock: dict, until: str | None = None, force: bool = False) -> list[Decision]:
    """Decisions for every stage as if the build ran now; stages after a pending one they read will run too."""
    decisions, pending = [], set()
    for name in selected(until):
        d = decide(name, cfg, output, lock, force)
        if d.status == UP_TO_DATE and pending & set(inputs_from(name)):
            d = Decision(name, WILL_RUN, ["an earlier stage will re-run"], d.writes, d.inputs)
        if d.status == WILL_RUN:
            pending.add(name)
        decisions.append(d)
    return decisions
