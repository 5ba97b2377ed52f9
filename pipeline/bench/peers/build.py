"""`trtllm-pipeline bench peers`: build every benchmark peer of a build from its own package, in its own
environment, and list them in OUTPUT/peers/manifest.json. A peer that cannot be built is listed with the reason and
the others still are.

Environments and compiled code are kept under the cache (`pipeline.build.cache_dir()`/peers), keyed by the peer's
version: llama.cpp's compile (about 10 minutes on 2 cores) and each environment's install happen once per machine.
Models are made per build, from its imported checkpoint, by each peer's own converter and quantizer, and remade
only when that checkpoint changes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.bench.peers import EngineSpec, PeerManifest, peer_environment
from pipeline.errors import PipelineError

Log = Callable[[str], None]

TORCH_SPEC = "torch==2.13.0"  # the CPU wheel goes in first, as in the Makefile: later, a dependency pulls CUDA's
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
# llama.cpp's tools the benchmarks use: the quantizer makes the GGUFs, llama-server is the serving peer, llama-bench
# and llama-batched-bench time it as its maintainers do (pipeline.bench.peers.native)
LLAMA_CPP_TOOLS = ("llama-server", "llama-bench", "llama-batched-bench")
LLAMA_CPP_TARGETS = ("llama", "llama-quantize", *LLAMA_CPP_TOOLS)
# compiler flags that leave out AMX's instructions (`runs_natively` says when they are needed)
WITHOUT_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
PROBE_TIMEOUT_S = 120  # a two-token llama-bench takes about a second; one that hangs counts as failed
LLAMA_CPP_PRECISIONS = ("F16", "Q8_0", "Q4_K_M")  # F16 is the converter's output; the others llama-quantize's
OPENVINO_PACKAGES = ("openvino-genai==2026.4.1.0", "optimum-intel[openvino]==2.2.0")
OPENVINO_EXPORTS = {"int8": [], "int4": ["--group-size", "64"]}  # --weight-format -> its options (build_openvino)
GENAI_PACKAGES = ("onnxruntime-genai==0.18.0", "transformers>=5,<6", "onnx", "onnx-ir")


class PeerUnavailable(PipelineError):
    pass


def run(command: list, log: Log, what: str, env: dict | None = None, cwd: Path | None = None, progress=None) -> None:
    """Run a build step, its output kept in memory; on failure raise with the step and the output's end.
    `progress(line)` sees each output line (e.g. to log a compile's progress now and then)."""
    log(f"{what}: {' '.join(str(c) for c in command)}")
    process = subprocess.Popen(
        [str(c) for c in command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )
    lines = []
    for line in process.stdout:
        lines.append(line.rstrip())
        if progress:
            progress(line.rstrip())
    if process.wait() != 0:
        raise PeerUnavailable(f"{what} failed (exit {process.returncode}): {failure(lines)}")


def failure(lines: list[str]) -> str:
    """What a failed step said: from its last error line (a Python exception, a compiler error) on, a few lines;
    else its last lines."""
    errors = [i for i, line in enumerate(lines) if "Error" in line or "error:" in line]
    start = errors[-1] if errors else max(0, len(lines) - 6)
    return " | ".join(line.strip() for line in lines[start : start + 4] if line.strip())


def environment(root: Path, packages: list[str], log: Log, env: dict | None = None, torch: bool = True) -> Path:
    """A virtual environment at `root` with `packages` (after the CPU torch wheel, when they need torch), made once
    (a stamp names them)."""
    python = root / "bin" / "python"
    stamp = root / ".installed"
    wanted = json.dumps(packages)
    if stamp.is_file() and stamp.read_text() == wanted:
        return python
    shutil.rmtree(root, ignore_errors=True)
    run([sys.executable, "-m", "venv", root], log, f"making the environment {root}")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if torch:
        run([*pip, TORCH_SPEC, "--extra-index-url", TORCH_INDEX], log, "installing the CPU torch wheel")
    run([*pip, *packages], log, f"installing {' '.join(packages)}", env=env)
    stamp.write_text(wanted)
    return python


@dataclass
class Built:
    """What a peer builder made: its engines, the tools it brings, and its models that could not be made, with why."""

    engines: list[EngineSpec] = field(default_factory=list)
    tools: dict[str, str] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)


@dataclass
class PeerContext:
    """What a peer builder needs: the build's imported checkpoint (and its hash), where its models go, the cache."""

    import_dir: Path
    import_hash: str
    models: Path  # OUTPUT/peers
    cache: Path  # cache_dir()/peers
    log: Log

    def fresh(self, folder: Path, key: dict) -> bool:
        """Whether `folder` holds models made from this checkpoint with this `key` (versions, options)."""
        stamp = folder / ".made-from.json"
        return stamp.is_file() and json.loads(stamp.read_text()) == {"import": self.import_hash, **key}

    def made(self, folder: Path, key: dict) -> None:
        (folder / ".made-from.json").write_text(json.dumps({"import": self.import_hash, **key}))


def compile_llamacpp(ctx: PeerContext, llama_cpp: Path, build: Path, flags: str) -> None:
    """llama.cpp's library and tools for this CPU (`-march=native`, its own default), with extra compiler `flags`;
    the stamp saying what was compiled goes only when the compile is whole."""
    (build / ".complete").unlink(missing_ok=True)
    run(
        [
            "cmake",
            "-S",
            llama_cpp,
            "-B",
            build,
            "-G",
            "Ninja",
            "-DCMAKE_BUILD_TYPE=Release",
            "-DBUILD_SHARED_LIBS=ON",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_OPENSSL=OFF",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_UI=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF",
            f"-DCMAKE_C_FLAGS={flags}",
            f"-DCMAKE_CXX_FLAGS={flags}",
        ],
        ctx.log,
        "configuring llama.cpp",
    )
    shown = {"step": 0}

    def progress(line: str) -> None:  # ninja prints [done/total] per compiled file
        if line.startswith("[") and "/" in line.split("]")[0]:
            done, total = (int(x) for x in line[1:].split("]")[0].split("/"))
            if done * 10 // total > shown["step"]:
                shown["step"] = done * 10 // total
                ctx.log(f"compiling llama.cpp: {done}/{total}")

    run(
        ["ninja", "-C", build, *LLAMA_CPP_TARGETS],
        ctx.log,
        "compiling llama.cpp (~10 min on 2 cores, once)",
        progress=progress,
    )
    (build / ".complete").write_text(json.dumps({"targets": list(LLAMA_CPP_TARGETS), "flags": flags}))


def runs_natively(bin_dir: Path, model: Path) -> bool:
    """Whether llama-bench decodes two tokens of `model` without dying by a signal: ggml's AMX kernels, which
    `-march=native` compiles in on a CPU with AMX, stopped at their first `ldtilecfg` with a general-protection fault
    on this project's 2-core virtual machine (2026-11-29: llama-bench SIGSEGV, llama-server SIGILL), though the
    kernel granted AMX's state (ARCH_REQ_XCOMP_PERM) and a tile configuration of our own loaded."""
    try:
        probe = subprocess.run(
            [bin_dir / "llama-bench", "-m", model, "-p", "8", "-n", "2", "-r", "1", "-t", "1"],
            capture_output=True,
            env=peer_environment(),
            timeout=PROBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return False
    return probe.returncode >= 0


def build_llamacpp(ctx: PeerContext) -> Built:
    """llama.cpp from the llama-cpp-python sdist's vendored tree (its library and tools, compiled here with cmake
    for this CPU, as its own build does), the bindings installed over that library, and GGUFs of the checkpoint by
    llama.cpp's converter (F16) and quantizer."""
    version = LLAMA_CPP_PYTHON.split("==")[1]
    root = ctx.cache / f"llama-cpp-python-{version}"
    source = root / "src" / f"llama_cpp_python-{version}"
    sdist = root / "download" / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        for tool in ("cmake", "ninja", "c++"):
            if not shutil.which(tool):
                raise PeerUnavailable(
                    f"{tool} is not installed; llama.cpp is compiled with cmake, ninja and a C++ compiler"
                )
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                LLAMA_CPP_PYTHON,
                "-d",
                sdist.parent,
            ],
            ctx.log,
            "downloading the llama-cpp-python sdist",
        )
    if not source.is_dir():
        with tarfile.open(sdist) as archive:
            archive.extractall(source.parent, filter="data")
    llama_cpp = source / "vendor" / "llama.cpp"
    build = root / "build"
    bin_dir = build / "bin"
    complete = build / ".complete"  # the targets and flags compiled: new ones are compiled into the same tree
    compiled = json.loads(complete.read_text()) if complete.is_file() else {}
    if isinstance(compiled, list):  # stamps before 2026-11-29 named the targets alone, compiled without flags
        compiled = {"targets": compiled, "flags": ""}
    if compiled.get("targets") != list(LLAMA_CPP_TARGETS):
        compile_llamacpp(ctx, llama_cpp, build, compiled.get("flags", ""))
    # the bindings alone (LLAMA_BUILD=OFF), loading the library compiled above through LLAMA_CPP_LIB_PATH
    python = environment(
        root / "venv", [str(sdist)], ctx.log, env={"CMAKE_ARGS": "-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"}, torch=False
    )
    folder = ctx.models / "llama.cpp"
    key = {"llama-cpp-python": version, "precisions": list(LLAMA_CPP_PRECISIONS), "tokenizer": "byte-level BPE"}
    models = {p: folder / f"model-{p}.gguf" for p in LLAMA_CPP_PRECISIONS}
    if not ctx.fresh(folder, key):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        # the converter runs in our environment (it needs torch and transformers) with its own gguf-py
        run(
            [sys.executable, llama_cpp / "convert_hf_to_gguf.py", ctx.import_dir, "--outtype", "f16"]
            + ["--outfile", models["F16"]],
            ctx.log,
            "converting the checkpoint to GGUF F16",
        )
        for precision in LLAMA_CPP_PRECISIONS[1:]:
            run(
                [bin_dir / "llama-quantize", models["F16"], models[precision], precision],
                ctx.log,
                f"quantizing to {precision}",
            )
        ctx.made(folder, key)
    if json.loads(complete.read_text())["flags"] != WITHOUT_AMX and not runs_natively(bin_dir, models["Q8_0"]):
        ctx.log("llama.cpp's AMX kernels fault on this host (a tool died by a signal): compiling it without them")
        compile_llamacpp(ctx, llama_cpp, build, WITHOUT_AMX)
        if not runs_natively(bin_dir, models["Q8_0"]):
            complete.unlink()  # not trusted as built: the next run compiles and probes again
            raise PeerUnavailable(f"llama.cpp's tools die by a signal on this host, with and without AMX: {bin_dir}")
    env = {"LLAMA_CPP_LIB_PATH": str(bin_dir)}
    engines = [
        EngineSpec(f"llama.cpp {p}", "llama.cpp", p, str(python), "pipeline.bench.peers.llamacpp", str(m), env)
        for p, m in models.items()
    ]
    return Built(engines, {tool: str(bin_dir / tool) for tool in LLAMA_CPP_TOOLS})


