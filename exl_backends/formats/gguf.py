"""GGUF -> a Hugging Face fp16 safetensors directory (config, weights, tokenizer, chat template), through
transformers' GGUF support (which needs the `gguf` and `accelerate` packages: the `gguf` extra).

Llama-architecture files take a shorter road to the same weights: transformers' loader rebuilds gguf's whole
tensor-name table once per module (397 times for a 30-layer model) and parses the file's metadata once more for
the model, which made importing the 135M default model take 35 s on a 2-core CPU. `_llama_model` reads the
tensor table with transformers' fast header reader, names the tensors with one table, dequantizes them with
gguf's code and applies transformers' own q/k un-permutation; any other architecture goes through
transformers' loader unchanged."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from ..errors import CheckpointError, ConfigError


def import_gguf(file: str | Path, out_dir: str | Path) -> Path:
    """Dequantizes every tensor of `file` to fp16 and writes an HF directory at out_dir (atomically: a
    half-written directory never appears under out_dir's name)."""
    file, out_dir = Path(file), Path(out_dir)
    if not file.is_file():
        raise CheckpointError(f"{file}: no such GGUF file")
    try:
        import gguf  # noqa: F401  (transformers needs it; fail here with the fix)
        import accelerate  # noqa: F401
    except ImportError:
        raise ConfigError("importing a GGUF file needs the `gguf` extra: pip install 'exl-backends[gguf]'") from None
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
        config = _llama_config(file) or AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name)
        model = _llama_model(file, config) or AutoModelForCausalLM.from_pretrained(
            str(file.parent), gguf_file=file.name, config=config, dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True))
    except (ValueError, OSError, KeyError) as e:
        raise CheckpointError(f"{file}: transformers cannot read this GGUF file ({e})") from None
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.to(torch.float16).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def gguf_to_hf_names(config, hf_names) -> dict[str, str]:
    """{GGUF tensor name: HF parameter name} for a llama model with these parameter names: the mapping
    transformers' get_gguf_hf_weights_map makes for llama, from one gguf name table instead of one per module."""
    import gguf

    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    names = {}
    for hf_name in hf_names:
        stem, dot, suffix = hf_name.rpartition(".")
        if suffix not in ("weight", "bias"):
            stem, dot, suffix = hf_name, "", ""
        gguf_name = table.get_name(stem)
        if gguf_name is not None:
            names[gguf_name + dot + suffix] = hf_name
    return names


def _llama_config(file: Path):
    """The config AutoConfig makes of a llama GGUF file, from its metadata read by transformers' header reader, which
    skips the vocabulary (AutoConfig reads the file with gguf's GGUFReader, decoding all of it: ~3 s, as the
    tokenizer's load does again); with transformers' own key table. None for other architectures (transformers
    renames some: a llama file named "mistral" becomes one), or where transformers lacks the reader."""
    try:
        from transformers import CONFIG_MAPPING
        from transformers.integrations.gguf.reader import read_gguf_metadata
        from transformers.modeling_gguf_pytorch_utils import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_TO_TRANSFORMERS_MAPPING
    except ImportError:
        return None
    try:
        metadata, tensor_names = read_gguf_metadata(str(file))
    except ValueError:
        return None
    if metadata.get("general.architecture") != "llama" or "mistral" in str(metadata.get("general.name", "")).lower():
        return None
    config = {"tie_word_embeddings": "output.weight" not in tensor_names}     # (load_gguf_checkpoint's order)
    for key, value in (GGUF_CONFIG_DEFAULTS_MAPPING.get("llama") or {}).items():
        config.setdefault(key, value)
    renames = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        name = renames.get(prefix, {}).get(rest)
        if name is not None and name != -1:
            config[name] = value
    config = CONFIG_MAPPING["llama"].from_dict(config)
    config.name_or_path = str(file.parent)                                  # as from_pretrained sets it
    return config


def _llama_model(file: Path, config):
    """The fp16 model holding the file's tensors, exactly as transformers' loader dequantizes (with gguf's
    numpy code) and un-permutes them (in fp32, then rounded once); None when this is not a llama file whose
    every tensor has a home and every parameter a tensor, or when transformers is older than its fast GGUF
    header reader (then transformers' loader decides)."""
    import gguf
    import numpy as np
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    try:  # reads the tensor table without decoding the vocabulary (gguf's GGUFReader takes 3 s on that)
        from transformers.integrations.gguf.reader import GgufHeader
    except ImportError:
        return None
    if config.model_type != "llama":
        return None
    try:
        header = GgufHeader.from_file(str(file))
    except ValueError:  # a tensor type its reader does not know
        return None
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    hf_names = set(skeleton.state_dict())
    if config.tie_word_embeddings:
        hf_names.discard("lm_head.weight")        # tied: the embedding's tensor fills it
    names = gguf_to_hf_names(config, hf_names)
    if {info.name for info in header.tensors} != set(names) or set(names.values()) != hf_names:
        return None
    processor = LlamaTensorProcessor(config=config.to_dict())
    blob = np.memmap(file, mode="r", dtype=np.uint8)
    state_dict = {}
    for info in header.tensors:
        qtype = gguf.GGMLQuantizationType(info.ggml_type)
        start = header.data_start + info.offset
        raw = np.asarray(blob[start:start + info.nbytes]).reshape(gguf.quant_shape_to_byte_shape(info.shape, qtype))
        weights = processor.process(weights=gguf.dequantize(raw, qtype), name=info.name).weights
        # numpy rounds fp32 -> fp16 as torch's .to(float16) does (to nearest even), without torch's extra copy
        state_dict[names[info.name]] = torch.from_numpy(weights.astype(np.float16))
    return type(skeleton).from_pretrained(None, config=config, state_dict=state_dict, dtype=torch.float16)
