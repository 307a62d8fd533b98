"""create_app: the FastAPI app serving one already-loaded model through its Generator (tests build it in-process;
`exl serve` loads the model, then builds it the same way).

Routes: GET /v1/models, /v1/models/{id}; POST /v1/chat/completions, /v1/completions, /v1/tokenize,
/v1/detokenize (these need the API key unless auth is off); GET /health, /metrics (Prometheus text), /docs,
/openapi.json (open). Every request body is bounded (413), every error has OpenAI's shape (errors.py)."""
from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request, Security
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse
from pydantic.json_schema import models_json_schema
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from ..engine.generator import Generator
from . import errors
from .auth import ApiKey, Auth
from .completions import Completions
from .engine import Engine
from .errors import APIError, bad_request
from .metrics import Metrics
from .schemas import (ChatCompletion, ChatCompletionChunk, ChatRequest, Completion, CompletionChunk,
                      CompletionRequest, DetokenizeRequest,
                      DetokenizeResponse, ErrorResponse, Health, ModelCard, ModelList, TokenizeRequest,
                      TokenizeResponse)

MAX_BODY_BYTES = 8 * 2**20          # a request body; 413 above (a full 128k-token prompt is ~0.5 MB of text)
MAX_JOBS = 256                      # jobs (choices) queued or running at once; 429 above

ERRORS = {status: {"model": ErrorResponse, "description": what} for status, what in (
    (400, "a parameter's value is not accepted, or the prompt does not fit the context"),
    (401, "missing or wrong API key"),
    (404, "unknown model"),
    (413, "request body too large"),
    (422, "the body is not a valid request (not JSON, wrong types, missing fields)"),
    (429, "too many jobs queued: retry after Retry-After seconds"),
    (500, "internal error"),
    (503, "out of memory while generating: retry"))}


def stream_doc(chunk: type) -> dict:
    """The 200 response with stream=true: server-sent events whose data is a JSON chunk, an error (mid-stream
    failure), or [DONE] last. OpenAPI 3.1: the text/event-stream schema describes one event."""
    data = {"if": {"const": "[DONE]"}, "else": {
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [{"$ref": f"#/components/schemas/{chunk.__name__}"},
                                    {"$ref": "#/components/schemas/ErrorResponse"}]}}}
    event = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string", **data}}}
    return {200: {"description": "the response, or with stream=true its server-sent events",
                  "content": {"text/event-stream": {"schema": event}}}}


def create_app(generator: Generator, model_id: str, api_key: ApiKey | None, max_jobs: int = MAX_JOBS,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """api_key None: no authentication."""
    metrics = Metrics()
    engine = Engine(generator, max_jobs, metrics)
    completions = Completions(generator, engine, model_id, metrics)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.close()

    app = FastAPI(title="exl-backends", summary=f"OpenAI-compatible API serving {model_id}", lifespan=lifespan)
    errors.install(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(RequestMetrics, metrics=metrics)         # added last: runs first, so it counts 413s too
    key_needed = [Depends(key_checker(Auth(api_key)))] if api_key is not None else []
    card = ModelCard(id=model_id, created=created, owned_by="exl-backends")

    @app.get("/v1/models", response_model=ModelList, dependencies=key_needed, responses=ERRORS)
    async def list_models():
        return ModelList(data=[card])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, dependencies=key_needed, responses=ERRORS)
    async def get_model(model_id: str):
        completions.check_model(model_id)
        return card

    @app.post("/v1/chat/completions", response_model=ChatCompletion, dependencies=key_needed,
              responses={**ERRORS, **stream_doc(ChatCompletionChunk)})
    async def chat_completions(body: ChatRequest, request: Request):
        return await completions.chat(body, request)

    @app.post("/v1/completions", response_model=Completion, dependencies=key_needed,
              responses={**ERRORS, **stream_doc(CompletionChunk)})
    async def text_completions(body: CompletionRequest, request: Request):
        return await completions.complete(body, request)

    @app.post("/v1/tokenize", response_model=TokenizeResponse, dependencies=key_needed, responses=ERRORS)
    async def tokenize(body: TokenizeRequest):
        completions.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", param="prompt")
        tokenizer = generator.tokenizer
        if body.messages is not None:
            text = completions.chat_text(body.messages)
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=generator.max_seq_len)

    @app.post("/v1/detokenize", response_model=DetokenizeResponse, dependencies=key_needed, responses=ERRORS)
    async def detokenize(body: DetokenizeRequest):
        completions.check_model(body.model)
        vocab = generator.config.vocab_size
        if body.tokens and max(body.tokens) >= vocab:
            raise bad_request(f"token id {max(body.tokens)} is outside the vocabulary (0 to {vocab - 1})",
                              param="tokens")
        return DetokenizeResponse(prompt=generator.tokenizer.decode(body.tokens))

    @app.get("/health", response_model=Health)
    async def health():
        return Health()

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus():
        return PlainTextResponse(metrics.render(generator, engine.n_outstanding),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    app.openapi = lambda: openapi_with_chunks(app)
    app.state.engine, app.state.metrics = engine, metrics
    return app


def openapi_with_chunks(app: FastAPI) -> dict:
    """FastAPI's schema plus the streamed chunk models, which no route returns as JSON."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        _, chunks = models_json_schema([(m, "serialization") for m in (ChatCompletionChunk, CompletionChunk)],
                                       ref_template="#/components/schemas/{model}")
        schema["components"]["schemas"].update(chunks["$defs"])
        app.openapi_schema = schema
    return app.openapi_schema


def key_checker(auth: Auth):
    bearer = HTTPBearer(auto_error=False, description="Authorization: Bearer <key>")
    header = APIKeyHeader(name="x-api-key", auto_error=False, description="x-api-key: <key>")

    async def require_key(credentials: HTTPAuthorizationCredentials | None = Security(bearer),
                          x_api_key: str | None = Security(header)):
        auth.check(credentials.credentials if credentials else None, x_api_key)
    return require_key


class BodyLimit:
    """ASGI middleware: reads the whole request body, refusing (413) one over max_bytes, whether its
    Content-Length says so or its chunks add up to it, then hands it to the app."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self.too_large(int(length), send)
        body, more = [], True
        size = 0
        while more:
            message = await receive()
            if message["type"] != "http.request":       # the client left while sending
                return
            body.append(message.get("body", b""))
            size += len(body[-1])
            if size > self.max_bytes:
                return await self.too_large(size, send)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()                  # the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": b"".join(body), "more_body": False}
        await self.app(scope, replay, send)

    async def too_large(self, size: int, send) -> None:
        e = APIError(413, f"the request body is {size} bytes or more; this server takes at most {self.max_bytes}",
                     code="request_too_large")
        response = e.response()
        response.headers["Connection"] = "close"
        await response({"type": "http"}, None, send)


class RequestMetrics:
    """ASGI middleware: counts requests by route and status, and those in flight."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        self.metrics.request_started()
        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            self.metrics.request_done(route.path if route is not None else "other", status)
