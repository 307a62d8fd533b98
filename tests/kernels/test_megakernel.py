"""The decode megakernel (kernels/megakernel.cu + .py): a run of one-row matmuls and their staging as one persistent
launch. CPU: its schedule, and that the argument struct Python packs is the one the kernel reads (host-compiled with
nvcc). GPU: a chained decode step gives launch-per-op's logits bit for bit (the same plans' sums in the same order),
eager and graph-replayed, over EXL2 widths and mixes, biases, act-order and every cache mode; and greedy generation
through the Generator is unchanged. Each GPU check runs every segment kernel: EXL_MEGAKERNEL=1 (weights read from
global memory), =ring (weights through a producer warp's ring in shared memory) and =ring-fold (the same, each
matmul block staging its own x)."""
from __future__ import annotations

import shutil
import subprocess

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kernel_testing import on_gpu

from exl_backends.kernels import megakernel as mk
from exl_backends.kernels import quant_matmul as qm
from exl_backends.kernels.loader import KERNEL_DIR
from exl_backends.model.batch import Batch, SeqChunk
from exl_backends.model.cache import KVCache
from exl_backends.model.config import ModelConfig
from exl_backends.model.model import Model
from exl_backends.model.runner import Runner

from conftest import FIXTURES, needs_fixtures, unlink_norms

# ----------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("blocks, grid", [([40, 300, 40, 500, 1, 7], 264), ([3, 3, 3], 2), ([1000], 132)])
def test_the_schedule_spreads_a_segments_blocks_evenly(blocks, grid):
    """Each op starts on the CTA after the one that ran the op before's last block, so over the whole segment every
    CTA runs floor or ceil of (blocks / grid) blocks, and each op's blocks go to distinct CTAs while it has no more
    blocks than CTAs."""
    per_cta = [0] * grid
    for n, first in zip(blocks, mk.schedule(blocks, grid)):
        ctas = [(first + v) % grid for v in range(n)]
        if n <= grid:
            assert len(set(ctas)) == n
        for c in ctas:
            per_cta[c] += 1
    assert max(per_cta) - min(per_cta) <= 1 and sum(per_cta) == sum(blocks)


def test_describe_names_every_op_and_what_it_waits_for():
    params = torch.zeros(1, dtype=torch.uint8)
    ops = [mk.Op(mk.STAGE, 16, 8192, params, {}, 1e-5, 16, "4096 x 4096"),
           mk.Op(mk.MATMUL, 400, 64, params, {}, name="4096 x 4096")]
    text = mk.describe(ops, 264)
    assert "one launch of 264 CTAs" in text and "op 0: stage x 4096 x 4096: 16 blocks on CTAs 0..15" in text
    assert "op 1: matmul 4096 x 4096: 400 blocks on every CTA (1.5 blocks each); waits for op 0 (done[0] = 16)" in text


