"""Kernel launches through the CUDA driver's cuLaunchKernelEx (ctypes), on CuPy's compiled CUfunction.

Two reasons not to launch through CuPy: a launch's host time (CuPy converts each argument to a numpy scalar, then
to a C value; here all of a launch's values are packed in one struct.pack: 8 us for 22 arguments instead of 53 on
the dev box, and an eager 8B forward makes ~400 launches), and launch attributes, which cuLaunchKernel does not
take. The one attribute used is programmatic dependent launch (sm_90+): a kernel launched with it may start while
the kernel before it on the stream is still running, up to its `griddepcontrol.wait` (exl::pdl_wait in
common.cuh). Our kernels trigger their dependents at once and wait before touching anything an earlier kernel
wrote, so the next kernel's launch, block scheduling and weight prefetches overlap the tail of the one before; in
a captured CUDA graph the same holds between graph nodes."""
from __future__ import annotations

import ctypes
import functools
import struct

import numpy as np
import torch

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


_SERIALIZE = ctypes.pointer(LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1))   # read-only


@functools.cache
def driver():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise DeviceError(f"cannot load the CUDA driver library libcuda.so.1 ({e}): is the NVIDIA driver "
                          f"installed?") from None
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


# the struct code of one 8-byte parameter slot, per argument type (little-endian, 4-byte values padded to 8)
_SLOT = {bool: "i4x", int: "i4x", float: "f4x", np.int32: "i4x", np.uint32: "I4x", np.int64: "q", np.uint64: "Q",
         np.float32: "f4x", np.float64: "d"}


def device_pointer(t: torch.Tensor) -> int:
    if not t.is_cuda:
        raise DeviceError(f"a kernel got a {t.device} tensor; every kernel argument must be on the GPU")
    return t.data_ptr()


def parameters(args: tuple) -> tuple[int, tuple]:
    """cuLaunchKernelEx's kernelParams: a pointer per argument to its value (Python ints are int32, floats
    float32, bools int32, tensors device pointers, None a null pointer, numpy scalars their own type).
    Values are packed into one buffer, 8 bytes each, in one struct.pack (a launch's host cost is mostly this); a
    struct passed by value (a 0-d numpy structured array) points to its own bytes. Returns the pointer array's
    address and what must outlive the launch."""
    fmt, values, structs = ["<"], [], {}
    for i, a in enumerate(args):
        code = _SLOT.get(type(a))
        if code is not None:
            values.append(a)
        elif a is None:
            code = "Q"
            values.append(0)
        elif isinstance(a, np.ndarray):
            code = "8x"
            structs[i] = a
        elif isinstance(a, torch.Tensor):       # last: torch's isinstance check is the slow one
            code = "Q"
            values.append(device_pointer(a))
        else:
            raise TypeError(f"kernel argument {i} is a {type(a).__name__}, which has no C type: pass a numpy scalar")
        fmt.append(code)
    n = len(args)
    block = ctypes.create_string_buffer(16 * n + 8)        # the 8-byte slots, then the pointer array
    base = ctypes.addressof(block)
    pointers = [structs[i].ctypes.data if i in structs else base + 8 * i for i in range(n)] if structs else \
        range(base, base + 8 * n, 8)
    struct.pack_into("".join(fmt) + f"{n}Q", block, 0, *values, *pointers)
    return base + 8 * n, (block, structs)


def launch(function_ptr: int, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int,
           stream_ptr: int, programmatic: bool) -> None:
    """Launches a compiled kernel (CUfunction `function_ptr`) on a stream (0: the legacy default stream), with
    programmatic stream serialization when `programmatic`."""
    params, values = parameters(args)       # values: alive until the driver has read them
    config = LaunchConfig((tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3], shared_mem, stream_ptr,
                          _SERIALIZE if programmatic else None, int(programmatic))
    lib = driver()
    status = lib.cuLaunchKernelEx(ctypes.byref(config), function_ptr, params, None)
    if status:
        text = ctypes.c_char_p()
        lib.cuGetErrorString(status, ctypes.byref(text))
        hint = "; set EXL_PDL=0 to launch without programmatic dependent launch" if programmatic else ""
        raise DeviceError(f"cuLaunchKernelEx failed: {(text.value or b'?').decode()} (CUresult {status}){hint}")
