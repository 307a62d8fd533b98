"""Tensor parallelism: shards of EXL2 and GPTQ weights against slices of the full weight; 2 CPU processes (gloo)
running sharded attention, MLP and whole models against the single-process reference, and the decode-graph
protocol (rank 0 announces each replay, rank 1 replays its own graph; DecodeGraph's CPU stand-in); each rank's
memory plan against loaded shards and synthetic GPU sizes; `exl serve` under a torchrun-style launch. On two
GPUs: logits and tokens (graph replay, eager, one GPU) and the plan's refusal."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import torch

from exl_backends import parallel
from exl_backends.errors import ConfigError
from exl_backends.formats.synthetic import random_exl2, random_gptq
from exl_backends.model.batch import Batch, SeqChunk
from exl_backends.model.cache import KVCache
from exl_backends.model.config import ModelConfig
from exl_backends.model.linear import QuantLinear
from exl_backends.model.model import Model

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
    cos, sin = m.rope.cos_sin(batch.positions, None, m.ops, torch.float32)
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


# ----------------------------------------------------------------------------------------------- decode graphs


def greedy(m, eager: bool, steps: int = 5) -> tuple[list[list[int]], torch.Tensor, list[int]]:
    """Three prompts prefilled, then greedy decode steps through a Runner (the second sequence stops after two
    steps, so batches of 3 and then 2 run: graph sizes 4 and 2, padding rows included), then a verify-shaped step
    (each sequence its newest token and two more: a graph of 3 tokens per sequence). Returns the tokens (the
    verify step's argmaxes last), the last decode step's logits and the graph shapes used (a q8 cache: codes per
    head, alike on every rank)."""
    from exl_backends.model.runner import Runner
    cache = KVCache(m.config, 7, 256, "q8", dtype=torch.float32)
    runner = Runner(m, cache, max_batch=4, max_pages=2, eager=eager)
    prompts = [list(range(3, 40)), [7, 8, 9, 400], [11, 12, 13, 14, 15, 16]]
    pages = [cache.pool.allocate(2) for _ in prompts]
    first = runner.forward(Batch.build([SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)], 256))
    tokens = [[t] for t in first.argmax(-1).tolist()]
    live = [0, 1, 2]
    for step in range(steps):
        if step == 2:
            live.remove(1)
        chunks = [SeqChunk([tokens[i][-1]], len(prompts[i]) + len(tokens[i]) - 1, pages[i]) for i in live]
        logits = runner.forward(Batch.build(chunks, 256))
        for i, t in zip(live, logits.argmax(-1).tolist()):
            tokens[i].append(t)
    chunks = [SeqChunk([tokens[i][-1], 5, 6], len(prompts[i]) + len(tokens[i]) - 1, pages[i]) for i in live]
    tokens.append(runner.forward(Batch.build(chunks, 256, all_logits=True)).argmax(-1).tolist())
    graphs = runner.graphs
    shapes = [] if graphs is None else sorted(getattr(graphs, "graphs", graphs).by_shape)
    return tokens, logits, shapes


def rank_zero_model(rank: int, world: int, init_method: str, path: str):
    """Joins the gloo group and loads this rank's shard: rank 0 gets its TensorParallelModel, the others follow
    rank 0 until it closes, then get None."""
    torch.set_num_threads(1)
    me, channel = parallel.join_group(rank, world, "cpu", init_method)
    local = parallel.load_shard(path, me, torch.float32)
    if rank == 0:
        return parallel.TensorParallelModel(local, channel)
    parallel.follow(local, channel)
    torch.distributed.destroy_process_group()
    return None


def graph_worker(rank: int, world: int, init_method: str, path: str, out_file: str) -> None:
    """Rank 0 decodes through a Runner over the TensorParallelModel (graph stand-ins, then eagerly) and runs
    `exl bench`'s report; rank 1 follows."""
    from exl_backends.commands import bench
    tp = rank_zero_model(rank, world, init_method, path)
    if tp is None:
        return
    out = {"graphs": greedy(tp, eager=False), "eager": greedy(tp, eager=True)}
    bench.copy_bandwidth = lambda device: 1e9                  # the bound's arithmetic, not a 2 GiB copy
    out["bench"] = bench.report(tp, *bench.measure(tp, [16], "fp16", [32]))
    torch.save(out, out_file)
    tp.close()


def test_decode_graph_steps_are_mirrored_on_every_rank(dirs, tmp_path):
    """The graph path's protocol on CPU (DecodeGraph's eager stand-in): rank 0 announces each replay with its
    batch size, tokens per sequence and inputs, rank 1 replays its own graph of the same shape; tokens equal eager
    TP and one process."""
    out_file = str(tmp_path / "rank0.pt")
    run_ranks(graph_worker, (str(dirs["exl2"]), out_file))
    got = torch.load(out_file)
    one = Model.load(dirs["exl2"])
    ref_tokens, ref_logits, _ = greedy(one, eager=True)
    tokens, logits, shapes = got["graphs"]
    assert shapes == [(2, 1), (2, 3), (4, 1)]    # batches of 3 and 2, padded up; the verify step of 2 x 3
    assert tokens == got["eager"][0] == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got["eager"][1], ref_logits, rtol=1e-4, atol=1e-4)
    assert "tensor parallel over 2 GPUs" in got["bench"] and "decode ctx 16" in got["bench"]


