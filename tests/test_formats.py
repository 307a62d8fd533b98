"""The EXL2 and GPTQ readers and format detection: the specs' worked examples, every width / group size /
act-order / zero convention through the reader, whole quantized models against transformers on the same
dequantized weights, and the formats we refuse."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from exl_backends import ExlForCausalLM, formats
from exl_backends.errors import CheckpointError, UnsupportedFormatError
from exl_backends.formats import gptq
from exl_backends.model import reference

from conftest import save_tiny, tiny_config
from quant_helpers import hf_with_weights, make_exl2, make_gptq, pack_stream, quantize_dir, rel_err

CPU = torch.device("cpu")


def write_layer(directory, key, tensors, quant_config=None, file="model.safetensors"):
    """A directory holding one layer's tensors (and optionally a quantize_config.json); returns its Checkpoint."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({f"{key}.{name}": v.contiguous() for name, v in tensors.items()}, directory / file)
    if quant_config is not None:
        (directory / "quantize_config.json").write_text(json.dumps(quant_config))
    return formats.open_checkpoint(directory)


def load_weight(ckpt, key, k, n, bias=False):
    layer = formats.load_linear(ckpt, key, k, n, bias, CPU, torch.float16)
    return layer, layer.dense_weight()


def assert_bits_equal(ours, ref):
    assert ours.dtype == ref.dtype == torch.float16 and ours.shape == ref.shape
    diff = int((ours.view(torch.int16) != ref.view(torch.int16)).sum())
    assert diff == 0, f"{diff} of {ref.numel()} fp16 values differ"


# ----------------------------------------------------------------------------------------------- worked examples

EXL2_Q_WEIGHT = """76543210 87654321 98765432 a9876543 ba987654 cba98765 dcba9876 edcba987
fedcba98 0fedcba9 10fedcba 210fedcb 3210fedc 43210fed 543210fe 6543210f
76543210 87654321 98765432 a9876543 ba987654 cba98765 dcba9876 edcba987
fedcba98 0fedcba9 10fedcba 210fedcb 3210fedc 43210fed 543210fe 6543210f
98abc398 e1cc55e1 2af0e62a 73157873 bc398abc c55e1cc5 0e62af0e 57873157
c398abc3 55e1cc55 e62af0e6 78731578 8abc398a 1cc55e1c af0e62af 31578731
abc398ab cc55e1cc f0e62af0 15787315 398abc39 5e1cc55e 62af0e62 87315787"""


def hex_words(text):
    return np.array([[int(w, 16) for w in line.split()] for line in text.splitlines()], dtype=np.uint32)


def test_exl2_worked_example(tmp_path):
    """exl2-format.md §13: K = 64, N = 8, a 4-bit and a 3-bit group, reversed permutation."""
    kp, n = np.arange(64)[:, None], np.arange(8)[None, :]
    codes4, codes3 = (kp[:32] + n) % 16, (3 * kp[:32] + n) % 8
    q_weight = np.concatenate([pack_stream(codes4, 4), pack_stream(codes3, 3)]).view(np.uint32)
    assert (q_weight == hex_words(EXL2_Q_WEIGHT)).all()
    padded = np.zeros((7, 32), dtype=np.uint32)          # columns padded to 32, as every writer does
    padded[:, :8] = q_weight
    q_scale = np.zeros((2, 4), dtype=np.uint32)
    q_scale[:, 0] = [0x76543210, 0xFEDCBA98]
    tensors = {"q_weight": torch.from_numpy(padded.view(np.int32)),
               "q_scale": torch.from_numpy(q_scale.view(np.int32)),
               "q_scale_max": torch.tensor([0.0625, 0.01], dtype=torch.float16),
               "q_groups": torch.tensor([4, 0, 3, 4], dtype=torch.int16),
               "q_invperm": torch.arange(63, -1, -1, dtype=torch.int32)}
    ckpt = write_layer(tmp_path, "x", tensors)
    _, weight = load_weight(ckpt, "x", 64, 8)
    w = weight.T.double()                                 # [K, N]: W[k, n]
    assert w[58, 2] == -0.002197265625
    assert w[21, 1] == 0.0117340087890625                 # a straddling 3-bit code and an fp16 tie
    assert (w[63, 0], w[32, 7], w[10, 3], w[0, 7]) == (-0.001953125, -0.03125, -0.011260986328125, 0.0)
    assert w.sum() == -1.6051025390625 and w.abs().sum() == 9.6080322265625
    assert w[:4, 0].tolist() == [0.00316619873046875, -0.0063323974609375, 0.00949859619140625, 0.0]


