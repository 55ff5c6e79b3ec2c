"""Start the draft and target services as local processes on free loopback ports."""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

log = logging.getLogger(__name__)


# Services that share this machine's cores take turns on them. After each parallel region
# libgomp's helper threads spin GOMP_SPINCOUNT times (300,000 by default) before they sleep,
# so the service that just answered kept a core busy well into the other's turn: measured on a
# 2-core CPU, verify passes took ~39 ms instead of ~33 ms in sequential rounds. 100,000 keeps
# each service's own passes at full speed (its helpers still spin between the ops of a pass;
# 0 made a target-only step 40 ms) and gave 15-25% more speculative tok/s.
SHARED_CORES_ENV = {"GOMP_SPINCOUNT": "100000"}


def shared_cores_env() -> dict:
    """Environment for services sharing this machine's cores (a user's own setting wins)."""
    return {k: v for k, v in SHARED_CORES_ENV.items() if k not in os.environ}


class ServiceRefused(ValueError):
    """A local service refused its model (or could not find it): the reason, in one line.

    A ValueError, so that ``specdec generate`` / ``serve`` print it as their one-line error."""


class ServiceProcess:
    """One service in a child process; stopped by its process id (never by name)."""

    def __init__(self, role: str, args: list[str], env: dict | None = None,
                 log_path: str | None = None, port: int = 0,
                 cores: list[int] | None = None, nice: int = 0):
        """``cores``: run the service on these CPU cores only (taskset), e.g. to give draft
        and target disjoint hardware on one machine. ``nice``: its CPU priority below this
        process's (see SpecdecSystems in bench.harness)."""
        self.role = role
        self._tmp = tempfile.mkdtemp(prefix=f"specdec-{role}-")
        self.port_file = os.path.join(self._tmp, "port")
        self.log_path = log_path or os.path.join(self._tmp, "log")
        module = "draft_service" if role == "draft" else "target_service"
        cmd = [sys.executable, "-m", module, "--port", str(port), "--port-file", self.port_file,
               *args]
        if cores is not None:
            if not shutil.which("taskset"):
                raise RuntimeError("pinning a service to cores needs taskset (util-linux)")
            cmd = ["taskset", "-c", ",".join(map(str, cores)), *cmd]
        if nice:
            cmd = ["nice", "-n", str(nice), *cmd]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, **shared_cores_env(), **(env or {})},
            start_new_session=True,
        )
        self.port: int | None = None

    @property
    def address(self) -> str:
        assert self.port is not None, "service not started"
        return f"127.0.0.1:{self.port}"

    def wait_port(self, timeout_s: float = 600.0) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
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

    def stop(self) -> None:
        for p in (self.draft, self.target):
            if p is not None:
                p.stop()

    @property
    def target_addr(self) -> str:
        return self.target.address

    @property
    def draft_addr(self) -> str | None:
        return self.draft.address if self.draft is not None else None
