"""Start the draft and target services as local processes on free loopback ports."""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

# PARENT_ENV tells a service which process started it: a service whose starter is gone stops,
# so a killed `specdec serve` leaves no services behind.
from specdec.rpc.service_main import PARENT_ENV

log = logging.getLogger(__name__)


# Services that share this machine's cores take turns on them. After each parallel region
# libgomp's helper threads spin GOMP_SPINCOUNT times (300,000 by default) before they sleep,
# so the service that just answered kept a core busy well into the other's turn: measured on a
# 2-core CPU, verify passes took ~39 ms instead of ~33 ms in sequential rounds. 100,000 keeps
# each service's own passes at full speed (its helpers still spin between the ops of a pass;
# 0 made a target-only step 40 ms) and gave 15-25% more speculative tok/s. Since the fused C
# layer ops, 10,000 does as well for target-only and better for drafted rounds (k = 1 on chat,
# three alternated pairs: spec 121-127 tok/s against 108-119 at 100,000, target-only 182-189
# against 181-193; docs/performance.md).
SHARED_CORES_ENV = {"GOMP_SPINCOUNT": "10000"}


def shared_cores_env() -> dict:
    """Environment for services sharing this machine's cores (a user's own setting wins)."""
    return {k: v for k, v in SHARED_CORES_ENV.items() if k not in os.environ}


class ServiceRefused(ValueError):
    """A local service refused its model (or could not find it): the reason, in one line.

    A ValueError, so that ``specdec generate`` / ``serve`` print it as their one-line error."""


# A service's working folder (its port file, its log) is named after the process that
# started it, so that a later start can remove the folders of a starter that is gone (killed
# before it could remove them itself).
_DIR = re.compile(r"specdec-(?:draft|target)-(\d+)-[^/]+")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale_dirs(root: str | None = None) -> int:
    """Remove the service folders whose starter process is gone; how many were removed."""
    root = root or tempfile.gettempdir()
    removed = 0
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            m = _DIR.fullmatch(name)
            if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
                removed += 1
    return removed


