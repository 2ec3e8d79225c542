/* Paged decode attention for the CPU: one query token per row, each row over its own keys.
 *
 * The KV pool is the torch backend's head-major layout (engine/kv_pool.py, "HSD"): for one
 * layer, k and v are [Hkv, S, D] with S = pages * page_size, and a row's key i lives in slot
 * pages[i / P] * P + i % P. Nothing is gathered or copied: each (row, KV head, chunk of keys)
 * is one task that reads its pages in place, scores the G = Hq / Hkv query heads that share
 * that KV head (GQA), and keeps an unnormalised partial result (max, sum of exponentials,
 * weighted sum of values), as split-K "flash decoding" does. The partials of a row are then
 * merged by their log-sum-exp. So a step costs the sum of each row's own context, whatever
 * the other rows hold, and a long row is spread over every thread.
 *
 * Arithmetic is float32 throughout (bfloat16 inputs are widened exactly); the output is
 * rounded to the input dtype, bfloat16 to nearest even as torch rounds. The softmax uses
 * exp2 of a degree-6 polynomial (relative error below 1e-7) so that the loop vectorises.
 * Threads: OpenMP, loaded into the process torch's own libgomp already is (one thread pool).
 *
 * engine/attention/cpu_kernel.py builds and calls this; engine/attention/reference.py is
 * the oracle it is tested against (tests/engine/test_cpu_kernel.py).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 256          /* keys per task */
#define MAX_G 16           /* query heads per KV head */
#define MAX_D 256          /* head dim */

typedef union { uint32_t u; float f; } bits32;

static inline float bf16_to_f32(uint16_t x) {
    bits32 c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) {
    bits32 c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40u);  /* NaN stays NaN */
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);                   /* nearest even */
}

/* exp(x) for x <= 0 (clamped at -87, where it is below float32's smallest normal anyway). */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.4426950408889634f;          /* exp(x) = 2^t = 2^n * 2^f */
    float n = floorf(t);
    float f = t - n;                            /* [0, 1) */
    float p = 2.1877504861477862e-4f;           /* least-squares fit of 2^f, degree 6 */
    p = p * f + 1.2387821452754277e-3f;
    p = p * f + 9.6845804549791600e-3f;
    p = p * f + 5.5480426324716045e-2f;
    p = p * f + 2.4023050204510465e-1f;
    p = p * f + 6.9314692869304260e-1f;
    p = p * f + 1.0000000025868887f;
    bits32 c;
    c.u = (uint32_t)((int32_t)n + 127) << 23;   /* 2^n, n in [-126, 0] */
    return p * c.f;
}

/* One task's partial result over keys [k0, k1) of one row and one KV head:
 * m[g] = max score, l[g] = sum exp(score - m), acc[g] = sum exp(score - m) * v.
 * Pass 1 widens each key and value row once (values into vbuf, [CHUNK, D] float32) and
 * scores the G queries; pass 2 takes the exponentials; pass 3 sums the values one query at
 * a time, so that query's accumulator stays in registers. DIM is the head dim when it is a
 * compile-time constant (64, 128: the loops unroll), else the runtime D. */
