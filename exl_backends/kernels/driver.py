"""Kernel launches through the CUDA driver's cuLaunchKernelEx (ctypes), on CuPy's compiled CUfunction.

Two reasons not to launch through CuPy: a launch's host time (CuPy converts each argument to a numpy scalar, then
to a C value; here all of a launch's values are packed in one struct.pack: 8 us for 22 arguments instead of 53 on
the dev box, and an eager 8B forward makes ~400 launches), and launch attributes, which cuLaunchKernel does not
take. The attributes used are a thread-block cluster's size (sm_90+, qmm_rows.cuh CLUSTER SUMS) and programmatic
dependent launch (sm_90+): a kernel launched with it may start while
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

CLUSTER_DIMENSION = 4                      # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION (cuda.h)
PROGRAMMATIC_STREAM_SERIALIZATION = 6      # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: a 4-byte id, 4 bytes of padding, a 64-byte value union (here its int member, or the
    cluster's x, y, z)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_y", ctypes.c_int), ("value_z", ctypes.c_int), ("value_pad", ctypes.c_char * 52)]


# CUlaunchConfig (cuda.h): gridDimX/Y/Z, blockDimX/Y/Z, sharedMemBytes, (padding), hStream, attrs, numAttrs,
# (padding). A launch packs it, its argument values and the kernelParams pointer array into one buffer, in one
# struct.pack_into: a launch's host cost is mostly this packing.
CONFIG = "<3I3II4xQQI4x"
CONFIG_BYTES = struct.calcsize(CONFIG)


_SERIALIZE = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)      # read-only


@functools.cache
def _attributes(programmatic: bool, cluster: int) -> ctypes.Array:
    """A launch's attribute array (read-only; the cache keeps it alive for the process)."""
    attrs = ([_SERIALIZE] if programmatic else []) + \
        ([LaunchAttribute(id=CLUSTER_DIMENSION, value=cluster, value_y=1, value_z=1)] if cluster > 1 else [])
    return (LaunchAttribute * len(attrs))(*attrs)


# The argument types of every driver function called here. ctypes passes an undeclared int argument as a C int, so
# a CUfunction (a 64-bit pointer) without its declaration arrives truncated and the driver crashes the process.
SIGNATURES = {
    "cuLaunchKernelEx": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p],
    "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuOccupancyMaxActiveBlocksPerMultiprocessor": [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int,
                                                    ctypes.c_size_t],
    "cuOccupancyMaxActiveClusters": [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_void_p],
    "cuFuncSetAttribute": [ctypes.c_void_p, ctypes.c_int, ctypes.c_int],
}


@functools.cache
def driver():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise DeviceError(f"cannot load the CUDA driver library libcuda.so.1 ({e}): is the NVIDIA driver "
                          f"installed?") from None
    for name, argtypes in SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return lib


# the struct code of one 8-byte parameter slot, per argument type (little-endian, 4-byte values padded to 8)
_SLOT = {bool: "i4x", int: "i4x", float: "f4x", np.int32: "i4x", np.uint32: "I4x", np.int64: "q", np.uint64: "Q",
         np.float32: "f4x", np.float64: "d"}
VALUE, POINTER, NULL, STRUCT = range(4)     # what an argument's slot holds: itself, a device pointer, 0, nothing


def device_pointer(t: torch.Tensor) -> int:
    if not t.is_cuda:
        raise DeviceError(f"a kernel got a {t.device} tensor; every kernel argument must be on the GPU")
    return t.data_ptr()


@functools.cache
def _signature(types: tuple[type, ...]) -> tuple[struct.Struct, tuple[int, ...]]:
    """The packer of a launch whose arguments have these types (config, a slot per argument, the pointer array),
    and each argument's kind. Kernels are launched with few distinct type signatures, so this is computed once
    each."""
    codes, kinds = [], []
    for i, t in enumerate(types):
        if t in _SLOT:
            codes.append(_SLOT[t])
            kinds.append(VALUE)
        elif t is type(None):
            codes.append("Q")
            kinds.append(NULL)
        elif issubclass(t, np.ndarray):
            codes.append("8x")
            kinds.append(STRUCT)
        elif issubclass(t, torch.Tensor):
            codes.append("Q")
            kinds.append(POINTER)
        else:
            raise TypeError(f"kernel argument {i} is a {t.__name__}, which has no C type: pass a numpy scalar")
    return struct.Struct(CONFIG + "".join(codes) + f"{len(types)}Q"), tuple(kinds)