def head_copy(m, copy) -> torch.Tensor:
    """A 40-token prompt over pages 0-2 (16 slots each), page 2's 8 tokens copied into page 3 by copy(cache,
    source slot, target slot, n), then 6 more tokens over pages 0, 1, 3: their logits."""
    tokens = torch.randint(0, 500, (46,), generator=torch.Generator().manual_seed(3)).tolist()
    cache = KVCache(m.config, 5, 16, "q8", dtype=torch.float32)
    m.forward(Batch.build([SeqChunk(tokens[:40], 0, [0, 1, 2])], 16), cache)
    copy(cache, 2 * 16, 3 * 16, 8)
    return m.forward(Batch.build([SeqChunk(tokens[40:], 40, [0, 1, 3])], 16, all_logits=True), cache)


def copy_worker(rank: int, world: int, init_method: str, path: str, out_file: str) -> None:
    tp = rank_zero_model(rank, world, init_method, path)
    if tp is None:
        return
    torch.save(head_copy(tp, tp.copy_slots), out_file)
    tp.close()


def test_copied_page_heads_are_mirrored_on_every_rank(dirs, tmp_path):
    """A prefix's page head copied on rank 0 is copied on rank 1's mirror too (else its half of every head would
    attend to empty slots): the logits equal one process computing the prompt whole."""
    out_file = str(tmp_path / "rank0.pt")
    run_ranks(copy_worker, (str(dirs["exl2"]), out_file))
    one = Model.load(dirs["exl2"])
    tokens = torch.randint(0, 500, (46,), generator=torch.Generator().manual_seed(3)).tolist()
    whole = one.forward(Batch.build([SeqChunk(tokens, 0, [0, 1, 2])], 16, all_logits=True),
                        KVCache(one.config, 3, 16, "q8", dtype=torch.float32))[40:]
    torch.testing.assert_close(torch.load(out_file), whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(head_copy(one, one.copy_slots), whole, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------- memory plan


def shard_bytes(m: Model) -> int:
    """Every weight tensor a loaded shard keeps (embedding, norms, linears, head), as the planner counts them."""
    c = m.config
    linears = [x for b in m.blocks for x in (b.attention.q, b.attention.k, b.attention.v, b.attention.o,
                                              b.mlp.gate, b.mlp.up, b.mlp.down)]
    norms = (2 * c.n_layers + 1) * c.hidden_size * m.dtype.itemsize
    return m.embed.numel() * m.embed.element_size() + norms + sum(x.nbytes() for x in linears) + m.lm_head.nbytes()


@pytest.mark.parametrize("name", ["fp16", "exl2", "gptq"])
def test_rank_footprint_covers_each_loaded_shard(dirs, name):
    from exl_backends import formats
    from exl_backends.model import planner
    config, ckpt = ModelConfig.from_dir(dirs[name]), formats.open_checkpoint(dirs[name])
    fp = parallel.rank_footprint(ckpt, config, 2, "fp16", torch.float16)
    for r in range(2):
        loaded = shard_bytes(parallel.load_shard(dirs[name], parallel.Rank(r, 2, torch.device("cpu")),
                                                 torch.float16))
        if name == "fp16":          # dense: the shares are exact (the planner rounds up by a byte at most)
            assert 0 <= fp.tensor_bytes - loaded < 64
        else:                       # quantized: an upper bound (row cuts get an allowance)
            assert loaded <= fp.tensor_bytes < 1.5 * loaded
    mode = "fp16" if name == "fp16" else "q8"       # each rank's cache holds half the kv heads
    whole = planner.footprint(ckpt, config, mode, torch.float16)
    assert parallel.rank_footprint(ckpt, config, 2, mode, torch.float16).bytes_per_token * 2 == whole.bytes_per_token


def test_tensor_parallel_plan_fits_refuses_and_shortens_per_gpu(dirs, caplog):
    from exl_backends import formats
    from exl_backends.errors import OutOfMemoryPlanError
    config, ckpt = ModelConfig.from_dir(dirs["exl2"]), formats.open_checkpoint(dirs["exl2"])
    fp = parallel.rank_footprint(ckpt, config, 2, "fp16", torch.float16)
    names = ["cuda:0 = GPU 0 (PCI 0000:01:00)", "cuda:1 = GPU 1 (PCI 0000:02:00)"]
    need_512, need_256 = fp.plan(512).total, fp.plan(256).total
    roomy = [need_512 + 10**6, need_512 + 10**9]
    assert parallel.fit_context(fp, roomy, names, 512, 2048) == 512
    tight = [need_512 + 10**6, need_256 + 100]       # GPU 1 holds 256 tokens only: it decides
    with pytest.raises(OutOfMemoryPlanError) as e:
        parallel.fit_context(fp, tight, names, 512, 2048)
    msg = str(e.value)
    assert re.search(r"cuda:0 = GPU 0 \(PCI 0000:01:00\): [\d.]+ GiB free, fits", msg)
    assert re.search(r"cuda:1 = GPU 1 \(PCI 0000:02:00\): [\d.]+ GiB free, short by", msg)
    assert "max_seq_len=256" in msg
    assert parallel.fit_context(fp, tight, names, None, 2048) == 256          # no request: shortened
    assert "shortened from 2048 to 256" in caplog.text
    with pytest.raises(OutOfMemoryPlanError, match="tensor_parallel=2"):
        parallel.fit_context(fp, [need_256 // 2] * 2, names, None, 2048)


def test_a_second_tensor_parallel_model_in_one_process_is_refused(dirs, monkeypatch):
    """torch.distributed keeps one default group per process: a second group would hang at its rendezvous."""
    from exl_backends import ExlForCausalLM
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(ConfigError, match="already open in this process"):
        ExlForCausalLM.from_pretrained(dirs["exl2"], device="cpu", tensor_parallel=2)


# ----------------------------------------------------------------------------------------------- serve under torchrun


def test_serve_followers_never_bind(monkeypatch):
    from exl_backends.server.serve import ServeOptions, is_follower
    o = ServeOptions(REPO, tensor_parallel=2)
    monkeypatch.delenv("RANK", raising=False)
    assert not is_follower(o)                       # started by hand: rank 0, which spawns the others
    monkeypatch.setenv("RANK", "0")
    assert not is_follower(o)
    monkeypatch.setenv("RANK", "1")
    assert is_follower(o) and not is_follower(ServeOptions(REPO))


def test_exl_serve_under_a_torchrun_launch_serves_from_rank_0(dirs, tmp_path):
    """Two processes started as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK), each
    running `exl serve --tensor-parallel 2`: rank 0 answers with the single-process greedy text; rank 1 never
    binds; stopping rank 0 ends both."""
    import signal

    import httpx

    from exl_backends import ExlForCausalLM, Generator, SamplingParams
    port, master = parallel.free_port(), parallel.free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(master), HOME=str(tmp_path))
    cmd = [sys.executable, "-m", "exl_backends.cli", "serve", "-m", str(dirs["exl2"]), "--device", "cpu",
           "--tensor-parallel", "2", "--port", str(port), "--no-auth", "--max-seq-len", "256",
           "--max-batch-size", "2"]
    procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        deadline = time.monotonic() + 150
        while True:
            assert all(p.poll() is None for p in procs), [p.communicate()[0][-2000:] for p in procs]
            try:
                httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.5)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json=dict(model="exl2", prompt="ab cd", max_tokens=8, temperature=0))
        one = ExlForCausalLM.from_pretrained(dirs["exl2"], device="cpu", max_seq_len=256)
        want = Generator(one).generate("ab cd", max_new_tokens=8, sampling=SamplingParams(temperature=0.0))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text
        procs[0].send_signal(signal.SIGINT)
        outputs = [p.communicate(timeout=60)[0] for p in procs]
        # rank 0 stops cleanly: 130 (Ctrl-C's code) where uvicorn re-raises the signal after its shutdown, 0 where
        # an older uvicorn swallows it; rank 1 is done
        assert procs[0].returncode in (0, 130) and procs[1].returncode == 0, outputs
        assert "cannot listen" not in outputs[1] and str(port) not in outputs[1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


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


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("cache_mode", ["fp16", "q4"])
def test_gpu_tensor_parallel_graph_replay_equals_eager_and_one_gpu(dirs, cache_mode):
    """Decode under TP replays CUDA graphs on both ranks (NCCL all-reduces captured inside): a batch of three
    greedy jobs of different lengths (graph size 4, then 2 and 1 as they finish, unless an EOS ends one sooner)
    gives exactly the tokens eager TP gives (the same kernels and reductions). Against one GPU, whose partial sums
    are reduced in another order, a near-tie may flip a token of a random model (on the H200 a q4 job's first
    token did: 399 for 233): each job's first token is one GPU's choice or within 0.05 nats of it in one GPU's
    distribution (test_gpu_tensor_parallel_logits_and_tokens_equal_one_gpu compares the logits)."""
    from exl_backends import ExlForCausalLM, Generator
    from exl_backends.model.runner import DecodeGraphs
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 40))]
    lengths = [12, 4, 8]

    def decode(model, graphs: bool, logprobs: int = 0):    # a page per job, so the three decode together
        gen = Generator(model, max_batch_size=4, cache_tokens=3 * model.page_size, cuda_graphs=graphs)
        jobs = [gen.submit(p, max_new_tokens=n, logprobs=logprobs) for p, n in zip(prompts, lengths)]
        results = [job.result() for job in jobs]
        return gen, [r.token_ids for r in results] if not logprobs else [r.logprobs[0] for r in results]
    one = ExlForCausalLM.from_pretrained(dirs["exl2"], device="cuda:0", max_seq_len=256, cache_mode=cache_mode)
    tp = ExlForCausalLM.from_pretrained(dirs["exl2"], device="cuda", max_seq_len=256, cache_mode=cache_mode,
                                        tensor_parallel=2)
    try:
        graphed, replayed = decode(tp, True)
        assert graphed.runner.use_graphs and isinstance(graphed.runner.graphs.graphs, DecodeGraphs)
        sizes = {size for size, _ in graphed.runner.graphs.graphs.by_shape}
        assert 4 in sizes and sizes <= {1, 2, 4}
        _, eager = decode(tp, False)
    finally:
        tp.model.close()
    _, single = decode(one, True, logprobs=20)
    assert replayed == eager
    for tokens, first in zip(replayed, single):
        alternatives = dict(first.top)
        assert tokens[0] == first.token or alternatives.get(tokens[0], -1e9) > first.logprob - 0.05


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gpu_tensor_parallel_plan_refuses_with_both_gpus_numbers(dirs):
    """A context far past what either GPU holds: every rank reaches the same verdict before loading."""
    from exl_backends import ExlForCausalLM
    from exl_backends.errors import OutOfMemoryPlanError
    with pytest.raises(OutOfMemoryPlanError) as e:
        ExlForCausalLM.from_pretrained(dirs["exl2"], device="cuda", max_seq_len=2**31, tensor_parallel=2)
    assert "cuda:0 = GPU" in str(e.value) and "cuda:1 = GPU" in str(e.value)
