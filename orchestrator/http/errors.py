"""Errors in OpenAI's error body, and the mapping of validation and service errors to them."""

from __future__ import annotations

import re

from fastapi.exceptions import RequestValidationError

from orchestrator.service_clients import ServiceError


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    def respelled(self, names: dict[str, str]) -> "APIError":
        """This error as a body that spells the fields otherwise says it (the native route's
        ``max_new_tokens`` for ``max_tokens``, ...)."""
        message = self.message
        for ours, theirs in names.items():
            message = re.sub(rf"\b{ours}\b", theirs, message)
        return APIError(self.status, message, names.get(self.param, self.param), self.code,
                        self.type)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def validation_error(exc: RequestValidationError) -> APIError:
    """The first problem of a pydantic validation error, phrased for the client."""
    errors = exc.errors()
    if not errors:
        return invalid("invalid request body")
    err = errors[0]
    loc = [p for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "invalid_unicode":
        return invalid(err["msg"], err["ctx"]["param"])
    if err.get("type") == "json_invalid":
        return invalid(f"malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}")
    if not loc:
        return invalid(f"request body: {err['msg']} (expected a JSON object)")
    if loc[0] == "prompt" and err.get("type") != "missing":  # a union: say what it can be
        return invalid("prompt must be a string, a list of token ids (integers), or a list "
                       "of one of these (a batch of one prompt)", "prompt")
    # Union members appear in loc by type name ("stop", "str"): keep field names and indexes.
    path = [str(loc[0])] + [f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:]
                            if isinstance(p, int) or not _is_type_tag(p)]
    name = "".join(path)
    return invalid(f"{name}: {err['msg']}", param=str(loc[0]))


def _is_type_tag(part: str) -> bool:
    """A union member's name in a pydantic error location (not a field name)."""
    return "[" in part or part in ("str", "int", "float", "bool", "list", "dict") or \
        part.startswith("function-")


def service_error(exc: ServiceError) -> APIError:
    status = 503 if exc.retriable else 500
    return APIError(status, f"generation failed: {exc}", code=exc.code.name.lower(),
                    type="server_error")
