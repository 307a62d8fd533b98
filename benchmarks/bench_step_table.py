"""The pipelined megakernel's step table (exl_backends/model/step_table.py) run on the GPU with stand-in work: each
CTA (one per SM) runs its SM's queue of slices in table order, waiting on the table's counters before a slice and
adding to them after it, its slice's bytes (weights; attention's K and V at the given context) streamed through a
ring of shared-memory slots by a producer warp, as bench_pipeline streams an op's even shares. So it measures what
the table itself costs: its load balance (strips of 32 columns leave SMs idle at the 1B shape), its waits (all of an
op's slices, or only a KV group's or a band's), the tiles' float atomics into the residual. Consumers and modes as
bench_pipeline's (free: no waits; after: the producer waits too; ahead: it copies across the waits).

    python benchmarks/bench_step_table.py [--shapes llama-3.2-1b,llama-3-8b] [--layouts columns,tiles]
        [--consumers w32,exl2@16] [--modes free,after,ahead] [--json DIR]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cupy as cp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import (SOURCE as PIPELINE_SOURCE, consumer_inputs, median_us, ring_arguments,  # noqa: E402
                            shared_memory, start, write_results)
from shapes import config_for  # noqa: E402

from exl_backends.model import step_table  # noqa: E402

SOURCE = PIPELINE_SOURCE + r"""
// One slice of an SM's queue (8 ints): its bytes at w + 16 * off16, its waits wait_k/wait_v[wait0 .. + nwait), the
// counters it adds one to, sig[sig0 .. + nsig), and the floats it adds into the residual (a tile's partial sum).
struct Entry { int off16, bytes, wait0, nwait, sig0, nsig, adds, pad; };

// The counters count over all launches so far, gen of them before this one: a wait for v is one for (gen + 1) v.
__device__ __forceinline__ void wait_all(const Entry& e, const int* wait_k, const int* wait_v, const int* counters,
                                         int gen)
{
    for (int i = e.wait0; i < e.wait0 + e.nwait; ++i) wait_counter(counters + wait_k[i], (gen + 1) * wait_v[i]);
}

