"""The OpenAI-compatible HTTP server (`exl serve`): FastAPI + uvicorn over one Generator's continuous batching.

    app.py       create_app(generator, model_id, ...): routes, middleware, error handlers (tests build it in-process)
    schemas.py   request and response bodies (pydantic), the API's documented limits
    openai.py    requests -> prompts, SamplingParams and jobs; chunks -> OpenAI's response and stream shapes
    engine.py    the Generator seen from asyncio: a thread consumes each job, outstanding jobs are bounded
    errors.py    OpenAI-shaped errors and how exceptions map to them
    auth.py      the API key: generated once, stored 0600, checked in constant time
    metrics.py   Prometheus text for /metrics
    banner.py    what `exl serve` prints at start
    serve.py     `exl serve`: load, bind, print the banner, run uvicorn

Needs the `server` extra (fastapi, uvicorn, sse-starlette); importing this package imports none of them."""