def build_openvino(ctx: PeerContext) -> Built:
    """OpenVINO GenAI with `optimum-cli export openvino` models of the checkpoint (NNCF weight compression), its
    tokenizers converted by the same export, as its docs have users do. int8 is per channel (its default); int4's
    default groups of 128 do not divide SmolLM2's 576 channels, which NNCF refuses, so groups of 64, the largest of
    its usual sizes that divides every layer's inputs here."""
    python = environment(ctx.cache / "openvino", list(OPENVINO_PACKAGES), ctx.log)
    built = Built()
    for precision, options in OPENVINO_EXPORTS.items():
        folder = ctx.models / f"openvino-{precision}"
        name = f"OpenVINO GenAI {precision}"
        key = {"packages": list(OPENVINO_PACKAGES), "options": options}
        if not ctx.fresh(folder, key):
            shutil.rmtree(folder, ignore_errors=True)
            try:
                run(
                    [
                        python.parent / "optimum-cli",
                        "export",
                        "openvino",
                        "--model",
                        ctx.import_dir,
                        "--task",
                        "text-generation-with-past",
                        "--weight-format",
                        precision,
                        *options,
                        folder,
                    ],
                    ctx.log,
                    f"exporting an OpenVINO {precision} model",
                )
            except PeerUnavailable as exc:
                built.unavailable[name] = str(exc)
                continue
            ctx.made(folder, key)
        built.engines.append(
            EngineSpec(name, "openvino", precision, str(python), "pipeline.bench.peers.openvino", str(folder))
        )
    return built


