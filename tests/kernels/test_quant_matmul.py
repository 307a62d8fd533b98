"""Quantized matmul (kernels/quant_matmul.py and its kernel families: matmul_rows.cu, gemm.cu, wgmma.cu, dequant.cu)
against the CPU reference.

CPU tests check what prepare() builds: the lane layout read back the way the kernels read it must give the
reference's dequantized weight bit for bit, and the kernel's own bit-extraction functions (compiled for the host
with nvcc) must read the bits the Python repack wrote. GPU tests (marker gpu) run the kernels on random inputs with
odd sizes against the reference computed in f32 from the exact dequantized weight."""
from __future__ import annotations

import itertools

import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import FIXTURES
from kernel_testing import on_gpu, poison_allocator
from safetensors.torch import save_file

from exl_backends.formats import exl2, synthetic
from exl_backends.formats.tensors import TensorStore
from exl_backends.kernels import planning
from exl_backends.kernels import lane_layout as ll
from exl_backends.kernels import quant_matmul as qm
from exl_backends.model import reference

EXL2_FIXTURE = FIXTURES / "exl2" / "llama_tiny_exl2_2.5bpw_h6"
HOPPER_SLOTS = {2: 132, 4: 64, 8: 32, 16: 14}   # clusters of each size a GPU of 132 SMs might run at once

# every width alone, the spec's candidate mixes (§10.6), and 3/2-bit mixes
EXL2_MIXES = ["2b_64g", "3b_128g", "4b_128g", "5b_64g", "6b_32g", "8b_128g",
              "0.05:8b_32g/0.95:4b_128g", "0.1:3b_64g/0.9:2b_64g", "0.05:6b_32g/0.2:3b_64g/0.75:2b_64g",
              "0.05:8b_32g/0.1:4b_128g/0.85:3b_128g", "0.05:5b_32g/0.95:3b_32g", "0.15:8b_128g/0.85:6b_128g",
              "0.05:8b_32g/0.1:6b_32g/0.85:5b_32g"]


# ----------------------------------------------------------------------------------------------- CPU: layout


def unlane_order(values: torch.Tensor) -> torch.Tensor:
    """Inverse of ll.lane_order: [G, strips, 8, 4] -> [G, Np]."""
    g, s = values.shape[:2]
    return values.reshape(g, s, 8, 2, 2).permute(0, 1, 3, 4, 2).reshape(g, s * 32)


