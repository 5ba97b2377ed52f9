"""Running and serving what the `pytorch` backend built: the LLM API over its model directory and options (`run`),
and `trtllm-serve` of the targeted release over a repository (`serve`), or the commands for NVIDIA's container where
this machine lacks it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeline.errors import PipelineError, TargetUnavailable
from pipeline.targets.trtllm.backend import lacking
from pipeline.targets.trtllm.image import nvidia_image
from pipeline.targets.trtllm.llm_api_options import serve_options_flag
from pipeline.targets.trtllm.repo_checks import recorded_release
from pipeline.targets.trtllm.triton_llmapi_model import llmapi_model

OPTIONS_FILE = "llm_api_options.yaml"
MODEL_DIR = "model"  # engine/model: the unified checkpoint and tokenizer, what `trtllm-serve MODEL` loads
ENGINE_RECORD = "config.json"  # engine/config.json: limits and release, where run/serve read an engine's


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

    def trtllm_serve(self, host: str, port: int) -> list[str]:
        return trtllm_serve_command(self.release, str(self.model_dir), str(self.options), host, port)

    def container_commands(self, host: str, port: int) -> list[str]:
        """`docker run` lines for the release's container, publishing `port` on `host`: trtllm-serve
        (OpenAI-compatible), or tritonserver once the container's llmapi model.py is copied beside our model.yaml."""
        import shlex

        image = nvidia_image(self.release)
        mounts = sorted({str(self.model_dir.parent.parent), str(self.repo.parent)})
        docker = ["docker", "run", "--rm", "--gpus=all", "--ipc=host", *(f"--volume={m}:{m}" for m in mounts)]
        docker.append(f"--publish={host}:{port}:{port}")
        model_py = f"{llmapi_model(self.release)['container']['llmapi_model_dir']}/1/*.py"
        triton = f"cp {model_py} {self.repo / self.llm_model_name / '1'}/ && tritonserver "
        triton += f"--model-repository={self.repo} --http-port={port}"
        return [
            shlex.join([*docker, image, *self.trtllm_serve("0.0.0.0", port)]),  # 0.0.0.0 inside: --publish binds
            shlex.join([*docker, image, "bash", "-c"]) + " " + shlex.quote(triton),
        ]


def trtllm_serve_command(release: str, model_dir: str, options: str, host: str, port: int) -> list[str]:
    """`trtllm-serve` of `release` serving a model directory with its options file."""
    return ["trtllm-serve", model_dir, f"{serve_options_flag(release)}={options}", f"--host={host}", f"--port={port}"]


def llmapi_model_name(repo: Path) -> str | None:
    """The repository's llmapi model: the python model whose version directory holds a model.yaml."""
    found = sorted(p.parent.parent.name for p in repo.glob("*/1/model.yaml"))
    return found[0] if found else None


def serve_llm_api(repo: Path, host: str, port: int) -> None:
    """Serve a pytorch-backend repository with trtllm-serve where TensorRT-LLM and a GPU are (the process becomes
    trtllm-serve); elsewhere stop with exit 4 and the exact commands for NVIDIA's container."""
    deployment = Deployment.of(repo)
    missing = missing_for_llm_api()
    if missing:
        trtllm_serve, triton = deployment.container_commands(host, port)
        raise TargetUnavailable(
            f"{deployment.repo} is served by TensorRT-LLM {deployment.release}'s PyTorch backend, which needs "
            f"{' and '.join(missing)}. On a GPU machine run NVIDIA's container:\n  {trtllm_serve}\nor, for "
            f"Triton's llmapi model:\n  {triton}"
        )
    command = deployment.trtllm_serve(host, port)
    os.execvp(command[0], command)


# ---------------------------------------------------------------- the backend
