"""The OpenAI-compatible HTTP front over an injected Orchestrator.

``create_app(backend, model_name)`` serves ``POST /v1/completions`` and
``POST /v1/chat/completions`` (``stream: true`` as Server-Sent Events), ``GET /v1/models``,
``GET /health`` and ``GET /metrics``. The backend is anything with the Orchestrator's
``stream``, ``tokenizer``, ``max_context``, ``target`` and ``draft``: the app never builds
one, so the CLI, a Ray Serve replica and the tests each inject their own.

Each response carries the generation's speculative statistics in an extra ``specdec`` field,
which OpenAI clients ignore. Bad requests get HTTP 400 with OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from orchestrator.generation import GenerationRequest
from orchestrator.http.errors import APIError, invalid, service_error, validation_error
from orchestrator.http.metrics import CONTENT_TYPE, Metrics
from orchestrator.http.middleware import BearerAuth, BodyLimit, EventStream, sse
from orchestrator.http.requests import RequestBuilder
from orchestrator.http.responses import LogprobShapes, is_result, specdec_stats, usage
from orchestrator.http.schemas import ChatBody, CompletionBody, ServeDefaults
from orchestrator.http.structured import Structure, ToolStream, split_tool_calls
from orchestrator.service_clients import ServiceError

log = logging.getLogger(__name__)

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class _Front:
    """The request handling behind the routes (one per app)."""

    def __init__(self, backend, model_name: str, defaults: ServeDefaults, metrics: Metrics):
        self.backend = backend
        self.model_name = model_name
        self.defaults = defaults
        self.metrics = metrics
        self.created = int(time.time())
        self.requests = RequestBuilder(backend, model_name, defaults)
        self.shapes = LogprobShapes(backend.tokenizer)

    # -- running a generation --

    async def run(self, req: GenerationRequest, endpoint: str) -> AsyncIterator:
        """backend.stream plus what every request needs: the running gauge, the metrics and
        one log line. A generation cancelled from outside counts as an abort."""
        self.metrics.running(1)
        started = time.perf_counter()
        sent = 0
        result = None
        outcome = "error"
        agen = self.backend.stream(req)
        try:
            async for item in agen:
                if is_result(item):
                    result = item
                else:
                    sent += len(item.token_ids)
                yield item
            outcome = result.finish_reason if result is not None else "error"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "abort"
            raise
        finally:
            self.metrics.running(-1)
            if result is not None:
                self.metrics.observe_result(result)
            elif outcome == "abort":
                self.metrics.aborted(len(req.prompt_ids), sent)
            else:
                self.metrics.failure("error")
            self.log_request(req, endpoint, outcome, result, sent, time.perf_counter() - started)
            # Only this closes the generation when we are closed at a yield (the client left
            # while a chunk was being sent): its finally closes both services' sessions.
            await agen.aclose()

    def log_request(self, req, endpoint, outcome, result, sent, wall_s) -> None:
        fields = dict(id=req.request_id, endpoint=endpoint, outcome=outcome,
                      prompt_tokens=len(req.prompt_ids), max_tokens=req.max_new_tokens,
                      mode=req.mode, temperature=req.sampling.temperature)
        if result is not None:
            s = specdec_stats(result)
            fields.update(completion_tokens=len(result.token_ids), rounds=s["rounds"],
                          draft_tokens=s["draft_tokens"], accepted_tokens=s["accepted_tokens"],
                          acceptance=s["acceptance_rate"],
                          tokens_per_round=s["mean_tokens_per_round"], k_mean=s["k_mean"],
                          ttft_s=s["ttft_s"], wall_s=s["wall_s"], tokens_per_s=s["tokens_per_s"])
        else:
            fields.update(completion_tokens=sent, wall_s=round(wall_s, 4))
        log.info("request %s", " ".join(f"{k}={v}" for k, v in fields.items()))

    async def generate(self, request: Request, reqs: list[GenerationRequest], endpoint: str):
        """The whole results, one per request, or None when the client disconnected first
        (then the generations are cancelled, which frees their sessions)."""

        async def collect(req):
            result = None
            async with contextlib.aclosing(self.run(req, endpoint)) as items:
                async for item in items:
                    if is_result(item):
                        result = item
            return result

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.ensure_future(collect(req)) for req in reqs]
        everything = asyncio.gather(*tasks)
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({everything, watch}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # we are cancelled (shutdown): so are the generations
            everything.cancel()
            raise
        finally:
            watch.cancel()
        if not everything.done() or everything.exception() is not None:
            # disconnected, or one choice failed: the others stop too
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if not everything.done() or everything.cancelled():
                return None
        try:
            return everything.result()
        except ServiceError as exc:
            raise service_error(exc) from None
        except ValueError as exc:
            raise invalid(str(exc)) from None

    async def _items(self, reqs: list[GenerationRequest], endpoint: str):
        """(choice index, delta or result) of every generation as they come; for n > 1 the
        generations run concurrently, and closing this closes them all."""
        if len(reqs) == 1:
            async with contextlib.aclosing(self.run(reqs[0], endpoint)) as items:
                async for item in items:
                    yield 0, item
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, req: GenerationRequest) -> None:
            error = None
            try:
                async with contextlib.aclosing(self.run(req, endpoint)) as items:
                    async for item in items:
                        queue.put_nowait((i, item, None))
            except Exception as exc:
                error = exc
            finally:  # the end of choice i, even when cancelled
                queue.put_nowait((i, None, error))

        tasks = [asyncio.ensure_future(pump(i, req)) for i, req in enumerate(reqs)]
        try:
            running = len(tasks)
            while running:
                i, item, exc = await queue.get()
                if exc is not None:
                    raise exc
                if item is None:
                    running -= 1
                    continue
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def events(self, reqs: list[GenerationRequest], endpoint: str, chat: bool, head: dict,
                     include_usage: bool, structure: Structure | None = None,
                     ) -> AsyncIterator[str]:
        """The SSE body of a streamed response (choices interleaved as they come, by index).
        A tool-calling choice streams its text before a call as content, the call whole at
        the end (as one tool_calls delta)."""
        extra = {"usage": None} if include_usage else {}
        want_logprobs = reqs[0].logprobs is not None
        offsets = [0] * len(reqs)  # completions: characters streamed per choice
        tools = [ToolStream(structure) for _ in reqs] \
            if structure is not None and structure.calls_tools else None

        def chunk(i: int, text: str | None, finish: str | None = None, role: bool = False,
                  logprobs=None, tool_calls: list | None = None) -> dict:
            lp = None
            if want_logprobs and logprobs is not None:
                lp = self.shapes.chat_logprobs(logprobs) if chat else \
                    self.shapes.completion_logprobs(logprobs, offsets[i])
            if chat:
                delta = {"role": "assistant", "content": ""} if role else \
                    ({} if text is None else {"content": text})
                if tool_calls:
                    delta = {"tool_calls": [{"index": n, **call}
                                            for n, call in enumerate(tool_calls)]}
                choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": i, "text": text or "", "logprobs": lp,
                          "finish_reason": finish}
            return {**head, "choices": [choice], **extra}

        try:
            if chat:
                for i in range(len(reqs)):
                    yield sse(chunk(i, None, role=True))
            results = [None] * len(reqs)
            # aclosing: when we are closed at a yield, the generations must be closed too
            async with contextlib.aclosing(self._items(reqs, endpoint)) as items:
                async for i, item in items:
                    finish = None
                    if tools is not None and is_result(item):
                        rest, calls = tools[i].finish()
                        if rest:
                            yield sse(chunk(i, rest))
                        if calls:
                            yield sse(chunk(i, None, tool_calls=calls))
                            finish = "tool_calls"
                    elif tools is not None:
                        text = tools[i].feed(item.text)
                        if text or (want_logprobs and item.logprobs):
                            yield sse(chunk(i, text, logprobs=item.logprobs))
                        continue
                    if is_result(item):
                        results[i] = item
                        last = chunk(i, None, finish or item.finish_reason)
                        last["specdec"] = specdec_stats(item)
                        yield sse(last)
                    elif item.text or (want_logprobs and item.logprobs):
                        yield sse(chunk(i, item.text, logprobs=item.logprobs))
                        offsets[i] += len(item.text)
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(results)})
        except ServiceError as exc:
            yield sse(service_error(exc).body())
        except ValueError as exc:
            yield sse(invalid(str(exc)).body())
        except Exception as exc:  # headers are sent: the error can only travel as an event
            log.exception("request %s failed", reqs[0].request_id)
            yield sse(APIError(500, f"internal error: {exc}", type="server_error").body())
        yield sse("[DONE]")

    async def respond(self, request: Request, body, prompt_ids: list[int], chat: bool,
                      max_tokens: int | None, structure: Structure | None = None):
        self.requests.unsupported(body)
        rid = request.headers.get("x-request-id", "")
        rid = rid if _REQUEST_ID.match(rid) else uuid.uuid4().hex[:16]
        reqs = self.requests.generation_requests(body, prompt_ids, rid, max_tokens,
                                                 structure.grammar if structure else "")
        endpoint = request.url.path
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}
        headers = {"X-Request-Id": rid}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return EventStream(self.events(reqs, endpoint, chat, head, include_usage,
                                           structure),
                                headers={**headers, "Cache-Control": "no-cache",
                                         "X-Accel-Buffering": "no"})
        results = await self.generate(request, reqs, endpoint)
        if results is None:  # nobody is listening any more
            return Response(status_code=499)
        want_logprobs = reqs[0].logprobs is not None
        choices = []
        for i, result in enumerate(results):
            if chat:
                lp = self.shapes.chat_logprobs(result.logprobs) if want_logprobs else None
                message = {"role": "assistant", "content": result.text}
                finish = result.finish_reason
                if structure is not None and structure.calls_tools:
                    message["content"], calls = split_tool_calls(result.text, structure)
                    if calls:
                        message["tool_calls"], finish = calls, "tool_calls"
                choices.append({"index": i, "message": message, "logprobs": lp,
                                "finish_reason": finish})
            elif body.echo:  # the prompt, then the completion; logprobs over both
                lp = self.shapes.completion_logprobs(result.prompt_logprobs + result.logprobs,
                                              first_token=prompt_ids[0]) if want_logprobs \
                    else None
                choices.append({"index": i, "text": self.requests.prompt_text(body, prompt_ids)
                                + result.text, "logprobs": lp,
                                "finish_reason": result.finish_reason})
            else:
                lp = self.shapes.completion_logprobs(result.logprobs) if want_logprobs else None
                choices.append({"index": i, "text": result.text, "logprobs": lp,
                                "finish_reason": result.finish_reason})
        if chat:
            head["object"] = "chat.completion"
        # one choice: its stats; several: a list, one per choice
        stats = [specdec_stats(r) for r in results]
        return JSONResponse({**head, "choices": choices, "usage": usage(results),
                             "specdec": stats[0] if len(stats) == 1 else stats},
                            headers=headers)



def create_app(backend, model_name: str, api_key: str | None = None, *,
               defaults: ServeDefaults | None = None,
               metrics: Metrics | None = None) -> FastAPI:
    """The OpenAI-compatible app over ``backend`` (an Orchestrator or the like), serving it
    under ``model_name``; with ``api_key`` every path but /health needs that bearer token."""
    front = _Front(backend, model_name, defaults or ServeDefaults(),
                   metrics or Metrics(model_name))
    app = FastAPI(title="specdec", summary="OpenAI-compatible speculative decoding")
    app.state.front = front
    app.state.metrics = front.metrics
    app.add_middleware(BodyLimit, limit=front.defaults.max_body_bytes,
                       timeout_s=front.defaults.body_timeout_s)
    if api_key:  # added last, so it runs first: no body is read for an unauthorized request
        app.add_middleware(BearerAuth, api_key=api_key)

    _handle_errors(app, front)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        front.requests.check_model(body.model)
        # Tokenizing (and rendering a chat template) runs off the event loop: a long prompt
        # must not hold up other requests or /health.
        prompt_ids = await asyncio.to_thread(front.requests.completion_prompt, body)
        return await front.respond(request, body, prompt_ids, False, body.max_tokens)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request):
        front.requests.check_model(body.model)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
            else body.max_tokens
        # (compiling a grammar runs off the event loop too)
        structure = await asyncio.to_thread(front.requests.structure, body)
        prompt_ids = await asyncio.to_thread(front.requests.chat_prompt, body, structure)
        return await front.respond(request, body, prompt_ids, True, max_tokens, structure)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": front.created,
            "owned_by": "specdec", "max_model_len": backend.max_context}]}

    @app.get("/health")
    async def health():
        """200 while every target answers: "ok", or "degraded" while a draft does not (the
        rounds go on without it, slower); 503 "unavailable" while a target does not."""
        clients = backend.service_clients()

        async def error(client) -> str | None:
            # a service known to be down is asked again (on its own schedule) before its
            # stats: a target's reason (dead, restarting), a draft that failed its calls
            if hasattr(client, "serving") and not await client.serving():
                return client.down
            if hasattr(client, "available") and not await client.available():
                return "down (bypassed: rounds go on without it)"
            try:
                await asyncio.wait_for(client.stats(), 5.0)
            except Exception as exc:
                return str(exc) or type(exc).__name__
            return None

        errors = dict(zip(clients, await asyncio.gather(*map(error, clients.values()))))
        failed = {name: e for name, e in errors.items() if e is not None}
        message = "; ".join(f"{name}: {e}" for name, e in failed.items())
        if any(name == "target" or name.endswith("/target") for name in failed):
            return JSONResponse({"status": "unavailable", "error": message}, status_code=503)
        if failed:
            return {"status": "degraded", "error": message}
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_endpoint():
        await front.metrics.refresh_services(backend.service_clients())
        return Response(front.metrics.exposition(), media_type=CONTENT_TYPE)

    return app


def _handle_errors(app: FastAPI, front: _Front) -> None:
    """Every error in OpenAI's body: APIError as raised, a bad body as 400 (not FastAPI's
    422), Starlette's HTTP errors (404, 405, an undecodable body) alike."""

    def error_response(request: Request, err: APIError) -> JSONResponse:
        if err.status == 400 and request.url.path.startswith("/v1/"):
            front.metrics.failure("invalid")
            log.info("request endpoint=%s outcome=invalid status=400 message=%r",
                     request.url.path, err.message)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        # OpenAI answers 400 for a bad body, not FastAPI's 422.
        return error_response(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400:  # FastAPI could not even decode the body
            cause = exc.__cause__
            why = ("it is not UTF-8" if isinstance(cause, UnicodeDecodeError) else
                   "it is nested too deeply" if isinstance(cause, RecursionError) else
                   str(exc.detail))
            return error_response(request, invalid(f"malformed JSON body: {why}"))
        err = APIError(exc.status_code, str(exc.detail),
                       code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)
