"""One error hierarchy: the CLI maps each class to an exit code and prints it without a traceback."""

import reprlib

# Messages echo what the user wrote: a 50 MB string or an alias-expanded list would bury the message (and the terminal).
_ECHO = reprlib.Repr()
_ECHO.maxlevel, _ECHO.maxstring, _ECHO.maxother, _ECHO.maxlong = 2, 160, 160, 160
_ECHO.maxlist = _ECHO.maxtuple = _ECHO.maxdict = _ECHO.maxset = 6
# A config error lists at most this many problems, each cut to this many characters: the first ones show what is
# wrong, thousands more (or a message quoting a 50 MB path) only scroll it away.
MAX_PROBLEMS, MAX_PROBLEM_CHARS = 50, 2000


def shown(value) -> str:
    """repr(value) bounded for a message: long strings are cut in the middle and long containers after a few items,
    with the full length named."""
    text = _ECHO.repr(value)
    if isinstance(value, (str, bytes)) and len(value) > _ECHO.maxstring:
        return f"{text} ({len(value):,} characters)"
    if isinstance(value, (list, tuple, dict, set)) and len(value) > _ECHO.maxlist:
        return f"{text} ({len(value):,} items)"
    return text


def _cut(text: str) -> str:
    half = MAX_PROBLEM_CHARS // 2
    return text if len(text) <= MAX_PROBLEM_CHARS else f"{text[:half]} ... {text[-half:]} ({len(text):,} characters)"


class PipelineError(Exception):
    """A user-facing failure: the message says what failed, where, and what to do next."""

    exit_code = 1


class ConfigError(PipelineError):
    """The build config is invalid; carries every problem found, not just the first."""

    exit_code = 2

    def __init__(self, path, problems: list[str]):
        self.path, self.total = path, len(problems)
        more = len(problems) - MAX_PROBLEMS
        self.problems = [_cut(p) for p in problems[:MAX_PROBLEMS]]
        self.problems += [f"... and {more:,} more problem(s) not listed"] if more > 0 else []
        super().__init__(f"{path}: {len(problems)} problem(s)\n" + "\n".join(f"  - {p}" for p in self.problems))


class StageError(PipelineError):
    """A stage failed while running; nothing it wrote is trusted by later runs."""

    exit_code = 3

    def __init__(self, stage: str, message: str):
        self.stage = stage
        super().__init__(f"stage '{stage}' failed: {message}")


class BuildStepError(PipelineError):
    """Raised by the code a stage calls (target adapters, the repository writer): the running stage
    reports it under its own name, so that code need not know which stage runs it."""


class TargetUnavailable(PipelineError):
    """The machine lacks what the target needs (GPU, TensorRT-LLM, ...)."""

    exit_code = 4


class NotEnoughMemory(TargetUnavailable):
    """A stage's predicted peak host memory exceeds what this machine has available (`pipeline.host_memory`): stopped
    before it starts rather than killed by the kernel hours into it."""


class CheckpointError(BuildStepError):
    """A model file is unreadable or malformed; the message names the file and what is wrong with it."""
