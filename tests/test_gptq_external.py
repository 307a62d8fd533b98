"""GPTQ checkpoints made by a tool nobody on this project wrote: AutoGPTQ 0.7.1 (its last release), installed with
`pip install auto-gptq==0.7.1 --no-deps`. Its GPTQ algorithm quantizes, its `QuantLinear.pack()` writes qweight /
qzeros / scales / g_idx, and its torch dequantization (the path its QuantLinear takes without CUDA) is the
reference our reader must equal bit for bit. Then a whole model it quantized runs end to end on CPU.

AutoGPTQ's package __init__ no longer imports under transformers 5, so its self-contained modules
(quantization/{gptq,quantizer}.py, nn_modules/qlinear/qlinear_cuda{,_old}.py) are imported under a stub parent
package; its CUDA extensions do not load here, which is what selects the torch path."""
from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from exl_backends import ExlForCausalLM, formats

from conftest import save_tiny, tiny_config
from quant_helpers import LINEARS, hf_with_weights, rel_err

K, N = 256, 96


@pytest.fixture(scope="module")
def auto_gptq():
    spec = importlib.util.find_spec("auto_gptq")
    if spec is None:
        pytest.skip("AutoGPTQ is not installed: pip install auto-gptq==0.7.1 --no-deps")
    saved = {name: m for name, m in sys.modules.items() if name.split(".")[0] == "auto_gptq"}
    stub = types.ModuleType("auto_gptq")
    stub.__path__ = list(spec.submodule_search_locations)
    sys.modules["auto_gptq"] = stub
    try:
        yield SimpleNamespace(
            GPTQ=importlib.import_module("auto_gptq.quantization").GPTQ,
            QuantLinear=importlib.import_module("auto_gptq.nn_modules.qlinear.qlinear_cuda").QuantLinear,
            QuantLinearOld=importlib.import_module("auto_gptq.nn_modules.qlinear.qlinear_cuda_old").QuantLinear)
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] == "auto_gptq"]:
            del sys.modules[name]
        sys.modules.update(saved)


@pytest.fixture
def no_cuda_sync(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)   # fasterquant calls it unconditionally


def gptq_quantize(ag, linear: torch.nn.Linear, inputs: list[torch.Tensor], bits: int, group_size: int, sym: bool,
                  act_order: bool):
    """AutoGPTQ's pipeline for one layer: Hessian from the inputs, fasterquant, pack. Returns its QuantLinear."""
    g = ag.GPTQ(linear)
    g.quantizer.configure(bits, perchannel=True, sym=sym, mse=False)
    for x in inputs:
        g.add_batch(x, None)
    scale, zero, g_idx = g.fasterquant(percdamp=0.01, group_size=group_size, actorder=act_order)
    assert (zero >= 1).all(), "a true zero of 0 is stored ambiguously by AutoGPTQ's v1 writer (see gptq-format.md)"
    q = ag.QuantLinear(bits, group_size, linear.in_features, linear.out_features, bias=linear.bias is not None)
    q.pack(linear.cpu(), scale.cpu(), zero.cpu(), g_idx.cpu())
    return q


def autogptq_dequant(q) -> torch.Tensor:
    """AutoGPTQ's own dequantized weight [N, K] fp16: its torch forward on the identity (exact: one term/output)."""
    with torch.no_grad():
        return q(torch.eye(q.infeatures, dtype=torch.float16)).T.contiguous()


def tensors_of(q, key: str) -> dict[str, torch.Tensor]:
    out = {f"{key}.{n}": getattr(q, n).contiguous() for n in ("qweight", "qzeros", "scales", "g_idx")}
    if q.bias is not None:
        out[f"{key}.bias"] = q.bias
    return out


def autogptq_config(bits, group_size, sym, act_order):
    """quantize_config.json as AutoGPTQ 0.7.1 saves it."""
    return {"bits": bits, "group_size": group_size, "damp_percent": 0.01, "desc_act": act_order,
            "static_groups": False, "sym": sym, "true_sequential": True, "model_name_or_path": None,
            "model_file_base_name": "model", "quant_method": "gptq", "checkpoint_format": "gptq"}


@pytest.mark.parametrize("bits,group_size,sym,act_order", [
    (4, 128, True, False), (4, 128, True, True), (8, 128, True, True), (3, 128, True, False),
    (4, 64, False, True), (2, 32, False, False), (8, -1, False, False)],
    ids=["4b-g128", "4b-g128-act", "8b-g128-act", "3b-g128", "4b-g64-asym-act", "2b-g32-asym", "8b-nogroup-asym"])
