"""The OpenAI server's cost over the in-process Generator: requests/s and per-request tokens/s at 1, 8 and 32
concurrent clients, for a synthetic Llama-3-8B-shape EXL2 model (4.0 bpw body, 6-bit head; speed does not depend
on the weights' values).

Both paths run the same Generator, the same prompt lengths (fresh random prompts each round: no prefix-cache hits)
and max_tokens, greedy, every request generating exactly max_tokens:
  in-process  each client is a thread iterating its jobs (Generator.submit + iteration, as the docs suggest);
  server      `create_app` on 127.0.0.1 in this process (uvicorn in a thread), driven by streaming /v1/completions
              clients (httpx, SSE, token-id prompts) in a separate process, so the clients' parsing does not take
              the server's interpreter lock.
Each concurrency level is warmed up once (CUDA graphs of its batch size), then timed over --requests rounds per
client. Overhead = 1 - server req/s / in-process req/s (goal: <= 10 %).

    python benchmarks/bench_server.py                                   # GPU: llama-3-8b shape, 1/8/32 clients
    python benchmarks/bench_server.py --shape tiny --requests 2 --max-tokens 16 --concurrency 1,4   # CPU smoke
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES, synthetic_model  # noqa: E402

SHAPES.setdefault("tiny", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=False))   # CPU smoke size


class WordTokenizer:
    """A stand-in tokenizer: token i is the text " w{i}". No EOS, so every request runs to max_tokens."""
    eos_token_id = bos_token_id = chat_template = None
    added_tokens_decoder: dict = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(w[1:]) for w in text.split() if w[1:].isdigit()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f" w{i}" for i in ids)


@dataclass
class SyntheticLM:
    """What Generator needs of an ExlForCausalLM, around a synthetic Model."""
    model: object
    tokenizer: WordTokenizer
    max_seq_len: int
    cache_mode: str
    page_size: int = 256

    @property
    def exl_config(self):
        return self.model.config

    @property
    def device(self):
        return self.model.device

    @property
    def dtype(self):
        return self.model.dtype


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def summary(records: list[dict], wall: float) -> dict:
    """Rates over the whole run; with the records' first_at / end_at (in-process), also the decode phase's: the
    tokens after each job's first chunk over the time from the first job's first chunk to the last job's end (the
    prompts' prefill, before any first token, left out)."""
    tokens = sum(r["tokens"] for r in records)
    out = dict(requests=len(records), wall_s=wall, req_s=len(records) / wall, tok_s=tokens / wall,
               per_request_tok_s=sum(r["tokens"] / r["latency"] for r in records) / len(records),
               ttft_ms=1000 * sum(r["ttft"] for r in records) / len(records))
    if all("first_at" in r for r in records):
        span = max(r["end_at"] for r in records) - min(r["first_at"] for r in records)
        out["decode_tok_s"] = sum(r["decode_tokens"] for r in records) / span
    return out


# ---- in-process ----------------------------------------------------------------------------------------------------

def in_process(gen, prompts: list[list[int]], concurrency: int, max_tokens: int, sampling=None) -> dict:
    """`concurrency` threads share the prompts; each job runs max_tokens tokens (greedy unless `sampling`)."""
    from exl_backends.engine.sampling import SamplingParams
    sampling = sampling or SamplingParams(temperature=0.0)
    records, lock = [], threading.Lock()

    def client(mine: list[list[int]]):
        for p in mine:
            t0 = time.perf_counter()
            first, first_n, n = None, 0, 0
            for chunk in gen.submit(p, max_new_tokens=max_tokens, min_new_tokens=max_tokens, sampling=sampling):
                if first is None:
                    first, first_n = time.perf_counter(), len(chunk.token_ids)
                n += len(chunk.token_ids)
            end = time.perf_counter()
            with lock:
                records.append(dict(latency=end - t0, ttft=first - t0, tokens=n, first_at=first, end_at=end,
                                    decode_tokens=n - first_n))
    threads = [threading.Thread(target=client, args=(prompts[i::concurrency],)) for i in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summary(records, time.perf_counter() - t0)


# ---- through the server --------------------------------------------------------------------------------------------

async def drive(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    """The client side (run in its own process): `concurrency` streaming clients share the prompts."""
    import httpx
    records = []

    async def one(client, prompt):
        body = dict(prompt=prompt, max_tokens=max_tokens, temperature=0, min_tokens=max_tokens, stream=True,
                    stream_options={"include_usage": True})
        t0 = time.perf_counter()
        first, n = None, 0
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    n = chunk["usage"]["completion_tokens"]
                elif first is None:
                    first = time.perf_counter()
        records.append(dict(latency=time.perf_counter() - t0, ttft=first - t0, tokens=n))

    async def client_loop(client, mine):
        for p in mine:
            await one(client, p)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client, prompts[i::concurrency]) for i in range(concurrency)))
        wall = time.perf_counter() - t0
    return summary(records, wall)


