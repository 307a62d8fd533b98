"""The converter's GPTQ (convert/gptq.py): the batched, block-graphed quantizer gives exactly the results of plain
column-by-column GPTQ run one setting at a time, and issues few operations per row (the GPU cost of the column
loop is launching them). CPU, small shapes; the CUDA graph path is checked against eager CUDA on a GPU."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from exl_backends.convert import gptq, job as job_module
from exl_backends.convert.qparams import MLP_CANDIDATES, distinct

K, N = 384, 24


class OpCount(TorchDispatchMode):
    """Counts the aten operations run under it (each one a kernel launch on a GPU, views aside)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def problem(seed: int = 0, k: int = K, n: int = N):
    """A weight with an all-zero group of rows (scale 0) and a full-rank Hessian with uneven diagonal."""
    g = torch.Generator().manual_seed(seed)
    w = 0.05 * torch.randn(n, k, generator=g)
    w[:, 64:96] = 0
    x = torch.randn(3 * k, k, generator=g) * (0.2 + 2 * torch.rand(k, generator=g))
    return w, gptq.prepare(x.T @ x / (3 * k), gptq.EXL2_DAMP)


def plain_gptq(weight, prepared, layout, rule):
    """The textbook formulation, one setting: rows in order, each quantized with its group's scale (chosen from the
    error-compensated rows when the group starts), its error spread over all later rows at once."""
    n, k = weight.shape
    w = weight.float().T[prepared.perm].contiguous()
    hinv = prepared.hinv
    codes = torch.empty(k, n, dtype=torch.uint8)
    dequant = torch.empty(k, n, dtype=torch.float16)
    data, row = [], 0
    for bits, rows in layout:
        scale, d = rule(w[None, row: row + rows], torch.tensor([float(bits)]))
        scale = scale[0]
        data.append({name: v[0] for name, v in d.items()})
        zero = 2 ** (bits - 1)
        for c in range(row, row + rows):
            q = torch.where(scale > 0, torch.round(w[c] / scale), 0).add(zero).clamp(0, 2 ** bits - 1)
            dq = ((q - zero) * scale).half()
            e = (w[c] - dq.float()) / hinv[c, c]
            w[c + 1:] -= hinv[c, c + 1:, None] * e[None, :]
            codes[c], dequant[c] = q, dq
        row += rows
    return codes, dequant[torch.argsort(prepared.perm)].T, data


def layouts(k: int = K):
    return [qp.groups(k) for qp in distinct(MLP_CANDIDATES, 2)][:6]


def same(results, expected) -> bool:
    return all(torch.equal(r.codes, c) and torch.equal(r.weight, d) and len(r.group_data) == len(g) and
               all(a.keys() == b.keys() and all(torch.equal(a[x], b[x]) for x in a) for a, b in zip(r.group_data, g))
               for r, (c, d, g) in zip(results, expected, strict=True))


@pytest.mark.parametrize("rtn", [False, True])
@pytest.mark.parametrize("rule", [gptq.exl2_scale, gptq.gptq_sym_scale])
def test_batched_settings_match_plain_gptq_one_setting_at_a_time(rule, rtn):
    """Lazy block updates are the same arithmetic as updating all later rows after every row (the same products
    subtracted in the same order), so the results are bit for bit the same. With the identity for hinv (round
    to nearest) the all-zero rows stay zero: their groups have scale 0 and must quantize to 0."""
    w, prepared = problem()
    if rtn:
        prepared = gptq.Prepared(torch.arange(K), torch.eye(K))
    lay = layouts() if rule is gptq.exl2_scale else [[(4, 64)] * (K // 64), [(8, 128)] * (K // 128)]
    got = gptq.quantize(w, prepared, lay, rule)
    assert same(got, [plain_gptq(w, prepared, layout, rule) for layout in lay])
    if rtn:
        assert all((r.weight[:, 64:96] == 0).all() for r in got)


def test_batches_and_graph_wrappers_do_not_change_results(monkeypatch):
    """Settings quantized together or one per batch, and the CUDA-graph path's static-buffer wrappers (here with
    the captured steps run eagerly, as the CPU cannot capture): identical results."""
    w, prepared = problem(1)
    together = gptq.quantize(w, prepared, layouts(), gptq.exl2_scale)
    monkeypatch.setattr(gptq, "MAX_BATCH_ELEMENTS", K * N)
    alone = gptq.quantize(w, prepared, layouts(), gptq.exl2_scale)
    monkeypatch.undo()
    monkeypatch.setattr(gptq, "_captures", lambda device: True)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(gptq, "_graphed", lambda fn, device, pool: fn)
    wrapped = gptq.quantize(w, prepared, layouts(), gptq.exl2_scale)
    as_tuples = [(r.codes, r.weight, r.group_data) for r in together]
    assert same(alone, as_tuples) and same(wrapped, as_tuples)


def count_ops(monkeypatch, graphs: bool, k: int) -> int:
    w, prepared = problem(2, k=k, n=8)
    counter = OpCount()
    if graphs:      # as on CUDA: a captured step is one replay; its capture is counted too (once per batch)
        def graphed(fn, device, pool):
            fn()
            fn()

            def replay():
                with torch.utils._python_dispatch._disable_current_modes():
                    fn()
                counter.ops += 1
            return replay
        monkeypatch.setattr(gptq, "_captures", lambda device: True)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
        monkeypatch.setattr(gptq, "_graphed", graphed)
    with counter:
        gptq.quantize(w, prepared, layouts(k), gptq.exl2_scale)
    return counter.ops


def test_few_operations_per_row(monkeypatch):
    """Eagerly (CPU) a row of all settings costs ~8 operations plus the group-scale searches; with the block and
    scale steps captured (CUDA) under 2 per row, views included, once the captures are paid (the first version:
    ~31 a row)."""
    rows = 2048
    eager = count_ops(monkeypatch, False, rows)
    graphed = count_ops(monkeypatch, True, 2 * rows) - count_ops(monkeypatch, True, rows)   # captures cancel
    assert eager < 15 * rows
    assert graphed < 2 * rows


def test_states_file_is_a_safetensors_file(tmp_path):
    job = job_module.Job(tmp_path, {})
    states = torch.randn(3, 5, 7)
    job_module.save_states(job, "quant", 2, states)
    assert torch.equal(load_file(tmp_path / job_module.states_file("quant", 2))["states"], states)
    assert torch.equal(job_module.load_states(job, "quant", 2), states)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_give_the_eager_cuda_results(monkeypatch):
    w, prepared = problem(3, k=1024, n=200)
    w, prepared = w.cuda(), gptq.Prepared(prepared.perm.cuda(), prepared.hinv.cuda())
    lay = layouts(1024)
    graphed = gptq.quantize(w, prepared, lay, gptq.exl2_scale)
    monkeypatch.setattr(gptq, "_captures", lambda device: False)
    eager = gptq.quantize(w, prepared, lay, gptq.exl2_scale)
    assert same(graphed, [(r.codes, r.weight, r.group_data) for r in eager])
    cpu = gptq.quantize(w.cpu(), gptq.Prepared(prepared.perm.cpu(), prepared.hinv.cpu()), lay, gptq.exl2_scale)
    agree = sum(int((g.codes.cpu() == c.codes).sum()) for g, c in zip(graphed, cpu)) / (len(lay) * 1024 * 200)
    assert agree > 0.999
