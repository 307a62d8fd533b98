"""Conversion time: `exl convert -b 4.0` of a Llama-3-8B-shape fp16 model (issue 5: under 15 minutes on the H200).

    python benchmarks/bench_convert.py [--shape llama-3-8b] [--device cuda] [-b 4.0] [--work DIR] [--keep]

Under a per-command time limit: `timeout 570 python benchmarks/bench_convert.py --work /tmp/bc` and the same
again until it prints the summary; the conversion job resumes (stage times add up over the runs). Under a
device time budget: --layers 4 converts the first 4 layers and scales the per-layer stages to the shape's 32.

Needs no network and no ../shared: it writes a random fp16 checkpoint of the shape shard by shard (linears and
embeddings N(0, 0.02²), norms 1 + 0.05 N(0, 1); drawn on the conversion device, never the whole model in
memory), a word-level tokenizer with one word per token id of the model's vocabulary, and synthetic calibration
text (Zipf-distributed words, enough for the converter's default rows plus held-out rows). Then it converts in
this process, through the CLI, with the converter's defaults for a calibration file (CUDA: 100 rows x 2048
tokens, 16 measurement rows, 16 held out; CPU: 32 x 512, 4, 8), prints the seconds of each stage as the job
booked them (job.json), peak memory and one summary line, and deletes everything it wrote (--keep keeps it;
--work keeps it until the conversion finishes).
Disk: about 2.1x the fp16 size at the peak (source, job states, quantized layers, output): ~34 GB for 8B.
Shapes: benchmarks/shapes.py's (llama-3.2-1b for a quick GPU run) and "tiny" (a CPU smoke test, ~30 s).

Prediction for llama-3-8b on one H200, made before any GPU run, from reading the code and counting operations
(aten ops under a TorchDispatchMode on the CPU at the shape's projections and real candidate settings; on CUDA a
captured graph's replay counts as one, its capture as the ops it ran).
First version: ~22-32 minutes. GPTQ's row loop issued ~31 ops a row: 4.17M ops a layer measuring, 1.19M
quantizing, 171M in all, each a launch of a tiny kernel (~4-6 us of host time): ~12-17 min alone; every
sub-layer run moved the rows' states to the GPU and back (3.4 GB each way quantizing), token errors on the CPU,
3.4 GB of states written per layer, every packed linear checked on the CPU.
Now: expect ~9-12 minutes, so under 15 is plausible (not yet measured):
- GPTQ (~1.5-2.5 min). A row of all settings is 7 ops on [S, N] tiles (quantize, error, rank-1 update of the
  block), a block's 32 rows one CUDA graph, each group-scale search one graph per group size starting at a block
  (the settings' bit widths batched), the batch cap raised to total memory / 128 B (every projection's settings
  in one batch on an H200). Ops issued a layer: measurement 72.6k (4.2k-25k a projection, ~half of them views,
  8.5k of it one-off captures), quantization 40.8k; 3.6M in all (47x fewer); ~20 s of host time. GPU time a layer:
  ~1216 blocks x 225 small kernels measuring and again quantizing (~1.2 s) plus the grid searches (~1 s).
  Eagerly (the CPU path) 587k / 345k ops a layer (5.8x fewer than before).
- Forward passes (~6 min) unchanged: f32 matmuls without TF32 at ~50 TFLOPS: measurement runs 19 attention and
  17 MLP candidates over 16 x 2048 tokens, the quantization pass each sub-layer twice over 100 x 2048 tokens.
- Host side (<1 min): the rows' states stay on the GPU (when 4 copies fit in half the free memory: 14 GB of
  an H200's 140), token errors are computed there, packed linears are checked there, and each layer's states
  file (the resume point) is written by a background thread while the next layer computes.
- Calibration, optimization, writing ~5.8 GB and the receipt (16 x 2048 tokens through both models): ~1-2 min.
Measured (H200, 2026-11-30, 69ddb40, 4 of 32 layers): ~15.8 min, measure ~13 s and quantize ~10 s a layer. With the
converter's linears in TF32 on CUDA (convert/forward.py _tf32; no quality loss in a CPU emulation on SmolLM2):
11.1 min (2026-11-30, 4bad357; BENCHMARKS.md). Further: the receipt's states on the GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES  # noqa: E402

from exl_backends import cli  # noqa: E402
from exl_backends.convert.pipeline import DEFAULTS  # noqa: E402

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)
ALL_SHAPES = {**SHAPES, "tiny": TINY}
SHARD_BYTES = 2 * 1024 ** 3
TARGET_SECONDS = {"llama-3-8b": 15 * 60}          # issue 5, on the H200
STAGES = ("calibrate", "measure", "optimize", "quantize", "compile", "receipt")
PER_LAYER = ("measure", "quantize", "compile", "receipt")


# ----------------------------------------------------------------------------------------------- source model


def llama_config(shape: dict) -> dict:
    v = shape["vocab_size"]
    return dict(shape, architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5,
                rope_theta=500000.0, max_position_embeddings=8192, hidden_act="silu", torch_dtype="float16",
                head_dim=shape["hidden_size"] // shape["num_attention_heads"], bos_token_id=v - 2,
                eos_token_id=v - 1)


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Llama checkpoint in file order."""
    d, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (cfg["vocab_size"], d))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", (d,)), (f"{p}.self_attn.q_proj.weight", (q, d)),
                (f"{p}.self_attn.k_proj.weight", (kv, d)), (f"{p}.self_attn.v_proj.weight", (kv, d)),
                (f"{p}.self_attn.o_proj.weight", (d, q)), (f"{p}.post_attention_layernorm.weight", (d,)),
                (f"{p}.mlp.gate_proj.weight", (inter, d)), (f"{p}.mlp.up_proj.weight", (inter, d)),
                (f"{p}.mlp.down_proj.weight", (d, inter))]
    out.append(("model.norm.weight", (d,)))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (cfg["vocab_size"], d)))
    return out


