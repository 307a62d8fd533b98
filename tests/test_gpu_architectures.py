"""Every architecture beyond Llama on the GPU against the CPU reference: tiny random models (fp16 files, and an EXL2
copy, whose Mixtral / Qwen3-MoE experts take the expert-indexed MoE kernels), prefill and 16 decode steps through a
paged cache far past the sliding window of 8, eagerly and with the decode steps replayed from CUDA graphs
(runner.Runner). The kernels cover every trait these need: windows, attention and final soft-caps, GELU-tanh, MoE,
q/k norms, Gemma's 1 + w norms (folded at load), local ropes, Phi-3's fused projections. Gemma 2 and 3 also run at
their real checkpoints' head_dim 256 (the attention kernels' warp-pair variants)."""
from __future__ import annotations

import importlib.util
import shutil

import pytest
import torch

from exl_backends.model.batch import Batch, SeqChunk
from exl_backends.model.cache import KVCache
from exl_backends.model.config import ModelConfig
from exl_backends.model.model import Model, missing_ops
from exl_backends.model.runner import Runner

import test_architectures
from quant_helpers import rel_err
from test_architectures import build, decisive_ids, quantized_copy
from test_model import DECODE, PREFILL

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None, reason="needs CUDA and CuPy")]

NAMES = ["qwen3", "gemma2", "gemma3", "phi3", "mistral-window", "mixtral", "qwen3-moe"]   # test_architectures.VARIANTS
# the Gemma variants at head_dim 256, with query_pre_attn_scalar 144 (not 256) so that a scale taken from head_dim
# would show
HEAD_DIM_256 = {f"{name}-d256": name for name in ("gemma2", "gemma3")}
PAGE = 32                        # the CUDA attention kernels need pages of a multiple of 32 tokens
TOLERANCE = 1e-2                 # as tests/test_gpu_model.py: fp16 activations against the f32 reference


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> {"fp16": dir, "exl2": dir}, built once per module."""
    out = {}
    for name in NAMES + list(HEAD_DIM_256):
        root = tmp_path_factory.mktemp(name)
        with pytest.MonkeyPatch.context() as patch:
            if name in HEAD_DIM_256:        # build() takes its variants from test_architectures.VARIANTS
                family, overrides = test_architectures.VARIANTS[HEAD_DIM_256[name]]
                patch.setitem(test_architectures.VARIANTS, name,
                              (family, {**overrides, "head_dim": 256, "query_pre_attn_scalar": 144}))
            build(root / "src", name, dtype=torch.float16)
        quantized_copy(root / "src", root / "exl2", "exl2")
        out[name] = {"fp16": root / "src", "exl2": root / "exl2"}
    yield out
    for dirs in out.values():
        shutil.rmtree(dirs["fp16"].parent, ignore_errors=True)


def run(model: Model, ids: list[int], graphs: bool) -> list[torch.Tensor]:
    """f32 logits of the prompt's rows (one tensor), then of each decode step, through non-contiguous pages. Each
    step's logits are copied out at once: a replayed graph returns a view of its static output, which the next
    replay overwrites."""
    cache = KVCache(model.config, n_pages=8, page_size=PAGE, mode="fp16", device=model.device, dtype=model.dtype)
    runner = Runner(model, cache, max_batch=1, max_pages=4, eager=not graphs)
    free = cache.pool.allocate(4)
    pages = [free[2], free[0]]                                   # 53 tokens: two pages, out of order
    batches = [Batch.build([SeqChunk(ids[:PREFILL], 0, pages)], PAGE, model.device, all_logits=True)]
    batches += [Batch.build([SeqChunk([ids[t]], t, pages)], PAGE, model.device)
                for t in range(PREFILL, PREFILL + DECODE)]
    return [runner.forward(batch).float().cpu() for batch in batches]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("fmt", ["fp16", "exl2"])
@pytest.mark.parametrize("name", NAMES + list(HEAD_DIM_256))
def test_gpu_logits_match_the_cpu_reference(checkpoints, name, fmt, graphs):
    path = checkpoints[name][fmt]
    config = ModelConfig.from_dir(path)
    if name in HEAD_DIM_256:
        assert config.head_dim == 256 and config.attn_scale == 144 ** -0.5
    from exl_backends.model.ops import ops_for
    assert missing_ops(config, ops_for(torch.device("cuda"))) == []
    ids = decisive_ids(path, (PREFILL + DECODE,)).tolist()
    cpu = run(Model.load(path, config, "cpu", torch.float32), ids, graphs=False)
    gpu = run(Model.load(path, config, "cuda", torch.float16), ids, graphs)
    for step, (ours, ref) in enumerate(zip(gpu, cpu)):
        assert rel_err(ours, ref) < TOLERANCE, f"step {step}: relative error {rel_err(ours, ref):.3g}"

