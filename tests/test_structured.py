"""Structured output under speculation (tiny random-weight models): the grammar's state per
block row and its rollback, text identical across modes and drafts, a session rebuilt from its
history, and the HTTP front's response_format / tools / logit_bias."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import xgrammar as xgr

from conftest import MODEL, TOKEN_PROMPTS, ApiHost, generate_on, run
from specdec.config import SamplingParams
from specdec.models.hub import load_tokenizer
from specdec.serving.grammar import Grammars, block_masks

# Bounded strings and numbers: a random model finishes the object within max_new tokens.
SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"],
     "additionalProperties": False},
    {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}},
     "required": ["color", "tags"], "additionalProperties": False},
]
MODES = [(None, "target-only"), ("near_draft", "spec"), ("near_draft", "pipelined"),
         ("self_draft", "spec"), ("self_draft", "pipelined"), ("draft", "spec"),
         ("ngram", "spec")]


def grammar_of(schema: dict) -> str:
    return str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))


@pytest.fixture(scope="module")
def grammars():
    tokenizer = load_tokenizer("default")
    return Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id]), tokenizer


def test_block_rows_masked_by_the_state_after_the_drafts_before_them(grammars):
    """Row j of a block is the mask after d_1..d_j, as a matcher stepped token by token gives
    it; rows after a refused draft token stay all-allowed (never read)."""
    g, tokenizer = grammars
    text = '{"name": "Al", "age": 7, "ok": true}'
    ids = tokenizer(text)["input_ids"]
    grammar = grammar_of(SCHEMAS[0])
    state = g.state(grammar, prompt_len=2)
    masks = block_masks(state, [9, 9] + ids[:2], ids[2:6])
    stepwise = g.state(grammar, prompt_len=0)
    for tok in ids[:2]:
        assert stepwise.accept(tok)
    for j in range(5):
        assert bool((masks[j] == stepwise.allowed()).all()), j
        if j < 4:
            assert stepwise.accept(ids[2 + j])
    # a refused draft token: its row refuses it, the rows after it are all-allowed
    bad = tokenizer("x")["input_ids"][0]
    masks = block_masks(state, [9, 9] + ids[:2], [ids[2], bad, ids[4]])
    assert not masks[1, bad] and bool(masks[2].all()) and bool(masks[3].all())


def test_sync_rolls_back_rejected_drafts(grammars):
    """After a verdict the matcher holds what target-only decoding would: the rejected draft
    tokens are rolled back (a matcher that kept them refuses the target's token)."""
    g, tokenizer = grammars
    ids = tokenizer('{"name": "Bob", "age": 1, "ok": false}')["input_ids"]
    state = g.state(grammar_of(SCHEMAS[0]), prompt_len=0)
    block_masks(state, ids[:3], ids[3:7])  # 4 draft tokens accepted into the matcher
    state.sync(ids[:4])  # the verdict kept one of them
    fresh = g.state(grammar_of(SCHEMAS[0]), prompt_len=0)
    fresh.sync(ids[:4])
    assert state.output == ids[:4]
    assert bool((state.allowed() == fresh.allowed()).all())
    state.sync(ids)  # and it goes on to the end
    assert state.matcher.is_completed()


@pytest.mark.parametrize("sampling", [
    SamplingParams(), SamplingParams(temperature=1.0, seed=11),
    SamplingParams(temperature=0.8, top_k=40, seed=5, logit_bias=((520, 3.0), (7, -5.0)))],
    ids=["greedy", "coupled", "coupled-topk-bias"])
@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "enum-array"])
def test_constrained_text_identical_in_every_mode(tiny_services, schema, sampling):
    """Greedy and coupled sampling under a grammar: the same tokens target-only, spec and
    pipelined (the speculation cache included), with drafts that agree always, often, rarely
    and by n-gram; the output validates."""
    prompt = TOKEN_PROMPTS[0]
    sampling = sampling.replace(grammar=grammar_of(schema), prompt_len=len(prompt))
    texts = {}
    for draft, mode in MODES:
        result = run(generate_on(tiny_services, draft, prompt, mode, None, 80, sampling))
        texts[(draft, mode)] = result.token_ids
        assert result.finish_reason == "stop", (draft, mode, result.text)
        jsonschema.validate(json.loads(result.text), schema)
        if draft == "self_draft" and sampling.greedy:  # it proposes the target's masked argmax
            assert result.summary()["acceptance_rate"] == 1.0
    base = texts[(None, "target-only")]
    assert all(t == base for t in texts.values()), texts


