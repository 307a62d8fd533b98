"""Speed measurement for `exl bench` and benchmarks/: decode and prefill tokens/s next to the bandwidth bound.

A decode step at batch 1 reads every weight once plus the KV cache of its context, so
    bound (tokens/s) = measured copy bandwidth / (weight bytes + context x cache bytes per token).
A layer split reads its layers one GPU after another: one GPU's bandwidth over all the bytes. Tensor parallel
reads every GPU's shard at once: one GPU's bandwidth over one rank's bytes (rank 0's, measured here; the other
ranks hold the same share). A mixture-of-experts layer at batch 1 reads its router and the top_k experts the
token is routed to, not every expert."""
from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import Tensor

from ..engine.generator import TokenCopies
from ..engine.sampling import greedy
from ..kernels import megakernel
from ..model import step_table
from ..model.batch import Batch, SeqChunk
from ..model.cache import KVCache, bytes_per_token
from ..model.linear import Linear, QuantLinear
from ..model.mlp import Mlp, MoeMlp
from ..model.model import Model
from ..model.runner import DecodeGraphs, Runner
from ..parallel import TensorParallelModel


def copy_bandwidth(device: torch.device, nbytes: int = 2 * 1024**3) -> float:
    """Bytes read + written per second by a large device-to-device copy (median of 10)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for i in range(13):
        _sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        _sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return 2 * nbytes / sorted(times)[len(times) // 2]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sync_all(model: Model | TensorParallelModel) -> None:
    """Waits for every device the model runs on (a layer split has several)."""
    for device in set(model.block_devices):
        _sync(device)


def shard(model: Model | TensorParallelModel) -> Model:
    """The weights one GPU reads per token: rank 0's shard under tensor parallelism, else the whole model."""
    return model.local if isinstance(model, TensorParallelModel) else model


