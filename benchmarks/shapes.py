"""Synthetic models in the real EXL2 layout, built directly on the GPU (random packed words are valid codes of
any width, so no CPU packing is needed). Decode speed does not depend on the weights' values. write_exl2_dir puts
one on disk as an EXL2 model directory (load-time measurements)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from exl_backends.errors import ExlError
from exl_backends.formats.exl2 import Exl2Weight, padded
from exl_backends.formats.exl2_writer import exl2_config, linear_tensors, save_tensors, write_json
from exl_backends.model.attention import Attention
from exl_backends.model.config import ModelConfig
from exl_backends.model.linear import QuantLinear
from exl_backends.model.linear import Linear
from exl_backends.model.mlp import Mlp, MoeMlp
from exl_backends.model.model import Block, Model

SHAPES = {   # Llama-3 family layer shapes
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "llama-3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
}


def config_for(shape: str, max_position_embeddings: int = 131072) -> ModelConfig:
    raw = dict(SHAPES[shape], architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5, rope_theta=500000.0,
               max_position_embeddings=max_position_embeddings)
    return ModelConfig.from_dict(raw)


def random_exl2(k: int, n: int, mix: list[tuple[float, int, int]], device, gen: torch.Generator) -> Exl2Weight:
    """mix: [(proportion, bits, group_size)] in non-increasing bits, as the converter splits rows (spec §3)."""
    groups, remaining = [], k
    for prop, bits, gs in mix:
        rows = min(round(k * prop), remaining) if prop < 1 else remaining
        count = -(-rows // gs)
        for _ in range(count):
            take = min(gs, remaining)
            if take > 0:
                groups.append((bits, take))
                remaining -= take
    if remaining:
        groups.append((mix[-1][1], remaining))
    np_ = padded(n)
    q_groups, qrow = [], 0
    for bits, rows in groups:
        q_groups += [bits, qrow]
        qrow += rows * bits // 32
    g = len(groups)

    def words(*shape):
        return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, device=device, generator=gen)
    # group maxima for weights of RMS ~0.5/sqrt(k) at any width (a code's offset has RMS 2^(b-1)/sqrt(3), a random
    # 4-bit scale's square ~0.45), so each linear halves its input's size and a deep random model's residual stream
    # stays well inside fp16 (the 70B shape's 80 layers included). Maxima of 0.01-0.03 at every width took the 8B
    # shape's residual past 65504 by its last layers: NaN logits, whatever the kernels; at RMS 1/sqrt(k) it still
    # reached 1.2e4.
    widths = torch.tensor([bits for bits, _ in groups], dtype=torch.float32, device=device)
    spread = 0.7 + 0.6 * torch.rand(g, device=device, generator=gen)
    scale_max = 0.5 * spread / (0.26 * 2 ** (widths - 1) * k ** 0.5)
    return Exl2Weight(
        q_weight=words(qrow, np_), q_scale=words(g, np_ // 8),
        q_scale_max=scale_max.half(),
        q_groups=torch.tensor(q_groups, dtype=torch.int16, device=device),
        q_invperm=torch.randperm(k, device=device, generator=gen).to(torch.int32),
        in_features=k, out_features=n)


BODY_MIX = [(1.0, 4, 128)]                       # 4.0 bpw (+0.03 for scales): spec candidate "4·128"
HEAD_MIX = [(0.15, 8, 128), (0.85, 6, 128)]      # ExLlamaV2's default head (-hb 6)


class _Random:
    """Random weights of a config on a device, in the real EXL2 layout (linears) or fp16 (norms, embedding)."""

    def __init__(self, config: ModelConfig, device, body_mix, head_mix, seed: int):
        self.config, self.device, self.body_mix, self.head_mix = config, device, body_mix, head_mix
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def linear(self, k: int, n: int, mix=None) -> QuantLinear:
        return QuantLinear(random_exl2(k, n, mix or self.body_mix, self.device, self.gen))

    def norm(self) -> torch.Tensor:
        return (1 + 0.05 * torch.randn(self.config.hidden_size, device=self.device, generator=self.gen)).half()

    def mlp(self, intermediate: int) -> Mlp:
        d = self.config.hidden_size
        return Mlp(self.linear(d, intermediate), self.linear(d, intermediate), self.linear(intermediate, d))

    def model(self, mlp_of) -> Model:
        """mlp_of(): each block's MLP."""
        c, d, hd = self.config, self.config.hidden_size, self.config.head_dim
        blocks = []
        for i in range(c.n_layers):
            attn = Attention(i, self.linear(d, c.n_heads * hd), self.linear(d, c.n_kv_heads * hd),
                             self.linear(d, c.n_kv_heads * hd), self.linear(c.n_heads * hd, d),
                             c.n_heads, c.n_kv_heads, hd)
            blocks.append(Block(self.norm(), attn, self.norm(), mlp_of()))
        embed = (torch.randn(c.vocab_size, d, device=self.device, generator=self.gen) * 0.02).half()
        head = self.linear(d, c.vocab_size, self.head_mix)
        return Model(c, embed, blocks, self.norm(), head, torch.device(self.device), torch.float16)


