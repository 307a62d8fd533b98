"""Programmatic dependent launch (sm_90+): a kernel launched with it may start while the kernel before it on the
stream is still running, up to its `griddepcontrol.wait` (exl::pdl_wait in common.cuh). Our kernels trigger their
dependents at once and wait before touching anything an earlier kernel wrote, so the next kernel's launch, block
scheduling and weight prefetches overlap the tail of the one before; in a captured CUDA graph the same holds
between graph nodes. CuPy launches through cuLaunchKernel, which takes no launch attributes, so this calls the
driver's cuLaunchKernelEx through ctypes with CuPy's compiled CUfunction.

Only kernels that wait before reading their inputs may be launched this way; every kernel in this package does."""
from __future__ import annotations

import ctypes
import functools

import numpy as np

from ..errors import DeviceError

PROGRAMMATIC_STREAM_SERIALIZATION = 6      # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: a 4-byte id, 4 bytes of padding, a 64-byte value union (here its int member)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_pad", ctypes.c_char * 60)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)), ("n_attrs", ctypes.c_uint)]


@functools.cache
def driver():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise DeviceError(f"cannot load the CUDA driver library libcuda.so.1 ({e}); set EXL_PDL=0 to launch "
                          f"through CuPy only") from None
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                     ctypes.c_void_p]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


_CTYPE = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
          np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint64): ctypes.c_uint64,
          np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}


def _storage(a) -> ctypes._SimpleCData | np.ndarray:
    """Something that owns the argument's bytes for the duration of the launch."""
    if isinstance(a, np.ndarray):            # a struct passed by value (a 0-d structured array)
        return a
    return _CTYPE[np.dtype(type(a))](a.item())


def launch(function_ptr: int, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int,
           stream_ptr: int) -> None:
    """Launches a compiled kernel (CUfunction `function_ptr`) with programmatic stream serialization. args are
    numpy scalars of the exact C types, or 0-d numpy arrays for structs passed by value."""
    keep = [_storage(a) for a in args]
    params = (ctypes.c_void_p * max(len(keep), 1))(
        *[k.ctypes.data if isinstance(k, np.ndarray) else ctypes.addressof(k) for k in keep])
    attr = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    g, b = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
    config = LaunchConfig((ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b), shared_mem, stream_ptr,
                          ctypes.pointer(attr), 1)
    lib = driver()
    status = lib.cuLaunchKernelEx(ctypes.byref(config), function_ptr, params, None)
    if status:
        text = ctypes.c_char_p()
        lib.cuGetErrorString(status, ctypes.byref(text))
        raise DeviceError(f"cuLaunchKernelEx failed: {(text.value or b'?').decode()} (CUresult {status}); set "
                          f"EXL_PDL=0 to launch without programmatic dependent launch")