HARNESS = r"""
#include "megakernel.cu"
#include <cstddef>
#include <cstdio>
int main() {
    OFFSETS
    printf("%zu %zu %zu %zu %zu %zu %zu %zu\n", sizeof(mk::Op), offsetof(mk::Segment<SEGMENT_N>, op),
           offsetof(mk::Segment<SEGMENT_N>, done), offsetof(mk::Segment<SEGMENT_N>, n_ops),
           offsetof(mk::Segment<SEGMENT_N>, ring_slots), offsetof(mk::Segment<SEGMENT_N>, xs_smem),
           offsetof(mk::Segment<SEGMENT_N>, ring_smem), sizeof(mk::Segment<SEGMENT_N>));
}
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("n", mk.SIZES)
def test_the_packed_segment_is_the_kernels_struct(tmp_path, n):
    lines = "\n    ".join(f'printf("%zu\\n", offsetof(mk::Op, {name}));' for name in mk.OP_DTYPE.names)
    (tmp_path / "harness.cu").write_text(HARNESS.replace("OFFSETS", lines))
    exe = tmp_path / "harness"
    subprocess.run(["nvcc", "-std=c++17", f"-I{KERNEL_DIR}", "-arch=sm_90", f"-DSEGMENT_N={n}", "-o", str(exe),
                    str(tmp_path / "harness.cu")], check=True, capture_output=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    assert [int(v) for v in out[:len(mk.OP_DTYPE.names)]] == [mk.OP_DTYPE.fields[n][1] for n in mk.OP_DTYPE.names]
    seg = mk.segment_dtype(qm.PARAMS_DTYPE, n)
    assert [int(v) for v in out[len(mk.OP_DTYPE.names):]] == [
        mk.OP_DTYPE.itemsize, seg.fields["op"][1], seg.fields["done"][1], seg.fields["n_ops"][1],
        seg.fields["ring_slots"][1], seg.fields["xs_smem"][1], seg.fields["ring_smem"][1], seg.itemsize]
    assert seg.itemsize <= 32764            # the kernel parameter space (CUDA 12.1+)


def test_a_one_row_matmul_appends_its_stage_and_matmul():
    """What QuantMatmul._small appends in a chain: stage_xs's blocks per part and arguments, then the matmul's plan,
    both reading the plan's Params; outputs beyond the parts stay null."""
    plan = SimpleNamespace(params=np.zeros((), [("a", np.int32)]), ws_floats=0, blocks=96, smem=64, threads=224)
    pair = mk.OneRowMatmul(plan, 4096, 16, torch.device("cpu"))
    chain = mk.Chain(torch.zeros(26, dtype=torch.int32))
    x, xs, residual, w, new = (torch.zeros(4096, dtype=torch.float16) for _ in range(5))
    ys = [torch.zeros(1, 4096, dtype=torch.float16), torch.zeros(1, 1024, dtype=torch.float16)]
    pair.append(chain, x, (None, residual, w, new, 1e-5), xs, ys)
    stage, matmul = chain.ops
    assert (stage.kind, stage.blocks, stage.smem, stage.grid_x, stage.eps) == (mk.STAGE, 32, 8192, 16, 1e-5)
    assert stage.tensors["x"] is x and stage.tensors["norm_w"] is w and stage.tensors["xs"] is xs
    assert (matmul.kind, matmul.blocks, matmul.smem, matmul.name) == (mk.MATMUL, 96, 64, "4096 x 4096+1024")
    assert matmul.tensors["y1"] is ys[1] and "y2" not in matmul.tensors and matmul.tensors["ws"] is None
    record = mk.segment(chain.ops, 264, torch.zeros(3, dtype=torch.int32))["op"]
    assert len(record) == 2                             # the pair travels in the 2-op kernel's argument, not 12's
    assert record[1]["first"] == 32 and record[1]["y2"] == 0 and record[0]["params"] == record[1]["params"] == 0
    assert record[1]["strips_per_block"] == 7           # the plan's (threads / 32), not the CTA's 8 warps


def test_a_folded_chain_appends_one_op_that_stages_its_own_x(monkeypatch):
    """EXL_MEGAKERNEL=ring-fold: the stage's inputs travel with the matmul op (no stage op, no xs), and its shared
    memory holds the normed row (2 bytes a K) before the plan's chunk_meta."""
    monkeypatch.setenv("EXL_MEGAKERNEL", "ring-fold")
    plan = SimpleNamespace(params=np.zeros((), [("a", np.int32)]), ws_floats=0, blocks=96, smem=64, threads=256)
    pair = mk.OneRowMatmul(plan, 4096, 16, torch.device("cpu"))
    chain = mk.Chain(torch.zeros(26, dtype=torch.int32))
    x, xs, residual, w, new = (torch.zeros(4096, dtype=torch.float16) for _ in range(5))
    pair.append(chain, x, (None, residual, w, new, 1e-5), xs, [torch.zeros(1, 4096, dtype=torch.float16)])
    (op,) = chain.ops
    assert (op.kind, op.blocks, op.smem, op.eps) == (mk.MATMUL, 96, 2 * 4096 + 64, 1e-5)
    assert op.tensors["x"] is x and op.tensors["norm_w"] is w and op.tensors["new_residual"] is new
    assert "xs" not in op.tensors
    record = mk.segment(chain.ops, 264, torch.zeros(2, dtype=torch.int32))["op"][0]
    assert record["x"] == x.data_ptr() and record["xs"] == 0 and record["kind"] == mk.MATMUL


def test_a_segment_takes_the_smallest_kernel_that_holds_its_ops():
    assert [mk.size_for(n) for n in (1, 2, 3, 4, 5, 8, 9, 12)] == [2, 2, 4, 4, 8, 8, 12, 12]
    assert mk.kernel_name(8) == "decode_segment_exl2_8"
    with pytest.raises(StopIteration):
        mk.size_for(mk.MAX_OPS + 1)                     # (Chain.flush cuts longer chains at MAX_OPS)


