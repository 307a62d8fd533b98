// Greedy decoding's argmax: per row of f32 logits, the index of the largest value, as torch.argmax(-1): the first
// of equal values, and NaN above every number (the first NaN). torch's own reduction takes one block a row, ~30 us
// for 128,256 logits on an H100 (docs/engine.md); this one spreads a row over many blocks.
//
// logits [R, V] f32, row r at logits + r * stride; out int64 [R]; ws [R, B] Best (each block's partial); counters
// int32 [R], zero before and after. Grid (B, R), block 256: block b of row r takes elements [b * span, min(V, (b + 1)
// * span)) and writes its best (value, index) to ws[r * B + b], then counts itself in counters[r]; the row's last
// block to arrive takes the B partials in block order, writes out[r] and resets the counter: one launch.
#include "common.cuh"

namespace {

constexpr int THREADS = 256;
constexpr int LOADS = 4;                // elements a thread has in flight per round
constexpr int NONE = 0x7fffffff;        // the index of the empty Best

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// by its bits: fast math may fold a comparison-based NaN test away
__device__ __forceinline__ bool is_nan(float x) { return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u; }

struct Best {
    float v;
    int i;
};

// a before b: NaN above numbers, then the larger value, then (equal values or two NaNs) the lower index. The
// empty Best (-inf, NONE) comes after every element, an all -inf row's first included.
__device__ __forceinline__ bool before(Best a, Best b)
{
    const bool an = is_nan(a.v), bn = is_nan(b.v);
    if (an != bn) return an;
    if (!an && a.v != b.v) return a.v > b.v;
    return a.i < b.i;
}

// The block's first Best (every thread gets it).
__device__ __forceinline__ Best block_best(Best x)
{
    __shared__ Best warps[THREADS / 32];
    __syncthreads();                            // (a call before may still be reading warps)
    for (int span = 16; span >= 1; span /= 2) {
        const Best y{__shfl_xor_sync(exl::FULL_MASK, x.v, span), __shfl_xor_sync(exl::FULL_MASK, x.i, span)};
        if (before(y, x)) x = y;
    }
    if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = x;
    __syncthreads();
    x = warps[0];
    for (int w = 1; w < THREADS / 32; ++w)
        if (before(warps[w], x)) x = warps[w];
    return x;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS)
    row_argmax(const float* __restrict__ logits, long long stride, int V, int span, long long* __restrict__ out,
               Best* __restrict__ ws, int* __restrict__ counters)
{
    exl::pdl_trigger();
    exl::pdl_wait();                            // the logits, ws and the counters come from earlier kernels
    const int b = blockIdx.x, B = gridDim.x, r = blockIdx.y;
    const float* row = logits + r * stride;
    const int end = min(V, (b + 1) * span);
    Best best{neg_inf(), NONE};
    for (int k0 = b * span + threadIdx.x; k0 < end; k0 += THREADS * LOADS) {
        float v[LOADS];
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int k = k0 + u * THREADS;
            v[u] = k < end ? __ldg(row + k) : neg_inf();
        }
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {       // indices rise with u: a tie keeps the earlier one
            const Best x{v[u], k0 + u * THREADS};
            if (x.i < end && before(x, best)) best = x;
        }
    }
    best = block_best(best);
    __shared__ int last;
    if (threadIdx.x == 0) {
        ws[r * B + b] = best;
        __threadfence();                        // the partial, then the arrival
        last = atomicAdd(counters + r, 1) == B - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    Best x{neg_inf(), NONE};
    for (int p = threadIdx.x; p < B; p += THREADS) {
        const Best y{__ldcg(&ws[r * B + p].v), __ldcg(&ws[r * B + p].i)};
        if (before(y, x)) x = y;
    }
    x = block_best(x);
    if (threadIdx.x == 0) {
        out[r] = x.i;
        counters[r] = 0;
    }
}
