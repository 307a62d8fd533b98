"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the status the official client maps
to its exception classes (400 BadRequestError, 401 AuthenticationError, 404 NotFoundError, 413, 422
UnprocessableEntityError, 429 RateLimitError, 5xx InternalServerError).

Status rules: a body that is not the request's shape (not JSON, wrong types, missing fields) is 422; a well-formed
value the API does not accept (out of range, unknown token, prompt over the context, unsupported feature) is 400;
a failure of ours is 500 (503 for running out of memory, which a retry may get past). A user's mistake is never
a 5xx."""
from __future__ import annotations

import logging

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..errors import ContextLengthError, SamplingError

log = logging.getLogger(__name__)

# pydantic error types that mean "well-formed, but this value is not accepted" (400); any other type is 422
VALUE_ERRORS = frozenset({
    "greater_than", "greater_than_equal", "less_than", "less_than_equal", "multiple_of", "finite_number",
    "too_short", "too_long", "string_too_short", "string_too_long", "literal_error", "enum", "value_error",
    "assertion_error"})


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def context_length_error(n_prompt: int, max_seq_len: int) -> APIError:
    """OpenAI's wording and code: langchain-openai maps code context_length_exceeded to its overflow error."""
    return APIError(400, f"This model's maximum context length is {max_seq_len} tokens. However, your prompt is "
                         f"{n_prompt} tokens, which leaves no room for a completion. Please reduce the length of "
                         f"the prompt (or start the server with a larger --max-seq-len).",
                    param="messages", code="context_length_exceeded")


def from_submit(e: Exception) -> APIError:
    """What Generator.submit refusing a job tells the client: it checks the request's values (ValueError)."""
    if isinstance(e, ContextLengthError):
        return APIError(400, str(e), code="context_length_exceeded")
    if isinstance(e, ValueError):                   # SamplingError is one too
        return bad_request(str(e))
    return from_generation(e)


def from_generation(e: BaseException) -> APIError:
    """What a job's failure while generating tells the client."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, SamplingError):                # the constraint or the samplers left no token to choose
        return bad_request(str(e))
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return APIError(503, f"the server ran out of memory while generating ({e}); retry, or ask for fewer "
                             f"tokens or choices", type="server_error", code="out_of_memory",
                        headers={"Retry-After": "1"})
    log.error("generation failed", exc_info=e)
    return APIError(500, f"internal error while generating: {type(e).__name__}: {e}", type="server_error")


def param_name(loc: tuple) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content"."""
    name = ""
    for part in loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or None


def validation_error(e: RequestValidationError) -> APIError:
    errors = e.errors()
    status = 400 if errors and all(err.get("type") in VALUE_ERRORS for err in errors) else 422
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = param_name(tuple(first.get("loc", ())))
    message = first.get("msg", "invalid request")
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return APIError(status, message, param=param, code="invalid_value" if status == 400 else "invalid_request")


def install(app: FastAPI) -> None:
    """Every error the app returns has OpenAI's shape (FastAPI's own are {"detail": ...})."""
    async def api_error(request: Request, e: APIError):
        return e.response()

    async def invalid(request: Request, e: RequestValidationError):
        return validation_error(e).response()

    async def http_error(request: Request, e: HTTPException):
        if e.status_code == 404:
            message = f"no route {request.method} {request.url.path}; the API is under /v1 (see /docs)"
        else:
            message = f"{request.method} {request.url.path}: {e.detail}"
        return APIError(e.status_code, message, code="not_found" if e.status_code == 404 else None,
                        headers=getattr(e, "headers", None)).response()

    async def internal(request: Request, e: Exception):
        log.error("request %s %s failed", request.method, request.url.path, exc_info=e)
        return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal)
