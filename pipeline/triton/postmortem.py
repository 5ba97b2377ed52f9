"""What a tritonserver's processes left to tell how they ended, for `TritonServer`'s watchdog and stop: a model
process's exit status, read from /proc while it is a zombie (tritonserver, its parent, reaps it only at unload), what
the model processes wrote to stderr (they inherit tritonserver's, its log file; every python model enables
faulthandler, so a crash leaves the stack of every thread there), and the models still loaded at a stop.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

# tritonserver's log line once no inference is in flight at a stop (core r24.10, src/server.cc, InferenceServer::Stop)
UNLOADING = "All models are stopped, unloading models"


def exit_status(pid: int) -> str:
    """How a zombie that is not our child ended ("exit code 1", "killed by signal 11 (SIGSEGV)"): /proc/PID/stat's
    exit_code (proc(5), field 52, a waitpid status), readable until its parent reaps it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "exit status unknown: already reaped"
    fields = stat[stat.rindex(")") + 2 :].split()  # from field 3 (state) on: comm, field 2, may hold spaces
    if fields[0] != "Z" or len(fields) < 50:
        return "exit status unknown"
    status = int(fields[52 - 3])
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        name = signal.Signals(number).name if number in signal.valid_signals() else "?"
        return f"killed by signal {number} ({name})" + (", core dumped" if os.WCOREDUMP(status) else "")
    return f"exit code {os.WEXITSTATUS(status)}"


def log_size(log: Path) -> int:
    try:
        return log.stat().st_size
    except OSError:
        return 0


def log_text(log: Path, offset: int) -> str:
    """The log from byte `offset` on."""
    try:
        with open(log, "rb") as file:
            file.seek(offset)
            return file.read().decode(errors="replace")
    except OSError:
        return ""


def model_output(log: Path, offset: int, server_pid: int, lines: int = 40) -> str:
    """The last lines after `offset` that tritonserver did not write: its own, the models' log calls included, begin
    `I1128 08:07:27.883847 <its pid> `; the rest is what its model processes wrote to stderr."""
    own = re.compile(rf"^[IWEF]\d{{4}} [\d:.]+ +{server_pid} ")
    kept = [line for line in log_text(log, offset).splitlines() if not own.match(line)]
    return "\n".join(kept[-lines:]) or "(nothing)"


def still_loaded(text: str, models: set[str]) -> list[str]:
    """The models of `models` that a stop's log `text` does not say were unloaded."""
    return sorted(model for model in models if f"successfully unloaded '{model}'" not in text)
