"""Running and serving what the `pytorch` backend built: the LLM API over its model directory and options (`run`),
and `trtllm-serve` of the targeted release over a repository (`serve`), or the commands for a container where this
machine lacks it.

`serve --openai` puts the project's OpenAI gateway in front of trtllm-serve (`Deployment.own_server`): trtllm-serve
on a loopback port, the gateway on the public one, with the same routes, API key and readiness as in front of
tritonserver, speaking the release's dialect (`openai_dialect`: the guides it enforces). The container command for
that runs `trtllm-pipeline serve` in our GPU image of the release, which holds NVIDIA's container and the pipeline.

A build with LoRA adapters (the lora stage's PEFT directories in `<output>/lora/<name>/`, listed in its index, and
`lora_config` in the options) serves each as a model of the gateway's: a request naming it is sent to trtllm-serve
with the release's `lora_request` for that directory and task id (`openai_dialect.adapter_fields`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeline.adapter_registry import INDEX, read_index
from pipeline.docker import APP_DIR
from pipeline.errors import PipelineError, TargetUnavailable
from pipeline.targets import OwnServer
from pipeline.targets.trtllm.backend import lacking
from pipeline.targets.trtllm.image import image_tag, nvidia_image, transformers_conflict
from pipeline.targets.trtllm.llm_api_options import serve_options_flag
from pipeline.targets.trtllm.openai_dialect import adapter_fields, dialect
from pipeline.targets.trtllm.repo_checks import recorded_release
from pipeline.targets.trtllm.triton_llmapi_model import llmapi_model

OPTIONS_FILE = "llm_api_options.yaml"
MODEL_DIR = "model"  # engine/model: the unified checkpoint and tokenizer, what `trtllm-serve MODEL` loads
ENGINE_RECORD = "config.json"  # engine/config.json: limits and release, where run/serve read an engine's
LORA_DIR = "lora"  # <output>/lora: the lora stage's PEFT directories and their index
OPENAI_PORT = 9000  # `serve --openai-port`'s default: the gateway in front of trtllm-serve
CLI = f"{APP_DIR}/.venv/bin/trtllm-pipeline"  # in our images


class LlmApiRunner:
    """tensorrt_llm.LLM behind ModelRunnerCpp's calling conventions, so `run` and scripts/run_batch.py drive it
    as they drive engines. Requests of a batch run concurrently (the LLM batches them in flight); their results
    are collected in order, one step each, so `run`'s time to first token is the first request's whole latency."""

    def __init__(self, llm, max_batch_size: int):
        self.llm, self.max_batch_size = llm, max_batch_size

    @classmethod
    def from_dir(cls, engine_dir: Path, engine: dict) -> "LlmApiRunner":
        """The LLM the way the llmapi model.py builds it: options through update_llm_args_with_extra_dict (nested
        dicts become their config classes), then LLM(**kwargs) (upstream/llmapi_model.json llm_kwargs)."""
        from tensorrt_llm import LLM
        from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict

        options = yaml.safe_load((engine_dir / OPTIONS_FILE).read_text())
        kwargs = update_llm_args_with_extra_dict({"model": str(engine_dir / MODEL_DIR)}, options)
        return cls(LLM(**kwargs), engine["build_config"]["max_batch_size"])

    def generate(
        self,
        batch_input_ids,
        *,
        max_new_tokens: int,
        end_id: int,
        pad_id: int,
        stop_words_list=None,
        temperature: float = 1.0,
        top_k: int = 1,
        top_p: float = 0.0,
        repetition_penalty: float = 1.0,
        random_seed: int | None = None,
        **_conventions,  # streaming / return_dict: always yields ModelRunnerCpp's dicts
    ):
        import torch
        from tensorrt_llm import SamplingParams

        stops = (stop_words_list or [[]])[0]  # the same stop words for every row: lists of token ids
        if any(len(word) != 1 for word in stops):
            raise PipelineError(
                "stop words of several tokens are not passed to the LLM API here (SamplingParams.stop_token_ids "
                "takes single tokens); use single-token stop words"
            )
        params = SamplingParams(
            max_tokens=max_new_tokens,
            end_id=end_id,
            pad_id=pad_id,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p or None,
            repetition_penalty=repetition_penalty,
            seed=random_seed,
            stop_token_ids=[word[0] for word in stops] or None,
        )
        prompts = [ids.tolist() for ids in batch_input_ids]
        futures = [self.llm.generate_async(ids, params) for ids in prompts]
        width = max(map(len, prompts)) + max_new_tokens
        output_ids = torch.full((len(prompts), 1, width), pad_id, dtype=torch.int32)
        lengths = torch.tensor([[len(ids)] for ids in prompts], dtype=torch.int32)
        for row, future in enumerate(futures):
            generated = future.result().outputs[0].token_ids
            output_ids[row, 0, : len(prompts[row])] = torch.tensor(prompts[row])
            output_ids[row, 0, len(prompts[row]) : len(prompts[row]) + len(generated)] = torch.tensor(generated)
            lengths[row, 0] = len(prompts[row]) + len(generated)
            yield {"output_ids": output_ids.clone(), "sequence_lengths": lengths.clone()}


def missing_for_llm_api() -> list[str]:
    """What this machine lacks to run the LLM API (empty on a GPU machine with TensorRT-LLM)."""
    import importlib.util

    return lacking(
        ("the tensorrt_llm package (NVIDIA's container or index)", importlib.util.find_spec("tensorrt_llm")),
        ("an NVIDIA GPU (/dev/nvidia0)", Path("/dev/nvidia0").exists()),
    )


@dataclass(frozen=True)
class Deployment:
    """What serving a pytorch-backend build needs: read back from its repository's model.yaml and the record
    the engine stage wrote next to the model directory."""

    model_dir: Path
    options: Path
    release: str
    repo: Path
    llm_model_name: str

    @classmethod
    def of(cls, repo: Path) -> "Deployment":
        repo = repo.resolve()
        name = llmapi_model_name(repo)
        spec = yaml.safe_load((repo / name / "1" / "model.yaml").read_text())
        model_dir = Path(spec["model"])
        record = model_dir.parent / ENGINE_RECORD
        release = recorded_release(record)
        if release is None:
            raise PipelineError(
                f"{record} does not record the TensorRT-LLM release (the repository was not built by "
                f"trtllm-pipeline): serve it yourself, e.g. "
                f"trtllm-serve {model_dir} --extra_llm_api_options OPTIONS.yaml"
            ) from None
        return cls(model_dir, model_dir.parent / OPTIONS_FILE, release, repo, name)

    def trtllm_serve(self, host: str, port: int, launcher: tuple[str, ...] = ()) -> list[str]:
        """trtllm-serve's command, after `launcher` (mpirun starting its ranks, trtllm-llmapi-launch on each)."""
        return [*launcher, *trtllm_serve_command(self.release, str(self.model_dir), str(self.options), host, port)]

    @property
    def lora_dir(self) -> Path:
        """The build's lora stage output: <output>/lora beside <output>/engine."""
        return self.model_dir.parent.parent / LORA_DIR

    def takes_lora(self) -> bool:
        """Whether the options give trtllm-serve a lora_config, so that a request's lora_request loads an adapter."""
        options = yaml.safe_load(self.options.read_text()) if self.options.is_file() else None
        return bool((options or {}).get("lora_config"))

    def adapters(self) -> dict[str, dict]:
        """The build's LoRA adapters as the gateway picks them: model name -> the request fields that make this
        release's trtllm-serve generate with it (its PEFT directory and task id); {} for a build without any."""
        if not (self.lora_dir / INDEX).is_file():
            return {}
        if not self.takes_lora():
            raise PipelineError(
                f"{self.lora_dir} holds LoRA adapters but {self.options} has no lora_config, so trtllm-serve would "
                "refuse every request on one: rebuild (trtllm-pipeline build CONFIG)"
            )
        adapters = {}
        for name, entry in read_index(self.lora_dir).items():
            path = self.lora_dir / name
            if not path.is_dir():
                raise PipelineError(f"{path} is missing (the lora stage's copy of adapter {name}): rebuild")
            try:
                adapters[name] = adapter_fields(self.release, name, entry["task_id"], str(path.resolve()))
            except ValueError as exc:
                raise PipelineError(f"adapter {name}: {exc}") from None
        return adapters

    def own_server(self, port: int, launcher: tuple[str, ...] = ()) -> OwnServer:
        """trtllm-serve on loopback port `port` (rank 0's host: the launcher's first), as the OpenAI gateway in front
        of it sees it."""
        return OwnServer(
            command=self.trtllm_serve("127.0.0.1", port, launcher),
            url=f"http://127.0.0.1:{port}",
            model=self.model_dir.name,
            tokenizer_dir=str(self.model_dir),
            limits_dir=str(self.model_dir.parent),  # engine/config.json's build_config
            dialect=dialect(self.release),
            description=f"trtllm-serve (TensorRT-LLM {self.release})",
            adapters=self.adapters(),
        )

    def container_commands(self, host: str, port: int, openai_port: int | None = OPENAI_PORT) -> list[str]:
        """The commands for a GPU machine, publishing on `host`: the OpenAI gateway on `openai_port` in front of
        trtllm-serve on loopback port `port` (`trtllm-pipeline serve --openai` in our GPU image of the release; where
        no image of ours holds the release, `serve --openai` run on the machine itself with NVIDIA's container as its
        --launcher, on the host's network), or with `openai_port` None trtllm-serve itself on `port` (NVIDIA's
        container); then tritonserver on `port` in NVIDIA's container, once its llmapi model.py is copied beside our
        model.yaml."""
        import shlex

        image = nvidia_image(self.release)
        mounts = sorted({str(self.model_dir.parent.parent), str(self.repo.parent)})
        docker = ["docker", "run", "--rm", "--gpus=all", "--ipc=host", *(f"--volume={m}:{m}" for m in mounts)]
        published = [*docker, f"--publish={host}:{port}:{port}"]
        model_py = f"{llmapi_model(self.release)['container']['llmapi_model_dir']}/1/*.py"
        triton = f"cp {model_py} {self.repo / self.llm_model_name / '1'}/ && tritonserver "
        triton += f"--model-repository={self.repo} --http-port={port}"
        if openai_port is None:  # 0.0.0.0 inside: --publish binds
            first = [*published, image, *self.trtllm_serve("0.0.0.0", port)]
        elif transformers_conflict(self.release):  # the gateway here, trtllm-serve in NVIDIA's container behind it
            launcher = shlex.join([*docker, "--network=host", "--init", image])  # --init: stops with the gateway
            first = ["trtllm-pipeline", "serve", str(self.repo), "--host", host, "--http-port", str(port)]
            first += ["--openai", "--openai-port", str(openai_port), "--launcher", launcher]
        else:
            first = [*docker, f"--publish={host}:{openai_port}:{openai_port}", "--env=TRTLLM_PIPELINE_API_KEY"]
            first += [image_tag(self.release), *gateway_serve_command(self.repo, port, openai_port, _loopback(host))]
        return [shlex.join(first), shlex.join([*published, image, "bash", "-c"]) + " " + shlex.quote(triton)]