def test_reader_equals_autogptq_dequant(tmp_path, auto_gptq, no_cuda_sync, bits, group_size, sym, act_order):
    torch.manual_seed(bits * 100 + group_size)
    linear = torch.nn.Linear(K, N, bias=False).half()
    with torch.no_grad():
        linear.weight.normal_(0, 0.05)
    channel_scale = torch.rand(K) * 3 + 0.1              # uneven activations, so act-order reorders
    inputs = [torch.randn(64, K) * channel_scale for _ in range(4)]
    q = gptq_quantize(auto_gptq, linear, inputs, bits, group_size, sym, act_order)
    save_file(tensors_of(q, "layer"), tmp_path / "model.safetensors")
    (tmp_path / "quantize_config.json").write_text(json.dumps(autogptq_config(bits, group_size, sym, act_order)))
    ckpt = formats.open_checkpoint(tmp_path)
    ours = formats.load_linear(ckpt, "layer", K, N, False, torch.device("cpu"), torch.float16).dense_weight()
    ref = autogptq_dequant(q)
    assert int((ours.view(torch.int16) != ref.view(torch.int16)).sum()) == 0
    if not act_order:      # AutoGPTQ's older kernel path reads groups as consecutive rows and wraps zeros
        old = auto_gptq.QuantLinearOld(bits, group_size, K, N, bias=False)
        old.load_state_dict(q.state_dict())
        assert torch.equal(autogptq_dequant(old).view(torch.int16), ours.view(torch.int16))


def quantize_model(ag, src, dst, bits, group_size, sym, act_order):
    """AutoGPTQ over every decoder linear of src (Hessians from the model's own activations on random tokens),
    written as AutoGPTQ lays out a checkpoint. Returns AutoGPTQ's dequantized weights by HF name."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float16).eval()
    linears = {name: m for name, m in model.named_modules() if name.endswith(LINEARS)}
    inputs = {name: [] for name in linears}
    hooks = [m.register_forward_hook(lambda m, i, o, name=name: inputs[name].append(i[0].reshape(-1, i[0].shape[-1]).float()))
             for name, m in linears.items()]
    ids = torch.randint(0, 509, (8, 64), generator=torch.Generator().manual_seed(0))   # 512 rows: full-rank Hessians
    with torch.no_grad():
        model.float()(ids)
        model.half()
    for h in hooks:
        h.remove()
    tensors = {k: v for k, v in model.state_dict().items() if k.rsplit(".", 1)[0] not in linears}
    dequantized = {}
    for name, m in linears.items():
        q = gptq_quantize(ag, m, inputs[name], bits, group_size, sym, act_order)
        tensors.update(tensors_of(q, name))
        dequantized[f"{name}.weight"] = autogptq_dequant(q)
    dst.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors")
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    (dst / "quantize_config.json").write_text(json.dumps(autogptq_config(bits, group_size, sym, act_order)))
    return dequantized


def rtn_weights(ag, src, bits: int, group_size: int) -> dict[str, torch.Tensor]:
    """The same linears rounded to nearest with AutoGPTQ's own quantizer (same grid, no Hessian): the baseline
    GPTQ must beat."""
    from transformers import AutoModelForCausalLM
    from auto_gptq.quantization.quantizer import Quantizer, quantize
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float16)
    out = {}
    for name, m in model.named_modules():
        if name.endswith(LINEARS):
            w = m.weight.float()
            q = Quantizer()
            q.configure(bits, perchannel=True, sym=True, mse=False)
            groups = []
            for g in w.split(group_size, dim=1):
                q.find_params(g, weight=True)
                groups.append(quantize(g, q.scale, q.zero, q.maxq))
            out[f"{name}.weight"] = torch.cat(groups, dim=1).half()
    return out


@pytest.mark.parametrize("bits", [8, 4])
def test_autogptq_model_runs_end_to_end_on_cpu(tmp_path, auto_gptq, no_cuda_sync, bits):
    """Logits of the GPTQ model equal transformers on AutoGPTQ's own dequantized weights, and are closer to the
    fp16 model than round-to-nearest on the same grid. A random model's activations are nearly isotropic, so the
    Hessians help little: measured relative L2 8 bits GPTQ 0.0193 / RTN 0.0198, 4 bits 0.313 / 0.330 (deterministic
    seeds). A wrong g_idx or permutation would lose to RTN by far."""
    src = tmp_path / "hf"
    config = tiny_config("llama", hidden_size=128, intermediate_size=256)
    save_tiny(src, config, dtype=torch.float16)
    dequantized = quantize_model(auto_gptq, src, tmp_path / "gptq", bits, 32, True, True)
    assert formats.detect_format(tmp_path / "gptq") == "gptq"
    ours = ExlForCausalLM.from_pretrained(tmp_path / "gptq", device="cpu")
    ids = torch.randint(0, 509, (2, 40), generator=torch.Generator().manual_seed(1))
    logits = ours(ids).logits
    with torch.no_grad():
        same_weights = hf_with_weights(src, dequantized)(ids).logits
        original = hf_with_weights(src, {})(ids).logits
        rtn = hf_with_weights(src, rtn_weights(auto_gptq, src, bits, 32))(ids).logits
    assert rel_err(logits, same_weights) < 1e-5
    err, rtn_err = rel_err(logits, original), rel_err(rtn, original)
    assert err < rtn_err, f"{bits}-bit: relative L2 vs the fp16 model: GPTQ {err:.3g}, round-to-nearest {rtn_err:.3g}"
