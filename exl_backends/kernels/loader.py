"""Compiles `<family>.cu` with NVRTC (through cupy.RawModule) for the current GPU and launches its kernels
(through the driver: driver.py) on torch's current stream, on torch tensors (zero copy: kernels get raw device
pointers).

Nothing happens at import. The first launch of a family compiles it for the GPU's compute capability; CuPy
caches the binary on disk (~/.cupy/kernel_cache), so later processes skip the compile."""
from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import DeviceError
from . import driver

KERNEL_DIR = Path(__file__).resolve().parent
MIN_CC = (7, 5)
# Families compiled without --use_fast_math, so that their tanhf, cosf and sinf are the libdevice ones torch's kernels
# call and round as their references do (fast math turns them into the hardware's approximations: tanh.approx,
# relative error ~2^-11; cos.approx and sin.approx, absolute error ~2^-21 on [-pi, pi], worse beyond).
PRECISE_FAMILIES = frozenset({"activation", "rope"})
PDL_CC = (9, 0)
# Families whose every kernel calls exl::pdl_wait before reading another kernel's output (common.cuh), so they may
# be launched with programmatic dependent launch (driver.py) on sm_90+. EXL_PDL=0 turns it off (A/B, debugging).
PDL_FAMILIES = frozenset({"matmul_rows", "matmul_moe", "gemm", "wgmma", "dequant", "norm", "activation", "rope",
                          "attention", "kv_cache", "megakernel", "argmax"})


@functools.cache
def cupy():
    try:
        import cupy as cp
    except ImportError:
        raise DeviceError("the CUDA path needs CuPy: pip install 'exl-backends[cuda12]' (CUDA 12 driver) or "
                          "'exl-backends[cuda13]' (CUDA 13 driver); or run on CPU with device='cpu'") from None
    return cp


def compute_capability(device: torch.device | None = None) -> tuple[int, int]:
    if not torch.cuda.is_available():
        raise DeviceError("no CUDA GPU is visible to torch (check the driver and CUDA_VISIBLE_DEVICES), "
                          "or run on CPU with device='cpu'")
    cc = torch.cuda.get_device_capability(device)
    if cc < MIN_CC:
        raise DeviceError(f"GPU compute capability {cc[0]}.{cc[1]} is older than the {MIN_CC[0]}.{MIN_CC[1]} "
                          f"(Turing) our kernels need; run on CPU with device='cpu'")
    return cc


def arch(cc: tuple[int, int]) -> str:
    """The NVRTC target for compute capability cc: on 9.0 (H100, H200) sm_90a, whose code runs only there and may use
    its warpgroup MMA (wgmma.cu)."""
    return f"sm_{cc[0]}{cc[1]}" + ("a" if cc == (9, 0) else "")


def nvrtc_options(family: str) -> tuple[str, ...]:
    """NVRTC's options for `<family>.cu`, all but the target (benchmarks/sass_loops.py compiles with the same)."""
    return ("-std=c++17", f"-I{KERNEL_DIR}") + (() if family in PRECISE_FAMILIES else ("--use_fast_math",))


@functools.cache
def module(family: str, cc: tuple[int, int]):
    """The compiled RawModule of `<family>.cu` for compute capability cc (memoised per process)."""
    return compile_module(family, cc)


def compile_module(family: str, cc: tuple[int, int], defines: tuple[str, ...] = ()):
    """`<family>.cu` compiled by NVRTC for compute capability cc, with -D<define> for each of defines (a probe's
    variant, for benchmarks and tests; the product compiles none)."""
    cp = cupy()
    source = f'#line 1 "{family}.cu"\n' + (KERNEL_DIR / f"{family}.cu").read_text()
    options = nvrtc_options(family) + (f"--gpu-architecture={arch(cc)}",) + tuple(f"-D{d}" for d in defines)
    try:
        mod = cp.RawModule(code=source, options=options, backend="nvrtc")
        mod.compile()
    except cp.cuda.compiler.CompileException as e:
        if "invalid value for --gpu-architecture" in str(e) or "unsupported gpu architecture" in str(e).lower():
            raise DeviceError(f"this CUDA toolkit's NVRTC cannot compile for sm_{cc[0]}{cc[1]}: install the CuPy "
                              f"wheel that matches your driver (cupy-cuda12x or cupy-cuda13x), newer") from None
        raise
    return mod


@functools.cache
def _use_pdl(family: str, cc: tuple[int, int]) -> bool:
    return family in PDL_FAMILIES and cc >= PDL_CC and os.environ.get("EXL_PDL", "1") != "0" and _pdl_works(cc)


