"""The decode step as an instruction table (model/step_table.py): its CPU interpreter, run in any order the counters
allow, gives the model's logits; a missing wait gives wrong ones, a wait never met is reported."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from exl_backends import ExlForCausalLM
from exl_backends.errors import UnsupportedFormatError
from exl_backends.model import step_table
from exl_backends.model.step_table import Interpreter, build, describe, ranges

from conftest import FIXTURES, needs_fixtures, save_tiny, tiny_config

# wider than the default tiny config, so that every op has several slices: 8 heads in 2 KV groups, 11 strips of
# intermediate rows, 16 of vocabulary
WIDE = dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, intermediate_size=352)
SMS = 5                          # odd: slices of unequal size, SMs with and without an attention group
TOKENS = 7


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model(request, tmp_path_factory):
    """A random model of the family (qwen2: q/k/v biases; qwen3: q/k norms), loaded on the CPU."""
    path = tmp_path_factory.mktemp(request.param)
    save_tiny(path, tiny_config(request.param, **WIDE, **({"head_dim": 16} if request.param == "qwen3" else {})))
    return ExlForCausalLM.from_pretrained(path, device="cpu")


def expected_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids[None]).logits[0]                                 # [T, vocab], the model's own forward


def interpreted_logits(table, model, ids: torch.Tensor, order: int | None) -> torch.Tensor:
    run = Interpreter(table, model.model, len(ids))
    return torch.stack([run.step(int(t), p, order) for p, t in enumerate(ids)])


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item(), f"max |diff| {err:.3g}"


def ids_for(model, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 509, (TOKENS,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layout", step_table.LAYOUTS)
def test_the_interpreted_step_gives_the_model_logits_in_any_order(model, layout):
    ids = ids_for(model)
    ref = expected_logits(model, ids)
    table = build(model.model.config, SMS, layout)
    for order in (None, 0, 1, 2):          # lowest SM first, then random orders the counters allow
        assert_close(interpreted_logits(table, model, ids, order), ref)


@needs_fixtures()
@pytest.mark.parametrize("layout", step_table.LAYOUTS)
def test_an_exllamav2_checkpoint_through_the_table(layout):
    model = ExlForCausalLM.from_pretrained(FIXTURES / "exl2" / "llama_tiny_exl2_4.0bpw_h6", device="cpu")
    ids = ids_for(model, 1)
    assert_close(interpreted_logits(build(model.model.config, 3, layout), model, ids, 5), expected_logits(model, ids))


def test_a_missing_wait_gives_wrong_logits(model):
    """gate_up slices that do not wait for every o slice read a residual still being written."""
    ids = ids_for(model)
    table = build(model.model.config, SMS, "columns")
    table.slices = [dataclasses.replace(s, waits=()) if s.op == "gate_up" else s for s in table.slices]
    ours = interpreted_logits(table, model, ids, None)
    assert not torch.allclose(ours, expected_logits(model, ids), rtol=0, atol=1e-3)


def test_fine_tiles_need_the_ring_of_residuals(model):
    """tiles-fine's o tiles add into the residual right after their own group's attention, while other groups'
    q/k/v slices may still be reading it. With one residual updated in place, the step is right when the slices run
    one after another in table order (one SM) and wrong when they run on several: the race the ring prevents."""
    ids = ids_for(model)
    ref = expected_logits(model, ids)

    def in_place(sms: int) -> torch.Tensor:
        run = Interpreter(build(model.model.config, sms, "tiles-fine"), model.model, len(ids))
        run._version = lambda v: run.ring[0]

        def add(s, v, delta):
            run.ring[0][s.lo:s.hi] += delta
        run._produce = add
        return torch.stack([run.step(int(t), p) for p, t in enumerate(ids)])

    assert_close(in_place(1), ref)
    assert not torch.allclose(in_place(SMS), ref, rtol=0, atol=1e-3)


def test_a_wait_never_met_is_reported(model):
    table = build(model.model.config, SMS)
    table.slices = [dataclasses.replace(s, waits=tuple((k, v + 1) for k, v in s.waits)) if s.op == "head" else s
                    for s in table.slices]
    with pytest.raises(RuntimeError, match="deadlocks"):
        Interpreter(table, model.model, 2).step(3, 0)


def test_the_tables_structure():
    """At the Llama-3.2-1B shape on 132 SMs: the waits a layer of each layout, tiles whose partial sums cover each
    output once and whose carrying tiles cover the residual once, and the step's bytes."""
    config = type("Config", (), dict(head_dim=64, n_heads=32, n_kv_heads=8, hidden_size=2048,
                                    intermediate_size=8192, n_layers=16, vocab_size=128256))()
    for layout, waits in (("columns", (5, 0)), ("tiles", (5, 0)), ("tiles-fine", (2, 3))):
        table = build(config, 132, layout)
        assert step_table.whole_op_waits(table, 1) == waits
        layer = [s for s in table.slices if s.layer == 1]
        for op, k in (("o", 32 * 64), ("down", 8192)):
            ss = [s for s in layer if s.op == op]
            covered = torch.zeros(k, 2048)              # each (input row, output column) exactly once
            for s in ss:
                covered[slice(*s.rows) if s.rows else slice(None), s.lo:s.hi] += 1
            assert bool((covered == 1).all())
            carried = sum(s.hi - s.lo for s in ss if s.carries)
            assert carried == (0 if layout == "columns" else 2048)
        assert len({s.sm for s in layer if s.op == "o"}) == (64 if layout == "columns" else 128)
        weights = sum(s.weight_bytes for s in table.slices)
        assert abs(weights / 0.69e9 - 1) < 0.03         # the 1B step's bytes at 4.0 bpw, a 6-bit head
    text = describe(build(config, 132, "tiles-fine"))
    assert "2 waits a layer on a whole op, 3 on part of one" in text and "attention: 8 slices on 8 SMs" in text


def test_ranges_cover_whole_strips():
    for n, parts in ((3072, 132), (2048, 132), (100, 7), (64, 5), (33, 2)):
        rs = ranges(n, parts)
        assert rs[0][0] == 0 and rs[-1][1] == n and len(rs) <= parts
        assert all(a[1] == b[0] for a, b in zip(rs, rs[1:]))
        assert all(lo % 32 == 0 for lo, _ in rs) and all(hi > lo for lo, hi in rs)


def test_other_families_are_refused(tmp_path):
    save_tiny(tmp_path, tiny_config("gemma2"))
    model = ExlForCausalLM.from_pretrained(tmp_path, device="cpu")
    with pytest.raises(UnsupportedFormatError, match="Llama family"):
        Interpreter(build(model.model.config, SMS), model.model, 4)