def gptq_example(v2):
    """gptq-format.md §11: 3-bit, K = N = 32, group size 16, act-order g_idx, asym."""
    k, n = np.arange(32)[:, None], np.arange(32)[None, :]
    g = np.arange(2)[:, None]
    zeros = 1 + (n + 3 * g) % 7
    scales = np.float16(0.002 + 0.001 * g + 0.0001 * n)
    return {"qweight": torch.from_numpy(pack_stream((5 * k + n) % 8, 3)),
            "qzeros": torch.from_numpy(pack_stream((zeros if v2 else zeros - 1).T, 3).T.copy()),
            "scales": torch.from_numpy(scales.astype(np.float16)),
            "g_idx": torch.from_numpy(((np.arange(32) // 2) % 2).astype(np.int32))}


@pytest.mark.parametrize("v2", [False, True])
def test_gptq_worked_example(tmp_path, v2):
    tensors = gptq_example(v2)
    qw, qz = tensors["qweight"].numpy().view(np.uint32), tensors["qzeros"].numpy().view(np.uint32)
    assert [f"{w:08x}" for w in qw[:, 0]] == ["a878cea8", "cea878ce", "78cea878"]
    assert [f"{w:08x}" for w in qw[:, 7]] == ["67543c67", "3c67543c", "543c6754"]
    assert [f"{w:08x}" for w in qw[0, :6]] == ["a878cea8", "f19d50f1", "3aa1e33a", "43c67543", "8cea878c",
                                                 "d50f19d5"]
    expected_g1 = ["f58d1fac", "347eb1a3", "fac68fd6"] if v2 else ["ac688d63", "a2358d11", "d63446b1"]
    assert [f"{w:08x}" for w in qz[1]] == expected_g1
    fmt = "gptq_v2" if v2 else "gptq"
    ckpt = write_layer(tmp_path, "x", tensors, {"bits": 3, "group_size": 16, "desc_act": True, "sym": False,
                                                "checkpoint_format": fmt})
    assert ckpt.format == "gptq" and ckpt.gptq_settings.v2 == v2
    _, weight = load_weight(ckpt, "x", 32, 32)
    w = weight.T.double()
    assert (w[10, 0], w[2, 10], w[2, 21], w[21, 7]) == (-0.006000518798828125, -0.0120086669921875,
                                                        0.0153045654296875, -0.0027008056640625)
    assert w.sum() == -2.2752761840820312


def test_gptq_4bit_symmetric_sanity(tmp_path):
    tensors = {"qweight": torch.full((4, 32), 0x76543210, dtype=torch.int32),
               "qzeros": torch.full((1, 4), 0x77777777, dtype=torch.int32),
               "scales": torch.full((1, 32), 0.5, dtype=torch.float16)}
    _, weight = load_weight(write_layer(tmp_path, "x", tensors), "x", 32, 32)
    assert weight[0, :8].tolist() == [-4.0, -3.5, -3.0, -2.5, -2.0, -1.5, -1.0, -0.5]


# ----------------------------------------------------------------------------------------------- EXL2 layers


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_rows", [32, 64, 128])
def test_exl2_single_width(tmp_path, bits, group_rows):
    """Groups of `group_rows` rows with a shorter last group; N = 40 is padded to 64 columns."""
    k, n = 224, 40
    groups = [(bits, group_rows)] * (k // group_rows) + ([(bits, k % group_rows)] if k % group_rows else [])
    layer = make_exl2(k, n, groups, np.random.default_rng(bits * group_rows))
    _, weight = load_weight(write_layer(tmp_path, "x", layer.tensors), "x", k, n)
    assert_bits_equal(weight, layer.weight)


def test_exl2_dequantization_by_runs_equals_one_group_at_a_time():
    """reference.dequant_exl2 unpacks each run of one width at once; a group ending inside a word (3 bits x 10 rows:
    30 bits, the next group on the next word) ends its run. Against the per-group unpacking, on random words."""
    gen = torch.Generator().manual_seed(11)
    q_groups = torch.tensor([4, 0, 3, 4, 3, 5, 2, 11, 2, 12], dtype=torch.int16)   # rows 32, 10, 64, 16, 8
    k, n = 130, 40
    q_weight = torch.randint(-2**31, 2**31 - 1, (13, 64), dtype=torch.int32, generator=gen)
    q_scale = torch.randint(-2**31, 2**31 - 1, (5, 8), dtype=torch.int32, generator=gen)
    q_scale_max = (torch.rand(5, generator=gen) * 0.1).half()
    q_invperm = torch.randperm(k, generator=gen).to(torch.int32)
    scales = reference.exl2_scales(q_scale, q_scale_max).float()
    rows = []
    for g, (bits, qrow, r) in enumerate(reference.exl2_groups(q_groups, k)):
        codes = reference.unpack_bits(q_weight[qrow: qrow + (r * bits + 31) // 32], bits, r)
        rows.append(((codes - 2 ** (bits - 1)).float() * scales[g]).half())
    want = torch.cat(rows)[q_invperm.long()][:, :n].T
    got = reference.dequant_exl2(q_weight, q_scale, q_scale_max, q_groups, q_invperm, n)
    assert [len(members) for *_, members in reference.exl2_runs(reference.exl2_groups(q_groups, k))] == [1, 1, 1, 2]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_exl2_every_width_in_one_matrix_with_padded_bias(tmp_path):
    k, n = 448, 72
    groups = [(8, 32), (6, 64), (6, 32), (5, 32), (4, 128), (3, 64), (2, 96)]
    layer = make_exl2(k, n, groups, np.random.default_rng(7))
    bias = torch.zeros(96, dtype=torch.float16)              # EXL2 pads the bias with out_features
    bias[:n] = torch.randn(n).half()
    ckpt = write_layer(tmp_path, "x", {**layer.tensors, "bias": bias})
    lin, weight = load_weight(ckpt, "x", k, n, bias=True)
    assert_bits_equal(weight, layer.weight)
    x = torch.randn(5, k)
    lin32 = formats.load_linear(ckpt, "x", k, n, True, CPU, torch.float32)
    ref = x @ layer.weight.float().T + bias[:n].float()
    assert torch.allclose(lin32(x), ref, rtol=1e-5, atol=1e-5)


def test_exl2_old_q_perm_is_ignored(tmp_path):
    """Older files also store q_perm; ExLlamaV2 recomputes it from q_invperm, and so do we."""
    layer = make_exl2(64, 32, [(4, 64)], np.random.default_rng(3))
    tensors = {**layer.tensors, "q_perm": torch.zeros(64, dtype=torch.int32)}   # even a wrong one
    _, weight = load_weight(write_layer(tmp_path, "x", tensors), "x", 64, 32)
    assert_bits_equal(weight, layer.weight)


# ----------------------------------------------------------------------------------------------- GPTQ layers


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_gptq_layer(tmp_path, bits, group_size):
    """Every width and group size, with and without act-order, sym and asym, v1 and v2 zeros."""
    k, n = 256, 64
    rng = np.random.default_rng(bits * 1000 + group_size)
    for act_order in (False, True):
        for sym in (True, False):
            for v2 in (False, True):
                layer = make_gptq(k, n, bits, group_size, rng, sym=sym, act_order=act_order, v2=v2)
                cfg = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order,
                       "sym": sym, "checkpoint_format": "gptq_v2" if v2 else "gptq"}
                d = tmp_path / f"{act_order}{sym}{v2}"
                _, weight = load_weight(write_layer(d, "x", layer.tensors, cfg), "x", k, n)
                assert_bits_equal(weight, layer.weight)


def test_gptq_v1_zero_point_zero_wraps_like_gptqmodel(tmp_path):
    """v1 cannot store a true zero of 0: GPTQModel's v1 writer subtracts 0x11111111 from each packed word (the
    field borrows from its neighbour) and its reader adds it back; we read it the same way."""
    zero = np.ones((1, 32), dtype=np.int64)
    zero[0, 3] = 0
    v2_words = pack_stream(zero.T, 4).T.view(np.uint32).astype(np.int64)
    v1_words = ((v2_words - 0x11111111) % 2**32).astype(np.uint32)
    q = np.tile(np.arange(32)[:, None] % 16, (1, 32))           # [K, N]: row k holds code k % 16
    tensors = {"qweight": torch.from_numpy(pack_stream(q, 4)), "qzeros": torch.from_numpy(v1_words.view(np.int32)),
               "scales": torch.full((1, 32), 0.25, dtype=torch.float16)}
    _, weight = load_weight(write_layer(tmp_path, "x", tensors), "x", 32, 32)
    assert torch.equal(weight.double(), torch.from_numpy(0.25 * (q - zero).T))


def test_gptq_scales_in_fp32_and_bf16_become_fp16(tmp_path):
    layer = make_gptq(128, 32, 4, 64, np.random.default_rng(5))
    _, w32 = load_weight(write_layer(tmp_path / "f32", "x", {**layer.tensors,
                                                           "scales": layer.tensors["scales"].float()}), "x", 128, 32)
    assert_bits_equal(w32, layer.weight)
    bf = layer.tensors["scales"].bfloat16()
    _, wbf = load_weight(write_layer(tmp_path / "bf16", "x", {**layer.tensors, "scales": bf}), "x", 128, 32)
    _, wref = load_weight(write_layer(tmp_path / "ref", "x", {**layer.tensors, "scales": bf.half()}), "x", 128, 32)
    assert_bits_equal(wbf, wref)


def test_gptq_missing_or_int64_g_idx(tmp_path):
    layer = make_gptq(256, 32, 4, 64, np.random.default_rng(6))
    no_g_idx = {k: v for k, v in layer.tensors.items() if k != "g_idx"}
    _, w = load_weight(write_layer(tmp_path / "a", "x", no_g_idx, {"bits": 4, "group_size": 64}), "x", 256, 32)
    assert_bits_equal(w, layer.weight)
    _, w = load_weight(write_layer(tmp_path / "b", "x", no_g_idx), "x", 256, 32)    # group size from shapes
    assert_bits_equal(w, layer.weight)
    as_int64 = {**layer.tensors, "g_idx": layer.tensors["g_idx"].long()}
    _, w = load_weight(write_layer(tmp_path / "c", "x", as_int64), "x", 256, 32)
    assert_bits_equal(w, layer.weight)


def test_gptq_zero_bias_is_no_bias_and_a_real_bias_is_used(tmp_path):
    layer = make_gptq(128, 32, 4, 128, np.random.default_rng(8))
    zero = write_layer(tmp_path / "zero", "x", {**layer.tensors, "bias": torch.zeros(32, dtype=torch.float16)})
    assert formats.load_linear(zero, "x", 128, 32, False, CPU, torch.float32).bias is None
    bias = torch.randn(32).half()
    real = write_layer(tmp_path / "real", "x", {**layer.tensors, "bias": bias})
    assert torch.equal(formats.load_linear(real, "x", 128, 32, False, CPU, torch.float16).bias, bias)


def test_gptq_config_disagreeing_with_shapes_names_tensor_and_file(tmp_path):
    layer = make_gptq(128, 32, 4, 64, np.random.default_rng(9))
    ckpt = write_layer(tmp_path, "blk.q", layer.tensors, {"bits": 8, "group_size": 64})
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*blk\.q\.qzeros.*4-bit.*8 bits"):
        formats.check_linear(ckpt, "blk.q", 128, 32, False)
    ckpt = write_layer(tmp_path / "g", "blk.q", layer.tensors, {"bits": 4, "group_size": 32})
    with pytest.raises(CheckpointError, match=r"blk\.q\.scales.*2 groups.*group_size 32"):
        formats.check_linear(ckpt, "blk.q", 128, 32, False)


def test_gptq_dynamic_overrides(tmp_path):
    """GPTQModel's `dynamic`: the first matching pattern wins; '-:' means not quantized (stored dense)."""
    rng = np.random.default_rng(10)
    k8 = make_gptq(128, 32, 8, 64, rng)
    q4 = make_gptq(128, 32, 4, 32, rng)
    dense = torch.randn(32, 128).half()
    cfg = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True,
           "dynamic": {r"+:.*\.k_proj": {"bits": 8, "group_size": 64}, r"-:.*\.v_proj": {},
                       r".*proj": {"bits": 2}}}
    tensors = {**{f"l.k_proj.{n}": v for n, v in k8.tensors.items()},
               **{f"l.q_proj.{n}": v for n, v in q4.tensors.items()}, "l.v_proj.weight": dense}
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": cfg}))
    ckpt = formats.open_checkpoint(tmp_path)
    s = ckpt.gptq_settings
    assert s.for_module("l.k_proj") == gptq.ModuleSettings(8, 64)
    assert s.for_module("l.v_proj") is None
    assert s.for_module("l.o_proj") == gptq.ModuleSettings(2, 32)
    assert s.for_module("lm_head") == gptq.ModuleSettings(4, 32)
    assert_bits_equal(load_weight(ckpt, "l.k_proj", 128, 32)[1], k8.weight)
    assert torch.equal(load_weight(ckpt, "l.v_proj", 128, 32)[1], dense)
    with pytest.raises(CheckpointError, match="l.q_proj.qzeros.*4-bit.*2 bits"):   # `.*proj` says 2 bits
        formats.check_linear(ckpt, "l.q_proj", 128, 32, False)


# ----------------------------------------------------------------------------------------------- whole models


def logits_close_to_dequantized_hf(ours_dir, src, expected, vocab=512):
    ids = torch.randint(0, min(vocab, 509), (1, 23), generator=torch.Generator().manual_seed(0))
    ours = ExlForCausalLM.from_pretrained(ours_dir, device="cpu")(ids).logits
    with torch.no_grad():
        ref = hf_with_weights(src, expected)(ids).logits
    assert rel_err(ours, ref) < 1e-5


@pytest.mark.parametrize("variant", ["exl2", "exl2-no-config", "exl2-odd-vocab-head"])
def test_exl2_model_equals_transformers_on_dequantized_weights(tmp_path, variant):
    """Mixed widths per layer, an fp16 layer left in place, quantized lm_head (padded when vocab % 32 != 0);
    a checkpoint without quantization_config (before ExLlamaV2 0.0.16) is found by its tensor names."""
    src = tmp_path / "hf"
    vocab = 500 if variant == "exl2-odd-vocab-head" else 512
    special = dict(pad_token_id=vocab - 1, bos_token_id=vocab - 3, eos_token_id=vocab - 2)
    save_tiny(src, tiny_config("qwen2", vocab_size=vocab, **special), dtype=torch.float16)
    qcfg = None if variant == "exl2-no-config" else {"quant_method": "exl2", "version": "0.2.7", "bits": 4.0,
                                                       "head_bits": 6}
    expected = quantize_dir(src, tmp_path / "q", "exl2", quant_config=qcfg, keep_dense=("layers.1.mlp.up_proj",),
                            head=True)
    # the converter copies the source's files, so a stale index naming other shards is common
    (tmp_path / "q" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}))
    assert formats.detect_format(tmp_path / "q") == "exl2"
    logits_close_to_dequantized_hf(tmp_path / "q", src, expected, vocab)


@pytest.mark.parametrize("where", ["quantize_config.json", "config.json"])
@pytest.mark.parametrize("opts", [dict(bits=4, group_size=32, sym=False, act_order=True),
                                  dict(bits=8, group_size=-1, sym=True, v2=True, head=True),
                                  dict(bits=3, group_size=64, sym=True)], ids=["4b-asym-act", "8b-v2-head", "3b"])
def test_gptq_model_equals_transformers_on_dequantized_weights(tmp_path, where, opts):
    """AutoGPTQ / Optimum layouts; GPTQModel's v2 zeros and `lm_head: true` (a quantized head)."""
    src = tmp_path / "hf"
    save_tiny(src, tiny_config("llama"), dtype=torch.float16)
    cfg = {"quant_method": "gptq", "bits": opts["bits"], "group_size": opts["group_size"],
           "desc_act": opts.get("act_order", False), "sym": opts["sym"], "lm_head": opts.get("head", False),
           "checkpoint_format": "gptq_v2" if opts.get("v2") else "gptq"}
    expected = quantize_dir(src, tmp_path / "q", "gptq", quant_config=cfg if where == "config.json" else None,
                            **opts)
    assert ("lm_head.weight" in expected) == opts.get("head", False)
    if where == "quantize_config.json":
        (tmp_path / "q" / where).write_text(json.dumps(cfg))
    assert formats.detect_format(tmp_path / "q") == "gptq"
    logits_close_to_dequantized_hf(tmp_path / "q", src, expected)


# ----------------------------------------------------------------------------------------------- detection


@pytest.mark.parametrize("dtype,name", [(torch.float16, "fp16"), (torch.bfloat16, "bf16"),
                                        (torch.float32, "fp32")])
def test_detects_dense_dtype(tmp_path, dtype, name):
    save_tiny(tmp_path, tiny_config("llama"), dtype=dtype)
    assert formats.detect_format(tmp_path) == name


def test_detects_gptq_from_tensor_names_alone(tmp_path):
    layer = make_gptq(128, 32, 4, 64, np.random.default_rng(11))
    ckpt = write_layer(tmp_path, "x", layer.tensors)
    assert ckpt.format == "gptq" and not ckpt.gptq_settings.v2
    assert_bits_equal(load_weight(ckpt, "x", 128, 32)[1], layer.weight)


def dir_with(tmp_path, tensors, config=None, files=()):
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config or {}))
    for name, text in files:
        (tmp_path / name).write_text(text)
    return tmp_path


W = {"model.layers.0.mlp.up_proj.weight": torch.zeros(32, 64, dtype=torch.float16)}


@pytest.mark.parametrize("config,files,match", [
    ({"quantization_config": {"quant_method": "awq", "bits": 4, "version": "gemm"}}, (), "AWQ"),
    ({}, [("quant_config.json", '{"w_bit": 4, "q_group_size": 128, "zero_point": true, "version": "GEMM"}')],
     "AWQ"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}, (), "FP8"),
    ({"quantization_config": {"quant_method": "exl3", "bits": 4.0}}, (), "EXL3"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}}, (), "marlin"),
    ({}, [("quantize_config.json", '{"bits": 4, "group_size": 128, "is_marlin_format": true}')], "marlin"),
    ({"quantization_config": {"quant_method": "marlin"}}, (), "marlin"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 5}}, (), "bits = 5"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "pack_dtype": "int16"}}, (), "pack_dtype"),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}, (), "bitsandbytes"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "checkpoint_format": "bitblas"}}, (), "bitblas"),
], ids=["awq", "autoawq-file", "fp8", "exl3", "gptq-marlin", "is-marlin", "marlin", "gptq-5bit",
        "pack-int16", "bnb", "bitblas"])