// CTA c runs entries[first[c] .. first[c + 1]).
template <class Consumer, int CONSUMERS>
__global__ void __launch_bounds__(32 * (CONSUMERS + 1), 1)
table_step(const unsigned char* __restrict__ w, const Entry* __restrict__ entries, const int* __restrict__ first,
           const int* __restrict__ wait_k, const int* __restrict__ wait_v, const int* __restrict__ sig,
           int slot_bytes, int slots, int* counters, int gen, int mode, float* out, float* resid, int hidden,
           const half* x, const unsigned* records, int kchunks)
{
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) unsigned long long full[32], empty[32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, c = blockIdx.x;
    const int e0 = first[c], e1 = first[c + 1];
    const Ring ring{smem, full, empty, slot_bytes, slots};
    ring.init(CONSUMERS);
    __syncthreads();

    if (warp == 0) {                                   // the producer
        if (lane) return;
        int it = 0;
        for (int i = e0; i < e1; ++i) {
            const Entry e = entries[i];
            if (mode == MODE_AFTER) wait_all(e, wait_k, wait_v, counters, gen);
            ring.fill(w + 16 * (size_t)e.off16, e.bytes, it);
        }
        return;
    }

    const int cw = warp - 1;
    Consumer consumer;
    consumer.start({x, records, kchunks}, smem + (size_t)slots * slot_bytes, lane);
    int it = 0;
    for (int i = e0; i < e1; ++i) {
        const Entry e = entries[i];
        if (mode != MODE_FREE) {
            if (threadIdx.x == 32) wait_all(e, wait_k, wait_v, counters, gen);
            asm volatile("bar.sync 1, %0;" ::"n"(32 * CONSUMERS) : "memory");
        }
        ring.drain(e.bytes, it, lane, [&](const unsigned char* data, int n) { consumer.slot(data, n, cw, lane); });
        const float partial = consumer.result();
        out[(size_t)c * 32 * CONSUMERS + cw * 32 + lane] = partial;
        for (int j = cw * 32 + lane; j < e.adds; j += 32 * CONSUMERS) atomicAdd(resid + j % hidden, partial);
        asm volatile("bar.sync 1, %0;" ::"n"(32 * CONSUMERS) : "memory");
        if (threadIdx.x == 32)
            for (int j = e.sig0; j < e.sig0 + e.nsig; ++j)
                asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counters + sig[j]) : "memory");
    }
}
"""

MODES = {"ahead": 0, "after": 1, "free": 2}


def flatten(table: step_table.StepTable, head_dim: int, context: int) -> dict[str, np.ndarray]:
    """The table as the kernel's arrays: entries in SM order (first[c]: CTA c's first), their waits and signals,
    each slice's bytes rounded up to whole 512-byte pieces (the EXL2 consumers' chunks) at its own offset."""
    entries, wait_k, wait_v, sig, first, off16 = [], [], [], [], [0], 0
    for queue in table.queues():
        for s in queue:
            nbytes = s.weight_bytes or (context * head_dim * 2 * 2 * (s.hi - s.lo) if s.op == "attention" else 0)
            nbytes = -(-nbytes // 512) * 512
            adds = s.hi - s.lo if s.rows else 0
            entries.append((off16, nbytes, len(wait_k), len(s.waits), len(sig), len(s.signals), adds, 0))
            wait_k += [k for k, _ in s.waits]
            wait_v += [v for _, v in s.waits]
            sig += list(s.signals)
            off16 += nbytes // 16
        first.append(len(entries))
    arrays = dict(entries=np.array(entries, dtype=np.int32).reshape(-1), first=np.array(first, dtype=np.int32),
                  wait_k=np.array(wait_k or [0], dtype=np.int32), wait_v=np.array(wait_v or [0], dtype=np.int32),
                  sig=np.array(sig or [0], dtype=np.int32))
    arrays["bytes"] = 16 * off16
    return arrays


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3-8b")
    ap.add_argument("--layouts", default=",".join(step_table.LAYOUTS))
    ap.add_argument("--context", type=int, default=256)
    ring_arguments(ap, "w0,w32,exl2@16")
    ap.add_argument("--modes", default="free,after,ahead")
    args = ap.parse_args()

    module, specs, G, bw = start(SOURCE, "table_step", args)
    slot_bytes = args.slot_kb * 1024
    rows, rng = [], np.random.default_rng(0)
    for shape in args.shapes.split(","):
        config = config_for(shape)
        x, records, kchunks = consumer_inputs(config.hidden_size, rng)
        resid = cp.zeros(config.hidden_size, dtype=cp.float32)
        for layout in args.layouts.split(","):
            table = step_table.build(config, G, layout)
            flat = flatten(table, config.head_dim, args.context)
            d = {k: cp.asarray(v) for k, v in flat.items() if k != "bytes"}
            w = cp.arange(flat["bytes"] // 4, dtype=cp.uint32).view(cp.uint8)
            counters = cp.zeros(len(table.counters), dtype=cp.int32)
            bound_us = flat["bytes"] / bw * 1e6
            whole, part = step_table.whole_op_waits(table, 1)
            print(f"\n{shape}, layout {layout}, ctx {args.context}: {len(table.slices)} slices, {whole} waits a layer "
                  f"on a whole op and {part} on part of one; {flat['bytes'] / 1e9:.3f} GB, bound {bound_us:.0f} us")
            print(f"{'mode':8} {'consumer':>12} {'us/step':>9} {'TB/s':>6} {'% of bound':>10}")
            for spec, (expression, warps) in specs.items():
                kernel = module.get_function(expression)
                smem = shared_memory(kernel, spec, slot_bytes * args.slots, kchunks)
                if smem is None:
                    continue
                out = cp.empty(G * 32 * warps, dtype=cp.float32)
                for mode in args.modes.split(","):
                    counters.fill(0)
                    us = median_us(lambda gen: kernel(
                        (G,), (32 * (warps + 1),),
                        (w, d["entries"], d["first"], d["wait_k"], d["wait_v"], d["sig"], np.int32(slot_bytes),
                         np.int32(args.slots), counters, np.int32(gen), np.int32(MODES[mode]), out, resid,
                         np.int32(config.hidden_size), x, records, np.int32(kchunks)), shared_mem=smem),
                        args.launches)
                    rows.append(dict(shape=shape, layout=layout, context=args.context, mode=mode, consumer=spec,
                                     us=round(us, 1), tb_s=round(flat["bytes"] / us / 1e6, 3),
                                     share=round(bound_us / us, 3), bytes=flat["bytes"], slices=len(table.slices),
                                     whole_waits=whole, part_waits=part))
                    print(f"{mode:8} {spec:>12} {us:9.1f} {flat['bytes'] / us / 1e6:6.2f} {100 * bound_us / us:9.1f}%")
    write_results(args.json, "step-table", bw, rows, G)


if __name__ == "__main__":
    main()
