"""The HTTP front over real tiny services: log-probabilities (the target's own), n > 1 choices,
prompt echo, and penalties applied alike by target and draft."""

from __future__ import annotations

import openai
import pytest
from conftest import MODEL, PROMPT, PROMPTS, chat_ids, hf_greedy, reference, run


# ---- logprobs and n > 1 ------------------------------------------------------------------

def hf_logprobs(model_dir: str, prompt_ids: list[int], token_ids: list[int]):
    """transformers' log-softmax at each generated position: [len(token_ids), vocab]."""
    import torch

    from specdec.models.hub import load_hf_model

    model, _ = load_hf_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0]
    return torch.log_softmax(logits[len(prompt_ids) - 1:-1].float(), -1)


@pytest.mark.parametrize("mode", ["pipelined", "target-only"])
def test_chat_logprobs_are_the_targets_own(api, tiny_models, tok, mode):
    """Each generated token's logprob and top alternatives equal transformers' log-softmax at
    that position, whichever pass (a verify block row or a single step) computed them."""
    client = openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0)
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=24,
        temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"specdec_mode": mode, "specdec_k": 3})
    content = resp.choices[0].logprobs.content
    prompt_ids = chat_ids(tok, PROMPT)
    _, ids = reference(tiny_models, tok, prompt_ids, 24)
    assert len(content) == len(ids) == resp.usage.completion_tokens
    ref = hf_logprobs(tiny_models["target"], prompt_ids, ids)
    for j, (entry, token_id) in enumerate(zip(content, ids)):
        assert entry.token == tok.decode([token_id])
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert abs(entry.logprob - float(ref[j, token_id])) < 1e-4, j
        top = ref[j].topk(3)
        assert [t.token for t in entry.top_logprobs] == [tok.decode([i]) for i in top.indices]
        assert all(abs(t.logprob - float(v)) < 1e-4 for t, v in zip(entry.top_logprobs,
                                                                     top.values))
        assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest token
    if mode == "pipelined":  # rows of verify blocks (accepted ones: the test below)
        assert resp.specdec["draft_tokens"] > 0


def test_verify_returns_logprobs_of_accepted_and_bonus_rows(tiny_services, tiny_models, tok):
    """A block the target accepts whole: every emitted token's logprob (block rows and the
    bonus) is transformers' at that position."""
    from orchestrator.service_clients import History, TargetClient
    from specdec.config import SamplingParams

    prompt_ids = chat_ids(tok, PROMPT)
    _, ids = reference(tiny_models, tok, prompt_ids, 8)
    ref = hf_logprobs(tiny_models["target"], prompt_ids, ids[:6])

    async def verify():
        client = TargetClient(tiny_services["target"].address)
        await client.wait_ready()
        try:
            resp, _ = await client.verify("lp-test", History(prompt_ids), ids[:5], [],
                                          SamplingParams(), logprobs=2)
            await client.close_session("lp-test")
            return resp
        finally:
            await client.close()

    resp = run(verify())
    assert resp.num_accepted == 5 and resp.next_token == ids[5]
    assert len(resp.logprobs) == 6
    for j, entry in enumerate(resp.logprobs):
        assert abs(entry.logprob - float(ref[j, ids[j]])) < 1e-4, j
        assert list(entry.top_ids) == ref[j].topk(2).indices.tolist()


def test_completion_logprobs_stream_as_they_come_and_match_the_whole(api):
    client = openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0)
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0.9, seed=3,
              logprobs=2)
    whole = client.completions.create(**kw).choices[0]
    lp = whole.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) > 0
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert all(x <= 0.0 for x in lp.token_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    text = ""
    for c in client.completions.create(stream=True, **kw):
        if c.choices and c.choices[0].logprobs:
            for key in streamed:
                streamed[key] += getattr(c.choices[0].logprobs, key)
        if c.choices:
            text += c.choices[0].text
    assert text == whole.text  # seeded, coupled rule: the same sample
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    assert streamed["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=1e-4)
    no_lp = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4)
    assert no_lp.choices[0].logprobs is None


def test_n_choices_are_independent_seeded_generations(api):
    """n > 1: choice i is the generation with seed + i (run concurrently); usage counts all."""
    client = openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": PROMPT}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=16, temperature=1.0)
    resp = client.chat.completions.create(n=3, seed=40, **kw)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    singles = [client.chat.completions.create(seed=40 + i, **kw) for i in range(3)]
    assert [c.message.content for c in resp.choices] == \
        [s.choices[0].message.content for s in singles]
    assert len({c.message.content for c in resp.choices}) > 1
    assert resp.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert resp.usage.prompt_tokens == singles[0].usage.prompt_tokens
    texts = {0: "", 1: "", 2: ""}
    finished = set()
    for c in client.chat.completions.create(n=3, seed=40, stream=True, **kw):
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2}
    assert [texts[i] for i in range(3)] == [c.message.content for c in resp.choices]


