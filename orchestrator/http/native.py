"""specdec's native routes over a PairRouter: ``POST /generate`` and ``GET /pairs`` (the Ray
front serves them beside the OpenAI routes)."""

from __future__ import annotations

import asyncio

import fastapi

from orchestrator.http.errors import APIError
from orchestrator.http.schemas import GenerateBody


def native_routes(front) -> fastapi.APIRouter:
    """POST /generate (summary JSON with token ids, and the pair that ran it), GET /pairs.

    The body is the HTTP front's own request model (orchestrator.http.schemas.GenerateBody):
    built, validated and defaulted by the same RequestBuilder as the OpenAI routes, and
    behind the same API-key check (the app's middleware covers every route but /health)."""
    router = front.backend
    routes = fastapi.APIRouter()

    @routes.post("/generate")
    async def generate(body: GenerateBody) -> dict:
        try:
            front.requests.unsupported(body)
            prompt_ids = await asyncio.to_thread(front.requests.native_prompt, body)
            req = front.requests.generation_request(body, prompt_ids, "", body.max_tokens)
        except APIError as err:
            raise err.respelled(GenerateBody.SPELLING) from None
        try:
            result, i = await router.generate_on_pair(req, body.session)
        except ValueError as exc:
            raise fastapi.HTTPException(400, str(exc)) from None
        return dict(result.summary(), pair=router.labels[i])

    @routes.get("/pairs")
    async def pairs() -> list[dict]:
        return router.describe()

    return routes


