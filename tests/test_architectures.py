"""The architectures beyond Llama (Gemma 2/3, Phi-3, Qwen3, Mixtral, Qwen3-MoE, and sliding windows in
Mistral/Qwen2) against transformers in f32: prefill past the sliding window, 16 decode steps through the paged
cache, greedy generation; EXL2 and GPTQ directories of each against transformers on the same dequantized
weights; the config rules that decide windows, ropes and expert layers; and the refusals."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from exl_backends import ExlForCausalLM
from exl_backends.errors import CheckpointError, ConfigError, DeviceError, UnsupportedArchitectureError
from exl_backends.model import model as model_module, reference
from exl_backends.model.batch import Batch, SeqChunk
from exl_backends.model.cache import KVCache
from exl_backends.model.config import ARCHITECTURES, ModelConfig
from exl_backends.model.ops import REFERENCE_OPS

import test_model
from conftest import REPO, TOKENIZER_DIR, tiny_config
from test_model import DECODE, PREFILL, assert_close     # 37 + 16 tokens, |diff| <= 1e-4 max |logit|
from quant_helpers import exl2_groups, make_exl2, make_gptq, rel_err

WINDOW = 8                     # sliding window of the tiny models: the test sequences run far past it
SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0]          # longrope factors (head_dim 16 -> 8 frequencies)
LONG = [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0]
LOCAL_GLOBAL = ["sliding_attention", "full_attention"]

VARIANTS = {
    "mistral-window": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2-window": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen3": ("qwen3", {}),
    "qwen3-window": ("qwen3", dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=LOCAL_GLOBAL)),
    "gemma2": ("gemma2", dict(sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=0.5,
                              final_logit_softcapping=1.5)),
    "gemma3": ("gemma3", dict(sliding_window=WINDOW, layer_types=LOCAL_GLOBAL, query_pre_attn_scalar=24,
                              final_logit_softcapping=1.5,
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "phi3": ("phi3", dict(sliding_window=WINDOW)),
    "phi3-longrope": ("phi3", dict(original_max_position_embeddings=32,
                                   rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                    "short_factor": SHORT, "long_factor": LONG})),
    "mixtral": ("mixtral", dict(sliding_window=WINDOW)),
    "qwen3-moe": ("qwen3_moe", dict(norm_topk_prob=True)),
    "qwen3-moe-dense-layer": ("qwen3_moe", dict(norm_topk_prob=False, mlp_only_layers=[1])),
}
ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
        "phi3": "Phi3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def decisive_ids(directory, shape: tuple[int, ...], seed: int = 7, min_gap: float = 1e-3) -> torch.Tensor:
    """Random token ids of `shape` (from seed on) on which every routing decision of the f32 CPU model has a clear
    margin: the k-th chosen expert's probability at least min_gap above the next one's. Near a tie, an fp16 model
    may rightly route a token to another expert, which moves its logits far; a kernel test needs clear choices.
    Models without experts take the first seed's ids."""
    config = ModelConfig.from_dir(directory)
    lm = ExlForCausalLM.from_pretrained(directory, device="cpu") if config.moe else None
    route = reference.route
    for s in range(seed, seed + 100):
        ids = torch.randint(0, 509, shape, generator=torch.Generator().manual_seed(s))
        if lm is None:
            return ids
        gaps = []

        def spy(logits, top_k, renormalize):
            p = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True).values
            gaps.append((p[:, top_k - 1] - p[:, top_k]).min().item())
            return route(logits, top_k, renormalize)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(reference, "route", spy)
            lm(ids.view(-1, shape[-1]))
        if min(gaps) >= min_gap:
            return ids
    raise AssertionError(f"no seed in {seed}..{seed + 99} routes every token clearly")


def build(directory, name, dtype=torch.float32):
    """The variant's random model, saved to directory with the fixtures' tokenizer; returns transformers' model
    (f32). Weights wider than the default init, and every norm weight near its identity (1, or 0 where the
    architecture scales by 1 + w), so that each sub-layer moves the logits (tiny norm weights would make
    the tests blind to attention details)."""
    from transformers import AutoModelForCausalLM
    family, overrides = VARIANTS[name]
    torch.manual_seed(sum(map(ord, name)))
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).eval()
    identity = 1.0 - ARCHITECTURES[type(model).__name__].norm_offset
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif "norm" in param_name:
                p.normal_(identity, 0.1)
            else:
                p.normal_(0, 0.05)
    model.to(dtype).save_pretrained(directory)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / file, directory / file)
    return model.float()


