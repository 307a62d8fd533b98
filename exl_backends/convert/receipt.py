"""The quality receipt: perplexity and mean KL divergence of the written checkpoint against the fp16 model on
text held out from calibration. Both models run layer by layer (one layer's weights on the device at a time),
the quantized one from the files just written, dequantized by the same readers the engine uses."""
from __future__ import annotations

import torch
from torch import Tensor
from tqdm import tqdm

from .. import formats
from ..commands.evaluate import Scores, score
from ..model.config import ModelConfig
from . import forward
from .forward import Context


@torch.inference_mode()
def evaluate(source: formats.Checkpoint, quantized: formats.Checkpoint, config: ModelConfig, tokens: Tensor,
             device: torch.device) -> Scores:
    """tokens [E, L]: each row is scored on its own (token t+1 predicted from tokens 0..t)."""
    ctx = Context.build(config, tokens.shape[1], device)
    x_ref, x_q = forward.embed(source.store, config, tokens), forward.embed(quantized.store, config, tokens)
    for i in tqdm(range(config.n_layers), desc="quality receipt", unit="layer"):
        for ckpt, states in ((source, x_ref), (quantized, x_q)):
            layer = forward.load_layer(ckpt, config, i, device)
            for sub in layer.sublayers:
                states.copy_(forward.run(sub, states, layer, ctx))
    head_ref, head_q = forward.load_head(source, config, device), forward.load_head(quantized, config, device)
    total = Scores()
    for r in range(tokens.shape[0]):
        total.add(score(head_q(x_q[r].to(device))[:-1], tokens[r, 1:], head_ref(x_ref[r].to(device))[:-1]))
    return total
