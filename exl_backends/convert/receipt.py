"""The quality receipt: perplexity and mean KL divergence of the written checkpoint against the fp16 model on
text held out from calibration. Both models run layer by layer (one layer's weights on the device at a time),
the quantized one from the files just written, dequantized by the same readers the engine uses."""
from __future__ import annotations

import torch
from torch import Tensor
from tqdm import tqdm

from .. import formats, reference
from ..config import ModelConfig
from ..evaluate import Scores, score
from . import forward
from .forward import Context


@torch.inference_mode()
def evaluate(source: formats.Checkpoint, quantized: formats.Checkpoint, config: ModelConfig, tokens: Tensor,
             device: torch.device) -> Scores:
    """tokens [E, L]: each row is scored on its own (token t+1 predicted from tokens 0..t)."""
    ctx = Context.build(config, tokens.shape[1], device)
    x_ref, x_q = forward.embed(source.store, config, tokens), forward.embed(quantized.store, config, tokens)
    for i in tqdm(range(config.n_layers), desc="quality receipt", unit="layer"):
        for store, states in ((source, x_ref), (quantized, x_q)):
            lw = forward.load_layer(store, config, i, device)
            states.copy_(forward.run(forward.mlp_chunk, forward.run(forward.attention_chunk, states, lw, ctx),
                                     lw, ctx))
    norm = f"{config.traits.names.final_norm}.weight"
    norm_ref = source.store.get(norm).to(device, torch.float32)
    norm_q = quantized.store.get(norm).to(device, torch.float32)
    head_ref = forward.output_head(source, config, device)
    head_q = forward.output_head(quantized, config, device)
    total = Scores()
    for r in range(tokens.shape[0]):
        ref = reference.linear(reference.rmsnorm(x_ref[r].to(device), norm_ref, config.rms_norm_eps), head_ref)
        got = reference.linear(reference.rmsnorm(x_q[r].to(device), norm_q, config.rms_norm_eps), head_q)
        total.add(score(got[:-1], tokens[r, 1:], ref[:-1]))
    return total