def write_checkpoint(directory: Path, cfg: dict, device: torch.device, seed: int = 0) -> None:
    """Random fp16 weights, written in shards of at most SHARD_BYTES, with the HF index."""
    gen = torch.Generator(device).manual_seed(seed)
    weight_map, shard, size, files = {}, {}, 0, []

    def flush():
        nonlocal shard, size
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update({t: name for t in shard})
        shard, size = {}, 0

    for name, shape in tensor_shapes(cfg):
        if len(shape) == 1:
            t = 1 + 0.05 * torch.randn(shape, generator=gen, device=device)
        else:
            t = 0.02 * torch.randn(shape, generator=gen, device=device)
        nbytes = math.prod(shape) * 2
        if shard and size + nbytes > SHARD_BYTES:
            flush()
        shard[name], size = t.half().cpu(), size + nbytes
    flush()
    total = sum(math.prod(s) * 2 for _, s in tensor_shapes(cfg))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer: token i is the word 'w{i}' ('<unk>' 0, BOS and EOS the last two ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"w{i}": i for i in range(1, vocab_size - 2)} | {"<unk>": 0, "<s>": vocab_size - 2,
                                                               "</s>": vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "unk_token": "<unk>", "model_max_length": 8192}))


def write_calibration(path: Path, vocab_size: int, n_tokens: int, seed: int = 0) -> None:
    """n_tokens words w1..w{V-3}, Zipf-distributed (p(rank r) ~ 1 / (r + 10)^1.1) as words of real text are, so
    the rows see many distinct embeddings and the Hessians are full rank."""
    ids = np.arange(1, vocab_size - 2)
    p = 1.0 / (ids + 9.0) ** 1.1
    words = np.random.default_rng(seed).choice(ids, size=n_tokens, p=p / p.sum())
    lines = [" ".join(f"w{i}" for i in words[r: r + 64]) for r in range(0, n_tokens, 64)]
    path.write_text("\n".join(lines))


