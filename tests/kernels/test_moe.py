"""kernels.moe.moe (MoE on CUDA: device routing, expert-indexed quantized matmuls) against reference.moe in f32 on
the CPU, with the same router logits and the same packed experts (EXL2 with mixed widths and act-order, expert
layouts differing within a layer, and GPTQ): 1 token (the one-row kernel), 3 and 37 tokens (passes of 16 rows),
200 tokens (experts one by one); replay in a CUDA graph; the dense-expert path on CPU."""
import pytest
import torch
from kernel_testing import on_gpu, poison_allocator

from exl_backends.formats.synthetic import random_exl2, random_gptq
from exl_backends.model import reference
from exl_backends.model.config import Activation
from exl_backends.model.linear import Linear, QuantLinear
from exl_backends.model.mlp import Experts, Mlp
from exl_backends.model.ops import REFERENCE_OPS, ops_for

# (hidden, expert intermediate, experts, top_k, renormalize): Mixtral-like and Qwen3-MoE-like, odd chunk counts
SHAPES = {"mixtral": (320, 736, 8, 2, True), "qwen3_moe": (256, 96, 16, 4, False)}
MIXES = ["0.05:8b_32g/0.95:4b_128g", "0.1:5b_32g/0.9:3b_128g"]     # two expert layouts in one layer


def weights(fmt: str, k: int, n: int, seed: int):
    if fmt == "exl2":
        return random_exl2(k, n, MIXES[seed % 2], seed=seed)
    return random_gptq(k, n, 4, 32, act_order=True, sym=False, seed=seed)


def experts_pair(fmt: str, d: int, inter: int, n_experts: int, activation=Activation.SILU):
    """The same packed experts twice: on the CPU (reference) and on CUDA (kernels)."""
    cpu, gpu = [], []
    for e in range(n_experts):
        ws = [weights(fmt, d, inter, 3 * e), weights(fmt, d, inter, 3 * e + 1), weights(fmt, inter, d, 3 * e + 2)]
        cpu.append(Mlp(*(QuantLinear(w) for w in ws), activation))
        gpu.append(Mlp(*(QuantLinear(w.to(torch.device("cuda"))) for w in ws), activation))
    return cpu, gpu


def inputs(tokens: int, d: int, n_experts: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, d, generator=g) + 0.1).half()
    logits = (torch.randn(tokens, n_experts, generator=g) * 2).half()
    return x, logits


def run_both(cpu, gpu, kernel, x, logits, top_k, renormalize):
    from exl_backends.kernels import activation, moe
    ref = reference.moe(x.float(), logits.float(), Experts(cpu, REFERENCE_OPS, None), top_k, renormalize)
    poison_allocator()
    ours = moe.moe(x.cuda(), logits.cuda(), Experts(gpu, ops_for(torch.device("cuda")), kernel), top_k, renormalize)
    return ours, ref


