"""`trtllm-pipeline bench structured`: JSON-schema answers on JSONSchemaBench, ours and llama-server side by side
(`pipeline.bench.structured`). `pipeline.cli` registers it on `bench_app`: pipeline/cli/bench.py is at the house's
length limit."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from pipeline.cli.bench import BenchOut
from pipeline.cli.common import ConfigArg, OutputOpt, console, reports_errors


@reports_errors
def bench_structured(
    config: Path = ConfigArg,
    output: Optional[Path] = OutputOpt,
    data: Optional[Path] = typer.Option(
        None,
        "--data",
        help="A local copy of JSONSchemaBench: a checkout (the folder holding data/SET/*.json) or its data/ folder. "
        "Default: downloaded from GitHub at the pinned commit once, into the cache.",
    ),
    per_set: int = typer.Option(50, "--per-set", help="Schemas drawn per set (all of a smaller set)."),
    sets: Optional[list[str]] = typer.Option(
        None,
        "--set",
        help="Sets to draw from (repeat); default Github_easy, Github_medium, Github_hard, Glaiveai2K, Kubernetes, "
        "JsonSchemaStore, Snowplow, WashingtonPost.",
    ),
    seed: int = typer.Option(0, help="Seed of each set's draw (random.Random(seed).sample of its sorted file names)."),
    max_tokens: int = typer.Option(384, "--max-tokens", help="max_tokens of every request."),
    concurrency: int = typer.Option(8, help="Requests in flight at once."),
    peer: Optional[str] = typer.Option(
        None,
        "--peer",
        help="llama-server (the default when `bench peers` built it; named, a peer that is not built is an error "
        "before anything starts) or none (ours alone).",
    ),
    whitespace: str = typer.Option(
        "engine",
        help="Our grammar's JSON layout: engine (as the engine lays it out: llama.cpp's whitespace) or compact (one "
        "line, ', ' and ': '), set per schema by llguidance's `x-guidance` extension; llama-server's is its own.",
    ),
    strict: bool = typer.Option(
        False,
        "--strict",
        help="Ask with OpenAI's strict: true: ours then refuses what its grammar cannot enforce, so every finished "
        "answer must be valid (llama-server ignores the key).",
    ),
    out: Path = BenchOut,
):
    """Structured outputs on real-world JSON schemas: each schema asked once, as a chat request with
    `response_format: json_schema` (greedy, not streamed), of our server through its OpenAI gateway, then of
    llama.cpp's llama-server on the Q8_0 GGUF of the same model (sized as `bench serve --peer llama-server` sizes it).
    Per set and in total, for each server: schemas drawn, answers accepted (HTTP 200), finished (finish_reason stop),
    valid, invalid, unjudgeable, seconds per request (p50, p99), and valid(ours)/valid(llama-server). Validity is
    judged here, alike for both: the answer parsed as JSON and validated by jsonschema against the whole schema (its
    own draft, every format jsonschema checks); a schema jsonschema cannot use makes its answers unjudgeable. For ours
    also: each guide's compile time for the engine's tokenizer (p50, p99; llama-server's is not observable), and
    where our gateway's own verdict (structured_output) disagrees.

    The schemas: JSONSchemaBench (github.com/guidance-ai/jsonschemabench) at commit
    ba103c73756198dd9b149ddc7db7867da7a077f6, data/SET/*.json, one schema per file. Without --data its tarball is
    downloaded once into the cache (TRTLLM_PIPELINE_CACHE, default ~/.cache/trtllm-pipeline); where GitHub cannot be
    reached, clone it elsewhere, check out that commit, and pass the checkout (or its data/ folder) as --data.

    Example: trtllm-pipeline bench structured build_configs/smollm2-135m-cpu.yaml --per-set 50
    """
    from pipeline.bench import report
    from pipeline.bench.structured import SETS, benchmark_structured, notes, table

    results = benchmark_structured(
        config,
        output,
        data=data,
        sets=sets or list(SETS),
        per_set=per_set,
        seed=seed,
        max_tokens=max_tokens,
        concurrency=concurrency,
        peer=peer,
        whitespace=whitespace,
        strict=strict,
        log=lambda m: console.print(f"  {m}", highlight=False, markup=False),
        server_log=lambda m: console.print(f"[dim]{m}[/]"),
    )
    summary = f"{table(results['summary'])}\n\n{notes(results)}"
    folder = report.write_report(
        out, "structured", f"structured outputs: {config}", results, summary, lambda path: None, ""
    )
    console.print(summary, highlight=False, markup=False, soft_wrap=True)
    console.print(f"report: {folder}")
