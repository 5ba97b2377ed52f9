"""`bench structured`: structured outputs (answers guided by a JSON schema) on real-world schemas, through our OpenAI
gateway and through llama.cpp's llama-server on the same model, one server after the other.

The schemas are JSONSchemaBench's (github.com/guidance-ai/jsonschemabench at JSONSCHEMABENCH_COMMIT; its data/SET/
files, one schema each): per set, its file names sorted, then a sample drawn by a `random.Random(seed)` of the set's
own, so that a set's sample does not depend on which other sets are chosen. A drawn file that holds no schema (not
JSON, not an object) is reported, not replaced. Each schema is asked of each server once, with the same non-streamed
chat request: one fixed instruction, the schema as `response_format` (no `strict` key: OpenAI's default, best
effort), greedy, `max_tokens`.

Validity is judged here, alike for both servers, not taken from either: the answer parsed as JSON and validated by
jsonschema against the whole schema, in the schema's own draft (2020-12 without `$schema`), with every format
jsonschema checks; only an answer that finished (finish_reason "stop") counts as valid. A schema jsonschema itself
cannot use (not a schema of its draft, a reference it cannot resolve) leaves its answers unjudgeable, counted apart
with the reason. Our gateway's own verdict (the choice's `structured_output`) is recorded beside it, and where the
two disagree is counted.

Compile times are ours only, measured in this process once both servers are stopped (nothing else loads the cores,
and the gateway's caches see nothing from here): the guide the gateway makes of each schema
(`pipeline.serving.schemas.prepare`) compiled by the CPU runtime's grammar compiler for the engine's tokenizer, as the
served model compiles it. llama-server compiles its grammar inside the request, which is not observable from outside.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import jsonschema

from pipeline.bench.peers import CHECKOUT
from pipeline.bench.report import build_info, markdown_table
from pipeline.bench.serve import READY_TIMEOUT_S, llama_server_sizing, loopback_serving, sized_llama_server
from pipeline.bench.serve_peer import PEERS, llama_server_files
from pipeline.bench.stats import percentiles
from pipeline.build import cache_dir, default_output
from pipeline.errors import PipelineError
from pipeline.serving.lifecycle import checked_repository, served_name
from pipeline.serving.schemas import check_schema, validator_class
from pipeline.triton.validate import RepoReport
from pipeline.validation import load_config

JSONSCHEMABENCH = "guidance-ai/jsonschemabench"
JSONSCHEMABENCH_COMMIT = "ba103c73756198dd9b149ddc7db7867da7a077f6"
JSONSCHEMABENCH_URL = f"https://codeload.github.com/{JSONSCHEMABENCH}/tar.gz/{JSONSCHEMABENCH_COMMIT}"
# JSONSchemaBench's sets of real-world schemas, in the order its paper reports them (Github_trivial and Github_ultra
# are there too, for --set)
SETS = (
    "Github_easy",
    "Github_medium",
    "Github_hard",
    "Glaiveai2K",
    "Kubernetes",
    "JsonSchemaStore",
    "Snowplow",
    "WashingtonPost",
)
PROMPT = "Answer with a JSON document that fits the requested format."
PEER = PEERS[0]  # llama-server
NOT_MEASURED = (
    "not measured: llama-server compiles its grammar inside the request, which is not observable from outside"
)
REQUEST_TIMEOUT_S = 600.0  # a request may wait behind the others in the server's queue
MESSAGE_CHARS = 200
DATA_HINT = (
    f"--data takes a copy of github.com/{JSONSCHEMABENCH} at {JSONSCHEMABENCH_COMMIT} (the folder holding data/, or "
    f"data/ itself), e.g. from `git clone https://github.com/{JSONSCHEMABENCH} && git -C jsonschemabench checkout "
    f"{JSONSCHEMABENCH_COMMIT}`; without --data it is downloaded once into the cache"
)


def download(url: str, path: Path, log, every: int = 10 * 2**20) -> None:
    """`url` into `path`, its progress logged every `every` bytes (GitHub's tarballs come without a length)."""
    log(f"downloading JSONSchemaBench {JSONSCHEMABENCH_COMMIT[:12]}: {url}")
    done = reported = 0
    try:
        with urllib.request.urlopen(url, timeout=60) as reply, open(path, "wb") as file:
            while chunk := reply.read(2**20):
                file.write(chunk)
                done += len(chunk)
                if done - reported >= every:
                    log(f"  {done / 2**20:.0f} MiB")
                    reported = done
    except OSError as exc:
        raise PipelineError(
            f"could not download {url} ({exc}): make a copy where GitHub can be reached and pass it; {DATA_HINT}"
        ) from None
    log(f"  {done / 2**20:.1f} MiB downloaded")


def data_members(archive: tarfile.TarFile):
    """The archive's data/ entries, named without the folder GitHub puts everything in (jsonschemabench-COMMIT/)."""
    for member in archive:
        parts = PurePosixPath(member.name).parts
        if len(parts) > 2 and parts[1] == "data":
            yield member.replace(name=str(PurePosixPath(*parts[1:])), deep=False)


def downloaded_data(cache: Path, log) -> Path:
    """JSONSchemaBench's data/ at the pinned commit, downloaded from GitHub once into the cache: only data/ is kept,
    extracted into a temporary folder that is then renamed into place, so an interrupted run leaves no partial copy."""
    folder = cache / f"jsonschemabench-{JSONSCHEMABENCH_COMMIT}"
    if not folder.is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache, prefix=".jsonschemabench-") as tmp:
            tarball, tree = Path(tmp) / "jsonschemabench.tar.gz", Path(tmp) / "tree"
            download(JSONSCHEMABENCH_URL, tarball, log)
            log(f"extracting data/ into {folder}")
            with tarfile.open(tarball) as archive:
                archive.extractall(tree, members=data_members(archive), filter="data")
            tree.rename(folder)
    return folder / "data"