def through_server(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    spec = json.dumps(dict(url=url, prompts=prompts, concurrency=concurrency, max_tokens=max_tokens))
    r = subprocess.run([sys.executable, __file__, "--client"], input=spec, capture_output=True, text=True,
                       timeout=3600, check=True)
    return json.loads(r.stdout)


def serve_in_thread(app):
    import uvicorn

    from exl_backends.server.serve import listen
    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


# ---- main ----------------------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=4, help="timed requests per client and level")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--cache-mode", default="fp16")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)    # the client process
    args = ap.parse_args()
    if args.client:
        spec = json.loads(sys.stdin.read())
        print(json.dumps(asyncio.run(drive(spec["url"], spec["prompts"], spec["concurrency"], spec["max_tokens"]))))
        return

    from exl_backends.engine.generator import Generator
    from exl_backends.server.app import create_app
    levels = [int(c) for c in args.concurrency.split(",")]
    seq = args.prompt_tokens + args.max_tokens
    lm = SyntheticLM(synthetic_model(args.shape, device=args.device), WordTokenizer(), seq, args.cache_mode)
    vocab = lm.exl_config.vocab_size
    gen = Generator(lm, max_batch_size=max(levels), cache_tokens=max(levels) * (seq + lm.page_size))
    server, thread, url = serve_in_thread(create_app(gen, f"synthetic-{args.shape}", None))
    rows, seed = [], 0
    try:
        for c in levels:
            def prompts(n):
                nonlocal seed
                seed += 1
                return random_prompts(n, args.prompt_tokens, vocab, seed)
            in_process(gen, prompts(c), c, args.max_tokens)                 # warm-up: graphs for this batch size
            through_server(url, prompts(c), c, args.max_tokens)
            inproc = in_process(gen, prompts(c * args.requests), c, args.max_tokens)
            served = through_server(url, prompts(c * args.requests), c, args.max_tokens)
            rows.append(dict(concurrency=c, in_process=inproc, server=served,
                             overhead_pct=100 * (1 - served["req_s"] / inproc["req_s"])))
            print(f"{c} clients done", file=sys.stderr, flush=True)
    finally:
        server.should_exit = True
        thread.join(15)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = dict(shape=args.shape, device=device, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                  requests_per_client=args.requests, cache_mode=args.cache_mode, rows=rows)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_server.json").write_text(json.dumps(result, indent=1))
    print(f"\n{args.shape} on {device}: prompt {args.prompt_tokens} tokens, {args.max_tokens} new, greedy, "
          f"{args.requests} requests per client")
    print(f"{'clients':>7} | {'req/s':>8} {'req/s':>8} | {'tok/s/req':>9} {'tok/s/req':>9} | {'TTFT ms':>8} "
          f"{'TTFT ms':>8} | {'overhead':>8}")
    print(f"{'':>7} | {'in-proc':>8} {'server':>8} | {'in-proc':>9} {'server':>9} | {'in-proc':>8} {'server':>8} |")
    for r in rows:
        a, b = r["in_process"], r["server"]
        print(f"{r['concurrency']:>7} | {a['req_s']:8.2f} {b['req_s']:8.2f} | {a['per_request_tok_s']:9.1f} "
              f"{b['per_request_tok_s']:9.1f} | {a['ttft_ms']:8.1f} {b['ttft_ms']:8.1f} | "
              f"{r['overhead_pct']:7.1f}%")


if __name__ == "__main__":
    main()