def _nbytes(t: Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def linear_bytes(linear: Linear | QuantLinear, dtype: torch.dtype) -> int:
    """Bytes a linear reads per step: on CUDA its packed weight; a quantized one on the CPU computes from its
    dequantized weight, in the model's dtype (4 bytes a weight in f32)."""
    if isinstance(linear, QuantLinear) and linear.kernel is None:
        return linear.dense_nbytes(dtype) + _nbytes(linear.bias)
    return linear.nbytes()


def mlp_bytes(mlp: Mlp | MoeMlp, dtype: torch.dtype) -> int:
    """Bytes an MLP reads for one token: a routed one its router and top_k experts (of their mean size)."""
    if isinstance(mlp, MoeMlp):
        experts = [mlp_bytes(e, dtype) for e in mlp.experts]
        return linear_bytes(mlp.router, dtype) + mlp.top_k * sum(experts) // len(experts)
    return sum(linear_bytes(x, dtype) for x in (mlp.gate, mlp.up, mlp.down))


def weight_bytes(model: Model) -> int:
    """Bytes one decode step at batch 1 reads from a Model's weights (under tensor parallelism pass its shard):
    every linear and norm once (an MoE layer: see mlp_bytes), the embedding one row."""
    dtype = model.dtype
    total = linear_bytes(model.lm_head, dtype) + _nbytes(model.norm)
    for b in model.blocks:
        a = b.attention
        total += sum(linear_bytes(x, dtype) for x in (a.q, a.k, a.v, a.o)) + mlp_bytes(b.mlp, dtype)
        total += sum(_nbytes(t) for t in (b.input_norm, b.post_attn_norm, b.attn_out_norm, b.mlp_out_norm,
                                          a.q_norm, a.k_norm))
    return total


def fill_cache(cache: KVCache) -> None:
    """Random cache contents: speed does not depend on them, but zeros could take shortcuts."""
    for layer in cache.layers:
        for t in (layer.k, layer.v):
            t.random_(0, 256) if t.dtype == torch.uint8 else t.normal_(0, 0.5)
        for s in (layer.k_scales, layer.v_scales):
            if s is not None:
                s.uniform_(0.01, 0.05)


def _cache(model: Model | TensorParallelModel, n_pages: int, page_size: int, cache_mode: str) -> KVCache:
    return KVCache(model.config, n_pages, page_size, cache_mode, model.device, model.dtype,
                   layer_devices=model.block_devices)


# Steps run before the timed ones: the graph's capture and the first steps' one-off costs (lazy kernel loads, the
# first pinned blocks) stay out of the figure. With 4, the stepped 8B figure was 385 tok/s where the same loop
# warmed longer ran at 400 (H100, 2026-12-07, benchmarks/host_step.py; docs/engine.md). They are paced as the timed
# ones (each reads the token of the one before) and drained before the clock starts: unread, the host queued all 16
# ahead of the GPU and the timed steps carried their backlog (the stepped figure 80 % of replay instead of 97 %).
WARM_STEPS = 16


def decode_speed(model: Model | TensorParallelModel, context: int, cache_mode: str = "fp16", steps: int = 64,
                 page_size: int = 256, batch: int = 1) -> dict:
    """Decode of `batch` sequences at a given context (cache filled with random K/V): tokens/s in all, stepping as
    the generator does (greedy: each step is fed the one before's argmax on the device and launched before the host
    reads that step's tokens, so the host's read and its next step's inputs overlap the GPU's work), and, for a model
    on one GPU, graph replays alone. bytes: what one GPU reads per step at batch 1 (tensor parallel: rank 0's shard
    and its kv heads' cache)."""
    n_pages = -(-(context + WARM_STEPS + steps + 8) // page_size)
    cache = _cache(model, batch * n_pages + 1, page_size, cache_mode)
    fill_cache(cache)
    pages = [cache.pool.allocate(n_pages) for _ in range(batch)]
    runner = Runner(model, cache, max_batch=batch, max_pages=n_pages)
    # tensor parallelism's other ranks take each step's tokens from its host bytes, as its generator feeds them
    on_device = not isinstance(model, TensorParallelModel)
    copies = TokenCopies()

    def step(i: int, top: Tensor | None) -> tuple[Tensor, Tensor, tuple]:
        """Step i fed step i - 1's tokens (top; None: placeholders): its logits, its tokens, and their copy on the
        way to the host (TokenCopies)."""
        ids = top.tolist() if top is not None and not on_device else [1] * batch
        b = Batch.build([SeqChunk([t], context + i, p) for t, p in zip(ids, pages)], page_size, model.device)
        if top is not None and on_device:
            b.feed(top)
        logits = runner.forward(b)
        top = greedy(logits)
        return logits, top, copies.start(top)

    def read(copy: tuple) -> list[int]:
        """The tokens of a step, as the generator reads them (Launched.tokens)."""
        host, done = copy
        if done is not None:
            done.synchronize()
        return host.tolist()
    def run(first: int, n: int, top: Tensor | None) -> tuple[Tensor, Tensor]:
        """Steps first .. first + n - 1, each launched before the host reads the one before's tokens; the last's
        logits and tokens, read."""
        logits, top, copy = step(first, top)
        for i in range(first + 1, first + n):
            ahead = step(i, top)
            read(copy)                          # the step before's tokens, while this one runs
            logits, top, copy = ahead
        read(copy)
        return logits, top
    _, top = run(0, WARM_STEPS, None)
    t0 = time.perf_counter()
    logits, _ = run(WARM_STEPS, steps, top)
    result = dict(tok_s=batch * steps / (time.perf_counter() - t0),
                  bytes=weight_bytes(shard(model)) + context * bytes_per_token(model.config, cache_mode,
                                                                             model.dtype.itemsize),
                  finite=bool(torch.isfinite(logits).all()))      # a speed of NaN logits is no speed
    if isinstance(runner.graphs, DecodeGraphs) and model.device.type == "cuda":   # tensor parallel replays in lockstep
        graph = runner.graphs.by_shape[batch, 1]
        _sync_all(model)
        t0 = time.perf_counter()
        for _ in range(steps):
            graph.replay()
        _sync_all(model)
        result["replay_tok_s"] = batch * steps / (time.perf_counter() - t0)
    return result


def prefill_speed(model: Model | TensorParallelModel, n_tokens: int, page_size: int = 256, reps: int = 3) -> float:
    """Tokens/s of one eager forward over an n_tokens prompt."""
    n_pages = -(-n_tokens // page_size)
    cache = _cache(model, n_pages, page_size, "fp16")
    ids = torch.randint(0, model.config.vocab_size, (n_tokens,)).tolist()
    batch = Batch.build([SeqChunk(ids, 0, cache.pool.allocate(n_pages))], page_size, model.device)
    model.forward(batch, cache)
    _sync_all(model)
    t0 = time.perf_counter()
    for _ in range(reps):
        model.forward(batch, cache)
    _sync_all(model)
    return n_tokens * reps / (time.perf_counter() - t0)


def notes(model: Model | TensorParallelModel) -> list[str]:
    """What the bound counts, for a model that is not one dense model on one device."""
    local, out = shard(model), []
    if local is not model:
        out.append(f"tensor parallel over {dist.get_world_size()} GPUs: each reads its shard at once; bytes and "
                   f"bound are one GPU's (rank 0's shard, {weight_bytes(local) / 1e9:.2f} GB of weights)")
    elif len(local.stages) > 1:
        out.append(f"layer split over {len(local.stages)} devices: the layers are read one device after another; "
                   f"bound = one device's bandwidth over all the bytes")
    routed = [b.mlp for b in local.blocks if isinstance(b.mlp, MoeMlp)]
    if routed:
        m = routed[0]
        out.append(f"mixture of experts: bytes per token count each MoE layer's router and top_k={m.top_k} of its "
                   f"{len(m.experts)} experts (batch 1), not every expert")
    return out


def measure(model: Model | TensorParallelModel, contexts: list[int], cache_mode: str,
            prefill_tokens: list[int]) -> tuple[float, list[dict]]:
    """(copy bandwidth, rows) of `exl bench`: prefill, then decode at batch 1 per context beside its bound, each row
    in benchmarks/results' form (what, context, cache_mode, batch, tok_s, bound_tok_s, pct, path)."""
    bw = copy_bandwidth(model.device)
    rows = [dict(what="prefill", tokens=n, tok_s=prefill_speed(model, n)) for n in prefill_tokens]
    path = "megakernel" if model.device.type == "cuda" and megakernel.enabled(model.device) \
        and shard(model).chainable() else "launch-per-op"
    for ctx in contexts:
        r = decode_speed(model, ctx, cache_mode)
        bound = bw / r["bytes"]
        rows.append(dict(what="decode", context=ctx, cache_mode=cache_mode, batch=1, tok_s=r["tok_s"],
                         replay_tok_s=r.get("replay_tok_s"), bound_tok_s=bound, pct=100 * r["tok_s"] / bound,
                         bytes=r["bytes"], path=path))
    return bw, rows


def report(model: Model | TensorParallelModel, bw: float, rows: list[dict]) -> str:
    """The table `exl bench` prints, of measure()'s rows."""
    lines = [f"device {model.device}, copy bandwidth {bw / 1e9:.0f} GB/s, weights read per token "
             f"{weight_bytes(shard(model)) / 1e9:.2f} GB"] + [f"note: {n}" for n in notes(model)]
    lines.append(f"{'what':28} {'tokens/s':>10} {'bound':>10} {'% of bound':>11}")
    for r in rows:
        if r["what"] == "prefill":
            lines.append(f"{'prefill ' + str(r['tokens']):28} {r['tok_s']:10.1f}")
        else:
            what = f"decode ctx {r['context']} ({r['cache_mode']})"
            lines.append(f"{what:28} {r['tok_s']:10.1f} {r['bound_tok_s']:10.1f} {r['pct']:10.1f}%")
    return "\n".join(lines)


def run_info(device: torch.device, bandwidth: float, rows: list[dict], **extra) -> dict:
    """A result file of benchmarks/results (its README): date, commit (EXL_COMMIT where the tree has no up-to-date
    .git, as on the device machine; "unknown" outside a checkout), device and copy bandwidth, the command line,
    the rows."""
    commit = os.environ.get("EXL_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(__file__)).stdout.strip()
        except OSError:
            commit = ""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return dict(date=datetime.date.today().isoformat(), commit=commit or "unknown",
                device=dict(name=name, copy_bandwidth=bandwidth), torch=torch.__version__,
                command=" ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]), **extra, results=rows)


def result_path(where: str, what: str, info: dict) -> str:
    """where, or under it (a directory) benchmarks/results' name: <what>-<gpu>-<date>-<commit>.json."""
    if not os.path.isdir(where):
        return where
    gpu = info["device"]["name"].lower().replace("nvidia ", "").split()[0]
    return os.path.join(where, f"{what}-{gpu}-{info['date']}-{info['commit']}.json")


_LOAD_PROBE = """
import json, sys, time
t0 = time.perf_counter()
import torch
from exl_backends import ExlForCausalLM
t1 = time.perf_counter()
model = ExlForCausalLM.from_pretrained(sys.argv[1], device=sys.argv[2], max_seq_len=2048)
t2 = time.perf_counter()
if sys.argv[3] == "engine":
    from exl_backends import Generator
    Generator(model).submit([1, 2, 3, 4], max_new_tokens=1, stop_token_ids=[], text=False).result()
else:
    model.generate(torch.tensor([[1, 2, 3, 4]], device=model.device), max_new_tokens=1, do_sample=False)
if model.device.type == "cuda":
    torch.cuda.synchronize()
t3 = time.perf_counter()
print(json.dumps({"imports": t1 - t0, "from_pretrained": t2 - t1, "first_token": t3 - t2,
                  "transformers_imported": "transformers" in sys.modules}))
"""


def load_time(model_dir: str, device: str, kernel_cache: str | None = None,
              env: dict[str, str] | None = None, route: str = "generate") -> dict[str, float]:
    """Seconds of a fresh process: imports, from_pretrained, then the first token of a 4-token prompt (on CUDA
    this compiles any kernel the cache lacks), through transformers' API (route "generate": ExlForCausalLM.generate)
    or the engine's ("engine": Generator.submit of token ids, as the server and the adapters decode); whether
    transformers got imported is reported too. kernel_cache: CuPy's cache directory for the run
    (an empty one gives the cold figure); None: the user's. env: more variables for the process (an empty HOME,
    say)."""
    env = dict(os.environ, **(env or {}))
    if kernel_cache is not None:
        env["CUPY_CACHE_DIR"] = kernel_cache
    out = subprocess.run([sys.executable, "-c", _LOAD_PROBE, str(model_dir), device, route], env=env,
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the load-time probe failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def load_report(model_dir: str, device: torch.device) -> list[str]:
    """`exl bench`'s load lines: from_pretrained to the first token in a fresh process, warm (the kernel cache as
    it is, the weights in the page cache after the first run) through generate() and through the engine, and, on
    CUDA, cold (an empty kernel cache)."""
    runs = [("warm", None, "generate"), ("warm, through the engine", None, "engine")]
    if device.type == "cuda":
        runs.insert(0, ("cold kernel cache", tempfile.mkdtemp(prefix="exl-bench-kernels-"), "generate"))
    lines = []
    for name, cache, route in runs:
        t = load_time(model_dir, device.type, cache, route=route)
        lines.append(f"load, {name}: from_pretrained {t['from_pretrained']:.2f} s + first token {t['first_token']:.2f} s"
                     f" = {t['from_pretrained'] + t['first_token']:.2f} s (imports before it {t['imports']:.2f} s)")
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
    return lines


def decode_schedule(model: Model | TensorParallelModel) -> str:
    """How a one-sequence decode step runs its matmuls as megakernel launches (`exl bench --schedule`): one chained
    step, the first two launches and the last in full (the ones between repeat the second's layout); then the
    pipelined megakernel's planned step table (model/step_table.py) for this model, in each of its layouts."""
    return _segment_schedule(model) + _planned_tables(model)


def _planned_tables(model: Model | TensorParallelModel) -> str:
    if not isinstance(model, Model) or step_table.supported(model) is not None:
        return ""
    sms = torch.cuda.get_device_properties(model.device).multi_processor_count if model.device.type == "cuda" else 132
    tables = [step_table.describe(step_table.build(model.config, sms, layout)) for layout in step_table.LAYOUTS]
    return ("\n\nthe pipelined megakernel's step table (planned, docs/megakernel.md; run today only by its CPU "
            f"interpreter), for {sms} SMs" + ("" if model.device.type == "cuda" else " (an H100's)") + ":\n"
            + "\n".join(tables))


def _segment_schedule(model: Model | TensorParallelModel) -> str:
    if not (isinstance(model, Model) and megakernel.enabled(model.device) and model.chainable()):
        return ("decode runs launch-per-op on this model: the megakernel needs one GPU of compute capability 9.0+, "
                "EXL2 weights, a Llama-family block, and EXL_MEGAKERNEL=1 (it is off by default)")
    cache = _cache(model, 2, 256, "fp16")
    batch = Batch.build([SeqChunk([1], 0, cache.pool.allocate(1))], 256, model.device)
    with megakernel.chaining(megakernel.counters(len(model.blocks), model.device)) as chain:
        model.forward(batch, cache)
    segments = chain.segments
    shown = list(enumerate(segments))
    shown = shown[:2] + shown[-1:] if len(shown) > 3 else shown
    lines = [f"a decode step of one sequence: {len(segments)} megakernel launches (each block's RoPE + KV write and "
             f"attention launch between two of them)"]
    for i, (ops, grid) in shown:
        if i == len(segments) - 1 and len(segments) > 3:
            lines.append(f"... launches 2-{len(segments) - 2} as launch 1")
        lines.append(f"launch {i}: " + megakernel.describe(ops, grid))
    return "\n".join(lines)
