"""scripts/dev/tabulate_trtllm_serving.py on short inputs written here in the syntax of the files it reads
(serve.py's click options, OpenAIServer's routes, trtllm-llmapi-launch, Triton's metrics table), and the committed
trtllm_serving table the deployment code reads."""

import json

import pytest

from pipeline.targets.trtllm.deployment import HEALTH_ROUTE, parse_series
from pipeline.targets.trtllm.llm_api_serving import trtllm_serve_command
from pipeline.upstream import facts, releases
from tests.conftest import dev_script

TABLE = facts("trtllm_serving")["releases"]

tab = dev_script("tabulate_trtllm_serving")

SERVE = """
@click.command("serve")
@click.argument("model", type=str)
@click.option("--port", type=int, default=8000)
@click.option("--backend", type=ChoiceWithAlias(["pytorch", "tensorrt"], {"trt": "tensorrt"}), default="pytorch")
@click.option("--config", "--extra_llm_api_options", "extra_llm_api_options", type=str, default=None)
@click.option("--metrics_port", type=int, default=None)
def serve(model, **options):
    pass
"""

SERVER = """
class OpenAIServer:
    def register_routes(self):
        self.app.add_api_route("/health", self.health, methods=["GET"])
        # a comment of upstream's, which is not kept
        self.app.add_api_route("/v1/chat", self.chat if not self.use_other else self.other_chat, methods=["POST"])
        if self.llm.args.return_perf_metrics:
            self.mount_metrics()

    def register_mm_encoder_routes(self):
        self.app.add_api_route("/health", self.health, methods=["GET"])

    def mount_metrics(self):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        self.app.routes.append(Mount("/prom/metrics", make_asgi_app(registry=registry)))

    async def health(self):
        return Response(status_code=200)
"""

LAUNCHER = """#!/bin/bash
mpi_rank=${SLURM_PROCID:-${OMPI_COMM_WORLD_RANK:-0}}
mpi_blacklist=(
    OMPI_ SLURM_
)
if [ "$mpi_rank" -eq 0 ]; then
    export PROXY_ADDR="ipc://x"
    python3 -m tensorrt_llm.llmapi.mgmn_leader_node
else
    python3 -m tensorrt_llm.llmapi.mgmn_worker_node -n "$SLURM_NTASKS"
fi
"""

METRICS_DOC = """
|Category |Metric |Metric Name |Description |Granularity |Frequency |
|---------|-------|------------|------------|------------|----------|
|Count |Waiting |`nv_made_up_waiting` |Words we do not keep. |Per model |Per request |
"""


def test_serve_options_keep_the_renamed_flag_its_old_name_and_structured_types():
    options = tab.serve_options(SERVE)
    assert options["options"] == {
        "--port": {"aliases": [], "dest": None, "default": 8000, "type": "int"},
        "--backend": {
            "aliases": [],
            "dest": None,
            "default": "pytorch",
            "choices": ["pytorch", "tensorrt"],
            "choice_aliases": {"trt": "tensorrt"},
        },
        "--config": {
            "aliases": ["--extra_llm_api_options"],
            "dest": "extra_llm_api_options",
            "default": None,
            "type": "str",
        },
    }
    assert options["options_missing_from_source"] == ["--host", "--tp_size", "--pp_size"]
    assert options["metrics_or_prometheus_flags"] == ["--metrics_port"]


def test_routes_name_their_handler_methods_and_conditions_not_code():
    routes = tab.openai_routes(SERVER)
    assert routes["register_routes"] == [
        {"path": "/health", "methods": ["GET"], "handler": "health", "when": "always"},
        {
            "path": "/v1/chat",
            "methods": ["POST"],
            "handler": "chat",
            "handler_when": {"use_other": "other_chat"},
            "when": "always",
        },
        {"calls": "mount_metrics", "when": {"llm_arg": "return_perf_metrics"}},
    ]
    assert routes["mount_metrics"] == {
        "mount_paths": ["/prom/metrics"],
        "prometheus_asgi_app": True,
        "multiprocess_registry": True,
        "fastapi_instrumentator": False,
    }
    assert routes["health_status"] == 200