def _loopback(host: str) -> bool:
    return host in ("localhost", "127.0.0.1", "::1")


def gateway_serve_command(repo, port: int, openai_port: int, unauthenticated: bool) -> list[str]:
    """`trtllm-pipeline serve --openai` in our image: the gateway on every address of the container, trtllm-serve on
    its loopback; without a key only where the published port is itself on a loopback address (the key is
    TRTLLM_PIPELINE_API_KEY, passed through by `docker run --env`)."""
    command = [CLI, "serve", str(repo), "--host", "0.0.0.0", "--http-port", str(port)]
    command += ["--openai", "--openai-port", str(openai_port)]
    return command + (["--allow-unauthenticated"] if unauthenticated else [])


def trtllm_serve_command(release: str, model_dir: str, options: str, host: str, port: int) -> list[str]:
    """`trtllm-serve` of `release` serving a model directory with its options file."""
    return ["trtllm-serve", model_dir, f"{serve_options_flag(release)}={options}", f"--host={host}", f"--port={port}"]


def llmapi_model_name(repo: Path) -> str | None:
    """The repository's llmapi model: the python model whose version directory holds a model.yaml."""
    found = sorted(p.parent.parent.name for p in repo.glob("*/1/model.yaml"))
    return found[0] if found else None


def serve_llm_api(
    repo: Path, host: str, port: int, openai_port: int | None = None, launcher: tuple[str, ...] = ()
) -> OwnServer:
    """Serve a pytorch-backend repository with trtllm-serve where TensorRT-LLM and a GPU are: without the gateway
    (`openai_port` None) the process becomes trtllm-serve on host:port; with it, trtllm-serve as it runs on loopback
    port `port` behind the gateway. Elsewhere stop with exit 4 and the exact container commands."""
    deployment = Deployment.of(repo)
    if openai_port is None and not _loopback(host) and deployment.takes_lora():
        raise PipelineError(
            f"{deployment.options} has a lora_config, and trtllm-serve loads whatever lora_path a request to its port "
            f"names, while {host} carries no authentication: serve it behind the gateway (--openai, which sends only "
            "the build's adapters), or on 127.0.0.1"
        )
    missing = [] if launcher else missing_for_llm_api()  # a launcher brings trtllm-serve's machines (mpirun, docker)
    if missing:
        served, triton = deployment.container_commands(host, port, openai_port)
        no_image = transformers_conflict(deployment.release)
        if openai_port is None:
            how = "NVIDIA's container"
        elif no_image:
            how = (
                f"the OpenAI gateway of trtllm-pipeline installed there, with NVIDIA's container as its launcher "
                f"(trtllm-serve on the host's network; no image of ours holds TensorRT-LLM {deployment.release}: "
                f"{no_image})"
            )
        else:
            how = (
                f"our GPU image of TensorRT-LLM {deployment.release} (NVIDIA's container with trtllm-pipeline: "
                "`trtllm-pipeline plan CONFIG` prints its docker build), the OpenAI gateway in front of trtllm-serve"
            )
        raise TargetUnavailable(
            f"{deployment.repo} is served by TensorRT-LLM {deployment.release}'s PyTorch backend, which needs "
            f"{' and '.join(missing)}. On a GPU machine run {how}:\n  {served}\nor, for Triton's llmapi model:\n  "
            f"{triton}"
        )
    if openai_port is not None:
        return deployment.own_server(port, launcher)
    command = deployment.trtllm_serve(host, port, launcher)
    os.execvp(command[0], command)


# ---------------------------------------------------------------- the backend
