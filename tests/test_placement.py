"""Layer split: the placement planner on synthetic device sizes, and split models against unsplit ones."""
from __future__ import annotations

import itertools
import re

import pytest
import torch

from exl_backends import ExlForCausalLM, Generator, formats
from exl_backends.errors import OutOfMemoryPlanError
from exl_backends.model import placement, planner
from exl_backends.model.batch import Batch, SeqChunk
from exl_backends.model.cache import KVCache
from exl_backends.model.config import ModelConfig
from exl_backends.model.model import Model, Stage
from exl_backends.model.placement import SplitCosts, place

from conftest import save_tiny, tiny_config
from quant_helpers import quantize_dir

GIB = 2**30


def costs(n_layers=32, layer=1.0, embedding=1.0, head=1.2, scratch=0.5, logits=0.25, reserve=0.25) -> SplitCosts:
    """Synthetic sizes in GiB (layer: weights + cache of one layer)."""
    def b(x):
        return int(x * GIB)
    return SplitCosts(4096, "fp16", (b(layer),) * n_layers, (0,) * n_layers, b(embedding), b(head), b(scratch),
                      b(logits), b(reserve))


def worst_fraction(c: SplitCosts, ranges, budgets) -> float:
    return max(placement.device_bytes(c, r) / b for r, b in zip(ranges, budgets))


def best_in_order(c: SplitCosts, budgets) -> float:
    """The smallest worst fraction over every in-order split (brute force)."""
    n, best = len(c.layers), float("inf")
    for cuts in itertools.combinations(range(n + 1), len(budgets) - 1):
        bounds = (0, *cuts, n)
        if any(a > b for a, b in zip(bounds, bounds[1:])):
            continue
        ranges = [range(a, b) for a, b in zip(bounds, bounds[1:])]
        if all(placement.device_bytes(c, r) <= b for r, b in zip(ranges, budgets)):
            best = min(best, worst_fraction(c, ranges, budgets))
    return best


def contiguous(ranges, n):
    return [i for r in ranges for i in r] == list(range(n))


@pytest.mark.parametrize("budgets_gib", [[24, 24], [24, 48], [40, 40, 40], [16, 24, 48]])
def test_auto_split_is_balanced(budgets_gib):
    c = costs()
    budgets = [g * GIB for g in budgets_gib]
    ranges = place(c, budgets, [f"gpu{i}" for i in range(len(budgets))], auto=True)
    assert contiguous(ranges, 32)
    assert worst_fraction(c, ranges, budgets) == pytest.approx(best_in_order(c, budgets), rel=1e-9)
    if budgets_gib == [24, 24]:
        assert [len(r) for r in ranges] in ([16, 16], [17, 15], [15, 17])
    if budgets_gib == [24, 48]:             # the larger device takes about twice the layers
        assert 1.6 < len(ranges[1]) / len(ranges[0]) < 2.6


def test_explicit_split_fills_in_order_up_to_each_number():
    c = costs()
    budgets = [10 * GIB, 30 * GIB]
    ranges = place(c, budgets, ["gpu0", "gpu1"], auto=False)
    assert contiguous(ranges, 32)
    first = ranges[0]
    assert placement.device_bytes(c, first) <= budgets[0] < placement.device_bytes(c, range(0, first.stop + 1))
    assert len(first) == 8              # 0.75 fixed + 1.0 embedding + 8 layers = 9.75 GiB of 10
    assert placement.device_bytes(c, ranges[1]) <= budgets[1]


def test_a_small_model_leaves_the_later_devices_unused_by_explicit_split():
    c = costs(n_layers=4)
    ranges = place(c, [40 * GIB, 40 * GIB], ["gpu0", "gpu1"], auto=False)
    assert ranges == [range(0, 4), range(4, 4)]


@pytest.mark.parametrize("auto", [True, False])
def test_refuses_with_numbers_per_device(auto):
    c = costs()
    with pytest.raises(OutOfMemoryPlanError) as e:
        place(c, [16 * GIB, 12 * GIB], ["cuda:0 = GPU 0", "cuda:1 = GPU 1"], auto=auto)
    msg = str(e.value)
    assert "cuda:0 = GPU 0: 16.00 GiB" in msg and "cuda:1 = GPU 1: 12.00 GiB" in msg
    assert re.search(r"layers 0-13 = 15\.\d\d GiB", msg)            # 0.75 + 1 + 14 layers
    assert re.search(r"layers \d+-31 of 32 are left over", msg)
    assert "max_seq_len" in msg and "q4" in msg


