"""Structured output through the `openai` package against `specdec serve` on the real default
pair: pydantic models parsed, JSON objects, forced tool calls, the same text in every mode."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from typing import Annotated

from pydantic import BaseModel, Field

from conftest import KEY

pytestmark = pytest.mark.real
MODEL = "specdec"  # specdec serve's default --model-name


# Bounded fields (maxLength, maximum, maxItems), as a user of a small model writes them: the
# 135M target, left unbounded, repeats digits or words on until max_tokens (measured:
# "population_millions": 31232323...), which the grammar allows; bounds end every field.
Short = Annotated[str, Field(max_length=40)]


class City(BaseModel):
    name: Short
    country: Short
    population_millions: Annotated[float, Field(ge=0, le=100)]


class Person(BaseModel):
    first_name: Short
    last_name: Short
    age: Annotated[int, Field(ge=0, le=120)]
    hobbies: Annotated[list[Short], Field(max_length=3)]


class Step(BaseModel):
    explanation: Annotated[str, Field(max_length=80)]
    output: Short


class Solution(BaseModel):  # nested models: $defs and $ref in the schema
    steps: Annotated[list[Step], Field(max_length=4)]
    final_answer: Short


CASES = [(City, "Give me facts about Paris as JSON."),
         (Person, "Invent a person with two hobbies, as JSON."),
         (Solution, "Solve 2 + 3 * 4 step by step, as JSON.")]


@pytest.fixture(scope="module")
def client(serve_with_key):
    _, url, _ = serve_with_key
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)


def ask(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


@pytest.mark.parametrize("model, prompt", CASES, ids=[c[0].__name__ for c in CASES])
def test_parse_returns_valid_instances(client, model, prompt):
    r = client.beta.chat.completions.parse(model=MODEL, messages=ask(prompt),
                                           response_format=model, max_tokens=400)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, model)


def test_json_object_is_valid_json(client):
    r = client.chat.completions.create(model=MODEL,
                                       messages=ask("Give me facts about Paris as JSON."),
                                       response_format={"type": "json_object"}, max_tokens=200)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_call_validates(client, stream):
    kw = dict(model=MODEL, messages=ask("What is the weather in Tokyo in celsius?"),
              tools=[WEATHER], tool_choice={"type": "function",
                                            "function": {"name": "get_weather"}},
              max_tokens=60)
    if stream:
        calls = [tc for chunk in client.chat.completions.create(stream=True, **kw)
                 for tc in (chunk.choices[0].delta.tool_calls or [])]
    else:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls"
        calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments),
                        WEATHER["function"]["parameters"])


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 7}],
                         ids=["greedy", "seeded"])
def test_constrained_text_identical_in_every_mode(client, sampling):
    """The same text in every mode, finished or cut at max_tokens (create, not parse: a cut
    output is no error here)."""
    fmt = {"type": "json_schema", "json_schema": {
        "name": "Person", "schema": Person.model_json_schema(), "strict": True}}
    texts = set()
    for mode in ("target-only", "spec", "pipelined"):
        r = client.chat.completions.create(
            model=MODEL, messages=ask(CASES[1][1]), response_format=fmt, max_tokens=60,
            extra_body={"specdec_mode": mode}, **sampling)
        texts.add(r.choices[0].message.content)
    assert len(texts) == 1, texts


def test_unsupported_schema_is_400_and_serving_goes_on(client):
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        client.chat.completions.create(
            model=MODEL, messages=ask("hi"), max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "array", "items": {"type": "string"}, "uniqueItems": True}}})
    r = client.chat.completions.create(model=MODEL, messages=ask("Say hi."), max_tokens=4)
    assert r.choices[0].message.content