def build_genai(ctx: PeerContext) -> Built:
    """onnxruntime-genai's INT4 CPU model of the checkpoint, made by its model builder at its defaults. Its own
    environment: the builder needs transformers 5, which ours cannot take (optimum-onnx and ModelOpt pin 4.57)."""
    python = environment(ctx.cache / "onnxruntime-genai", list(GENAI_PACKAGES), ctx.log)
    folder = ctx.models / "onnxruntime-genai-int4"
    key = {"packages": list(GENAI_PACKAGES)}
    if not ctx.fresh(folder, key):
        shutil.rmtree(folder, ignore_errors=True)
        with tempfile.TemporaryDirectory() as scratch:
            run(
                [
                    python,
                    "-m",
                    "onnxruntime_genai.models.builder",
                    "-i",
                    ctx.import_dir,
                    "-o",
                    folder,
                    "-p",
                    "int4",
                    "-e",
                    "cpu",
                    "-c",
                    scratch,
                ],
                ctx.log,
                "building the onnxruntime-genai INT4 model",
            )
        ctx.made(folder, key)
    return Built(
        [
            EngineSpec(
                "onnxruntime-genai int4",
                "onnxruntime-genai",
                "int4",
                str(python),
                "pipeline.bench.peers.genai",
                str(folder),
            )
        ]
    )


