/* Prefill attention for the CPU in bfloat16 (and float32, at the end): a chunk of Q new queries of one
 * sequence over its L keys, the first L - Q of them cached before the chunk (L == Q: nothing cached). Query i
 * of the chunk sees keys 0 .. L - Q + i (the bottom-right causal mask).
 *
 * The keys and values are read in place from one layer of the KV pool (engine/kv_pool.py's head-major
 * "HSD" layout, [Hkv, S, D]; bfloat16 pages, or int8 pages dequantized to bfloat16 as they are read, the
 * values KVCache.gather gives) at the sequence's slots, and repacked once per call into the layouts the
 * vdpbf16ps instruction multiplies (products of bfloat16 pairs summed into float32 lanes):
 *   keys:   per block of KB keys, [D / 2][KB] pairs: pair p of key j is its elements 2p and 2p + 1
 *           (a 32-bit word of the key row), so one register holds pair p of 16 keys;
 *   values: per block, [KB / 2][D] pairs: element d of keys 2j and 2j + 1, so one register holds
 *           16 dims of a pair of keys.
 * Then each task, one KV head and up to QT queries (times the G query heads that share the KV head:
 * the task's rows), runs flash attention over the blocks its queries see: scores of 4 rows x 64 keys
 * in 16 registers, an online softmax in float32 (exp as exp2 of a polynomial, kernel_math.h), the
 * probabilities rounded to bfloat16 (as torch's bfloat16 matmul rounds them, and the decode kernel
 * does) and multiplied with the values into float32 accumulators. The softmax's sum stays float32;
 * the output is rounded to bfloat16, to nearest even as torch rounds.
 *
 * Without AVX512-BF16 the same loops run in portable C on the widened values (every bfloat16 is a
 * float32 exactly): the path the tests compare the vector one with; engine/attention/torch_backend.py
 * calls the bfloat16 kernel only where it runs vdpbf16ps and keeps torch's fused attention elsewhere.
 *
 * A float32 version (prefill_attention_f32, at the end) runs the same flash attention on float32 pages
 * for float32 engines, on AVX / AVX-512 vectors; torch_backend.py calls it where it is vectorized.
 * Threads: OpenMP, in the process's one libgomp pool, as engine/attention/csrc/decode_attention.c.
 *
 * engine/attention/cpu_kernel.py builds and calls this; engine/attention/reference.py is the oracle
 * (tests/engine/test_prefill_kernel.py).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_math.h"   /* engine/csrc: bf16 <-> f32, exp_nonpos (and exp_nonpos16), INLINE */

#define KB 64              /* keys per block */
#define QT 32              /* queries per task */
#define RB 4               /* rows per microkernel call */
#define MAX_G 16
#define MAX_D 256

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

/* Scores of RB rows against one block: s[r][j] = sum_p q[r] pair p . k[j] pair p (unscaled).
 * qp: [RB][D2] pairs; kp: [D2][KB] pairs; s: [RB][KB]. */