@functools.cache
def _pdl_works(cc: tuple[int, int]) -> bool:
    """One programmatic launch of a kernel that does nothing (softcap of 0 elements) on the current stream: a
    driver that refuses the attribute says so when the launch is made (no sync needed, so this may run during a
    CUDA graph capture, where it adds an empty node); it then gets plain launches, with a warning, instead of
    failing every kernel."""
    fn = module("activation", cc).get_function("softcap_f32")
    try:
        driver.launch(fn.kernel.ptr, (1,), (32,), (None, None, np.int64(0), 1.0), 0,
                      torch.cuda.current_stream().cuda_stream, programmatic=True)
    except Exception as e:      # whatever refuses it (driver, library, CuPy version): fall back, never fail
        warnings.warn(f"programmatic dependent launch is not available ({e!r}); kernels launch without it")
        return False
    return True


def launch(family: str, kernel: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple,
           shared_mem: int = 0, cluster: int = 1) -> None:
    """Launches `kernel` of `<family>.cu` on torch's current stream (driver.py). Tensors become device pointers,
    Python ints int32, floats float32, None a null pointer; pass numpy scalars for any other C type and a 0-d
    numpy structured array for a struct passed by value. On sm_90+ the families in PDL_FAMILIES launch with
    programmatic dependent launch, except on the legacy default stream. cluster: blocks per thread-block cluster
    (sm_90+; grid[0] a multiple of it)."""
    device = torch.cuda.current_device()
    cc = _capability(device)
    fn, fn_ptr = _function(family, kernel, device)
    if shared_mem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = shared_mem
    if cluster > driver.PORTABLE_CLUSTER:
        _allow_large_clusters(fn_ptr)
    stream_ptr = torch._C._cuda_getCurrentRawStream(device)    # torch.cuda.current_stream() costs ~10 us more
    driver.launch(fn_ptr, grid, block, args, shared_mem, stream_ptr,
                  programmatic=bool(stream_ptr) and _use_pdl(family, cc), cluster=cluster)


@functools.cache
def _allow_large_clusters(fn_ptr: int) -> None:
    driver.allow_large_clusters(fn_ptr)


def resident_blocks(family: str, kernel: str, threads: int, shared_mem: int) -> int:
    """Blocks of `kernel` that fit on one SM of the current device at once, with this much dynamic shared memory."""
    fn, fn_ptr = _function(family, kernel, torch.cuda.current_device())
    if shared_mem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = shared_mem
    return driver.resident_blocks(fn_ptr, threads, shared_mem)


@functools.cache
def cluster_slots(family: str, kernel: str, threads: int, sizes: tuple[int, ...], device: int) -> dict[int, int]:
    """Clusters of each of `sizes` blocks of `kernel` that a device runs at once (a GPC holds whole clusters, so
    fewer than its SMs' block slots suggest). Asked with no dynamic shared memory: the kernels it is asked for need
    a few KB, and their registers bound their blocks per SM."""
    fn, fn_ptr = _function(family, kernel, device)
    if max(sizes) > driver.PORTABLE_CLUSTER:
        _allow_large_clusters(fn_ptr)
    return {c: driver.max_active_clusters(fn_ptr, c, threads, 0, c) for c in sizes}


def aligned(x: Tensor, boundary: int = 16) -> Tensor:
    """x, or a copy of it whose data starts on a `boundary`-byte boundary (for kernels that move vectors of that
    size: a view into a larger tensor may start anywhere)."""
    return x if x.data_ptr() % boundary == 0 else x.clone()


# Per-launch lookups, memoised: a decode step outside a CUDA graph launches ~400 kernels, and a launch's host time
# is its cost there (eager prefill, speculative verify steps).
@functools.cache
def _capability(device: int) -> tuple[int, int]:
    return compute_capability(torch.device("cuda", device))


@functools.cache
def _function(family: str, kernel: str, device: int):
    """(the cupy.RawKernel, its CUfunction on device): CuPy loads a family's module once per device, and device
    is the current one whenever this is first called for it."""
    fn = module(family, _capability(device)).get_function(kernel)
    return fn, fn.kernel.ptr


def counters(family: str, device: torch.device, n: int) -> Tensor:
    """int32 zeros, at least n of them, for a family's arrival counters (the last block to arrive resets its
    counter, so each launch leaves them zero and one buffer serves every launch of the family on the device;
    launches on one device must not run concurrently on different streams). Sizes are 4,096 times a power of two,
    so that few buffers exist."""
    size = 4096
    while size < n:
        size *= 2
    return _zeros(family, device, size)


@functools.cache
def _zeros(family: str, device: torch.device, size: int) -> Tensor:
    return torch.zeros(size, dtype=torch.int32, device=device)