def sets_folder(data: Path | None, cache: Path, log) -> Path:
    """The folder holding the set folders: --data's data/ (a checkout), --data itself (the data/ folder), or the
    copy downloaded into the cache without --data."""
    if data is None:
        return downloaded_data(cache, log)
    return data / "data" if (data / "data").is_dir() else data


def check_sets(root: Path, sets: list[str]) -> None:
    """An error naming `root` and the fix when it holds no sets, or the sets it holds when one asked for is not."""
    available = sorted(p.name for p in root.iterdir() if p.is_dir() and any(p.glob("*.json"))) if root.is_dir() else []
    if not available:
        found = "does not exist" if not root.exists() else f"holds no sets (folders of *.json schemas, e.g. {SETS[0]}/)"
        raise PipelineError(f"{root} {found}: {DATA_HINT}")
    missing = [name for name in sets if name not in available]
    if missing:
        raise PipelineError(f"--set {', '.join(missing)}: no such set in {root}; its sets: {', '.join(available)}")


@dataclass(frozen=True)
class Drawn:
    """One drawn schema file: its set and name, and its schema, or why the file holds none."""

    set: str
    file: str
    schema: dict | None
    not_a_schema: str | None = None


def read_schema(path: Path, set_name: str) -> Drawn:
    try:
        schema = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return Drawn(set_name, path.name, None, f"not JSON: {exc}"[:MESSAGE_CHARS])
    if not isinstance(schema, dict):
        return Drawn(set_name, path.name, None, f"not an object but a JSON {type(schema).__name__}")
    return Drawn(set_name, path.name, schema)


def draw(root: Path, sets: list[str], per_set: int, seed: int) -> list[Drawn]:
    """`per_set` files of each set (all of a smaller one), drawn from its sorted file names by a `random.Random(seed)`
    of the set's own."""
    check_sets(root, sets)
    drawn = []
    for name in sets:
        files = sorted(path.name for path in (root / name).glob("*.json"))
        sample = random.Random(seed).sample(files, min(per_set, len(files)))
        drawn += [read_schema(root / name / file, name) for file in sample]
    return drawn


# --whitespace: how our engine's grammar lays JSON out, set per schema by llguidance's own schema extension
# (`x-guidance`), which other servers ignore: "engine" leaves it to the engine (pipeline/targets/onnxruntime/runtime/
# guided.py JSON_OPTIONS: llama.cpp's whitespace), "compact" asks for one line with ", " and ": " (no whitespace
# pattern: the engine's own would still allow newlines)
WHITESPACE = {
    "engine": None,
    "compact": {
        "whitespace_flexible": False,
        "whitespace_pattern": None,
        "item_separator": ", ",
        "key_separator": ": ",
    },
}


