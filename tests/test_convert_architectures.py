"""`exl convert` on every architecture beyond Llama/Mistral/Qwen2 (tiny random models, CPU): the EXL2 output is
detected as EXL2, hits 4.0 bpw, loads in the engine and tracks the fp16 model; its tensors are named and laid
out as ExLlamaV2 writes them (MoE experts and fp16 routers, Phi-3 split, Gemma's norms as in the source); the
converter's layer-by-layer forward is the engine's (its receipt equals the engine's KL on the same rows); MoE
experts get Hessians from their routed tokens only, and an expert that no token reaches still quantizes
sanely; GPTQ output where the runtime can load it."""
from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from exl_backends import ExlForCausalLM, formats
from exl_backends.commands.evaluate import Scores, score
from exl_backends.convert import forward, gptq, measure
from exl_backends.convert.job import Job
from exl_backends.convert.pipeline import ConvertOptions, convert, written_bpw
from exl_backends.convert.qparams import distinct
from exl_backends.errors import UnsupportedArchitectureError
from exl_backends.formats.tensors import TensorStore
from exl_backends.model import reference
from exl_backends.model.config import ARCHITECTURES, ModelConfig

from conftest import TOKENIZER_DIR, tiny_config
from test_convert import calibration_text

ROWS, LENGTH = 4, 64
WINDOW = 16                    # shorter than the calibration rows, so windowed layers mask keys
LOCAL_GLOBAL = ["sliding_attention", "full_attention"]
SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0]           # Phi-3 longrope factors (head_dim 16)
LONG = [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0]

VARIANTS = {
    "qwen3": dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=LOCAL_GLOBAL),
    "gemma2": dict(sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0),
    "gemma3": dict(sliding_window=WINDOW, layer_types=LOCAL_GLOBAL, query_pre_attn_scalar=24,
                   final_logit_softcapping=3.0, tie_word_embeddings=True,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    # rows of 64 tokens run past original_max_position_embeddings: calibration takes the long factors
    "phi3": dict(sliding_window=WINDOW, original_max_position_embeddings=32,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": SHORT,
                                  "long_factor": LONG}),
    "mixtral": dict(sliding_window=WINDOW),
    # experts as wide as the dense MLPs: 32-wide ones cannot reach 4.0 bpw (q_invperm alone costs 32/N bits)
    "qwen3_moe": dict(norm_topk_prob=True, moe_intermediate_size=128, mlp_only_layers=[1]),
}
# (relative L2 error of the logits vs the fp16 model, top-1 agreement) bounds on the held-out rows. Measured at
# 4.0 bpw (EXL2; GPTQ 4-bit g32 is 5.07 bpw and no worse): qwen3 0.117 / 0.808, gemma2 0.218 / 0.669,
# gemma3 0.229 / 0.986, phi3 0.107 / 0.833, mixtral 0.068 / 0.871, qwen3_moe 0.085 / 0.885. Bounds: 1.5x the
# error, top-1 0.1 lower. A wrong norm offset, window, rope or routing gives errors near 1.
BOUNDS = {"qwen3": (0.18, 0.70), "gemma2": (0.33, 0.57), "gemma3": (0.34, 0.88), "phi3": (0.16, 0.73),
          "mixtral": (0.10, 0.77), "qwen3_moe": (0.13, 0.78)}


def build(directory: Path, family: str, **changes) -> Path:
    """The family's tiny random model in fp16 with the fixtures' tokenizer, weights drawn like test_convert's
    (linears N(0, 0.05²), embeddings and head N(0, 0.2²): peaked next-token distributions, so quantization
    error shows in them), norm weights near their identity (1, or 0 where the architecture scales by 1 + w)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(sum(map(ord, family)))
    model = AutoModelForCausalLM.from_config(tiny_config(family, **{**VARIANTS[family], **changes})).eval()
    identity = 1.0 - ARCHITECTURES[type(model).__name__].norm_offset
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(identity, 0.05)
            else:
                p.normal_(0, 0.2 if "embed" in name or "lm_head" in name else 0.05)
    model.half().save_pretrained(directory)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (directory / file).write_bytes((TOKENIZER_DIR / file).read_bytes())
    return directory


def options(src: Path, out: Path, cal: Path, **kw) -> ConvertOptions:
    return ConvertOptions(src, out, kw.pop("bits", 4.0), calibration=str(cal), rows=ROWS, length=LENGTH,
                          device="cpu", **kw)


@pytest.fixture(scope="module")
def cal(tmp_path_factory):
    return calibration_text(tmp_path_factory.mktemp("cal") / "cal.txt")


@pytest.fixture(scope="module", params=list(VARIANTS))
def converted(request, cal, tmp_path_factory):
    """(family, fp16 source dir, EXL2 4.0 bpw output dir)."""
    base = tmp_path_factory.mktemp(request.param)
    src = build(base / "src", request.param)
    return request.param, src, convert(options(src, base / "q", cal))


def held_out(out: Path) -> torch.Tensor:
    return Job(Path(f"{out}.job"), {}).load_tensors("calibration.safetensors")["eval"]


def engine_scores(out: Path, src: Path, rows: torch.Tensor) -> tuple[Scores, float]:
    """The engine's KL/top-1 of out against src on each row, and the relative L2 error of all their logits."""
    ours, ref = (ExlForCausalLM.from_pretrained(d, device="cpu") for d in (out, src))
    total, diff, norm = Scores(), 0.0, 0.0
    for row in rows:
        got, want = ours(row[None]).logits[0], ref(row[None]).logits[0]
        total.add(score(got[:-1], row[1:], want[:-1]))
        diff, norm = diff + float((got - want).pow(2).sum()), norm + float(want.pow(2).sum())
    return total, (diff / norm) ** 0.5