static void scores_block(const uint32_t *qp, const uint32_t *kp, int D2, float *s) {
#if HAVE_DPBF16
    __m512 acc[RB][KB / 16];
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < KB / 16; c++) acc[r][c] = _mm512_setzero_ps();
    for (int p = 0; p < D2; p++) {
        __m512bh k[KB / 16];
        for (int c = 0; c < KB / 16; c++) k[c] = (__m512bh)_mm512_loadu_si512(kp + p * KB + 16 * c);
        for (int r = 0; r < RB; r++) {
            __m512bh a = (__m512bh)_mm512_set1_epi32((int)qp[r * D2 + p]);
            for (int c = 0; c < KB / 16; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, k[c]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < KB / 16; c++) _mm512_storeu_ps(s + r * KB + 16 * c, acc[r][c]);
#else
    for (int r = 0; r < RB; r++) {
        float a[KB];
        for (int j = 0; j < KB; j++) a[j] = 0.0f;
        for (int p = 0; p < D2; p++) {
            uint32_t w = qp[r * D2 + p];
            float q0 = bf16_to_f32((uint16_t)w), q1 = bf16_to_f32((uint16_t)(w >> 16));
            const uint32_t *kr = kp + p * KB;
#pragma omp simd
            for (int j = 0; j < KB; j++)
                a[j] += q0 * bf16_to_f32((uint16_t)kr[j]) + q1 * bf16_to_f32((uint16_t)(kr[j] >> 16));
        }
        memcpy(s + r * KB, a, sizeof a);
    }
#endif
}

/* o[r] = o[r] * alpha[r] + sum_j P[r][j] v[j] for RB rows and one block.
 * pp: [RB][KB / 2] pairs of bfloat16 probabilities; vp: [KB / 2][D] pairs; o: [RB][D] float32. */
static void values_block(const uint32_t *pp, const uint32_t *vp, int D, const float *alpha, float *o) {
#if HAVE_DPBF16
    for (int d0 = 0; d0 < D; d0 += 64) {
        __m512 acc[RB][4];
        for (int r = 0; r < RB; r++) {
            __m512 a = _mm512_set1_ps(alpha[r]);
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d0 + 16 * c), a);
        }
        for (int j = 0; j < KB / 2; j++) {
            __m512bh v[4];
            for (int c = 0; c < 4; c++) v[c] = (__m512bh)_mm512_loadu_si512(vp + j * D + d0 + 16 * c);
            for (int r = 0; r < RB; r++) {
                __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[r * (KB / 2) + j]);
                for (int c = 0; c < 4; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w, v[c]);
            }
        }
        for (int r = 0; r < RB; r++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + r * D + d0 + 16 * c, acc[r][c]);
    }
#else
    for (int r = 0; r < RB; r++) {
        float *orow = o + r * D;
        for (int d = 0; d < D; d++) orow[d] *= alpha[r];
        for (int j = 0; j < KB / 2; j++) {
            uint32_t w = pp[r * (KB / 2) + j];
            float p0 = bf16_to_f32((uint16_t)w), p1 = bf16_to_f32((uint16_t)(w >> 16));
            if (p0 == 0.0f && p1 == 0.0f) continue;
            const uint32_t *vr = vp + j * D;
#pragma omp simd
            for (int d = 0; d < D; d++)
                orow[d] += p0 * bf16_to_f32((uint16_t)vr[d]) + p1 * bf16_to_f32((uint16_t)(vr[d] >> 16));
        }
    }
#endif
}

/* One row's scores of a block (the first n of KB visible) -> its probabilities as bfloat16 pairs in pr,
 * with the running max *m and sum *l updated; returns the factor the row's output is rescaled by. */
INLINE float softmax_row(float *sr, int n, float scale, float *m, float *l, uint32_t *pr) {
#if HAVE_DPBF16
    __mmask16 mk[KB / 16];
    __m512 x[KB / 16];
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int c = 0; c < KB / 16; c++) {
        int left = n - 16 * c;
        mk[c] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
        x[c] = _mm512_mul_ps(_mm512_loadu_ps(sr + 16 * c), _mm512_set1_ps(scale));
        vmax = _mm512_mask_max_ps(vmax, mk[c], vmax, x[c]);
    }
    float bmax = _mm512_reduce_max_ps(vmax);
    float mx = bmax > *m ? bmax : *m;
    __m512 vm = _mm512_set1_ps(mx), vsum = _mm512_setzero_ps(), e[KB / 16];
    for (int c = 0; c < KB / 16; c++) {
        e[c] = _mm512_maskz_mov_ps(mk[c], exp_nonpos16(_mm512_sub_ps(x[c], vm)));
        vsum = _mm512_add_ps(vsum, e[c]);
    }
    for (int c = 0; c < KB / 16; c += 2)   /* rounded to nearest even, 32 in order */
        _mm512_storeu_si512(pr + 8 * c, (__m512i)_mm512_cvtne2ps_pbh(e[c + 1], e[c]));
    float a = exp_nonpos(*m - mx);           /* *m = -inf at first: a = exp(-87), and l, o are 0 */
    *l = *l * a + _mm512_reduce_add_ps(vsum);
    *m = mx;
    return a;
