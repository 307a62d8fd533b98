"""Tensor parallelism: shards of EXL2 and GPTQ weights against slices of the full weight, and 2 CPU processes
(gloo) running sharded attention, MLP and whole models against the single-process reference."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from exl_backends import parallel
from exl_backends.batch import Batch, SeqChunk
from exl_backends.cache import KVCache
from exl_backends.config import ModelConfig
from exl_backends.formats.synthetic import random_exl2, random_gptq
from exl_backends.linear import QuantLinear
from exl_backends.model import Model

from conftest import REPO, save_tiny, tiny_config
from quant_helpers import quantize_dir

# ----------------------------------------------------------------------------------------------- weight shards


@pytest.fixture(scope="module")
def exl2():
    w = random_exl2(320, 96, "0.1:8b_32g/0.4:5b_32g/0.5:3b_64g", seed=3)     # act-order, mixed widths
    return w, w.dequantize()


def test_exl2_column_shards_are_slices(exl2):
    w, full = exl2
    for cols in (torch.arange(32, 64), torch.arange(8, 48), torch.randperm(96)[:37]):
        shard = parallel.exl2_columns(w, cols)
        assert torch.equal(shard.dequantize(), full[cols])
    aligned = parallel.exl2_columns(w, torch.arange(32, 64))        # 8-aligned: the q_scale words, sliced
    assert torch.equal(aligned.q_scale, w.q_scale[:, 4:8])


def test_exl2_down_partition_keeps_whole_groups(exl2):
    w, full = exl2
    parts = parallel.input_partition(QuantLinear(w), 2)
    assert sorted(torch.cat(parts).tolist()) == list(range(320))
    for rows in parts:
        shard, pad = parallel.exl2_rows(w, rows)
        assert pad == 0 and torch.equal(shard.q_invperm, torch.arange(rows.numel(), dtype=torch.int32))
        assert torch.equal(shard.dequantize(), full[:, rows])
    halves = [parallel.exl2_rows(w, rows)[0] for rows in parts]
    assert sum(h.q_weight.shape[0] for h in halves) == w.q_weight.shape[0]     # no byte added


def test_exl2_head_rows_are_padded_with_zero_rows(exl2):
    w, full = exl2
    x = torch.randn(5, 320)
    partial = []
    for rows in (torch.arange(0, 160), torch.arange(160, 320)):
        shard, pad = parallel.exl2_rows(w, rows)
        d = shard.dequantize().float()
        assert torch.equal(d[:, :160], full[:, rows].float()) and not d[:, 160:].any()
        assert shard.in_features == 160 + pad
        partial.append(torch.nn.functional.pad(x[:, rows], (0, pad)) @ d.T)
    torch.testing.assert_close(partial[0] + partial[1], x @ full.float().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits,v2", [(4, False), (3, False), (8, True)])
def test_gptq_shards_are_slices(bits, v2):
    w = random_gptq(256, 64, bits, 32, act_order=True, sym=False, seed=bits, v2=v2)
    full = w.dequantize()
    for cols in (torch.arange(0, 32), torch.arange(32, 64)):
        assert torch.equal(parallel.gptq_columns(w, cols).dequantize(), full[cols])
    for rows in (torch.arange(0, 128), torch.arange(96, 256), torch.randperm(256)[:64]):
        shard = parallel.gptq_rows(w, rows)
        assert torch.equal(shard.dequantize(), full[:, rows])
        assert int(shard.g_idx.max()) + 1 == shard.scales.shape[0]


def test_heads_must_divide():
    c = ModelConfig.from_dict(dict(tiny_config("llama").to_dict(), architectures=["LlamaForCausalLM"]))  # 2 kv heads
    assert parallel.head_runs(c, 2) == ([range(0, 2), range(2, 4)], [range(0, 1), range(1, 2)])
    with pytest.raises(Exception, match="kv heads"):
        parallel.head_runs(c, 3)


# ----------------------------------------------------------------------------------------------- 2 processes


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    out = {"fp16": root / "llama", "exl2": root / "exl2", "gptq": root / "gptq"}
    save_tiny(out["fp16"], tiny_config("llama", num_hidden_layers=2, tie_word_embeddings=True))
    src = root / "qwen2"
    save_tiny(src, tiny_config("qwen2", vocab_size=500, head_dim=64, hidden_size=128, intermediate_size=256,
                                 pad_token_id=499, bos_token_id=497, eos_token_id=498),
              seed=1, dtype=torch.float16)
    quantize_dir(src, out["exl2"], "exl2", quant_config={"quant_method": "exl2"}, head=True)
    quantize_dir(src, out["gptq"], "gptq", quant_config={"quant_method": "gptq", "bits": 4, "group_size": 32},
                 bits=4, group_size=32, act_order=True, sym=False)
    return out


def probe_batch() -> Batch:
    return Batch.build([SeqChunk(list(range(3, 30)), 0, [0]), SeqChunk([7, 8, 9, 400], 0, [1])], 256,
                       all_logits=True)


def probe(m: Model, out: dict, name: str) -> None:
    """Block 0's attention and MLP on a fixed input, then the whole model's logits (the quantized models with a q8
    cache: its 64-element chunks are single heads here, so a rank's cache holds the same codes)."""
    batch = probe_batch()
    x = torch.randn(batch.input_ids.shape[0], m.config.hidden_size, generator=torch.Generator().manual_seed(5))
    cache = KVCache(m.config, 2, 256, "fp16", dtype=torch.float32)
    cos, sin = m.rope.cos_sin(batch, m.ops, torch.float32)
    block = m.blocks[0]
    out[f"{name}/attention"] = block.attention(x, batch, cache, cos, sin, m.ops)
    out[f"{name}/mlp"] = block.mlp(x, m.ops)
    mode = "fp16" if name == "fp16" else "q8"
    out[f"{name}/logits"] = m.forward(batch, KVCache(m.config, 2, 256, mode, dtype=torch.float32))


def worker(rank: int, world: int, init_method: str, dirs: dict, out_file: str) -> None:
    torch.set_num_threads(1)
    me, _ = parallel.join_group(rank, world, "cpu", init_method)
    out = {}
    for name, d in dirs.items():
        probe(parallel.load_shard(d, me, torch.float32), out, name)
    if rank == 0:
        torch.save(out, out_file)
    torch.distributed.destroy_process_group()


def run_ranks(target, args, world: int = 2, timeout: float = 120) -> None:
    ctx = torch.multiprocessing.get_context("spawn")
    init = f"tcp://127.0.0.1:{parallel.free_port()}"
    procs = [ctx.Process(target=target, args=(r, world, init, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * world


def test_sharded_sublayers_and_models_equal_the_reference(dirs, tmp_path):
    out_file = str(tmp_path / "rank0.pt")
    run_ranks(worker, ({k: str(v) for k, v in dirs.items()}, out_file))
    got = torch.load(out_file)
    for name, d in dirs.items():
        ref = {}
        probe(Model.load(d), ref, name)
        for key, value in ref.items():      # f32 throughout: only the order of the sums differs
            torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-4, msg=key)
        assert torch.equal(got[f"{name}/logits"].argmax(-1), ref[f"{name}/logits"].argmax(-1))


def test_cli_generate_with_tensor_parallel_2_gives_the_same_greedy_text(dirs, capsys):
    from exl_backends import cli
    common = ["generate", "-m", str(dirs["exl2"]), "-p", "ab cd", "-n", "12", "--greedy", "--device", "cpu",
              "--max-seq-len", "256"]
    assert cli.main(common) == 0
    single = capsys.readouterr().out
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "exl_backends.cli", *common, "--tensor-parallel", "2"], env=env,
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    assert run.stdout == single and len(single) > len("ab cd")


# ----------------------------------------------------------------------------------------------- two GPUs


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("cache_mode", ["fp16", "q4"])
def test_gpu_tensor_parallel_logits_and_tokens_equal_one_gpu(dirs, cache_mode):
    from exl_backends import ExlForCausalLM, Generator
    ids = torch.randint(0, 500, (2, 37), generator=torch.Generator().manual_seed(0)).cuda()
    one = ExlForCausalLM.from_pretrained(dirs["exl2"], device="cuda:0", max_seq_len=256, cache_mode=cache_mode)
    tp = ExlForCausalLM.from_pretrained(dirs["exl2"], device="cuda", max_seq_len=256, cache_mode=cache_mode,
                                        tensor_parallel=2)
    a, b = one(ids).logits, tp(ids).logits
    assert ((a - b).norm() / a.norm()).item() < 1e-2         # fp16 partial sums reduced in another order
    prompt = [1, 2, 3, 4, 5]
    assert Generator(one).generate(prompt, max_new_tokens=8).token_ids == \
        Generator(tp).generate(prompt, max_new_tokens=8).token_ids
    tp.model.close()
