"""Load generator against a running Triton server: concurrency sweeps and Poisson request rates.

Written here on tritonclient's asyncio gRPC client (and aiohttp for HTTP `generate_stream`) because
genai-perf needs the perf_analyzer binary, absent on these machines, and guidellm / inference-perf
speak only OpenAI-style HTTP, not Triton's streaming gRPC. Every request streams; per request it
records time to first token, the gaps between streamed chunks (divided over the chunk's tokens),
end-to-end latency and output tokens (one engine log-probability per generated token). Bounded by
request count and a wall-clock limit; loopback only.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid

import numpy as np

from pipeline.triton.client import client_inputs


def synthetic_prompts(tokenizer, text: str, count: int, input_len: int, spread: float, seed: int = 0) -> list[str]:
    """`count` prompts cut from a real text, lengths uniform in input_len x [1 - spread, 1 + spread] tokens."""
    rng = random.Random(seed)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompts = []
    for _ in range(count):
        length = max(1, int(input_len * rng.uniform(1 - spread, 1 + spread)))
        start = rng.randrange(0, max(1, len(ids) - length))
        prompts.append(tokenizer.decode(ids[start : start + length]))
    return prompts


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
    import tritonclient.grpc.aio as grpcclient

    client = grpcclient.InferenceServerClient(url)
    params = {
        "text_input": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "min_length": max_tokens if ignore_eos else None,
    }

    async def requests():
        yield {
            "model_name": model,
            "inputs": client_inputs(params),
            "request_id": uuid.uuid4().hex,
            "enable_empty_final_response": True,
        }

    timeline = Timeline()
    try:
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                timeline.fail(str(error))
                break
            response = result.get_response()
            if any(o.name == "output_log_probs" for o in response.outputs):
                timeline.chunk(int(np.asarray(result.as_numpy("output_log_probs")).size))
            if response.parameters["triton_final_response"].bool_param:
                break
    except Exception as exc:  # network errors count as failed requests, not as a crashed benchmark
        timeline.fail(repr(exc))
    finally:
        await client.close()
    return timeline.done()


async def http_request(base: str, model: str, prompt: str, max_tokens: int, ignore_eos: bool) -> dict:
    import aiohttp

    body = {
        "text_input": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        **({"min_length": max_tokens} if ignore_eos else {}),
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
