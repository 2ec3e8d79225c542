/* y = x @ W^T with W in a GGUF file's own blocks of 32 weights along K, for decode and small batches.
 *
 * Weights, repacked once at load by engine/models/qmatmul.py (``pack``; the values are the file's), in
 * groups of G = 16 output rows (N padded to a multiple of 16 with zero rows), block b of a group holding
 * its 16 rows' block b side by side, 4 bytes of each row at a time, so that one 64-byte load is 4 bytes
 * of every row of the group (one 32-bit lane per row):
 * Each block of a group is one record, read as one stream:
 *   4-bit (Q4_1, and Q4_0 as Q4_1 with m = -8 d), 320 bytes: qs [4, 16, 4] (chunk j, row r, byte t is byte
 *     4j + t of the row's GGUF block: element 4j + t in its low nibble, 16 + 4j + t in its high one), then
 *     d [16] and m [16] float16 (GGUF's own): w = d * q + m, q in 0..15.
 *   8-bit (Q8_0), 544 bytes: qs [8, 16, 4] (chunk j, row r, byte t is element 4j + t as q + 128,
 *     unsigned), then d [16] float16: w = d * q.
 * Activations are quantized per block of 32 to int8 (llama.cpp's Q8_1 idea): xd = max|x| / 127,
 * xq = round_half_even(x * (1 / xd)), xi = sum(xq), xs = xd * xi (what the 4-bit min term needs). Per
 * block, for the 16 rows of a group at once (a vector with one lane per row):
 *   4-bit: d * xd * sum(q * xq) + m * xs        8-bit: d * xd * sum(q * xq)
 * the integer sums exact: AVX512-VNNI vpdpbusd (unsigned weight bytes x 4 signed activation bytes
 * broadcast to every lane; for 8 bits sum((q + 128) * xq) - 128 xi), AVX2 vpmaddubsw / vpmaddwd (4 bits:
 * the int16 pair sums of a whole block stay below 2^15; 8 bits: |q| times xq with q's sign), portable C
 * elsewhere; the blocks accumulate in float32 and no horizontal sums are needed. Groups of rows are split
 * over the OpenMP threads (torch's pool). Activations are read as float32 or bfloat16 and y written as
 * either. One code path per build, fixed by the compiler's target (-march); qmm_variant() says which.
 * engine/models/qmatmul.py holds the plain references.
 */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QMM_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QMM_AVX2 1
#else
/* The portable path's float sums in the order written. Reassociated (-fassociative-math, which the vector
 * paths' intrinsics do not depend on), GCC ordered a row's block sums differently by how many rows shared
 * the pass (a Sapphire Rapids -march=native with -mno-avx2), so a row's values depended on its batch.
 * Before every function, kernel_math.h's included, so all of them are compiled with the same options. */
#pragma GCC optimize("no-associative-math")
#endif

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernel_math.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define QK 32
#define G 16      /* output rows per group */
#define MAX_M 8   /* activation rows multiplied per pass over the weights */
#define Q4_BYTES (256 + 4 * G)   /* one block of a group: qs, d, m */
#define Q8_BYTES (512 + 2 * G)   /* qs, d */
/* Each thread reads its rows' records as one stream; asking for the bytes this far ahead of the record
 * being read took a 2-thread stream from ~35-42 to ~45-52 GB/s here (the hardware prefetcher alone
 * leaves the memory idle part of the time). */
#define PREFETCH_AHEAD 8192

INLINE void prefetch_record(const uint8_t *rec, int bytes) {
    for (int j = 0; j < bytes; j += 64) __builtin_prefetch(rec + PREFETCH_AHEAD + j, 0, 3);
}

/* f16_to_f32 (kernel_math.h): the portable path's half -> float; the vector paths convert with vcvtph2ps */

const char *qmm_variant(void) {
#if defined(QMM_VNNI)
    return "avx512vnni";
#elif defined(QMM_AVX2)
    return "avx2";
#else
    return "portable";
#endif
}

/* x: [M, K] (float32, or bfloat16 where bf16) -> xq [M, K] int8, xd, xs [M, K/32] float32, xi [M, K/32]
 * int32 (K a multiple of 32). */
