"""The ctypes mirror of the driver's launch structs (kernels/driver.py) against cuda.h itself, compiled by nvcc here
(no GPU needed): a wrong offset would hand the driver garbage grid sizes or a wrong stream. The launches
themselves run in the GPU tests (every kernel launch goes through them)."""
from __future__ import annotations

import ctypes
import shutil
import struct
import subprocess

import numpy as np
import pytest
import torch

from exl_backends.errors import DeviceError
from exl_backends.kernels import driver

from conftest import FIXTURES

PROBE = r"""
#include <stdio.h>
#include <stddef.h>
#include <cuda.h>
int main(void) {
    printf("%zu %zu %zu %zu %zu %zu %zu %zu %d %zu %zu %zu %d %d\n", sizeof(CUlaunchConfig),
           offsetof(CUlaunchConfig, blockDimX), offsetof(CUlaunchConfig, sharedMemBytes),
           offsetof(CUlaunchConfig, hStream), offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs),
           sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value),
           (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, offsetof(CUlaunchAttribute, value.clusterDim.x),
           offsetof(CUlaunchAttribute, value.clusterDim.y), offsetof(CUlaunchAttribute, value.clusterDim.z),
           (int)CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, (int)CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED);
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_launch_structs_match_cuda_h(tmp_path):
    (tmp_path / "probe.c").write_text(PROBE)
    subprocess.run(["nvcc", "probe.c", "-o", "probe"], cwd=tmp_path, check=True, capture_output=True)
    out = subprocess.run([str(tmp_path / "probe")], check=True, capture_output=True, text=True).stdout.split()
    # where CONFIG "<3I3II4xQQI4x" puts blockDimX, sharedMemBytes, hStream, attrs, numAttrs: its prefixes' sizes
    prefixes = ["<3I", "<3I3I", "<3I3II4x", "<3I3II4xQ", "<3I3II4xQQ"]
    assert all(driver.CONFIG.startswith(p) for p in prefixes)
    A = driver.LaunchAttribute
    ours = [driver.CONFIG_BYTES, *map(struct.calcsize, prefixes), ctypes.sizeof(A), A.value.offset,
            driver.PROGRAMMATIC_STREAM_SERIALIZATION, A.value.offset, A.value_y.offset, A.value_z.offset,
            driver.CLUSTER_DIMENSION, driver.NON_PORTABLE_CLUSTER_SIZE_ALLOWED]
    assert [int(v) for v in out] == ours


def test_parameters_hold_each_argument_as_its_exact_c_type():
    """Each kernelParams pointer reads back its argument as the C type the loader's conversions give it, wherever
    it sits among the others; a struct is passed from its own bytes; the config ahead of them holds the launch's
    grid, block, shared memory, stream and the programmatic-serialization attribute."""
    by_value = np.zeros((), np.dtype([("a", np.int32), ("b", np.uint64)]))
    args = (np.int32(-7), np.uint64(2**63 + 5), 3, np.float32(1.5), None, np.int64(-(2**40)), 0.25, True, by_value,
            np.uint32(2**32 - 1), np.float64(1 / 3))
    ctype = [ctypes.c_int32, ctypes.c_uint64, ctypes.c_int32, ctypes.c_float, ctypes.c_uint64, ctypes.c_int64,
             ctypes.c_float, ctypes.c_int32, None, ctypes.c_uint32, ctypes.c_double]
    config, params = driver.pack((5, 3), (128,), 1024, 77, True, args)
    pointers = [ctypes.c_void_p.from_address(params + 8 * i).value for i in range(len(args))]
    read = [None if t is None else t.from_address(pointers[i]).value for i, t in enumerate(ctype)]
    assert read == [-7, 2**63 + 5, 3, 1.5, 0, -(2**40), 0.25, 1, None, 2**32 - 1, 1 / 3]
    assert pointers[8] == by_value.ctypes.data
    head = struct.unpack_from(driver.CONFIG, config)
    assert head == (5, 3, 1, 128, 1, 1, 1024, 77, ctypes.addressof(driver._SERIALIZE), 1)
    config, _ = driver.pack((8,), (256,), 0, 77, True, (3,), cluster=4)     # a cluster's size: a second attribute
    *_, attrs, n_attrs = struct.unpack_from(driver.CONFIG, config)
    pdl, cluster = (driver.LaunchAttribute * 2).from_address(attrs)
    assert n_attrs == 2 and (pdl.id, pdl.value) == (driver.PROGRAMMATIC_STREAM_SERIALIZATION, 1)
    assert (cluster.id, cluster.value, cluster.value_y, cluster.value_z) == (driver.CLUSTER_DIMENSION, 4, 1, 1)
    config, _ = driver.pack((8,), (256,), 0, 0, False, (3,), cluster=2)
    *_, attrs, n_attrs = struct.unpack_from(driver.CONFIG, config)
    assert n_attrs == 1 and driver.LaunchAttribute.from_address(attrs).id == driver.CLUSTER_DIMENSION
    assert struct.unpack_from(driver.CONFIG, driver.pack((8,), (256,), 0, 0, False, (3,))[0])[-2:] == (0, 0)
    with pytest.raises(TypeError, match="argument 0 is a str"):
        driver.pack((1,), (1,), 0, 0, False, ("x",))
    with pytest.raises(struct.error):
        driver.pack((1,), (1,), 0, 0, False, (2**31,))      # a Python int is an int32: never truncated silently
    with pytest.raises(DeviceError, match="must be on the GPU"):
        driver.pack((1,), (1,), 0, 0, False, (torch.zeros(3),))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(3, 37), (1, 3)], ids=["dequant-matmul", "small-matmul"])
def test_programmatic_launches_give_the_plain_launches_logits(shape):
    """Kernels launched on a stream of our own go through cuLaunchKernelEx with programmatic serialization (sm_90+),
    on the legacy default stream without it: the same kernels in the same order, so the logits
    must be bit-identical. A missing pdl_wait shows up here as a race (different or garbage logits)."""
    from exl_backends import ExlForCausalLM
    from exl_backends.kernels import loader
    model = ExlForCausalLM.from_pretrained(FIXTURES / "exl2" / "llama_tiny_exl2_4.0bpw_h6", device="cuda")
    ids = torch.randint(0, model.exl_config.vocab_size, shape, generator=torch.Generator().manual_seed(0)).cuda()
    plain = model(ids).logits
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ours = [model(ids).logits for _ in range(3)]
    torch.cuda.current_stream().wait_stream(side)
    for logits in ours:
        assert torch.equal(logits, plain)
    if torch.cuda.get_device_capability() >= loader.PDL_CC:
        assert loader._use_pdl("matmul_rows", torch.cuda.get_device_capability())


def test_cupy_gives_the_cufunction_the_loader_launches():
    """module().get_function() is a cupy.RawKernel; its `kernel` is the current device's cupy Function, whose
    `ptr` is the CUfunction cuLaunchKernelEx takes (RawKernel itself has no `ptr`)."""
    cupy = pytest.importorskip("cupy")
    assert isinstance(getattr(cupy.RawKernel, "kernel", None), property) or hasattr(cupy.RawKernel, "kernel")
    assert "ptr" in dir(cupy.cuda.function.Function) and "ptr" not in dir(cupy.RawKernel)
    assert "max_dynamic_shared_size_bytes" in dir(cupy.RawKernel)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_first_launch_may_come_inside_a_graph_capture():
    """The probe for programmatic launches needs no sync, so a process whose first programmatic launch is being
    captured (bench_matmul's was) still captures, and keeps programmatic launches."""
    from exl_backends.kernels import activation, loader
    from exl_backends.model import reference
    loader._use_pdl.cache_clear()
    loader._pdl_works.cache_clear()
    x = torch.randn(3, 1001, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)) * 5
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = activation.softcap(x, 2.0)
    graph.replay()
    torch.testing.assert_close(out, reference.softcap(x, 2.0), rtol=0, atol=0)
    cc = torch.cuda.get_device_capability()
    assert loader._use_pdl("activation", cc) == (cc >= loader.PDL_CC)
