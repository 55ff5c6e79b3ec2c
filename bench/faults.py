"""Faults against `specdec serve`, timed: its target and then its draft killed (SIGKILL) while a
stream runs, on loopback. Prints how soon the caught stream failed, how soon /health and
requests were back, how soon speculation resumed, and what was left behind (zombies, folders).

    python -m bench.faults                      # the default pair
    python -m bench.faults --target T --draft D --tokenizer default --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from orchestrator.http_client import ServerError, SpecdecClient

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def role_of(pid: int) -> str | None:
    """"target" or "draft" for a specdec service process, else None."""
    try:
        cmd = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    for role in ("target", "draft"):
        if f"{role}_service".encode() in cmd:
            return role
    return None


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, state) of the processes whose parent is ``pid`` (Linux /proc; Z = zombie)."""
    out = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append((int(stat.parent.name), fields[0]))
    return out


def services(serve_pid: int) -> dict[str, int]:
    """The live services a server started, by role."""
    return {role_of(p): p for p, state in children(serve_pid) if state != "Z" and role_of(p)}


def gone(pid: int) -> bool:
    """No such process, not even a zombie waiting to be reaped."""
    return not pathlib.Path(f"/proc/{pid}").exists()


def wait_until(what: str, check, timeout_s: float = 300.0, every_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(every_s)


def health(url: str) -> tuple[int, dict]:
    try:
        r = httpx.get(url + "/health", timeout=10)
    except httpx.HTTPError:
        return 0, {}
    return r.status_code, r.json()


def kill_mid_stream(client: SpecdecClient, pid: int, max_tokens: int, **options) -> dict:
    """Stream an answer and SIGKILL ``pid`` after its third chunk: the text streamed, the
    error it ended with (None: it finished), and the seconds from the kill to its end."""
    text, error, killed_at = [], None, None
    try:
        for n, chunk in enumerate(client.stream_chat(PROMPT, max_tokens=max_tokens,
                                                     temperature=0, **options)):
            text.append(chunk.text)
            if n == 2:
                killed_at = time.monotonic()
                os.kill(pid, signal.SIGKILL)
    except ServerError as exc:
        error = exc.message
    return {"text": "".join(text), "error": error, "ended_s": time.monotonic() - killed_at,
            "killed_at": killed_at}


def run(args) -> dict:
    tmp = tempfile.mkdtemp(prefix="bench-faults-")
    port_file, log_path = os.path.join(tmp, "port"), os.path.join(tmp, "serve.log")
    folders = os.path.join(tmp, "tmp")
    os.mkdir(folders)
    cmd = [sys.executable, "-m", "orchestrator.cli", "serve", "--port", "0", "--port-file",
           port_file, "--target", args.target, "--draft", args.draft]
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "TMPDIR": folders})
    report: dict = {"log": log_path}
    try:
        wait_until("specdec serve", lambda: os.path.exists(port_file) or proc.poll() is not None,
                   timeout_s=900)
        url = f"http://127.0.0.1:{pathlib.Path(port_file).read_text()}"
        pids = wait_until("both services", lambda: (lambda s: s if len(s) == 2 else None)(
            services(proc.pid)))
        with SpecdecClient(url, max_retries=0, timeout=600) as client:
            started = time.monotonic()
            ref = client.chat(PROMPT, max_tokens=args.max_tokens, temperature=0)
            report["unloaded_tokens_per_s"] = ref.usage.completion_tokens / (
                time.monotonic() - started)

            # the target
            caught = kill_mid_stream(client, pids["target"], args.max_tokens,
                                     mode="target-only")
            t0 = caught["killed_at"]
            wait_until("the dead target reaped", lambda: gone(pids["target"]))
            reaped = time.monotonic() - t0
            wait_until("/health 200", lambda: health(url)[0] == 200)
            healthy = time.monotonic() - t0
            after = client.chat(PROMPT, max_tokens=args.max_tokens, temperature=0)
            report["target"] = {
                "stream_failed_after_s": round(caught["ended_s"], 2),
                "stream_error": caught["error"], "reaped_after_s": round(reaped, 2),
                "health_ok_after_s": round(healthy, 2),
                "first_answer_after_s": round(time.monotonic() - t0, 2),
                "answer_identical": after.text == ref.text}

            # the draft
            pids = services(proc.pid)
            caught = kill_mid_stream(client, pids["draft"], args.max_tokens, mode="spec")
            t0 = caught["killed_at"]
            wait_until("the dead draft reaped", lambda: gone(pids["draft"]))
            reaped = time.monotonic() - t0
            drafted = wait_until("speculation to resume", lambda: client.chat(
                PROMPT, max_tokens=8, temperature=0, mode="spec", k=3).specdec.draft_tokens > 0,
                every_s=0.2)
            report["draft"] = {
                "stream_error": caught["error"],
                "stream_identical": caught["text"] == ref.text,
                "reaped_after_s": round(reaped, 2),
                "drafting_again_after_s": round(time.monotonic() - t0, 2) if drafted else None}
            report["zombies"] = sum(state == "Z" for _, state in children(proc.pid))
        proc.send_signal(signal.SIGTERM)
        report["serve_exit_code"] = proc.wait(120)
        report["services_left"] = sum(not gone(p) for p in services(proc.pid).values())
        report["folders_left"] = os.listdir(folders)
        restarts = [line for line in pathlib.Path(log_path).read_text().splitlines()
                    if "is back on port" in line or "died" in line]
        report["supervisor_log"] = restarts
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="default")
    p.add_argument("--draft", default="default-draft")
    p.add_argument("--tokenizer")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", help="write the report here too")
    args = p.parse_args(argv)
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        pathlib.Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