#define DEFINE_CHUNK(NAME, T, TO_F32, DIM)                                                         \
static void NAME(const float *qf, const T *kh, const T *vh, const int32_t *pages, int P,          \
                 int64_t k0, int64_t k1, int G, int D, float *vbuf, float *m, float *l, float *acc) {\
    float s[MAX_G * CHUNK];                                                                          \
    float row[MAX_D];                                                                                \
    (void)D;                                                                                         \
    int n = (int)(k1 - k0);                                                                          \
    int64_t base = 0, next = -1;                   /* slot of key t: base + t, within a page */       \
    for (int t = 0; t < n; t++) {                  /* k0 is a multiple of P: P divides CHUNK */   \
        if (t % P == 0) {                          /* once a page: its slots, the next page's */  \
            base = (int64_t)pages[(k0 + t) / P] * P - t;                                             \
            next = t + P < n ? (int64_t)pages[(k0 + t) / P + 1] * P : -1;                            \
        }                                                                                            \
        const T *kr = kh + (base + t) * (DIM), *vr = vh + (base + t) * (DIM);                        \
        if (next >= 0) {                           /* the next page's rows, a row's worth a key */    \
            int64_t ahead = (next + t % P) * (DIM);                                                  \
            for (int c = 0; c < (int)sizeof(T) * (DIM); c += 64) {                                   \
                __builtin_prefetch((const char *)(kh + ahead) + c);                                  \
                __builtin_prefetch((const char *)(vh + ahead) + c);                                  \
            }                                                                                        \
        }                                                                                            \
        float *vt = vbuf + t * (DIM);                                                                \
        _Pragma("omp simd")                                                                          \
        for (int d = 0; d < (DIM); d++) { row[d] = TO_F32(kr[d]); vt[d] = TO_F32(vr[d]); }           \
        for (int g = 0; g < G; g++) {                                                                \
            const float *qg = qf + g * (DIM);                                                        \
            float dot = 0.0f;                                                                        \
            _Pragma("omp simd reduction(+:dot)")                                                     \
            for (int d = 0; d < (DIM); d++) dot += qg[d] * row[d];                                   \
            s[g * CHUNK + t] = dot;                                                                  \
        }                                                                                            \
    }                                                                                                \
    for (int g = 0; g < G; g++) {                                                                    \
        float *sg = s + g * CHUNK;                                                                   \
        float mx = sg[0];                                                                            \
        for (int t = 1; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;                                    \
        float sum = 0.0f;                                                                            \
        _Pragma("omp simd reduction(+:sum)")                                                         \
        for (int t = 0; t < n; t++) { sg[t] = exp_nonpos(sg[t] - mx); sum += sg[t]; }                \
        m[g] = mx;                                                                                   \
        l[g] = sum;                                                                                  \
        float a[MAX_D];                                                                              \
        for (int d = 0; d < (DIM); d++) a[d] = 0.0f;                                                 \
        for (int t = 0; t < n; t++) {                                                                \
            float p = sg[t];                                                                         \
            const float *vt = vbuf + t * (DIM);                                                      \
            _Pragma("omp simd")                                                                      \
            for (int d = 0; d < (DIM); d++) a[d] += p * vt[d];                                       \
        }                                                                                            \
        memcpy(acc + g * (DIM), a, sizeof(float) * (DIM));                                           \
    }                                                                                                \
}

static inline float f32_id(float x) { return x; }
static inline float f32_out(float x) { return x; }

DEFINE_CHUNK(chunk_bf16_64, uint16_t, bf16_to_f32, 64)
DEFINE_CHUNK(chunk_bf16_128, uint16_t, bf16_to_f32, 128)
DEFINE_CHUNK(chunk_bf16_any, uint16_t, bf16_to_f32, D)
DEFINE_CHUNK(chunk_f32_64, float, f32_id, 64)
DEFINE_CHUNK(chunk_f32_128, float, f32_id, 128)
DEFINE_CHUNK(chunk_f32_any, float, f32_id, D)


/* q: [B, Hq, D]; k, v: [Hkv, S, D]; pages: row b's page ids at page_start[b] .. page_start[b+1];
 * kv_len[b] keys per row (0 allowed: zeros out, lse -inf); out: [B, Hq, D]; lse: [B, Hq] or NULL.
 * Returns 0, or -1 when G or D exceed what the kernel was built for (nothing written). */
#define DEFINE_ENTRY(NAME, T, CHUNK_FN, TO_F32, FROM_F32)                                          \
int NAME(const T *q, const T *k, const T *v, int64_t S, const int32_t *pages,                       \
         const int64_t *page_start, const int64_t *kv_len, int B, int Hq, int Hkv, int D, int P,   \
         float scale, T *out, float *lse) {                                                         \
    int G = Hq / Hkv;                                                                               \
    if (G > MAX_G || D > MAX_D || G * Hkv != Hq) return -1;                                         \
    int64_t *first = malloc(sizeof(int64_t) * (B + 1));     /* first task of each row */             \
    if (!first) return -2;                                                                          \
    first[0] = 0;                                                                                   \
    for (int b = 0; b < B; b++) first[b + 1] = first[b] + (kv_len[b] + CHUNK - 1) / CHUNK;          \
    int64_t chunks = first[B], tasks = chunks * Hkv;                                                \
    float *part = malloc(sizeof(float) * (tasks > 0 ? tasks : 1) * G * (D + 2));                    \
    float *vbufs = malloc(sizeof(float) * omp_get_max_threads() * CHUNK * D);  /* one per thread */  \
    if (!part || !vbufs) { free(part); free(vbufs); free(first); return -2; }                       \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                                \
    for (int64_t task = 0; task < tasks; task++) {                                                  \
        int64_t c = task / Hkv;                                                                     \
        int h = (int)(task % Hkv);                                                                  \
        int lo = 0, hi = B;                          /* the row whose chunks hold chunk c */        \
        while (hi - lo > 1) { int mid = (lo + hi) / 2; if (first[mid] <= c) lo = mid; else hi = mid; } \
        int b = lo;                                                                                 \
        while (first[b + 1] <= c) b++;               /* skip rows with no keys */                   \
        int64_t k0 = (c - first[b]) * CHUNK;                                                        \
        int64_t k1 = k0 + CHUNK < kv_len[b] ? k0 + CHUNK : kv_len[b];                               \
        float qf[MAX_G * MAX_D];                                                                    \
        const T *qb = q + ((int64_t)b * Hq + (int64_t)h * G) * D;                                   \
        for (int i = 0; i < G * D; i++) qf[i] = TO_F32(qb[i]) * scale;                              \
        float *pt = part + task * G * (D + 2);       /* m[G], l[G], acc[G * D] */                    \
        CHUNK_FN(D)(qf, k + (int64_t)h * S * D, v + (int64_t)h * S * D, pages + page_start[b], P,      \
                 k0, k1, G, D, vbufs + (int64_t)omp_get_thread_num() * CHUNK * D, pt, pt + G, pt + 2 * G);                                             \
    }                                                                                               \
    _Pragma("omp parallel for schedule(static)")                                                    \
    for (int64_t bh = 0; bh < (int64_t)B * Hq; bh++) {                                              \
        int b = (int)(bh / Hq), hq = (int)(bh % Hq), h = hq / G, g = hq % G;                        \
        T *o = out + bh * D;                                                                        \
        if (first[b + 1] == first[b]) {                                                             \
            for (int d = 0; d < D; d++) o[d] = FROM_F32(0.0f);                                      \
            if (lse) lse[bh] = -INFINITY;                                                           \
            continue;                                                                               \
        }                                                                                           \
        float mx = -INFINITY;                                                                       \
        for (int64_t c = first[b]; c < first[b + 1]; c++) {                                        \
            float mc = part[(c * Hkv + h) * G * (D + 2) + g];                                       \
            mx = mc > mx ? mc : mx;                                                                 \
        }                                                                                           \
        float total = 0.0f, o32[MAX_D];                                                             \
        memset(o32, 0, sizeof(float) * D);                                                          \
        for (int64_t c = first[b]; c < first[b + 1]; c++) {                                        \
            const float *pt = part + (c * Hkv + h) * G * (D + 2);                                   \
            float w = exp_nonpos(pt[g] - mx);                                                       \
            total += w * pt[G + g];                                                                 \
            const float *acc = pt + 2 * G + g * D;                                                  \
            _Pragma("omp simd")                                                                     \
            for (int d = 0; d < D; d++) o32[d] += w * acc[d];                                       \
        }                                                                                           \
        float inv = 1.0f / total;                                                                   \
        for (int d = 0; d < D; d++) o[d] = FROM_F32(o32[d] * inv);                                  \
        if (lse) lse[bh] = mx + logf(total);                                                        \
    }                                                                                               \
    free(vbufs);                                                                                    \
    free(part);                                                                                     \
    free(first);                                                                                    \
    return 0;                                                                                       \
}

#define CHUNK_BF16(D) (D == 64 ? chunk_bf16_64 : D == 128 ? chunk_bf16_128 : chunk_bf16_any)
#define CHUNK_F32(D) (D == 64 ? chunk_f32_64 : D == 128 ? chunk_f32_128 : chunk_f32_any)
DEFINE_ENTRY(decode_attention_bf16, uint16_t, CHUNK_BF16, bf16_to_f32, f32_to_bf16)
DEFINE_ENTRY(decode_attention_f32, float, CHUNK_F32, f32_id, f32_out)

/* The chunk size, so the Python side and the tests can place rows across chunk boundaries. */
int decode_attention_chunk(void) { return CHUNK; }
