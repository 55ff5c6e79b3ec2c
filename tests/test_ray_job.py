"""`ray start --head` on 127.0.0.1, then `ray job submit ... -- specdec ray-up --config F` (the
README's command), a request through the app it serves, and `ray job stop` tearing it down.
The head is stopped by process id: never `ray stop`, which kills Ray processes by name."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
import yaml
from conftest import REPO, free_port, hf_greedy

psutil = pytest.importorskip("psutil")
pytest.importorskip("ray")

BIN = pathlib.Path(sys.executable).parent
RAY = str(BIN / "ray")


def ray_env() -> dict:
    return {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",  # `specdec` for the job
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keep 127.0.0.1 (see conftest)
        "TOKENIZERS_PARALLELISM": "false",
    }


def head_processes(temp_dir: str) -> list:
    """The processes of the head started with ``temp_dir``: those whose command line names it
    (gcs, raylet, dashboard, agents), and their descendants (workers, actors)."""
    roots = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(temp_dir in arg for arg in proc.info["cmdline"] or []):
                roots.append(proc)
    found = {p.pid: p for p in roots}
    for proc in roots:
        with contextlib.suppress(psutil.Error):
            found.update({c.pid: c for c in proc.children(recursive=True)})
    return list(found.values())


def kill_head(temp_dir: str) -> None:
    procs = head_processes(temp_dir)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=15)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=10)


@pytest.fixture(scope="module")
def head():
    """A one-node Ray cluster on 127.0.0.1 offering both custom resources, with the job server."""
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths live here
    dashboard = free_port()
    cmd = [
        RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(free_port()),
        "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
        "--dashboard-port", str(dashboard), "--ray-client-server-port", str(free_port()),
        "--dashboard-agent-listen-port", str(free_port()), "--min-worker-port", "0",
        "--max-worker-port", "0", "--num-cpus", "2", "--object-store-memory", str(100 << 20),
        "--resources", json.dumps({"draft_node": 1, "target_node": 1}), "--temp-dir", temp_dir,
        "--disable-usage-stats",
    ]
    try:
        out = subprocess.run(cmd, env=ray_env(), capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stdout + out.stderr
        yield dict(address=f"http://127.0.0.1:{dashboard}", temp_dir=temp_dir)
    finally:
        kill_head(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def ray_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([RAY, *args], env=ray_env(), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def job_client(head: dict):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(head["address"])


def job_logs(head: dict, job_id: str) -> str:
    return job_client(head).get_job_logs(job_id)


def job_status(head: dict, job_id: str) -> str:
    return str(job_client(head).get_job_status(job_id).value)


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 2.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def port_open(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, int(port))) == 0


def test_ray_job_submit_serves_and_stops(head, tiny_models, tmp_path):
    http_port = free_port()
    service = dict(calibrate=False, batch_wait_ms=0.0, device="cpu")
    config = dict(
        name="specdec-job", namespace="specdec-job",
        target=dict(model=tiny_models["target"], bind_host="127.0.0.1", num_cpus=0.5,
                    service=service),
        draft=dict(model=tiny_models["draft"], bind_host="127.0.0.1", num_cpus=0.5,
                   service=service),
        orchestrator=dict(ray_actor_options={"num_cpus": 0.5}, tokenizer=tiny_models["target"]),
        http=dict(host="127.0.0.1", port=http_port),
    )
    config_path = tmp_path / "ray-app.yaml"
    config_path.write_text(yaml.safe_dump(config))

    job_id = f"specdec-test-{os.getpid()}"
    # The README's command, with --no-wait so this test can talk to the app while it runs.
    out = ray_cli("job", "submit", "--address", head["address"], "--submission-id", job_id,
                  "--working-dir", ".", "--no-wait", "--",
                  "specdec", "ray-up", "--config", str(config_path), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    try:
        def serving():
            logs = job_logs(head, job_id)
            status = job_status(head, job_id)
            assert status not in ("FAILED", "STOPPED", "SUCCEEDED"), f"job {status}:\n{logs}"
            # the JSON line is printed right after "serving at": wait for it too (a log
            # snapshot taken between the two prints has only the first)
            return any(line.startswith('{"url"') for line in logs.splitlines()) and logs

        logs = wait_for(serving, 600, "specdec ray-up to serve")
        info = json.loads(next(line for line in logs.splitlines() if line.startswith('{"url"')))
        assert info["url"] == f"http://127.0.0.1:{http_port}"
        services = re.findall(r"^(draft|target) \S+ at (\S+) on node", logs, re.M)
        assert sorted(role for role, _ in services) == ["draft", "target"]

        prompt = [1, 520, 3300, 12, 99, 7]
        r = httpx.post(f"{info['url']}/generate", timeout=120,
                       json=dict(prompt_ids=prompt, max_new_tokens=24, mode="pipelined", k=3))
        assert r.status_code == 200, r.text
        ids = r.json()["token_ids"]
        assert ids == hf_greedy(tiny_models["target"], prompt, 24)[: len(ids)]
        assert len(ids) == 24 or r.json()["finish_reason"] == "stop"

        # `ray job stop` sends SIGTERM: ray-up removes the app and the service actors.
        out = ray_cli("job", "stop", "--address", head["address"], job_id, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        wait_for(lambda: job_status(head, job_id) in ("STOPPED", "SUCCEEDED", "FAILED"), 120,
                 "the job to stop")
        wait_for(lambda: not any(port_open(addr) for _, addr in services), 120,
                 "the service actors to go")
        assert "stopping specdec" in job_logs(head, job_id)
    finally:
        ray_cli("job", "stop", "--address", head["address"], job_id, timeout=120)
