"""`--format gptq`: GPTQ checkpoints in the standard AutoGPTQ layout (gptq-format.md §2-§5, §8): symmetric,
v1 zero points ("gptq" checkpoint_format: stored zero - 1), 4- or 8-bit codes packed down K, optional act-order
recorded in g_idx, lm_head left in fp16."""
from __future__ import annotations

import torch
from torch import Tensor

from ..errors import ExlError
from ..model import reference
from .gptq import Prepared, gptq_sym_scale, quantize
from .qparams import QParams

GPTQ_FORMAT_BITS = (4, 8)
GPTQ_DAMP = 0.01          # AutoGPTQ's damp_percent default


def layout(k: int, bits: int, group_size: int) -> list[tuple[int, int]]:
    """(bits, rows) per group in quantization order; group_size -1: one group over all of K."""
    size = k if group_size == -1 else group_size
    return [(bits, min(size, k - start)) for start in range(0, k, size)]


class GptqQuantizer:
    def __init__(self, bits: int, group_size: int, act_order: bool, damp: float = GPTQ_DAMP, rtn: bool = False):
        if bits not in GPTQ_FORMAT_BITS:
            raise ExlError(f"GPTQ output supports {' and '.join(map(str, GPTQ_FORMAT_BITS))} bits, not {bits}")
        if group_size != -1 and (group_size <= 0 or group_size % 32):
            raise ExlError(f"GPTQ group size must be a positive multiple of 32 (or -1), not {group_size}")
        self.bits, self.group_size, self.damp, self.rtn = bits, group_size, damp, rtn
        self.act_order = act_order and not rtn      # rtn: round-to-nearest baseline, no Hessian, no error feedback

    def __call__(self, key: str, qp: QParams | None, weight: Tensor, bias: Tensor | None,
                 prepared: Prepared) -> tuple[dict[str, Tensor], Tensor]:
        n, k = weight.shape
        if (n * self.bits) % 32:
            raise ExlError(f"{key}: GPTQ packs zero points along out_features, which must make whole 32-bit "
                           f"words ({n} x {self.bits} bits does not)")
        if self.rtn:
            prepared = Prepared(torch.arange(k, device=weight.device), torch.eye(k, device=weight.device))
        q = quantize(weight, prepared, [layout(k, self.bits, self.group_size)], gptq_sym_scale)[0]
        dev = q.codes.device            # packed and checked there (the GPU in a GPU conversion), then saved
        inv = torch.argsort(q.perm)
        g_idx = (torch.arange(k, device=dev) // (k if self.group_size == -1 else self.group_size))[inv]
        scales = torch.stack([g["scales"] for g in q.group_data])                        # fp16 [G, N]
        zeros_v1 = torch.full((len(q.group_data), n), 2 ** (self.bits - 1) - 1, dtype=torch.int64, device=dev)
        tensors = {
            f"{key}.qweight": reference.pack_bits(q.codes[inv], self.bits),               # original row order
            f"{key}.qzeros": reference.pack_bits(zeros_v1.T.contiguous(), self.bits).T.contiguous(),
            f"{key}.scales": scales,
            f"{key}.g_idx": g_idx.to(torch.int32),
        }
        if bias is not None:
            tensors[f"{key}.bias"] = bias.to(torch.float16)
        got = reference.dequant_gptq(tensors[f"{key}.qweight"], tensors[f"{key}.qzeros"], scales,
                                     tensors[f"{key}.g_idx"], self.bits)
        if not torch.equal(got, q.weight):
            raise ExlError(f"internal error: packed {key} does not dequantize to the quantized weights; "
                           f"please report this")
        return {name: t.cpu() for name, t in tensors.items()}, q.weight

    def config(self) -> dict:
        """quantization_config / quantize_config.json (the keys AutoGPTQ, GPTQModel and transformers read)."""
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size,
                "desc_act": self.act_order, "sym": True, "static_groups": False, "true_sequential": False,
                "damp_percent": self.damp, "checkpoint_format": "gptq", "lm_head": False}