class ServiceProcess:
    """One service in a child process; stopped by its process id (never by name)."""

    def __init__(self, role: str, args: list[str], env: dict | None = None,
                 log_path: str | None = None, port: int = 0,
                 cores: list[int] | None = None, nice: int = 0):
        """``cores``: run the service on these CPU cores only (taskset), e.g. to give draft
        and target disjoint hardware on one machine. ``nice``: its CPU priority below this
        process's (see SpecdecSystems in bench.harness)."""
        self.role = role
        remove_stale_dirs()
        self._tmp = tempfile.mkdtemp(prefix=f"specdec-{role}-{os.getpid()}-")
        self.port_file = os.path.join(self._tmp, "port")
        self.log_path = log_path or os.path.join(self._tmp, "log")
        self._args, self._cores, self._nice = list(args), cores, nice
        self._env = {**os.environ, **shared_cores_env(), **(env or {}),
                     PARENT_ENV: str(os.getpid())}
        self._log = open(self.log_path, "ab")
        self.port: int | None = None
        self.proc = self._spawn(port)

    def _spawn(self, port: int) -> subprocess.Popen:
        module = "draft_service" if self.role == "draft" else "target_service"
        cmd = [sys.executable, "-m", module, "--port", str(port), "--port-file", self.port_file,
               *self._args]
        if self._cores is not None:
            if not shutil.which("taskset"):
                raise RuntimeError("pinning a service to cores needs taskset (util-linux)")
            cmd = ["taskset", "-c", ",".join(map(str, self._cores)), *cmd]
        if self._nice:
            cmd = ["nice", "-n", str(self._nice), *cmd]
        return subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self._env,
                                start_new_session=True)

    def restart(self) -> None:
        """Start the service again (after it died) on the port it had, so that channels to it
        reconnect by themselves; ``wait_port`` then waits for it to serve."""
        if self.proc.poll() is None:
            raise RuntimeError(f"the {self.role} service is still running")
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.port_file)
        self.proc = self._spawn(self.port or 0)

    @property
    def address(self) -> str:
        assert self.port is not None, "service not started"
        return f"127.0.0.1:{self.port}"

    def wait_port(self, timeout_s: float = 600.0, abort: threading.Event | None = None) -> int:
        """Wait until the service serves (its port file appears); ``abort`` ends the wait."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if abort is not None and abort.is_set():
                raise RuntimeError(f"stopped waiting for the {self.role} service")
            if os.path.exists(self.port_file):
                self.port = int(pathlib.Path(self.port_file).read_text())
                return self.port
            if self.proc.poll() is not None:
                reason = self.refusal()
                if reason is not None:
                    raise ServiceRefused(reason)
                raise RuntimeError(
                    f"{self.role} service exited with {self.proc.returncode}:\n{self.tail()}"
                )
            time.sleep(0.05)
        raise TimeoutError(f"{self.role} service did not start in {timeout_s}s:\n{self.tail()}")

    def refusal(self) -> str | None:
        """The one-line reason a service gave for refusing to start (specdec.rpc.host), if any."""
        from specdec.rpc.host import LOAD_ERROR_PREFIX

        lines = [ln for ln in self.tail(5).splitlines() if ln.startswith(LOAD_ERROR_PREFIX)]
        return lines[-1][len(LOAD_ERROR_PREFIX):] if lines else None

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(pathlib.Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the service (SIGTERM, then SIGKILL after ``timeout_s``), reap it, and remove
        its folder (and log, unless the log was put elsewhere)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL, as a crash would (fault tests)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def service_args(model: str, threads: int, extra: list[str] | None = None) -> list[str]:
    args = ["--model", model, "--log-level", os.environ.get("SPECDEC_SERVICE_LOG", "WARNING")]
    if threads:
        args += ["--threads", str(threads)]
    return args + list(extra or [])


class LocalServices:
    """Both services as child processes (context manager); ``draft`` is None for target-only."""

    def __init__(self, target: str = "default", draft: str | None = "default-draft",
                 threads: int = 1, target_args: list[str] | None = None,
                 draft_args: list[str] | None = None):
        self.target = ServiceProcess("target", service_args(target, threads, target_args))
        self.draft = None
        self._draft_args = None
        if draft is not None:
            self._draft_args = service_args(draft, threads, ["--target", target, *(draft_args or [])])

    def __enter__(self) -> "LocalServices":
        # One at a time: each service times its forward passes at start (the costs adaptive k
        # works from), and two processes doing so at once on the same cores distort both
        # (measured: a 3 ms draft step timed at 84 ms).
        try:
            self.target.wait_port()
            if self._draft_args is not None:
                self.draft = ServiceProcess("draft", self._draft_args)
                self.draft.wait_port()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def supervise(self, on_event: Callable[[str, str, str], None] | None = None) -> "Supervisor":
        """Restart a service that dies (see Supervisor); ``on_event(role, event, detail)``
        hears of each death ("down") and each restart that serves again ("up")."""
        self.supervisor = Supervisor([p for p in (self.target, self.draft) if p is not None],
                                     on_event)
        return self.supervisor

    def stop(self) -> None:
        if getattr(self, "supervisor", None) is not None:
            self.supervisor.stop()
        for p in (self.draft, self.target):
            if p is not None:
                p.stop()

    @property
    def target_addr(self) -> str:
        return self.target.address

    @property
    def draft_addr(self) -> str | None:
        return self.draft.address if self.draft is not None else None


class Supervisor:
    """Watches local services and restarts one that dies, on the port it had (its clients'
    channels reconnect by themselves), with backoff between restarts of a service that keeps
    dying: RESTART_DELAY_S first, doubling up to MAX_RESTART_DELAY_S, back to the first once
    a restart has served for STABLE_S. Polling each child also reaps it (no zombies)."""

    POLL_S = 0.1
    RESTART_DELAY_S = 0.5
    MAX_RESTART_DELAY_S = 30.0
    STABLE_S = 60.0

    def __init__(self, services: list[ServiceProcess],
                 on_event: Callable[[str, str, str], None] | None = None):
        self.services = services
        self.on_event = on_event
        self.restarts = {p.role: 0 for p in services}
        self._delay = {p.role: self.RESTART_DELAY_S for p in services}
        self._up_since = {p.role: time.monotonic() for p in services}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="specdec-supervisor",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=30)

    def _tell(self, role: str, event: str, detail: str = "") -> None:
        if self.on_event is not None:
            try:
                self.on_event(role, event, detail)
            except Exception:  # a listener's failure must not stop the supervision
                log.exception("supervisor listener failed")

    def _watch(self) -> None:
        while not self._stopping.wait(self.POLL_S):
            for p in self.services:
                code = p.proc.poll()
                if code is not None and not self._stopping.is_set():
                    self._recover(p, code)

    def _recover(self, p: ServiceProcess, code: int) -> None:
        role = p.role
        why = f"signal {-code}" if code < 0 else f"exit code {code}"
        log.error("the %s service died (%s); restarting it. Its log ends:\n%s", role, why,
                  p.tail(10))
        self._tell(role, "down", f"the {role} service died ({why}); restarting")
        if time.monotonic() - self._up_since[role] >= self.STABLE_S:
            self._delay[role] = self.RESTART_DELAY_S
        while not self._stopping.wait(self._delay[role]):
            self._delay[role] = min(2 * self._delay[role], self.MAX_RESTART_DELAY_S)
            try:
                p.restart()
                p.wait_port(abort=self._stopping)
            except Exception as exc:  # it failed to start: try again after the next delay
                log.error("restarting the %s service failed: %s", role, exc)
                continue
            self.restarts[role] += 1
            self._up_since[role] = time.monotonic()
            log.warning("the %s service is back on port %s (restart %d)", role, p.port,
                        self.restarts[role])
            self._tell(role, "up", f"restarted on port {p.port}")
            return