def pack(grid: tuple[int, ...], block: tuple[int, ...], shared_mem: int, stream_ptr: int, programmatic: bool,
         args: tuple, cluster: int = 1) -> tuple[ctypes.Array, int]:
    """The launch config and cuLaunchKernelEx's kernelParams in one buffer: a pointer per argument to its value
    (Python ints are int32, floats float32, bools int32, tensors device pointers, None a null pointer, numpy
    scalars their own type), each value in an 8-byte slot; a struct passed by value (a 0-d numpy structured array)
    points to its own bytes. Returns the buffer (config at offset 0; it and the structs must outlive the launch)
    and the pointer array's address."""
    packer, kinds = _signature(tuple(map(type, args)))
    n = len(args)
    buffer = ctypes.create_string_buffer(packer.size)
    slots = ctypes.addressof(buffer) + CONFIG_BYTES
    values = [a if k is VALUE else device_pointer(a) if k is POINTER else 0
              for a, k in zip(args, kinds) if k is not STRUCT]
    pointers = [a.ctypes.data if k is STRUCT else slots + 8 * i for i, (a, k) in enumerate(zip(args, kinds))] \
        if STRUCT in kinds else range(slots, slots + 8 * n, 8)
    g, b = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
    if cluster == 1:
        attrs, n_attrs = (ctypes.addressof(_SERIALIZE), 1) if programmatic else (0, 0)
    else:
        array = _attributes(programmatic, cluster)
        attrs, n_attrs = ctypes.addressof(array), len(array)
    packer.pack_into(buffer, 0, *g, *b, shared_mem, stream_ptr, attrs, n_attrs, *values, *pointers)
    return buffer, slots + 8 * n


PORTABLE_CLUSTER = 8                       # blocks a cluster may have without the attribute below
NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14     # CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED (cuda.h)


def allow_large_clusters(function_ptr: int) -> None:
    """Lets a kernel launch in clusters of more than PORTABLE_CLUSTER blocks (16 on Hopper)."""
    lib = driver()
    _check(lib, lib.cuFuncSetAttribute(function_ptr, NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1), "cuFuncSetAttribute",
           " (clusters of more than 8 blocks)")


def max_active_clusters(function_ptr: int, grid: int, threads: int, shared_mem: int, cluster: int) -> int:
    """How many clusters of `cluster` blocks of a kernel run on the GPU at once (a GPC holds whole clusters, so
    fewer than its SMs' block slots suggest)."""
    config, _ = pack((grid,), (threads,), shared_mem, 0, False, (), cluster)
    lib, n = driver(), ctypes.c_int()
    _check(lib, lib.cuOccupancyMaxActiveClusters(ctypes.byref(n), function_ptr, ctypes.addressof(config)),
           "cuOccupancyMaxActiveClusters")
    return n.value


def resident_blocks(function_ptr: int, threads: int, shared_mem: int) -> int:
    """How many blocks of a kernel fit on one SM at once (registers, shared memory, threads), as the driver says."""
    lib, n = driver(), ctypes.c_int()
    _check(lib, lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), function_ptr, threads, shared_mem),
           "cuOccupancyMaxActiveBlocksPerMultiprocessor")
    return n.value


def _check(lib, status: int, call: str, hint: str = "") -> None:
    if status:
        text = ctypes.c_char_p()
        lib.cuGetErrorString(status, ctypes.byref(text))
        raise DeviceError(f"{call} failed: {(text.value or b'?').decode()} (CUresult {status}){hint}")


def launch(function_ptr: int, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int,
           stream_ptr: int, programmatic: bool, cluster: int = 1) -> None:
    """Launches a compiled kernel (CUfunction `function_ptr`) on a stream (0: the legacy default stream), with
    programmatic stream serialization when `programmatic`, in clusters of `cluster` blocks when more than one."""
    config, params = pack(grid, block, shared_mem, stream_ptr, programmatic, args, cluster)   # alive until it returns
    lib = driver()
    hint = "; set EXL_PDL=0 to launch without programmatic dependent launch" if programmatic else ""
    _check(lib, lib.cuLaunchKernelEx(ctypes.addressof(config), function_ptr, params, None), "cuLaunchKernelEx", hint)
