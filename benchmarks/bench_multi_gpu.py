"""Multi-GPU decode and prefill: one GPU vs a layer split over two vs tensor parallel over two, on a synthetic
EXL2 model (random codes in the real layout, 4.0 bpw body, 6-bit head). Needs 2 GPUs.

Bounds at batch 1: a layer split reads every weight once per token, one GPU at a time, so its bound is one GPU's
bandwidth; tensor parallel reads half the weights on each GPU at once, so its bound is two GPUs' bandwidth (minus
two all-reduces per layer and a logits all-gather per token).

    python benchmarks/bench_multi_gpu.py [--shape llama-3-8b] [--context 256] [--prefill 4096]

It writes the EXL2 directory once (to --dir, default /tmp/exl-bench-<shape>) so that every engine loads the same
file (random packed words drawn on the GPU: about a minute even for the 70B shape), and runs tensor parallel through
ExlForCausalLM.from_pretrained(tensor_parallel=2). Decode goes through the generator's Runner, which replays CUDA
graphs: tensor parallel's on every rank, a layer split's one per GPU in turn."""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import BODY_MIX, HEAD_MIX, SHAPES, random_exl2  # noqa: E402

from exl_backends import ExlForCausalLM  # noqa: E402
from exl_backends.commands.bench import copy_bandwidth, decode_speed, prefill_speed  # noqa: E402
from exl_backends.formats.exl2_writer import linear_tensors, shard_names  # noqa: E402

FIXTURES = Path(os.environ.get("EXL_FIXTURES", Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "exl2-ref"))
TOKENIZER = FIXTURES / "hf" / "llama_tiny"


LAYERS_PER_SHARD = 8