def lane_codes(lane: torch.Tensor, bits: int) -> torch.Tensor:
    """A chunk's lane words [S, 32 lanes, bits] -> its codes [32 rows, 32 S columns], read with ll.PAIR_BITS."""
    strips = lane.shape[0]
    pos = torch.tensor(ll.PAIR_BITS[bits])                                  # [16 pairs, bits]
    code = torch.zeros(strips, 32, 16, 2, dtype=torch.int64)
    for k in range(bits):
        for e in range(2):
            p = pos[:, k] + 16 * e
            code[..., e] |= ((lane[:, :, p // 32] >> (p % 32)) & 1) << k
    # lane 4g + q, pair 8t + 4u + 2s + h, e  ->  row 16s + 4q + 2h + e, column 32 strip + 16t + 8u + g
    code = code.reshape(strips, 8, 4, 2, 2, 2, 2, 2)                        # [S, g, q, t, u, s, h, e]
    return code.permute(5, 2, 6, 7, 0, 3, 4, 1).reshape(32, strips * 32)


def chunk_scales(lay: ll.LaneLayout, c: int) -> tuple[torch.Tensor, torch.Tensor | int]:
    """(scales [Np] f32 holding fp16 values, zero points) of chunk c, derived from chunk_meta and the strip-major
    meta0/meta1 the way the kernels do."""
    g, base = lay.chunk_meta[c].tolist()
    assert g == lay.chunk_group[c]
    if lay.fmt is ll.Format.GPTQ:
        scales, zeros = lay.meta0[:, g].cpu(), lay.meta1[:, g].cpu()                  # [strips, 8, 4]
        return unlane_order(scales[None]).float()[0], unlane_order(zeros[None]).long()[0]
    words = lay.meta0[:, g].cpu().long()[None] & 0xFFFFFFFF                           # [1, strips, 4]
    lane16 = torch.stack([(words[..., g8 // 2] >> 16 * (g8 % 2)) & 0xFFFF for g8 in range(8)], dim=2)   # [1, S, 8]
    codes = torch.stack([lane16 & 15, lane16 >> 8 & 15, lane16 >> 4 & 15, lane16 >> 12 & 15], dim=3)
    assert base >> 16 & 0xFFFF == base & 0xFFFF
    m = torch.tensor([base & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    return ((unlane_order(codes)[0] + 1) ** 2 * m).half().float(), 2 ** (lay.chunk_bits[c] - 1)


def lane_dequant(lay: ll.LaneLayout) -> torch.Tensor:
    """The fp16 weight [N, K] read back from a lane layout the way the kernels read it: chunk c of width B at word
    32 * (sum of the widths before it) of its strip, runs of one width in WIDTHS order (run_start)."""
    words = (lay.words.cpu().long() & 0xFFFFFFFF).view(lay.strips, -1)
    bounds = lay.run_start
    stored = torch.empty(lay.k, lay.np_, dtype=torch.float16)
    word = 0
    for c, bits in enumerate(lay.chunk_bits):
        assert bounds[ll.WIDTHS.index(bits)] <= c < bounds[ll.WIDTHS.index(bits) + 1]
        chunk = words[:, word: word + 32 * bits]
        word += 32 * bits
        planes = torch.split(chunk, [32 * w for w in ll.plane_words(bits)], dim=1)
        lane = torch.cat([p.reshape(lay.strips, 32, -1) for p in planes], dim=2)
        scales, z = chunk_scales(lay, c)
        stored[32 * c: 32 * c + 32] = ((lane_codes(lane, bits) - z).float() * scales).half()
    assert word == lay.words_per_strip
    w = torch.empty_like(stored)
    w[lay.perm.cpu().long() if lay.perm is not None else torch.arange(lay.k)] = stored
    return w[:, :lay.n].T


@pytest.mark.parametrize("bits", ll.WIDTHS)
def test_unpacking_reads_back_the_packed_codes(bits):
    """reference.unpack_bits (one shift a code where codes never straddle words, a 64-bit window where they do)
    inverts pack_bits, signed words (top bit set) included; unpack_codes is it as uint8."""
    codes = torch.randint(0, 2**bits, (96, 40), generator=torch.Generator().manual_seed(bits))
    codes[0] = 2**bits - 1
    words = reference.pack_bits(codes, bits)
    assert torch.equal(reference.unpack_bits(words, bits, 96), codes)
    assert torch.equal(reference.unpack_bits(words, bits, 90), codes[:90])
    short = words[:(45 * bits + 31) // 32]                    # a stream cut after its 45th code's last word
    assert torch.equal(reference.unpack_bits(short, bits, 45), codes[:45])
    got = ll.unpack_codes(words, bits, 96)
    assert got.dtype == torch.uint8 and torch.equal(got.long(), codes)


@pytest.mark.parametrize("mix", EXL2_MIXES)
@pytest.mark.parametrize("k,n", [(416, 96), (96, 517)])
def test_exl2_lane_layout_reads_back_the_reference_weight(mix, k, n):
    w = synthetic.random_exl2(k, n, mix, seed=k + n)
    assert torch.equal(lane_dequant(ll.exl2_layout(w)), w.dequantize())


def test_an_exl2_layout_for_another_device_reads_nothing_back_from_it():
    """A model's layers are repacked from their CPU tensors for the GPU (QuantLinear.to): the tables are made on the
    CPU and only the codes unpacked on the device, so the host never waits for the device's queue. On the meta
    device any read back (.cpu(), .tolist()) or mix of devices raises; the layout is the CPU one's shape for shape."""
    from exl_backends.model.linear import QuantLinear
    w = synthetic.random_exl2(4128, 517, "0.05:8b_32g/0.1:6b_32g/0.1:5b_64g/0.45:4b_128g/0.2:3b_64g/0.1:2b_64g", seed=5)
    cpu, meta = ll.exl2_layout(w), ll.exl2_layout(w, torch.device("meta"))
    for name in ("words", "chunk_meta", "meta0", "perm"):
        a, b = getattr(cpu, name), getattr(meta, name)
        assert (a is None) == (b is None)
        if a is not None:
            assert b.device.type == "meta" and (b.shape, b.dtype) == (a.shape, a.dtype), name
    assert (meta.chunk_bits, meta.chunk_group) == (cpu.chunk_bits, cpu.chunk_group)
    assert QuantLinear(w, None, "cpu").kernel is None          # the CPU path keeps the packed weight


@pytest.mark.parametrize("mix", ["0.05:8b_32g/0.95:4b_128g", "0.1:6b_32g/0.9:3b_64g"])
def test_stored_places_put_x_where_stage_xs_puts_it(mix):
    """QuantMatmul.stored_x's places (where the op before writes one row of x for the one-row kernel) give
    stage_xs's staged row: stored row k holds x[perm[k]], times 2^-4 on 4-bit chunks' rows with (k >> 1) & 1."""
    w = synthetic.random_exl2(416, 96, mix, seed=7)
    lay = ll.exl2_layout(w)
    assert lay.perm is not None                                # act-order: the places are not the identity
    x = torch.randn(lay.k, generator=torch.Generator().manual_seed(1)).half()
    places = qm.stored_places(lay).long()
    staged = torch.zeros(lay.k, dtype=torch.float16)
    staged[places & 0x7FFFFFFF] = torch.where(places < 0, x.float() * 0.0625, x.float()).half()
    k = torch.arange(lay.k)
    bits = torch.tensor(lay.chunk_bits).repeat_interleave(32)
    scale = torch.where((bits == 4) & (k >> 1 & 1).bool(), 0.0625, 1.0)
    assert torch.equal(staged, (x[lay.perm.long()].float() * scale).half())
    assert (places < 0).any() == (4 in lay.chunk_bits)


def test_exl2_lane_layout_of_a_real_exllamav2_checkpoint():
    store = TensorStore(EXL2_FIXTURE)
    for key, (k, n) in {"model.layers.0.mlp.down_proj": (768, 256), "model.layers.1.self_attn.q_proj": (256, 256),
                        "lm_head": (256, 512)}.items():
        w = exl2.load(store, key, k, n)
        assert torch.equal(lane_dequant(ll.exl2_layout(w)), w.dequantize()), key


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size,act_order,sym,v2", [(32, True, False, False), (64, False, True, False),
                                                          (128, True, True, True), (-1, False, False, True)])
def test_gptq_lane_layout_reads_back_the_reference_weight(bits, group_size, act_order, sym, v2):
    w = synthetic.random_gptq(416, 128 if bits == 3 else 80, bits, group_size, act_order, sym, seed=bits, v2=v2)
    lay = ll.gptq_layout(w)
    assert torch.equal(lane_dequant(lay), w.dequantize())
    assert (lay.perm is None) == (not act_order)


def test_gptq_groups_that_are_not_whole_chunks_are_refused():
    w = synthetic.random_gptq(96, 64, 4, 16, False, True)
    with pytest.raises(ll.UnsupportedFormatError, match="multiples of 32"):
        ll.gptq_layout(w)


def test_pair_bits_use_every_bit_of_a_lanes_words_once():
    for bits, table in ll.PAIR_BITS.items():
        used = sorted(p + 16 * e for pair in table for p in pair for e in range(2))
        assert used == list(range(32 * bits)), bits
        for pair in table:      # the kernel turns a pair into a half2: the low code sits in the low 16 bits
            assert all(p % 32 < 16 for p in pair)


def test_splits_cover_the_chunks_with_balanced_bytes():
    chunk_bits = [8] * 7 + [4] * 13 + [3] * 100 + [2] * 9
    for n in (1, 2, 5, 17, 64):
        starts = qm.split_starts(chunk_bits, n)
        assert starts[0] == 0 and starts[-1] == len(chunk_bits) and starts == sorted(starts)
        sizes = [sum(chunk_bits[a:b]) for a, b in zip(starts, starts[1:])]
        assert max(sizes) - min(sizes) <= 2 * 8, (n, sizes)


def test_x_tile_rows_start_eight_banks_apart():
    for starts in ([0, 3, 7], [0, 4], [0, 1, 2], [0, 33, 40]):
        stride, smem = qm.x_tile(starts, 5)
        assert stride // 2 % 32 == 8 and stride >= 32 * max(b - a for a, b in zip(starts, starts[1:]))
        assert smem == 5 * stride * 2


@pytest.mark.parametrize("rows", [1, 2, 9, 16])
def test_small_m_plans_run_in_one_wave_within_limits(rows):
    lays = [ll.exl2_layout(synthetic.random_exl2(4096, n, "0.05:8b_32g/0.95:4b_128g", seed=n)) for n in (256, 96)]
    counters = [torch.zeros(lay.strips, dtype=torch.int32) for lay in lays]
    plan = qm.plan_small(lays, [None, None], counters, rows, 132, HOPPER_SLOTS)
    p = plan.params
    splits = [int(n) for n in p["part"]["n_splits"][:2]]
    assert plan.cluster == planning.cluster_size(splits, rows, plan.blocks // max(splits), HOPPER_SLOTS)
    assert qm.plan_small(lays, [None, None], counters, rows, 132, {}).cluster == 1
    assert int(p["n_parts"]) == 2 and int(p["M"]) == rows and int(p["K"]) == 4096
    assert plan.smem <= planning.X_SMEM_BYTES
    # x comes staged (stage_xs): shared memory holds the longest split's chunk_meta entries only
    longest = max(int(np.diff(p["part"]["split_chunk"][i, :int(p["part"]["n_splits"][i]) + 1]).max())
                  for i in range(2))
    assert plan.smem == 8 * longest and int(p["meta_smem"]) == 0
    assert plan.kernel == qm.MATMUL_KERNELS[ll.Format.EXL2, 1 if rows == 1 else 8 if rows <= 8 else 16]
    assert plan.blocks <= planning.RESIDENT_BLOCKS[qm.rows_class(rows)] * 132   # one wave
    block0, ws = 0, 0
    for i, lay in enumerate(lays):
        part = p["part"][i]
        n = int(part["n_splits"])
        assert 1 <= n <= qm.MAX_SPLITS and (n == 1 or n * rows <= planning.MAX_SPLIT_ROWS)
        assert part["split_chunk"][:n + 1].tolist() == qm.split_starts(lay.chunk_bits, n)
        assert part["split_group"][:n + 1].tolist() == [lay.chunk_group[min(c, len(lay.chunk_group) - 1)]
                                                        for c in part["split_chunk"][:n + 1]]
        assert part["run_start"].tolist() == lay.run_start
        words = [32 * sum(lay.chunk_bits[:c]) for c in range(len(lay.chunk_bits) + 1)]
        assert part["run_word"].tolist() == [words[c] for c in lay.run_start[:-1]]
        assert part["split_word"][:n + 1].tolist() == [words[c] for c in part["split_chunk"][:n + 1]]
        assert int(part["block0"]) == block0 and int(part["col_blocks"]) == -(-lay.strips // (plan.threads // 32))
        assert int(part["ws_offset"]) == ws and int(part["qw"]) == lay.words.data_ptr()
        block0 += int(part["col_blocks"]) * n
        ws += n * rows * lay.np_ if n > 1 else 0
    assert plan.blocks == block0 and plan.ws_floats == ws


def test_one_row_launches_run_in_clusters_where_every_part_splits_k_alike():
    """qmm_rows.cuh CLUSTER SUMS: one row of x, sm_90+, every part split the same 2, 4, 8 or 16 ways."""
    assert planning.cluster_size([4, 4, 4], 1, 12, HOPPER_SLOTS) == 4
    assert planning.cluster_size([1], 1, 12, HOPPER_SLOTS) == 1               # nothing to sum
    assert planning.cluster_size([11, 11, 11], 1, 12, HOPPER_SLOTS) == 1     # not a cluster's size
    assert planning.cluster_size([32], 1, 4, HOPPER_SLOTS) == 1               # more than a cluster holds
    assert planning.cluster_size([4, 2], 1, 4, HOPPER_SLOTS) == 1             # parts split differently
    assert planning.cluster_size([4], 8, 4, HOPPER_SLOTS) == 1                # 8- and 16-row kernels: counters
    assert planning.cluster_size([4], 1, 4, {}) == 1                          # no clusters (before Hopper, GPTQ)
    assert planning.cluster_size([16], 1, 14, {16: 14}) == 16
    assert planning.cluster_size([16], 1, 15, {16: 14}) == 1                  # a second wave: counters


def test_one_row_plans_take_a_cluster_sized_split_where_the_model_rates_it_faster():
    """planning.clustered_splits: the 1B shape's q/k/v (K 2048, 3 parts), which the planner alone splits 11 ways,
    takes a split count a cluster can hold once the counters' tail is counted, of the sizes whose clusters the GPU
    runs all at once; with no clusters the planner's own."""
    lays = [ll.exl2_layout(synthetic.random_exl2(2048, n, "4b_128g", seed=n)) for n in (2048, 512, 512)]
    counters = [torch.zeros(lay.strips, dtype=torch.int32) for lay in lays]
    hopper = qm.plan_small(lays, [None] * 3, counters, 1, 132, HOPPER_SLOTS)
    ampere = qm.plan_small(lays, [None] * 3, counters, 1, 132, {})
    splits = [int(n) for n in hopper.params["part"]["n_splits"][:3]]
    assert hopper.cluster == splits[0] in planning.CLUSTER_SIZES and len(set(splits)) == 1
    assert ampere.cluster == 1 and [int(n) for n in ampere.params["part"]["n_splits"][:3]] == \
        planning.small_blocks(lays, 1, 132)[1]
    assert hopper.blocks <= planning.RESIDENT_BLOCKS[1] * 132
    short = {**HOPPER_SLOTS, hopper.cluster: hopper.blocks // hopper.cluster - 1}     # a second wave
    other = qm.plan_small(lays, [None] * 3, counters, 1, 132, short)
    assert other.cluster != hopper.cluster and other.blocks <= planning.RESIDENT_BLOCKS[1] * 132
    if other.cluster > 1:
        assert short[other.cluster] >= other.blocks // other.cluster


def test_small_m_blocks_of_seven_strips_fill_the_wave_where_eight_leave_it_short():
    """The 8B shape's gate/up (2 x 448 strips of 128 4-bit chunks, 2 splits): 224 blocks of 8 strips on 264 slots
    leave 40 SMs with one block; 256 of 7 strips fill it. q/k/v (4096 x (4096, 1024, 1024)) fills it with 8."""
    def lay(n):
        return SimpleNamespace(k=4096, strips=n // 32, chunk_bits=[4] * 128)
    assert qm.small_blocks([lay(14336), lay(14336)], 1, 132) == (7, [2, 2])
    spb, splits = qm.small_blocks([lay(4096), lay(1024), lay(1024)], 1, 132)
    assert spb == 8 and sum(-(-s // 8) * n for s, n in zip((128, 32, 32), splits)) <= 264


def test_sixteen_row_plans_weigh_the_split_reduction_against_the_warps_stream():
    """The model's split-K tail (REDUCE_SECONDS a round of 2 rows x 8 splits) at one 16-row block per SM: 4096 x
    4096 and the down projection 14336 -> 4096 take 8 splits, 4096 x 6144 5 (measured 14.9 / 26.7 / 16.8 us, against
    18.0 / 31.4 / 20.2 for two unpipelined blocks per SM and 8 / 16 / 8 splits); one-row plans are not affected.
    At one row a plan stops at one round of the last warp's reduction: the 1B down projection (8192 -> 2048) takes
    16 splits, not the 33 that fill the wave (8.25 against 8.71 us)."""
    def lay(n, k=4096):
        return SimpleNamespace(k=k, strips=-(-n // 32), chunk_bits=[4] * (k // 32))
    assert qm.small_blocks([lay(4096)], 16, 132)[1] == [8]
    assert qm.small_blocks([lay(6144)], 16, 132)[1] == [5]
    assert qm.small_blocks([lay(4096, 14336)], 16, 132)[1] == [8]
    assert qm.small_blocks([lay(4096)], 1, 132)[1] == [16]
    assert qm.small_blocks([lay(2048, 8192)], 1, 132)[1] == [planning.M1_MAX_SPLITS] == [16]
    bytes_ = [128 * 4 * 128]                     # a strip of 4096 x 4096 at 4 bits
    assert planning._launch_seconds(bytes_, [16], [16], 132, 1, 8, 16) > planning._launch_seconds(bytes_, [16], [8], 132, 1, 8, 16)


def test_the_models_reduction_round_is_the_kernels():
    """REDUCE_ROWS x REDUCE_SPLITS in the planner's model: the rows and splits reduce_splits loads at once at 8-16
    rows (qmm.cuh QMM_REDUCE_ROWS, REDUCE_LOADS / 2); at one row, M1_MAX_SPLITS the splits it loads at
    once."""
    source = (Path(qm.__file__).parent / "qmm.cuh").read_text()
    rows = int(re.search(r"^#define QMM_REDUCE_ROWS (\d+)", source, re.M).group(1))
    loads = int(re.search(r"^constexpr int REDUCE_LOADS = (\d+);", source, re.M).group(1))
    assert (planning.REDUCE_ROWS, planning.REDUCE_SPLITS) == (rows, loads // 2) and planning.M1_MAX_SPLITS == loads


def test_planner_prefers_one_full_wave():
    lay = ll.exl2_layout(synthetic.random_exl2(4096, 4096, "4b_128g"))
    assert qm.choose_splits([lay], 1, 132, 3, 1) == [24]       # 16 column blocks: 384 of 396 slots, not 400


def gemm_warp_tiles(rows: int, shape: tuple[int, int]) -> list[list[int]]:
    """The m16 tiles of x each GEMM warp multiplies, per (M tile, row group), as qmm_tiled.cuh GemmTile cuts them."""
    groups, m_tiles = shape
    m16 = -(-rows // 16)
    per_tile = -(-m16 // m_tiles)
    out = []
    for mt in range(m_tiles):
        t0 = min(m16, mt * per_tile)
        t1 = min(m16, t0 + per_tile)
        per_warp = -(-per_tile // groups)
        for rg in range(groups):
            w0 = min(t1, t0 + rg * per_warp)
            out.append(list(range(w0, w0 + min(per_warp, t1 - w0))))
    return out


@pytest.mark.parametrize("row_groups", [1, 2])
def test_gemm_warps_cover_every_row_once_within_their_registers(row_groups, monkeypatch):
    monkeypatch.setattr(qm, "GEMM_ROW_GROUPS", row_groups)
    for rows in range(qm.LARGE_M, qm.GEMM_ROWS_LIMIT + 1):
        shape = qm.gemm_shape(rows)
        tiles = gemm_warp_tiles(rows, shape)
        assert sorted(t for warp in tiles for t in warp) == list(range(-(-rows // 16))), rows
        assert max(len(warp) for warp in tiles) * 16 <= qm.GEMM_WARP_ROWS, rows
        assert shape[0] == (1 if rows <= qm.GEMM_WARP_ROWS else qm.GEMM_ROW_GROUPS)


@pytest.mark.parametrize("wgmma", [False, True])      # compute capability 9.0 or not
def test_forward_picks_the_path_from_the_rows_alone(wgmma):
    paths = SimpleNamespace(_small="small", _gemm="gemm", _wgmma="wgmma", _dequant_matmul="dequant",
                            wgmma_plan="plan" if wgmma else None)
    picked = {rows: qm.QuantMatmul._path(paths, rows) for rows in range(1, 600)}
    wgmma_rows = set(range(qm.WGMMA_MIN_M, qm.WGMMA_MAX_M + 1)) if wgmma else set()
    assert {r for r, p in picked.items() if p == "small"} == set(range(1, qm.LARGE_M))
    assert {r for r, p in picked.items() if p == "gemm"} == set(range(qm.LARGE_M, qm.GEMM_MAX_M + 1)) - wgmma_rows
    assert {r for r, p in picked.items() if p == "wgmma"} == wgmma_rows
    assert qm.GEMM_MAX_M <= qm.GEMM_ROWS_LIMIT and qm.LARGE_M < qm.WGMMA_MIN_M
    assert qm.WGMMA_MAX_M <= qm.WGMMA_ROWS


def test_wgmma_shared_a_meets_the_descriptors_canonical_layout():
    """wgmma.cu WgmmaSink: where lane 4g + q stores pair (j, s, h) of its strip's chunk is where the wgmma
    descriptor (K-major, no swizzle: 8 rows x 16 bytes a core matrix, LBO along K, SBO along the rows) reads A[column]
    [MMA k]; and D row 16 (warp % 4) + g + 8h of tile t is the epilogue's strip and column."""
    strip_bytes, lbo, sbo = 2048, 128, 512
    for strip in range(4):
        t = strip // 2
        for g, q, p, e in itertools.product(range(8), range(4), range(16), range(2)):
            j, s, h = p // 4, p // 2 % 2, p % 2
            column, k = 16 * (j // 2) + 8 * (j % 2) + g, 16 * s + 8 * h + 2 * q + e
            stored = strip * strip_bytes + (4 * j + 2 * s + h) * 128 + 16 * g + 4 * q + 2 * e
            row, kl = (strip - 2 * t) * 32 + column, k - 16 * s
            read = 2 * t * strip_bytes + 256 * s + row // 8 * sbo + row % 8 * 16 + kl // 8 * lbo + kl % 8 * 2
            assert stored == read, (strip, g, q, p, e)
    for t, warp, g, h in itertools.product(range(2), range(4), range(8), range(2)):
        row = 16 * warp + g + 8 * h
        assert (2 * t + row // 32, row % 32) == (2 * t + warp // 2, warp % 2 * 16 + 8 * h + g)


@pytest.mark.parametrize("n,splits", [(14336, 2), (4096, 8), (517, 16)])
def test_wgmma_plans_fill_one_wave_of_one_block_per_sm(n, splits):
    lay = ll.exl2_layout(synthetic.random_exl2(4096, n, "4b_128g", seed=n))
    plan = qm.plan_wgmma([lay], [None], n_sm=132)
    p = plan.params
    assert plan.kernel == "exl2_wgmma" and int(p["row_groups"]) == 1 and int(p["m_tiles"]) == 1
    assert int(p["part"][0]["n_splits"]) == splits and plan.blocks == -(-lay.strips // qm.WARPS) * splits <= 132
    decoded = qm.WGMMA_DEPTH * qm.WARPS * qm.CHUNK * ll.STRIP * 2
    assert plan.smem == int(p["ring_smem"]) + qm.WGMMA_STAGES * qm.WGMMA_ROWS * qm.CHUNK * 2 + decoded
    assert plan.smem <= 99 * 1024


@pytest.mark.parametrize("rows", [17, 64, 65, 208, 256, 512])
def test_gemm_plans_split_k_to_fill_the_gpu_within_limits(rows):
    lays = [ll.exl2_layout(synthetic.random_exl2(4128, n, "0.05:8b_32g/0.95:4b_128g", seed=n)) for n in (517, 96)]
    shape = qm.gemm_shape(rows)
    plan = qm.plan_gemm(lays, [None, None], shape, n_sm=132)
    p = plan.params
    groups, m_tiles = shape
    assert (int(p["row_groups"]), int(p["m_tiles"]), int(p["n_parts"]), int(p["K"])) == (groups, m_tiles, 2, 4128)
    assert plan.kernel == "exl2_gemm"
    block0 = ws = 0
    for i, lay in enumerate(lays):
        part = p["part"][i]
        n, col_blocks = int(part["n_splits"]), int(part["col_blocks"])
        assert col_blocks == -(-lay.strips // (qm.WARPS // groups))
        assert 1 <= n <= qm.MAX_SPLITS and len(lay.chunk_bits) // n >= qm.GEMM_MIN_CHUNKS
        assert part["split_chunk"][:n + 1].tolist() == qm.split_starts(lay.chunk_bits, n)
        assert int(part["block0"]) == block0 and int(part["ws_offset"]) == ws
        block0 += col_blocks * m_tiles * n
        ws += n * lay.np_ if n > 1 else 0
    assert plan.blocks == block0 and plan.ws_floats == ws
    slots, tiles = qm.GEMM_RESIDENT * 132, plan.blocks // int(p["part"][0]["n_splits"])
    assert plan.blocks <= max(slots, tiles)                       # one wave, unless the tiles alone take more
    assert plan.blocks + tiles > slots or all(                    # and as full as the split limits allow
        len(lay.chunk_bits) // int(part["n_splits"]) < 2 * qm.GEMM_MIN_CHUNKS for lay, part in zip(lays, p["part"]))
    longest = max(b - a for i in range(2) for a, b in zip(p["part"][i]["split_chunk"][:-1],
                                                           p["part"][i]["split_chunk"][1:]) if b > a)
    assert int(p["ring_smem"]) % 16 == 0 and int(p["ring_smem"]) >= 8 * longest
    assert plan.smem == int(p["ring_smem"]) + qm.GEMM_STAGES * 64 * groups * qm.GEMM_XS * 2 <= 99 * 1024


def test_gemm_ring_rows_are_bank_conflict_free():
    """Each 8x8 matrix of a warp's ldmatrix.x4 (8 rows of 16 bytes, any 16-column step s and half) hits all 32
    banks once, and ring rows stay 16-byte aligned."""
    for col in (0, 8, 16, 24):
        banks = [((r * qm.GEMM_XS + col) * 2 // 4 + b) % 32 for r in range(8) for b in range(4)]
        assert sorted(banks) == list(range(32)) and qm.GEMM_XS * 2 % 16 == 0


# ----------------------------------------------------------------------------------------------- CPU: kernel decode

STRUCTS = [("Part", qm.PART_DTYPE), ("Params", qm.PARAMS_DTYPE), ("Chain", qm.CHAIN_DTYPE)]


def _offset_lines() -> str:
    """C++ that prints offsetof of every field of qm.PART_DTYPE, qm.PARAMS_DTYPE and qm.CHAIN_DTYPE, then their
    sizes."""
    lines = [f'printf("%zu\\n", offsetof(qmm::{struct}, {name}));'
             for struct, dtype in STRUCTS for name in dtype.names]
    lines += ['printf("%zu %zu %zu\\n", sizeof(qmm::Part), sizeof(qmm::Params), sizeof(qmm::Chain));']
    return "\n        ".join(lines)


HARNESS = r"""
#include "gemm.cu"
#include <cstddef>
#include <cstdio>
template <int B> void pairs(const unsigned* in) {
    unsigned w[B];
    for (int i = 0; i < B; ++i) w[i] = in[i];
    for (int p = 0; p < 16; ++p) printf("%u %d\n", qmm::pair_bits<B>(w, p), qmm::magic_shift<B>(p));
}
int main() {   // lines "P bits words...", "E bits codes[32 x 32]...", "S word g", "Z word j", "K n", "O 0"
    char op;
    unsigned in[8];
    int b;
    while (scanf(" %c %d", &op, &b) == 2) {
        if (op == 'E') {                 // a chunk's codes, row-major: every lane's b words
            static unsigned codes[32][32];
            for (int i = 0; i < 32 * 32; ++i) scanf("%u", &codes[i / 32][i % 32]);
            for (int lane = 0; lane < 32; ++lane) {
                unsigned w[8];
                qmm::encode_lane(w, b, lane, [&](int row, int col) { return codes[row][col]; });
                for (int i = 0; i < b; ++i) printf("%u ", w[i]);
                printf("\n");
            }
        } else if (op == 'P') {
            for (int i = 0; i < b; ++i) scanf("%u", &in[i]);
            switch (b) { case 2: pairs<2>(in); break; case 3: pairs<3>(in); break; case 4: pairs<4>(in); break;
                         case 5: pairs<5>(in); break; case 6: pairs<6>(in); break; default: pairs<8>(in); }
        } else if (op == 'K') {
            for (int k = 0; k < b; ++k) printf("%d\n", qmm::gemm_k_row(k));
        } else if (op == 'O') {
        OFFSETS
        } else {
            unsigned word = (unsigned)b, sel, r[2];
            scanf("%u", &sel);
            if (op == 'S') { qmm::scale_code_pairs(word, (int)sel, r); printf("%u %u\n", r[0], r[1]); }
            else printf("%u\n", qmm::zero_pair(word, (int)sel));
        }
    }
}
""".replace("OFFSETS", _offset_lines())


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """The kernels' decode functions (dequant.cuh, via gemm.cu) compiled for the host (nvcc; PTX only, so no GPU code generation)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    d = tmp_path_factory.mktemp("qm_harness")
    (d / "harness.cu").write_text(HARNESS)
    subprocess.run([nvcc, "-std=c++17", f"-I{qm.__file__.rsplit('/', 1)[0]}", "-gencode",
                    "arch=compute_75,code=compute_75", "-o", str(d / "harness"), str(d / "harness.cu")], check=True)

    def run(lines: list[str]) -> list[list[int]]:
        out = subprocess.run([str(d / "harness")], input="\n".join(lines) + "\n", capture_output=True, text=True,
                             check=True).stdout
        return [[int(v) for v in line.split()] for line in out.splitlines()]
    return run


def words_by_lane(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """lane_words of one chunk of one strip ([32, 32] codes) as each lane's words, [32 lanes, bits] (unsigned)."""
    words = ll.lane_words(codes, bits).long() & 0xFFFFFFFF               # [1 strip, 32 * bits]
    planes = torch.split(words[0], [32 * w for w in ll.plane_words(bits)])
    return torch.cat([p.reshape(32, -1) for p in planes], dim=1)


def test_kernel_decodes_the_codes_the_repack_wrote(harness):
    gen = torch.Generator().manual_seed(0)
    for bits in ll.WIDTHS:
        codes = torch.randint(0, 2**bits, (32, 32), generator=gen)
        lane = words_by_lane(codes, bits)
        out = harness([f"P {bits} " + " ".join(map(str, lane[l].tolist())) for l in range(32)])
        for l in range(32):
            g, q = divmod(l, 4)
            for p in range(16):
                v, i = out[16 * l + p]
                j, s, h = p // 4, p // 2 % 2, p % 2
                row, col = 16 * s + 4 * q + 2 * h, 16 * (j // 2) + 8 * (j % 2) + g
                for e, half in enumerate((v & 0xFFFF, v >> 16)):
                    assert half >> 10 == 0x19 and half & ((1 << i) - 1) == 0, (bits, l, p)   # 1024 + code * 2^i
                    assert (half & 0x3FF) >> i == codes[row + e, col], (bits, l, p, e)


def test_kernel_encodes_a_lane_as_the_repack_does(harness):
    """dequant.cuh encode_lane (the GPU repack, lane_layout.cu) gives each lane the words lane_words gives it."""
    gen = torch.Generator().manual_seed(3)
    for bits in ll.WIDTHS:
        codes = torch.randint(0, 2**bits, (32, 32), generator=gen)
        out = harness([f"E {bits} " + " ".join(map(str, codes.reshape(-1).tolist()))])
        assert out == words_by_lane(codes, bits).tolist(), bits


def test_gemm_x_columns_meet_the_lane_layouts_weights(harness):
    """The GEMM's x columns (permute_x: x[gemm_k_row(k)]) give ldmatrix's A fragment of lane 4g + q at MMA k = 2q + e
    and 2q + 8 + e of step s the chunk rows whose weights the lane holds as B there: 16s + 4q + 2h + e (h = 0, 1)."""
    rows = [r[0] for r in harness(["K 64"])]
    assert sorted(rows) == list(range(64))
    for t in range(2):                               # two chunks
        for s in range(2):
            for q in range(4):
                for e in range(2):
                    for h in range(2):
                        k = 32 * t + 16 * s + 2 * q + 8 * h + e
                        assert rows[k] == 32 * t + 16 * s + 4 * q + 2 * h + e, (k, rows[k])


def test_launch_parameters_match_the_kernels_structs(harness):
    out = harness(["O 0"])
    fields = [(dtype, name) for _, dtype in STRUCTS for name in dtype.names]
    assert [row[0] for row in out[:-1]] == [dtype.fields[name][1] for dtype, name in fields]
    assert out[-1] == [dtype.itemsize for _, dtype in STRUCTS]


def test_kernel_reads_scale_codes_and_zeros_of_its_columns(harness):
    gen = torch.Generator().manual_seed(1)
    nibbles = torch.randint(0, 16, (1, 32), generator=gen)
    words = ll.exl2_scale_codes(reference.pack_bits(nibbles.T.contiguous(), 4).T.contiguous()).long() & 0xFFFFFFFF
    out = harness([f"S {words[0, 0, g // 2].item()} {g}" for g in range(8)])
    zeros = ll.lane_order(torch.randint(0, 256, (1, 32), generator=gen))          # [1, 1, 8, 4]
    zword = [int(sum(int(zeros[0, 0, g, j]) << 8 * j for j in range(4))) for g in range(8)]
    zout = harness([f"Z {zword[g]} {j}" for g in range(8) for j in range(4)])
    for g in range(8):
        cols = [g, 8 + g, 16 + g, 24 + g]
        for j in range(4):
            half = out[g][j // 2] >> 16 * (j % 2) & 0xFFFF
            assert half == 0x6400 + nibbles[0, cols[j]], (g, j)
            assert zout[4 * g + j][0] == (0x6400 + zeros[0, 0, g, j]) * 0x10001, (g, j)


# ----------------------------------------------------------------------------------------------- CPU: synthetic


def test_synthetic_exl2_is_a_valid_checkpoint(tmp_path):
    w = synthetic.random_exl2(416, 517, "0.05:8b_32g/0.1:4b_128g/0.85:3b_128g", seed=3)
    save_file({f"lm_head.{name}": t for name, t in w.tensors().items()}, tmp_path / "output.safetensors")
    loaded = exl2.load(TensorStore(tmp_path), "lm_head", 416, 517)
    assert [b for b, _, _ in loaded.groups()] == [8, 4, 3, 3]
    assert sum(r for _, _, r in loaded.groups()) == 416
    assert torch.equal(loaded.dequantize(), w.dequantize())
    assert (w.dequantize().float().abs().sum(0) > 0).all()


def test_synthetic_exl2_follows_the_converters_row_split():
    assert synthetic.exl2_group_rows(4096, synthetic.parse_mix("0.05:8b_32g/0.95:4b_128g")) == \
        [(8, 32)] * 7 + [(4, 128)] * 30 + [(4, 32)]   # 224 + 3840 + the clamped 32


def test_synthetic_gptq_symmetric_v1_zeros_are_the_usual_words():
    w = synthetic.random_gptq(128, 64, 4, 32, act_order=True, sym=True)
    assert (w.qzeros == 0x77777777).all()
    assert sorted(torch.bincount(w.g_idx.long()).tolist()) == [32] * 4
    assert not torch.equal(w.g_idx.long(), torch.arange(128) // 32)


# ----------------------------------------------------------------------------------------------- GPU


def check_matmul(weight, m: int, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k, n = weight.in_features, weight.out_features
    x = torch.randn(m, k, generator=gen).half()
    b = (torch.randn(n, generator=gen) * 0.1).half() if bias else None
    ref = x.float() @ weight.dequantize().float().T + (0 if b is None else b.float())
    f = qm.prepare(weight.to(torch.device("cuda")), None if b is None else b.cuda())
    for _ in range(2):                       # twice: split-K counters must reset themselves
        poison_allocator()
        y = f(x.cuda()).float().cpu()
        assert y.shape == (m, n) and torch.isfinite(y).all()
        rel = ((y - ref).norm() / ref.norm()).item()
        assert rel < 2e-3, rel
        assert (y - ref).abs().max() <= 5e-3 * ref.abs().max()


@on_gpu
@pytest.mark.parametrize("mix", EXL2_MIXES + ["0.05:8b_32g/0.1:6b_32g/0.1:5b_64g/0.45:4b_128g/0.2:3b_64g/0.1:2b_64g"])
def test_the_gpu_repack_writes_the_cpu_repacks_words(mix):
    """lane_layout.cu (one launch a width) against lane_words (the specification), word for word, on odd shapes."""
    for k, n in ((416, 96), (96, 517), (4128, 517)):
        w = synthetic.random_exl2(k, n, mix, seed=k + n)
        cpu, gpu = ll.exl2_layout(w), ll.exl2_layout(w, torch.device("cuda"))
        assert gpu.words.is_cuda and torch.equal(gpu.words.cpu(), cpu.words), (mix, k, n)
        assert torch.equal(gpu.meta0.cpu(), cpu.meta0) and torch.equal(gpu.chunk_meta.cpu(), cpu.chunk_meta)


@on_gpu
def test_the_gpu_repack_of_a_real_exllamav2_checkpoint():
    store = TensorStore(EXL2_FIXTURE)
    for key, (k, n) in {"model.layers.0.mlp.down_proj": (768, 256), "lm_head": (256, 512)}.items():
        w = exl2.load(store, key, k, n)
        assert torch.equal(ll.exl2_layout(w, torch.device("cuda")).words.cpu(), ll.exl2_layout(w).words), key


@on_gpu
@pytest.mark.parametrize("mix", EXL2_MIXES)
@pytest.mark.parametrize("m", [1, 3, 16, 130])
@pytest.mark.parametrize("k,n", [(416, 96), (96, 517)])
def test_exl2_matmul_small_shapes(mix, m, k, n):
    check_matmul(synthetic.random_exl2(k, n, mix, seed=m), m, bias=m % 2 == 1)


@on_gpu
@pytest.mark.parametrize("mix", ["0.05:8b_32g/0.95:4b_128g", "0.05:6b_32g/0.2:3b_64g/0.75:2b_64g",
                                 "0.15:8b_128g/0.85:6b_128g", "0.05:5b_32g/0.95:3b_32g"])
@pytest.mark.parametrize("m", [1, 7, 33, 130])
@pytest.mark.parametrize("k,n", [(4128, 96), (416, 4128)])
def test_exl2_matmul_large_shapes(mix, m, k, n):
    check_matmul(synthetic.random_exl2(k, n, mix, seed=m + k), m, bias=True)


@on_gpu
def test_exl2_matmul_gathers_x_in_several_rounds():
    """A split longer than one round of the x gather (THREADS * STAGE_LOADS = 2048 rows): rounds after the first
    read their perm indices after the wait, the first before it."""
    w = synthetic.random_exl2(8224, 17408, "0.05:8b_32g/0.95:4b_128g", seed=5)
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    lay = ll.exl2_layout(w)
    splits = qm.small_blocks([lay], 1, n_sm)[1][0]            # the plan forward takes at one row
    assert 32 * len(lay.chunk_bits) / splits > 2048, splits
    check_matmul(w, 1, bias=False)


@on_gpu
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("sym,act_order", [(True, False), (False, True)])
@pytest.mark.parametrize("m", [1, 7, 130])
def test_gptq_matmul(bits, group_size, sym, act_order, m):
    w = synthetic.random_gptq(416, 128 if bits == 3 else 80, bits, group_size, act_order, sym, seed=m, v2=not sym)
    check_matmul(w, m, bias=m != 7)


@on_gpu
@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("m", [1, 16, 130])
def test_gptq_matmul_large_k(bits, m):
    check_matmul(synthetic.random_gptq(4128, 160 if bits == 4 else 128, bits, 128, True, False, seed=bits), m, True)


@on_gpu
@pytest.mark.parametrize("weight", [synthetic.random_exl2(416, 517, "0.05:8b_32g/0.1:4b_128g/0.85:3b_128g"),
                                    synthetic.random_gptq(416, 96, 4, 32, True, False)], ids=["exl2", "gptq"])
def test_dequant_kernel_is_bit_exact(weight):
    f = qm.prepare(weight.to(torch.device("cuda")), None)
    poison_allocator()
    assert torch.equal(f.dequantize().cpu(), weight.dequantize())


@on_gpu
@pytest.mark.parametrize("m", [1, 5, 16, 47, 90])         # one row, 16-row passes, the tiled GEMM
def test_forward_replays_in_a_cuda_graph(m):
    w = synthetic.random_exl2(4128, 416, "0.05:8b_32g/0.95:4b_128g", seed=5)
    f = qm.prepare(w.to(torch.device("cuda")), (torch.randn(416) * 0.1).half().cuda())
    x = torch.randn(m, 4128, device="cuda").half()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = f(x)                          # warm-up: compiles and loads the module
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = f(x)
    for _ in range(3):
        x.copy_(torch.randn(m, 4128, device="cuda").half())
        graph.replay()
        assert torch.equal(y, f(x))           # deterministic split-K: graph and eager agree bit for bit
    assert not torch.equal(y, eager)


@on_gpu
@pytest.mark.parametrize("strips_per_block", [7, 5])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_small_m_blocks_of_fewer_strips(strips_per_block, m, monkeypatch):
    """Small-M launches of blocks with fewer than 8 strips (as small_blocks picks for gate/up-like shapes), fused
    parts whose strip counts are not multiples of the block's, against the reference."""
    monkeypatch.setattr(planning, "SMALL_STRIPS_PER_BLOCK", (strips_per_block,))
    k = 4128
    weights = [synthetic.random_exl2(k, 517, "0.05:8b_32g/0.95:4b_128g", seed=m),
               synthetic.random_exl2(k, 300, "0.1:3b_64g/0.9:2b_64g", seed=m + 1)]
    f = qm.fuse([qm.prepare(w.to(torch.device("cuda")), None) for w in weights])
    assert f.plans[m].threads == 32 * strips_per_block
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).half()
    for _ in range(2):                       # twice: split-K counters must reset themselves
        poison_allocator()
        for w, y in zip(weights, f.forward(x.cuda())):
            ref = x.float() @ w.dequantize().float().T
            assert ((y.float().cpu() - ref).norm() / ref.norm()).item() < 2e-3


@on_gpu
@pytest.mark.parametrize("fmt", ["exl2", "gptq"])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 70, 100, 200])
def test_gated_forward_applies_silu_mul_as_it_stages(fmt, m):
    """f(gate, up) is the down projection of the gated MLP: bit for bit f(silu_mul(gate, up)), and close to the
    reference composition. Applied as stage_xs stages x (1-16 rows), as permute_x reorders it for the tiled GEMMs
    (17-96 rows; 65-128 by wgmma on sm_90), by silu_mul's own launch before dequantize + cuBLAS (200)."""
    from exl_backends.kernels import activation
    k = 4128
    w = (synthetic.random_exl2(k, 517, "0.05:8b_32g/0.95:4b_128g", seed=m) if fmt == "exl2"
         else synthetic.random_gptq(k, 160, 4, 128, True, False, seed=m))
    gen = torch.Generator().manual_seed(m)
    gate, up = (torch.randn(m, k, generator=gen) * 3).half(), torch.randn(m, k, generator=gen).half()
    f = qm.prepare(w.to(torch.device("cuda")), None)
    for _ in range(2):
        poison_allocator()
        y = f(gate.cuda(), up.cuda())
        assert torch.equal(y, f(activation.silu_mul(gate.cuda(), up.cuda())))
    unaligned = torch.empty(m * k + 1, dtype=torch.float16, device="cuda")[1:].view(m, k)
    unaligned.copy_(up)
    assert torch.equal(f(gate.cuda(), unaligned), y)
    ref = reference.silu_mul(gate, up).float() @ w.dequantize().float().T
    assert ((y.float().cpu() - ref).norm() / ref.norm()).item() < 2e-3
    with pytest.raises(ValueError, match="differ in shape"):
        f(gate.cuda(), up[:, 1:].cuda())


@on_gpu
@pytest.mark.parametrize("fmt", ["exl2", "gptq"])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 70, 100, 200])
@pytest.mark.parametrize("with_residual", [True, False])
def test_normed_forward_is_the_norm_kernel_then_forward(fmt, m, with_residual):
    """forward_normed(h, residual, w, eps) of fused weights (each with its own permutation) is bit for bit
    norm.add_rmsnorm (norm.rmsnorm without a residual) then forward, outputs and new residual: normed as stage_xs
    stages x (1-16 rows), as permute_x reorders it (17-128), by the norm kernel before dequantize + cuBLAS (200);
    rows that are not 16-byte aligned take that composition (whose norm kernel then sums element by element)."""
    from exl_backends.kernels import norm
    k = 4128
    if fmt == "exl2":
        weights = [synthetic.random_exl2(k, 96, "0.05:8b_32g/0.95:4b_128g", seed=1),
                   synthetic.random_exl2(k, 517, "0.1:3b_64g/0.9:2b_64g", seed=2)]
    else:
        weights = [synthetic.random_gptq(k, 160, 4, 128, True, False, seed=1),
                   synthetic.random_gptq(k, 96, 4, 128, True, False, seed=2)]
    f = qm.fuse([qm.prepare(w.to(torch.device("cuda")), None) for w in weights])
    gen = torch.Generator().manual_seed(m)
    h = torch.randn(m, k, generator=gen).half().cuda()
    residual = (torch.randn(m, k, generator=gen) * 4).half().cuda() if with_residual else None
    w = (torch.rand(k, generator=gen) + 0.5).half().cuda()
    x, r = norm.add_rmsnorm(h, residual, w, 1e-5) if with_residual else (norm.rmsnorm(h, w, 1e-5), h)
    expected = f.forward(x)
    for _ in range(2):
        poison_allocator()
        ys, new = f.forward_normed(h, residual, w, 1e-5)
        assert torch.equal(new, r) and all(torch.equal(y, e) for y, e in zip(ys, expected))
    # unaligned rows (norm.cu holds at most 4096 of them): a narrower fused weight
    k = 2080
    narrow = (synthetic.random_exl2(k, 96, "0.05:8b_32g/0.95:4b_128g", seed=3) if fmt == "exl2" else
              synthetic.random_gptq(k, 160, 4, 128, True, False, seed=3))
    f = qm.fuse([qm.prepare(narrow.to(torch.device("cuda")), None)])
    h, w = h[:, :k].contiguous(), w[:k].contiguous()
    residual = residual[:, :k].contiguous() if with_residual else None
    unaligned = torch.empty(m * k + 1, dtype=torch.float16, device="cuda")[1:].view(m, k)
    unaligned.copy_(h)
    x, r = norm.add_rmsnorm(unaligned, residual, w, 1e-5) if with_residual else (norm.rmsnorm(unaligned, w, 1e-5), h)
    ys, new = f.forward_normed(unaligned, residual, w, 1e-5)
    assert torch.equal(new, r) and all(torch.equal(y, e) for y, e in zip(ys, f.forward(x)))


@on_gpu
@pytest.mark.parametrize("fmt", ["exl2", "gptq"])
@pytest.mark.parametrize("k,d,clusters", [(4128, 2080, True), (4128, 2080, False), (96, 416, True)],
                         ids=["split-cluster", "split-counters", "no-split"])
def test_a_launch_that_feeds_the_next_norm_gives_its_results_within_rounding(fmt, k, d, clusters, monkeypatch):
    """STAGE-FREE NORM: a one-row launch of d outputs (the gated MLP's down; its columns finished by a cluster's
    summing warp, by the split counters' last warp, or unsplit) returns r = residual + y bit for bit as
    add_rmsnorm forms it and leaves r * w' in its consumer's stored orders (fused weights of their own
    permutations and widths, one with a bias; w above 1, so w' = w / 4); the consumer's outputs are
    forward_normed's within fp16 rounding and no farther from the exact result (the norm in fp64) than they are."""
    if not clusters:
        monkeypatch.setattr(qm, "one_row_cluster_slots", lambda device: {})
    cuda = torch.device("cuda")
    if fmt == "exl2":
        down = synthetic.random_exl2(k, d, "0.05:8b_32g/0.95:4b_128g", seed=k)
        weights = [synthetic.random_exl2(d, 96, "0.05:8b_32g/0.95:4b_128g", seed=1),
                   synthetic.random_exl2(d, 517, "0.1:4b_64g/0.9:3b_64g", seed=2),
                   synthetic.random_exl2(d, 40, "6b_32g", seed=3)]
    else:
        down = synthetic.random_gptq(k, d, 4, 32, True, False, seed=k)
        weights = [synthetic.random_gptq(d, 160, 4, 32, True, False, seed=1),
                   synthetic.random_gptq(d, 96, 4, 32, True, False, seed=2)]
    gen = torch.Generator().manual_seed(d)
    biases = [None, (torch.randn(weights[1].dequantize().shape[0], generator=gen) * 0.1).half()] + [None] * 2
    producer = qm.prepare(down.to(cuda), None)
    consumer = qm.fuse([qm.prepare(w.to(cuda), None if b is None else b.cuda()) for w, b in zip(weights, biases)])
    assert (producer.plans[1].cluster > 1) == (clusters and fmt == "exl2" and k > 96 and
                                                torch.cuda.get_device_capability() >= planning.CLUSTER_CC)
    assert (int(producer.plans[1].params["part"]["n_splits"][0]) > 1) == (k > 96)
    gate, up = (torch.randn(1, k, generator=gen) * 2).half().cuda(), torch.randn(1, k, generator=gen).half().cuda()
    residual = (torch.randn(1, d, generator=gen) * 4).half().cuda()
    w = (torch.rand(d, generator=gen) * 2.5 + 0.25).half().cuda()
    expected, r_expected = consumer.forward_normed(producer(gate, up), residual, w, 1e-5)
    producer.feeding = consumer.fed_by = consumer.norm_feed(w, 1e-5)
    assert consumer.fed_by.unscale == 4.0 and producer.feeds(1) and not producer.feeds(2)
    for _ in range(2):                       # twice: the split counters reset themselves
        poison_allocator()
        r = producer.forward_feeding(producer.stage_gated(gate, up), residual)
        ys = consumer.forward_fed()
        assert torch.equal(r, r_expected)
        rms = r.double().pow(2).mean().add(1e-5).sqrt()
        for y, e, weight, bias in zip(ys, expected, weights, biases):
            exact = (r.double() * w.double() / rms) @ weight.dequantize().double().T.cuda()
            exact = exact + (0 if bias is None else bias.double().cuda())
            assert torch.isfinite(y).all() and (y - e).abs().max() <= 4e-3 * e.abs().max()
            assert rel(y, exact) <= max(1.5 * rel(e, exact), 1e-3), (rel(y, exact), rel(e, exact))


@on_gpu
@pytest.mark.parametrize("fmt", ["exl2", "gptq"])
@pytest.mark.parametrize("d", [2080, 96])
def test_the_embedding_gather_feeds_the_first_norm_as_a_launch_would(fmt, d):
    """norm.embed_feed: one token's embedding row r, returned as it is in the table, and r * w' in its consumer's
    stored orders with r's sums (STAGE-FREE NORM without a matmul before it): the consumer's outputs are
    forward_normed's of the row within fp16 rounding (w above 1, so w' = w / 4)."""
    from exl_backends.kernels import norm
    cuda = torch.device("cuda")
    if fmt == "exl2":
        weights = [synthetic.random_exl2(d, 96, "0.05:8b_32g/0.95:4b_128g", seed=1),
                   synthetic.random_exl2(d, 517, "0.1:4b_64g/0.9:3b_64g", seed=2)]
    else:
        weights = [synthetic.random_gptq(d, 160, 4, 32, True, False, seed=1)]
    consumer = qm.fuse([qm.prepare(w.to(cuda), None) for w in weights])
    gen = torch.Generator().manual_seed(d)
    table = (torch.randn(1000, d, generator=gen) * 3).half().cuda()
    w = (torch.rand(d, generator=gen) * 2.5 + 0.25).half().cuda()
    ids = torch.tensor([617], device=cuda)
    expected, _ = consumer.forward_normed(table[617:618], None, w, 1e-5)
    consumer.fed_by = consumer.norm_feed(w, 1e-5)
    assert consumer.fed_by.unscale == 4.0
    for _ in range(2):
        poison_allocator()
        r = norm.embed_feed(ids, table, consumer.fed_by)
        ys = consumer.forward_fed()
        assert torch.equal(r, table[617:618])
        for y, e in zip(ys, expected):
            assert torch.isfinite(y).all() and (y - e).abs().max() <= 4e-3 * e.abs().max()
    with pytest.raises(ValueError, match="one int64 token id"):
        norm.embed_feed(torch.tensor([1, 2], device=cuda), table, consumer.fed_by)


@on_gpu
@pytest.mark.parametrize("fmt", ["exl2", "gptq"])
@pytest.mark.parametrize("d", [2080, 96], ids=["split", "unsplit"])
def test_a_fed_gate_up_stages_downs_x_as_stage_xs_does(fmt, d, monkeypatch):
    """PAIRED ENDS: a gate/up launch fed by o's norm (STAGE-FREE NORM) that writes fp16(silu(gate)) * up into
    down's stored order (gate's and up's strips on one counter, split or not, up with a bias) leaves down's x bit
    for bit as the fed launch's outputs through stage_xs would, and down's output with it; twice (the shared
    counter resets itself). Without clusters on both sides, so that both sum the same splits."""
    monkeypatch.setattr(qm, "one_row_cluster_slots", lambda device: {})
    cuda, n = torch.device("cuda"), 416
    if fmt == "exl2":
        o, gate, up = (synthetic.random_exl2(k, m, "0.05:8b_32g/0.95:4b_128g", seed=i)
                       for i, (k, m) in enumerate([(416, d), (d, n), (d, n)]))
        down = synthetic.random_exl2(n, d, "0.1:4b_64g/0.9:3b_64g", seed=3)
    else:
        o, gate, up, down = (synthetic.random_gptq(k, m, 4, 32, True, False, seed=i)
                             for i, (k, m) in enumerate([(416, d), (d, n), (d, n), (n, d)]))
    gen = torch.Generator().manual_seed(d)
    up_bias = (torch.randn(n, generator=gen) * 0.1).half().cuda()
    producer, down = qm.prepare(o.to(cuda), None), qm.prepare(down.to(cuda), None)
    gate_up = qm.fuse([qm.prepare(gate.to(cuda), None), qm.prepare(up.to(cuda), up_bias)])
    w = (torch.rand(d, generator=gen) * 2.5 + 0.25).half().cuda()
    producer.feeding = gate_up.fed_by = gate_up.norm_feed(w, 1e-5)
    gate_up.link_gating(down)
    assert gate_up.gating is not None and gate_up.gating.plan.cluster == 1
    assert (int(gate_up.gating.plan.params["part"]["n_splits"][0]) > 1) == (d > 96)
    x, residual = torch.randn(1, 416, generator=gen).half().cuda(), (torch.randn(1, d, generator=gen) * 4).half().cuda()
    staged = down.stored_x(1)[0]
    for _ in range(2):
        producer.forward_feeding(producer._stage(x, 1, qm.PLAIN), residual)
        expected_x = down.stage_gated(*gate_up.forward_fed()).clone()
        expected_y = down.forward_stored(staged)
        poison_allocator()
        staged[:n].fill_(float("nan"))
        producer.forward_feeding(producer._stage(x, 1, qm.PLAIN), residual)
        assert gate_up.forward_gated() is staged
        assert torch.equal(staged[:n], expected_x[:n]) and torch.equal(down.forward_stored(staged), expected_y)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@on_gpu
def test_a_launch_feeds_only_the_norm_it_can_hold():
    """norm_feed refuses a norm weight of another length or dtype; forward_feeding a residual of another shape."""
    cuda = torch.device("cuda")
    f = qm.prepare(synthetic.random_exl2(416, 96, "4b_128g", seed=1).to(cuda), None)
    assert f.norm_feed(torch.ones(400, dtype=torch.float16, device=cuda), 1e-5) is None
    assert f.norm_feed(torch.ones(416, dtype=torch.float32, device=cuda), 1e-5) is None
    feed = f.norm_feed(torch.full((416,), 0.75, dtype=torch.float16, device=cuda), 1e-5)
    assert feed.unscale == 1.0 and feed.sums.shape == (16,) and feed.places.shape == (1, 416)
    producer = qm.prepare(synthetic.random_exl2(96, 416, "4b_128g", seed=2).to(cuda), None)
    producer.feeding = feed
    with pytest.raises(ValueError, match="residual"):
        producer.forward_feeding(producer.stage_gated(*torch.ones(2, 1, 96, dtype=torch.float16, device=cuda)),
                                 torch.ones(1, 400, dtype=torch.float16, device=cuda))


@on_gpu
@pytest.mark.parametrize("m", [1, 5, 16, 70])
def test_fused_weights_match_each_weight(m):
    k = 4128
    weights = [synthetic.random_exl2(k, 96, "0.05:8b_32g/0.95:4b_128g", seed=1),
               synthetic.random_exl2(k, 517, "0.1:3b_64g/0.9:2b_64g", seed=2),
               synthetic.random_exl2(k, 40, "6b_32g", seed=3)]
    gen = torch.Generator().manual_seed(m)
    biases = [(torch.randn(96, generator=gen) * 0.1).half(), None, (torch.randn(40, generator=gen) * 0.1).half()]
    f = qm.fuse([qm.prepare(w.to(torch.device("cuda")), None if b is None else b.cuda())
                 for w, b in zip(weights, biases)])
    assert f is not None and len(f.layouts) == 3
    x = torch.randn(m, k, generator=gen).half()
    for _ in range(2):                       # twice: split-K counters must reset themselves
        poison_allocator()
        ys = f.forward(x.cuda())
        for w, b, y in zip(weights, biases, ys):
            ref = x.float() @ w.dequantize().float().T + (0 if b is None else b.float())
            y = y.float().cpu()
            assert y.shape == ref.shape and torch.isfinite(y).all()
            assert ((y - ref).norm() / ref.norm()).item() < 2e-3


# ----------------------------------------------------------------------------------------------- GPU: tiled GEMM

GEMM_ROWS = [16, 17, 33, 47, 64, 100, 129, 208, 256, 300]


def on_wgmma_gpu(test):
    """A GPU test that needs the GEMM by wgmma (compute capability 9.0)."""
    wgmma = torch.cuda.is_available() and torch.cuda.get_device_capability() == qm.WGMMA_CC
    return on_gpu(pytest.mark.skipif(not wgmma, reason="the wgmma GEMM runs on compute capability 9.0 only")(test))


def check_gemm(weights: list, m: int, biases: list, seed: int = 0, splits: str = "any",
               wgmma: bool = False) -> list[torch.Tensor]:
    """The tiled GEMM (or with wgmma, the GEMM by wgmma) of one or more fused weights against the reference, twice on
    poisoned memory; returns the outputs. Asserts which rows forward sends there; others call it directly (the GEMM is
    planned from LARGE_M - 1 rows, a shape LARGE_M shares, up to GEMM_ROWS_LIMIT; wgmma up to WGMMA_ROWS). splits:
    "one" / "several" asserts the plan's K split."""
    gen = torch.Generator().manual_seed(seed)
    k = weights[0].in_features
    x = torch.randn(m, k, generator=gen).half()
    fs = [qm.prepare(w.to(torch.device("cuda")), None if b is None else b.cuda()) for w, b in zip(weights, biases)]
    f = fs[0] if len(fs) == 1 else qm.fuse(fs)
    in_wgmma = f.wgmma_plan is not None and qm.WGMMA_MIN_M <= m <= qm.WGMMA_MAX_M
    if wgmma:
        assert (f._path(m) == f._wgmma) == in_wgmma
    else:
        assert (f._path(m) == f._gemm) == (qm.LARGE_M <= m <= qm.GEMM_MAX_M and not in_wgmma)
    plan = f.wgmma_plan if wgmma else f.gemm_plans[qm.gemm_shape(m)]
    n_splits = [int(part["n_splits"]) for part in plan.params["part"][:len(weights)]]
    assert splits == "any" or (max(n_splits) == 1) == (splits == "one"), n_splits
    for _ in range(2):
        poison_allocator()
        ys = [y.float().cpu() for y in (f._wgmma if wgmma else f._gemm)(x.cuda())]
        for w, b, y in zip(weights, biases, ys):
            ref = x.float() @ w.dequantize().float().T + (0 if b is None else b.float())
            assert y.shape == ref.shape and torch.isfinite(y).all()
            assert ((y - ref).norm() / ref.norm()).item() < 2e-3
            assert (y - ref).abs().max() <= 5e-3 * ref.abs().max()
    return ys


def bias_for(n: int, seed: int) -> torch.Tensor:
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.1).half()


@on_gpu
@pytest.mark.parametrize("m", GEMM_ROWS)
@pytest.mark.parametrize("k,n,splits", [(4128, 517, "several"), (416, 4128, "one")])
def test_gemm_exl2_4bpw(m, k, n, splits):
    w = synthetic.random_exl2(k, n, "4b_128g", seed=m)
    check_gemm([w], m, [bias_for(n, m) if m % 2 else None], seed=m, splits=splits)


@on_gpu
@pytest.mark.parametrize("mix", EXL2_MIXES)
@pytest.mark.parametrize("m", [47, 129])
def test_gemm_exl2_every_width_and_mix(mix, m):
    check_gemm([synthetic.random_exl2(1056, 96, mix, seed=m)], m, [bias_for(96, m)], seed=m)


@on_gpu
@pytest.mark.parametrize("act_order", [True, False])
def test_gemm_exl2_with_and_without_act_order(act_order):
    w = synthetic.random_exl2(4128, 264, "0.05:8b_32g/0.1:4b_128g/0.85:3b_128g", seed=4, act_order=act_order)
    assert (ll.exl2_layout(w).perm is None) != act_order
    check_gemm([w], 100, [None], seed=4)


@on_gpu
@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("m", GEMM_ROWS)
def test_gemm_gptq_4bit_g128(act_order, m):
    w = synthetic.random_gptq(4096, 416, 4, 128, act_order, sym=False, seed=m)
    check_gemm([w], m, [bias_for(416, m)], seed=m)


@on_gpu
@pytest.mark.parametrize("bits", [2, 3, 8])
@pytest.mark.parametrize("group_size,act_order,sym", [(32, True, False), (-1, False, True)])
def test_gemm_gptq_other_widths(bits, group_size, act_order, sym):
    w = synthetic.random_gptq(416, 128 if bits == 3 else 80, bits, group_size, act_order, sym, seed=bits, v2=not sym)
    check_gemm([w], 47, [None], seed=bits)


@on_gpu
@pytest.mark.parametrize("m", [33, 129, 256])
def test_gemm_fused_three_parts_with_bias(m):
    k = 4128
    weights = [synthetic.random_exl2(k, 96, "0.05:8b_32g/0.95:4b_128g", seed=1),
               synthetic.random_exl2(k, 517, "0.1:3b_64g/0.9:2b_64g", seed=2),
               synthetic.random_exl2(k, 40, "6b_32g", seed=3)]
    check_gemm(weights, m, [bias_for(96, m), None, bias_for(40, m + 1)], seed=m)


@on_gpu
@pytest.mark.parametrize("m", [64, 208])
def test_gemm_agrees_with_dequant_and_cublas(m):
    w = synthetic.random_exl2(4128, 517, "0.05:8b_32g/0.95:4b_128g", seed=m)
    f = qm.prepare(w.to(torch.device("cuda")), bias_for(517, m).cuda())
    x = torch.randn(m, 4128, generator=torch.Generator().manual_seed(m)).half().cuda()
    (gemm,), (dense,) = f._gemm(x), f._dequant_matmul(x)
    gemm, dense = gemm.float(), dense.float()
    assert ((gemm - dense).norm() / dense.norm()).item() < 5e-4
    assert (gemm - dense).abs().max() <= 2e-3 * dense.abs().max()


@on_gpu
def test_rows_past_the_tiled_gemms_go_to_dequant_and_cublas():
    w = synthetic.random_exl2(416, 96, "4b_128g", seed=9)
    f = qm.prepare(w.to(torch.device("cuda")), None)
    last, tiled = (qm.WGMMA_MAX_M, f._wgmma) if f.wgmma_plan is not None else (qm.GEMM_MAX_M, f._gemm)
    assert f._path(last + 1) == f._dequant_matmul and f._path(last) == tiled
    check_matmul(w, last + 1, bias=True)


# ----------------------------------------------------------------------------------------------- GPU: wgmma GEMM

WGMMA_ROWS = [17, 33, 64, 65, 100, 127, 128]


@on_wgmma_gpu
@pytest.mark.parametrize("m", WGMMA_ROWS)
@pytest.mark.parametrize("k,n,splits", [(4128, 517, "several"), (416, 4128, "one")])
def test_wgmma_exl2_4bpw(m, k, n, splits):
    w = synthetic.random_exl2(k, n, "4b_128g", seed=m)
    check_gemm([w], m, [bias_for(n, m) if m % 2 else None], seed=m, splits=splits, wgmma=True)


@on_wgmma_gpu
@pytest.mark.parametrize("mix", EXL2_MIXES)
@pytest.mark.parametrize("m", [47, 100])
def test_wgmma_exl2_every_width_and_mix(mix, m):
    check_gemm([synthetic.random_exl2(1056, 96, mix, seed=m)], m, [bias_for(96, m)], seed=m, wgmma=True)


@on_wgmma_gpu
@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("m", [65, 113])
def test_wgmma_gptq_4bit_g128(act_order, m):
    w = synthetic.random_gptq(4096, 416, 4, 128, act_order, sym=False, seed=m)
    check_gemm([w], m, [bias_for(416, m)], seed=m, wgmma=True)


@on_wgmma_gpu
@pytest.mark.parametrize("bits", [2, 3, 8])
@pytest.mark.parametrize("group_size,act_order,sym", [(32, True, False), (-1, False, True)])
def test_wgmma_gptq_other_widths(bits, group_size, act_order, sym):
    w = synthetic.random_gptq(416, 128 if bits == 3 else 80, bits, group_size, act_order, sym, seed=bits, v2=not sym)
    check_gemm([w], 90, [None], seed=bits, wgmma=True)


@on_wgmma_gpu
@pytest.mark.parametrize("m", [33, 100])
def test_wgmma_fused_three_parts_with_bias(m):
    k = 4128
    weights = [synthetic.random_exl2(k, 96, "0.05:8b_32g/0.95:4b_128g", seed=1),
               synthetic.random_exl2(k, 517, "0.1:3b_64g/0.9:2b_64g", seed=2),
               synthetic.random_exl2(k, 40, "6b_32g", seed=3)]
    check_gemm(weights, m, [bias_for(96, m), None, bias_for(40, m + 1)], seed=m, wgmma=True)


@on_wgmma_gpu
def test_wgmma_agrees_with_the_mma_sync_gemm():
    w = synthetic.random_exl2(4128, 517, "0.05:8b_32g/0.95:4b_128g", seed=5)
    f = qm.prepare(w.to(torch.device("cuda")), bias_for(517, 5).cuda())
    x = torch.randn(100, 4128, generator=torch.Generator().manual_seed(5)).half().cuda()
    (wg,), (mma,) = f._wgmma(x), f._gemm(x)
    wg, mma = wg.float(), mma.float()
    assert ((wg - mma).norm() / mma.norm()).item() < 5e-4
    assert (wg - mma).abs().max() <= 2e-3 * mma.abs().max()


@on_gpu
def test_gemm_of_an_unaligned_x():
    w = synthetic.random_gptq(416, 80, 4, 32, False, True, seed=2)
    f = qm.prepare(w.to(torch.device("cuda")), None)
    x = torch.randn(40 * 416 + 1, generator=torch.Generator().manual_seed(2)).half()
    xs = x.cuda()[1:].view(40, 416)                     # 2 bytes past an aligned start
    assert xs.data_ptr() % 16 and f._path(40) == f._gemm
    ref = x[1:].view(40, 416).float() @ w.dequantize().float().T
    y = f(xs).float().cpu()
    assert ((y - ref).norm() / ref.norm()).item() < 2e-3


@on_gpu
def test_weights_of_different_formats_are_not_fused():
    exl2_w = synthetic.random_exl2(416, 96, "4b_128g")
    gptq_w = synthetic.random_gptq(416, 96, 4, 32, True, False)
    kernels = [qm.prepare(w.to(torch.device("cuda")), None) for w in (exl2_w, gptq_w)]
    assert qm.fuse(kernels) is None


@on_gpu
@pytest.mark.parametrize("k, ns", [(2048, (2048,)), (8192, (2048,)), (2048, (8192, 8192)), (4096, (14336, 14336))])
def test_a_clustered_one_row_launch_gives_the_counters_sums_bit_for_bit(k, ns, monkeypatch):
    """qmm_rows.cuh CLUSTER SUMS on the 1B and 8B shapes' o, down and gate/up (K split 16, 4 and 2 ways): the same
    bits as the counters' reduction, and the reference's values; the counters stay zero. Clusters are allowed
    whether or not they all fit at once (a second wave is slower, not different)."""
    if torch.cuda.get_device_capability() < planning.CLUSTER_CC:
        pytest.skip("thread-block clusters need compute capability 9.0")
    monkeypatch.setattr(qm, "one_row_cluster_slots", lambda device: dict.fromkeys(planning.CLUSTER_SIZES, 1 << 20))
    weights = [synthetic.random_exl2(k, n, "0.05:8b_32g/0.95:4b_128g", seed=n + i) for i, n in enumerate(ns)]
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).half()

    def run():
        f = qm.fuse([qm.prepare(w.to(torch.device("cuda")), None) for w in weights])
        return f, [f.forward(x.cuda()) for _ in range(2)]
    clustered, (first, again) = run()
    assert clustered.plans[1].cluster > 1
    monkeypatch.setattr(qm, "cluster_size", lambda *args: 1)      # the same splits, summed through the counters
    counted, (plain, _) = run()
    assert counted.plans[1].cluster == 1
    assert np.array_equal(counted.plans[1].params["part"]["n_splits"], clustered.plans[1].params["part"]["n_splits"])
    for a, b, c, w in zip(first, again, plain, weights):
        assert torch.equal(a, b) and torch.equal(a, c)
        ref = x.float() @ w.dequantize().float().T
        assert ((a.float().cpu() - ref).norm() / ref.norm()).item() < 2e-3
    assert all(int(c.count_nonzero()) == 0 for c in clustered.counters)
