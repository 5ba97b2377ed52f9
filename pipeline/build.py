"""Run the planned stages: each writes into a temporary directory renamed into place when complete.

An interrupted stage leaves only `.tmp-<stage>-*` and `.build.lock.json.*` (deleted by the next run) or,
if killed between rename and lock update, an output whose hash the lock does not vouch for -- so
nothing half-written is ever trusted.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console

from pipeline.config import BuildConfig
from pipeline.errors import BuildStepError, PipelineError, StageError
from pipeline.host_memory import available_memory, check_fits, predict, shown_bytes
from pipeline.lock import hash_paths, read_lock, remove_lock_temps, write_lock
from pipeline.plan import SKIPPED, UP_TO_DATE, Decision, decide
from pipeline.stages import STAGES, selected


def default_output(config_path: Path) -> Path:
    return Path("artifacts") / config_path.stem


def cache_dir() -> Path:
    """Downloads shared by all builds (model wheels, evaluation text): $TRTLLM_PIPELINE_CACHE or ~/.cache."""
    return Path(os.environ.get("TRTLLM_PIPELINE_CACHE", Path.home() / ".cache" / "trtllm-pipeline")).expanduser()


@dataclass
class StageContext:
    out_dir: Path
    output: Path
    cache: Path
    console: Console
    metrics: dict = field(default_factory=dict)

    def upstream(self, name: str) -> Path:
        return self.output / name

    def log(self, message: str) -> None:
        self.console.print(f"  [dim]{time.strftime('%H:%M:%S')}[/] {message}")

    def progress(self, items, description: str, total: int | None = None):
        """Iterate with a progress bar (elapsed and remaining time) for long loops such as calibration."""
        from rich.progress import track

        return track(items, description=f"  {description}", total=total, console=self.console, transient=True)


@contextmanager
def exclusive(output: Path, wait: bool = False, console: Console | None = None):
    """One build per output directory at a time, in a directory it can write (checked first, so a read-only
    one fails here with its name rather than mid-stage); with `wait`, queue behind the running one."""
    try:
        output.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=output).close()  # open(.lock, "w") alone passes when .lock is writable
        handle = open(output / ".lock", "w")
    except OSError as exc:
        raise PipelineError(
            f"cannot write to the output directory {output}: {exc.strerror or exc}; choose a writable one with "
            "--output or fix its permissions"
        ) from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                raise PipelineError(
                    f"another build is running in {output}; wait for it (--wait) or use --output"
                ) from None
            if console:
                console.print(f"waiting for the build running in {output} ...")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _remove_leftovers(output: Path) -> None:
    """What killed runs left behind; called under the build lock, so none of it belongs to a live build."""
    for stale in output.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in output.glob(".old-*"):
        shutil.rmtree(stale, ignore_errors=True)
    remove_lock_temps(output)


def run_stage(decision: Decision, cfg: BuildConfig, output: Path, lock: dict, console: Console) -> dict:
    name = decision.stage
    tmp = output / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    ctx = StageContext(tmp, output, cache_dir(), console)
    started = time.perf_counter()
    try:
        metrics = STAGES[name].run(cfg, ctx) or {}
    except BuildStepError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise StageError(name, str(exc)) from exc
    except PipelineError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        if os.environ.get("TRTLLM_PIPELINE_DEBUG"):
            traceback.print_exc()
        raise StageError(name, f"{type(exc).__name__}: {exc} (run with --debug for the traceback)") from exc
    duration = time.perf_counter() - started
    files, out_hash = hash_paths([tmp], root=tmp)
    final, old = output / name, output / f".old-{name}-{os.getpid()}"
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    # mtimes survive the rename, so the records stay valid for the stat fast path
    entry = {k: v for k, v in decision.inputs.items()}
    entry.update(
        output_hash=out_hash,
        files=files,
        duration_s=round(duration, 3),
        metrics=metrics,
        finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    lock["stages"][name] = entry
    write_lock(output, lock)
    return entry


def _preflight(name: str, prediction, console: Console, check_memory: bool) -> None:
    """Say what the stage is predicted to hold and write; stop it before it starts when this machine cannot hold it
    (read just before each stage: earlier ones, or other processes, change what is available)."""
    available = available_memory()
    console.print(
        f"[dim]  {name}: predicted peak host memory {shown_bytes(prediction.host_bytes)} ({prediction.peak}; "
        f"{shown_bytes(available)} available), disk {shown_bytes(prediction.disk_bytes)}[/]",
        highlight=False,
    )
    if check_memory:
        check_fits(name, prediction, available)


def build(
    cfg: BuildConfig,
    output: Path,
    console: Console,
    until: str | None = None,
    force: bool = False,
    only: str | None = None,
    wait: bool = False,
    check_memory: bool = True,
) -> list[Decision]:
    """Run every stage (of `selected(until, only)`) that is not up to date, in order; returns what happened to each.
    `wait`: wait for another build of `output` to finish instead of failing (replicas building onto one claim).
    `check_memory`: stop before a stage whose predicted peak host memory exceeds what is available here (exit 4)."""
    done: list[Decision] = []
    predictions = predict(cfg)
    with exclusive(output, wait, console):
        _remove_leftovers(output)
        lock = read_lock(output)
        for name in selected(until, only):
            # decided just before running: an upstream re-run that reproduced identical bytes keeps this stage valid
            decision = decide(name, cfg, output, lock, force)
            if decision.status == SKIPPED:
                console.print(f"[dim]- {name}: skipped ({decision.reasons[0]})[/]")
            elif decision.status == UP_TO_DATE:
                console.print(f"[green]✓ {name}[/]: up to date")
            else:
                if name in predictions:
                    _preflight(name, predictions[name], console, check_memory)
                console.print(f"[bold cyan]▶ {name}[/]: running ({'; '.join(decision.reasons)})")
                entry = run_stage(decision, cfg, output, lock, console)
                console.print(f"[green]✓ {name}[/]: done in {entry['duration_s']:.1f}s → {output / name}")
            done.append(decision)
    return done


def verify_output(cfg: BuildConfig, output: Path, log=print) -> tuple[Path, dict]:
    """(what was scored, its quality report) for the build in `output`: what its target's gated stage built, against
    its reference, as the `verify` command scores it (the stage's own gate runs the same `quality.measure`)."""
    from pipeline.quality import measure
    from pipeline.targets import target_of

    target = target_of(cfg)
    model, reference = target.scored(cfg, output, output / target.gated_stage, log)
    return model.path, measure(cfg, model, reference, output / "import", cache_dir(), log)