def test_refused_formats_say_what_is_supported(tmp_path, config, files, match):
    d = dir_with(tmp_path, W, config, files)
    with pytest.raises(UnsupportedFormatError, match=match) as e:
        formats.detect_format(d)
    assert "Supported" in str(e.value) or "supported" in str(e.value)


@pytest.mark.parametrize("tensors,match", [
    ({"a.weight": torch.zeros(4, 4).to(torch.float8_e4m3fn)}, "FP8"),
    ({"a.trellis": torch.zeros(2, 2, 64, dtype=torch.int16), "a.suh": torch.ones(32).half()}, "EXL3"),
    ({"a.qweight": torch.zeros(64, 4, dtype=torch.int32), "a.qzeros": torch.zeros(1, 4, dtype=torch.int32),
      "a.scales": torch.zeros(1, 32).half()}, "AWQ"),
], ids=["fp8-dtype", "exl3-trellis", "awq-layout"])
def test_refused_formats_found_by_tensors(tmp_path, tensors, match):
    with pytest.raises(UnsupportedFormatError, match=match):
        formats.detect_format(dir_with(tmp_path, tensors))


def test_gguf_points_at_import_gguf(tmp_path):
    (tmp_path / "model-Q4_K_M.gguf").write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(UnsupportedFormatError, match="exl import-gguf .*model-Q4_K_M.gguf"):
        formats.detect_format(tmp_path)
    with pytest.raises(UnsupportedFormatError, match="exl import-gguf"):
        formats.detect_format(tmp_path / "model-Q4_K_M.gguf")


def test_from_pretrained_refuses_awq_before_loading(tmp_path):
    save_tiny(tmp_path, tiny_config("llama"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedFormatError, match="AWQ.*Supported: .*EXL2.*GPTQ"):
        ExlForCausalLM.from_pretrained(tmp_path, device="cpu")


def test_header_only_read_for_detection(tmp_path):
    """Detection reads headers and JSON, never tensor data: a file whose data is garbage still detects."""
    header = json.dumps({"x.q_weight": {"dtype": "I32", "shape": [8, 32], "data_offsets": [0, 1024]}}).encode()
    (tmp_path / "output.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\xff" * 1024)
    assert formats.detect_format(tmp_path) == "exl2"
    assert load_file(tmp_path / "output.safetensors")["x.q_weight"].shape == (8, 32)