static void quantize_rows(const void *x, int bf16, int64_t M, int64_t K, int8_t *xq, float *xd, float *xs,
                          int32_t *xi) {
    int64_t nb = K / QK;
#pragma omp parallel for schedule(static) if (M > MAX_M)
    for (int64_t i = 0; i < M * nb; i++) {
        float v[QK];
        if (bf16)
            for (int j = 0; j < QK; j++) v[j] = bf16_to_f32(((const uint16_t *)x)[i * QK + j]);
        else
            memcpy(v, (const float *)x + i * QK, sizeof v);
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(v[j]));
        float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            int q = (int)nearbyintf(v[j] * id);
            xq[i * QK + j] = (int8_t)q;
            sum += q;
        }
        xd[i] = d;
        xs[i] = d * (float)sum;
        xi[i] = sum;
    }
}

/* float32 x: the activation quantization alone (engine/models/qmatmul.py's quantize_activations is its
 * reference). */
void qmm_quantize_rows(const float *x, int64_t M, int64_t K, int8_t *xq, float *xd, float *xs) {
    int32_t *xi = malloc(sizeof(int32_t) * (size_t)(M * (K / QK)) + 1);
    if (!xi) return;
    quantize_rows(x, 0, M, K, xq, xd, xs, xi);
    free(xi);
}

/* Activation rows of one pass: r-th row's block b at q + r * K + b * 32, its scales at [r * nb + b]. */
typedef struct {
    const int8_t *q;
    const float *d, *s;
    const int32_t *i;
    int64_t K, nb;
} acts;

INLINE int32_t load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* One group of 16 rows (its block records from w) against M (<= MAX_M, a constant after inlining)
 * activation rows: out[r * 16 + i] = y of activation row r, group row i. */
INLINE void q4_group(const uint8_t *w, const acts a, const int M, float *out) {
    const int64_t nb = a.nb;
#if defined(QMM_VNNI)
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[MAX_M];
    for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch_record(w + b * Q4_BYTES, Q4_BYTES);
        __m512i lo[4], hi[4];
        for (int j = 0; j < 4; j++) {
            __m512i raw = _mm512_loadu_si512(w + b * Q4_BYTES + j * 64);
            lo[j] = _mm512_and_si512(raw, low);
            hi[j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
        const uint8_t *sc = w + b * Q4_BYTES + 256;
        __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
        __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 2 * G)));
        for (int r = 0; r < M; r++) {
            const int8_t *x = a.q + r * a.K + b * QK;
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++) {
                s0 = _mm512_dpbusd_epi32(s0, lo[j], _mm512_set1_epi32(load4(x + 4 * j)));
                s1 = _mm512_dpbusd_epi32(s1, hi[j], _mm512_set1_epi32(load4(x + 16 + 4 * j)));
            }
            __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_set1_ps(a.d[r * nb + b]));
            acc[r] = _mm512_fmadd_ps(p, dv, acc[r]);
            acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.s[r * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < M; r++) _mm512_storeu_ps(out + r * G, acc[r]);
