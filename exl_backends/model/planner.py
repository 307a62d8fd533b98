"""The memory plan of a model on a GPU, from the checkpoint's headers alone: weights + KV cache + scratch +
reserve. from_pretrained checks it against free memory before allocating anything; `exl info` prints it.

weights  every tensor the loader keeps on the device (formats.linear_nbytes: packed tensors as stored, dense
         ones in the compute dtype), plus PREPARE_BYTES_PER_ROW per input row of each quantized linear for
         what the kernels' prepare() derives at load time (an int32 row permutation and an int16 group map
         per row, as ExLlamaV2 keeps).
cache    cache.bytes_per_token(config, mode) x the context rounded up to whole pages of PAGE_SIZE.
scratch  the live tensors of the largest prefill chunk, chunk = min(context, PREFILL_CHUNK) tokens:
         activations  chunk x (2D residual and normed x, (H + 2Hkv)Dh q/k/v, H Dh attention output,
                      3I gate/up/product) in the compute dtype (attention kernels are flash-style: no score
                      matrix is kept);
         logits       min(tokens, LOGIT_ROWS) x vocab x (compute dtype + 4 bytes): the head's output and its
                      f32 copy for the rows one engine step samples from (a row per job, 1 + k per job
                      drafting k tokens);
         dequant      the largest quantized linear as a dense fp16 matrix, columns padded to 32 (large
                      batches dequantize it, then call cuBLAS);
         pieces       the static buffers of the graphs that run steps of many tokens (runner.PrefillGraphs):
                      residual, normed x, queries and attention output for TOKEN_SIZES[-1] rows.
reserve  RESERVE_BYTES for the cuBLAS workspace, compiled kernels and allocator fragmentation (the CUDA
         context itself is already outside torch.cuda.mem_get_info's free memory).
Outside the plan: a transformers-style full forward, `model(input_ids)`, which makes its own cache for its input
and logits for every position ([batch, seq, vocab] f32)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .. import formats
from ..errors import ConfigError, OutOfMemoryPlanError
from . import cache as kv_cache
from . import model
from .config import ModelConfig
from .runner import TOKEN_SIZES

PAGE_SIZE = 256
PREFILL_CHUNK = 2048
LOGIT_ROWS = 256                # an engine step's logits rows (32 jobs verifying 1 + 7 drafted tokens each)
PREPARE_BYTES_PER_ROW = 8
RESERVE_BYTES = 256 * 2**20
GIB = 2**30

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryPlan:
    tokens: int                 # the context planned for
    cache_mode: str
    weights: int                # bytes
    cache: int
    scratch: int
    reserve: int

    @property
    def total(self) -> int:
        return self.weights + self.cache + self.scratch + self.reserve


@dataclass(frozen=True)
class Footprint:
    """What a model costs independently of the context; `plan(tokens)` adds the context's part."""
    config: ModelConfig
    cache_mode: str
    dtype: torch.dtype          # compute dtype
    tensor_bytes: int           # every weight tensor exactly as the loader keeps it
    prepare_bytes: int          # the kernels' per-layer metadata allowance
    dequant_bytes: int          # the largest quantized linear as dense fp16
    decoder_linear_bytes: int   # tensor bytes of the decoder-layer linears ...
    decoder_linear_weights: int  # ... and their in x out sum (bpw = 8 bytes / weights)
    bytes_per_token: int        # KV cache

    @property
    def weights(self) -> int:
        return self.tensor_bytes + self.prepare_bytes

    def scratch(self, tokens: int) -> int:
        c = self.config
        width = 2 * c.hidden_size + (2 * c.n_heads + 2 * c.n_kv_heads) * c.head_dim + 3 * c.intermediate_size
        pieces = TOKEN_SIZES[-1] * (2 * c.hidden_size + 2 * c.n_heads * c.head_dim) * self.dtype.itemsize
        return min(tokens, PREFILL_CHUNK) * width * self.dtype.itemsize + self.logits(tokens) + self.dequant_bytes \
            + pieces

    def logits(self, tokens: int) -> int:
        """The logits part of scratch."""
        return min(tokens, LOGIT_ROWS) * self.config.vocab_size * (self.dtype.itemsize + 4)

    def plan(self, tokens: int) -> MemoryPlan:
        pages = -(-tokens // PAGE_SIZE)
        return MemoryPlan(tokens, self.cache_mode, self.weights, pages * PAGE_SIZE * self.bytes_per_token,
                          self.scratch(tokens), RESERVE_BYTES)

    def max_tokens(self, budget: int) -> int:
        """The largest context (whole pages) whose plan fits in budget bytes; 0 if not even one page does."""
        lo, hi = 0, budget // (PAGE_SIZE * max(self.bytes_per_token, 1)) + 1
        while lo < hi:                      # the plan grows with the context: bisect on pages
            mid = (lo + hi + 1) // 2
            if self.plan(mid * PAGE_SIZE).total <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo * PAGE_SIZE


def footprint(ckpt: formats.Checkpoint, config: ModelConfig, cache_mode: str = "fp16",
              dtype: torch.dtype = torch.float16) -> Footprint:
    """Reads only headers. dtype: the compute dtype (fp16 on the GPU)."""
    kv_cache.check_mode(cache_mode, config)
    item = dtype.itemsize
    store, head = ckpt.store, config.traits.names.lm_head
    d = config.hidden_size
    tensor_bytes = (config.vocab_size * d + (2 * config.n_layers + 1) * d) * item   # embedding, norms
    prepare = dequant = decoder_bytes = decoder_weights = 0
    layers = [(key, k, n) for key, k, n, _ in model.linears(config, store)]
    if not model.head_is_tied(store, config):
        layers.append((head, d, config.vocab_size))
    for key, k, n in layers:
        nbytes = formats.linear_nbytes(ckpt, key, k, n, dtype)
        tensor_bytes += nbytes
        if key != head:
            decoder_bytes, decoder_weights = decoder_bytes + nbytes, decoder_weights + k * n
        if formats.linear_kind(store, key) != "dense":
            prepare += PREPARE_BYTES_PER_ROW * k
            dequant = max(dequant, k * formats.exl2.padded(n) * 2)     # columns padded to 32
    return Footprint(config, cache_mode, dtype, tensor_bytes, prepare, dequant, decoder_bytes, decoder_weights,
                     kv_cache.bytes_per_token(config, cache_mode, item))


def plan(ckpt: formats.Checkpoint, config: ModelConfig, tokens: int, cache_mode: str = "fp16",
         dtype: torch.dtype = torch.float16) -> MemoryPlan:
    return footprint(ckpt, config, cache_mode, dtype).plan(tokens)


def free_memory(device: torch.device) -> int:
    """Free bytes on a CUDA device, as the driver reports them (before we allocate anything)."""
    return torch.cuda.mem_get_info(device)[0]


def fit_context(ckpt: formats.Checkpoint, config: ModelConfig, requested: int | None, cache_mode: str,
                budget: int, where: str, dtype: torch.dtype = torch.float16) -> int:
    """The context to allocate on a device with budget free bytes (`where` names it in messages): `requested`
    if its plan fits, else OutOfMemoryPlanError with the numbers and concrete ways out. With no request, the
    model's max_position_embeddings, shortened to what fits."""
    fp = footprint(ckpt, config, cache_mode, dtype)
    tokens = requested or config.max_position_embeddings
    if fp.plan(tokens).total <= budget:
        return tokens
    fits = fp.max_tokens(budget)
    if requested is None and fits >= min(tokens, PAGE_SIZE):
        log.warning("%s: context shortened from %d to %d tokens to fit %s free (pass max_seq_len to choose)",
                    where, tokens, fits, gib(budget))
        return fits
    p = fp.plan(tokens)
    raise OutOfMemoryPlanError(
        f"the model does not fit on {where}: it needs {gib(p.total)} ({breakdown(p)}) but {gib(budget)} are "
        f"free. Try: {'; '.join(suggestions(ckpt, config, fp, tokens, budget))}")


def breakdown(p: MemoryPlan) -> str:
    return (f"weights {gib(p.weights)} + KV cache {gib(p.cache)} for {p.tokens} tokens ({p.cache_mode}) + "
            f"scratch {gib(p.scratch)} + reserve {gib(p.reserve)}")


def suggestions(ckpt: formats.Checkpoint, config: ModelConfig, fp: Footprint, tokens: int, budget: int) -> list[str]:
    out = []
    fits = fp.max_tokens(budget)
    if fits:
        out.append(f"max_seq_len={fits} (the longest context that fits with the {fp.cache_mode} cache)")
    if fp.cache_mode != "q4":
        try:
            q4 = footprint(ckpt, config, "q4", fp.dtype)
        except ConfigError:                 # this model's kv width does not allow a quantized cache
            q4 = None
        if q4 is not None and q4.max_tokens(budget) > fits:
            ok = q4.plan(tokens).total <= budget
            out.append(f"cache_mode='q4' ({'fits' if ok else 'fits up to'} "
                       f"{tokens if ok else q4.max_tokens(budget)} tokens)")
    if fp.decoder_linear_weights:
        rest = fp.plan(tokens).total - fp.decoder_linear_bytes
        bpw = (budget - rest) * 8 / fp.decoder_linear_weights
        if bpw >= 2.5:      # EXL2's smallest useful quants are about 2.5 bpw
            out.append(f"a quant of this model with at most {bpw:.2f} bits per weight in the decoder layers "
                       f"(this one has {fp.decoder_linear_bytes * 8 / fp.decoder_linear_weights:.2f})")
    out.append("a GPU with more free memory")
    return out


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"
