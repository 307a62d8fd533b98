// lane_layout.cu: an EXL2 weight's codes repacked into the quantized matmuls' lane layout on the GPU (dequant.cuh:
// LANE LAYOUT), one launch per run of one bit width: a load's repack without the ~20 torch operations per slab of
// the CPU path (quant_matmul.lane_words over unpack_codes, the specification; a GPU test compares them word for
// word). Launcher: quant_matmul.py (exl2_lane_words).
//
// exl2_lane_words  grid (ceil(chunks / 8), strips), block 256: warp w of block (bx, strip) is chunk 8 bx + w of the
//   run, its lane l packs that lane's B words (encode_lane). q_weight int32 [rows, Np], row-major: the run's codes
//   are a little-endian bit stream down each column from word row qrow0 (chunk row r of column n at stream bit
//   (32 c + r) B; 3-, 5- and 6-bit codes may straddle two words). The words go to out[strip * words_per_strip +
//   run_word + c * 32 B + ...] in planes of 4, 2 and 1 words a lane (quant_matmul.plane_words): plane i, of W words
//   a lane and starting at word J of the lane's B, holds the lane's words J..J + W at 32 J + l W.
#include "dequant.cuh"

extern "C" __global__ void __launch_bounds__(256)
exl2_lane_words(const unsigned* __restrict__ qw, int np, int qrow0, int B, int chunks, unsigned* __restrict__ out,
                int words_per_strip, int run_word)
{
    const int strip = blockIdx.y, c = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (c >= chunks) return;
    const unsigned* column = qw + (size_t)qrow0 * np + strip * 32;
    unsigned w[8];
    qmm::encode_lane(w, B, lane, [&](int row, int col) {
        const long long bit = (long long)(32 * c + row) * B;
        const unsigned* word = column + (size_t)(bit / 32) * np + col;
        unsigned long long v = word[0];
        if (bit % 32 + B > 32) v |= (unsigned long long)word[np] << 32;
        return (unsigned)(v >> bit % 32) & ((1u << B) - 1u);
    });
    unsigned* o = out + (size_t)strip * words_per_strip + run_word + (size_t)c * 32 * B;
    int first = 0;
    for (int width = 4; width >= 1; width /= 2)
        for (int n = 0; n < (width == 4 ? B / 4 : width == 2 ? B % 4 / 2 : B % 2); ++n, first += width)
            for (int i = 0; i < width; ++i) o[32 * first + lane * width + i] = w[first + i];
}