def test_a_route_condition_it_cannot_state_is_refused():
    with pytest.raises(tab.UnrecognizedSource, match="condition"):
        tab.openai_routes(SERVER.replace("if self.llm.args.return_perf_metrics:", "if os.environ.get('X'):"))


def test_launcher_rank_chain_exports_and_modules():
    assert tab.launcher_facts(LAUNCHER) == {
        "rank_from": ["SLURM_PROCID", "OMPI_COMM_WORLD_RANK"],
        "rank_default": 0,
        "world_size_from": ["SLURM_NTASKS"],
        "world_size_default": 1,
        "env_read": ["OMPI_COMM_WORLD_RANK", "SLURM_NTASKS", "SLURM_PROCID", "mpi_rank"],
        "env_exported": ["PROXY_ADDR"],
        "rank0": {
            "runs_in_background": "the wrapped command",
            "background_env_unset_prefixes": ["OMPI_", "SLURM_"],
            "runs_in_foreground": "tensorrt_llm.llmapi.mgmn_leader_node",
            "stops_with": {"module": "tensorrt_llm.llmapi.mgmn_leader_node", "action": "stop"},
        },
        "other_ranks": ["tensorrt_llm.llmapi.mgmn_worker_node"],
    }


def test_triton_metric_rows_keep_granularity_and_frequency_not_the_description():
    assert tab.triton_metric_rows(METRICS_DOC) == {
        "nv_made_up_waiting": {"granularity": "Per model", "frequency": "Per request"}
    }


# ---------------------------------------------------------------- the committed table


@pytest.mark.parametrize("release", releases("trtllm_serving"))
def test_every_release_has_every_section_and_cites_commits(release):
    block = TABLE[release]
    assert set(block) == {"source", "trtllm_serve", "llmapi_launch", "triton_engine", "triton_core"}
    for record in block["source"]["files"].values():
        assert len(record["commit"]) == 40 and record["pinned"] is False and len(record["release_commit"]) == 40
    for record in block["triton_engine"]["backend_release"]["source"]["files"]:
        assert len(record["commit"]) == 40
    assert block["triton_core"]["source"]["commit"] is None and block["triton_core"]["source"]["pinned"] is False
    text = json.dumps(block)
    assert '"comment"' not in text and '"description"' not in text and "self." not in text


@pytest.mark.parametrize("release", releases("trtllm_serving"))
def test_table_has_what_the_deployment_reads(release):
    block = TABLE[release]
    assert HEALTH_ROUTE in {route.get("path") for route in block["trtllm_serve"]["routes"]["register_routes"]}
    queue = block["triton_engine"]["queue_metric"]
    assert parse_series(queue["queued"]) == ("nv_trt_llm_request_metrics", {"request_type": "waiting"})
    assert queue["from"]
    family = block["triton_engine"]["custom_metrics"]["families"]["nv_trt_llm_request_metrics"]
    assert family["label"] == "request_type" and "waiting" in family["values"]


@pytest.mark.parametrize("release", releases("trtllm_serving"))
def test_the_trtllm_serve_command_parses_back_against_the_releases_options(release):
    """Every flag the pipeline passes to trtllm-serve (serve's exit-4 message, its docker run line, the Kubernetes
    pods) is an option or alias of that release's tabulated serve command, with a value of the option's type."""
    command = trtllm_serve_command(release, "/model", "/options.yaml", "0.0.0.0", 8000)
    assert command[:2] == ["trtllm-serve", "/model"]
    options = TABLE[release]["trtllm_serve"]["cli"]["options"]
    spelled = {spelling: spec for name, spec in options.items() for spelling in (name, *spec["aliases"])}
    for argument in command[2:]:
        flag, _, value = argument.partition("=")
        assert flag in spelled, f"trtllm-serve of {release} has no {flag} (it has {sorted(spelled)})"
        {"int": int, "str": str}[spelled[flag]["type"]](value)
