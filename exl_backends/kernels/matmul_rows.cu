// matmul_rows.cu: y = x @ W^T (+ bias) for 1, <= 8 and <= 16 rows of x (decode steps, speculative verify steps,
// small batches), each launch after stage_xs. Launcher: quant_matmul.py (QuantMatmul._small and _stage). Device
// code: qmm_rows.cuh.
#include "qmm_rows.cuh"

// Blocks per SM the register budget is fitted to (planning.RESIDENT_BLOCKS): M1 2, up to 128 registers (it ran
// at 3, 80 registers, until its pipelined batches needed more; 2 blocks measured faster even without them, and 4 no
// faster); M8 and M16 1 (168-247 registers, pipelined: 8-25 % faster than 2 blocks unpipelined;
// docs/decode-matmul.md). QMM_M1_BLOCKS: for benchmarks/tune_matmul.py.
// ys: the parts' outputs [M, part.n] fp16; ws: split partials (fp32, see Part.ws_offset), unused without splits.
#define QMM_MATMUL(NAME, FMT, N8, M1, BLOCKS_PER_SM)                                                                   \
    extern "C" __global__ void __launch_bounds__(qmm::THREADS, BLOCKS_PER_SM)                                          \
    NAME(const __grid_constant__ qmm::Params p, const half* x, half* y0, half* y1, half* y2, float* ws)              \
    {                                                                                                                  \
        exl::pdl_trigger();                                                                                           \
        qmm::matmul<FMT, N8, M1>(p, x, y0, y1, y2, ws, blockIdx.x, blockDim.x / 32);                                  \
    }

// One row: the chain says what the launch's last act is besides y (qmm_rows.cuh STAGE-FREE NORM; all null: y).
#define QMM_MATMUL_M1(NAME, FMT)                                                                                       \
    extern "C" __global__ void __launch_bounds__(qmm::THREADS, QMM_M1_BLOCKS)                                          \
    NAME(const __grid_constant__ qmm::Params p, const half* x, half* y0, half* y1, half* y2, float* ws,              \
         const __grid_constant__ qmm::Chain chain)                                                                     \
    {                                                                                                                  \
        exl::pdl_trigger();                                                                                           \
        __shared__ qmm::EndLines end_s[qmm::WARPS];                                                                   \
        qmm::matmul<FMT, 1, true>(p, x, y0, y1, y2, ws, blockIdx.x, blockDim.x / 32, qmm::PdlWait(), chain, end_s);\
    }

#ifndef QMM_M1_BLOCKS
#define QMM_M1_BLOCKS 2
#endif
QMM_MATMUL_M1(exl2_matmul_m1, qmm::Exl2)
QMM_MATMUL(exl2_matmul_m8, qmm::Exl2, 1, false, 1)
QMM_MATMUL(exl2_matmul_m16, qmm::Exl2, 2, false, 1)
QMM_MATMUL_M1(gptq_matmul_m1, qmm::Gptq)
QMM_MATMUL(gptq_matmul_m8, qmm::Gptq, 1, false, 1)
QMM_MATMUL(gptq_matmul_m16, qmm::Gptq, 2, false, 1)

// grid (ceil(K / 32 / 8), parts, 1 / 8 / 16 staged rows), block 256: x (or silu(x) * up, or the add_rmsnorm of x)
// staged for the small-M kernels (qmm::stage_xs); dynamic shared memory 2K bytes with norm_w, else none.
extern "C" __global__ void __launch_bounds__(qmm::THREADS)
stage_xs(const __grid_constant__ qmm::Params p, const half* x, const half* up, const half* residual,
         const half* norm_w, half* new_residual, float eps, half* xs)
{
    exl::pdl_trigger();
    qmm::stage_xs(p, x, up, residual, norm_w, new_residual, eps, xs, blockIdx.x, blockIdx.y, blockIdx.z, gridDim.z);
}
