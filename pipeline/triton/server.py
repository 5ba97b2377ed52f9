"""Run a real tritonserver on CPU: the 2.51 binary and python backend bundled in PyPI's
`nvidia-pytriton==0.7.0` wheel (the NGC container is not reachable here).

The wheel is downloaded, never installed (it would downgrade the environment), and unpacked once
into the cache. The python backend finds its stub only next to `libtriton_python.so`, and the stub
finds our virtualenv only through PATH plus the interpreter's LIBDIR on LD_LIBRARY_PATH, so a
private backend directory and environment are set up here. The python models import the installed
`pipeline` package, so the server runs in the project's virtualenv.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from pipeline.adapter_registry import REGISTRY_ENV
from pipeline.errors import PipelineError
from pipeline.fetch import fetch_wheel
from pipeline.triton.postmortem import UNLOADING, exit_status, log_size, log_text, model_output, still_loaded
from pipeline.triton.reaper import remove_server_files

PYTRITON_WHEEL = ("nvidia-pytriton==0.7.0", "21f063ff93bb426d0c06b7a55e7eb9efcfe62c0dddd9a908e9877e18710128df")
TRITONSERVER_VERSION = "2.51"
_MEMBERS = ("pytriton/tritonserver/", "nvidia_pytriton.libs/")


def install_tritonserver(cache: Path, log=print) -> Path:
    """The unpacked server directory (bin/, backends/, python_backend_stubs/, libs/), unpacking it once."""
    home = cache / f"tritonserver-{TRITONSERVER_VERSION}"
    if (home / "bin" / "tritonserver").is_file():
        return home
    wheel = fetch_wheel(*PYTRITON_WHEEL, cache, log)
    log(f"unpacking tritonserver {TRITONSERVER_VERSION} from {wheel.name}")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=f".{home.name}-"))
    try:
        with zipfile.ZipFile(wheel) as archive:
            for info in archive.infolist():
                if info.is_dir() or not info.filename.startswith(_MEMBERS):
                    continue
                relative = info.filename.removeprefix("pytriton/tritonserver/").replace(
                    "nvidia_pytriton.libs/", "libs/"
                )
                dest = tmp / relative
                dest.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(info) as src, open(dest, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
                dest.chmod((info.external_attr >> 16) & 0o777 or 0o644)
        tmp.rename(home)
    except FileExistsError:  # another process unpacked it first
        shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return home


def python_backend_dir(home: Path, work_dir: Path) -> Path:
    """A backend directory whose python backend has the stub for this interpreter next to it."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = home / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        known = ", ".join(sorted(p.name for p in (home / "python_backend_stubs").iterdir()))
        raise PipelineError(
            f"tritonserver {TRITONSERVER_VERSION} ships python backend stubs for Python {known}, not {version}; "
            "run the pipeline with one of those"
        )
    backend = work_dir / "backends" / "python"
    backend.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        link = backend / name
        if not link.exists():
            link.symlink_to(home / "backends" / "python" / name)
    shutil.copy2(stub, backend / stub.name)
    return backend.parent


def tritonserver_address_args(host: str, ports: "Ports") -> list[str]:
    """Where tritonserver listens: HTTP, gRPC and metrics on `host`.

    An IPv6 address is written as each server parses it: gRPC appends `:port` (brackets needed, else "::1:8001"
    fails as "already in use"), the HTTP and metrics servers (libevhtp) want `ipv6:` before it.
    """
    ipv6 = ":" in host
    grpc_host, http_host = (f"[{host}]", f"ipv6:{host}") if ipv6 else (host, host)
    return [
        f"--http-address={http_host}",
        f"--http-port={ports.http}",
        f"--grpc-address={grpc_host}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-address={http_host}",
        f"--metrics-port={ports.metrics}",
    ]