#else
    float mx = *m;
    for (int j = 0; j < n; j++) {
        sr[j] *= scale;
        mx = sr[j] > mx ? sr[j] : mx;
    }
    float sum = 0.0f;
    uint16_t *p16 = (uint16_t *)pr;
    for (int j = 0; j < KB; j++) {
        float e = j < n ? exp_nonpos(sr[j] - mx) : 0.0f;
        sum += e;
        p16[j] = f32_to_bf16(e);
    }
    float a = exp_nonpos(*m - mx);
    *l = *l * a + sum;
    *m = mx;
    return a;
#endif
}

/* One layer of the pool: bfloat16 rows, or int8 rows with a float32 scale per token and KV head
 * (engine/kv_pool.py's int8 pages), read as bfloat16 either way. */
typedef struct {
    const void *k, *v;
    const float *ks, *vs;   /* int8 only: (Hkv, S) */
    int i8;
    int64_t S;
    int D;
} Pool;

/* Row `slot` of KV head h of k (which = 0) or v (1) as bfloat16: in place, or for int8 pages dequantized into buf
 * as KVCache.gather does (int8 times the scale in float32, rounded to bfloat16 to nearest even). */
INLINE const uint16_t *pool_row(const Pool *p, int which, int64_t h, int64_t slot, uint16_t *buf) {
    int64_t off = (h * p->S + slot) * p->D;
    if (!p->i8) return (const uint16_t *)(which ? p->v : p->k) + off;
    const int8_t *x = (const int8_t *)(which ? p->v : p->k) + off;
    float sc = (which ? p->vs : p->ks)[h * p->S + slot];
    for (int d = 0; d < p->D; d++) buf[d] = f32_to_bf16((float)x[d] * sc);
    return buf;
}

/* Block b of KV head h into the two layouts; keys past L are zeros. */
static void repack_block(const Pool *pool, int64_t h, const int64_t *slots, int64_t L, int64_t b, uint32_t *kp,
                         uint32_t *vp) {
    int D = pool->D, D2 = D / 2;
    uint16_t kb[MAX_D], vb0[MAX_D], vb1[MAX_D];
    for (int j = 0; j < KB; j++) {
        int64_t key = b * KB + j;
        if (key < L) {
            const uint32_t *kr = (const uint32_t *)pool_row(pool, 0, h, slots[key], kb);
            for (int p = 0; p < D2; p++) kp[p * KB + j] = kr[p];
        } else {
            for (int p = 0; p < D2; p++) kp[p * KB + j] = 0;
        }
    }
    for (int j = 0; j < KB / 2; j++) {
        int64_t k0 = b * KB + 2 * j, k1 = k0 + 1;
        const uint16_t *v0 = k0 < L ? pool_row(pool, 1, h, slots[k0], vb0) : NULL;
        const uint16_t *v1 = k1 < L ? pool_row(pool, 1, h, slots[k1], vb1) : NULL;
        for (int d = 0; d < D; d++)
            vp[j * D + d] = (uint32_t)(v0 ? v0[d] : 0) | (uint32_t)(v1 ? v1[d] : 0) << 16;
    }
}

/* One call, of either path: the queries, the pool layer, the packed keys and values, the shapes. */
typedef struct {
    const void *q;          /* (Q, Hq, D): bfloat16, or float32 (f32) */
    void *out;              /* (Q, Hq, D), q's dtype */
    Pool pool;              /* bfloat16 or int8 pages, or float32 ones (f32) */
    int f32;
    const int64_t *slots;
    int64_t L, Q;
    int Hq, Hkv;
    float scale;
    const char *kpack, *vpack;   /* per (KV head, block): block_bytes each, in the path's layouts */
    int64_t n_blocks, block_bytes;
} Call;

/* One task: KV head h, queries i0 .. i1 - 1 of the chunk. rows = (i1 - i0) * G, row r = (i - i0) * G + g;
 * padded to a multiple of RB with copies of the last row (their output is not written). */
