/* A GGUF file's Q4_0, Q4_1 and Q8_0 blocks -> float32, in one pass over the blocks and over the threads.
 *
 * engine/loader/gguf_file.py's dequantize_numpy() decodes these types exactly as gguf-py's
 * gguf.quants.dequantize computes them; this does the same arithmetic in the same order (a multiply, then
 * for Q4_1 an add). Each product d * q is exact in float32 (a float16's 11-bit significand times an integer
 * of at most 8 bits), so the only rounding is Q4_1's add, in both, and the values are the same bit for bit
 * (tests/engine/test_gguf_dequant.py checks every block tensor of the default model). numpy takes
 * several passes over each tensor (nibbles, widening, product, sum) on one thread: 0.46 of an engine
 * build's 1.38 s at one thread for the default model's 210 Q4_1 tensors.
 *
 * Blocks of 32 weights: Q4_0 (18 bytes: float16 d, 16 bytes of nibbles; w = d * (q - 8)), Q4_1 (20 bytes:
 * float16 d and m, 16 bytes of nibbles; w = d * q + m), Q8_0 (34 bytes: float16 d, 32 int8; w = d * q).
 * Byte j of the nibbles holds element j in its low half and element j + 16 in its high half. */
#include <stdint.h>
#include <string.h>

#include "kernel_math.h"   /* engine/csrc: f16_to_f32 */

#define QK 32

void gguf_dequant(const uint8_t *raw, int64_t nblocks, int type, float *out) {
    int bytes = type == 0 ? 18 : type == 1 ? 20 : 34;
#pragma omp parallel for schedule(static) if (nblocks >= 4096)
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *blk = raw + b * bytes;
        float *o = out + b * QK;
        uint16_t h;
        memcpy(&h, blk, 2);
        float d = f16_to_f32(h);
        if (type == 2) {
            const int8_t *q = (const int8_t *)(blk + 2);
            for (int j = 0; j < QK; j++) o[j] = (float)q[j] * d;
        } else if (type == 1) {
            memcpy(&h, blk + 2, 2);
            float m = f16_to_f32(h);
            const uint8_t *qs = blk + 4;
            for (int j = 0; j < QK / 2; j++) {
                o[j] = d * (float)(qs[j] & 0x0F) + m;
                o[j + QK / 2] = d * (float)(qs[j] >> 4) + m;
            }
        } else {
            const uint8_t *qs = blk + 2;
            for (int j = 0; j < QK / 2; j++) {
                o[j] = d * (float)((int)(qs[j] & 0x0F) - 8);
                o[j + QK / 2] = d * (float)((int)(qs[j] >> 4) - 8);
            }
        }
    }
}
