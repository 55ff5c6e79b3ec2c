"""`specdec serve` heals: a killed target or draft is restarted, requests caught by a dead
target fail at once (not after a minute), /health tells the truth, killed children are reaped,
and no service or folder outlives the server, however it ends. Real processes, loopback only."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import ApiHost, ServiceThread, stop_process, wait_for_port_file

from bench.faults import gone, health, role_of, services, wait_until
from orchestrator.http_client import ServerError, SpecdecClient
from orchestrator.local import ServiceProcess, remove_stale_dirs, service_args

MODEL = "specdec"
PROMPT = "Count from one to twenty, in words, one number per line."
MAX_TOKENS = 40


@pytest.fixture
def serve(tiny_models, tmp_path):
    """`specdec serve` over the tiny pair, its services' folders in their own TMPDIR:
    (process, base URL, that TMPDIR)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    port_file, log_path = tmp_path / "port", tmp_path / "log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "serve", "--port", "0", "--port-file",
             str(port_file), "--target", tiny_models["target"], "--draft",
             tiny_models["near_draft"], "--tokenizer", "default", "--mode", "spec"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": str(tmp)})
    try:
        url = f"http://127.0.0.1:{wait_for_port_file(proc, port_file, log_path, 300)}"
        yield proc, url, tmp
    finally:
        stop_process(proc)


def test_serve_restarts_a_killed_target_and_draft_and_leaves_nothing_behind(serve):
    proc, url, tmp = serve
    pids = wait_until("both services", lambda: (lambda s: s if len(s) == 2 else None)(
        services(proc.pid)))
    with SpecdecClient(url, model=MODEL, max_retries=0) as client:
        ref = client.chat(PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        assert ref.usage.completion_tokens > 8

        # the target dies while a stream is running: the stream ends with an error event
        # at once (it waited ~60 s before), not with the end of a text
        failed = {}

        def kill_target_mid_stream():
            try:
                # (long enough that it cannot end before the kill lands, however slow the
                # reader: the kill comes at its third chunk)
                for n, _ in enumerate(client.stream_chat(PROMPT, max_tokens=300,
                                                         temperature=0, mode="target-only")):
                    if n == 2:
                        failed["killed_at"] = time.monotonic()
                        os.kill(pids["target"], signal.SIGKILL)
                failed["error"] = None
            except ServerError as exc:
                failed["error"] = exc
            failed["ended_at"] = time.monotonic()

        t = threading.Thread(target=kill_target_mid_stream)
        t.start()
        t.join(120)
        assert isinstance(failed["error"], ServerError), failed
        assert "target" in failed["error"].message
        assert failed["ended_at"] - failed["killed_at"] < 10.0  # a mutant that waits: ~60 s

        # ... the supervisor reaps it and starts another; /health is 503 until it serves
        wait_until("the dead target reaped", lambda: gone(pids["target"]))
        wait_until("the target back", lambda: health(url)[0] == 200)
        again = services(proc.pid)
        assert again["target"] != pids["target"] and again["draft"] == pids["draft"]
        assert client.chat(PROMPT, max_tokens=MAX_TOKENS, temperature=0).text == ref.text

        # the draft dies: requests go on (the target's text), and once it is back the rounds
        # draft again
        os.kill(again["draft"], signal.SIGKILL)
        r = client.chat(PROMPT, max_tokens=MAX_TOKENS, temperature=0, mode="spec", k=3)
        assert r.text == ref.text
        wait_until("the dead draft reaped", lambda: gone(again["draft"]))
        third = wait_until("a new draft", lambda: (lambda s: s if s.get("draft") not in (
            None, again["draft"]) else None)(services(proc.pid)))

        def drafted():
            r = client.chat(PROMPT, max_tokens=MAX_TOKENS, temperature=0, mode="spec", k=3)
            assert r.text == ref.text
            return r.specdec.draft_tokens > 0

        wait_until("speculation to resume", drafted, every_s=0.5)
        assert health(url) == (200, {"status": "ok"})
    assert len(os.listdir(tmp)) == 2  # the services' folders (and no others)

    stop_process(proc)  # SIGTERM: a clean shutdown
    assert proc.returncode == 0
    assert all(gone(p) for p in third.values())
    assert os.listdir(tmp) == []  # no folder outlives the server


def test_a_killed_server_leaves_no_service_and_its_folders_go_at_the_next_start(
        tiny_models, tmp_path):
    """SIGKILL of the starter: its services notice within seconds and stop; the folders it
    could not remove are removed by the next start (theirs name a process that is gone)."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    code = ("import sys, time; from orchestrator.local import ServiceProcess, service_args; "
            "p = ServiceProcess('target', service_args(sys.argv[1], 1, ['--no-calibrate'])); "
            "p.wait_port(300); print(p.proc.pid, flush=True); time.sleep(600)")
    starter = subprocess.Popen([sys.executable, "-c", code, tiny_models["target"]], env=env,
                               stdout=subprocess.PIPE, text=True)
    try:
        service = int(starter.stdout.readline())
        assert role_of(service) == "target" and len(os.listdir(tmp_path)) == 1
        starter.kill()
        starter.wait()
        wait_until("the orphaned service to stop", lambda: gone(service), timeout_s=30)
        assert len(os.listdir(tmp_path)) == 1  # left behind by the killed starter
        assert remove_stale_dirs(str(tmp_path)) == 1 and os.listdir(tmp_path) == []
    finally:
        if starter.poll() is None:
            starter.kill()


def test_a_stopped_service_removes_its_folder_and_a_restart_serves_on_its_port(tiny_models):
    p = ServiceProcess("target", service_args(tiny_models["target"], 1, ["--no-calibrate"]))
    try:
        port = p.wait_port(300)
        folder = os.path.dirname(p.port_file)
        first = p.proc.pid
        with pytest.raises(RuntimeError, match="still running"):
            p.restart()
        os.kill(first, signal.SIGKILL)
        p.proc.wait()
        p.restart()
        assert p.wait_port(300) == port and p.proc.pid != first
    finally:
        p.stop()
    assert not os.path.exists(folder)


def test_health_is_degraded_while_the_draft_is_down_and_503_while_the_target_is(tiny_models):
    target = ServiceThread("target", tiny_models["target"])
    draft = ServiceThread("draft", tiny_models["near_draft"], target=tiny_models["target"])
    h = ApiHost(target.address, draft.address)
    try:
        url = h.serve()
        assert health(url) == (200, {"status": "ok"})
        draft.stop()
        status, body = health(url)
        assert status == 200 and body["status"] == "degraded" and "draft" in body["error"]
        target.stop()
        status, body = health(url)
        assert status == 503 and body["status"] == "unavailable" and "target" in body["error"]
    finally:
        h.stop()
        if target.thread.is_alive():
            target.stop()
