"""``specdec serve`` on the real default pair (it starts the services itself), through the real
openai package: the README's "done when"."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import CHAT_PROMPTS, hf_greedy

pytestmark = pytest.mark.real

MAX_NEW = 32
KEY = "sekret"


def _children(pid: int) -> set[int]:
    """Process ids whose parent is ``pid`` (Linux /proc)."""
    out = set()
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.add(int(stat.parent.name))
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    port_file, log_path = d / "port", d / "log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "serve", "--port", "0", "--port-file",
             str(port_file), "--api-key", KEY], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 900
        while not port_file.exists():
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "specdec serve did not start"
            time.sleep(0.5)
        url = f"http://127.0.0.1:{port_file.read_text()}"
        yield proc, url, log_path
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _scrape(url: str) -> dict:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))):
            s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_openai_streams_the_target_only_greedy_answer(server):
    from orchestrator.cli import encode_prompt
    from specdec.models import load_tokenizer

    _, url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY)
    tok = load_tokenizer("default")
    prompt = CHAT_PROMPTS[0]
    stream = client.chat.completions.create(
        model="specdec", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_NEW,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ref = hf_greedy("default", encode_prompt(tok, prompt, None), MAX_NEW)
    assert text == tok.decode(ref, skip_special_tokens=True)
    assert chunks[-1].usage.completion_tokens == len(ref)
    spec = next(c.model_extra["specdec"] for c in chunks if c.choices and
                c.choices[0].finish_reason)
    # `specdec serve` started both services on this machine: --mode auto runs sequential
    # rounds (they share the cores); pipelined is asked for per request below
    assert spec["mode"] == "spec" and spec["rounds"] > 0
    piped = client.chat.completions.create(
        model="specdec", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_NEW,
        temperature=0, extra_body={"specdec_mode": "pipelined"})
    assert piped.choices[0].message.content == text
    assert piped.model_extra["specdec"]["mode"] == "pipelined"
    # the same through target-only (no draft at all)
    plain = client.chat.completions.create(
        model="specdec", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_NEW,
        temperature=0, extra_body={"specdec_mode": "target-only"})
    assert plain.choices[0].message.content == text
    assert plain.model_extra["specdec"]["draft_tokens"] == 0


def test_metrics_show_the_acceptance_counters_and_the_log_has_the_request(server):
    _, url, log_path = server
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY)
    before = _scrape(url)
    r = client.chat.completions.create(
        model="specdec", messages=[{"role": "user", "content": CHAT_PROMPTS[1]}],
        max_tokens=MAX_NEW, temperature=0, extra_body={"specdec_k": 4},
        extra_headers={"X-Request-Id": "real-metrics-1"})
    spec = r.model_extra["specdec"]
    after = _scrape(url)

    def d(name, **labels):
        key = ("specdec:" + name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] > 0
    assert d("spec_decode_num_draft_tokens_total") == spec["draft_tokens"]
    assert d("spec_decode_num_accepted_tokens_total") == spec["accepted_tokens"]
    assert d("spec_decode_num_drafts_total") == spec["num_drafts"]
    assert d("spec_decode_num_accepted_tokens_per_pos_total", position="0") == \
        spec["accepted_per_position"][0]
    assert d("generation_tokens_total") == r.usage.completion_tokens
    assert after[("specdec:service_up", (("service", "target"),))] == 1
    assert after[("specdec:service_up", (("service", "draft"),))] == 1
    line = next(x for x in log_path.read_text().splitlines() if "id=real-metrics-1" in x)
    assert f"completion_tokens={r.usage.completion_tokens}" in line
    assert f"accepted_tokens={spec['accepted_tokens']}" in line and "ttft_s=" in line


def test_sigterm_stops_the_server_and_its_services(server):
    proc, url, _ = server
    children = _children(proc.pid)
    assert len(children) == 2  # the target and draft services it started
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") for pid in children):
        assert time.monotonic() < deadline, "services left running"
        time.sleep(0.2)
