"""Calibration tokens: rows of `length` tokens for the quantization pass (the first ones also for the
measurement), plus held-out rows for the quality receipt.

From a file (.txt, .jsonl, .parquet) or a Hugging Face dataset name, the text is tokenized and cut into
consecutive chunks; a seeded shuffle picks the calibration chunks and, disjoint from them, the held-out ones.
A .safetensors file gives token rows as they are (an earlier job's calibration.safetensors: 'quant' and 'eval'),
so that a conversion can reuse sampled rows without sampling again.
With no source, rows are sampled from the fp16 model itself (the first token of each row drawn at random,
then plain sampling at temperature 1), so conversion works offline."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from ..errors import ExlError
from ..model.batch import Batch, SeqChunk
from ..model.cache import KVCache
from ..model.config import ModelConfig
from ..model.model import Model
from ..model.ops import REFERENCE_OPS

FILE_SUFFIXES = (".txt", ".jsonl", ".parquet", ".safetensors")
MAX_TEXT_CHARS = 64 * 1024 * 1024      # a larger file is read up to here; that is far more than any row count needs
SAMPLE_PAGE = 256
DEFAULT_DATASET = "(default)"


@dataclass
class Calibration:
    quant: Tensor         # [R, L] int64: quantization-pass rows
    measure: Tensor       # [Rm, L]: measurement rows (the first Rm quantization rows)
    eval: Tensor          # [E, L]: held-out rows for the quality receipt
    dataset: str          # what quantization_config.calibration.dataset records
    description: str      # for quality.json

    def tensors(self) -> dict[str, Tensor]:
        return {"quant": self.quant, "measure": self.measure.clone(), "eval": self.eval}


def from_source(source: str, tokenizer, rows: int, measure_rows: int, length: int, eval_rows: int,
                seed: int) -> Calibration:
    path = Path(source)
    if path.suffix == ".safetensors":
        return from_rows(path, tokenizer, rows, measure_rows, length, eval_rows)
    if path.suffix in FILE_SUFFIXES or path.exists():
        text, dataset = read_text(path), path.name
    else:
        text, dataset = dataset_text(source), source
    tokens = encode(tokenizer, text)
    n_chunks = len(tokens) // length
    if n_chunks < rows + 1:
        raise ExlError(f"calibration source {source} is too short: {len(tokens)} tokens make {n_chunks} rows of "
                       f"{length}, and conversion needs {rows} calibration rows plus at least one held-out row for "
                       f"the quality receipt; pass a longer file or lower --rows / --length")
    chunks = torch.tensor(tokens[:n_chunks * length], dtype=torch.int64).view(n_chunks, length)
    order = torch.randperm(n_chunks, generator=torch.Generator().manual_seed(seed))
    quant = chunks[order[:rows]]
    held_out = chunks[order[rows: rows + eval_rows]]
    return Calibration(quant, quant[:measure_rows], held_out, dataset,
                       f"{source}: {rows} of its {n_chunks} chunks of {length} tokens (seeded shuffle)")


def from_rows(path: Path, tokenizer, rows: int, measure_rows: int, length: int, eval_rows: int) -> Calibration:
    """Token rows saved earlier: 'quant' [R, L] and 'eval' [E, L] (int64, or uint16 to halve the file). The first
    `rows` quantization rows and up to `eval_rows` held-out rows are used, each cut to `length` tokens."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    if not path.is_file():
        raise ExlError(f"calibration file {path} not found")
    try:
        saved = load_file(path)
    except (OSError, SafetensorError) as e:
        raise ExlError(f"cannot read calibration rows from {path}: {e}") from None
    quant, held_out = saved.get("quant"), saved.get("eval")
    if quant is None or held_out is None or quant.dim() != 2 or held_out.dim() != 2:
        raise ExlError(f"{path} holds no calibration rows: it needs 2-d token tensors 'quant' and 'eval' (as a "
                       f"conversion job's calibration.safetensors has)")
    if quant.shape[0] < rows or quant.shape[1] < length or held_out.shape[0] < 1 or held_out.shape[1] < length:
        raise ExlError(f"{path} has {quant.shape[0]} rows of {quant.shape[1]} tokens and {held_out.shape[0]} "
                       f"held-out rows of {held_out.shape[1]}; this conversion needs {rows} rows of {length} and at "
                       f"least one held-out row: lower --rows / --length")
    quant, held_out = quant[:rows, :length].long(), held_out[:eval_rows, :length].long()
    vocab = len(tokenizer)
    if int(max(quant.max(), held_out.max())) >= vocab or int(min(quant.min(), held_out.min())) < 0:
        raise ExlError(f"{path} holds token ids outside this model's vocabulary (0..{vocab - 1}): the rows were "
                       f"made with another tokenizer")
    return Calibration(quant, quant[:measure_rows], held_out, path.name,
                       f"{path.name}: {rows} saved rows of {length} tokens, {held_out.shape[0]} held out")


