"""Turning a request body into GenerationRequests: prompt encoding, validation, defaults.

Every route builds its requests here (the OpenAI completions and chat routes, the native
``/generate``), so a field means the same and is refused with the same message everywhere.
"""

from __future__ import annotations

import dataclasses
import math
import secrets

from orchestrator.generation import MODES, GenerationRequest
from orchestrator.http.errors import invalid
from orchestrator.http.schemas import MAX_N, ChatBody, CompletionBody, GenerateBody, ServeDefaults
from orchestrator.http.structured import Structure, structure_of, tool_call_text
from specdec.config import MAX_TOP_LOGPROBS, SamplingParams
from specdec.models.tokenizer import chat_prompt_ids, encode_prompt
from specdec.serving.grammar import GrammarError, Grammars


def request_seed(seed: int | None) -> int:
    """A request's seed: its own, or a fresh one so that repeated sampled requests differ (as
    with OpenAI). Every front (the OpenAI routes, the Ray app's /generate) uses this."""
    return secrets.randbits(63) if seed is None else seed


class RequestBuilder:
    """Builds the GenerationRequests of a body for one backend (its tokenizer and context)."""

    def __init__(self, backend, model_name: str, defaults: ServeDefaults):
        self.backend = backend
        self.model_name = model_name
        self.defaults = defaults
        # the backend's compiler (an Orchestrator has one), else one of our own
        self.grammars = getattr(backend, "grammars", None) or Grammars(
            backend.tokenizer, None, sorted(getattr(backend, "eos_ids", ())))

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise invalid(f"model {model!r} is not served here; this server serves "
                           f"{self.model_name!r}", "model", "model_not_found")

    @staticmethod
    def one_prompt(body: CompletionBody) -> str | list[int]:
        """The request's prompt: text or token ids, sent alone or as a batch of one."""
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise invalid(f"one prompt per request: got a batch of {len(prompt)} prompts; "
                              "send each as its own request (lm-eval: batch_size=1)", "prompt")
            prompt = prompt[0]
        return prompt

    def completion_prompt(self, body: CompletionBody) -> list[int]:
        prompt = self.one_prompt(body)
        if not prompt:
            raise invalid("prompt must not be empty", "prompt")
        if isinstance(prompt, str):
            return [int(t) for t in self.backend.tokenizer(prompt)["input_ids"]]
        vocab = len(self.backend.tokenizer)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise invalid(f"prompt token ids must be in [0, {vocab}), got {bad[0]}", "prompt")
        return list(prompt)

    def prompt_text(self, body: CompletionBody, prompt_ids: list[int]) -> str:
        """The prompt as echoed: the text sent, or the token ids' text."""
        prompt = self.one_prompt(body)
        return prompt if isinstance(prompt, str) else self.backend.tokenizer.decode(prompt_ids)

    def structure(self, body: ChatBody) -> Structure:
        """The body's response_format / tools as a Structure whose grammar compiles here (so a
        grammar the services could not compile is the client's 400, not a failed generation).
        Compiling takes ~10 ms (cached by grammar): call it off the event loop."""
        structure = structure_of(body.response_format, body.tools, body.tool_choice)
        if structure.grammar:
            try:
                self.grammars.compile(structure.grammar)
            except GrammarError as exc:
                param = "tools" if structure.calls_tools else "response_format"
                raise invalid(f"{param}: not supported: {exc}", param)
        return structure

    def chat_prompt(self, body: ChatBody, structure: Structure | None = None) -> list[int]:
        if not body.messages:
            raise invalid("messages must not be empty", "messages")
        tokenizer = self.backend.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise invalid("this model has no chat template: use /v1/completions", "messages")
        messages = []
        for i, m in enumerate(body.messages):
            if isinstance(m.content, list):
                if any(p.type != "text" or p.text is None for p in m.content):
                    raise invalid(f"messages[{i}].content: only text parts are supported",
                                   "messages")
                text = "".join(p.text for p in m.content)
            else:
                text = m.content or ""
            if m.role == "assistant" and m.tool_calls:  # its calls, as the model writes them
                text += "".join(tool_call_text(c) for c in m.tool_calls if isinstance(c, dict))
            # Chat templates know "system"; OpenAI's newer name for it is "developer".
            messages.append({"role": "system" if m.role == "developer" else m.role,
                             "content": text})
        if structure is not None and structure.instruction:  # the form, in the system turn
            offer = structure.instruction
            if messages[0]["role"] == "system":
                messages[0]["content"] = f"{messages[0]['content']}\n\n{offer}"
            else:
                messages.insert(0, {"role": "system", "content": offer})
        try:
            return chat_prompt_ids(tokenizer, messages)
        except Exception as exc:  # the template rejects this conversation (e.g. role order)
            raise invalid(f"messages: the chat template rejected them: {exc}", "messages")

    def native_prompt(self, body: GenerateBody) -> list[int]:
        """The prompt of a native /generate body: token ids, or text (``chat``: as one user
        message under the chat template)."""
        if (body.prompt is None) == (body.prompt_ids is None):
            raise invalid("give exactly one of prompt and prompt_ids", "prompt")
        if body.prompt is None:
            return self.completion_prompt(CompletionBody(model="", prompt=body.prompt_ids))
        if not body.prompt:
            raise invalid("prompt must not be empty", "prompt")
        return encode_prompt(self.backend.tokenizer, body.prompt, body.chat)

    def unsupported(self, body) -> None:
        """Refuse options that would change the output and that specdec does not implement."""
        checks = [
            ("n", not 1 <= body.n <= MAX_N, f"n must be in [1, {MAX_N}], got {body.n}"),
        ]
        if isinstance(body, CompletionBody):
            checks += [("logprobs", body.logprobs is not None and
                        not 0 <= body.logprobs <= MAX_TOP_LOGPROBS,
                        f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {body.logprobs}"),
                       ("echo", body.echo and body.stream, "echo is not supported with "
                        "stream"),
                       ("best_of", body.best_of not in (None, 1), "best_of must be 1"),
                       ("suffix", bool(body.suffix), "not supported")]
        elif isinstance(body, GenerateBody):
            checks += [("stream", body.stream, "/generate does not stream: use /v1/completions")]
        else:
            checks += [("top_logprobs", body.top_logprobs is not None and
                        not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS,
                        f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], "
                        f"got {body.top_logprobs}"),
                       ("top_logprobs", bool(body.top_logprobs) and not body.logprobs,
                        "top_logprobs needs logprobs: true")]
        for param, bad, why in checks:
            if bad:
                raise invalid(f"{param}: {why}", param)

    def logit_bias(self, body) -> tuple[tuple[int, float], ...]:
        """OpenAI's logit_bias ({"token id": bias in [-100, 100]}) as SamplingParams takes it."""
        vocab = len(self.backend.tokenizer)
        out = {}
        for key, bias in (body.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise invalid(f"logit_bias: keys must be token ids, got {key!r}", "logit_bias")
            if not 0 <= token < vocab:
                raise invalid(f"logit_bias: token ids must be in [0, {vocab}), got {token}",
                              "logit_bias")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or \
                    not -100 <= bias <= 100:
                raise invalid(f"logit_bias: biases must be numbers in [-100, 100], got "
                              f"{bias!r} for token {token}", "logit_bias")
            out[token] = float(bias)
        return tuple(sorted(out.items()))

    def generation_requests(self, body, prompt_ids: list[int], request_id: str,
                            max_tokens: int | None, grammar: str = "",
                            ) -> list[GenerationRequest]:
        """One request per choice: choice i has seed + i (a fresh seed each without one)."""
        first = self.generation_request(body, prompt_ids, request_id, max_tokens, grammar)
        if isinstance(body, CompletionBody) and body.echo and body.logprobs is not None:
            first = dataclasses.replace(first, prompt_logprobs=True)
        if body.n == 1:
            return [first]
        reqs = []
        for i in range(body.n):
            seed = first.sampling.seed + i if body.seed is not None else request_seed(None)
            reqs.append(dataclasses.replace(first, request_id=f"{request_id}-{i}",
                                            sampling=first.sampling.replace(seed=seed % 2**64)))
        return reqs

    def generation_request(self, body, prompt_ids: list[int], request_id: str,
                           max_tokens: int | None, grammar: str = "") -> GenerationRequest:
        d = self.defaults
        room = self.backend.max_context - len(prompt_ids)
        if max_tokens is None:
            if room < 1:
                raise invalid(f"the prompt ({len(prompt_ids)} tokens) fills the model's "
                               f"context of {self.backend.max_context} tokens", "messages"
                               if isinstance(body, ChatBody) else "prompt")
            max_tokens = min(d.max_tokens, room)
        elif max_tokens < 1:
            raise invalid(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        elif max_tokens > room:
            raise invalid(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) "
                           f"exceeds the model's context of {self.backend.max_context} tokens",
                           "max_tokens", "context_length_exceeded")
        temperature = d.temperature if body.temperature is None else body.temperature
        if not (math.isfinite(temperature) and temperature >= 0):
            raise invalid(f"temperature must be a finite number >= 0, got {temperature}",
                           "temperature")
        top_p = d.top_p if body.top_p is None else body.top_p
        if not 0.0 < top_p <= 1.0:
            raise invalid(f"top_p must be in (0, 1], got {top_p}", "top_p")
        top_k = d.top_k if body.top_k is None else body.top_k
        if top_k == -1:  # vLLM's spelling of "no limit"
            top_k = 0
        seed = request_seed(body.seed)
        try:
            sampling = SamplingParams(
                temperature, top_k, top_p, seed, body.specdec_rule or d.rule,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None
                else body.repetition_penalty,
                prompt_len=len(prompt_ids), grammar=grammar, logit_bias=self.logit_bias(body))
        except ValueError as exc:  # its messages start with the field's name
            field = next((p for p in ("temperature", "top_k", "top_p", "seed", "rule",
                                      "presence_penalty", "frequency_penalty",
                                      "repetition_penalty")
                          if str(exc).startswith(p)), None)
            raise invalid(str(exc), "specdec_rule" if field == "rule" else field)
        stop = d.stop if body.stop is None else [body.stop] if isinstance(body.stop, str) \
            else body.stop
        mode = body.specdec_mode or d.mode
        if mode not in MODES:
            raise invalid(f"specdec_mode must be one of {', '.join(MODES)}, got {mode!r}",
                           "specdec_mode")
        k = d.k if body.specdec_k is None else body.specdec_k
        if isinstance(body, ChatBody):
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
        else:
            logprobs = getattr(body, "logprobs", None)  # the native body has none
        try:
            return GenerationRequest(prompt_ids, max_tokens, sampling, list(stop), mode, k,
                                     request_id, prompt_lookup=d.prompt_lookup,
                                     logprobs=logprobs)
        except ValueError as exc:
            raise invalid(str(exc), "specdec_k" if "k must" in str(exc) else None)