PEER_BUILDERS = {"llama.cpp": build_llamacpp, "openvino": build_openvino, "onnxruntime-genai": build_genai}


def build_peers(output: Path, cache: Path, only: list[str] | None = None, log: Log = print) -> PeerManifest:
    """Build the peers (all, or those named in `only`) for the build in `output` and write its peer manifest, which
    lists what this call built. Each builder reuses what it made before, so building all again is quick."""
    from pipeline.lock import read_lock

    import_dir = output / "import"
    import_hash = read_lock(output)["stages"].get("import", {}).get("output_hash") if import_dir.is_dir() else None
    if not import_hash:
        raise PipelineError(f"{import_dir}: no imported checkpoint; build first (trtllm-pipeline build CONFIG)")
    for name in only or []:
        if name not in PEER_BUILDERS:
            raise PipelineError(f"--peer {name}: unknown; choose from {', '.join(PEER_BUILDERS)}")
    ctx = PeerContext(import_dir, import_hash, (output / "peers").resolve(), cache / "peers", log)
    manifest = PeerManifest()
    for name, builder in PEER_BUILDERS.items():
        if only and name not in only:
            continue
        try:
            built = builder(ctx)
        except PeerUnavailable as exc:
            log(f"{name}: not built: {exc}")
            manifest.unavailable[name] = str(exc)
            continue
        for model, why in built.unavailable.items():
            log(f"{model}: not built: {why}")
        manifest.engines += built.engines
        manifest.tools |= built.tools
        manifest.unavailable |= built.unavailable
    manifest.write(output)
    return manifest