#elif defined(QMM_AVX2)
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    if (M <= 2) {
        /* A decode step's one row (or two): both halves of each record in one sweep, so each broadcast of
         * x serves 16 rows and the record is read once; 4 accumulators and the int16 sums fit the 16
         * registers. The same sums in the same order as the loop below. */
        __m256 acc[2][2];
        for (int r = 0; r < M; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *rec = w + b * Q4_BYTES;
            prefetch_record(rec, Q4_BYTES);
            __m256i s[2][2];
            for (int r = 0; r < M; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                __m256i raw0 = _mm256_loadu_si256((const __m256i *)(rec + j * 64));
                __m256i raw1 = _mm256_loadu_si256((const __m256i *)(rec + j * 64 + 32));
                __m256i lo0 = _mm256_and_si256(raw0, low), hi0 = _mm256_and_si256(_mm256_srli_epi16(raw0, 4), low);
                __m256i lo1 = _mm256_and_si256(raw1, low), hi1 = _mm256_and_si256(_mm256_srli_epi16(raw1, 4), low);
                for (int r = 0; r < M; r++) {
                    const int8_t *x = a.q + r * a.K + b * QK;
                    __m256i xl = _mm256_set1_epi32(load4(x + 4 * j)), xh = _mm256_set1_epi32(load4(x + 16 + 4 * j));
                    s[r][0] = _mm256_add_epi16(s[r][0], _mm256_maddubs_epi16(lo0, xl));
                    s[r][0] = _mm256_add_epi16(s[r][0], _mm256_maddubs_epi16(hi0, xh));
                    s[r][1] = _mm256_add_epi16(s[r][1], _mm256_maddubs_epi16(lo1, xl));
                    s[r][1] = _mm256_add_epi16(s[r][1], _mm256_maddubs_epi16(hi1, xh));
                }
            }
            for (int h = 0; h < 2; h++) {
                __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 256 + h * 16)));
                __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 256 + 2 * G + h * 16)));
                for (int r = 0; r < M; r++) {
                    __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s[r][h], ones)),
                                             _mm256_set1_ps(a.d[r * nb + b]));
                    acc[r][h] = _mm256_fmadd_ps(p, dv, acc[r][h]);
                    acc[r][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a.s[r * nb + b]), acc[r][h]);
                }
            }
        }
        for (int r = 0; r < M; r++)
            for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + r * G + h * 8, acc[r][h]);
        return;
    }
    for (int h = 0; h < 2; h++) {                              /* rows 8h .. 8h + 7 */
        __m256 acc[MAX_M];
        for (int r = 0; r < M; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            if (h == 0) prefetch_record(w + b * Q4_BYTES, Q4_BYTES);   /* the second half re-reads from L1 */
            __m256i lo[4], hi[4];
            for (int j = 0; j < 4; j++) {
                __m256i raw = _mm256_loadu_si256((const __m256i *)(w + b * Q4_BYTES + j * 64 + h * 32));
                lo[j] = _mm256_and_si256(raw, low);
                hi[j] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            }
            const uint8_t *sc = w + b * Q4_BYTES + 256 + h * 16;
            __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sc));
            __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 2 * G)));
            for (int r = 0; r < M; r++) {
                const int8_t *x = a.q + r * a.K + b * QK;
                /* int16 pair sums: each at most 2 * 15 * 127, so the 8 of a block stay below 2^15 */
                __m256i s = _mm256_setzero_si256();
                for (int j = 0; j < 4; j++) {
                    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[j], _mm256_set1_epi32(load4(x + 4 * j))));
                    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[j], _mm256_set1_epi32(load4(x + 16 + 4 * j))));
                }
                __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones)),
                                         _mm256_set1_ps(a.d[r * nb + b]));
                acc[r] = _mm256_fmadd_ps(p, dv, acc[r]);
                acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a.s[r * nb + b]), acc[r]);
            }
        }
        for (int r = 0; r < M; r++) _mm256_storeu_ps(out + r * G + h * 8, acc[r]);
    }
#else
    float acc[MAX_M * G] = {0};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *qs = w + b * Q4_BYTES;
        prefetch_record(qs, Q4_BYTES);
        uint16_t d[G], mn[G];
        memcpy(d, qs + 256, sizeof d);
        memcpy(mn, qs + 256 + 2 * G, sizeof mn);
        for (int r = 0; r < M; r++) {
            const int8_t *x = a.q + r * a.K + b * QK;
            for (int i = 0; i < G; i++) {
                int32_t s = 0;
                for (int j = 0; j < 4; j++)
                    for (int t = 0; t < 4; t++) {
                        uint8_t v = qs[j * 64 + i * 4 + t];
                        s += (v & 0x0F) * x[4 * j + t] + (v >> 4) * x[16 + 4 * j + t];
                    }
                acc[r * G + i] += (float)s * a.d[r * nb + b] * f16_to_f32(d[i]) + f16_to_f32(mn[i]) * a.s[r * nb + b];
            }
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)(M * G));
#endif
}

INLINE void q8_group(const uint8_t *w, const acts a, const int M, float *out) {
    const int64_t nb = a.nb;
#if defined(QMM_VNNI)
    __m512 acc[MAX_M];
    for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch_record(w + b * Q8_BYTES, Q8_BYTES);
        __m512i q[8];
        for (int j = 0; j < 8; j++) q[j] = _mm512_loadu_si512(w + b * Q8_BYTES + j * 64);
        __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + b * Q8_BYTES + 512)));
        for (int r = 0; r < M; r++) {
            const int8_t *x = a.q + r * a.K + b * QK;
            __m512i s0 = _mm512_set1_epi32(-128 * a.i[r * nb + b]), s1 = _mm512_setzero_si512();
            for (int j = 0; j < 8; j += 2) {   /* sum((q + 128) * xq) - 128 sum(xq) = sum(q * xq) */
                s0 = _mm512_dpbusd_epi32(s0, q[j], _mm512_set1_epi32(load4(x + 4 * j)));
                s1 = _mm512_dpbusd_epi32(s1, q[j + 1], _mm512_set1_epi32(load4(x + 4 * j + 4)));
            }
            __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_set1_ps(a.d[r * nb + b]));
            acc[r] = _mm512_fmadd_ps(p, dv, acc[r]);
        }
    }
    for (int r = 0; r < M; r++) _mm512_storeu_ps(out + r * G, acc[r]);
