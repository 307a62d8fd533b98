// matmul_moe.cu: the expert-indexed matmuls of a mixture-of-experts layer (one launch over all experts, each
// reading its weights only if a row was routed to it). Launcher: matmul_moe.py (ExpertMatmul). Device code:
// qmm_rows.cuh (moe_matmul).
#include "qmm_rows.cuh"

#ifndef QMM_M1_BLOCKS
#define QMM_M1_BLOCKS 2
#endif

// MoE (qmm::moe_matmul): grid (blocks per expert, experts, passes of 1 or 16 rows), block 256, dynamic shared memory
// as the experts' plans say. experts: Params [E] in device memory (parts w1, w3 or w2 of each expert).
#define QMM_MOE(NAME, FMT, N8, M1, BLOCKS_PER_SM)                                                                      \
    extern "C" __global__ void __launch_bounds__(qmm::THREADS, BLOCKS_PER_SM)                                          \
    NAME(const qmm::Params* experts, const int* offsets, const int* counts, int S, const half* x, half* y0,          \
         half* y1, float* ws, long long ws_part, int* counters, int strips_max)                                      \
    {                                                                                                                  \
        exl::pdl_trigger();                                                                                           \
        qmm::moe_matmul<FMT, N8, M1>(experts, offsets, counts, S, x, y0, y1, ws, ws_part, counters, strips_max);     \
    }

QMM_MOE(exl2_moe_m1, qmm::Exl2, 1, true, QMM_M1_BLOCKS)
QMM_MOE(exl2_moe_m16, qmm::Exl2, 2, false, 2)
QMM_MOE(gptq_moe_m1, qmm::Gptq, 1, true, QMM_M1_BLOCKS)
QMM_MOE(gptq_moe_m16, qmm::Gptq, 2, false, 2)