# ----------------------------------------------------------------------------------------------- real checkpoints


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """4-layer tiny models: llama fp16 (untied), llama fp16 tied, qwen2 EXL2 (act-order, mixed widths, biases)."""
    root = tmp_path_factory.mktemp("placement")
    out = {"llama": root / "llama", "tied": root / "tied", "exl2": root / "exl2"}
    save_tiny(out["llama"], tiny_config("llama", num_hidden_layers=4))
    save_tiny(out["tied"], tiny_config("llama", num_hidden_layers=3, tie_word_embeddings=True), seed=1)
    src = root / "qwen2"
    save_tiny(src, tiny_config("qwen2", num_hidden_layers=4, head_dim=32), seed=2, dtype=torch.float16)
    quantize_dir(src, out["exl2"], "exl2", quant_config={"quant_method": "exl2"}, head=True)
    return out


def test_split_costs_add_up_to_the_plan(dirs):
    for d in dirs.values():
        config, ckpt = ModelConfig.from_dir(d), formats.open_checkpoint(d)
        c = placement.split_costs(ckpt, config, 1024, "fp16")
        fp = planner.footprint(ckpt, config, "fp16")
        tied_copy = config.vocab_size * config.hidden_size * 2 if config.tie_word_embeddings else 0
        assert sum(c.layers) - sum(c.cache) + c.embedding + c.head - tied_copy == fp.weights
        assert sum(c.cache) == fp.plan(1024).cache
        assert c.scratch + c.logits == fp.scratch(1024)


@pytest.mark.parametrize("name", ["llama", "tied", "exl2"])
def test_split_logits_equal_unsplit(dirs, name):
    ids = torch.randint(0, 500, (2, 37), generator=torch.Generator().manual_seed(0))
    whole = ExlForCausalLM.from_pretrained(dirs[name], device="cpu", max_seq_len=256)
    split = ExlForCausalLM.from_pretrained(dirs[name], device=["cpu", "cpu"], gpu_split="auto", max_seq_len=256)
    stages = split.model.stages
    assert len(stages) == 2 and stages[0].layers.stop == stages[1].layers.start
    assert [d.type for d in split.placement.devices] == ["cpu", "cpu"]
    assert torch.equal(split(ids).logits, whole(ids).logits)


def test_split_generation_and_cache_follow_the_layers(dirs):
    whole = ExlForCausalLM.from_pretrained(dirs["exl2"], device="cpu", max_seq_len=256, cache_mode="q4")
    split = ExlForCausalLM.from_pretrained(dirs["exl2"], device=["cpu", "cpu"], gpu_split="auto",
                                           max_seq_len=256, cache_mode="q4")
    assert len(split.model.stages) == 2
    gen = Generator(split)
    assert gen.cache.layer_devices == split.model.block_devices
    prompts = [[1, 5, 9, 200, 17], [3, 4, 100]]
    ours = [gen.generate(p, max_new_tokens=6).token_ids for p in prompts]
    assert ours == [Generator(whole).generate(p, max_new_tokens=6).token_ids for p in prompts]


def test_three_stages_equal_one(dirs):
    cpu = torch.device("cpu")
    stages = [Stage(cpu, range(0, 1)), Stage(cpu, range(1, 3)), Stage(cpu, range(3, 4))]
    whole, split = Model.load(dirs["exl2"]), Model.load(dirs["exl2"], stages=stages)
    assert split.block_devices == [cpu] * 4
    batch = Batch.build([SeqChunk(list(range(3, 40)), 0, [0]), SeqChunk([7, 8, 9], 0, [1])], 256, all_logits=True)
    logits = [m.forward(batch, KVCache(m.config, 2, 256, "q8", dtype=torch.float32)) for m in (whole, split)]
    assert torch.equal(*logits)