static void run_task(const Call *c, int h, int64_t i0, int64_t i1, uint32_t *qp, float *o, float *m, float *l) {
    const uint16_t *q = c->q;
    uint16_t *out = c->out;
    int Hq = c->Hq, D = c->pool.D, G = Hq / c->Hkv, D2 = D / 2;
    int rows = (int)(i1 - i0) * G, padded = (rows + RB - 1) / RB * RB;
    int64_t n_cached = c->L - c->Q;
    float s[RB * KB], alpha[RB];
    uint32_t pp[RB * KB / 2];
    for (int r = 0; r < padded; r++) {
        int rr = r < rows ? r : rows - 1;
        int64_t i = i0 + rr / G;
        int g = rr % G;
        memcpy(qp + (int64_t)r * D2, q + (i * Hq + h * G + g) * D, sizeof(uint16_t) * D);
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(o, 0, sizeof(float) * padded * D);
    int64_t last_key = n_cached + i1 - 1;                 /* the last key any row of the task sees */
    int64_t n_blocks = last_key / KB + 1;
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint32_t *kp = (const uint32_t *)(c->kpack + (h * c->n_blocks + b) * c->block_bytes);
        const uint32_t *vp = (const uint32_t *)(c->vpack + (h * c->n_blocks + b) * c->block_bytes);
        for (int r0 = 0; r0 < padded; r0 += RB) {
            scores_block(qp + (int64_t)r0 * D2, kp, D2, s);
            for (int r = r0; r < r0 + RB; r++) {
                int rr = r < rows ? r : rows - 1;
                int64_t visible = n_cached + i0 + rr / G + 1 - b * KB;   /* keys of this block the row sees */
                int n = visible >= KB ? KB : visible <= 0 ? 0 : (int)visible;
                alpha[r - r0] = softmax_row(s + (r - r0) * KB, n, c->scale, m + r, l + r, pp + (r - r0) * (KB / 2));
            }
            values_block(pp, vp, D, alpha, o + (int64_t)r0 * D);
        }
    }
    for (int r = 0; r < rows; r++) {
        int64_t i = i0 + r / G;
        int g = r % G;
        uint16_t *dst = out + (i * Hq + h * G + g) * D;
        float inv = 1.0f / l[r];
        for (int d = 0; d < D; d++) dst[d] = f32_to_bf16(o[(int64_t)r * D + d] * inv);
    }
}

/* ------------------------------------------------------------------ float32
 * The same flash attention over float32 pages, for float32 engines (the default on every CPU without native
 * bfloat16: all AVX2-only ones). Scores, probabilities and the output stay float32 (nothing is rounded to
 * bfloat16); the queries are scaled by 1/sqrt(D) as they are copied. Written with GCC's vector extensions,
 * VW lanes: 16 with AVX-512F, 8 with AVX (fused multiply-adds with FMA), else 4 (SSE2 or scalar code: the
 * build the tests hold the vector ones against, beside a float64 reference). Register blocking: RBF rows of
 * queries against NC vectors of keys (scores) or of dims (values), sized so the accumulators and the loaded
 * vectors fit in AVX's 16 registers. */
#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
#define NC 2               /* vectors of keys (scores) or of dims (values) a register block spans */
#define RBF 6              /* query rows a register block spans */
#define KBF 64             /* keys per block */
_Static_assert(KBF == KB, "the driver packs both paths in blocks of KB keys");

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vf_u __attribute__((vector_size(VW * 4), aligned(4)));   /* unaligned loads and stores */
#define VLOAD(p) (*(const vf_u *)(p))
#define VSTORE(p, x) (*(vf_u *)(p) = (x))

/* Keep a loaded vector in a register: without it GCC folds the load into each multiply-add that uses it (one
 * load per multiply-add instead of one per vector), and the loops run at the load ports' speed. */
#if defined(__AVX512F__)
#define IN_REGISTER(x) __asm__("" : "+v"(x))
#elif defined(__SSE2__)
#define IN_REGISTER(x) __asm__("" : "+x"(x))
#else
#define IN_REGISTER(x) ((void)0)   /* other architectures: the compiler's choice */
#endif

/* c[r] = c[r] * scale[r] + sum_k a[r][k] b[k] for RBF rows of NC vectors each (scale NULL: c starts at 0): element
 * (r, k) of a at a[r * a_r + k * a_k], row k of b at b + k * ldb, row r of c at c + r * ldc. Inlined into its two
 * callers, so the strides are constants there and the broadcasts of a need no register of their own. */
