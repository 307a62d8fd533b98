"""A decode step of one sequence as an instruction table for a persistent kernel (issue #35, docs/megakernel.md,
"The step as a table"): every op of a Llama-family step cut into slices, each slice on one SM, each SM running its
slices in table order, each slice waiting on counters before it starts and adding to counters when done. The table
is what the pipelined megakernel is to run; `Interpreter` is its CPU interpreter and the kernel's spec: it executes
the SMs' queues in any order the counters allow (random orders in the tests) and must give the model's logits, so a
missing wait shows up as wrong logits, a wait that is never met as an error.

Three layouts. "columns" (today's launch-per-op, as one table): every matmul split by output columns, every slice
waiting for the whole op before it (5 waits a layer). "tiles": o and down split by input rows too, so that every SM
gets a tile at the 1B shape, their partial sums added into the residual (float atomics in a kernel); the same waits.
"tiles-fine": the same tiles, each waiting only for the producers of the rows it reads, so that only the two norms
of the residual wait for every SM (2 waits a layer on a whole op, 3 on part of one). Tiles are rows in the model's
order, which the interpreter reads; a kernel reads a weight's rows in its stored order, so tiles-fine's o and down
fit weights stored in the model's row order (fp16, GPTQ without act-order, EXL2 with no permutation): act-order
(our converter's default and ExLlamaV2's) scatters a tile's rows over every stored chunk. The ops of layer i:
  qkv        columns of q|k|v (whole strips of 32), the input norm of residual R(2i) in each slice; waits for R(2i)
  attention  one KV head group: q/k norms, RoPE, K/V into the cache, attention over it; waits for every qkv slice
             (tiles-fine: only for those whose columns hold the group's heads)
  o          columns: columns of the hidden size, R(2i+1) = R(2i) + o(attn) there; waits for every group.
             tiles: (a group's head rows, a column range); waits for every group (tiles-fine: its own)
  gate_up    a range of intermediate rows: the post-attention norm of R(2i+1), gate and up of the same rows,
             silu(gate) * up written there; waits for R(2i+1)
  down       columns: columns of the hidden size, R(2i+2) = R(2i+1) + down(act) there; waits for every gate_up slice.
             tiles: (a band of intermediate rows, a column range); waits for every gate_up slice (tiles-fine: those
             of its band)
  head       columns of the vocabulary after the final norm of R(2L); waits for R(2L)
Residual versions R(v) live in a ring of three buffers: R(v)'s producers run only after R(v - 1) is complete, and
then no one reads R(v - 2) any more (its readers all come before R(v - 1)'s producers), so R(v + 1) may take its
buffer. Tiles add partials into R(v), which must start at zero: the tiles of the first group (o) or band (down) also
carry their columns of R(v - 1) into R(v) and zero them in R(v + 1). Partial sums in any order agree with the
columns layout within rounding, not bit for bit."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import UnsupportedFormatError
from . import reference
from .config import Activation, ModelConfig
from .mlp import Mlp

LAYOUTS = ("columns", "tiles", "tiles-fine")
STRIP = 32                      # columns a slice holds a multiple of (the kernels' strip)


@dataclass(frozen=True)
class Slice:
    op: str                     # qkv, attention, o, gate_up, down, head
    layer: int                  # the block (the head: the number of blocks)
    lo: int                     # output columns [lo, hi) (qkv: of q|k|v; gate_up: intermediate rows);
    hi: int                     # attention: KV head groups [lo, hi)
    sm: int
    waits: tuple[tuple[int, int], ...]      # (counter, value) to wait for
    signals: tuple[int, ...]                # counters it adds one to when done
    weight_bytes: int                       # weights it streams, at the table's bits per weight
    rows: tuple[int, int] | None = None     # a tile: the input rows it reads, its output a partial sum
    carries: bool = False                   # a tile that also carries its columns of the residual version before


@dataclass
class StepTable:
    slices: list[Slice]         # in table order: an SM runs its own in this order
    counters: list[str]         # counter -> what it counts
    sms: int
    layout: str

    def queues(self) -> list[list[Slice]]:
        queues = [[] for _ in range(self.sms)]
        for s in self.slices:
            queues[s.sm].append(s)
        return queues


@dataclass
class _Counters:
    names: list[str] = field(default_factory=list)

    def new(self, name: str) -> int:
        self.names.append(name)
        return len(self.names) - 1


def ranges(n: int, parts: int, align: int = STRIP) -> list[tuple[int, int]]:
    """[0, n) cut into at most `parts` ranges of whole `align`-wide units (the last may be short), as even as they
    can be."""
    units = -(-n // align)
    parts = min(parts, units)
    cuts = [align * (units * p // parts) for p in range(parts + 1)]
    return [(lo, min(hi, n)) for lo, hi in zip(cuts, cuts[1:])]


class _Builder:
    """The table of one decode step, op by op (build)."""

    def __init__(self, config: ModelConfig, sms: int, layout: str, bits: float):
        self.c, self.sms, self.layout, self.bits = config, sms, layout, bits
        self.counters, self.slices, self.next_sm = _Counters(), [], 0
        self.ready: tuple[int, int] | None = None    # the residual version the next op reads is complete

    def add(self, op: str, layer: int, lo: int, hi: int, waits, signals, k: int, n: int, sm: int | None = None,
            bits: float | None = None, **tile) -> None:
        """A slice of k x n weights (at `bits`, default the table's); on `sm`, else on the SM after the last one
        given (round robin)."""
        if sm is None:
            sm, self.next_sm = self.next_sm, (self.next_sm + 1) % self.sms
        nbytes = int(k * n * (bits or self.bits) / 8)
        self.slices.append(Slice(op, layer, lo, hi, sm, tuple(w for w in waits if w), tuple(signals), nbytes, **tile))

    def done(self, name: str, parts: int) -> list[int]:
        """Counters for an op's slices: one a part (KV group, band) in tiles-fine, else one for the whole op."""
        if self.layout == "tiles-fine":
            return [self.counters.new(f"{name} of part {p}") for p in range(parts)]
        return [self.counters.new(name)] * parts

    def layer(self, i: int) -> None:
        c = self.c
        hd, groups = c.head_dim, c.n_kv_heads
        per_group = c.n_heads // groups
        q_cols, kv_cols, hidden = c.n_heads * hd, groups * hd, c.hidden_size

        def group_of(col: int) -> int:        # the KV head group of a q|k|v column
            return col // hd // per_group if col < q_cols else (col - q_cols) % kv_cols // hd

        qkv_done = self.done(f"layer {i}: qkv slices", groups)
        need = [0] * groups                   # what each group's attention waits for on its counter
        self.next_sm = 0
        qkv_ranges = ranges(q_cols + 2 * kv_cols, self.sms)
        for lo, hi in qkv_ranges:
            touched = sorted({group_of(col) for col in range(lo, hi)})
            signals = sorted({qkv_done[g] for g in touched})
            for g in range(groups):
                need[g] += qkv_done[g] in signals
            self.add("qkv", i, lo, hi, [self.ready], signals, hidden, hi - lo)
        group_sm = [g * self.sms // groups for g in range(groups)]
        attn_done = self.done(f"layer {i}: attention", groups)
        for g in range(groups):
            self.add("attention", i, g, g + 1, [(qkv_done[g], need[g])], [attn_done[g]], 0, 0, group_sm[g])
        attn_need = 1 if self.layout == "tiles-fine" else groups
        o_done = self.counters.new(f"layer {i}: o")
        self.next_sm = 0
        if self.layout == "columns":
            o_ranges = ranges(hidden, self.sms)
            for lo, hi in o_ranges:
                self.add("o", i, lo, hi, [(attn_done[0], groups)], [o_done], q_cols, hi - lo)
            self.ready = (o_done, len(o_ranges))
        else:
            cols = ranges(hidden, max(1, self.sms // groups))
            for g in range(groups):
                rows = (g * per_group * hd, (g + 1) * per_group * hd)
                for lo, hi in cols:
                    self.add("o", i, lo, hi, [(attn_done[g], attn_need)], [o_done], per_group * hd, hi - lo,
                             rows=rows, carries=g == 0)
            self.ready = (o_done, groups * len(cols))
        self.mlp(i)

    def mlp(self, i: int) -> None:
        c, hidden = self.c, self.c.hidden_size
        gu_ranges = ranges(c.intermediate_size, self.sms)
        down_done = self.counters.new(f"layer {i}: down")
        self.next_sm = 0
        if self.layout == "columns":
            (gu_done,) = self.done(f"layer {i}: gate_up", 1)
            for lo, hi in gu_ranges:
                self.add("gate_up", i, lo, hi, [self.ready], [gu_done], hidden, 2 * (hi - lo))
            self.next_sm = 0
            down_ranges = ranges(hidden, self.sms)
            for lo, hi in down_ranges:
                self.add("down", i, lo, hi, [(gu_done, len(gu_ranges))], [down_done], c.intermediate_size, hi - lo)
            self.ready = (down_done, len(down_ranges))
            return
        # tiles: bands of whole gate_up slices x column ranges, about one tile an SM
        bands = ranges(len(gu_ranges), max(1, round(math.sqrt(self.sms))), 1)
        band_done = self.done(f"layer {i}: gate_up slices", len(bands))
        for b, (first, last) in enumerate(bands):
            for lo, hi in gu_ranges[first:last]:
                self.add("gate_up", i, lo, hi, [self.ready], [band_done[b]], hidden, 2 * (hi - lo))
        self.next_sm = 0
        cols = ranges(hidden, max(1, self.sms // len(bands)))
        for b, (first, last) in enumerate(bands):
            rows = (gu_ranges[first][0], gu_ranges[last - 1][1])
            need = last - first if self.layout == "tiles-fine" else len(gu_ranges)
            for lo, hi in cols:
                self.add("down", i, lo, hi, [(band_done[b], need)], [down_done], rows[1] - rows[0], hi - lo,
                         rows=rows, carries=b == 0)
        self.ready = (down_done, len(bands) * len(cols))

    def head(self, bits: float) -> None:
        c, done = self.c, self.counters.new("head")
        self.next_sm = 0
        for lo, hi in ranges(c.vocab_size, self.sms):
            self.add("head", c.n_layers, lo, hi, [self.ready], [done], c.hidden_size, hi - lo, bits=bits)


def build(config: ModelConfig, sms: int, layout: str = "columns", bits: float = 4.0,
          head_bits: float = 6.0) -> StepTable:
    """The table of one decode step of `config` (a Llama-family model) over `sms` SMs."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    b = _Builder(config, sms, layout, bits)
    for i in range(config.n_layers):
        b.layer(i)
    b.head(head_bits)
    return StepTable(b.slices, b.counters.names, sms, layout)


def whole_op_waits(table: StepTable, layer: int) -> tuple[int, int]:
    """(waits of a layer's slices on every slice of an op, waits on part of one): the all-to-all dependencies and the
    per-group / per-band ones."""
    signalers: dict[int, set] = {}
    count: dict[tuple[int, str], int] = {}
    for s in table.slices:
        count[s.layer, s.op] = count.get((s.layer, s.op), 0) + 1
        for k in s.signals:
            signalers.setdefault(k, set()).add((s.layer, s.op))
    waits = {w for s in table.slices if s.layer == layer for w in s.waits}
    whole = sum(1 for k, v in waits if len(signalers[k]) == 1 and count[next(iter(signalers[k]))] == v)
    kinds = {table.counters[k].split(" of ")[0] for k, v in waits
             if not (len(signalers[k]) == 1 and count[next(iter(signalers[k]))] == v)}
    return whole, len(kinds)


def describe(table: StepTable) -> str:
    """The table in words (`exl bench --schedule`): per op of a layer, its slices, SMs and waits; the totals."""
    layer0 = [s for s in table.slices if s.layer == 0] + [s for s in table.slices if s.op == "head"]
    whole, part = whole_op_waits(table, min(1, table.slices[-1].layer - 1))
    lines = [f"decode step as {len(table.slices)} slices on {table.sms} SMs, layout {table.layout}: "
             f"{whole} waits a layer on a whole op, {part} on part of one; {len(table.counters)} counters. "
             f"Layer 0 and the head:"]
    for op in ("qkv", "attention", "o", "gate_up", "down", "head"):
        ss = [s for s in layer0 if s.op == op]
        sms = sorted({s.sm for s in ss})
        waits = sorted({f"{table.counters[k]} = {v}" for s in ss for k, v in s.waits}) or ["nothing"]
        kb = [s.weight_bytes / 1024 for s in ss]
        lines.append(f"  {op}: {len(ss)} slices on {len(sms)} SMs, {min(kb):.1f}-{max(kb):.1f} KB of weights each"
                     + (", partial sums" if ss[0].rows else "") + f"; waits for {'; '.join(waits[:2])}"
                     + (f" (+{len(waits) - 2} more)" if len(waits) > 2 else ""))
    return "\n".join(lines)


def supported(model) -> str | None:
    """Why the interpreter (and the table) cannot run `model` (a Model), or None: the Llama family only."""
    c = model.config
    if any(b.attn_out_norm is not None or b.mlp_out_norm is not None for b in model.blocks):
        return "output norms (Gemma)"
    if any(not isinstance(b.mlp, Mlp) or b.mlp.activation is not Activation.SILU for b in model.blocks):
        return "an MLP other than the SiLU-gated one"
    if any(b.attention.options for b in model.blocks) or c.local_rope is not None or c.final_softcap is not None:
        return "sliding windows, soft-capping or a local rope"
    if model.rope.long_inv_freq is not None or model.embed_scale is not None:
        return "longrope or scaled embeddings"
    return None


class _Weights:
    """A model's weights as the interpreter reads them: dense, fp32."""

    def __init__(self, model):
        def dense(linear):
            return linear.dense_weight().float()

        def bias(linear):
            return torch.zeros(linear.out_features) if linear.bias is None else linear.bias.float()

        self.layers = []
        for b in model.blocks:
            a, m = b.attention, b.mlp
            parts = (a.q, a.k, a.v)
            self.layers.append(dict(
                input_norm=b.input_norm.float(), post_norm=b.post_attn_norm.float(),
                qkv=torch.cat([dense(p) for p in parts]), qkv_bias=torch.cat([bias(p) for p in parts]),
                o=dense(a.o), o_bias=bias(a.o), gate=dense(m.gate), up=dense(m.up),
                down=dense(m.down), down_bias=bias(m.down),
                q_norm=None if a.q_norm is None else a.q_norm.float(),
                k_norm=None if a.k_norm is None else a.k_norm.float(), scale=a.scale))
        self.embed, self.norm, self.head = model.embed.float(), model.norm.float(), dense(model.lm_head)
        self.inv_freq, self.rope_scale = model.rope.inv_freq, model.rope.scale


class Interpreter:
    """Runs a StepTable on a model's weights on the CPU, one decode step of one sequence at a time, with its own
    fp32 KV cache. order: None runs the ready SM with the lowest index first; a seed picks the ready SM at random."""

    def __init__(self, table: StepTable, model, max_positions: int):
        why = supported(model)
        if why is not None:
            raise UnsupportedFormatError(f"the step table covers the Llama family; this model has {why}")
        self.table, self.config, self.w = table, model.config, _Weights(model)
        c = self.config
        self.cache = [(torch.zeros(max_positions, c.n_kv_heads, c.head_dim),
                       torch.zeros(max_positions, c.n_kv_heads, c.head_dim)) for _ in range(c.n_layers)]

    def step(self, token: int, position: int, order: int | None = None) -> Tensor:
        """The logits [vocab] after `token` at `position` (earlier positions run by earlier steps)."""
        c, nan = self.config, float("nan")
        self.pos = position
        self.ring = [self.w.embed[token].clone(), torch.zeros(c.hidden_size), torch.full((c.hidden_size,), nan)]
        self.qkv = torch.full(((c.n_heads + 2 * c.n_kv_heads) * c.head_dim,), nan)
        self.attn = torch.full((c.n_heads * c.head_dim,), nan)
        self.act = torch.full((c.intermediate_size,), nan)
        self.logits = torch.full((c.vocab_size,), nan)
        counts = [0] * len(self.table.counters)
        queues, at = self.table.queues(), [0] * self.table.sms
        pick = random.Random(order) if order is not None else None
        while True:
            ready = [sm for sm, q in enumerate(queues)
                     if at[sm] < len(q) and all(counts[k] >= v for k, v in q[at[sm]].waits)]
            if not ready:
                if any(at[sm] < len(q) for sm, q in enumerate(queues)):
                    stuck = [q[at[sm]] for sm, q in enumerate(queues) if at[sm] < len(q)]
                    raise RuntimeError(f"the step table deadlocks: {len(stuck)} SMs wait, e.g. {stuck[0]}")
                return self.logits.clone()
            sm = pick.choice(ready) if pick else ready[0]
            s = queues[sm][at[sm]]
            getattr(self, "_" + s.op)(s)
            for k in s.signals:
                counts[k] += 1
            at[sm] += 1

    def _version(self, v: int) -> Tensor:
        return self.ring[v % 3]

    def _normed(self, v: int, w: Tensor) -> Tensor:
        return reference.rmsnorm(self._version(v)[None], w, self.config.rms_norm_eps)[0]

    def _produce(self, s: Slice, v: int, delta: Tensor) -> None:
        """Residual version v from version v - 1 in the slice's columns: written (a column slice), or a partial sum
        added (a tile), which the carrying tiles complete with version v - 1's columns, zeroing them in v + 1."""
        out, before = self._version(v), self._version(v - 1)
        if s.rows is None:
            out[s.lo:s.hi] = before[s.lo:s.hi] + delta
            return
        out[s.lo:s.hi] += delta
        if s.carries:
            out[s.lo:s.hi] += before[s.lo:s.hi]
            self._version(v + 1)[s.lo:s.hi] = 0.0

    def _qkv(self, s: Slice) -> None:
        w = self.w.layers[s.layer]
        x = self._normed(2 * s.layer, w["input_norm"])
        self.qkv[s.lo:s.hi] = w["qkv"][s.lo:s.hi] @ x + w["qkv_bias"][s.lo:s.hi]

    def _attention(self, s: Slice) -> None:
        c, w, g = self.config, self.w.layers[s.layer], s.lo
        hd, per_group = c.head_dim, c.n_heads // c.n_kv_heads
        q_cols, kv_cols = c.n_heads * hd, c.n_kv_heads * hd
        q = self.qkv[g * per_group * hd:(g + 1) * per_group * hd].view(1, per_group, hd)
        k = self.qkv[q_cols + g * hd:q_cols + (g + 1) * hd].view(1, 1, hd)
        v = self.qkv[q_cols + kv_cols + g * hd:q_cols + kv_cols + (g + 1) * hd]
        eps = c.rms_norm_eps
        if w["q_norm"] is not None:
            q = reference.rmsnorm(q.reshape(-1, hd), w["q_norm"], eps).view(q.shape)
            k = reference.rmsnorm(k.reshape(-1, hd), w["k_norm"], eps).view(k.shape)
        cos, sin = reference.rope_cos_sin(torch.tensor([self.pos]), self.w.inv_freq, self.w.rope_scale, torch.float32)
        q, k = reference.apply_rope(q, cos, sin), reference.apply_rope(k, cos, sin)
        keys, values = self.cache[s.layer]
        keys[self.pos, g], values[self.pos, g] = k[0, 0], v
        scores = torch.einsum("hd,td->ht", q[0], keys[:self.pos + 1, g]) * w["scale"]
        out = torch.softmax(scores, dim=-1) @ values[:self.pos + 1, g]                      # [per_group, hd]
        self.attn[g * per_group * hd:(g + 1) * per_group * hd] = out.reshape(-1)

    def _o(self, s: Slice) -> None:
        self._project(s, "o", self.attn, 2 * s.layer + 1)

    def _project(self, s: Slice, name: str, x: Tensor, v: int) -> None:
        """o or down: the slice's columns (of its input rows, a tile) into residual version v."""
        w = self.w.layers[s.layer]
        rows = slice(*s.rows) if s.rows else slice(None)
        bias = w[name + "_bias"][s.lo:s.hi] if s.rows is None or s.carries else 0.0
        self._produce(s, v, w[name][s.lo:s.hi, rows] @ x[rows] + bias)

    def _gate_up(self, s: Slice) -> None:
        w = self.w.layers[s.layer]
        x = self._normed(2 * s.layer + 1, w["post_norm"])
        self.act[s.lo:s.hi] = reference.silu_mul(w["gate"][s.lo:s.hi] @ x, w["up"][s.lo:s.hi] @ x)

    def _down(self, s: Slice) -> None:
        self._project(s, "down", self.act, 2 * s.layer + 2)

    def _head(self, s: Slice) -> None:
        x = self._normed(2 * self.config.n_layers, self.w.norm)
        self.logits[s.lo:s.hi] = self.w.head[s.lo:s.hi] @ x
