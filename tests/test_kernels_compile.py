"""Every kernels/*.cu compiles for every GPU generation we support, with nvcc and with NVRTC (what the loader uses
at run time). Needs no GPU: nvcc only compiles; NVRTC is called through CuPy's binding without touching a device.
New .cu files are picked up automatically."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from exl_backends.kernels.loader import KERNEL_DIR

sys.path.insert(0, str(KERNEL_DIR.parents[1] / "benchmarks"))
import sass_loops  # noqa: E402
from sass_loops import cuda_include_dir  # noqa: E402

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


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_the_attention_trace_probe_compiles():
    """attention.cu TRACE (benchmarks/trace_step.py): its buffers keep C names, which the benchmark looks up."""
    out = subprocess.run([NVCC, "-std=c++17", f"-I{KERNEL_DIR}", "-arch=sm_90a", "-cubin", "-DATT_TRACE=1024", "-o",
                          "/dev/stdout", str(KERNEL_DIR / "attention.cu")], capture_output=True)
    assert out.returncode == 0, out.stderr.decode()
    assert b"\0att_trace_n\0" in out.stdout and b"\0att_trace\0" in out.stdout


def assert_fp16_decode_kernels_spill_free(defines: list[str], head_dims: tuple[int, ...]) -> None:
    """attention.cu compiled (sm_90a) with these -D defines: the fp16 decode kernels at these head dims spill nothing."""
    out = subprocess.run([NVCC, "-std=c++17", f"-I{KERNEL_DIR}", "-arch=sm_90a", "-cubin", "--use_fast_math",
                          *(f"-D{d}" for d in defines), "-Xptxas", "-v", "-o", "/dev/null",
                          str(KERNEL_DIR / "attention.cu")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for dh in head_dims:
        report = out.stderr.split(f"Compiling entry function 'paged_decode_fp16_d{dh}'")[1]
        assert "0 bytes spill stores, 0 bytes spill loads" in report.split("Compiling entry function")[0]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_the_fp16_decode_kernels_rotating_in_registers_have_no_spills():
    """attention.cu ROPE IN REGISTERS (docs/megakernel.md): the fp16 decode kernels that rotate their queries in
    registers keep every value there (the head_dim 128 one holds ~230 of its 255)."""
    assert_fp16_decode_kernels_spill_free([], (64, 128))


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_the_tile_before_wait_probe_compiles_without_spills():
    """attention.cu ATT_TILE_BEFORE_WAIT (docs/megakernel.md): the fp16 decode kernels keep every value in registers
    with a warp's first tile loaded before the wait."""
    assert_fp16_decode_kernels_spill_free(["ATT_TILE_BEFORE_WAIT=1"], (16, 32, 64, 96, 128, 256))


LISTING = """
.text.k:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
.L_x_2:
        /*0020*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0030*/              @!P0 HMMA.16816.F32 R12, R4, R6, R12 ;
        /*0040*/                   ISETP.GE.AND P1, PT, R0, 0x3, PT ;
        /*0050*/              @!P1 BRA `(.L_x_2) ;
        /*0060*/                   BRA `(.L_x_3) ;
        /*0070*/                   IADD3 R0, R0, 0x1, RZ ;
.L_x_3:
        /*0080*/               @P2 BRA `(.L_x_1) ;
        /*0090*/                   EXIT ;
.L_x_4:
        /*00a0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R19+URZ], R18 ;
        /*00b0*/              @!P0 BRA `(.L_x_4) ;
        /*00c0*/                   BRA `(.L_x_3) ;
//--------------------- .text.other --------------------------
"""


def test_sass_loops_reads_a_listing():
    """Backward branches make loops (the inner one inside the outer), forward ones do not; a wait's retry stub after
    the kernel's end is a loop of its own, but its branch back into the body is none (its span holds the EXIT);
    predicates and modifiers are not part of an opcode."""
    funcs = sass_loops.functions(LISTING)
    assert list(funcs) == ["k"]
    inner, outer, retry = sass_loops.loops(funcs["k"])
    assert (retry.start, retry.end) == (10, 11)
    assert (inner.start, inner.end, inner.size) == (2, 5, 4) and inner.opcodes["HMMA"] == 2
    assert (outer.start, outer.end) == (1, 8) and outer.opcodes == {"LDG": 1, "HMMA": 2, "ISETP": 1, "BRA": 3,
                                                                     "IADD3": 1}


def test_sass_loops_counts_the_one_row_matmul():
    """The loader's compile of matmul_rows.cu, disassembled: exl2_matmul_m1's 4-bit batch (3 chunks of 4 MMAs and
    the 2 that sum the corrections) is one loop of 18 HMMA, and CuPy's short cubin image is made whole (nvdisasm
    reads it)."""
    nvrtc_or_skip()
    if sass_loops.nvdisasm() is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    funcs = sass_loops.functions(sass_loops.disassemble(sass_loops.compile_cubin("matmul_rows")))
    batches = [lp for lp in sass_loops.loops(funcs["exl2_matmul_m1"]) if lp.opcodes["HMMA"] == 18]
    assert len(batches) == 1 and batches[0].opcodes["LDG"] >= 3, batches