# ----------------------------------------------------------------------------------------------- run


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2          # Linux: KiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(ALL_SHAPES), default="llama-3-8b")
    ap.add_argument("-b", "--bits", type=float, default=4.0)
    ap.add_argument("--layers", type=int, default=None,
                    help="convert only the first N layers of the shape and extrapolate the per-layer stages to all "
                         "(every layer costs the same), to fit a device time budget")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--work", default=None,
                    help="scratch directory, kept until the conversion finishes: after an interruption (a time "
                         "limit) the same command continues where it stopped (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (model, job, output)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.work:
        work = Path(args.work) / f"{args.shape}-{args.layers or 'all'}-{device.type}-{args.bits}"
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="bench_convert-"))
    finished = False
    try:
        made = make_source(work, args.shape, args.layers, device)
        compiled = compile_kernels(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        rc = cli.main(["convert", "-i", str(work / "src"), "-o", str(work / "out"), "-b", str(args.bits), "-c",
                       str(work / "calibration.txt"), "--device", args.device])
        if rc:
            sys.exit(f"bench_convert: exl convert failed (exit {rc}); scratch directory {work}")
        finished = True
        report(work, args, made, compiled, time.perf_counter() - t0)
    finally:
        if not args.keep and (finished or not args.work):
            shutil.rmtree(work, ignore_errors=True)


def compile_kernels(device: torch.device) -> float:
    """Compiles every kernel family now, timed apart: NVRTC compiles each once per machine (CuPy keeps the binaries
    on disk), and inside the conversion that one-off landed in the receipt's first layer (~21 s of its 25 on a
    fresh H200), where --layers scaled it 8x with the per-layer stages. Returns the seconds."""
    if device.type != "cuda":
        return 0.0
    from exl_backends.kernels import loader
    t0 = time.perf_counter()
    for source in sorted(loader.KERNEL_DIR.glob("*.cu")):
        loader.module(source.stem, loader.compute_capability(device))
    return time.perf_counter() - t0


def make_source(work: Path, shape: str, layers: int | None, device: torch.device) -> float:
    """Writes the model, tokenizer and calibration text into work unless an earlier run did; returns the
    seconds that took."""
    done = work / "source.done"
    if done.is_file():
        return float(done.read_text())
    cfg = llama_config(ALL_SHAPES[shape] | ({"num_hidden_layers": layers} if layers else {}))
    rows, length, _, eval_rows = DEFAULTS[(device.type, "file")]
    fp16_bytes = sum(math.prod(s) * 2 for _, s in tensor_shapes(cfg))
    free = shutil.disk_usage(work).free
    if free < 2.2 * fp16_bytes:
        sys.exit(f"bench_convert: {work} has {free / 1e9:.1f} GB free; {shape} needs ~{2.2 * fp16_bytes / 1e9:.0f} "
                 f"GB (pass --work DIR on a larger disk)")
    t0 = time.perf_counter()
    src = work / "src"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir()
    write_checkpoint(src, cfg, device)
    write_tokenizer(src, cfg["vocab_size"])
    write_calibration(work / "calibration.txt", cfg["vocab_size"], (rows + eval_rows + 2) * length)
    made = time.perf_counter() - t0
    done.write_text(f"{made:.1f}")
    print(f"{shape}: {fp16_bytes / 1e9:.2f} GB fp16 source written in {made:.0f} s", flush=True)
    return made


def report(work: Path, args, made: float, compiled: float, wall: float) -> None:
    """Seconds per stage as the job booked them (summed over resumed runs) and the kernels' one-off compile,
    the receipt's numbers, peaks."""
    job = json.loads((work / "out.job" / "job.json").read_text())
    seconds, quality = job["seconds"], json.loads((work / "out" / "quality.json").read_text())
    cal = job["calibration"]
    total = sum(seconds.values())
    full = ALL_SHAPES[args.shape]["num_hidden_layers"]
    if args.layers and args.layers < full:       # per layer: measure, quantize (+ the head), compile, receipt
        scaled = {s: t * (full / args.layers if s in PER_LAYER else 1) for s, t in seconds.items()}
        print(f"{args.layers} of {full} layers converted in {total:.0f} s; extrapolated to {full}:")
        seconds, total = scaled, sum(scaled.values())
    cuda = args.device == "cuda"
    seconds["kernels"] = compiled       # once per machine: never scaled
    total += compiled
    for stage in ("kernels", *STAGES):
        print(f"  {stage:10s} {seconds.get(stage, 0.0):8.1f} s")
    stages = " ".join(f"{s} {seconds.get(s, 0.0):.0f}" for s in ("kernels", *STAGES))
    target = TARGET_SECONDS.get(args.shape)
    verdict = "" if target is None else f" | target {target // 60} min: {'met' if total <= target else 'MISSED'}"
    layers = f" ({args.layers} layers, extrapolated)" if args.layers else ""
    print(f"bench_convert {args.shape}{layers} {torch.cuda.get_device_name() if cuda else 'cpu'} -b {args.bits}: "
          f"{total:.0f} s = {total / 60:.1f} min ({stages}; this run {wall:.0f} s, source {made:.0f} s) | "
          f"{quality['bpw']:.3f} bpw, ppl {quality['perplexity']:.2f} (fp16 {quality['perplexity_fp16']:.2f}), "
          f"KL {quality['kl_divergence']:.4f} | {cal['rows']} x {cal['length']} rows | peak GPU "
          f"{torch.cuda.max_memory_allocated() / 1024 ** 3 if cuda else 0.0:.1f} GiB (this run), peak RSS "
          f"{peak_rss_gib():.1f} GiB{verdict}", flush=True)


if __name__ == "__main__":
    main()
