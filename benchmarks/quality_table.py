"""The converter's quality table (BENCHMARKS.md): SmolLM2-135M-Instruct converted on the CPU, calibrated on
wikitext-2 valid.txt, scored on test.txt against the fp16 model with our engine.

    python benchmarks/quality_table.py FP16_DIR WORK_DIR [--valid FILE] [--test FILE] [--ctx 512] [--tokens N]

Converts every variant into WORK_DIR (skipping finished ones; each conversion is resumable), then scores all
of them in one pass over the test windows so the fp16 logits are computed once per window. Prints the
markdown table and writes WORK_DIR/quality_table.json."""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from exl_backends import ExlForCausalLM
from exl_backends.commands.evaluate import Scores, score, text_tokens, windows
from exl_backends.convert.pipeline import ConvertOptions, convert

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2"
EXL2_BITS = (3.0, 3.5, 4.0, 4.15, 5.0, 6.0, 8.0)


def variants(src: Path, work: Path, valid: Path) -> dict[str, ConvertOptions]:
    """name -> conversion, in table order. EXL2 targets other than 4.0 reuse its measurement, as a user would."""
    cal = str(valid)
    measured = work / "exl2-4.0" / "measurement.json"
    out = {"RTN 4-bit g128 (GPTQ layout)": ConvertOptions(src, work / "rtn4-g128", 4, calibration=cal,
                                                          format="gptq", act_order=False, rtn=True, device="cpu"),
           "GPTQ 4-bit g128 act-order": ConvertOptions(src, work / "gptq4-g128", 4, calibration=cal, format="gptq",
                                                       device="cpu")}
    for bits in EXL2_BITS:
        out[f"EXL2 {bits} bpw"] = ConvertOptions(src, work / f"exl2-{bits}", bits, calibration=cal, device="cpu",
                                                 measurement=None if bits == 4.0 else measured)
    out["EXL2 4.0 bpw, built-in calibration"] = ConvertOptions(src, work / "exl2-4.0-default", 4.0, device="cpu")
    return out


@torch.inference_mode()
def evaluate_all(ref: ExlForCausalLM, models: dict[str, Path], tokens: torch.Tensor, ctx: int) -> dict[str, Scores]:
    """Each model against the fp16 reference on the same windows, the reference run once per window."""
    loaded = {name: ExlForCausalLM.from_pretrained(path, device="cpu", max_seq_len=ctx)
              for name, path in models.items()}
    scores = {name: Scores() for name in ["fp16"] + list(loaded)}
    spans = windows(len(tokens), ctx, ctx)
    for n, (begin, end, first) in enumerate(spans):
        rows = slice(first - 1 - begin, end - 1 - begin)
        ref_logits = ref(tokens[None, begin:end]).logits[0][rows]
        targets = tokens[first:end]
        scores["fp16"].add(score(ref_logits, targets, ref_logits))
        for name, model in loaded.items():
            scores[name].add(score(model(tokens[None, begin:end]).logits[0][rows], targets, ref_logits))
        logging.info("window %d/%d", n + 1, len(spans))
    return scores


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("fp16_dir", type=Path)
    ap.add_argument("work_dir", type=Path)
    ap.add_argument("--valid", type=Path, default=DATA / "valid.txt")
    ap.add_argument("--test", type=Path, default=DATA / "test.txt")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=16384)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    runs = variants(args.fp16_dir, args.work_dir, args.valid)
    first = "EXL2 4.0 bpw"                    # measures; the other EXL2 targets reuse its measurement
    times_file = args.work_dir / "times.json"
    times = json.loads(times_file.read_text()) if times_file.is_file() else {}
    for name, opts in sorted(runs.items(), key=lambda item: item[0] != first):
        if (opts.output_dir / "quality.json").is_file():
            continue
        wall, cpu = time.time(), time.process_time()
        convert(opts)
        times[name] = {"wall": time.time() - wall, "cpu": time.process_time() - cpu}
        times_file.write_text(json.dumps(times, indent=2))
        logging.info("%s: %.0f s wall, %.0f s CPU", name, times[name]["wall"], times[name]["cpu"])
    ref = ExlForCausalLM.from_pretrained(args.fp16_dir, device="cpu", max_seq_len=args.ctx)
    tokens = text_tokens(ref.tokenizer, args.test, args.tokens)
    scores = evaluate_all(ref, {name: o.output_dir for name, o in runs.items()}, tokens, args.ctx)
    rows = []
    for name, s in scores.items():
        q = json.loads((runs[name].output_dir / "quality.json").read_text()) if name in runs else {}
        job = json.loads(Path(f"{runs[name].output_dir}.job/job.json").read_text()) if name in runs else {}
        rows.append({"name": name, "bpw": q.get("bpw", 16.0), "perplexity": s.perplexity, "kl": s.mean_kl,
                     "top1": s.top1_agreement, "tokens": s.tokens, "stages": job.get("seconds"),
                     **times.get(name, {})})
    (args.work_dir / "quality_table.json").write_text(json.dumps(rows, indent=2))
    print("| model | bpw written | perplexity | KL vs fp16 | top-1 agreement | conversion: CPU time (wall) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        t = f"{r['cpu'] / 60:.1f} min ({r['wall'] / 60:.1f})" if "cpu" in r else "—"
        print(f"| {r['name']} | {r['bpw']:.3f} | {r['perplexity']:.3f} | {r['kl']:.4f} | {r['top1']:.4f} | {t} |")
    print(f"\n{rows[0]['tokens']} tokens of {args.test.name}, ctx {args.ctx}")


if __name__ == "__main__":
    main()
