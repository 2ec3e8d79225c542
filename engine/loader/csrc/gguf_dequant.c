/* A GGUF file's Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K blocks -> float32, in one pass over the blocks and
 * over the threads.
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
 * Byte j of the nibbles holds element j in its low half and element j + 16 in its high half. The K types
 * (the blocks of Q4_K_M and Q5_K_M files) are super-blocks of 256, decoded as gguf-py decodes them (their
 * numpy path makes many passes over each tensor: about 10x this decoder's time for Q4_K and Q5_K,
 * benchmarks/gguf_dequant.py and docs/benchmarking.md). */
#include <stdint.h>
#include <string.h>

#include "kernel_math.h"   /* engine/csrc: f16_to_f32 */

#define QK 32
#define QK_K 256

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j (0..7) from the super-block's 12 packed bytes
 * (llama.cpp's get_scale_min_k4; gguf-py's Q4_K.get_scale_min). */
INLINE void scale_min_k4(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 0x3F;
        *mn = s[j + 4] & 0x3F;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    }
}

/* One super-block of 256 (type 3: Q4_K, 144 bytes: d, dmin, 12 bytes of scales, 128 of nibbles; 4: Q5_K,
 * 176 bytes: the same with 32 bytes of fifth bits before the nibbles; 5: Q6_K, 210 bytes: 128 bytes of low
 * nibbles, 64 of high pairs, 16 int8 scales, d). The products are gguf-py's: d * sc and dmin * m first
 * (exact in float32), then (d * sc) * q and the min subtracted (Q4_K, Q5_K: the product is exact, one
 * rounding at the subtraction; Q6_K: one rounding at the product, as there). */
INLINE void super_block(const uint8_t *blk, int type, float *o) {
    uint16_t h;
    if (type == 5) {   /* each half of 128: byte l of its ql and qh gives elements l, 32 + l, 64 + l, 96 + l */
        memcpy(&h, blk + 208, 2);
        float d = f16_to_f32(h);
        for (int g = 0; g < 2; g++) {
            const uint8_t *ql = blk + 64 * g, *qh = blk + 128 + 32 * g;
            const int8_t *sc = (const int8_t *)(blk + 192) + 8 * g;
            float *y = o + 128 * g;
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                y[l] = (d * (float)sc[is]) * (float)(((ql[l] & 0x0F) | ((qh[l] & 0x03) << 4)) - 32);
                y[l + 32] = (d * (float)sc[is + 2]) * (float)(((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 0x03) << 4)) - 32);
                y[l + 64] = (d * (float)sc[is + 4]) * (float)(((ql[l] >> 4) | (((qh[l] >> 4) & 0x03) << 4)) - 32);
                y[l + 96] = (d * (float)sc[is + 6]) * (float)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 0x03) << 4)) - 32);
            }
        }
        return;
    }
    memcpy(&h, blk, 2);
    float d = f16_to_f32(h);
    memcpy(&h, blk + 2, 2);
    float dmin = f16_to_f32(h);
    const uint8_t *scales = blk + 4, *qh = blk + 16, *qs = blk + (type == 4 ? 48 : 16);
    for (int sub = 0; sub < 8; sub++) {
        int sc, mn;
        scale_min_k4(scales, sub, &sc, &mn);
        float dl = d * (float)sc, ml = dmin * (float)mn;
        int g = sub / 2, s = sub % 2;
        for (int i = 0; i < 32; i++) {
            int q = (qs[g * 32 + i] >> (4 * s)) & 0x0F;
            if (type == 4) q |= ((qh[i] >> sub) & 1) << 4;
            o[sub * 32 + i] = dl * (float)q - ml;
        }
    }
}

/* type: 0 Q4_0, 1 Q4_1, 2 Q8_0 (blocks of 32), 3 Q4_K, 4 Q5_K, 5 Q6_K (super-blocks of 256). */
void gguf_dequant(const uint8_t *raw, int64_t nblocks, int type, float *out) {
    static const int bytes_of[] = {18, 20, 34, 144, 176, 210};
    int bytes = bytes_of[type];
    if (type >= 3) {
#pragma omp parallel for schedule(static) if (nblocks >= 512)
        for (int64_t b = 0; b < nblocks; b++) super_block(raw + b * bytes, type, out + b * QK_K);
        return;
    }
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
