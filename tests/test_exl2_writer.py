"""EXL2 writer: the spec's worked example word for word, a repack of ExLlamaV2's own files bit for bit, and
write -> read -> identical dequantized weights at many bit mixes (exl2-format.md §3-§8, §13)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from exl_backends import formats
from exl_backends.convert.gptq import Prepared, exl2_scale, quantize
from exl_backends.convert.qparams import ATTN_CANDIDATES, HEAD_OPTIONS, MLP_CANDIDATES, QParams
from exl_backends.convert.quantize import pack_exl2
from exl_backends.model import reference
from exl_backends.formats.exl2_writer import (exl2_config, linear_tensors, matrix_bits, pack_linear, save_tensors,
                                              shard_names, write_shards)
from exl_backends.formats.tensors import TensorStore

from conftest import FIXTURES
from quant_helpers import pack_stream


def _hex(words: torch.Tensor) -> list[list[str]]:
    return [[f"{int(w) & 0xFFFFFFFF:08x}" for w in row] for row in words]


def test_worked_example_of_the_spec():
    """§13: K = 64, N = 8, a 4-bit and a 3-bit group, reversed permutation."""
    k, n = 64, 8
    codes = torch.zeros(k, n, dtype=torch.int64)
    for r in range(32):
        codes[r] = (r + torch.arange(n)) % 16
        codes[32 + r] = (3 * r + torch.arange(n)) % 8
    qs = torch.stack([torch.arange(n) + 1, torch.arange(n) + 9])
    scale_max = torch.tensor([0.0625, 0.01], dtype=torch.float16)
    perm = torch.arange(k - 1, -1, -1)
    w = pack_linear(codes, [(4, 32), (3, 32)], qs, scale_max, perm, n)
    # The spec's toy layer has N = 8; a real writer pads to 32 columns, whose extra words the spec does not list.
    assert w.q_weight.shape == (7, 32) and w.q_scale.shape == (2, 4)
    assert _hex(w.q_weight[:, :8]) == [
        "76543210 87654321 98765432 a9876543 ba987654 cba98765 dcba9876 edcba987".split(),
        "fedcba98 0fedcba9 10fedcba 210fedcb 3210fedc 43210fed 543210fe 6543210f".split(),
        "76543210 87654321 98765432 a9876543 ba987654 cba98765 dcba9876 edcba987".split(),
        "fedcba98 0fedcba9 10fedcba 210fedcb 3210fedc 43210fed 543210fe 6543210f".split(),
        "98abc398 e1cc55e1 2af0e62a 73157873 bc398abc c55e1cc5 0e62af0e 57873157".split(),
        "c398abc3 55e1cc55 e62af0e6 78731578 8abc398a 1cc55e1c af0e62af 31578731".split(),
        "abc398ab cc55e1cc f0e62af0 15787315 398abc39 5e1cc55e 62af0e62 87315787".split()]
    assert _hex(w.q_scale[:, :1]) == [["76543210"], ["fedcba98"]]
    assert w.q_groups.tolist() == [4, 0, 3, 4] and w.q_groups.dtype == torch.int16
    assert w.q_scale_max.view(torch.int16).tolist() == [0x2c00, 0x211f]
    assert w.q_invperm.tolist() == list(range(63, -1, -1)) and w.q_invperm.dtype == torch.int32
    weight = w.dequantize().float()                                             # [N, K] HF layout
    assert weight.sum().item() == pytest.approx(-1.6051025390625, abs=1e-9)
    assert weight.abs().sum().item() == pytest.approx(9.6080322265625, abs=1e-9)
    assert weight[1, 21].item() == 0.0117340087890625 and weight[2, 58].item() == -0.002197265625


@pytest.mark.parametrize("variant", ["llama_tiny_exl2_2.5bpw_h6", "llama_tiny_exl2_6.0bpw_h8"])
def test_repacking_exllamav2_files_gives_the_same_words(variant):
    """Unpack every linear ExLlamaV2 wrote (codes, scale codes, permutation) and pack it again: identical."""
    tensors = load_file(FIXTURES / "exl2" / variant / "output.safetensors")
    assert len([n for n in tensors if n.endswith(".q_weight")]) == 15
    for key in ("model.layers.1.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "model.layers.0.mlp.down_proj",
                "lm_head"):
        t = {name: tensors[f"{key}.{name}"] for name in ("q_weight", "q_scale", "q_scale_max", "q_groups",
                                                         "q_invperm")}
        k, np_ = t["q_invperm"].shape[0], t["q_weight"].shape[1]
        groups = reference.exl2_groups(t["q_groups"], k)
        codes = torch.cat([reference.unpack_bits(t["q_weight"][q0: q0 + rows * b // 32], b, rows)
                           for b, q0, rows in groups])
        qs = reference.unpack_bits(t["q_scale"].T.contiguous(), 4, np_).T + 1
        w = pack_linear(codes, [(b, rows) for b, _, rows in groups], qs, t["q_scale_max"],
                        torch.argsort(t["q_invperm"].long()), np_)
        for name, ref in t.items():
            assert torch.equal(w.tensors()[name], ref), f"{key}.{name}"


def _independent_dequant(codes, groups, qs, scale_max, perm, n):
    """W[perm[k'], n] = fp16((code - z) * fp16(qs^2 * fp16(q_scale_max * 2^-8))) in numpy fp16 arithmetic."""
    out = np.zeros((codes.shape[0], n), dtype=np.float16)
    row = 0
    for g, (bits, rows) in enumerate(groups):
        m = np.float16(np.float32(np.float16(scale_max[g])) * np.float32(2.0 ** -8))
        scale = (qs[g].astype(np.float32) ** 2 * np.float32(m)).astype(np.float16)
        out[row: row + rows] = ((codes[row: row + rows] - 2 ** (bits - 1)).astype(np.float32)
                                * scale.astype(np.float32)).astype(np.float16)
        row += rows
    w = np.empty_like(out)
    w[perm] = out
    return torch.from_numpy(w.T.copy())


MIXES = sorted({qp for c in ATTN_CANDIDATES + MLP_CANDIDATES for qp in c} | set(HEAD_OPTIONS.values()),
               key=QParams.desc)


@pytest.mark.parametrize("qp", MIXES[::3], ids=QParams.desc)
@pytest.mark.parametrize("k,n", [(256, 96), (416, 40)])
def test_write_read_round_trip(tmp_path, qp, k, n):
    """Random codes, scales (some deep in the fp16 subnormal range) and permutation under a candidate's group
    layout: written, read back through the loader, dequantized to exactly the numpy-computed weights."""
    rng = np.random.default_rng(k + n)
    groups = qp.groups(k)
    codes = np.concatenate([rng.integers(0, 2 ** b, (rows, n)) for b, rows in groups])
    qs = rng.integers(1, 17, (len(groups), n))
    scale_max = np.float16(rng.choice([0.3, 0.02, 7e-4], len(groups)) * rng.uniform(0.5, 2, len(groups)))
    perm = rng.permutation(k)
    w = pack_linear(torch.from_numpy(codes), groups, torch.from_numpy(qs), torch.from_numpy(scale_max),
                    torch.from_numpy(perm), n)
    bias = torch.randn(n, dtype=torch.float16)
    save_tensors(linear_tensors("layer", w, bias), tmp_path / "output.safetensors")
    store = TensorStore(tmp_path)
    assert store.info("layer.bias").shape == ((n + 31) // 32 * 32,)
    got = formats.exl2.load(store, "layer", k, n)
    expected = _independent_dequant(codes, groups, qs, scale_max, perm, n)
    assert torch.equal(got.dequantize(), expected)
    # q_weight words against the test-side packer (independent bit-stream construction)
    padded = np.full((k, (n + 31) // 32 * 32), 0)
    padded[:, :n] = codes
    row, words = 0, []
    for b, rows in groups:
        padded[row: row + rows, n:] = 2 ** (b - 1)
        words.append(pack_stream(padded[row: row + rows], b))
        row += rows
    assert np.array_equal(w.q_weight.numpy(), np.concatenate(words))
    assert matrix_bits(linear_tensors("x", w)) == qp.total_bits(k, (n + 31) // 32 * 32)


@pytest.mark.parametrize("qp", [ATTN_CANDIDATES[1][2], MLP_CANDIDATES[4][2], HEAD_OPTIONS[6], MLP_CANDIDATES[16][0]],
                         ids=QParams.desc)
def test_quantized_layers_pack_to_exactly_their_fake_quantized_weights(qp):
    """What the converter relies on: GPTQ's dequantized fp16 weights == the packed layer's dequantization."""
    torch.manual_seed(0)
    k, n = 160, 48
    weight = torch.randn(n, k) * 0.05
    x = torch.randn(256, k) * torch.linspace(0.2, 3, k)
    h = x.T @ x / 256
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True)
    hp = h[perm][:, perm] + 0.12 * torch.diagonal(h).mean() * torch.eye(k)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hp)), upper=True)
    q = quantize(weight, Prepared(perm, hinv), [qp.groups(k)], exl2_scale)[0]
    packed = pack_exl2(q, n)
    assert torch.equal(packed.dequantize(), q.weight)
    assert 0 < (q.weight.float() - weight).norm() / weight.norm() < 0.5


def test_bad_group_layouts_are_refused():
    codes = torch.zeros(64, 32, dtype=torch.int64)
    qs, sm, perm = torch.ones(2, 32, dtype=torch.int64), torch.ones(2, dtype=torch.float16), torch.arange(64)
    with pytest.raises(ValueError, match="non-increasing"):
        pack_linear(codes, [(3, 32), (4, 32)], qs, sm, perm, 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_linear(codes, [(4, 48), (4, 16)], qs, sm, perm, 32)
    with pytest.raises(ValueError, match="fit 2 bits"):
        pack_linear(codes + 5, [(2, 32), (2, 32)], qs, sm, perm, 32)


def test_config_has_the_quantization_config_of_exllamav2_and_top_level_rope():
    fixture = json.loads((FIXTURES / "exl2" / "llama_tiny_exl2_4.0bpw_h6" / "config.json").read_text())
    source = {"architectures": ["LlamaForCausalLM"],
              "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
              "quantization_config": {"quant_method": "gptq"}}
    cfg = exl2_config(source, 4.0, 6, 32, 512, "valid.txt", "0.1.0")
    ours, theirs = cfg["quantization_config"], fixture["quantization_config"]
    assert ours.keys() == theirs.keys() and ours["calibration"].keys() == theirs["calibration"].keys()
    assert all(type(ours[k]) is type(theirs[k]) for k in ours)
    assert cfg["rope_theta"] == 100000.0 and "rope_scaling" not in cfg and cfg["rope_parameters"]
    llama3 = {"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 32.0}}
    assert exl2_config(llama3, 4.0, 6, 1, 16, "x", "v")["rope_scaling"] == {"rope_type": "llama3", "factor": 32.0}


def test_shards_are_named_like_exllamav2_and_read_back(tmp_path):
    tensors = {f"t{i}": torch.full((256,), i, dtype=torch.int32) for i in range(5)}
    entries = [(name, t.numel() * 4, lambda t=t: t) for name, t in tensors.items()]
    files = write_shards(tmp_path, entries, max_bytes=2048)
    assert files == shard_names(3) == [f"output-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == files
    store = TensorStore(tmp_path)
    assert all(torch.equal(store.get(name), t) for name, t in tensors.items())
    assert write_shards(tmp_path / ".." / tmp_path.name, entries[:1]) == ["output.safetensors"]
    assert math.prod(store.info("t0").shape) == 256
