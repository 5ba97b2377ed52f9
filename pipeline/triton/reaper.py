"""The reaper of one tritonserver: a small process that outlives `serve` by a moment, to take the server's whole
process group and its files along when `serve` dies without cleaning up (kill -9, the OOM killer).

tritonserver itself gets SIGKILL from the kernel when `serve` dies (a parent-death signal), but its python-backend
model processes are its children, not `serve`'s, and wait for their own parent check: a busy one was seen running
20 s after its server was gone. The reaper gets SIGTERM from the kernel when `serve` dies (blocked from its start,
so none is lost before it waits), then kills the group and removes the server's /dev/shm regions and work
directory. Run as `python -m pipeline.triton.reaper PGID SHM_PREFIX WORK_DIR`; standard library only, so it starts
in milliseconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path


def remove_server_files(shm_prefix: str, work_dir: str | Path | None) -> int:
    """Remove a server's /dev/shm regions and work directory (a clean stop, the reaper, an orphan's reclaim);
    returns how many regions there were."""
    regions = list(Path("/dev/shm").glob(f"{shm_prefix}*"))
    for region in regions:
        region.unlink(missing_ok=True)
    if work_dir:
        shutil.rmtree(work_dir, ignore_errors=True)
    return len(regions)


def reap(pgid: int, shm_prefix: str, work_dir: str) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone already
        pass
    remove_server_files(shm_prefix, work_dir)


def main() -> None:
    pgid, shm_prefix, work_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    signal.sigwait({signal.SIGTERM})  # `serve` died; a clean stop kills this process instead
    reap(pgid, shm_prefix, work_dir)


if __name__ == "__main__":
    main()