def write_model(directory: Path, shape: str) -> None:
    """An EXL2 checkpoint of the shape: body 4.0 bpw (4-bit codes in 128-row groups), head ExLlamaV2's default 6-bit
    mix, act-order; random packed words (valid codes of any width) drawn on the GPU, so even the 70B shape takes
    about a minute to write. Shards of LAYERS_PER_SHARD layers, named as ExLlamaV2 names them."""
    if (directory / "config.json").is_file():
        return
    directory.mkdir(parents=True, exist_ok=True)
    s = SHAPES[shape]
    d, heads, kv, layers = s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"], s["num_hidden_layers"]
    hd, inter = d // heads, s["intermediate_size"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)

    def vector(n):
        return (1 + 0.05 * torch.randn(n, generator=gen, device=device)).half()

    def linear(key, k, n, mix=BODY_MIX):
        return {name: t.cpu() for name, t in linear_tensors(key, random_exl2(k, n, mix, device, gen)).items()}
    shapes = {"self_attn.q_proj": (d, heads * hd), "self_attn.k_proj": (d, kv * hd), "self_attn.v_proj": (d, kv * hd),
              "self_attn.o_proj": (heads * hd, d), "mlp.gate_proj": (d, inter), "mlp.up_proj": (d, inter),
              "mlp.down_proj": (inter, d)}
    names = shard_names(-(-layers // LAYERS_PER_SHARD) + 1)
    for shard, first in zip(names, range(0, layers, LAYERS_PER_SHARD)):
        tensors = {}
        for i in range(first, min(first + LAYERS_PER_SHARD, layers)):
            for norm in ("input_layernorm", "post_attention_layernorm"):
                tensors[f"model.layers.{i}.{norm}.weight"] = vector(d).cpu()
            for name, (k, n) in shapes.items():
                tensors.update(linear(f"model.layers.{i}.{name}", k, n))
        save_file(tensors, str(directory / shard))
    tensors = {"model.embed_tokens.weight": (torch.randn(s["vocab_size"], d, generator=gen, device=device) * 0.02)
               .half().cpu(), "model.norm.weight": vector(d).cpu()}
    if not s["tie_word_embeddings"]:
        tensors.update(linear("lm_head", d, s["vocab_size"], HEAD_MIX))
    save_file(tensors, str(directory / names[-1]))
    config = dict(s, architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5,
                  rope_theta=500000.0, max_position_embeddings=131072, bos_token_id=1, eos_token_id=2,
                  quantization_config={"quant_method": "exl2", "bits": 4.0, "head_bits": 6})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((TOKENIZER / name).read_bytes())
    (directory / "config.json").write_text(json.dumps(config))       # last: its presence means the rest is there


def decode_tok_s(lm: ExlForCausalLM, context: int, steps: int = 64) -> float:
    """Batch-1 decode at a context (cache filled with random K/V), a host sync per token as generation does;
    through the generator's Runner, which replays CUDA graphs (a layer split's one per GPU)."""
    return decode_speed(lm.model, context, lm.cache_mode, steps, lm.page_size)["tok_s"]


def weight_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--engines", default="single,split,tp2")
    ap.add_argument("--watchdog", type=float, default=180,
                    help="print every thread's stack each this many seconds (where a stalled run waits)")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.watchdog, repeat=True)
    directory = Path(args.dir or f"/tmp/exl-bench-{args.shape}")
    t0 = time.perf_counter()
    write_model(directory, args.shape)
    print(f"model written in {time.perf_counter() - t0:.0f} s", flush=True)
    bw = copy_bandwidth(torch.device("cuda", 0))
    nbytes = weight_bytes(directory)
    seq = args.context + args.prefill + 128
    load = {"single": dict(device="cuda:0"), "split": dict(gpu_split="auto"), "tp2": dict(tensor_parallel=2)}
    bounds = {"single": bw / nbytes, "split": bw / nbytes, "tp2": 2 * bw / nbytes}
    rows, logits = [], {}
    probe = torch.randint(0, SHAPES[args.shape]["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(0))
    for engine in args.engines.split(","):
        clock = [time.perf_counter()]                    # each phase's wall time: where a slow run spent it

        def lap() -> float:
            clock.append(time.perf_counter())
            return round(clock[-1] - clock[-2], 1)
        lm = ExlForCausalLM.from_pretrained(directory, max_seq_len=seq, **load[engine])
        seconds = dict(load=lap())
        if lm.placement is not None:
            print(lm.placement.describe())
        logits[engine] = lm(probe).logits.cpu()          # every engine against the first on the same tokens
        seconds["logits"] = lap()
        first = logits[next(iter(logits))]
        row = dict(engine=engine, decode_tok_s=decode_tok_s(lm, args.context), decode_bound=bounds[engine])
        seconds["decode"] = lap()
        row["prefill_tok_s"] = prefill_speed(lm.model, args.prefill, lm.page_size)
        seconds["prefill"] = lap()
        rows.append(dict(row, logits_rel_l2=float((logits[engine] - first).norm() / first.norm()),
                         argmax_agree=float((logits[engine].argmax(-1) == first.argmax(-1)).float().mean()),
                         seconds=seconds))
        print(rows[-1], flush=True)
        if engine == "tp2":
            lm.model.close()
        del lm
        torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_multi_gpu.json").write_text(json.dumps(dict(shape=args.shape, copy_bw=bw, bytes=nbytes,
                                                                     rows=rows), indent=1))
    print(f"\n{args.shape}, {nbytes / 1e9:.2f} GB of weights; copy bandwidth {bw / 1e12:.2f} TB/s "
          f"({torch.cuda.get_device_name(0)})")
    print(f"{'engine':8} {'decode tok/s':>13} {'bound':>8} {'%':>5} {'prefill ' + str(args.prefill):>14} "
          f"{'logits vs ' + rows[0]['engine']:>26}")
    for r in rows:
        print(f"{r['engine']:8} {r['decode_tok_s']:13.1f} {r['decode_bound']:8.1f} "
              f"{100 * r['decode_tok_s'] / r['decode_bound']:5.1f} {r['prefill_tok_s']:14.1f} "
              f"  rel L2 {r['logits_rel_l2']:.1e}, argmax {r['argmax_agree']:.3f}")


if __name__ == "__main__":
    main()
