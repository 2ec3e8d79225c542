/* y = x @ W^T with W in a GGUF file's own blocks of 32 weights along K, for decode and small batches.
 *
 * Weights (repacked once at load by engine/models/qmatmul.py; the values are the file's):
 *   4-bit (Q4_1, and Q4_0 as Q4_1 with m = -8 d): qs [N, K/32, 16] bytes, byte j of a block holding
 *     element j in its low nibble and element j + 16 in its high nibble (GGUF's order); d, m [N, K/32]
 *     float32: w = d * q + m, q in 0..15.
 *   8-bit (Q8_0): qs [N, K] int8; d [N, K/32] float32: w = d * q.
 * Activations are quantized per block of 32 to int8 (llama.cpp's Q8_1 idea): xd = max|x| / 127,
 * xq = round_half_even(x * (1 / xd)), xs = xd * sum(xq) (what the 4-bit min term needs). Then per block
 *   4-bit: d * xd * sum(q * xq) + m * xs        8-bit: d * xd * sum(q * xq)
 * with the integer sums exact (AVX2: vpmaddubsw unsigned x signed bytes -> int16 pairs, vpmaddwd -> int32)
 * and the blocks accumulated in float32. Output rows are split over the OpenMP threads (torch's pool).
 * One code path per build: AVX2 where the compiler targets it (-march=native on an AVX2 CPU), portable C
 * otherwise; qmm_variant() says which. engine/models/qmatmul.py holds the plain references.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define QK 32
#define MAX_M 8   /* activation rows multiplied per pass over the weights */

const char *qmm_variant(void) {
#ifdef __AVX2__
    return "avx2";
#else
    return "portable";
#endif
}

/* x: [M, K] float32 -> xq [M, K] int8, xd and xs [M, K/32] float32 (K a multiple of 32). */
void qmm_quantize_rows(const float *x, int64_t M, int64_t K, int8_t *xq, float *xd, float *xs) {
    int64_t nb = K / QK;
    for (int64_t i = 0; i < M * nb; i++) {
        const float *v = x + i * QK;
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
    }
}

#ifdef __AVX2__
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* One weight row against M (<= MAX_M, a constant after inlining) activation rows: out[r] for r < M. */
static inline __attribute__((always_inline)) void q4_row(const uint8_t *qs, const float *d, const float *mn,
        int64_t nb, const int8_t *xq, const float *xd, const float *xs, int64_t K, const int M, float *out) {
    float msum[MAX_M];
    for (int r = 0; r < M; r++) {
        float s = 0.0f;
        for (int64_t b = 0; b < nb; b++) s += mn[b] * xs[r * nb + b];
        msum[r] = s;
    }
#ifdef __AVX2__
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MAX_M];
    for (int r = 0; r < M; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m128i raw = _mm_loadu_si128((const __m128i *)(qs + b * 16));
        __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
        for (int r = 0; r < M; r++) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(xq + r * K + b * QK));
            __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d[b] * xd[r * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < M; r++) out[r] = hsum8(acc[r]) + msum[r];
#else
    float acc[MAX_M] = {0};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *q = qs + b * 16;
        for (int r = 0; r < M; r++) {
            const int8_t *a = xq + r * K + b * QK;
            int32_t s = 0;
            for (int j = 0; j < 16; j++) s += (q[j] & 0x0F) * a[j] + (q[j] >> 4) * a[j + 16];
            acc[r] += (float)s * (d[b] * xd[r * nb + b]);
        }
    }
    for (int r = 0; r < M; r++) out[r] = acc[r] + msum[r];
#endif
}

static inline __attribute__((always_inline)) void q8_row(const int8_t *qs, const float *d, int64_t nb,
        const int8_t *xq, const float *xd, int64_t K, const int M, float *out) {
#ifdef __AVX2__
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MAX_M];
    for (int r = 0; r < M; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(qs + b * QK));
        __m256i aw = _mm256_sign_epi8(w, w);            /* |w| as unsigned bytes (-128 -> 128) */
        for (int r = 0; r < M; r++) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(xq + r * K + b * QK));
            __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(a, w)), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d[b] * xd[r * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < M; r++) out[r] = hsum8(acc[r]);
#else
    float acc[MAX_M] = {0};
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *q = qs + b * QK;
        for (int r = 0; r < M; r++) {
            const int8_t *a = xq + r * K + b * QK;
            int32_t s = 0;
            for (int j = 0; j < QK; j++) s += q[j] * a[j];
            acc[r] += (float)s * (d[b] * xd[r * nb + b]);
        }
    }
    for (int r = 0; r < M; r++) out[r] = acc[r];
#endif
}

/* Dispatch one weight row to the specialisation for m rows (1..MAX_M), so each unrolls. */
#define BY_M(m, CALL) switch (m) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; \
    case 4: CALL(4); break; case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; \
    default: CALL(8); }

/* Quantized activations for x [M, K]; NULL if out of memory. One buffer: xq, then xd, then xs. */
static int8_t *quantize(const float *x, int64_t M, int64_t K, float **xd, float **xs) {
    int64_t nb = K / QK;
    int8_t *buf = malloc((size_t)(M * K) + 2 * sizeof(float) * (size_t)(M * nb) + 64);
    if (!buf) return NULL;
    *xd = (float *)(buf + ((M * K + 63) / 64) * 64);
    *xs = *xd + M * nb;
    qmm_quantize_rows(x, M, K, buf, *xd, *xs);
    return buf;
}

/* x [M, K] float32 times weights [N, K] (4-bit: qs, d, mn as above; 8-bit: qs int8, d, mn NULL) ->
 * y [M, N] float32. Returns 0, -1 for K not a multiple of 32, -2 when out of memory. */
static int qmm(int bits, const float *x, int64_t M, int64_t K, const void *qs, const float *d, const float *mn,
               int64_t N, float *y) {
    if (K % QK) return -1;
    float *xd, *xs;
    int8_t *xq = quantize(x, M, K, &xd, &xs);
    if (!xq) return -2;
    int64_t nb = K / QK;
    for (int64_t r0 = 0; r0 < M; r0 += MAX_M) {
        int m = M - r0 < MAX_M ? (int)(M - r0) : MAX_M;
        const int8_t *aq = xq + r0 * K;
        const float *ad = xd + r0 * nb, *as = xs + r0 * nb;
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            float out[MAX_M];
            if (bits == 4) {
#define Q4(c) q4_row((const uint8_t *)qs + n * nb * 16, d + n * nb, mn + n * nb, nb, aq, ad, as, K, c, out)
                BY_M(m, Q4)
            } else {
#define Q8(c) q8_row((const int8_t *)qs + n * K, d + n * nb, nb, aq, ad, K, c, out)
                BY_M(m, Q8)
            }
            for (int r = 0; r < m; r++) y[(r0 + r) * N + n] = out[r];
        }
    }
    free(xq);
    return 0;
}

int qmm_q4(const float *x, int64_t M, int64_t K, const uint8_t *qs, const float *d, const float *mn,
           int64_t N, float *y) {
    return qmm(4, x, M, K, qs, d, mn, N, y);
}

int qmm_q8(const float *x, int64_t M, int64_t K, const int8_t *qs, const float *d, int64_t N, float *y) {
    return qmm(8, x, M, K, qs, d, NULL, N, y);
}
