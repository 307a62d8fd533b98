"""What a kernel's loops execute, without a GPU: compiles a kernels/*.cu as the loader does (NVRTC, the loader's
options, sm_90a unless told), disassembles it (nvdisasm: CUDA's, or the nvidia-cuda-nvdisasm wheel's) and prints
every loop of the named kernels (a backward branch and what lies between it and its target): SASS instructions,
tensor-core MMAs (HMMA) and the most frequent opcodes. Counting here before a GPU run says whether a change to a
chunk loop removed the instructions it meant to (the one-row matmul: docs/decode-matmul.md, docs/megakernel.md).

    python benchmarks/sass_loops.py matmul_rows --kernel exl2_matmul_m1 [--defines QMM_PREFETCH_BYTES=2048,...]
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from exl_backends.kernels.loader import KERNEL_DIR, nvrtc_options  # noqa: E402


def cuda_include_dir() -> Path | None:
    """The CUDA headers NVRTC needs (cuda_fp16.h): CuPy passes its CUDA path's include dir at run time."""
    candidates = [os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    try:
        import cupy
        candidates.insert(0, cupy.cuda.get_cuda_path() or "")
    except ImportError:
        pass
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    for c in candidates:
        if c and (Path(c) / "include" / "cuda_fp16.h").is_file():
            return Path(c) / "include"
    return None


def nvdisasm() -> str | None:
    """CUDA's nvdisasm, or the one in the nvidia-cuda-nvdisasm wheel (nvidia/cu*/bin)."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for path in sorted(Path(root).glob("cu*/bin/nvdisasm")):
            return str(path)
    return None


def compile_cubin(family: str, arch: str = "sm_90a", defines: tuple[str, ...] = ()) -> bytes:
    """`<family>.cu` compiled by NVRTC with loader.module's options (plus -D defines) into a cubin for arch."""
    from cupy_backends.cuda.libs import nvrtc
    include = cuda_include_dir()
    if include is None:
        raise SystemExit("CUDA headers (cuda_fp16.h) not found: set CUDA_PATH")
    source = f'#line 1 "{family}.cu"\n' + (KERNEL_DIR / f"{family}.cu").read_text()
    # -arch=, not --gpu-architecture=: CuPy's getCUBIN looks for that spelling of a real architecture
    options = [*nvrtc_options(family), f"-I{include}", f"-arch={arch}", *(f"-D{d}" for d in defines)]
    prog = nvrtc.createProgram(source, f"{family}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, options)
        return whole_elf(nvrtc.getCUBIN(prog))
    except nvrtc.NVRTCError:
        raise SystemExit(nvrtc.getProgramLog(prog)) from None
    finally:
        nvrtc.destroyProgram(prog)


def whole_elf(image: bytes) -> bytes:
    """CuPy's getCUBIN returns the image one byte short (cut as a C string; CuPy 14, NVRTC 13.5): zeros back to the
    end its header gives (the program and section header tables)."""
    phoff, shoff = struct.unpack_from("<QQ", image, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", image, 0x36)
    size = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    return image + bytes(max(0, size - len(image)))


def disassemble(cubin: bytes) -> str:
    tool = nvdisasm()
    if tool is None:
        raise SystemExit("nvdisasm not found: install CUDA's, or `pip install nvidia-cuda-nvdisasm`")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], check=True, capture_output=True, text=True).stdout


def functions(sass: str) -> dict[str, list[str]]:
    """Each kernel's lines of an nvdisasm listing, by name."""
    out: dict[str, list[str]] = {}
    name = None
    for line in sass.splitlines():
        m = re.match(r"^\.text\.(\w+):", line)
        if m:
            name = m.group(1)
            out[name] = []
        elif line.startswith("//----"):
            name = None
        elif name:
            out[name].append(line)
    return out


@dataclass
class Loop:
    start: int                   # index of the first instruction (the branch target)
    end: int                     # index of the backward branch
    opcodes: collections.Counter

    @property
    def size(self) -> int:
        return self.end - self.start + 1


def opcode(instruction: str) -> str:
    """HMMA of `@!P0 HMMA.16816.F32 R60, ...`: the predicate and the modifiers dropped."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def parse(lines: list[str]) -> tuple[dict[str, int], list[str]]:
    """A kernel's listing as its labels (name -> index of the instruction after it) and its instructions."""
    labels, instructions = {}, []
    for line in lines:
        m = re.match(r"^\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(instructions)
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            instructions.append(m.group(1))
    return labels, instructions


def loops(lines: list[str]) -> list[Loop]:
    """Every backward branch of a kernel's listing with the instructions from its target to it, in listing order.
    A span with an EXIT in it is not a loop: the compiler puts the retry loops of waits (mbarrier try_wait) after
    the kernel's end, each branching back into the body."""
    labels, instructions = parse(lines)
    found = []
    for i, ins in enumerate(instructions):
        m = re.search(r"\bBRA\b.*?(\.L_x_\d+)", ins)
        if m and labels.get(m.group(1), i + 1) <= i:
            start = labels[m.group(1)]
            opcodes = collections.Counter(opcode(x) for x in instructions[start:i + 1])
            if not opcodes["EXIT"]:
                found.append(Loop(start, i, opcodes))
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("family", help="a kernels/*.cu file's name, without .cu")
    ap.add_argument("--kernel", default="", help="regex of the kernel names to show (default: all)")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--defines", default="", help="comma-separated NAME=VALUE, as -D")
    ap.add_argument("--min-size", type=int, default=20, help="loops shorter than this many instructions are left out")
    ap.add_argument("--top", type=int, default=10, help="opcodes shown per loop")
    args = ap.parse_args()
    defines = tuple(d for d in args.defines.split(",") if d)
    for name, lines in functions(disassemble(compile_cubin(args.family, args.arch, defines))).items():
        if not re.search(args.kernel, name):
            continue
        print(f"{name}: {len(parse(lines)[1])} instructions")
        for lp in loops(lines):
            if lp.size < args.min_size:
                continue
            mix = ", ".join(f"{op} {n}" for op, n in lp.opcodes.most_common(args.top))
            print(f"  loop {lp.start}-{lp.end}: {lp.size} instructions, HMMA {lp.opcodes['HMMA']}: {mix}")


if __name__ == "__main__":
    main()