static inline __attribute__((always_inline)) void rows_times_block(const float *a, int a_r, int a_k, const float *b,
                                                                   int64_t ldb, int K, const float *scale, float *c,
                                                                   int ldc) {
    vf acc[RBF][NC];
    for (int r = 0; r < RBF; r++)
        for (int j = 0; j < NC; j++) acc[r][j] = scale ? VLOAD(c + r * ldc + j * VW) * scale[r] : (vf){0};
    for (int k = 0; k < K; k++) {
        vf bv[NC];
        for (int j = 0; j < NC; j++) {
            bv[j] = VLOAD(b + k * ldb + j * VW);
            IN_REGISTER(bv[j]);
        }
        for (int r = 0; r < RBF; r++) {
            float w = a[r * a_r + k * a_k];
            for (int j = 0; j < NC; j++) acc[r][j] += bv[j] * w;
        }
    }
    for (int r = 0; r < RBF; r++)
        for (int j = 0; j < NC; j++) VSTORE(c + r * ldc + j * VW, acc[r][j]);
}

/* s[r][j] = qt[r] . k[j] for RBF rows and one block. qt: [D][RBF], the rows interleaved (already scaled);
 * kp: [D][KBF]; s: [RBF][KBF]. */
static __attribute__((noinline)) void scores_f32(const float *qt, const float *kp, int D, float *s) {
    for (int c0 = 0; c0 < KBF; c0 += NC * VW) rows_times_block(qt, 1, RBF, kp + c0, KBF, D, NULL, s + c0, KBF);
}

/* o[r] = o[r] * alpha[r] + sum_j p[r][j] v[j] for RBF rows and one block. p: [RBF][KBF]; vp: [KBF][D]. */
static __attribute__((noinline)) void values_f32(const float *p, const float *vp, int D, const float *alpha, float *o) {
    for (int d0 = 0; d0 < D; d0 += NC * VW) rows_times_block(p, KBF, 1, vp + d0, D, KBF, alpha, o + d0, D);
}

/* One row's scores of a block (the first n of KBF visible) -> its probabilities in place (0 past n), with the
 * running max *m and sum *l updated; returns the factor the row's output is rescaled by. */
static float softmax_f32(float *sr, int n, float *m, float *l) {
    float mx = *m, sum = 0.0f;
    if (n == KBF) {   /* every key of the block visible (all but the diagonal blocks): fixed trip counts, no masks */
#pragma omp simd reduction(max : mx)
        for (int j = 0; j < KBF; j++) mx = sr[j] > mx ? sr[j] : mx;
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < KBF; j++) {
            float e = exp_nonpos(sr[j] - mx);
            sr[j] = e;
            sum += e;
        }
    } else {
#pragma omp simd reduction(max : mx)
        for (int j = 0; j < n; j++) mx = sr[j] > mx ? sr[j] : mx;
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < KBF; j++) {
            float e = j < n ? exp_nonpos(sr[j] - mx) : 0.0f;
            sr[j] = e;
            sum += e;
        }
    }
    float a = exp_nonpos(*m - mx);           /* *m = -inf at first: a = exp(-87), and l, o are 0 */
    *l = *l * a + sum;
    *m = mx;
    return a;
}

/* Row `slot` of KV head h of k (which = 0) or v (1) of a float32 pool: in place, or for int8 pages dequantized into
 * buf as KVCache.gather does for a float32 model (int8 times the scale in float32). */
INLINE const float *pool_row_f32(const Pool *p, int which, int64_t h, int64_t slot, float *buf) {
    int64_t off = (h * p->S + slot) * p->D;
    if (!p->i8) return (const float *)(which ? p->v : p->k) + off;
    const int8_t *x = (const int8_t *)(which ? p->v : p->k) + off;
    float sc = (which ? p->vs : p->ks)[h * p->S + slot];
    for (int d = 0; d < p->D; d++) buf[d] = (float)x[d] * sc;
    return buf;
}

/* Block b of KV head h of a float32 pool (or int8 pages read as float32): keys transposed to [D][KBF], values as
 * rows [KBF][D]; keys past L are zeros. */