#elif defined(QMM_AVX2)
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    if (M <= 2) {
        /* As q4_group's: both halves of each record in one sweep for a pass of one or two rows (the LM
         * head of a decode step), the same sums in the same order as the loop below. */
        __m256 acc[2][2];
        for (int r = 0; r < M; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *rec = w + b * Q8_BYTES;
            prefetch_record(rec, Q8_BYTES);
            __m256i s[2][2];
            for (int r = 0; r < M; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                __m256i q0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(rec + j * 64)), flip);
                __m256i q1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(rec + j * 64 + 32)), flip);
                __m256i aq0 = _mm256_sign_epi8(q0, q0), aq1 = _mm256_sign_epi8(q1, q1);
                for (int r = 0; r < M; r++) {
                    __m256i xj = _mm256_set1_epi32(load4(a.q + r * a.K + b * QK + 4 * j));
                    __m256i p0 = _mm256_maddubs_epi16(aq0, _mm256_sign_epi8(xj, q0));
                    __m256i p1 = _mm256_maddubs_epi16(aq1, _mm256_sign_epi8(xj, q1));
                    s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(p0, ones));
                    s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(p1, ones));
                }
            }
            for (int h = 0; h < 2; h++) {
                __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 512 + h * 16)));
                for (int r = 0; r < M; r++) {
                    __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(s[r][h]), _mm256_set1_ps(a.d[r * nb + b]));
                    acc[r][h] = _mm256_fmadd_ps(p, dv, acc[r][h]);
                }
            }
        }
        for (int r = 0; r < M; r++)
            for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + r * G + h * 8, acc[r][h]);
        return;
    }
    for (int h = 0; h < 2; h++) {
        __m256 acc[MAX_M];
        for (int r = 0; r < M; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            if (h == 0) prefetch_record(w + b * Q8_BYTES, Q8_BYTES);
            __m256i q[8], aq[8];
            for (int j = 0; j < 8; j++) {
                q[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + b * Q8_BYTES + j * 64 + h * 32)), flip);
                aq[j] = _mm256_sign_epi8(q[j], q[j]);          /* |q| as unsigned bytes (-128 -> 128) */
            }
            __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + b * Q8_BYTES + 512 + h * 16)));
            for (int r = 0; r < M; r++) {
                const int8_t *x = a.q + r * a.K + b * QK;
                __m256i s = _mm256_setzero_si256();
                for (int j = 0; j < 8; j++) {   /* |q| * (xq with q's sign): pairs at most 2 * 128 * 127 */
                    __m256i p = _mm256_maddubs_epi16(aq[j], _mm256_sign_epi8(_mm256_set1_epi32(load4(x + 4 * j)), q[j]));
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
                }
                __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(a.d[r * nb + b]));
                acc[r] = _mm256_fmadd_ps(p, dv, acc[r]);
            }
        }
        for (int r = 0; r < M; r++) _mm256_storeu_ps(out + r * G + h * 8, acc[r]);
    }
#else
    float acc[MAX_M * G] = {0};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *qs = w + b * Q8_BYTES;
        prefetch_record(qs, Q8_BYTES);
        uint16_t d[G];
        memcpy(d, qs + 512, sizeof d);
        for (int r = 0; r < M; r++) {
            const int8_t *x = a.q + r * a.K + b * QK;
            for (int i = 0; i < G; i++) {
                int32_t s = 0;
                for (int j = 0; j < 8; j++)
                    for (int t = 0; t < 4; t++) s += ((int)qs[j * 64 + i * 4 + t] - 128) * x[4 * j + t];
                acc[r * G + i] += (float)s * a.d[r * nb + b] * f16_to_f32(d[i]);
            }
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)(M * G));
#endif
}

