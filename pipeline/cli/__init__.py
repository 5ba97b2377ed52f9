"""`trtllm-pipeline` command line: one small function per verb, grouped by concern (`build`: the build verbs,
`registries`: what can be built, `serving`: using a build, `bench`: the benchmarks); all logic lives in the modules
they call. The verbs are registered here, in the order `--help` lists them."""

from __future__ import annotations

import os

import typer

from pipeline.cli import bench_structured, build, registries, serving
from pipeline.cli.bench import bench_app

app = typer.Typer(
    help="Compile Hugging Face LLM checkpoints into ONNX Runtime / TensorRT-LLM engines and Triton model "
    "repositories.\n\n"
    "Example: trtllm-pipeline build build_configs/smollm2-135m-cpu.yaml",
    no_args_is_help=True,
    rich_markup_mode="markdown",
    pretty_exceptions_enable=False,
)


@app.callback()
def main(debug: bool = typer.Option(False, "--debug", help="Show Python tracebacks for failures.")):
    if debug:
        os.environ["TRTLLM_PIPELINE_DEBUG"] = "1"


for verb in (
    build.validate,
    registries.targets,
    registries.architectures,
    build.plan,
    build.build,
    build.verify,
    serving.run,
    serving.serve,
    build.deploy,
):
    app.command()(verb)
app.command("validate-repo")(serving.validate_repo)
bench_app.command("structured")(bench_structured.bench_structured)
app.add_typer(bench_app, name="bench")