def assert_moe_close(ours, ref):
    assert ours.dtype == torch.float16 and ours.shape == ref.shape and torch.isfinite(ours).all()
    err = ((ours.float().cpu() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert err < 4e-3, f"worst token's relative error {err:.3g}"       # fp16 activations through two matmuls


@on_gpu
@pytest.mark.parametrize("fmt", ["exl2", "gptq"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 3, 37, 200])
def test_moe_matches_reference(fmt, shape, tokens):
    from exl_backends.kernels import activation, moe
    d, inter, n_experts, top_k, renormalize = SHAPES[shape]
    cpu, gpu = experts_pair(fmt, d, inter, n_experts)
    kernel = moe.prepare(gpu, activation.silu_mul, top_k)
    assert kernel is not None
    x, logits = inputs(tokens, d, n_experts, seed=tokens)
    assert_moe_close(*run_both(cpu, gpu, kernel, x, logits, top_k, renormalize))


@on_gpu
def test_moe_gelu_experts_and_unrouted_experts():
    """GELU-tanh experts; every token routed to the same two experts (the others must not be read or added)."""
    from exl_backends.kernels import activation, moe
    d, inter, n_experts, top_k, renormalize = SHAPES["mixtral"]
    cpu, gpu = experts_pair("exl2", d, inter, n_experts, Activation.GELU_TANH)
    kernel = moe.prepare(gpu, activation.gelu_tanh_mul, top_k)
    x, logits = inputs(21, d, n_experts, seed=4)
    logits[:, 5] += 20
    logits[:, 2] += 19
    assert_moe_close(*run_both(cpu, gpu, kernel, x, logits, top_k, renormalize))


@on_gpu
@pytest.mark.parametrize("tokens", [1, 3])
def test_moe_replays_in_a_cuda_graph(tokens):
    """Captured once; replayed with new tokens and new routing: the expert choice is read on the device only."""
    from exl_backends.kernels import activation, moe
    d, inter, n_experts, top_k, renormalize = SHAPES["mixtral"]
    cpu, gpu = experts_pair("exl2", d, inter, n_experts)
    experts = Experts(gpu, ops_for(torch.device("cuda")), moe.prepare(gpu, activation.silu_mul, top_k))
    x, logits = (t.cuda() for t in inputs(tokens, d, n_experts, seed=10))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe.moe(x, logits, experts, top_k, renormalize)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.moe(x, logits, experts, top_k, renormalize)
    for seed in (11, 12, 13):
        new_x, new_logits = inputs(tokens, d, n_experts, seed=seed)
        x.copy_(new_x)
        logits.copy_(new_logits)
        out.fill_(float("nan"))
        graph.replay()
        ref = reference.moe(new_x.float(), new_logits.float(), Experts(cpu, REFERENCE_OPS, None), top_k, renormalize)
        assert_moe_close(out, ref)


@on_gpu
def test_dense_experts_have_no_kernel_and_match_reference():
    """fp16 experts (no expert-indexed kernel): few tokens run every expert, weighted by zero where not routed."""
    from exl_backends.kernels import activation, moe
    d, inter, n_experts, top_k = 64, 96, 4, 2
    g = torch.Generator().manual_seed(3)
    mats = [[torch.randn(n, k, generator=g) * 0.1 for k, n in ((d, inter), (d, inter), (inter, d))]
            for _ in range(n_experts)]
    cpu = [Mlp(*(Linear(w) for w in ws)) for ws in mats]
    gpu = [Mlp(*(Linear(w.half().cuda()) for w in ws)) for ws in mats]
    assert moe.prepare(gpu, activation.silu_mul, top_k) is None
    x, logits = inputs(5, d, n_experts, seed=8)
    ref = reference.moe(x.float(), logits.float(), Experts(cpu, REFERENCE_OPS, None), top_k, True)
    ours = moe.moe(x.cuda(), logits.cuda(), Experts(gpu, ops_for(torch.device("cuda")), None), top_k, True)
    assert_moe_close(ours, ref)


def test_all_experts_path_equals_reference_on_cpu():
    """moe._all_experts (plain torch, so it runs here) against reference.moe: zero weights add nothing."""
    from exl_backends.kernels import moe
    g = torch.Generator().manual_seed(2)
    mlps = [Mlp(*(Linear(torch.randn(n, k, generator=g) * 0.2) for k, n in ((16, 24), (16, 24), (24, 16))))
            for _ in range(5)]
    experts = Experts(mlps, REFERENCE_OPS, None)
    x, logits = torch.randn(7, 16, generator=g), torch.randn(7, 5, generator=g)
    weights, selected = reference.route(logits, 2, False)
    torch.testing.assert_close(moe._all_experts(x, weights, selected, experts),
                               reference.moe(x, logits, experts, 2, False))


def test_experts_sequence_gives_bound_experts():
    g = torch.Generator().manual_seed(1)
    mlps = [Mlp(*(Linear(torch.randn(8, 8, generator=g)) for _ in range(3))) for _ in range(3)]
    experts = Experts(mlps, REFERENCE_OPS, None)
    x = torch.randn(2, 8, generator=g)
    assert len(experts) == 3 and experts.kernel is None
    torch.testing.assert_close(experts[1](x), mlps[1](x, REFERENCE_OPS))
    assert [f(x).shape for f in experts] == [(2, 8)] * 3
