"""The HTTP front's request bodies (strict: "5" is not an integer, as in OpenAI's API) and
the server's defaults for what a request leaves out.

One request model for every route: the OpenAI bodies and the native ``/generate`` body (the
Ray front's) share ``GenerationBody``, so both are validated and defaulted by one builder
(orchestrator.http.requests).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from orchestrator.generation import DEFAULT_MODE, GenerationRequest
from specdec.config import DEFAULT_RULE, SamplingParams

MAX_N = 16  # choices per request (each is a generation of its own, run concurrently)


@dataclasses.dataclass
class ServeDefaults:
    """Generation settings for what a request leaves out (``specdec serve``'s flags)."""

    max_tokens: int = 128
    temperature: float = 0.0  # greedy unless the request asks otherwise
    top_p: float = 1.0
    top_k: int = 0
    rule: str = DEFAULT_RULE  # acceptance rule of sampled requests (SamplingParams.rule)
    mode: str = DEFAULT_MODE
    k: int | None = None  # None = adaptive
    stop: list[str] = dataclasses.field(default_factory=list)
    prompt_lookup: bool = True  # see GenerationRequest.prompt_lookup
    # Larger bodies get 413 before they are read whole or parsed: 2 MiB holds a 128k-token
    # prompt of ordinary text, and parsing or tokenizing megabytes would hold the server up.
    max_body_bytes: int = 2 * 1024 * 1024
    # A body not all in this long after its request's headers gets 408: the bodies OpenAI
    # clients send are a few KB, and even a 2 MiB one needs only ~70 KB/s.
    body_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        # Refuse bad defaults once, at start, rather than on every request.
        sampling = SamplingParams(self.temperature, self.top_k, self.top_p, rule=self.rule)
        GenerationRequest([0], self.max_tokens, sampling, self.stop, self.mode, self.k)
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s}")


class _Body(BaseModel):
    # OpenAI clients send fields we do not use (user, metadata...): ignore them.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


def _invalid_text(value: Any) -> str | None:
    """The path of the first string in parsed JSON that is not valid Unicode, or None.

    JSON's escapes can spell lone surrogates ("\\ud800"): Python parses them into strings that
    no tokenizer and no UTF-8 response can take. Iterative: bodies may nest deeply.
    """
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                stack.append((f"{path}.{key}" if path else str(key), child))
                stack.append((path or "body", key))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child) for i, child in reversed(list(enumerate(item))))
    return None


class GenerationBody(_Body):
    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        path = _invalid_text(data)
        if path:
            raise PydanticCustomError(
                "invalid_unicode", "{path}: not valid Unicode text (a lone surrogate escape "
                "such as \\ud800 encodes no character)",
                {"path": path, "param": path.split(".")[0].split("[")[0]})
        return data

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # not OpenAI's; as in vLLM (-1 or 0 = no limit)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # not OpenAI's; as in vLLM (1 = none)
    logit_bias: dict[str, Any] | None = None
    # specdec's own extras: how to speculate for this request
    specdec_mode: str | None = None
    specdec_k: int | None = None
    specdec_rule: str | None = None  # coupled | rejection (see SamplingParams.rule)


class CompletionBody(GenerationBody):
    # A batch of one ([text] or [[ids]], as lm-eval's local-completions sends) is one prompt.
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatBody(GenerationBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # accepted; a response holds at most one call
    response_format: dict[str, Any] | None = None


class GenerateBody(GenerationBody):
    """POST /generate, specdec's native request: the same fields as the OpenAI bodies (so the
    same validation and defaults), spelled as specdec's CLI spells them, and token ids or text
    (``chat`` applies the chat template to ``prompt``)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    # the OpenAI name of a field -> its name here (errors say what the client sent)
    SPELLING: ClassVar[dict[str, str]] = {"max_tokens": "max_new_tokens", "specdec_mode": "mode",
                                          "specdec_k": "k", "specdec_rule": "rule"}

    model: str | None = None
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    chat: bool = False
    max_tokens: int | None = Field(None, validation_alias=AliasChoices("max_new_tokens",
                                                                       "max_tokens"))
    stop: list[str] | None = None
    specdec_mode: str | None = Field(None, validation_alias=AliasChoices("mode", "specdec_mode"))
    specdec_k: int | None = Field(None, validation_alias=AliasChoices("k", "specdec_k"))
    specdec_rule: str | None = Field(None, validation_alias=AliasChoices("rule", "specdec_rule"))
    session: str | None = None  # routing key: equal keys go to one pair under ``hash`` routing