def test_exl2_output_loads_on_target_and_tracks_fp16(converted):
    family, src, out = converted
    assert formats.detect_format(out) == "exl2"
    quality = json.loads((out / "quality.json").read_text())
    assert abs(quality["bpw"] - 4.0) <= 0.02
    assert quality["bpw"] == pytest.approx(written_bpw(TensorStore(out), ModelConfig.from_dir(out)))
    scores, rel_l2 = engine_scores(out, src, held_out(out))
    max_rel_l2, min_top1 = BOUNDS[family]
    assert rel_l2 < max_rel_l2 and scores.top1_agreement > min_top1, (family, rel_l2, scores.top1_agreement)
    # the converter's layer-by-layer forward computes what the engine computes, for this architecture too
    assert quality["kl_divergence"] == pytest.approx(scores.mean_kl, rel=1e-3)
    assert quality["perplexity_fp16"] == pytest.approx(scores.ref_perplexity, rel=1e-4)


# quantized module keys of layer 0 / 1 and the fp16 tensors beside them, per family (exl2-format.md §9)
ATTN = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
MLP = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
NORMS = ["input_layernorm", "post_attention_layernorm"]
GEMMA_NORMS = NORMS + ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
QK_NORMS = ["self_attn.q_norm", "self_attn.k_norm"]
MIXTRAL_EXPERTS = [f"block_sparse_moe.experts.{e}.{w}" for e in range(4) for w in ("w1", "w2", "w3")]
QWEN3_EXPERTS = [f"mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
LAYOUT = {   # family: (quantized per layer (layer 0, layer 1), fp16 per layer)
    "qwen3": ((ATTN + MLP,) * 2, NORMS + QK_NORMS),
    "gemma2": ((ATTN + MLP,) * 2, GEMMA_NORMS),
    "gemma3": ((ATTN + MLP,) * 2, GEMMA_NORMS + QK_NORMS),
    "phi3": ((ATTN + MLP,) * 2, NORMS),
    "mixtral": ((ATTN + MIXTRAL_EXPERTS,) * 2, NORMS + ["block_sparse_moe.gate"]),
    "qwen3_moe": ((ATTN + QWEN3_EXPERTS + ["mlp.gate"], ATTN + MLP), NORMS + QK_NORMS),
}
Q_SUFFIXES = ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")


def test_tensor_names_and_fp16_tensors_are_exllamav2s(converted):
    family, src, out = converted
    quantized, dense = LAYOUT[family]
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {f"lm_head.{s}" for s in Q_SUFFIXES}
    for i, keys in enumerate(quantized):
        for key in keys:
            if key == "mlp.gate":              # Qwen3-MoE's router sits among the quantized keys: fp16
                expected.add(f"model.layers.{i}.{key}.weight")
            else:
                expected |= {f"model.layers.{i}.{key}.{s}" for s in Q_SUFFIXES}
        expected |= {f"model.layers.{i}.{name}.weight" for name in dense}
    written = safe_open(str(out / "output.safetensors"), "pt")
    assert set(written.keys()) == expected                  # Phi-3: no qkv_proj / gate_up_proj; Gemma 3: lm_head
    source = load_file(src / "model.safetensors")
    for name in expected - {n for n in expected if n.rsplit(".", 1)[1] in Q_SUFFIXES}:
        # embeddings, norms (Gemma's without the +1) and routers: fp16, exactly as in the source
        assert written.get_tensor(name).dtype == torch.float16 and torch.equal(written.get_tensor(name),
                                                                               source[name]), name
    q = "model.layers.0.self_attn.q_proj"                   # split from Phi-3's qkv_proj: K 64, N 4 heads x 16
    assert (written.get_slice(f"{q}.q_invperm").get_shape(), written.get_slice(f"{q}.q_weight").get_shape()[1]) == \
        ([64], 64)
    last = sorted(n for n in expected if n.endswith(".q_weight"))[-1].removesuffix(".q_weight")   # an expert, for MoE
    assert [written.get_tensor(f"{last}.{s}").dtype for s in Q_SUFFIXES] == \
        [torch.int32, torch.int32, torch.float16, torch.int16, torch.int32]


def test_moe_measurement_entries_name_the_expert_projections(converted):
    family, _, out = converted
    if family not in ("mixtral", "qwen3_moe"):
        pytest.skip("MoE only")
    layers = json.loads((out / "measurement.json").read_text())["measurement"]
    key, roles = {"mixtral": ("model.layers.0.block_sparse_moe", {"w1", "w3", "w2"}),
                  "qwen3_moe": ("model.layers.0.mlp", {"gate_proj", "up_proj", "down_proj"})}[family]
    assert len(layers[key]) == 17 and roles <= set(layers[key][0])
    # a candidate's bits are its settings over every expert (4 of them) and nothing for the fp16 router
    sub = forward.sublayers(ModelConfig.from_dir(out), 0)[1]
    assert sub.key == key and len(sub.roles[0].linears) == 4
    assert layers[key][0]["total_bits"] == 4 * sum(qp.total_bits(k, n) for qp, (k, n) in zip(
        sub.candidates[0], [(64, 128), (64, 128), (128, 64)]))


# ----------------------------------------------------------------------------------------------- MoE Hessians


def mixtral_moe_layer(tmp_path):
    """A tiny Mixtral's config, a CPU forward context, its layer 0 loaded and that layer's MoE sub-layer."""
    src = build(tmp_path / "src", "mixtral")
    config = ModelConfig.from_dir(src)
    ctx = forward.Context.build(config, 32, torch.device("cpu"))
    layer = forward.load_layer(formats.open_checkpoint(src), config, 0, torch.device("cpu"))
    return config, ctx, layer, forward.sublayers(config, 0)[1]


def test_expert_hessians_see_only_their_routed_tokens(tmp_path):
    """Each expert's gate/up Hessian counts exactly the tokens the router sends it, and equals the sum of
    x^T x over those tokens of the MoE input (the router's input)."""
    config, ctx, layer, mlp = mixtral_moe_layer(tmp_path)
    states = torch.randn(2, 32, config.hidden_size, generator=torch.Generator().manual_seed(0))
    hessians = forward.input_hessians(mlp, layer, ctx.device)
    forward.run(mlp, states, layer, ctx, hessians)
    router = "model.layers.0.block_sparse_moe.gate"
    x = reference.rmsnorm(states.reshape(-1, config.hidden_size), layer.block.post_attn_norm, config.rms_norm_eps)
    _, selected = reference.route(reference.linear(x, layer.linears[router].weight), 2, True)
    counts = [hessians[f"model.layers.0.block_sparse_moe.experts.{e}.w1"].tokens for e in range(4)]
    assert counts == [int((selected == e).sum()) for e in range(4)] and sum(counts) == 2 * 64
    assert hessians[router].tokens == 64
    e0 = x[(selected == 0).any(-1)]
    torch.testing.assert_close(hessians["model.layers.0.block_sparse_moe.experts.0.w1"].sum, e0.T @ e0)


def test_moe_measurement_holds_one_experts_trial_weights_and_gives_the_whole_layer_errors(tmp_path, monkeypatch):
    """The MoE measurement quantizes and runs the experts one at a time: the fake-quantized trial weights alive
    at once peak at one expert's (counted as they are made and freed), every expert's are made, and the
    accuracies are exactly those of running the whole sub-layer with every expert's trial weights in place
    (the measurement before the experts were taken one by one). Three rows in chunks of two, so the
    accumulation spans chunks."""
    config, ctx, layer, mlp = mixtral_moe_layer(tmp_path)
    states = torch.randn(3, 32, config.hidden_size, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(forward, "CHUNK_TOKENS", 64)
    live, peak, made = [0], [0], [0]

    def counting_quantize(*args):
        results = gptq.quantize(*args)
        for r in results:
            live[0] += r.weight.nbytes
            made[0] += r.weight.nbytes
            weakref.finalize(r.weight, lambda n=r.weight.nbytes: live.__setitem__(0, live[0] - n))
        peak[0] = max(peak[0], live[0])
        return results

    monkeypatch.setattr(measure, "quantize", counting_quantize)
    entries, y = measure.measure_sublayer(mlp, states, layer, ctx)
    one_expert = sum(len(distinct(mlp.candidates, pos)) * k * n * 2
                     for pos, (_, k, n, _) in enumerate(role.linears[0] for role in mlp.roles))
    assert (peak[0], made[0], live[0]) == (one_expert, 4 * one_expert, 0)

    monkeypatch.undo()
    hessians = forward.input_hessians(mlp, layer, ctx.device)
    y_ref = forward.run(mlp, states, layer, ctx, hessians)
    whole = measure._errors(mlp, states, y_ref, layer, ctx, measure.trial_weights(mlp, layer, hessians))
    assert torch.equal(y, y_ref)
    assert [e["accuracy"] for e in entries] == [max(1e-6, 1.0 - err) for err in whole]
    assert len(set(whole)) > 10 and 0 < min(whole)     # candidates differ (some coincide at K 64, e.g. g64 vs g128)


def test_an_expert_no_token_reaches_still_quantizes_sanely(tmp_path, cal):
    """Top-1 routing with expert 3's router row the mean of experts 0 and 1: its logit never beats both of theirs,
    so no calibration token reaches it. Its gate/up are quantized with the H of all tokens entering the block,
    its down projection with the identity (round-to-nearest, so no act-order: q_invperm is 0..K-1); its
    weights come out about as close to the source as the routed experts'."""
    src = build(tmp_path / "src", "mixtral", num_experts_per_tok=1)
    tensors = load_file(src / "model.safetensors")
    for i in range(2):
        gate = tensors[f"model.layers.{i}.block_sparse_moe.gate.weight"]
        gate[3] = ((gate[0].float() + gate[1].float()) / 2).half()
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    out = convert(options(src, tmp_path / "q", cal))
    ckpt = formats.open_checkpoint(out)
    errors = {}
    for e in range(4):
        for w, (k, n) in (("w1", (64, 128)), ("w2", (128, 64))):
            key = f"model.layers.0.block_sparse_moe.experts.{e}.{w}"
            q = formats.load_linear(ckpt, key, k, n, False, torch.device("cpu"), torch.float32).dense_weight()
            source = tensors[f"{key}.weight"].float()
            errors[e, w] = float((q.float() - source).norm() / source.norm())
        invperm = ckpt.store.get(f"model.layers.0.block_sparse_moe.experts.{e}.w2.q_invperm")
        assert torch.equal(invperm, torch.arange(128, dtype=torch.int32)) == (e == 3)
    # measured: routed experts 0.27 (w1) / 0.21 (w2), the unrouted one 0.25 / 0.17
    for w in ("w1", "w2"):
        assert errors[3, w] < 1.25 * max(errors[e, w] for e in range(3)) < 0.35, errors
    scores, rel_l2 = engine_scores(out, src, held_out(out))
    assert rel_l2 < 0.15 and scores.top1_agreement > 0.77, (rel_l2, scores.top1_agreement)   # measured 0.103 / 0.869


# ----------------------------------------------------------------------------------------------- GPTQ


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "mixtral", "qwen3_moe"])
def test_gptq_output(tmp_path, cal, family):
    src = build(tmp_path / "src", family)
    out = convert(options(src, tmp_path / "g", cal, bits=4, format="gptq", group_size=32))
    assert formats.detect_format(out) == "gptq"
    store = TensorStore(out)
    expert = {"mixtral": "block_sparse_moe.experts.2.w2", "qwen3_moe": "mlp.experts.2.down_proj"}.get(family,
                                                                                                    "mlp.down_proj")
    assert f"model.layers.0.{expert}.qweight" in store and f"model.layers.0.{expert}.weight" not in store
    router = {"mixtral": "block_sparse_moe.gate", "qwen3_moe": "mlp.gate"}.get(family)
    if router:
        assert store.info(f"model.layers.0.{router}.weight").dtype == torch.float16
        assert f"model.layers.0.{router}.qweight" not in store
    quality = json.loads((out / "quality.json").read_text())
    scores, rel_l2 = engine_scores(out, src, held_out(out))
    max_rel_l2, min_top1 = BOUNDS[family]
    assert rel_l2 < max_rel_l2 and scores.top1_agreement > min_top1, (family, rel_l2, scores.top1_agreement)
    assert quality["kl_divergence"] == pytest.approx(scores.mean_kl, rel=1e-3)


def test_phi3_gptq_is_refused_with_what_to_do(tmp_path, cal):
    src = build(tmp_path / "src", "phi3")
    with pytest.raises(UnsupportedArchitectureError, match="qkv_proj.*--format exl2"):
        convert(options(src, tmp_path / "g", cal, bits=4, format="gptq"))
    assert not (tmp_path / "g").exists() and not (tmp_path / "g.job").exists()