def asked_schema(schema: dict, layout: dict | None) -> dict:
    """The schema as both servers are sent it: with `layout`, our grammar's JSON layout in llguidance's extension."""
    return schema if layout is None else {**schema, "x-guidance": layout}


def chat_request(model: str, schema: dict, max_tokens: int, layout: dict | None = None, strict: bool = False) -> dict:
    """What both servers are asked for `schema` (with `layout`, our grammar's JSON layout; with `strict`, OpenAI's
    `strict: true`, which llama-server ignores)."""
    json_schema = {"name": "schema", "schema": asked_schema(schema, layout), **({"strict": True} if strict else {})}
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "response_format": {"type": "json_schema", "json_schema": json_schema},
        "temperature": 0,
        "max_tokens": max_tokens,
    }


def refusal(reply) -> str:
    """A refused request's message: the OpenAI error's, else the body."""
    try:
        message = reply.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = reply.text
    return str(message)[:MESSAGE_CHARS]


async def ask(client, url: str, body: dict) -> dict:
    """One request's outcome: the HTTP status (None when no reply came) and its wall time; accepted (200), the first
    choice's finish_reason, content and, where the server gives it, structured_output; refused, the message."""
    import httpx

    started = time.perf_counter()
    try:
        reply = await client.post(url, json=body)
    except httpx.HTTPError as exc:  # no answer counts as a refusal, not as a crashed benchmark
        return {"status": None, "seconds": round(time.perf_counter() - started, 4), "error": repr(exc)[:MESSAGE_CHARS]}
    outcome = {"status": reply.status_code, "seconds": round(time.perf_counter() - started, 4)}
    if reply.status_code != 200:
        return outcome | {"error": refusal(reply)}
    choice = reply.json()["choices"][0]
    outcome |= {"finish_reason": choice.get("finish_reason"), "content": choice["message"].get("content")}
    if "structured_output" in choice:
        outcome["structured_output"] = choice["structured_output"]
    return outcome


