"""What every verb shares: the consoles, PipelineErrors printed as messages with their exit codes, the arguments
several verbs take, and loading the build config they name."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from pipeline.errors import ConfigError, PipelineError

console = Console()
err_console = Console(stderr=True)

ConfigArg = typer.Argument(
    ..., exists=False, help="YAML build config, e.g. build_configs/smollm2-135m-cpu.yaml.", show_default=False
)
OverridesArg = typer.Argument(
    None,
    help="Overrides merged over the YAML, e.g. build.max_batch_size=16 quantization.weights=int4.",
    show_default=False,
)
OutputOpt = typer.Option(None, "--output", "-o", help="Output directory (default: artifacts/CONFIG-NAME).")


def reports_errors(fn):
    """Print PipelineErrors as messages with their exit code; tracebacks only with --debug."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PipelineError as exc:
            if os.environ.get("TRTLLM_PIPELINE_DEBUG"):
                raise
            # escaped: messages quote user input, and rich would swallow e.g. "[lm_head]" as a style tag
            if isinstance(exc, ConfigError):
                err_console.print(
                    f"[bold red]error:[/] {escape(str(exc.path))}: {exc.total} problem(s)", highlight=False
                )
                for problem in exc.problems:
                    err_console.print(f"  - {escape(problem)}", highlight=False, soft_wrap=True)
            else:
                err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err_console.print("[yellow]interrupted; completed stages are kept, the running one was discarded[/]")
            raise typer.Exit(130) from None

    return wrapper


def load(config: Path, overrides: Optional[list[str]]):
    """The build config with the command line's overrides merged over it."""
    from pipeline.validation import load_config

    return load_config(config, overrides or [])