@pytest.fixture(params=list(VARIANTS))
def variant(request, tmp_path):
    hf = build(tmp_path, request.param)
    return ExlForCausalLM.from_pretrained(tmp_path, device="cpu"), hf


# ----------------------------------------------------------------------------------------------- against transformers


def test_prefill_logits_equal_transformers(variant):
    ours, hf = variant
    ids = torch.randint(0, 509, (2, PREFILL), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    assert_close(ours(ids).logits, ref)


def test_incremental_decode_equals_transformers(variant):
    """37 tokens prefilled, then 16 one at a time through non-contiguous cache pages: 53 positions, far past
    the window of 8, so every windowed layer masks keys that are still in the cache."""
    ours, hf = variant
    ids = torch.randint(0, 509, (PREFILL + DECODE,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    page = 16
    cache = KVCache(ours.exl_config, n_pages=8, page_size=page, device="cpu", dtype=torch.float32)
    pages = [5, 2, 7, 0]
    step = ours.model.forward(Batch.build([SeqChunk(ids[:PREFILL].tolist(), 0, pages)], page, all_logits=True),
                              cache)
    assert_close(step, ref[:PREFILL])
    for t in range(PREFILL, PREFILL + DECODE):
        logits = ours.model.forward(Batch.build([SeqChunk([int(ids[t])], t, pages)], page), cache)
        assert_close(logits[0], ref[t])


def test_greedy_generate_equals_transformers(variant):
    ours, hf = variant
    prompt = torch.randint(0, 509, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=511)
    out = ours.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=511)
    assert out.tolist() == ref.tolist()


def test_readme_lists_exactly_the_tested_architectures():
    """README's "What it runs" names every row of the traits table, and each has a variant here or in
    test_model.py (which covers Llama, Mistral and Qwen2 the same way)."""
    section = (REPO / "README.md").read_text().split("## What it runs")[1].split("\n## ")[0]
    listed = set(re.findall(r"`(\w+ForCausalLM)`", section))
    tested = {ARCH[family] for family, _ in [*VARIANTS.values(), *test_model.VARIANTS.values()]}
    assert listed == tested == set(ARCHITECTURES)


# ----------------------------------------------------------------------------------------------- quantized checkpoints


def split_fused(tensors: dict, config: ModelConfig) -> dict:
    """Phi-3's fused qkv_proj / gate_up_proj split into q/k/v and gate/up, as EXL2 files store them."""
    n, hd, out = config.traits.names, config.head_dim, dict(tensors)
    for i in range(config.n_layers):
        layer = n.layer.format(i=i)
        for fused, parts, sizes in ((n.qkv, (n.q, n.k, n.v), [config.n_heads * hd] + [config.n_kv_heads * hd] * 2),
                                    (n.gate_up, (n.gate, n.up), [config.intermediate_size] * 2)):
            if fused and f"{layer}.{fused}.weight" in out:
                for part, w in zip(parts, out.pop(f"{layer}.{fused}.weight").split(sizes)):
                    out[f"{layer}.{part}.weight"] = w.contiguous()
    return out


def fuse_back(tensors: dict, config: ModelConfig) -> dict:
    """The inverse of split_fused, for transformers' Phi-3 (which only knows the fused tensors)."""
    n, out = config.traits.names, dict(tensors)
    for i in range(config.n_layers):
        layer = n.layer.format(i=i)
        for fused, parts in ((n.qkv, (n.q, n.k, n.v)), (n.gate_up, (n.gate, n.up))):
            if fused and f"{layer}.{parts[0]}.weight" in out:
                out[f"{layer}.{fused}.weight"] = torch.cat([out.pop(f"{layer}.{p}.weight") for p in parts])
    return out


def quantized_copy(src, dst, fmt: str, split: bool = True) -> dict:
    """dst: src with every decoder linear and lm_head quantized (round-to-nearest codes of the source weights;
    EXL2 with mixed widths). Returns the expected dequantized fp16 weights by tensor name."""
    config = ModelConfig.from_dir(src)
    tensors = load_file(src / "model.safetensors")
    tensors = split_fused(tensors, config) if split else tensors
    keys = [key for key, *_ in model_module.linears(config, None if split else tensors)]
    keys = [k for k in keys if not k.endswith(("block_sparse_moe.gate", "mlp.gate"))] + ["lm_head"]  # routers fp16
    rng, expected = np.random.default_rng(0), {}
    if "lm_head.weight" not in tensors:                         # tied: EXL2 still writes a quantized head
        tensors["lm_head.weight"] = tensors[f"{config.traits.names.embed}.weight"]
    for i, key in enumerate(keys):
        w = tensors.pop(f"{key}.weight").float().numpy()
        n, k = w.shape
        layer = make_exl2(k, n, exl2_groups(k, i), rng, weight=w) if fmt == "exl2" else \
            make_gptq(k, n, 4, 32, rng, sym=False, act_order=True, weight=w)
        tensors.update({f"{key}.{name}": v for name, v in layer.tensors.items()})
        expected[f"{key}.weight"] = layer.weight
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "exl2", "bits": 4.0, "head_bits": 6} if fmt == "exl2" else \
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False}
    (dst / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return expected


def dequantized_reference(src, dst, expected: dict):
    """transformers' f32 model of src with the expected dequantized weights in place (head untied)."""
    from transformers import AutoModelForCausalLM
    config = ModelConfig.from_dir(src)
    tensors = {k: v.float() for k, v in load_file(src / "model.safetensors").items()}
    tensors = fuse_back({**split_fused(tensors, config), **{k: v.float() for k, v in expected.items()}}, config)
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(tie_word_embeddings=False, dtype="float32")
    (dst / "config.json").write_text(json.dumps(cfg))
    return AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", ["mistral-window", "gemma2", "gemma3", "phi3", "qwen3", "mixtral",
                                  "qwen3-moe-dense-layer"])