async def ask_all(
    base_url: str,
    model: str,
    schemas: list[Drawn],
    max_tokens: int,
    concurrency: int,
    strict: bool,
    log,
    layout: dict | None = None,
) -> list:
    """Every schema asked of the OpenAI server at `base_url` (`.../v1`), `concurrency` requests in flight; one row
    per schema, in their order."""
    import httpx

    rows: list[dict | None] = [None] * len(schemas)
    pending, answered, every = iter(enumerate(schemas)), 0, max(1, len(schemas) // 10)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0)
    limits = httpx.Limits(max_connections=concurrency)
    # trust_env off: both servers are on loopback, which a proxy in the environment must not reach for
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:

        async def worker() -> None:
            nonlocal answered
            for index, drawn in pending:
                outcome = await ask(
                    client,
                    f"{base_url}/chat/completions",
                    chat_request(model, drawn.schema, max_tokens, layout, strict),
                )
                rows[index] = {"set": drawn.set, "file": drawn.file, **outcome}
                answered += 1
                if answered % every == 0 or answered == len(schemas):
                    log(f"  {answered}/{len(schemas)} answered")

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return rows


def judge(schema: dict, content: str | None) -> tuple[bool | None, str | None]:
    """(whether the answer is valid for the schema, why not): jsonschema in the schema's own draft (as the gateway
    reads it: `validator_class`), with every format it checks; None when jsonschema cannot use the schema (the answer
    is unjudgeable), with the reason."""
    try:
        instance = json.loads(content or "")
    except json.JSONDecodeError as exc:
        return False, f"not JSON: {exc}"[:MESSAGE_CHARS]
    cls = validator_class(schema)
    try:
        check_schema(cls, schema)
        error = jsonschema.exceptions.best_match(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(instance))
    except Exception as exc:  # noqa: BLE001 -- SchemaError, an unresolvable $ref, a pattern Python's re cannot read
        return None, f"{type(exc).__name__}: {exc}"[:MESSAGE_CHARS]
    return (True, None) if error is None else (False, f"{error.json_path}: {error.message}"[:MESSAGE_CHARS])


def judged(rows: list[dict], schemas: list[Drawn]) -> list[dict]:
    """The rows with the benchmark's judgement of each accepted answer (`schema_valid`, `why`)."""
    for row, drawn in zip(rows, schemas):
        if row["status"] == 200:
            row["schema_valid"], row["why"] = judge(drawn.schema, row["content"])
    return rows


def measure_ours(
    repo: Path, report: RepoReport, schemas: list[Drawn], settings: dict, layout: dict | None, log, server_log
) -> dict:
    """Our server and its OpenAI gateway started as `bench serve --protocol openai` starts them, asked every schema;
    with why the server died, when it did during the run (the requests after that were refused)."""
    serving = loopback_serving(repo, report, True, server_log)
    with serving:
        serving.start(READY_TIMEOUT_S)
        log(f"ours: {len(schemas)} requests, {settings['concurrency']} in flight")
        rows = asyncio.run(ask_all(serving.openai_url, served_name(repo), schemas, **settings, log=log, layout=layout))
        server = serving.server
        died = {"died": server.exit_reason()} if server.process.poll() is not None else {}
    return {"rows": judged(rows, schemas), **died}


def measure_llama_server(output: Path, report: RepoReport, schemas: list[Drawn], settings: dict, log) -> dict:
    """llama-server on the Q8_0 GGUF, sized as `bench serve --peer llama-server` sizes it (our max_batch_size as
    slots, our thread count, a whole max_seq_len per slot), asked every schema; or why it could not run."""
    from transformers import AutoTokenizer

    sizing = llama_server_sizing(report)
    try:
        server = sized_llama_server(output, sizing)
        model = server.model
        log(f"{PEER}: {model.name}, {sizing['parallel']} slots, {sizing['threads']} threads: {len(schemas)} requests")
        with server:
            server.check_prompts([PROMPT], AutoTokenizer.from_pretrained(output / "engine"))
            rows = asyncio.run(ask_all(f"{server.url}/v1", model.name, schemas, **settings, log=log))
            build = server.call("/props").get("build_info")
    except PipelineError as exc:  # not built, would not start or read the prompt as ours does: ours still stands
        return {"unavailable": str(exc)}
    return {"model": str(model), "build_info": build, "command": server.command, "rows": judged(rows, schemas)}


def compile_times(
    engine_dir: Path, schemas: list[Drawn], log, layout: dict | None = None, strict: bool = False
) -> list[dict]:
    """Per schema, the guide our gateway makes of it (`prepare`, as for the benchmark's requests) compiled for the
    engine's tokenizer by the CPU runtime's grammar compiler: its milliseconds, or why prepare refused the schema or
    the guide did not compile."""
    from pipeline.serving.schemas import prepare
    from pipeline.targets.onnxruntime.runtime.guided import Guide
    from pipeline.targets.onnxruntime.runtime.model_runner import ModelRunner

    log(f"ours: compiling {len(schemas)} guides for the engine's tokenizer")
    grammars = ModelRunner.from_dir(engine_dir, num_threads=1).grammars
    grammars.tokenizer  # made once, outside the first compile's timing, as the served model makes it once
    entries = []
    for drawn in schemas:
        entry = {"set": drawn.set, "file": drawn.file}
        try:
            prepared = prepare(asked_schema(drawn.schema, layout), strict=strict)
        except ValueError as exc:
            entries.append(entry | {"refused": str(exc)[:MESSAGE_CHARS]})
            continue
        started = time.perf_counter()
        try:
            grammars.compile(Guide("json_schema", json.dumps(prepared.grammar_schema))).result()
        except ValueError as exc:
            entries.append(entry | {"failed": str(exc)[:MESSAGE_CHARS]})
            continue
        milliseconds = round((time.perf_counter() - started) * 1000, 3)
        entries.append(entry | {"compile_ms": milliseconds, "relaxed": list(prepared.relaxed)})
    return entries


def tally(rows: list[dict]) -> dict:
    """One server's counts and request times over `rows` (a set's or all): every finished answer is valid, invalid
    or unjudgeable."""
    accepted = [row for row in rows if row["status"] == 200]
    verdicts = [row["schema_valid"] for row in accepted if row["finish_reason"] == "stop"]
    seconds = percentiles([row["seconds"] for row in accepted])
    counts = {
        "requests": len(rows),
        "accepted": len(accepted),
        "finished": len(verdicts),
        "valid": verdicts.count(True),
        "invalid": verdicts.count(False),
        "unjudgeable": verdicts.count(None),
        "seconds_p50": seconds["p50"],
        "seconds_p99": seconds["p99"],
    }
    reported = [row for row in accepted if "structured_output" in row]
    if reported:  # our gateway's verdict against ours, where both gave one
        both = [row for row in reported if None not in (row["structured_output"].get("valid"), row["schema_valid"])]
        disagree = sum(row["structured_output"]["valid"] != row["schema_valid"] for row in both)
        counts["structured_output"] = {"reported": len(reported), "compared": len(both), "disagree": disagree}
    return counts


def compile_tally(entries: list[dict]) -> dict:
    milliseconds = [entry["compile_ms"] for entry in entries if "compile_ms" in entry]
    spread = percentiles(milliseconds)
    return {
        "compiled": len(milliseconds),
        "refused": sum("refused" in entry for entry in entries),
        "failed": sum("failed" in entry for entry in entries),
        "compile_ms_p50": spread["p50"],
        "compile_ms_p99": spread["p99"],
    }


def in_sets(items: list[dict], sets: set[str]) -> list[dict]:
    return [item for item in items if item["set"] in sets]


def summaries(drawn: list[Drawn], rows: dict[str, list[dict]], compiles: list[dict]) -> dict:
    """Per set and in total ("total"): schemas drawn and not a schema, our compile times, each server's tally (by
    name, of `rows`), and valid(ours)/valid(llama-server) where both ran and the peer had any valid."""
    groups = {name: {name} for name in dict.fromkeys(d.set for d in drawn)} | {"total": {d.set for d in drawn}}
    out = {}
    for group, members in groups.items():
        servers = {name: tally(in_sets(server_rows, members)) for name, server_rows in rows.items()}
        peer_valid = servers.get(PEER, {}).get("valid")
        out[group] = {
            "sampled": sum(d.set in members for d in drawn),
            "not_a_schema": sum(d.set in members and d.schema is None for d in drawn),
            "compile": compile_tally(in_sets(compiles, members)),
            "servers": servers,
            "valid_ratio": round(servers["ours"]["valid"] / peer_valid, 3) if peer_valid else None,
        }
    return out


def table(summary: dict) -> str:
    """One row per set and server, ours first; the ratio on ours' row."""
    rows = []
    for group, entry in summary.items():
        for name, counts in entry["servers"].items():
            ours = name == "ours"
            compiled = (
                [entry["compile"]["compile_ms_p50"], entry["compile"]["compile_ms_p99"]]
                if ours
                else ["not measured"] * 2
            )
            ratio = entry["valid_ratio"]
            rows.append(
                [group, name, entry["sampled"], entry["not_a_schema"]]
                + [counts[key] for key in ("accepted", "finished", "valid", "invalid", "unjudgeable")]
                + compiled
                + [counts["seconds_p50"], counts["seconds_p99"]]
                + [(f"{ratio:.2f}x" if ratio is not None else "n/a") if ours else ""]
            )
    headers = ["set", "server", "sampled", "not a schema", "accepted", "finished", "valid", "invalid", "unjudgeable"]
    headers += ["compile p50 ms", "compile p99 ms", "s/request p50", "s/request p99", f"valid ours/{PEER}"]
    return markdown_table(headers, rows)


def notes(results: dict) -> str:
    """What the table leaves out: files that held no schema, our compile refusals, our server's death, the peer's
    absence, our gateway's disagreements with the judgement here."""
    lines = [f"- {d['set']}/{d['file']}: not a schema ({d['why']})" for d in results["not_a_schema"]]
    total = results["summary"]["total"]
    if total["compile"]["refused"] or total["compile"]["failed"]:
        lines.append(
            f"- ours: {total['compile']['refused']} schemas refused by the gateway's prepare, "
            f"{total['compile']['failed']} guides did not compile (results.json: compile)"
        )
    if "died" in results["servers"]["ours"]:
        lines.append(f"- ours: the server died during the run: {results['servers']['ours']['died'].splitlines()[0]}")
    lines.append(f"- {PEER}: compile time {NOT_MEASURED}")
    if "unavailable" in results["servers"].get(PEER, {}):
        lines.append(f"- {PEER}: not run: {results['servers'][PEER]['unavailable']}")
    verdicts = total["servers"]["ours"].get("structured_output")
    if verdicts:
        lines.append(
            f"- ours: the gateway's structured_output.valid disagrees with the judgement here on {verdicts['disagree']}"
            f" of {verdicts['compared']} answers both judged"
        )
    return "\n".join(lines)


def checkout_commit() -> str | None:
    """This checkout's commit, "-dirty" when its tracked files have changes; None outside a git checkout."""
    command = ["git", "-C", str(CHECKOUT), "describe", "--always", "--dirty", "--abbrev=40", "--exclude=*"]
    try:
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def benchmark_structured(
    config: Path,
    output: Path | None,
    *,
    data: Path | None,
    sets: list[str],
    per_set: int,
    seed: int,
    max_tokens: int,
    concurrency: int,
    peer: str | None,
    whitespace: str = "engine",
    strict: bool = False,
    log=print,
    server_log=print,
) -> dict:
    """The whole run: the schemas drawn, our server asked every one, then llama-server (unless `peer` is "none";
    asked for by name, a peer that is not built is an error before anything starts, otherwise it is reported), then
    our compile times. Returns the results: provenance, every request's row, every compile, the summaries."""
    from importlib import metadata

    if peer not in (None, "none", PEER):
        raise PipelineError(f"--peer {peer}: choose {PEER} or none")
    if whitespace not in WHITESPACE:
        raise PipelineError(f"--whitespace {whitespace}: choose one of {', '.join(WHITESPACE)}")
    if per_set < 1 or concurrency < 1 or max_tokens < 1:
        raise PipelineError("--per-set, --concurrency and --max-tokens take a positive number")
    load_config(config, [])
    output = output or default_output(config)
    engine = output / "engine"
    if not (engine / "config.json").is_file():
        raise PipelineError(f"no engine in {engine}: build it first (trtllm-pipeline build {config})")
    if peer == PEER:
        llama_server_files(output)
    root = sets_folder(data, cache_dir(), log)
    drawn = draw(root, sets, per_set, seed)
    schemas = [d for d in drawn if d.schema is not None]
    repo = output / "triton_repo"
    report = checked_repository(repo, config)
    settings = {"max_tokens": max_tokens, "concurrency": concurrency, "strict": strict}
    servers = {"ours": measure_ours(repo, report, schemas, settings, WHITESPACE[whitespace], log, server_log)}
    if peer != "none":
        servers[PEER] = measure_llama_server(output, report, schemas, settings, log)
    compiles = compile_times(engine, schemas, log, WHITESPACE[whitespace], strict)
    answered = {name: server["rows"] for name, server in servers.items() if "rows" in server}
    return {
        "name": config.stem,
        "config": str(config),
        "commit": checkout_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "build": build_info(output),
        "dataset": {
            "repository": f"github.com/{JSONSCHEMABENCH}",
            "commit": JSONSCHEMABENCH_COMMIT,
            "source": str(data) if data else JSONSCHEMABENCH_URL,
            "sets": sets,
            "per_set": per_set,
            "seed": seed,
        },
        "request": {
            "prompt": PROMPT,
            "response_format": f"json_schema (name schema, {'strict: true' if strict else 'no strict key'})",
            "temperature": 0,
            "max_tokens": max_tokens,
            "concurrency": concurrency,
            "whitespace": whitespace,
        },
        "judged_by": {
            "jsonschema": metadata.version("jsonschema"),
            "formats_checked": sorted(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers),
        },
        "not_a_schema": [{"set": d.set, "file": d.file, "why": d.not_a_schema} for d in drawn if d.schema is None],
        "compile": {"ours": compiles, PEER: NOT_MEASURED},
        "servers": servers,
        "summary": summaries(drawn, answered, compiles),
    }
