"""Whole models on the GPU against the CPU reference: a random EXL2 model of SmolLM2-135M's shape, and generation
with graph-captured decode against eager decode."""
from __future__ import annotations

import dataclasses
import gc
import json

import pytest
import torch
from safetensors.torch import save_file

from exl_backends import ExlForCausalLM, Generator
from exl_backends.formats.exl2_writer import linear_tensors
from exl_backends.formats.synthetic import random_exl2

from conftest import FIXTURES, TOKENIZER_DIR, unlink_norms

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SMOLLM2 = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, rms_norm_eps=1e-5,
               rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True)


def write_random_exl2(directory, config: dict, seed: int = 0) -> None:
    """An EXL2 checkpoint with random valid codes (mixed widths, act-order) and fp16 embeddings/norms."""
    gen = torch.Generator().manual_seed(seed)
    d, hd = config["hidden_size"], config["hidden_size"] // config["num_attention_heads"]
    q, kv, inter = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd, config["intermediate_size"]
    tensors = {"model.embed_tokens.weight": (torch.randn(config["vocab_size"], d, generator=gen) * 0.5).half(),
               "model.norm.weight": (1 + 0.1 * torch.randn(d, generator=gen)).half()}
    mixes = ["0.05:8b_32g/0.95:4b_128g", "0.1:4b_128g/0.9:3b_128g", "6b_128g", "0.1:5b_32g/0.9:4b_32g"]
    shapes = {"self_attn.q_proj": (d, q), "self_attn.k_proj": (d, kv), "self_attn.v_proj": (d, kv),
              "self_attn.o_proj": (q, d), "mlp.gate_proj": (d, inter), "mlp.up_proj": (d, inter),
              "mlp.down_proj": (inter, d)}
    n = 0
    for i in range(config["num_hidden_layers"]):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{norm}.weight"] = (1 + 0.1 * torch.randn(d, generator=gen)).half()
        for name, (k, m) in shapes.items():
            n += 1
            w = random_exl2(k, m, mixes[n % len(mixes)], seed=seed * 1000 + n)
            tensors.update(linear_tensors(f"model.layers.{i}.{name}", w))
    tensors.update(linear_tensors("lm_head", random_exl2(d, config["vocab_size"], "0.15:8b_128g/0.85:6b_128g",
                                                         seed=seed)))
    save_file(tensors, str(directory / "output.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((TOKENIZER_DIR / name).read_bytes())


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_smollm2_shape_gpu_logits_match_cpu_reference(tmp_path):
    write_random_exl2(tmp_path, SMOLLM2)
    ids = torch.randint(0, 509, (1, 77), generator=torch.Generator().manual_seed(1))
    cpu = ExlForCausalLM.from_pretrained(tmp_path, device="cpu", max_seq_len=256)(ids).logits
    gpu = ExlForCausalLM.from_pretrained(tmp_path, device="cuda", max_seq_len=256)(ids.cuda()).logits.cpu()
    assert rel(gpu, cpu) < 1e-2            # fp16 activations over 30 layers vs the f32 reference
    assert (gpu.argmax(-1) == cpu.argmax(-1)).float().mean() > 0.8   # random weights: some near-ties


@pytest.mark.parametrize("cache_mode,context", [("fp16", 300), ("q4", 300), ("fp16", 700)])
def test_decode_attention_writes_the_o_projections_input_as_it_reads_it(cache_mode, context, monkeypatch):
    """A decode row's attention output written where and as its quantized o projection reads it (act-order's stored
    order, 4-bit rows scaled: no stage launch before o) gives the staged path's logits bit for bit; 700 keys take
    the split attention's merge."""
    import dataclasses

    from exl_backends.kernels import quant_matmul as qm
    from exl_backends.model.batch import Batch, SeqChunk
    from exl_backends.model.cache import KVCache
    model = ExlForCausalLM.from_pretrained(FIXTURES / "exl2" / "llama_tiny_exl2_4.0bpw_h6", device="cuda",
                                           max_seq_len=1024, cache_mode=cache_mode).model
    cache = KVCache(model.config, 4, 256, cache_mode, "cuda", torch.float16)
    pages = cache.pool.allocate(3)
    prompt = torch.randint(1, 500, (context,), generator=torch.Generator().manual_seed(5)).tolist()
    model.forward(Batch.build([SeqChunk(prompt, 0, pages)], 256, "cuda"), cache)
    step = Batch.build([SeqChunk([17], context, pages)], 256, "cuda")
    unlink_norms(model)             # (o feeding the MLP's norm: test_a_decode_rows_launches_do_the_norms_between_them)
    stored = []
    forward_stored = qm.QuantMatmul.forward_stored
    monkeypatch.setattr(qm.QuantMatmul, "forward_stored", lambda self, x: stored.append(x) or forward_stored(self, x))
    direct = model.forward(step, cache)
    assert len(stored) == model.config.n_layers
    monkeypatch.setattr(model, "ops", dataclasses.replace(model.ops, attention_into=False))
    staged = model.forward(step, cache)
    assert len(stored) == model.config.n_layers and torch.equal(direct, staged)


@pytest.mark.parametrize("path", ["exl2/llama_tiny_exl2_4.0bpw_h6", "exl2/qwen2_tiny_exl2_4.0bpw_h6",
                                  "exl2/llama_tiny_exl2_2.5bpw_h6", "gptq/llama_tiny_gptq4_g64"])
def test_a_decode_rows_launches_do_the_norms_between_them(path, monkeypatch):
    """A decode row's o and down leave the next norm's x in place (Model.link_norms, QuantMatmul.forward_feeding),
    and a fed gate/up down's (QuantMatmul.link_gating), the embedding's launch the first block's (embed_feed): no
    stage_xs launch for any block's norms, nor for a quantized head's final norm, nor for down where gate/up pair;
    the logits are the staged path's within fp16 rounding (the norm's scale after the matmul), its greedy token too,
    in eager steps and in a graph's replays."""
    from exl_backends.kernels import quant_matmul as qm
    from exl_backends.model.batch import Batch, SeqChunk
    from exl_backends.model.cache import KVCache
    from exl_backends.model.runner import Runner
    model = ExlForCausalLM.from_pretrained(FIXTURES / path, device="cuda", max_seq_len=512).model
    cache = KVCache(model.config, 4, 256, "fp16", "cuda", torch.float16)
    pages = cache.pool.allocate(2)
    prompt = torch.randint(1, 500, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    model.forward(Batch.build([SeqChunk(prompt, 0, pages)], 256, "cuda"), cache)
    step = Batch.build([SeqChunk([17], len(prompt), pages)], 256, "cuda")
    staged_launches = []
    stage = qm.QuantMatmul._stage
    monkeypatch.setattr(qm.QuantMatmul, "_stage", lambda self, *a: staged_launches.append(a[2]) or stage(self, *a))
    fed = model.forward(step, cache)
    normed = [before for before in staged_launches if before[2] is not None]      # stage_xs with a norm weight
    ungated = sum(b.mlp.gate_up.kernel.gating is None for b in model.blocks)     # downs staged by stage_xs
    # (the embedding's launch feeds the first block's q/k/v; the last down a quantized head, a dense one stages
    # nothing)
    assert not normed and len(staged_launches) == ungated < model.config.n_layers
    assert (model.lm_head.kernel.fed_by is not None) if getattr(model.lm_head, "kernel", None) else True
    replayed = Runner(model, cache, max_batch=1, max_pages=2, eager=False)
    assert all(torch.equal(replayed.forward(step), fed) for _ in range(2))
    unlink_norms(model)
    staged = model.forward(step, cache)
    assert torch.isfinite(fed).all() and rel(fed, staged) < 2e-3 and torch.equal(fed.argmax(-1), staged.argmax(-1))


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_a_quantized_head_applies_the_final_norm_as_it_stages_x(rows, monkeypatch):
    """Model.logits on rows the last down did not feed: the quantized head's launch stages x with the final norm
    (QuantMatmul.forward_normed), no norm launch before it, and gives the norm-then-head logits bit for bit."""
    from exl_backends.kernels import norm
    from exl_backends.model.batch import Batch, SeqChunk
    model = ExlForCausalLM.from_pretrained(FIXTURES / "exl2/llama_tiny_exl2_4.0bpw_h6", device="cuda",
                                           max_seq_len=512).model
    gen = torch.Generator().manual_seed(rows)
    h, residual = (torch.randn(rows, model.config.hidden_size, generator=gen).half().cuda() for _ in range(2))
    batch = Batch.build([SeqChunk(list(range(1, rows + 1)), 0, [0])], 256, "cuda", all_logits=True)
    x, _ = norm.add_rmsnorm(h, residual, model.norm, model.config.rms_norm_eps)
    expected = model.lm_head(x).float()
    launched = []
    monkeypatch.setattr(norm, "add_rmsnorm", lambda *a: launched.append(a))   # forward_normed's unfused way
    model.ops = dataclasses.replace(model.ops, add_rmsnorm=lambda *a: launched.append(a))
    assert torch.equal(model.logits(h, residual, batch), expected) and not launched


@pytest.mark.parametrize("cache_mode", ["fp16", "q4"])
def test_graph_replay_generates_the_same_tokens_as_eager(cache_mode, attention_probe):
    """Also with attention's probe (TILE BEFORE WAIT, fp16), whose loads before the wait rely on the step's order
    (prompts, then decode steps in graphs and eager, new pages as the rows grow)."""
    if attention_probe and cache_mode != "fp16":
        pytest.skip("the probe changes the fp16 kernels only")
    model = ExlForCausalLM.from_pretrained(FIXTURES / "exl2" / "llama_tiny_exl2_4.0bpw_h6", device="cuda",
                                           max_seq_len=512, cache_mode=cache_mode)
    # 128 prompt tokens in all: the first step fills a size of the prefill graphs exactly, so no padding rows change
    # its matmul plans and the prompts' K/V are eager's bit for bit (padding: test_prefill_pieces_replay_the_eager_logits)
    prompts = [[509] + list(range(20 + i, 40 + 3 * i)) for i in range(5)]
    prompts[-1] += [7, 8, 9]

    def run(graphs):
        gen = Generator(model, cuda_graphs=graphs, max_batch_size=8)
        jobs = [gen.submit(p, max_new_tokens=40, stop_token_ids=[]) for p in prompts]
        return [job.result().token_ids for job in jobs]
    assert run(True) == run(False)


@pytest.mark.parametrize("drafting", ["ngram", "self-draft"])
def test_speculative_verify_graphs_generate_the_eager_tokens(drafting):
    """Speculative decoding with captured verify steps (several tokens per sequence) and, for a draft model, its own
    captured steps: greedy tokens equal eager decoding's."""
    model = ExlForCausalLM.from_pretrained(FIXTURES / "exl2" / "llama_tiny_exl2_4.0bpw_h6", device="cuda",
                                           max_seq_len=512)
    phrase = list(range(30, 37))
    prompts = [[509] + phrase * 4, [509] + phrase[::-1] * 3, [509] + phrase[2:] * 5]
    kw = dict(ngram_draft=True) if drafting == "ngram" else dict(draft_model=model)

    def run(graphs):
        gen = Generator(model, cuda_graphs=graphs, max_batch_size=4, **kw)
        jobs = [gen.submit(p, max_new_tokens=40, stop_token_ids=[]) for p in prompts]
        return gen, [job.result().token_ids for job in jobs]
    gen, replayed = run(True)
    assert any(tokens > 1 for _, tokens in gen.runner.graphs.by_shape)
    assert replayed == run(False)[1]


def test_captures_run_without_automatic_garbage_collection(monkeypatch):
    """A generator dropped in a reference cycle keeps its graphs until the garbage collector frees them, and freeing
    a graph while another one is being captured invalidates that capture (seen on the H200: "operation not permitted
    when stream is capturing", then the capture failed). When that happens depends on the collector's timing, so
    this checks its precondition: no automatic collection while any of the runner's graphs is captured (decode,
    verify and prefill pieces), and the tokens still equal eager decoding's."""
    model = ExlForCausalLM.from_pretrained(FIXTURES / "exl2" / "llama_tiny_exl2_4.0bpw_h6", device="cuda",
                                           max_seq_len=256)
    phrase = list(range(20, 40))
    prompt = [509] + phrase * 2
    eager = Generator(model, cuda_graphs=False).generate(prompt, max_new_tokens=12, stop_token_ids=[]).token_ids
    seen = []
    for name in ("stage_forward", "embed_tokens", "after_attention"):   # decode graphs, prefill pieces
        original = getattr(model.model, name)

        def watched(*args, original=original, **kwargs):
            if torch.cuda.is_current_stream_capturing():
                seen.append(gc.isenabled())
            return original(*args, **kwargs)
        monkeypatch.setattr(model.model, name, watched)
    gen = Generator(model, max_batch_size=2, ngram_draft=True)
    assert gen.generate(prompt, max_new_tokens=12, stop_token_ids=[]).token_ids == eager
    assert seen and not any(seen)


@pytest.mark.parametrize("cache_mode", ["fp16", "q4"])
def test_prefill_pieces_replay_the_eager_logits(cache_mode):
    """Steps that no decode graph takes (prompts, and a prompt chunk beside a decode row) through the captured
    pieces around eager attention give the eager forward's logits; padding rows leave the sequences' cache alone."""
    from exl_backends.model.batch import Batch, SeqChunk
    from exl_backends.model.cache import KVCache
    from exl_backends.model.runner import Runner
    lm = ExlForCausalLM.from_pretrained(FIXTURES / "exl2" / "llama_tiny_exl2_4.0bpw_h6", device="cuda",
                                        max_seq_len=1024, cache_mode=cache_mode)
    model = lm.model
    cache = KVCache(model.config, 8, 256, cache_mode, "cuda", torch.float16)
    runner = Runner(model, cache, max_batch=4, max_pages=4)
    pages = [cache.pool.allocate(2) for _ in range(3)]
    g = torch.Generator().manual_seed(3)

    def tokens(n):
        return torch.randint(1, 500, (n,), generator=g).tolist()
    steps = [[SeqChunk(tokens(300), 0, pages[0]), SeqChunk(tokens(40), 0, pages[1])],
             [SeqChunk(tokens(1), 300, pages[0]), SeqChunk(tokens(79), 40, pages[1]), SeqChunk(tokens(13), 0, pages[2])],
             [SeqChunk(tokens(5), 13, pages[2]), SeqChunk(tokens(2), 301, pages[0])]]
    for chunks in steps:
        batch = Batch.build(chunks, 256, "cuda", all_logits=True)
        eager = model.forward(batch, cache)
        kept = [t[256 * p:256 * (p + 1)].clone() for layer in cache.layers for t in (layer.k, layer.v)
                for p in pages[0] + pages[1] + pages[2]]
        ours = runner.forward(batch)
        assert rel(ours, eager) < 2e-3
        assert (ours.argmax(-1) == eager.argmax(-1)).float().mean() > 0.95
        now = [t[256 * p:256 * (p + 1)] for layer in cache.layers for t in (layer.k, layer.v)
               for p in pages[0] + pages[1] + pages[2]]
        assert all((a.float() - b.float()).norm() <= 2e-3 * b.float().norm() for a, b in zip(now, kept))
    assert sorted(runner.prefill.graphs) == [8, 96, 352]      # 7, 93 and 340 tokens, padded (runner.TOKEN_SIZES)


@pytest.mark.parametrize("cache_mode", ["fp16", "q4"])
def test_a_copied_page_head_gives_the_computed_prefix_distribution(cache_mode):
    """A chat's next turn takes the finished turn's partly filled last page as a copied head (on the GPU: every
    layer's K/V, and a q4 cache's scales): its next-token distribution equals a fresh generator computing the whole
    prompt (within fp16 noise: the prefix ran in other batches)."""
    model = ExlForCausalLM.from_pretrained(FIXTURES / "exl2" / "llama_tiny_exl2_4.0bpw_h6", device="cuda",
                                           max_seq_len=1024, cache_mode=cache_mode)
    prompt = [509] + torch.randint(1, 500, (300,), generator=torch.Generator().manual_seed(4)).tolist()
    gen = Generator(model)
    first = gen.generate(prompt, max_new_tokens=8, stop_token_ids=[])
    turn = prompt + first.token_ids + [11, 12, 13]
    reused = gen.generate(turn, max_new_tokens=1, stop_token_ids=[], logprobs=5)
    fresh = Generator(model).generate(turn, max_new_tokens=1, stop_token_ids=[], logprobs=5)
    assert reused.usage.cached_tokens == len(prompt) + 7 and fresh.usage.cached_tokens == 0
    ours, theirs = dict(reused.logprobs[0].top), dict(fresh.logprobs[0].top)
    assert reused.token_ids == fresh.token_ids
    both = ours.keys() & theirs.keys()
    assert len(both) >= 4 and all(abs(ours[t] - theirs[t]) < 0.05 for t in both)
