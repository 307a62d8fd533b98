"""Every kernels/*.cu compiles for every GPU generation we support, with nvcc and with NVRTC (what the loader uses
at run time). Needs no GPU: nvcc only compiles; NVRTC is called through CuPy's binding without touching a device.
New .cu files are picked up automatically."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from exl_backends.kernels.loader import KERNEL_DIR

SOURCES = sorted(p.name for p in KERNEL_DIR.glob("*.cu") if not p.name.startswith("_"))
ARCHS = ["sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_90a"]   # 90a: what the loader compiles on 9.0
NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES)
def test_nvcc_compiles(source, arch):
    result = subprocess.run([NVCC, "-std=c++17", f"-I{KERNEL_DIR}", f"-arch={arch}", "-c", "-o", os.devnull,
                             str(KERNEL_DIR / source)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr.lower(), result.stderr


def cuda_include_dir() -> Path | None:
    """The CUDA headers NVRTC needs (cuda_fp16.h): CuPy passes its CUDA path's include dir at run time."""
    candidates = [os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    try:
        import cupy
        candidates.insert(0, cupy.cuda.get_cuda_path() or "")
    except ImportError:
        pass
    if NVCC:
        candidates.append(str(Path(NVCC).resolve().parent.parent))
    for c in candidates:
        if c and (Path(c) / "include" / "cuda_fp16.h").is_file():
            return Path(c) / "include"
    return None


def nvrtc_or_skip():
    """CuPy's NVRTC binding and the CUDA include dir, or the test skips."""
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="CuPy (NVRTC) not installed")
    include = cuda_include_dir()
    if include is None:
        pytest.skip("CUDA headers (cuda_fp16.h) not found")
    try:
        nvrtc.getVersion()
    except Exception as e:     # CuPy installed, NVRTC library not loadable here
        pytest.skip(f"NVRTC not loadable: {e}")
    return nvrtc, include


def nvrtc_compile(nvrtc, code: str, name: str, options: list[str], expressions: list[str] = ()) -> str:
    """Compiles code (and instantiates the name expressions); fails the test with NVRTC's log, else returns it."""
    prog = nvrtc.createProgram(code, name, [], [])
    for e in expressions:
        nvrtc.addNameExpression(prog, e)
    try:
        nvrtc.compileProgram(prog, options)
    except nvrtc.NVRTCError:
        pytest.fail(nvrtc.getProgramLog(prog))
    finally:
        log = nvrtc.getProgramLog(prog)
        nvrtc.destroyProgram(prog)
    return log


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("source", SOURCES)
def test_nvrtc_compiles(source, arch):
    nvrtc, include = nvrtc_or_skip()
    code = f'#line 1 "{source}"\n' + (KERNEL_DIR / source).read_text()      # as loader.module() compiles it
    options = ["-std=c++17", f"-I{KERNEL_DIR}", f"-I{include}", f"--gpu-architecture={arch}", "--use_fast_math"]
    log = nvrtc_compile(nvrtc, code, source, options)
    assert "warning" not in log.lower(), log


def test_persistent_benchmarks_compile():
    """bench_pipeline's and bench_step_table's inline kernels, with every consumer, compile with NVRTC for sm_90a
    (their options on the device): they run only there, so a broken one would cost a GPU call to find."""
    nvrtc, include = nvrtc_or_skip()
    sys.path.insert(0, str(KERNEL_DIR.parents[1] / "benchmarks"))
    import bench_pipeline
    import bench_step_table
    options = ["-std=c++17", f"-I{KERNEL_DIR}", f"-I{include}", "--gpu-architecture=sm_90a"]
    kernels = [bench_pipeline.consumer_kernel(spec)[0] for spec in bench_pipeline.CONSUMERS.split(",")]
    nvrtc_compile(nvrtc, bench_pipeline.SOURCE, "bench_pipeline.cu", options, kernels)
    nvrtc_compile(nvrtc, bench_step_table.SOURCE, "bench_step_table.cu", options,
                  [k.replace("pipeline<", "table_step<", 1) for k in kernels])


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("source", ["matmul_rows.cu", "matmul_moe.cu", "megakernel.cu"])
def test_the_trace_probe_compiles(source):
    """qmm_rows.cuh TRACE (benchmarks/bench_segment.py --trace): its buffers keep C names, which the benchmark looks
    up by name."""
    out = subprocess.run([NVCC, "-std=c++17", f"-I{KERNEL_DIR}", "-arch=sm_90a", "-cubin", "-DQMM_TRACE=1024", "-o",
                          "/dev/stdout", str(KERNEL_DIR / source)], capture_output=True)
    assert out.returncode == 0, out.stderr.decode()
    assert b"\0qmm_trace_n\0" in out.stdout and b"\0qmm_trace\0" in out.stdout
