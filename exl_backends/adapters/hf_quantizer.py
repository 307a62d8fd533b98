"""transformers' quantizer plugin for EXL2: after `import exl_backends`, stock
`AutoModelForCausalLM.from_pretrained(exl2_dir)` builds transformers' own model with our EXL2 linear layers
(registered lazily by hf_registration.py, so that importing exl_backends stays cheap).

Only the linear layers become ours (`Exl2Linear`, running `linear.QuantLinear`: the reference on CPU, the
quantized-matmul kernels on CUDA); embeddings, norms, attention, the KV cache and `generate` stay transformers'.
`ExlForCausalLM` is the faster path (our whole decoder, paged cache and generator); this plugin is for code that
must keep a `PreTrainedModel` (peft, forward hooks, transformers' own generation strategies).

GPTQ: the "gptq" slot belongs to transformers' own quantizer (optimum + gptqmodel) and stays theirs, so users who
load GPTQ checkpoints through transformers keep transformers' behaviour. For our kernels on a GPTQ directory, use
`ExlForCausalLM.from_pretrained(gptq_dir)`, which reads GPTQ natively.

Without `import exl_backends`, transformers does not know "exl2": it logs "Unknown quantization type, got exl2 ...
we will skip the quantization", then finds no model.safetensors in an ExLlamaV2-style directory (its file is
output.safetensors) and raises OSError ("Error no file named model.safetensors ..."). A directory whose file was
renamed model.safetensors would load with random Linear weights (the q_* tensors reported UNEXPECTED, every
`weight` MISSING in transformers' load report), so always import exl_backends first."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers.quantizers.auto import (AUTO_QUANTIZATION_CONFIG_MAPPING, register_quantization_config,
                                          register_quantizer)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..errors import CheckpointError
from ..formats.exl2 import Exl2Weight
from ..formats.tensors import TensorInfo, read_header
from ..model.linear import QuantLinear

EXL2_TENSORS = ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")


def register() -> None:
    """Adds "exl2" to transformers' quantization registries (once per process)."""
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get("exl2") is not Exl2Config:
        register_quantization_config("exl2")(Exl2Config)
        register_quantizer("exl2")(Exl2HfQuantizer)


class Exl2Config(QuantizationConfigMixin):
    """config.json's `quantization_config` of an EXL2 checkpoint, as ExLlamaV2 writes it."""

    def __init__(self, bits: float | None = None, head_bits: int | None = None, version: str | None = None,
                 calibration: dict | None = None, **kwargs):
        self.quant_method = "exl2"
        self.bits, self.head_bits, self.version, self.calibration = bits, head_bits, version, calibration
        for key, value in kwargs.items():       # keep what newer writers add, so to_dict round-trips
            setattr(self, key, value)


class Exl2Linear(nn.Module):
    """A Linear whose buffers are named like the checkpoint's EXL2 tensors, so transformers loads them as they are;
    `prepare()` (after loading) builds the QuantLinear that computes y = x @ W^T + b."""

    def __init__(self, in_features: int, out_features: int, infos: dict[str, TensorInfo]):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        for name, info in infos.items():
            self.register_buffer(name, torch.empty(info.shape, dtype=info.dtype, device="meta"))
        self.linear: QuantLinear | None = None

    def prepare(self) -> None:
        weight = Exl2Weight(self.q_weight, self.q_scale, self.q_scale_max.half(), self.q_groups, self.q_invperm,
                            in_features=self.in_features, out_features=self.out_features)
        bias = getattr(self, "bias", None)
        bias = None if bias is None else bias[:self.out_features]         # ExLlamaV2 pads it to 32
        self.linear = QuantLinear(weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.linear is None:
            raise RuntimeError("Exl2Linear called before its weights were loaded (load through from_pretrained)")
        y = self.linear(x.reshape(-1, self.in_features))                    # [T, N]
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format=exl2"


class Exl2HfQuantizer(HfQuantizer):
    requires_calibration = True         # loads pre-quantized checkpoints only

    def update_attn_implementation(self, config):
        """The one hook that sees the config before transformers looks for weight files: an ExLlamaV2 directory
        names its file output.safetensors, so point transformers at it (config.transformers_weights)."""
        directory = Path(str(getattr(config, "_name_or_path", "") or ""))
        if directory.is_dir() and getattr(config, "transformers_weights", None) is None:
            config.transformers_weights = weights_file(directory)
        return config

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        """On the meta device: each nn.Linear whose key has EXL2 tensors becomes an Exl2Linear."""
        infos: dict[str, TensorInfo] = {}
        for file in checkpoint_files or ():
            infos.update(read_header(Path(file)))
        replaced: set[str] = set()
        for name, module in list(model.named_modules()):
            if isinstance(module, nn.Linear) and f"{name}.q_weight" in infos:
                parts = {t: infos[f"{name}.{t}"] for t in EXL2_TENSORS + ("bias",) if f"{name}.{t}" in infos}
                missing = [t for t in EXL2_TENSORS if t not in parts]
                if missing:
                    raise CheckpointError(f"{infos[f'{name}.q_weight'].file}: layer {name!r} lacks "
                                          f"{', '.join(missing)}; the EXL2 checkpoint is incomplete, re-convert it")
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent), attr, Exl2Linear(module.in_features, module.out_features, parts))
                replaced.add(f"{name}.weight")
        if not replaced:
            raise CheckpointError(f"{[str(f) for f in checkpoint_files or ()]}: config.json says quant_method "
                                  f"'exl2' but no layer has EXL2 tensors (<layer>.q_weight)")
        if isinstance(model.get_output_embeddings(), Exl2Linear):
            model.config.tie_word_embeddings = False     # the head is its own quantized tensor, not the embedding
        # transformers computed which weights to tie when it built the model (config.tie_word_embeddings: true for
        # SmolLM2 and most small models), before our layers replaced them: an Exl2Linear has no `weight` to tie
        tied = getattr(model, "all_tied_weights_keys", None) or {}
        model.all_tied_weights_keys = {target: source for target, source in tied.items()
                                       if target not in replaced and source not in replaced}
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        for module in model.modules():
            if isinstance(module, Exl2Linear):
                module.prepare()
        return model

    def is_serializable(self, **kwargs) -> bool:
        return False

    @property
    def is_trainable(self) -> bool:
        return False


def weights_file(directory: Path) -> str | None:
    """The weight file transformers should read when it would not find one itself; None when it will."""
    if (directory / "model.safetensors").is_file() or (directory / "model.safetensors.index.json").is_file():
        return None
    files = sorted(p.name for p in directory.glob("*.safetensors"))
    if len(files) == 1:
        return files[0]
    if not files:
        return None                     # transformers reports the missing weights itself
    raise CheckpointError(f"{directory}: the EXL2 shards {files} have no model.safetensors.index.json, which "
                          f"transformers needs to read several files; load this directory with "
                          f"exl_backends.ExlForCausalLM.from_pretrained instead")