def read_text(path: Path) -> str:
    """The text of a .txt, .jsonl (the 'text' field, else every string field, of each line) or .parquet file
    (every string column of each row joined with spaces, as ExLlamaV2 does)."""
    if not path.is_file():
        raise ExlError(f"calibration file {path} not found")
    try:
        if path.suffix == ".parquet":
            text = _parquet_text(path)
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                raw = f.read(MAX_TEXT_CHARS)
            text = _jsonl_text(raw, path) if path.suffix == ".jsonl" else raw
    except OSError as e:
        raise ExlError(f"cannot read calibration file {path}: {e.strerror or e}") from None
    if not text.strip():
        raise ExlError(f"calibration file {path} holds no text")
    return text


def _jsonl_text(raw: str, path: Path) -> str:
    lines = raw.splitlines()
    parts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines) and len(raw) == MAX_TEXT_CHARS:
                break                                   # the last line was cut at the read limit
            raise ExlError(f"{path}:{n}: not a JSON object per line") from None
        parts.append(_record_text(record))
    return "\n\n".join(p for p in parts if p)


def _record_text(record) -> str:
    if isinstance(record, str):
        return record
    if isinstance(record, dict):
        if isinstance(record.get("text"), str):
            return record["text"]
        return " ".join(v for v in record.values() if isinstance(v, str))
    return ""


def _parquet_text(path: Path) -> str:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ExlError(f"reading {path} needs pyarrow: pip install pyarrow (or pass a .txt or .jsonl file)") from None
    table = pq.read_table(path)
    columns = [c for c in table.column_names if str(table.schema.field(c).type) in ("string", "large_string")]
    if not columns:
        raise ExlError(f"{path} has no string column to calibrate on")
    data = [table.column(c).to_pylist() for c in columns]
    rows, size = [], 0
    for values in zip(*data):
        row = " ".join(v for v in values if v)
        rows.append(row)
        size += len(row)
        if size > MAX_TEXT_CHARS:
            break
    return "\n\n".join(rows)


def dataset_text(name: str) -> str:
    """`NAME[:CONFIG[:SPLIT]]` of the Hugging Face hub, through the `datasets` package (network needed)."""
    try:
        import datasets
    except ImportError:
        raise ExlError(f"calibration source {name!r} is neither a file nor loadable: it is not an existing "
                       f".txt/.jsonl/.parquet file, and Hugging Face dataset names need `pip install datasets` "
                       f"and network access") from None
    repo, config, split = (name.split(":") + [None, None])[:3]
    try:
        ds = datasets.load_dataset(repo, config, split=split or "train")
    except Exception as e:            # datasets raises many types (network, missing config, ...)
        raise ExlError(f"cannot load dataset {name!r}: {e}") from None
    parts, size = [], 0
    for record in ds:
        text = _record_text(record)
        parts.append(text)
        size += len(text)
        if size > MAX_TEXT_CHARS:
            break
    return "\n\n".join(parts)


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of text without added special tokens (no BOS: rows are plain text chunks)."""
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids


# ----------------------------------------------------------------------------------------------- sampled


def sampled(model_dir: Path, config: ModelConfig, tokenizer, rows: int, measure_rows: int, length: int,
            eval_rows: int, seed: int, device: torch.device) -> Calibration:
    """Rows sampled from the fp16 model itself: the built-in default. The whole model is loaded for this (the
    one step of the converter that needs it all at once)."""
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    model = Model.load(model_dir, config, device, dtype)
    model.ops = REFERENCE_OPS           # the converter must run without the CUDA kernels
    tokens = sample_rows(model, tokenizer, rows + eval_rows, length, seed)
    quant = tokens[:rows]
    return Calibration(quant, quant[:measure_rows], tokens[rows:], DEFAULT_DATASET,
                       f"(default) {rows + eval_rows} rows of {length} tokens sampled from the fp16 model "
                       f"(temperature 1, random first token, seed {seed}); the last {eval_rows} held out")


@torch.inference_mode()
def sample_rows(model: Model, tokenizer, n_rows: int, length: int, seed: int) -> Tensor:
    """[n_rows, length] int64 token ids, all rows decoded together with a KV cache."""
    config = model.config
    gen = torch.Generator().manual_seed(seed)
    special = set(tokenizer.all_special_ids)
    ordinary = torch.tensor([i for i in range(config.vocab_size) if i not in special])
    out = torch.empty(n_rows, length, dtype=torch.int64)
    out[:, 0] = ordinary[torch.randint(len(ordinary), (n_rows,), generator=gen)]
    pages_per_row = -(-length // SAMPLE_PAGE)
    cache = KVCache(config, n_rows * pages_per_row, SAMPLE_PAGE, "fp16", model.device, model.dtype)
    pages = [list(range(r * pages_per_row, (r + 1) * pages_per_row)) for r in range(n_rows)]
    for t in tqdm(range(1, length), desc="sampling calibration text", unit="tok"):
        batch = Batch.build([SeqChunk(out[r, t - 1: t].tolist(), t - 1, pages[r]) for r in range(n_rows)],
                            SAMPLE_PAGE, model.device)
        probs = torch.softmax(model.forward(batch, cache).float().cpu(), dim=-1)       # [rows, vocab]
        out[:, t] = torch.multinomial(probs, 1, generator=gen)[:, 0]
    return out