@pytest.mark.parametrize("fmt", ["exl2", "gptq"])
def test_quantized_checkpoint_equals_transformers_on_dequantized_weights(tmp_path, name, fmt):
    """Experts as block_sparse_moe.experts.{e}.w1/w3/w2 (Mixtral) or mlp.experts.{e}.*_proj (Qwen3-MoE), the
    router left fp16; Phi-3 EXL2 split into q/k/v and gate/up; Gemma's head quantized although tied."""
    if name == "phi3" and fmt == "gptq":
        pytest.skip("fused quantized projections are refused (test_quantized_fused_projection_is_refused)")
    build(tmp_path / "src", name, dtype=torch.float16)
    expected = quantized_copy(tmp_path / "src", tmp_path / "q", fmt)
    ids = torch.randint(0, 509, (1, PREFILL), generator=torch.Generator().manual_seed(4))
    ours = ExlForCausalLM.from_pretrained(tmp_path / "q", device="cpu")(ids).logits
    with torch.no_grad():
        ref = dequantized_reference(tmp_path / "src", tmp_path / "ref", expected)(ids).logits
    assert rel_err(ours, ref) < 1e-5


def test_quantized_fused_projection_is_refused(tmp_path):
    build(tmp_path / "src", "phi3", dtype=torch.float16)
    quantized_copy(tmp_path / "src", tmp_path / "q", "gptq", split=False)
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.qkv_proj.*quantized fused.*EXL2"):
        ExlForCausalLM.from_pretrained(tmp_path / "q", device="cpu")


# ----------------------------------------------------------------------------------------------- reference ops