static void repack_block_f32(const Pool *pool, int64_t h, const int64_t *slots, int64_t L, int64_t b, float *kp,
                             float *vp) {
    int D = pool->D;
    float kb[MAX_D];
    for (int j = 0; j < KBF; j++) {
        int64_t key = b * KBF + j;
        if (key < L) {
            const float *kr = pool_row_f32(pool, 0, h, slots[key], kb);
            for (int d = 0; d < D; d++) kp[(int64_t)d * KBF + j] = kr[d];
            float *vrow = vp + (int64_t)j * D;
            const float *vr = pool_row_f32(pool, 1, h, slots[key], vrow);   /* int8: dequantized into its place */
            if (vr != vrow) memcpy(vrow, vr, sizeof(float) * D);
        } else {
            for (int d = 0; d < D; d++) kp[(int64_t)d * KBF + j] = 0.0f;
            memset(vp + (int64_t)j * D, 0, sizeof(float) * D);
        }
    }
}

/* One task: KV head h, queries i0 .. i1 - 1 (rows as in run_task, padded to a multiple of RBF). */
static void run_task_f32(const Call *c, int h, int64_t i0, int64_t i1, float *qr, float *o, float *m, float *l) {
    const float *q = c->q;
    float *out = c->out;
    int Hq = c->Hq, D = c->pool.D, G = Hq / c->Hkv;
    int rows = (int)(i1 - i0) * G, padded = (rows + RBF - 1) / RBF * RBF;
    int64_t n_cached = c->L - c->Q;
    float s[RBF * KBF], alpha[RBF];
    for (int r = 0; r < padded; r++) {
        int rr = r < rows ? r : rows - 1;
        const float *src = q + ((i0 + rr / G) * Hq + h * G + rr % G) * D;
        float *dst = qr + (int64_t)(r / RBF) * RBF * D + r % RBF;   /* group r / RBF, [D][RBF] */
        for (int d = 0; d < D; d++) dst[d * RBF] = src[d] * c->scale;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(o, 0, sizeof(float) * padded * D);
    int64_t n_blocks = (n_cached + i1 - 1) / KBF + 1;
    for (int64_t b = 0; b < n_blocks; b++) {
        const float *kp = (const float *)(c->kpack + (h * c->n_blocks + b) * c->block_bytes);
        const float *vp = (const float *)(c->vpack + (h * c->n_blocks + b) * c->block_bytes);
        for (int r0 = 0; r0 < padded; r0 += RBF) {
            scores_f32(qr + (int64_t)r0 * D, kp, D, s);
            for (int r = r0; r < r0 + RBF; r++) {
                int rr = r < rows ? r : rows - 1;
                int64_t visible = n_cached + i0 + rr / G + 1 - b * KBF;
                int n = visible >= KBF ? KBF : visible <= 0 ? 0 : (int)visible;
                alpha[r - r0] = softmax_f32(s + (r - r0) * KBF, n, m + r, l + r);
            }
            values_f32(s, vp, D, alpha, o + (int64_t)r0 * D);
        }
    }
    for (int r = 0; r < rows; r++) {
        float *dst = out + ((i0 + r / G) * Hq + h * G + r % G) * D;
        float inv = 1.0f / l[r];
        for (int d = 0; d < D; d++) dst[d] = o[(int64_t)r * D + d] * inv;
    }
}

/* ------------------------------------------------------------------ the driver
 * Repack every (KV head, block) once, then run the (KV head, QT queries) tasks, the tiles with the most keys (the
 * last queries) first. Per thread: the task's queries (float32: max_rows x D; bfloat16: pairs, half of that),
 * its output rows, running maxima and sums. Returns 0, -1 for shapes outside the kernel's limits, -2 when memory
 * runs out. */
static int prefill(Call *c) {
    int D = c->pool.D, Hkv = c->Hkv;
    int64_t L = c->L, Q = c->Q;
    if (Q < 1 || L < Q || Hkv < 1 || c->Hq % Hkv || c->Hq / Hkv > MAX_G || D % 64 || D > MAX_D) return -1;
    int G = c->Hq / Hkv;
    c->n_blocks = (L + KB - 1) / KB;   /* KB == KBF */
    c->block_bytes = c->f32 ? (int64_t)sizeof(float) * KBF * D : (int64_t)sizeof(uint32_t) * KB * (D / 2);
    char *kpack = malloc(c->block_bytes * Hkv * c->n_blocks), *vpack = malloc(c->block_bytes * Hkv * c->n_blocks);
    if (!kpack || !vpack) {
        free(kpack);
        free(vpack);
        return -2;
    }
    c->kpack = kpack;
    c->vpack = vpack;
    int64_t n_tiles = (Q + QT - 1) / QT, n_tasks = Hkv * n_tiles, n_blocks = c->n_blocks;
    int failed = 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < Hkv * n_blocks; t++) {
            int64_t h = t / n_blocks, b = t % n_blocks;
            if (c->f32)
                repack_block_f32(&c->pool, h, c->slots, L, b, (float *)(kpack + t * c->block_bytes),
                                 (float *)(vpack + t * c->block_bytes));
            else
                repack_block(&c->pool, h, c->slots, L, b, (uint32_t *)(kpack + t * c->block_bytes),
                             (uint32_t *)(vpack + t * c->block_bytes));
        }
        int max_rows = QT * G + RBF;   /* the rows of a task padded to RB or RBF */
        float *qbuf = malloc(sizeof(float) * max_rows * D), *o = malloc(sizeof(float) * max_rows * D);
        float *m = malloc(sizeof(float) * max_rows), *l = malloc(sizeof(float) * max_rows);
        if (!qbuf || !o || !m || !l) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < n_tasks; t++) {
                int64_t tile = n_tiles - 1 - t / Hkv;
                int h = (int)(t % Hkv);
                int64_t i0 = tile * QT, i1 = i0 + QT < Q ? i0 + QT : Q;
                if (c->f32)
                    run_task_f32(c, h, i0, i1, qbuf, o, m, l);
                else
                    run_task(c, h, i0, i1, (uint32_t *)qbuf, o, m, l);
            }
        }
        free(qbuf);
        free(o);
        free(m);
        free(l);
    }
    free(kpack);
    free(vpack);
    return failed ? -2 : 0;
}