def matmul_op(split_chunks: list[int], smem: int) -> mk.Op:
    params = np.zeros((), qm.PARAMS_DTYPE)
    params["n_parts"] = 1
    part = params["part"][0]
    part["n_splits"] = len(split_chunks) - 1
    part["split_chunk"][:len(split_chunks)] = split_chunks
    return mk.Op(mk.MATMUL, 10, smem, params, {})


def test_the_ring_fits_beside_the_longest_splits_x_or_is_not_used():
    """RING's shared memory: the ops' own area, then x of the longest split (64 bytes a chunk), then
    whole slots up to RING_SMEM; too little room for MIN_RING_SLOTS slots: no ring (the plain segment runs)."""
    ops = [mk.Op(mk.STAGE, 16, 8192, np.zeros((), qm.PARAMS_DTYPE), {}), matmul_op([0, 100, 448], 8 * 348)]
    xs, ring, slots = mk.ring_layout(ops)
    assert xs == 8192 and ring == 8192 + 64 * 348 and ring % 128 == 0
    assert slots == min(mk.MAX_RING_SLOTS, (mk.RING_SMEM - ring) // mk.RING_SLOT) >= mk.MIN_RING_SLOTS
    assert ring + slots * mk.RING_SLOT <= mk.RING_SMEM
    assert mk.ring_layout([matmul_op([0, 1200], 8 * 1200)]) is None      # 75 KB of x leaves room for one slot


def test_chaining_without_counters_changes_nothing():
    with mk.chaining(None) as chain:
        assert chain is None and mk.active() is None
    mk.flush()          # outside any chain: nothing to do


# ----------------------------------------------------------------------------------------------- GPU

PAGE = 64
CHECKPOINTS = ["llama_tiny_exl2_4.0bpw_h6", "llama_tiny_exl2_2.5bpw_h6", "llama_tiny_exl2_6.0bpw_h8",
               "qwen2_tiny_exl2_4.0bpw_h6"]       # every width, 8-bit head, q/k/v biases (Qwen2)


def decode_step(model: Model, cache_mode: str, prompt_len: int):
    """A cache holding a random prompt of prompt_len tokens (crossing a page), and the batch of its next token."""
    cache = KVCache(model.config, 16, PAGE, cache_mode, "cuda", torch.float16)
    pages = cache.pool.allocate(4)
    g = torch.Generator().manual_seed(prompt_len)
    ids = torch.randint(0, model.config.vocab_size, (prompt_len + 1,), generator=g).tolist()
    model.forward(Batch.build([SeqChunk(ids[:-1], 0, pages)], PAGE, "cuda"), cache)
    return cache, Batch.build([SeqChunk(ids[-1:], prompt_len, pages)], PAGE, "cuda")


def kernels_of(chain: mk.Chain) -> set[str]:
    return {k.rsplit("_", 2)[0] for k in chain.kernels}


@on_gpu
@needs_fixtures()
@pytest.mark.parametrize("flag", ["1", "ring", "ring-fold"])
@pytest.mark.parametrize("cache_mode", ["fp16", "q8", "q6", "q4"])
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_a_chained_step_gives_launch_per_ops_logits_bit_for_bit(name, cache_mode, flag, monkeypatch):
    monkeypatch.setenv("EXL_MEGAKERNEL", flag)
    path = FIXTURES / "exl2" / name
    model = Model.load(path, ModelConfig.from_dir(path), "cuda", torch.float16)
    assert model.chainable()
    unlink_norms(model)          # the segments stage each norm (a chain's launches feed none)
    cache, step = decode_step(model, cache_mode, 70)
    plain = model.forward(step, cache).clone()
    with mk.chaining(mk.counters(len(model.blocks), model.device)) as chain:
        chained = model.forward(step, cache).clone()
    # each block's q/k/v ends one, the last block's MLP one, a quantized head one
    assert len(chain.segments) == len(model.blocks) + 1 + (getattr(model.lm_head, "kernel", None) is not None)
    assert kernels_of(chain) == {"decode_segment" if flag == "1" else "decode_ring"}
    assert torch.equal(chained, plain)
    again = Runner(model, cache, max_batch=1, max_pages=4, eager=False)
    for _ in range(3):                                           # the counters reset themselves between replays
        assert torch.equal(again.forward(step), plain)
    assert again.graphs.by_shape[1, 1].segment_counters is not None


@on_gpu
@pytest.mark.parametrize("flag", ["1", "ring", "ring-fold"])
@pytest.mark.parametrize("strips_per_block", [8, 7, 5])
def test_a_chained_matmul_is_its_own_launch_bit_for_bit(strips_per_block, flag, monkeypatch):
    """Each op of a segment runs launch-per-op's plan, also where that plan's blocks have fewer strips than the
    CTA has warps (as small_blocks picks for the 8B gate/up): fused parts whose strip counts are not multiples of
    the block's, normed and gated staging, several segments from one counters tensor."""
    from exl_backends.formats import synthetic
    from exl_backends.kernels import planning
    from exl_backends.kernels import quant_matmul as qm
    monkeypatch.setenv("EXL_MEGAKERNEL", flag)
    monkeypatch.setattr(planning, "SMALL_STRIPS_PER_BLOCK", (strips_per_block,))
    k = 4128
    weights = [synthetic.random_exl2(k, 517, "0.05:8b_32g/0.95:4b_128g", seed=1),
               synthetic.random_exl2(k, 300, "0.1:3b_64g/0.9:2b_64g", seed=2)]
    f = qm.fuse([qm.prepare(w.to(torch.device("cuda")), None) for w in weights])
    assert f.plans[1].threads == 32 * strips_per_block and f.segment is not None
    gen = torch.Generator().manual_seed(strips_per_block)
    h, residual, up = ((torch.randn(1, k, generator=gen) * s).half().cuda() for s in (1, 4, 1))
    w = (torch.rand(k, generator=gen) + 0.5).half().cuda()
    (normed, new), gated = f.forward_normed(h, residual, w, 1e-5), f.forward(h, up)
    done = mk.counters(2, torch.device("cuda"))
    for _ in range(2):                                       # the counters reset themselves
        with mk.chaining(done) as chain:
            chained_normed, chained_new = f.forward_normed(h, residual, w, 1e-5)
            mk.flush()
            chained_gated = f.forward(h, up)
        ops_each = 1 if flag == "ring-fold" else 2                  # folded: the matmul stages its own x
        assert len(chain.segments) == 2 and all(len(ops) == ops_each for ops, _ in chain.segments)
        assert kernels_of(chain) == {"decode_segment" if flag == "1" else "decode_ring"}
        assert torch.equal(chained_new, new)
        assert all(torch.equal(a, b) for a, b in zip(chained_normed + chained_gated, normed + gated))
        assert done.count_nonzero() == 0


@on_gpu
@needs_fixtures()
@pytest.mark.parametrize("flag", ["1", "ring", "ring-fold"])
def test_greedy_generation_is_unchanged_by_the_megakernel(flag, monkeypatch):
    from exl_backends import ExlForCausalLM, Generator

    def tokens(path: str):
        monkeypatch.setenv("EXL_MEGAKERNEL", path)
        model = ExlForCausalLM.from_pretrained(FIXTURES / "exl2" / "llama_tiny_exl2_4.0bpw_h6", device="cuda",
                                               max_seq_len=512)
        unlink_norms(model.model)            # the segments stage each norm, so their tokens are its bit for bit
        gen = Generator(model, cuda_graphs=True, max_batch_size=1)
        out = gen.submit([509] + list(range(20, 60)), max_new_tokens=64, stop_token_ids=[]).result().token_ids
        assert (gen.runner.graphs.by_shape[1, 1].segment_counters is not None) == (path != "0")
        return out
    assert tokens(flag) == tokens("0")


@on_gpu
@needs_fixtures()
def test_the_printed_schedule_is_the_captured_steps(monkeypatch):
    from exl_backends.commands.bench import decode_schedule
    monkeypatch.setenv("EXL_MEGAKERNEL", "1")
    path = FIXTURES / "exl2" / "llama_tiny_exl2_4.0bpw_h6"
    model = Model.load(path, ModelConfig.from_dir(path), "cuda", torch.float16)
    text = decode_schedule(model)
    assert text.startswith(f"a decode step of one sequence: {len(model.blocks) + 2} megakernel launches")
    assert "launch 0: one launch of" in text and "op 1: matmul" in text and "waits for op 0" in text


def test_the_schedule_command_says_why_it_does_not_apply(tmp_path):
    from conftest import save_tiny, tiny_config
    from exl_backends.commands.bench import decode_schedule
    save_tiny(tmp_path, tiny_config("llama"))
    text = decode_schedule(Model.load(tmp_path, ModelConfig.from_dir(tmp_path), "cpu", torch.float32))
    assert text.startswith("decode runs launch-per-op on this model")