STUB = "triton_python_backend_stub"  # the process name of every python-backend model instance
WORK_PREFIX = "trtllm-pipeline-serve-"  # + token: a server's directory in the temp dir (backends, owner file)
SHM_PREFIX = "trtllm_pipeline_"  # + token + "_": its /dev/shm regions
OWNER = "owner.json"  # in the work dir: the pid and create time of the process that started the server
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: a preexec_fn should not load libraries


def dial_host(host: str) -> str:
    """The address a local client dials to reach a server bound to `host`: a wildcard address is not dialable."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)


def host_port(host: str, port: int) -> str:
    """`host:port`, an IPv6 address in brackets (as URLs and gRPC targets need it)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def dial_address(host: str, port: int) -> str:
    """`host:port` for a local client of a server bound to `host`."""
    return host_port(dial_host(host), port)


def _owner_record() -> dict:
    return {"pid": os.getpid(), "create_time": psutil.Process().create_time()}


def _owner_alive(work: Path) -> bool | None:
    """Whether the process that started the server of `work` still runs (None: no owner file, e.g. mid-creation);
    a zombie does not: killed, it stays one until its parent reaps it."""
    try:
        owner = json.loads((work / OWNER).read_text())
        process = psutil.Process(owner["pid"])
        same = abs(process.create_time() - owner["create_time"]) < 1.0  # else: a reused pid
        return same and process.status() != psutil.STATUS_ZOMBIE
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (psutil.NoSuchProcess, ValueError, KeyError, TypeError):
        return False


def reclaim_orphans(log=print) -> None:
    """Remove what servers whose owner died (`serve` killed with -9, a crashed test run) left behind: processes
    still naming their token, /dev/shm regions, work directories. A server whose owner lives is never touched;
    one without an owner file only when no process names it and its directory (if any) is a minute old."""
    tmp = Path(tempfile.gettempdir())
    tokens = {p.name.removeprefix(WORK_PREFIX) for p in tmp.glob(f"{WORK_PREFIX}*")}
    tokens |= {p.name.removeprefix(SHM_PREFIX).split("_")[0] for p in Path("/dev/shm").glob(f"{SHM_PREFIX}*")}
    processes = None
    for token in sorted(tokens):
        work = tmp / f"{WORK_PREFIX}{token}"
        owned = _owner_alive(work)
        if owned:
            continue
        if processes is None:
            processes = [(p, " ".join(p.info["cmdline"] or ())) for p in psutil.process_iter(["cmdline"])]
        named = [p for p, line in processes if f"{SHM_PREFIX}{token}_" in line or f"{WORK_PREFIX}{token}" in line]
        if owned is None and (named or (work.exists() and time.time() - work.stat().st_mtime < 60)):
            continue
        for process in named:
            try:
                process.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(named, timeout=5)
        regions = remove_server_files(f"{SHM_PREFIX}{token}_", work)
        log(f"reclaimed orphaned server {token}: {len(named)} process(es), {regions} /dev/shm region(s)")