def test_sliding_window_attention_masks_old_keys():
    """A query at p sees keys p-window+1 .. p: equal to full attention over just those keys."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(20, h, 8, generator=gen) for h in (4, 2, 2))
    positions = torch.arange(20)
    out = reference.attention(q, k, v, positions, 0.3, window=5)
    for p in (0, 3, 4, 5, 12, 19):
        lo = max(0, p - 4)
        alone = reference.attention(q[p:p + 1], k[lo:p + 1], v[lo:p + 1], torch.tensor([p - lo]), 0.3)
        torch.testing.assert_close(out[p], alone[0])
    assert not torch.allclose(out[12], reference.attention(q, k, v, positions, 0.3)[12])


def test_attention_softcap_caps_scores_before_the_mask():
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(6, 2, 8, generator=gen) * 3 for _ in range(3))
    positions = torch.arange(6)
    cap = 0.7
    scores = torch.einsum("qhd,khd->hqk", q, k) * 0.5
    scores = (torch.tanh(scores / cap) * cap).masked_fill(torch.ones(6, 6).triu(1).bool(), float("-inf"))
    expect = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    torch.testing.assert_close(reference.attention(q, k, v, positions, 0.5, softcap=cap), expect)


def test_route_takes_top_k_of_the_softmax():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.9]])
    weights, experts = reference.route(logits, 2, renormalize=False)
    probs = logits.softmax(-1)
    assert experts.tolist() == [[1, 2], [0, 3]]
    torch.testing.assert_close(weights, probs.gather(1, experts))
    renormed, _ = reference.route(logits, 2, renormalize=True)
    torch.testing.assert_close(renormed.sum(-1), torch.ones(2))


# ----------------------------------------------------------------------------------------------- config rules


def config_of(family, **overrides):
    return ModelConfig.from_dict(tiny_config(family, **overrides).to_dict() | {"architectures": [ARCH[family]]})


def raw_config(family, **changes):
    raw = tiny_config(family).to_dict() | {"architectures": [ARCH[family]]}
    raw.pop("layer_types", None)                 # as in configs written before transformers 4.53
    if "rope_scaling" in changes or "rope_theta" in changes:
        raw.pop("rope_parameters")               # as in configs written before transformers 5
    return ModelConfig.from_dict(raw | changes)


def test_layer_windows_follow_transformers_rules():
    six = dict(num_hidden_layers=6, sliding_window=WINDOW)
    assert raw_config("mistral", **six).layer_windows == (WINDOW,) * 6
    assert raw_config("gemma2", **six).layer_windows == (WINDOW, None) * 3                  # alternating
    assert raw_config("gemma3", **six).layer_windows == (WINDOW,) * 5 + (None,)              # 5 local : 1 global
    assert raw_config("gemma3", **six, sliding_window_pattern=3).layer_windows == (WINDOW, WINDOW, None) * 2
    assert raw_config("qwen2", **six).layer_windows == (None,) * 6                           # use_sliding_window off
    assert raw_config("qwen2", **six, use_sliding_window=True, max_window_layers=4).layer_windows == \
        (None,) * 4 + (WINDOW,) * 2
    assert raw_config("qwen3_moe", **six, use_sliding_window=True).layer_windows == (WINDOW,) * 6
    assert raw_config("llama", **six).layer_windows == (None,) * 6
    with pytest.raises(ConfigError, match="layer_types"):
        raw_config("gemma3", **six, layer_types=["sliding_attention"] * 5)


def test_gemma3_ropes_from_either_config_layout():
    new = config_of("gemma3", rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    old = raw_config("gemma3", rope_theta=1e6, rope_local_base_freq=1e4,
                     rope_scaling={"rope_type": "linear", "factor": 8.0})
    for c in (new, old):
        assert (c.rope.theta, c.rope.type, c.rope.factor) == (1e6, "linear", 8.0)
        assert (c.local_rope.theta, c.local_rope.type) == (1e4, "default")


def test_moe_layers_and_renormalisation():
    c = config_of("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert c.moe.layers == (False, True, False, False)
    assert (c.moe.n_experts, c.moe.top_k, c.moe.intermediate_size, c.moe.renormalize) == (4, 2, 32, False)
    assert config_of("mixtral").moe.renormalize


def test_longrope_reads_su_and_checks_factor_lengths():
    c = raw_config("phi3", rope_scaling={"type": "su", "short_factor": SHORT, "long_factor": LONG},
                   original_max_position_embeddings=32, max_position_embeddings=512)
    assert c.rope.type == "longrope"
    assert c.rope.cos_sin_scale() == pytest.approx((1 + np.log(16) / np.log(32)) ** 0.5)
    with pytest.raises(ConfigError, match="short_factor and long_factor of head_dim / 2 = 8"):
        raw_config("phi3", rope_scaling={"type": "longrope", "short_factor": SHORT[:4], "long_factor": LONG})


def test_longrope_factors_are_chosen_per_sequence_of_a_packed_batch():
    """A sequence past original_max_position_embeddings (32) takes the long factors for all its tokens of the
    pass; one still within it, packed in the same batch, keeps the short ones."""
    config = raw_config("phi3", rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
                        original_max_position_embeddings=32)
    rope = model_module.Rope(config.rope, config.head_dim, torch.device("cpu"))
    batch = Batch.build([SeqChunk(list(range(5)), 20, [0, 1]), SeqChunk(list(range(6)), 30, [2, 3])], 32)
    cos, sin = rope.cos_sin(batch.positions, model_module.token_seq_lens(batch), REFERENCE_OPS, torch.float32)
    for rows, inv_freq in ((slice(0, 5), config.rope.inv_freq(16)), (slice(5, 11), config.rope.long_inv_freq(16))):
        expect = reference.rope_cos_sin(batch.positions[rows], inv_freq, config.rope.cos_sin_scale(), torch.float32)
        torch.testing.assert_close((cos[rows], sin[rows]), expect)


def test_multimodal_gemma3_is_refused_with_what_to_use():
    with pytest.raises(UnsupportedArchitectureError, match="Gemma3ForConditionalGeneration.*Gemma3ForCausalLM"):
        raw_config("gemma3", architectures=["Gemma3ForConditionalGeneration"])


def test_bidirectional_gemma3_is_refused():
    with pytest.raises(ConfigError, match="use_bidirectional_attention"):
        raw_config("gemma3", use_bidirectional_attention=True)


# ----------------------------------------------------------------------------------------------- devices


@pytest.mark.parametrize("name,missing", [
    ("gemma2", ["GELU-tanh", "final logit soft-capping", "sliding-window attention (window 8 in layers 0;",
                "attention logit soft-capping"]),
    ("mixtral", ["mixture-of-experts", "sliding-window attention (window 8 in layers 0-1;"]),
    ("qwen3", [])])
def test_an_ops_bundle_without_an_op_is_refused_naming_it(name, missing):
    """As the CUDA bundle is until its kernels cover these traits: refused when the model is built."""
    family, overrides = VARIANTS[name]
    config = config_of(family, **overrides)
    bare = dataclasses.replace(REFERENCE_OPS, gelu_tanh_mul=None, softcap=None, moe=None,
                               attention_options=frozenset())
    assert len(model_module.missing_ops(config, bare)) == len(missing)
    if not missing:
        model_module.check_ops(config, bare, torch.device("cuda"))
        return
    with pytest.raises(DeviceError, match=".*".join(map(re.escape, missing)) + ".*device='cpu'"):
        model_module.check_ops(config, bare, torch.device("cuda"))


def cuda_ready() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_ready(), reason="needs CUDA and CuPy")
@pytest.mark.parametrize("name", list(VARIANTS))
def test_gpu_logits_match_the_cpu_reference_or_are_refused(tmp_path, name):
    """fp16 on the GPU against the f32 CPU reference; an architecture whose traits the CUDA ops do not cover
    yet is refused at load with a DeviceError naming them."""
    from exl_backends.model.ops import ops_for
    build(tmp_path, name, dtype=torch.float16)
    config = ModelConfig.from_dir(tmp_path)
    if model_module.missing_ops(config, ops_for(torch.device("cuda"))):
        with pytest.raises(DeviceError, match="cannot run on cuda"):
            ExlForCausalLM.from_pretrained(tmp_path, device="cuda")
        return
    ids = decisive_ids(tmp_path, (2, PREFILL + DECODE))
    cpu = ExlForCausalLM.from_pretrained(tmp_path, device="cpu")(ids).logits
    gpu = ExlForCausalLM.from_pretrained(tmp_path, device="cuda")(ids.cuda()).logits.cpu()
    assert rel_err(gpu, cpu) < 2.5e-3