def test_session_rebuilt_from_history_after_loss(tiny_services):
    """A target and a draft that lose every session mid-generation (as a restart does) rebuild
    their matchers from the re-sent history: the text is unchanged."""
    prompt = TOKEN_PROMPTS[1]
    sampling = SamplingParams(grammar=grammar_of(SCHEMAS[0]), prompt_len=len(prompt))
    want = run(generate_on(tiny_services, None, prompt, "target-only", None, 80, sampling))

    async def lose_sessions(n):
        if n in (2, 4):
            for key in ("target", "near_draft"):
                store = tiny_services[key].runtime.store
                for sid in store.ids():
                    store.close(sid)

    got = run(generate_on(tiny_services, "near_draft", prompt, "spec", 3, 80, sampling,
                          hook=lose_sessions))
    assert got.token_ids == want.token_ids
    assert got.stats.re_prefills >= 1


@pytest.fixture(scope="module")
def api(tiny_services):
    host = ApiHost(tiny_services["target"].address, tiny_services["near_draft"].address)
    url = host.serve()
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    host.stop()


MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 9},
            "b": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a", "b"]}}}]


def test_json_schema_and_json_object_over_http(api):
    schema = SCHEMAS[1]
    outs = set()
    for mode in ("target-only", "spec", "pipelined"):
        r = api.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=80, extra_body={"specdec_mode": mode},
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": schema, "strict": True}})
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        outs.add(r.choices[0].message.content)
    assert len(outs) == 1
    r = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                    response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")  # (a random model seldom closes it)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_call(api, choice, stream):
    """tool_choice required / a named function: tool_calls in OpenAI's shape whose arguments
    validate against the function's parameters."""
    tool_choice = "required" if choice == "required" else \
        {"type": "function", "function": {"name": "add"}}
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=80, tools=TOOLS,
              tool_choice=tool_choice)
    if stream:
        calls, finish = {}, None
        for chunk in api.chat.completions.create(stream=True, **kw):
            c = chunk.choices[0]
            assert not c.delta.content
            for tc in c.delta.tool_calls or []:
                calls[tc.index] = tc
            finish = c.finish_reason or finish
        calls = list(calls.values())
    else:
        r = api.chat.completions.create(**kw)
        message, finish = r.choices[0].message, r.choices[0].finish_reason
        assert message.content is None
        calls = message.tool_calls
    assert finish == "tool_calls" and len(calls) == 1
    fn = calls[0].function
    assert calls[0].id.startswith("call_") and calls[0].type == "function"
    if choice == "named":
        assert fn.name == "add"
    params = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == fn.name)
    jsonschema.validate(json.loads(fn.arguments), params)


def test_tool_choice_auto_and_none(api):
    """auto: text, or a call after <tool_call> (whichever the model writes, the response is
    well-formed); none: plain text, no tool_calls."""
    r = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, tools=TOOLS)
    m = r.choices[0].message
    assert (m.tool_calls is None) == (r.choices[0].finish_reason != "tool_calls")
    r = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, tools=TOOLS,
                                    tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_logit_bias(api):
    """+100 on a token makes greedy decoding emit it, in every mode; -100 keeps it out."""
    for mode in ("target-only", "spec", "pipelined"):
        text = api.completions.create(model=MODEL, prompt=TOKEN_PROMPTS[0], max_tokens=5,
                                      logit_bias={"520": 100},
                                      extra_body={"specdec_mode": mode}).choices[0].text
        assert text == load_tokenizer("default").decode([520] * 5)
        text = api.completions.create(model=MODEL, prompt=TOKEN_PROMPTS[0], max_tokens=5,
                                      logit_bias={"520": -100},
                                      extra_body={"specdec_mode": mode}).choices[0].text
        assert load_tokenizer("default").decode([520]) not in text
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        api.completions.create(model=MODEL, prompt="hi", max_tokens=2, logit_bias={"1": 101})


@pytest.mark.parametrize("response_format, needle", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "(?<=a)b"}}}, "Lookbehind"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}},
     "properties.a.not"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}},
     "strnig"),
    ({"type": "xml"}, "response_format.type"),
])
def test_unsupported_schema_is_400_and_the_server_keeps_serving(api, response_format, needle):
    with pytest.raises(openai.BadRequestError, match=needle):
        api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                    response_format=response_format)
    r = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert r.choices[0].message.content