/* Dispatch one group to the specialisation for m rows (1..MAX_M), so each unrolls. */
#define BY_M(m, CALL) switch (m) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; \
    case 4: CALL(4); break; case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; \
    default: CALL(8); }

/* x [M, K] float32 or bfloat16 times weights [N, K] packed as above -> y [M, N] float32 or bfloat16.
 * Returns 0, -1 for K not a multiple of 32, -2 when out of memory. */
static int qmm(int bits, const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y,
               int y_bf16) {
    if (K % QK) return -1;
    int64_t nb = K / QK, groups = (N + G - 1) / G;
    size_t qbytes = (size_t)((M * K + 63) / 64 * 64);
    int8_t *buf = malloc(qbytes + (2 * sizeof(float) + sizeof(int32_t)) * (size_t)(M * nb) + 64);
    if (!buf) return -2;
    float *xd = (float *)(buf + qbytes), *xs = xd + M * nb;
    int32_t *xi = (int32_t *)(xs + M * nb);
    quantize_rows(x, x_bf16, M, K, buf, xd, xs, xi);
    const int64_t wbytes = bits == 4 ? Q4_BYTES : Q8_BYTES;
    /* (pass of MAX_M rows, group) tasks in one parallel region: a prefill chunk of 512 rows is 64 passes,
     * and a region per pass paid a thread barrier each (most of a pass's time on 2 busy cores) */
    const int64_t passes = (M + MAX_M - 1) / MAX_M;
#pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < passes * groups; task++) {
        const int64_t r0 = task / groups * MAX_M, g = task % groups;
        int m = M - r0 < MAX_M ? (int)(M - r0) : MAX_M;
        const acts a = {buf + r0 * K, xd + r0 * nb, xs + r0 * nb, xi + r0 * nb, K, nb};
        float out[MAX_M * G];
        const uint8_t *wg = w + g * nb * wbytes;
        if (bits == 4) {
#define Q4(c) q4_group(wg, a, c, out)
            BY_M(m, Q4)
        } else {
#define Q8(c) q8_group(wg, a, c, out)
            BY_M(m, Q8)
        }
        int64_t n0 = g * G, rows = N - n0 < G ? N - n0 : G;
        for (int r = 0; r < m; r++) {
            int64_t at = (r0 + r) * N + n0;
            if (y_bf16)
                for (int64_t i = 0; i < rows; i++) ((uint16_t *)y)[at + i] = f32_to_bf16(out[r * G + i]);
            else
                memcpy((float *)y + at, out + r * G, sizeof(float) * (size_t)rows);
        }
    }
    free(buf);
    return 0;
}

int qmm_q4(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y, int y_bf16) {
    return qmm(4, x, x_bf16, M, K, w, N, y, y_bf16);
}

int qmm_q8(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y, int y_bf16) {
    return qmm(8, x, x_bf16, M, K, w, N, y, y_bf16);
}

/* A SwiGLU MLP of a few float32 rows on 4-bit blocks in one call, as a decode step runs it: y [M, N] =
 * down(silu(gate) * up) with [gate; up] = x [M, K] @ gate_up^T ([2 I, K] packed), down [N, I] packed. The
 * same kernels and the same silu (kernel_math.h's silu_f32, as layer_ops.c's silu_mul_f32) as three
 * separate calls; one call from Python instead of three. Returns qmm's codes. */
int qmm_swiglu_q4_f32(const float *x, int64_t M, int64_t K, const uint8_t *gate_up, int64_t I, const uint8_t *down,
                      int64_t N, float *y) {
    float *gu = malloc(sizeof(float) * (size_t)(M * 3 * I) + 64);
    if (!gu) return -2;
    float *act = gu + M * 2 * I;
    int rc = qmm(4, x, 0, M, K, gate_up, 2 * I, gu, 0);
    if (rc == 0) {
#pragma omp parallel for schedule(static) if (M > MAX_M)
        for (int64_t t = 0; t < M; t++) {
            const float *g = gu + t * 2 * I, *u = g + I;
            float *o = act + t * I;
#pragma omp simd
            for (int64_t i = 0; i < I; i++) o[i] = silu_f32(g[i]) * u[i];
        }
        rc = qmm(4, act, 0, M, I, down, N, y, 0);
    }
    free(gu);
    return rc;
}