/* q: (Q, Hq, D) bfloat16, contiguous; k, v: one layer of the pool, (Hkv, S, D) bfloat16; slots: the
 * sequence's L slots in order (each in [0, S): the caller checks); out: (Q, Hq, D) bfloat16.
 * Returns 0, or -1 for shapes outside the kernel's limits, -2 when memory runs out. */
int prefill_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t S, const int64_t *slots,
                           int64_t L, int64_t Q, int Hq, int Hkv, int D, float scale, uint16_t *out) {
    Call c = {.q = q, .out = out, .pool = {k, v, NULL, NULL, 0, S, D}, .slots = slots, .L = L, .Q = Q, .Hq = Hq,
              .Hkv = Hkv, .scale = scale};
    return prefill(&c);
}

/* The same over int8 pages: k, v (Hkv, S, D) int8 with ks, vs (Hkv, S) float32 scales. */
int prefill_attention_i8(const uint16_t *q, const int8_t *k, const int8_t *v, const float *ks, const float *vs, int64_t S,
                         const int64_t *slots, int64_t L, int64_t Q, int Hq, int Hkv, int D, float scale, uint16_t *out) {
    Call c = {.q = q, .out = out, .pool = {k, v, ks, vs, 1, S, D}, .slots = slots, .L = L, .Q = Q, .Hq = Hq,
              .Hkv = Hkv, .scale = scale};
    return prefill(&c);
}

/* The same in float32: q, out (Q, Hq, D) float32; k, v (Hkv, S, D) float32, or int8 with ks, vs (Hkv, S) float32
 * scales (NULL for float32 pages). */
int prefill_attention_f32(const float *q, const void *k, const void *v, const float *ks, const float *vs, int64_t S,
                          const int64_t *slots, int64_t L, int64_t Q, int Hq, int Hkv, int D, float scale, float *out) {
    Call c = {.q = q, .out = out, .pool = {k, v, ks, vs, ks != NULL, S, D}, .f32 = 1, .slots = slots, .L = L, .Q = Q,
              .Hq = Hq, .Hkv = Hkv, .scale = scale};
    return prefill(&c);
}

int prefill_attention_dpbf16(void) { return HAVE_DPBF16; }

/* The float32 path's vector width in floats: 16 (AVX-512F), 8 (AVX, with FMA where the CPU has it), 4 otherwise. */
int prefill_attention_f32_lanes(void) { return VW; }