def test_describe_names_every_device_and_its_layers(dirs):
    split = ExlForCausalLM.from_pretrained(dirs["llama"], device=["cpu", "cpu"], gpu_split=[1, 1], max_seq_len=256)
    text = split.placement.describe()
    assert re.search(r"cpu: layers 0-\d \(\d\)", text) and re.search(r"cpu: layers \d-3 \(\d\)", text)


def test_device_order_note(monkeypatch):
    gpus = (torch.device("cuda", 0), torch.device("cuda", 1))
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in placement.device_order_note(gpus)
    assert placement.device_order_note(gpus[:1]) is None
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert placement.device_order_note(gpus) is None


# ----------------------------------------------------------------------------------------------- two GPUs


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("name", ["llama", "exl2"])
def test_gpu_split_logits_equal_one_gpu(dirs, name):
    ids = torch.randint(0, 500, (2, 37), generator=torch.Generator().manual_seed(0)).cuda()
    one = ExlForCausalLM.from_pretrained(dirs[name], device="cuda:0", max_seq_len=256, dtype=torch.float16)
    two = ExlForCausalLM.from_pretrained(dirs[name], gpu_split="auto", max_seq_len=256, dtype=torch.float16)
    assert [d.index for d in two.placement.devices] == [0, 1]
    assert "PCI" in two.placement.describe()
    a = one(ids).logits
    b = two(ids).logits.to(a.device)
    assert torch.allclose(a, b, atol=1e-3, rtol=1e-3)       # the same kernels, in the same order, per layer
    gen_one, gen_two, eager_two = Generator(one), Generator(two), Generator(two, cuda_graphs=False)
    want = gen_one.generate([1, 2, 3], max_new_tokens=8).token_ids
    assert gen_two.generate([1, 2, 3], max_new_tokens=8).token_ids == want
    assert eager_two.generate([1, 2, 3], max_new_tokens=8).token_ids == want
    graph = gen_two.runner.graphs.by_shape[1, 1]            # a split replays one graph per GPU
    assert [b.input_ids.device.index for b in graph.stage_batches] == [0, 1] and len(graph.graphs) == 2


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_a_model_on_the_second_gpu_generates_as_on_the_first(dirs):
    """Kernels and captures follow the model's device, not the current one (cuda:0 throughout): after graphs were
    captured on cuda:0, decode graphs and prefill pieces on cuda:1 give cuda:0's tokens."""
    prompts = [[1, 2, 3], list(range(10, 50))]
    tokens = []
    for device in ("cuda:0", "cuda:1"):
        gen = Generator(ExlForCausalLM.from_pretrained(dirs["exl2"], device=device, max_seq_len=256,
                                                       dtype=torch.float16))
        tokens.append([gen.generate(p, max_new_tokens=8).token_ids for p in prompts])
        assert gen.runner.prefill.graphs and gen.runner.graphs.by_shape        # both captured
    assert torch.cuda.current_device() == 0 and tokens[0] == tokens[1]

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_on_one_gpu_replays_a_graph_per_stage(dirs):
    """Two stages on one GPU: the split's decode graphs (one per stage, the residual handed over between them)
    give one unsplit model's tokens, eagerly and replayed."""
    one = ExlForCausalLM.from_pretrained(dirs["exl2"], device="cuda:0", max_seq_len=256, dtype=torch.float16)
    two = ExlForCausalLM.from_pretrained(dirs["exl2"], device=["cuda:0", "cuda:0"], gpu_split="auto",
                                         max_seq_len=256, dtype=torch.float16)
    assert len(two.model.stages) == 2
    ids = torch.randint(0, 500, (2, 37), generator=torch.Generator().manual_seed(0)).cuda()
    assert torch.allclose(one(ids).logits, two(ids).logits, atol=1e-3, rtol=1e-3)
    prompts = [[1, 2, 3], list(range(10, 50))]
    want = [Generator(one).generate(p, max_new_tokens=8).token_ids for p in prompts]
    graphed, eager = Generator(two), Generator(two, cuda_graphs=False)
    for gen in (graphed, eager):
        assert [gen.generate(p, max_new_tokens=8).token_ids for p in prompts] == want
    assert len(graphed.runner.graphs.by_shape[1, 1].graphs) == 2
