"""``specdec serve`` on the real default pair (it starts the services itself), through the real
openai package: the README's "done when"."""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest
from conftest import CHAT_PROMPTS, KEY, child_pids, hf_greedy, scrape

pytestmark = pytest.mark.real

MAX_NEW = 32
def test_openai_streams_the_target_only_greedy_answer(serve_with_key):
    from specdec.models.hub import load_tokenizer
    from specdec.models.tokenizer import encode_prompt

    _, url, _ = serve_with_key
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


def test_concurrent_requests_on_shared_cores_are_crowded_and_stay_the_targets(serve_with_key):
    """`specdec serve` started both services on this machine: while two generations run
    together they leave the draft idle (crowded rounds; the target batches them), and each
    answer is still the target's own."""
    import concurrent.futures

    from specdec.models.hub import load_tokenizer
    from specdec.models.tokenizer import encode_prompt

    _, url, _ = serve_with_key
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY)
    tok = load_tokenizer("default")
    prompts = CHAT_PROMPTS[:2]

    def ask(prompt):
        return client.chat.completions.create(
            model="specdec", messages=[{"role": "user", "content": prompt}],
            max_tokens=MAX_NEW, temperature=0)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(ask, prompts))
    for prompt, answer in zip(prompts, answers):
        ref = hf_greedy("default", encode_prompt(tok, prompt, None), MAX_NEW)
        assert answer.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)
    crowded = [a.model_extra["specdec"]["crowded_rounds"] for a in answers]
    assert sum(crowded) > 0, crowded
    # alone again, no round is crowded (whether it drafts is adaptive k's choice: on shared
    # cores a lone generation starts from the acceptance its predecessors saw)
    alone = ask(prompts[0]).model_extra["specdec"]
    assert alone["crowded_rounds"] == 0 and alone["rounds"] > 0


def test_metrics_show_the_acceptance_counters_and_the_log_has_the_request(serve_with_key):
    _, url, log_path = serve_with_key
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY)
    before = scrape(url, headers={"Authorization": f"Bearer {KEY}"})
    r = client.chat.completions.create(
        model="specdec", messages=[{"role": "user", "content": CHAT_PROMPTS[1]}],
        max_tokens=MAX_NEW, temperature=0, extra_body={"specdec_k": 4},
        extra_headers={"X-Request-Id": "real-metrics-1"})
    spec = r.model_extra["specdec"]
    after = scrape(url, headers={"Authorization": f"Bearer {KEY}"})

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


def test_a_prompt_near_the_context_completes_beside_a_small_request(serve_with_key):
    """An 8,000-token prompt (the context is 8,192) completes, however long its prefill
    takes (a verify call's deadline grows with the tokens it carries; a flat 30 s one failed
    it with 503), while a small request sent alongside is answered with the target's text;
    one over the context is refused with 400 saying so. (How fast the small one goes meanwhile
    is `python -m bench.long_prompt`'s to measure, and the scheduler's tests assert the chunk
    sizes that keep it going.)"""
    import concurrent.futures

    from specdec.models.hub import load_tokenizer
    from specdec.models.tokenizer import encode_prompt

    _, url, _ = serve_with_key
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=900)
    long_prompt = [100 + (i % 5000) for i in range(8000)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long = pool.submit(client.completions.create, model="specdec", prompt=long_prompt,
                           max_tokens=1, temperature=0)
        time.sleep(1.0)  # the long prompt is prefilling
        small = client.chat.completions.create(
            model="specdec", messages=[{"role": "user", "content": CHAT_PROMPTS[2]}],
            max_tokens=MAX_NEW, temperature=0)
        done = long.result()
    assert done.usage.prompt_tokens == 8000 and done.usage.completion_tokens == 1
    tok = load_tokenizer("default")
    ref = hf_greedy("default", encode_prompt(tok, CHAT_PROMPTS[2], None), MAX_NEW)
    assert small.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="specdec", prompt=long_prompt + long_prompt[:200],
                                  max_tokens=1)
    assert "context" in str(err.value)


def test_sigterm_stops_the_server_and_its_services(serve_with_key):
    proc, url, _ = serve_with_key
    children = child_pids(proc.pid)
    assert len(children) == 2  # the target and draft services it started
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") for pid in children):
        assert time.monotonic() < deadline, "services left running"
        time.sleep(0.2)