def synthetic_model(shape: str, device="cuda", body_mix=BODY_MIX, head_mix=HEAD_MIX, seed: int = 0) -> Model:
    config = config_for(shape)
    r = _Random(config, device, body_mix, head_mix, seed)
    return r.model(lambda: r.mlp(config.intermediate_size))


MOE_SHAPES = {   # Mixtral-8x7B: 8 experts of Llama-2-7B-like MLP width on a Mistral-7B body, 2 routed per token
    "mixtral-8x7b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False, num_local_experts=8,
                         num_experts_per_tok=2, sliding_window=None),
}


def moe_config_for(shape: str, max_position_embeddings: int = 32768) -> ModelConfig:
    raw = dict(MOE_SHAPES[shape], architectures=["MixtralForCausalLM"], rms_norm_eps=1e-5, rope_theta=1e6,
               max_position_embeddings=max_position_embeddings)
    return ModelConfig.from_dict(raw)


def synthetic_moe_model(shape: str, device="cuda", body_mix=BODY_MIX, head_mix=HEAD_MIX, seed: int = 0,
                        n_layers: int | None = None) -> Model:
    """A Mixtral-shape model in the real EXL2 layout (every expert w1/w3/w2 quantized, the router fp16 as EXL2
    files keep it); n_layers: fewer layers than the shape has (for a quicker run; bytes scale with it)."""
    config = moe_config_for(shape)
    if n_layers is not None:
        config = ModelConfig.from_dict(dict(config.raw, num_hidden_layers=n_layers))
    r, moe = _Random(config, device, body_mix, head_mix, seed), config.moe

    def moe_mlp() -> MoeMlp:
        experts = [r.mlp(moe.intermediate_size) for _ in range(moe.n_experts)]
        router = Linear((torch.randn(moe.n_experts, config.hidden_size, device=device, generator=r.gen) * 0.02).half())
        return MoeMlp(router, experts, moe.top_k, moe.renormalize)
    return r.model(moe_mlp)


# a tokenizer for synthetic directories (from_pretrained loads one; the load probes feed token ids, not text)
TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "exl2-ref" / "hf" / "llama_tiny"


def write_exl2_dir(shape: str, directory: str | Path, device="cuda", body_mix=BODY_MIX, head_mix=HEAD_MIX,
                   seed: int = 0) -> int:
    """A synthetic model of `shape` as an EXL2 directory, as ExLlamaV2 writes one (config.json with its
    quantization_config, one output.safetensors under the HF tensor names, generation_config.json, a tokenizer):
    random weights made on `device` a layer at a time, the head quantized as synthetic_model's, written from the
    CPU. Returns the bytes of the weight file. Refuses, before writing, when the disk cannot hold it."""
    directory = Path(directory)
    c = config_for(shape)
    r = _Random(c, device, body_mix, head_mix, seed)
    d, hd = c.hidden_size, c.head_dim
    linears = {"self_attn.q_proj": (d, c.n_heads * hd), "self_attn.k_proj": (d, c.n_kv_heads * hd),
               "self_attn.v_proj": (d, c.n_kv_heads * hd), "self_attn.o_proj": (c.n_heads * hd, d),
               "mlp.gate_proj": (d, c.intermediate_size), "mlp.up_proj": (d, c.intermediate_size),
               "mlp.down_proj": (c.intermediate_size, d)}

    def on_cpu(tensors: dict) -> dict:
        return {name: t.cpu() for name, t in tensors.items()}
    tensors = on_cpu({"model.embed_tokens.weight": (torch.randn(c.vocab_size, d, device=device, generator=r.gen)
                                                    * 0.02).half(), "model.norm.weight": r.norm()})
    for i in range(c.n_layers):
        prefix = f"model.layers.{i}"
        layer = {f"{prefix}.input_layernorm.weight": r.norm(), f"{prefix}.post_attention_layernorm.weight": r.norm()}
        for name, (k, n) in linears.items():
            layer.update(linear_tensors(f"{prefix}.{name}", random_exl2(k, n, body_mix, device, r.gen)))
        tensors.update(on_cpu(layer))
    tensors.update(on_cpu(linear_tensors("lm_head", random_exl2(d, c.vocab_size, head_mix, device, r.gen))))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < nbytes + 2**30:
        raise ExlError(f"{directory}: {free / 1e9:.1f} GB free, the {shape} model needs {nbytes / 1e9:.1f} GB "
                       f"(and 1 GB to spare): write it elsewhere")
    save_tensors(tensors, directory / "output.safetensors")
    bits = sum(p * b for p, b, _ in body_mix)
    source = dict(c.raw, model_type="llama", torch_dtype="float16")
    write_json(exl2_config(source, bits, head_mix[-1][1], 0, 0, f"random weights, seed {seed}",
                           "synthetic (benchmarks/shapes.py)"), directory / "config.json")
    # the converter copies the source's generation_config.json: Llama-3-8B-Instruct's
    write_json({"bos_token_id": 128000, "eos_token_id": [128001, 128009], "do_sample": True, "temperature": 0.6,
                "top_p": 0.9, "max_length": 4096}, directory / "generation_config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER_DIR / name, directory / name)
    return nbytes