def _die_with_parent(parent: int, death_signal: int = signal.SIGKILL):
    """A preexec_fn: `death_signal` once the thread that forked the child exits, `serve` killed with -9 included.
    A SIGTERM is blocked, to wait for it (the reaper), so none arrives before the child is ready for it."""

    def set_up() -> None:
        if death_signal == signal.SIGTERM:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        _prctl(_PR_SET_PDEATHSIG, death_signal, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: no signal would come
            os._exit(1)

    return set_up


def _exited(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports free now. Every socket stays bound until all are chosen: closed one at a time,
    the kernel may hand the same port out twice (tritonserver then refuses HTTP and gRPC on one port)."""
    with ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for held_socket in sockets:
            held_socket.bind(("127.0.0.1", 0))
        return [held_socket.getsockname()[1] for held_socket in sockets]


def free_port() -> int:
    return free_ports(1)[0]


@dataclass
class Ports:
    http: int
    grpc: int
    metrics: int

    @classmethod
    def pick(cls, http: int = 0, grpc: int = 0, metrics: int = 0) -> "Ports":
        chosen = (http, grpc, metrics)
        fresh = iter(free_ports(chosen.count(0)))
        return cls(*(port or next(fresh) for port in chosen))


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
UNLOAD_S = 5.0  # how long `stop` lets the models unload once tritonserver logs UNLOADING


@contextmanager
def stop_signals_deferred():
    """SIGINT/SIGTERM held until the block ends: one arriving between tritonserver's fork and the assignment of
    its Popen would leave a server nobody can stop (seen as an orphan when `serve` was stopped at 0.5 s)."""
    if threading.current_thread() is not threading.main_thread():  # handlers run on the main thread only
        yield
        return
    pending: list[int] = []
    previous = {sig: signal.signal(sig, lambda number, _: pending.append(number)) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if pending:
            signal.raise_signal(pending[0])


class TritonServer:
    """A tritonserver process serving one repository (on 127.0.0.1 unless told otherwise); a context manager.

    Logs go to `log_file` (default: next to the repository); its backend directory lives in a temporary
    directory that `stop` removes; `start` waits until the server reports ready and fails with the log's
    tail when it exits or times out first.

    Nothing of it outlives its owner: tritonserver gets SIGKILL when the thread that started it exits, and a reaper
    process (pipeline.triton.reaper) then kills its model processes and removes its files; `start` reclaims what
    servers of dead owners left all the same (an owner and its reaper killed together). Once ready, a watchdog stops
    tritonserver at once when a model process dies: tritonserver 2.51 would keep reporting ready while every
    request to that model hangs or fails; stopped, it fails in-flight streams (UNAVAILABLE) and `failure` says why.
    """

    def __init__(
        self,
        repo: Path,
        cache: Path,
        *,
        ports: Ports | None = None,
        host: str = "127.0.0.1",
        log_file: Path | None = None,
        extra_args: tuple[str, ...] = (),
        launch: Callable[[list[str]], list[str]] | None = None,
        log=print,
    ):
        self.repo = Path(repo).resolve()
        self.cache = cache
        self.ports = ports or Ports.pick()
        self.host = host
        self.token = secrets.token_hex(4)  # names its work dir and /dev/shm regions, so orphans can be found
        self.work_dir: Path | None = None  # the private backend directory, from start() until stop()
        self.shm_prefix = f"{SHM_PREFIX}{self.token}_"
        self.log_file = log_file or self.repo.parent / "tritonserver.log"
        self.extra_args = extra_args
        # a target's own tritonserver launch (e.g. TensorRT-LLM's container, one rank per GPU): the command for
        # these address arguments; None runs the wheel's tritonserver on CPU
        self.launch = launch
        self.log = log
        self.process: subprocess.Popen | None = None
        self.reaper: subprocess.Popen | None = None  # see pipeline.triton.reaper
        self.stubs: dict[psutil.Process, str] = {}  # the model processes, with their model's name
        self.failure: str | None = None  # set by the watchdog: which model process died, and how
        self._watching = threading.Event()
        self._watchdog: threading.Thread | None = None

    @property
    def lora_registry(self) -> Path:
        """The LoRA adapters added while serving (`pipeline.adapter_registry.Registry`): a file in the private work dir,
        named to the model processes through their environment, so no Triton client can read or change it."""
        return Path(tempfile.gettempdir()) / f"{WORK_PREFIX}{self.token}" / "lora_registry.json"

    def address_args(self) -> list[str]:
        return tritonserver_address_args(self.host, self.ports)

    def dial(self, port: int) -> str:
        """`host:port` a local client dials for one of this server's ports."""
        return dial_address(self.host, port)

    def command(self, home: Path, backends: Path) -> list[str]:
        return [
            str(home / "bin" / "tritonserver"),
            f"--model-repository={self.repo}",
            f"--backend-directory={backends}",
            *self.address_args(),
            "--allow-sagemaker=false",
            "--allow-vertex-ai=false",
            "--pinned-memory-pool-byte-size=0",
            "--cuda-memory-pool-byte-size=0:0",  # no GPU: no pinned/CUDA pools
            "--exit-timeout-secs=30",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            *self.extra_args,
        ]

    def environment(self, home: Path) -> dict:
        env = dict(os.environ)
        # the stub embeds libpython: ours first, or it binds the system one and misses the venv's packages
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            filter(None, [sysconfig.get_config_var("LIBDIR"), str(home / "libs"), env.get("LD_LIBRARY_PATH")])
        )
        env["PATH"] = os.pathsep.join(
            [str(Path(sys.executable).parent), env.get("PATH", "")]
        )  # the stub finds pyvenv.cfg via PATH
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env[REGISTRY_ENV] = str(self.lora_registry)
        # The CPU repository's python models only tokenize with transformers: without torch its import takes 1.5 s
        # instead of 7 (three models at once on two cores: start-up 18 s -> 6 s, measured), and it says so once.
        env.setdefault("USE_TORCH", "0")
        env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        return env

    def start(self, timeout: float = 120.0) -> "TritonServer":
        if self.launch:
            command, env = self.launch(self.address_args()), dict(os.environ)
        else:
            home = install_tritonserver(self.cache, self.log)
            reclaim_orphans(self.log)
            self.work_dir = self.lora_registry.parent
            self.work_dir.mkdir(mode=0o700)
            (self.work_dir / OWNER).write_text(json.dumps(_owner_record()))
            command, env = self.command(home, python_backend_dir(home, self.work_dir)), self.environment(home)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        # the stubs tritonserver leaves when it dies are adopted here and reaped by stop(), not left as zombies
        _prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        # a death signal is bound to the forking thread: only the main thread lives as long as the process
        dies_with_us = threading.current_thread() is threading.main_thread()
        with open(self.log_file, "ab") as log, stop_signals_deferred():
            self.process = subprocess.Popen(
                command,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches serve only, which stops the gateway first
                preexec_fn=_die_with_parent(os.getpid()) if dies_with_us else None,
            )
            if dies_with_us:  # tritonserver's model processes are its children: the reaper takes them along
                self.reaper = subprocess.Popen(
                    [sys.executable, "-m", "pipeline.triton.reaper", str(self.process.pid), self.shm_prefix]
                    + [str(self.work_dir or "")],
                    start_new_session=True,  # outside tritonserver's group, which it kills, and out of Ctrl-C's way
                    preexec_fn=_die_with_parent(os.getpid(), signal.SIGTERM),
                )
        self._wait_ready(timeout)
        self._watch()
        return self

    def _wait_ready(self, timeout: float) -> None:
        import tritonclient.http as httpclient

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PipelineError(
                    f"tritonserver exited with code {self.process.returncode} while loading "
                    f"{self.repo}:\n{self.log_tail()}"
                )
            # a client per probe, closed: a kept-alive connection makes tritonserver wait out its exit timeout
            client = httpclient.InferenceServerClient(self.dial(self.ports.http))
            try:
                if client.is_server_ready():
                    return
            except Exception:  # not listening yet
                pass
            finally:
                client.close()
            time.sleep(0.25)
        self.stop()
        raise PipelineError(f"tritonserver was not ready after {timeout:.0f} s serving {self.repo}:\n{self.log_tail()}")

    def _watch(self, interval: float = 0.1) -> None:
        """Stop tritonserver with SIGKILL as soon as one of its model processes dies or turns zombie.

        SIGKILL, not SIGINT: requests held by the dead model never complete, so a graceful stop would leave their
        clients waiting out the exit timeout.
        """
        self._watching.clear()
        ready = log_size(self.log_file)
        server = psutil.Process(self.process.pid)
        self.stubs = {
            process: self._model_of(process) for process in server.children(recursive=True) if process.name() == STUB
        }

        def watch() -> None:
            while not self._watching.wait(interval):
                dead = next((stub for stub in self.stubs if _exited(stub)), None)
                if dead is not None:
                    if _exited(server):  # it died first and its models after it: `exit_reason` says how it ended
                        return
                    status = exit_status(dead.pid)  # while it is a zombie, before anyone reaps it
                    self.failure = f"the process of model '{self.stubs[dead]}' (pid {dead.pid}) died: {status}"
                    try:
                        os.killpg(self.process.pid, signal.SIGKILL)
                    except ProcessLookupError:  # tritonserver went first
                        pass
                    self.log(f"{self.failure}: stopped tritonserver")
                    self.log(
                        f"the model processes' stderr since ready (in {self.log_file}):\n"
                        + model_output(self.log_file, ready, self.process.pid)
                    )
                    return

        self._watchdog = threading.Thread(target=watch, name="tritonserver-watchdog", daemon=True)
        self._watchdog.start()

    def _model_of(self, stub: psutil.Process) -> str:
        """The model a stub runs: its command line names the model's file, <repo>/<model>/<version>/model.py."""
        for arg in stub.cmdline():
            path = Path(arg)
            if path.name == "model.py" and len(path.parts) >= 3:
                return path.parts[-3]
        return "unknown"

    def exit_reason(self) -> str:
        """Why tritonserver exited (after it did): the model process that died, else its exit code and log's tail."""
        if self.failure:
            return f"{self.failure}; tritonserver was stopped (its log: {self.log_file})"
        return f"tritonserver exited with code {self.process.returncode}:\n{self.log_tail()}"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> None:
        """SIGINT (models unload, within `_exits`' bounds), then make sure no python-backend stub of this server
        outlives it.

        On a loaded machine tritonserver may exit before its stubs do; they share its process group,
        so the group is drained (SIGTERM, then SIGKILL) and their shared-memory regions removed.
        """
        self._watching.set()  # the stubs exit now: no failure
        if self._watchdog:
            self._watchdog.join()
        if self.process and self.process.poll() is None:
            since = log_size(self.log_file)
            os.killpg(self.process.pid, signal.SIGINT)  # tritonserver unloads models and exits on SIGINT
            if not self._exits(timeout, since):
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self.process:
            self._drain_group(self.process.pid)
        remove_server_files(self.shm_prefix, self.work_dir)
        self.work_dir = None
        if self.reaper:  # stopped cleanly: nothing left to reap
            self.reaper.kill()
            self.reaper.wait()
            self.reaper = None

    def _exits(self, timeout: float, since: int) -> bool:
        """Whether tritonserver exits within `timeout` s of SIGINT, and within UNLOAD_S of beginning to unload the
        models (UNLOADING in its log: no inference in flight any more).

        Our models unload in a second or two. One that does not is held by a request that tritonserver 2.51's gRPC
        frontend never completes, after a client's cancel reached it while the request completed (a client that
        closes its stream on the last answer, before the stream's end): it would hold the exit for the whole
        --exit-timeout-secs with nothing left to do.
        """
        deadline, unloading = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            try:
                self.process.wait(0.1)
                return True
            except subprocess.TimeoutExpired:
                pass
            if unloading is None and UNLOADING in log_text(self.log_file, since):
                unloading = time.monotonic()
                deadline = min(deadline, unloading + UNLOAD_S)
        if unloading is not None:
            held = ", ".join(still_loaded(log_text(self.log_file, since), set(self.stubs.values())))
            self.log(
                f"tritonserver still held model(s) {held} {time.monotonic() - unloading:.0f} s into unloading: killed"
            )
        else:
            self.log(f"tritonserver had not exited {timeout:.0f} s after SIGINT: killed")
        return False

    @staticmethod
    def _drain_group(pgid: int, grace: float = 10.0) -> None:
        """Signal the group until it is empty, reaping the stubs adopted from tritonserver (zombies stay members)."""
        deadline = time.monotonic() + grace
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return  # nothing left in the group
            while time.monotonic() < deadline:
                try:
                    while os.waitid(os.P_PGID, pgid, os.WEXITED | os.WNOHANG):
                        pass
                except ChildProcessError:
                    pass  # none of the group is our child
                try:
                    os.killpg(pgid, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.1)
            deadline = time.monotonic() + 2.0

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
