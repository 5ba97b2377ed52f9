"""One error hierarchy: the CLI maps each class to an exit code and prints it without a traceback."""


class PipelineError(Exception):
    """A user-facing failure: the message says what failed, where, and what to do next."""

    exit_code = 1


class ConfigError(PipelineError):
    """The build config is invalid; carries every problem found, not just the first."""

    exit_code = 2

    def __init__(self, path, problems: list[str]):
        self.path = path
        self.problems = problems
        super().__init__(f"{path}: {len(problems)} problem(s)\n" + "\n".join(f"  - {p}" for p in problems))


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


class CheckpointError(BuildStepError):
    """A model file is unreadable or malformed; the message names the file and what is wrong with it."""