@pytest.mark.parametrize("words", [6, 320])  # 320 words: a prompt over several prefill chunks
def test_echo_scores_the_prompt_as_transformers_does(api, tiny_models, tok, words):
    """echo + logprobs (how lm-eval scores a continuation): the prompt's text and each prompt
    token's logprob given the ones before it (the first has none), then the completion."""
    client = openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0)
    prompt = " ".join(["the quick brown fox jumps over a lazy dog"] * 40).split()[:words]
    prompt = " ".join(prompt)
    ids = tok(prompt)["input_ids"]
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                     logprobs=1, echo=True)
    choice = resp.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None
    ref = hf_logprobs(tiny_models["target"], ids[:1], ids[1:])  # rows predicting ids[1:]
    for j, token_id in enumerate(ids[1:]):
        assert abs(lp.token_logprobs[j + 1] - float(ref[j, token_id])) < 1e-4, j
    _, greedy = reference(tiny_models, tok, ids, 1)
    assert lp.tokens[-1] == tok.decode(greedy)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                      echo=True)
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None


def hf_penalized_greedy(model_dir: str, prompt_ids: list[int], n: int, presence: float,
                        frequency: float, repetition: float, eos: int) -> list[int]:
    """Greedy decoding with the penalties computed independently: transformers' own
    RepetitionPenaltyLogitsProcessor, then OpenAI's presence / frequency formula."""
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    from specdec.models.hub import load_hf_model

    model, _ = load_hf_model(model_dir)
    rep = RepetitionPenaltyLogitsProcessor(repetition)
    ids, out = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(n):
            scores = model(torch.tensor([ids])).logits[:, -1].float()
            scores = rep(torch.tensor([ids]), scores)[0]
            for t in set(out):
                scores[t] -= presence + frequency * out.count(t)
            token = int(scores.argmax())
            out.append(token)
            ids.append(token)
            if token == eos:
                break
    return out


@pytest.mark.parametrize("penalties", [dict(presence_penalty=1.5),
                                       dict(frequency_penalty=2.0),
                                       dict(repetition_penalty=1.6),
                                       dict(presence_penalty=-0.5, frequency_penalty=0.4,
                                            repetition_penalty=1.2)])
def test_penalties_apply_to_target_and_draft_alike_and_keep_greedy_exact(api, tiny_models, tok,
                                                                         penalties):
    client = openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0)
    ids = tok(PROMPTS[1])["input_ids"]
    ref = hf_penalized_greedy(tiny_models["target"], ids, 32,
                              penalties.get("presence_penalty", 0.0),
                              penalties.get("frequency_penalty", 0.0),
                              penalties.get("repetition_penalty", 1.0), tok.eos_token_id)
    plain = hf_greedy(tiny_models["target"], ids, 32)
    assert ref != plain  # the penalties change this text: the comparison below can fail
    for mode in ("target-only", "spec", "pipelined"):
        extra = {"specdec_mode": mode, "specdec_k": 3}
        if "repetition_penalty" in penalties:
            extra["repetition_penalty"] = penalties["repetition_penalty"]
        kw = {k: v for k, v in penalties.items() if k != "repetition_penalty"}
        resp = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=32,
                                         temperature=0, extra_body=extra, **kw)
        assert resp.choices[0].text == tok.decode(ref, skip_special_tokens=True), mode
    # sampled with the coupled rule: the same text in every mode
    texts = {client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=1.0, seed=5,
        frequency_penalty=1.0, extra_body={"specdec_mode": mode, "specdec_k": 3}
    ).choices[0].text for mode in ("target-only", "spec", "pipelined")}
    assert len(texts) == 1


def test_a_block_is_penalized_row_by_row_as_single_steps_would_be(tiny_services, tiny_models,
                                                                   tok):
    """Row i of a verify block sees the block's first i tokens as output: a block of the
    penalized greedy tokens is accepted whole (here the text repeats a token of the block's
    second position at its fifth, which only the block's own rows can penalize)."""
    from orchestrator.service_clients import History, TargetClient
    from specdec.config import SamplingParams

    ids = tok(PROMPTS[1])["input_ids"]
    ref = hf_penalized_greedy(tiny_models["target"], ids, 14, 0.0, 2.0, 1.6, -1)
    assert hf_greedy(tiny_models["target"], ids, 13)[12] == ref[9] != ref[12]
    params = SamplingParams(frequency_penalty=2.0, repetition_penalty=1.6, prompt_len=len(ids))

    async def verify():
        client = TargetClient(tiny_services["target"].address)
        await client.wait_ready()
        try:
            resp, _ = await client.verify("pen-test", History(ids + ref[:8]), ref[8:13], [],
                                          params)
            await client.close_session("pen-test")
            return resp
        finally:
            await client.close()

    resp = run(verify())
    assert (resp.num_accepted, resp.next_token) == (5, ref[13])
