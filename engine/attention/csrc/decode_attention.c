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
 * Arithmetic is float32 throughout (bfloat16 inputs are widened exactly; on CPUs with
 * AVX512-BF16 the bfloat16 scores are dot products of the bfloat16 inputs summed in float32
 * by the vdpbf16ps instruction); the output is rounded to the input dtype, bfloat16 to
 * nearest even as torch rounds. The softmax uses exp2 of a degree-6 polynomial (relative
 * error below 1e-7) so that the loop vectorises. Threads: OpenMP, loaded into the process
 * torch's own libgomp already is (one thread pool).
 *
 * engine/attention/cpu_kernel.py builds and calls this; engine/attention/reference.py is
 * the oracle it is tested against (tests/engine/test_cpu_kernel.py).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_math.h"   /* engine/csrc: bits32, bf16 <-> f32, exp_nonpos, INLINE */

#define CHUNK 256          /* keys per task */
#define MAX_G 16           /* query heads per KV head */
#define MAX_D 256          /* head dim */
#define TASKS_AT_ONCE 4    /* consecutive tasks a thread takes at a time */

/* A row of D elements of the pool (bfloat16 or float32) widened into float32. */
INLINE void widen(const void *src, int bf16, float *dst, int D) {
    if (bf16) {
        const uint16_t *x = src;
#pragma omp simd
        for (int d = 0; d < D; d++) dst[d] = bf16_to_f32(x[d]);
    } else {
        memcpy(dst, src, sizeof(float) * D);
    }
}

/* With each key, the key and value rows of the key PREFETCH_PAGES pages on are asked into the
 * cache: pages are scattered, so the hardware prefetcher cannot follow, and a row at a time keeps
 * the requests in flight few (a whole page at once measured slower). 2 pages ahead: 29 -> 19 ns
 * per key and KV head over a pool larger than the caches (one thread). */
#define PREFETCH_PAGES 2
INLINE void prefetch_row(const char *k, const char *v, int64_t row_bytes) {
    for (int64_t c = 0; c < row_bytes; c += 64) {
        __builtin_prefetch(k + c);
        __builtin_prefetch(v + c);
    }
}

/* A query's n scores in place -> exp(score - max), with *m = max and *l = their sum. */
INLINE void exponentials(float *sg, int n, float *m, float *l) {
    float mx = sg[0];
#pragma omp simd reduction(max:mx)
    for (int t = 1; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;
    float sum = 0.0f;
#pragma omp simd reduction(+:sum)
    for (int t = 0; t < n; t++) {
        sg[t] = exp_nonpos(sg[t] - mx);
        sum += sg[t];
    }
    *m = mx;
    *l = sum;
}

/* Passes 2 and 3 of a chunk: s[g][t] -> exp(s - max) with m[g] = max and l[g] = their sum, then
 * acc[g] = sum_t exp(...) * vbuf[t], one query at a time so its accumulator stays in registers. */
INLINE void softmax_values(float *s, const float *vbuf, int n, int G, int D, float *m, float *l, float *acc) {
    for (int g = 0; g < G; g++) {
        float *sg = s + g * CHUNK;
        exponentials(sg, n, m + g, l + g);
        float a[MAX_D];
        for (int d = 0; d < D; d++) a[d] = 0.0f;
        for (int t = 0; t < n; t++) {
            float p = sg[t];
            const float *vt = vbuf + t * D;
#pragma omp simd
            for (int d = 0; d < D; d++) a[d] += p * vt[d];
        }
        memcpy(acc + g * D, a, sizeof(float) * D);
    }
}

/* One task's partial result over keys [k0, k1) of one row and one KV head: m[g] = max score,
 * l[g] = sum exp(score - m), acc[g] = sum exp(score - m) * v. Pass 1 widens each key and value
 * row once (values into vbuf, [CHUNK, D] float32) and scores the G queries (qf: scaled, float32).
 * Inlined with a constant D (64, 128) the loops unroll. */
INLINE void chunk_generic(const float *qf, const void *kh, const void *vh, int bf16, const int32_t *pages,
                          int P, int64_t k0, int64_t k1, int G, int D, float *vbuf, float *m, float *l,
                          float *acc) {
    float s[MAX_G * CHUNK];
    float row[MAX_D];
    int64_t esize = bf16 ? 2 : 4, base = 0;        /* slot of key t: base + t, within a page */
    int64_t ahead = -1;                            /* slot of key t's row PREFETCH_PAGES pages on */
    int n = (int)(k1 - k0);
    for (int t = 0; t < n; t++) {                  /* k0 is a multiple of P: P divides CHUNK */
        if (t % P == 0) {
            base = (int64_t)pages[(k0 + t) / P] * P - t;
            ahead = t + PREFETCH_PAGES * P < n ? (int64_t)pages[(k0 + t) / P + PREFETCH_PAGES] * P : -1;
        }
        if (ahead >= 0)
            prefetch_row((const char *)kh + (ahead + t % P) * D * esize, (const char *)vh + (ahead + t % P) * D * esize,
                         D * esize);
        int64_t at = (base + t) * D * esize;
        widen((const char *)kh + at, bf16, row, D);
        widen((const char *)vh + at, bf16, vbuf + t * D, D);
        for (int g = 0; g < G; g++) {
            const float *qg = qf + g * D;
            float dot = 0.0f;
#pragma omp simd reduction(+:dot)
            for (int d = 0; d < D; d++) dot += qg[d] * row[d];
            s[g * CHUNK + t] = dot;
        }
    }
    softmax_values(s, vbuf, n, G, D, m, l, acc);
}

#if defined(__AVX2__)
#include <immintrin.h>
#endif
/* int8 -> float32 of a row of D values, and a += w * row: AVX2 (vpmovsxbd + vcvtdq2ps, 8 lanes) where the
 * build has it and D is a multiple of 8, plain C elsewhere (GCC leaves these conversions scalar: measured
 * 4.5x slower than the bfloat16 path before they were written out). */
INLINE void widen_i8(const int8_t *x, float *dst, int D) {
#if defined(__AVX2__)
    if (D % 8 == 0) {
        for (int d = 0; d < D; d += 8)
            _mm256_storeu_ps(dst + d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(x + d)))));
        return;
    }
#endif
    for (int d = 0; d < D; d++) dst[d] = (float)x[d];
}

INLINE void axpy_i8(float *a, float w, const int8_t *x, int D) {
#if defined(__AVX2__)
    if (D % 8 == 0) {
        __m256 wv = _mm256_set1_ps(w);
        for (int d = 0; d < D; d += 8) {
            __m256 xv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(x + d))));
            _mm256_storeu_ps(a + d, _mm256_fmadd_ps(wv, xv, _mm256_loadu_ps(a + d)));
        }
        return;
    }
#endif
    for (int d = 0; d < D; d++) a[d] += w * (float)x[d];
}

#ifndef PREFETCH_PAGES_I8
#define PREFETCH_PAGES_I8 2
#endif
/* While scoring key k0 + t of a row of row_len keys, the key and value rows PREFETCH_PAGES_I8 pages on
 * (their slot: ahead, -1 past the row's end) are asked into the cache: pass 3 then finds the values there
 * too; chunk_slots asks for those pages' scales once a page. The look-ahead runs past the chunk's end into
 * the row's next chunk, which the same thread usually takes next (tasks go out a few consecutive chunks of
 * one row and head at a time). */
INLINE void prefetch_i8(const int8_t *kh, const int8_t *vh, int64_t ahead, int D) {
    if (ahead >= 0) prefetch_row((const char *)(kh + ahead * D), (const char *)(vh + ahead * D), D);
}

/* The pool slots of a chunk's keys k0 .. k0 + n (k0 a multiple of P) and of the keys PREFETCH_PAGES_I8 pages
 * on (-1 past row_len), and the keys' scales copied in order (ksc, vsc), a page at a time: no division per
 * key, and the passes read the scales from one short array (scattered, a page's scales are a run of P). */
INLINE void chunk_slots(const int32_t *pages, int P, int64_t k0, int n, int64_t row_len, const float *ksh,
                        const float *vsh, int64_t *slot, int64_t *ahead, float *ksc, float *vsc) {
    for (int t = 0; t < n; t += P) {
        int64_t pg = (k0 + t) / P, base = (int64_t)pages[pg] * P;
        int64_t a0 = k0 + t + (int64_t)PREFETCH_PAGES_I8 * P;          /* the page's first key PREFETCH on */
        int64_t abase = a0 < row_len ? (int64_t)pages[pg + PREFETCH_PAGES_I8] * P : -1;
        if (abase >= 0) prefetch_row((const char *)(ksh + abase), (const char *)(vsh + abase), 4 * P);
        int m = n - t < P ? n - t : P;
        memcpy(ksc + t, ksh + base, sizeof(float) * m);
        memcpy(vsc + t, vsh + base, sizeof(float) * m);
        for (int i = 0; i < m; i++) {
            slot[t + i] = base + i;
            ahead[t + i] = abase >= 0 && a0 + i < row_len ? abase + i : -1;
        }
    }
}

/* Vectors of int8 -> float32 lanes for the int8 chunk: AVX-512 (16 lanes) or AVX2 (8) where the build
 * has them; I8_LANES 0 in the portable build. */
#if defined(__AVX512F__)
#define I8_LANES 16
typedef __m512 i8vec;
INLINE i8vec i8_load(const int8_t *x) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)x))); }
INLINE i8vec i8_zero(void) { return _mm512_setzero_ps(); }
INLINE i8vec i8_fma(float w, i8vec x, i8vec a) { return _mm512_fmadd_ps(_mm512_set1_ps(w), x, a); }
INLINE i8vec i8_mul_add(i8vec q, i8vec x, i8vec a) { return _mm512_fmadd_ps(q, x, a); }
INLINE i8vec i8_loadf(const float *x) { return _mm512_loadu_ps(x); }
INLINE void i8_store(float *dst, i8vec a) { _mm512_storeu_ps(dst, a); }
INLINE float i8_sum(i8vec a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__)
#define I8_LANES 8
typedef __m256 i8vec;
INLINE i8vec i8_load(const int8_t *x) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)x))); }
INLINE i8vec i8_zero(void) { return _mm256_setzero_ps(); }
INLINE i8vec i8_fma(float w, i8vec x, i8vec a) { return _mm256_fmadd_ps(_mm256_set1_ps(w), x, a); }
INLINE i8vec i8_mul_add(i8vec q, i8vec x, i8vec a) { return _mm256_fmadd_ps(q, x, a); }
INLINE i8vec i8_loadf(const float *x) { return _mm256_loadu_ps(x); }
INLINE void i8_store(float *dst, i8vec a) { _mm256_storeu_ps(dst, a); }
INLINE float i8_sum(i8vec a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
#define I8_LANES 0
#endif

#if defined(__AVX2__)
/* Eight vectors of 8 -> one vector of their 8 sums (lane i: the sum of v[i]). */
INLINE __m256 sums8(const __m256 *v) {
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#endif
#if I8_LANES == 16
/* I8_LANES vectors -> one vector of their sums: halves added, then eight at a time. */
INLINE i8vec i8_sums(const i8vec *v) {
    __m256 h[16];
    for (int i = 0; i < 16; i++) h[i] = _mm256_add_ps(_mm512_castps512_ps256(v[i]), _mm512_extractf32x8_ps(v[i], 1));
    return _mm512_insertf32x8(_mm512_castps256_ps512(sums8(h)), sums8(h + 8), 1);
}
#elif I8_LANES == 8
INLINE i8vec i8_sums(const i8vec *v) { return sums8(v); }
#endif

#if I8_LANES
/* Pass 1 of an int8 chunk, vectorised (D a multiple of I8_LANES): each key row widened once into
 * registers and multiplied with each of the G queries into one vector per (query, key); the vectors of
 * I8_LANES keys are then summed across lanes together (i8_sums: a transpose of adds), one vector of
 * scores per query, instead of a horizontal sum per key. */
INLINE void scores_i8_vec(const float *qf, const int8_t *kh, const int8_t *vh, const float *ksc, const int64_t *slot,
                          const int64_t *ahead, int n, int G, int D, float *s) {
    int R = D / I8_LANES;
    for (int t0 = 0; t0 < n; t0 += I8_LANES) {
        i8vec part[MAX_G][I8_LANES];
        int tn = n - t0 < I8_LANES ? n - t0 : I8_LANES;
        for (int i = 0; i < I8_LANES; i++) {
            int t = t0 + i;
            if (i >= tn) {                                   /* past the chunk's last key: zeros */
                for (int g = 0; g < G; g++) part[g][i] = i8_zero();
                continue;
            }
            prefetch_i8(kh, vh, ahead[t], D);
            const int8_t *kr = kh + slot[t] * D;
            i8vec k[MAX_D / 8];
            for (int r = 0; r < R; r++) k[r] = i8_load(kr + r * I8_LANES);
            for (int g = 0; g < G; g++) {
                i8vec a = i8_zero();
                for (int r = 0; r < R; r++) a = i8_mul_add(i8_loadf(qf + g * D + r * I8_LANES), k[r], a);
                part[g][i] = a;
            }
        }
        float sk[I8_LANES];
        for (int i = 0; i < tn; i++) sk[i] = ksc[t0 + i];
        for (int g = 0; g < G; g++) {
            float sums[I8_LANES];
            i8_store(sums, i8_sums(part[g]));
            for (int i = 0; i < tn; i++) s[g * CHUNK + t0 + i] = sums[i] * sk[i];
        }
    }
}

/* Pass 3 of an int8 chunk, vectorised: acc[g] = sum_t w[g][t] * v[t] (w = probability x the value row's
 * scale), keys outer: each value row is widened once, RB vectors of D at a time, and added into all G
 * queries' accumulators, G x RB vectors that stay in registers (G and D are constants where run_i8
 * inlines this: RB is the most of D's vectors that fit beside them). Per lane and query the sum runs
 * over keys in order, as the per-query loop it replaces did. AVX2 has 16 vector registers, AVX-512 32: at 24
 * accumulators an AVX2 build kept some on the stack (3 queries x 8 vectors for a head dim of 64), at 12 it
 * runs two passes of 4 vectors over the chunk's rows, which are in L1 by then (one layer's b64_ctx2048 call,
 * x86-64-v3 build: 4.068 -> 3.989-4.005 ms in benchmarks/decode_kernel_ab.py, the same output bit for bit;
 * 8 and 16 were slower than 12). Each value vector is widened and used at once by the G queries, not all RB
 * of them widened first: those RB vectors beside 12 accumulators and the broadcast weight were 17 registers
 * for G = 3, and the AVX2 build spilled accumulators in the loop (Zen 4, one call of 64 rows x 2,048 keys,
 * benchmarks/decode_kernel_ab.py, medians of the ABBA blocks: x86-64-v3 build 6.62 -> 6.16 ms, 1.075x (6 a
 * side); the native AVX-512 build 5.83 -> 5.82 ms, unchanged (10 a side); the same output bit for bit;
 * benchmarks/results/decode_kernel_ab-int8-values-order-zen4-*-cpu.json). The accumulators are a block of a
 * constant rb (values_i8_block): with rb a run-time value the AVX2 build still stored all 12 to the stack with every
 * key (Zen 3, AVX2: 6.20 -> 4.97 ms, 1.25x, the same output bit for bit,
 * benchmarks/results/decode_kernel_ab-int8-values-block-zen3-avx2-cpu.json). */
#if I8_LANES == 8
#define I8_ACC_REGS 12
#else
#define I8_ACC_REGS 24
#endif
/* One block of rb of a value row's vectors, rb a constant where the caller's G and D are, so the G x rb
 * accumulators stay in registers. */
INLINE void values_i8_block(const float *w, const int8_t *vh, const int64_t *slot, int n, int G, int D, int r0, int rb,
                            float *acc) {
    i8vec a[I8_ACC_REGS > MAX_G ? I8_ACC_REGS : MAX_G];
    for (int j = 0; j < G * rb; j++) a[j] = i8_zero();
    for (int t = 0; t < n; t++) {
        const int8_t *vr = vh + slot[t] * D + r0 * I8_LANES;
        for (int r = 0; r < rb; r++) {
            i8vec x = i8_load(vr + r * I8_LANES);
            for (int g = 0; g < G; g++) a[g * rb + r] = i8_fma(w[g * CHUNK + t], x, a[g * rb + r]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int r = 0; r < rb; r++) i8_store(acc + g * D + (r0 + r) * I8_LANES, a[g * rb + r]);
}

INLINE void values_i8_vec(const float *w, const int8_t *vh, const int64_t *slot, int n, int G, int D, float *acc) {
    int R = D / I8_LANES, RB = I8_ACC_REGS / G < 1 ? 1 : I8_ACC_REGS / G;
    if (RB > R) RB = R;
    int r0 = 0;
    for (; r0 + RB <= R; r0 += RB) values_i8_block(w, vh, slot, n, G, D, r0, RB, acc);
    if (r0 < R) values_i8_block(w, vh, slot, n, G, D, r0, R - r0, acc);
}
#endif

/* An int8 pool's chunk (int8 K/V rows, one float32 scale per KV head and slot: ks, vs): scores are
 * q . k * ks[slot]; values are summed as (p * vs[slot]) * v straight from the pool's int8 rows (pass 3
 * walks the pages again): no chunk of dequantized values is ever written. With AVX2 / AVX-512 and D a
 * multiple of the vector, the vectorised passes above; otherwise widen_i8 / axpy_i8 a query at a time. */
INLINE void chunk_i8(const float *qf, const int8_t *kh, const int8_t *vh, const float *ksh, const float *vsh,
                     const int32_t *pages, int P, int64_t k0, int64_t k1, int64_t row_len, int G, int D, float *m,
                     float *l, float *acc) {
    float s[MAX_G * CHUNK];
    float row[MAX_D];
    int64_t slot[CHUNK], ahead[CHUNK];
    float ksc[CHUNK], vsc[CHUNK];
    int n = (int)(k1 - k0);
    chunk_slots(pages, P, k0, n, row_len, ksh, vsh, slot, ahead, ksc, vsc);   /* k0: a multiple of P */
#if I8_LANES
    int vec = D % I8_LANES == 0;
    if (vec) scores_i8_vec(qf, kh, vh, ksc, slot, ahead, n, G, D, s);
#else
    int vec = 0;
#endif
    if (!vec) {
        for (int t = 0; t < n; t++) {
            prefetch_i8(kh, vh, ahead[t], D);
            widen_i8(kh + slot[t] * D, row, D);
            float sk = ksc[t];
            for (int g = 0; g < G; g++) {
                const float *qg = qf + g * D;
                float dot = 0.0f;
#pragma omp simd reduction(+:dot)
                for (int d = 0; d < D; d++) dot += qg[d] * row[d];
                s[g * CHUNK + t] = dot * sk;
            }
        }
    }
    for (int g = 0; g < G; g++) {
        float *sg = s + g * CHUNK;
        exponentials(sg, n, m + g, l + g);
        if (vec) {
            for (int t = 0; t < n; t++) sg[t] *= vsc[t];           /* the weights pass 3 adds with */
            continue;
        }
        float a[MAX_D];
        for (int d = 0; d < D; d++) a[d] = 0.0f;
        for (int t = 0; t < n; t++) axpy_i8(a, sg[t] * vsc[t], vh + slot[t] * D, D);
        memcpy(acc + g * D, a, sizeof(float) * D);
    }
#if I8_LANES
    if (vec) values_i8_vec(s, vh, slot, n, G, D, acc);
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
/* Values of two keys interleaved (a0 b0 a1 b1 ..., within each 128-bit lane, as unpack does), the
 * pairs vdpbf16ps multiplies: out is 2 * D elements, [lo_0, hi_0, lo_1, hi_1, ...] per 32 of D. */
INLINE void interleave(const uint16_t *a, const uint16_t *b, uint16_t *out, int R) {
    for (int r = 0; r < R; r++) {
        __m512i x = _mm512_loadu_si512(a + 32 * r), y = b ? _mm512_loadu_si512(b + 32 * r) : _mm512_setzero_si512();
        _mm512_storeu_si512(out + 64 * r, _mm512_unpacklo_epi16(x, y));
        _mm512_storeu_si512(out + 64 * r + 32, _mm512_unpackhi_epi16(x, y));
    }
}

/* The bfloat16 chunk in hardware, for head dims that are a multiple of 32 (vdpbf16ps: products of
 * bfloat16 pairs summed into float32 lanes). Scores: a key row is D / 32 registers, multiplied with
 * each query's bfloat16 row as given and summed, then scaled. Values: keys taken two at a time, their
 * rows interleaved once (vi, in vbuf's memory) and weighted by the two probabilities rounded to
 * bfloat16, as torch's bfloat16 matmul rounds them; the sum l of the probabilities stays float32. */
INLINE void chunk_bf16_dp(const uint16_t *qb, float scale, const uint16_t *kh, const uint16_t *vh,
                          const int32_t *pages, int P, int64_t k0, int64_t k1, int G, int D, float *vbuf,
                          float *m, float *l, float *acc) {
    float s[MAX_G * CHUNK + 1];
    __m512bh q[MAX_G][MAX_D / 32];
    uint16_t *vi = (uint16_t *)vbuf;
    const uint16_t *prev = NULL;
    int R = D / 32, n = (int)(k1 - k0);
    for (int g = 0; g < G; g++)
        for (int r = 0; r < R; r++) q[g][r] = (__m512bh)_mm512_loadu_si512(qb + g * D + 32 * r);
    int64_t base = 0, ahead = -1;
    for (int t = 0; t < n; t++) {
        if (t % P == 0) {
            base = (int64_t)pages[(k0 + t) / P] * P - t;
            ahead = t + PREFETCH_PAGES * P < n ? (int64_t)pages[(k0 + t) / P + PREFETCH_PAGES] * P : -1;
        }
        if (ahead >= 0)
            prefetch_row((const char *)(kh + (ahead + t % P) * D), (const char *)(vh + (ahead + t % P) * D), 2 * D);
        const uint16_t *kr = kh + (base + t) * D, *vr = vh + (base + t) * D;
        if (t & 1) interleave(prev, vr, vi + (t - 1) * D, R);
        else prev = vr;
        __m512bh k[MAX_D / 32];
        for (int r = 0; r < R; r++) k[r] = (__m512bh)_mm512_loadu_si512(kr + 32 * r);
        for (int g = 0; g < G; g++) {
            __m512 a = _mm512_setzero_ps();
            for (int r = 0; r < R; r++) a = _mm512_dpbf16_ps(a, q[g][r], k[r]);
            s[g * CHUNK + t] = _mm512_reduce_add_ps(a) * scale;
        }
    }
    if (n & 1) interleave(prev, NULL, vi + (n - 1) * D, R);     /* the last key pairs with zeros */
    for (int g = 0; g < G; g++) {
        float *sg = s + g * CHUNK;
        exponentials(sg, n, m + g, l + g);
        __m512 a[2 * MAX_D / 32];
        for (int j = 0; j < 2 * R; j++) a[j] = _mm512_setzero_ps();
        for (int i = 0; 2 * i < n; i++) {
            float p1 = 2 * i + 1 < n ? sg[2 * i + 1] : 0.0f;
            uint32_t pair = (uint32_t)f32_to_bf16(sg[2 * i]) | (uint32_t)f32_to_bf16(p1) << 16;
            __m512bh w = (__m512bh)_mm512_set1_epi32((int)pair);
            const uint16_t *blk = vi + 2 * i * D;
            for (int j = 0; j < 2 * R; j++) a[j] = _mm512_dpbf16_ps(a[j], w, (__m512bh)_mm512_loadu_si512(blk + 32 * j));
        }
        for (int r = 0; r < R; r++) {               /* lane 4L + i of lo holds d = 32r + 8L + i, of hi 8L + 4 + i */
            float lo[16], hi[16];
            _mm512_storeu_ps(lo, a[2 * r]);
            _mm512_storeu_ps(hi, a[2 * r + 1]);
            for (int j = 0; j < 16; j++) {
                acc[g * D + 32 * r + 8 * (j / 4) + j % 4] = lo[j];
                acc[g * D + 32 * r + 8 * (j / 4) + 4 + j % 4] = hi[j];
            }
        }
    }
}
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

/* chunk_i8 with constant arguments where they are common (head dims 64, 128; 1-8 queries per KV head), so
 * each call inlines into its own unrolled loop nest with the G accumulators in registers. Those 16 nests are
 * most of this file's compile time (gcc 12, -march=native on a Zen 5 EPYC: 10.6-12.3 s with all 16, 3.4 s with
 * none, 3.8 s with one), so the engine builds only the one it runs:
 * with -DI8_ONE_G=g -DI8_ONE_D=d only that pair's nest (a model's int8 pool), with -DI8_NO_CASES none (a pool
 * that is not int8 never calls run_i8); without either, all 16 (the tests' and benchmarks' builds). A pair
 * outside the 16 takes the generic calls below in every build. decode_attention_i8_cases() says which. */
#define I8_CASE(GG, DD) if (G == GG && D == DD) { chunk_i8(qf, kh, vh, ksh, vsh, pages, P, k0, k1, row_len, GG, DD, m, l, acc); return; }
#define I8_CASES(DD) I8_CASE(1, DD) I8_CASE(2, DD) I8_CASE(3, DD) I8_CASE(4, DD) I8_CASE(5, DD) I8_CASE(6, DD) \
    I8_CASE(7, DD) I8_CASE(8, DD)
static void run_i8(const float *qf, const int8_t *kh, const int8_t *vh, const float *ksh, const float *vsh,
                   const int32_t *pages, int P, int64_t k0, int64_t k1, int64_t row_len, int G, int D, float *m,
                   float *l, float *acc) {
#if defined(I8_ONE_G) && defined(I8_ONE_D)
    I8_CASE(I8_ONE_G, I8_ONE_D)
#elif !defined(I8_NO_CASES)
    I8_CASES(64)
    I8_CASES(128)
#endif
    if (D == 64) chunk_i8(qf, kh, vh, ksh, vsh, pages, P, k0, k1, row_len, G, 64, m, l, acc);
    else if (D == 128) chunk_i8(qf, kh, vh, ksh, vsh, pages, P, k0, k1, row_len, G, 128, m, l, acc);
    else chunk_i8(qf, kh, vh, ksh, vsh, pages, P, k0, k1, row_len, G, D, m, l, acc);
}

/* One (row, KV head, chunk) task: q rows of that KV head's G query heads, keys [k0, k1). bf16: q (and
 * the pool unless i8) is bfloat16; i8: the pool is int8 with scales ksh, vsh (that head's, [S]). */
static void run_task(const void *qh, int bf16, int i8, float scale, const void *kh, const void *vh, const float *ksh,
                     const float *vsh, const int32_t *pages, int P, int64_t k0, int64_t k1, int64_t row_len, int G,
                     int D, float *vbuf, float *part) {
    float *m = part, *l = part + G, *acc = part + 2 * G;
#if HAVE_DPBF16
    if (!i8 && bf16 && D == 64) { chunk_bf16_dp(qh, scale, kh, vh, pages, P, k0, k1, G, 64, vbuf, m, l, acc); return; }
    if (!i8 && bf16 && D == 128) { chunk_bf16_dp(qh, scale, kh, vh, pages, P, k0, k1, G, 128, vbuf, m, l, acc); return; }
#endif
    float qf[MAX_G * MAX_D];
    for (int i = 0; i < G * D; i++) qf[i] = (bf16 ? bf16_to_f32(((const uint16_t *)qh)[i]) : ((const float *)qh)[i]) * scale;
    /* constant arguments: each call inlines into a loop nest of its own (unrolled for D 64, 128) */
    if (i8) { run_i8(qf, kh, vh, ksh, vsh, pages, P, k0, k1, row_len, G, D, m, l, acc); return; }
    else if (bf16 && D == 64) chunk_generic(qf, kh, vh, 1, pages, P, k0, k1, G, 64, vbuf, m, l, acc);
    else if (bf16 && D == 128) chunk_generic(qf, kh, vh, 1, pages, P, k0, k1, G, 128, vbuf, m, l, acc);
    else if (bf16) chunk_generic(qf, kh, vh, 1, pages, P, k0, k1, G, D, vbuf, m, l, acc);
    else if (D == 64) chunk_generic(qf, kh, vh, 0, pages, P, k0, k1, G, 64, vbuf, m, l, acc);
    else if (D == 128) chunk_generic(qf, kh, vh, 0, pages, P, k0, k1, G, 128, vbuf, m, l, acc);
    else chunk_generic(qf, kh, vh, 0, pages, P, k0, k1, G, D, vbuf, m, l, acc);
}

/* q: [B, Hq, D]; k, v: [Hkv, S, D]; pages: row b's page ids at page_start[b] .. page_start[b+1];
 * kv_len[b] keys per row (0 allowed: zeros out, lse -inf); out: [B, Hq, D]; lse: [B, Hq] or NULL.
 * Returns 0, -1 when G or D exceed what the kernel was built for, -2 when memory ran out (nothing
 * written either way). */
static int decode_attention(const void *q, const void *k, const void *v, const float *ks, const float *vs, int bf16,
                            int i8, int64_t S, const int32_t *pages, const int64_t *page_start, const int64_t *kv_len,
                            int B, int Hq, int Hkv, int D, int P, float scale, void *out, float *lse) {
    int G = Hq / Hkv;
    int64_t esize = bf16 ? 2 : 4, kvsize = i8 ? 1 : esize;   /* bytes of a q element, of a pool element */
    if (G > MAX_G || D > MAX_D || G * Hkv != Hq) return -1;
    int64_t *first = malloc(sizeof(int64_t) * (B + 1));     /* first chunk of each row */
    if (!first) return -2;
    first[0] = 0;
    for (int b = 0; b < B; b++) first[b + 1] = first[b] + (kv_len[b] + CHUNK - 1) / CHUNK;
    int64_t tasks = first[B] * Hkv, stride = (int64_t)G * (D + 2);
    float *part = malloc(sizeof(float) * (tasks > 0 ? tasks : 1) * stride);   /* m[G], l[G], acc[G * D] */
    float *vbufs = malloc(sizeof(float) * omp_get_max_threads() * CHUNK * D);  /* one per thread */
    if (!part || !vbufs) {
        free(part);
        free(vbufs);
        free(first);
        return -2;
    }
    /* tasks go out by KV head, then row, then chunk: with many tasks a thread takes TASKS_AT_ONCE consecutive
     * chunks of a row at a time, so the int8 look-ahead that runs past a chunk's end fetches the thread's own
     * next; with few (small batches, short rows) one at a time, so that every thread gets some */
    int at_once = tasks >= (int64_t)8 * TASKS_AT_ONCE * omp_get_max_threads() ? TASKS_AT_ONCE : 1;
#pragma omp parallel
    {
    unsigned int fp_was = subnormals_flushed();      /* kernel_math.h: no microcode assists in a peaked softmax */
#pragma omp for schedule(dynamic, at_once)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t c = task % first[B];
        int h = (int)(task / first[B]);
        int lo = 0, hi = B;                          /* the row whose chunks hold chunk c */
        while (hi - lo > 1) {
            int mid = (lo + hi) / 2;
            if (first[mid] <= c) lo = mid; else hi = mid;
        }
        int64_t k0 = (c - first[lo]) * CHUNK;
        int64_t k1 = k0 + CHUNK < kv_len[lo] ? k0 + CHUNK : kv_len[lo];
        const char *qh = (const char *)q + ((int64_t)lo * Hq + (int64_t)h * G) * D * esize;
        run_task(qh, bf16, i8, scale, (const char *)k + h * S * D * kvsize, (const char *)v + h * S * D * kvsize,
                 i8 ? ks + h * S : NULL, i8 ? vs + h * S : NULL, pages + page_start[lo], P, k0, k1, kv_len[lo], G, D,
                 vbufs + (int64_t)omp_get_thread_num() * CHUNK * D, part + (c * Hkv + h) * stride);
    }
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < (int64_t)B * Hq; bh++) {
        int b = (int)(bh / Hq), hq = (int)(bh % Hq), h = hq / G, g = hq % G;
        float mx = -INFINITY, total = 0.0f, o32[MAX_D];
        for (int64_t c = first[b]; c < first[b + 1]; c++) {
            float mc = part[(c * Hkv + h) * stride + g];
            mx = mc > mx ? mc : mx;
        }
        memset(o32, 0, sizeof(float) * D);
        for (int64_t c = first[b]; c < first[b + 1]; c++) {
            const float *pt = part + (c * Hkv + h) * stride;
            float w = exp_nonpos(pt[g] - mx);
            total += w * pt[G + g];
            const float *acc = pt + 2 * G + g * D;
#pragma omp simd
            for (int d = 0; d < D; d++) o32[d] += w * acc[d];
        }
        float inv = first[b + 1] > first[b] ? 1.0f / total : 0.0f;   /* no keys: zeros, lse -inf */
        for (int d = 0; d < D; d++) {
            if (bf16) ((uint16_t *)out)[bh * D + d] = f32_to_bf16(o32[d] * inv);
            else ((float *)out)[bh * D + d] = o32[d] * inv;
        }
        if (lse) lse[bh] = first[b + 1] > first[b] ? mx + logf(total) : -INFINITY;
    }
    subnormals_restored(fp_was);
    }
    free(vbufs);
    free(part);
    free(first);
    return 0;
}

int decode_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t S, const int32_t *pages,
                          const int64_t *page_start, const int64_t *kv_len, int B, int Hq, int Hkv, int D, int P,
                          float scale, uint16_t *out, float *lse) {
    return decode_attention(q, k, v, NULL, NULL, 1, 0, S, pages, page_start, kv_len, B, Hq, Hkv, D, P, scale, out, lse);
}

int decode_attention_f32(const float *q, const float *k, const float *v, int64_t S, const int32_t *pages,
                         const int64_t *page_start, const int64_t *kv_len, int B, int Hq, int Hkv, int D, int P,
                         float scale, float *out, float *lse) {
    return decode_attention(q, k, v, NULL, NULL, 0, 0, S, pages, page_start, kv_len, B, Hq, Hkv, D, P, scale, out, lse);
}

/* int8 pool (k, v [Hkv, S, D] int8; ks, vs [Hkv, S] float32 scales); q and out float32 or (qbf16) bfloat16. */
int decode_attention_i8(const void *q, const int8_t *k, const int8_t *v, const float *ks, const float *vs, int64_t S,
                        const int32_t *pages, const int64_t *page_start, const int64_t *kv_len, int B, int Hq, int Hkv,
                        int D, int P, float scale, int qbf16, void *out, float *lse) {
    return decode_attention(q, k, v, ks, vs, qbf16, 1, S, pages, page_start, kv_len, B, Hq, Hkv, D, P, scale, out, lse);
}

/* RoPE on a step's fused q/k/v projection, and k, v stored into the pool: what a layer does before its
 * attention, in one call instead of a dozen small torch operations per layer.
 * qkv: [T, Hq + 2 Hkv, D] (q heads, k heads, v heads); cos, ssin: [T, D], the step's cos and sign-folded
 * sin rows (engine/models/llama.py's RopeTable: rotate-half RoPE is x * cos + roll(x, D/2) * ssin);
 * slots: [T] pool slots (checked by the caller); k, v: one layer's pool, [Hkv, S, D]; q_out: [T, Hq, D].
 * bfloat16 rounds each product and the sum to bfloat16, as torch's three operations on bfloat16 tensors
 * do, so the result is torch's bit for bit; float32 keeps the products apart (no fused multiply-add). */
__attribute__((optimize("fp-contract=off")))
static void rope_store(const void *qkv, int bf16, const void *cos, const void *ssin, const int64_t *slots,
                       void *k, void *v, int64_t S, int64_t T, int Hq, int Hkv, int D, void *q_out, int only_q) {
    int H = Hq + 2 * Hkv, half = D / 2, heads = only_q ? Hq : H;   /* only_q: k, v are not touched */
    int64_t esize = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++) {
        for (int h = 0; h < heads; h++) {
            const char *x = (const char *)qkv + (t * H + h) * D * esize;
            char *dst;
            if (h < Hq) dst = (char *)q_out + (t * Hq + h) * D * esize;
            else if (h < Hq + Hkv) dst = (char *)k + ((int64_t)(h - Hq) * S + slots[t]) * D * esize;
            else {   /* v: stored as it is */
                memcpy((char *)v + ((int64_t)(h - Hq - Hkv) * S + slots[t]) * D * esize, x, D * esize);
                continue;
            }
            if (bf16) {
                const uint16_t *xs = (const uint16_t *)x, *c = (const uint16_t *)cos + t * D,
                               *s = (const uint16_t *)ssin + t * D;
                uint16_t *o = (uint16_t *)dst;
#pragma omp simd
                for (int d = 0; d < D; d++) {
                    float a = bf16_to_f32(f32_to_bf16(bf16_to_f32(xs[d]) * bf16_to_f32(c[d])));
                    float b = bf16_to_f32(f32_to_bf16(bf16_to_f32(xs[d < half ? d + half : d - half]) *
                                                      bf16_to_f32(s[d])));
                    o[d] = f32_to_bf16(a + b);
                }
            } else {
                const float *xs = (const float *)x, *c = (const float *)cos + t * D, *s = (const float *)ssin + t * D;
                float *o = (float *)dst;
                for (int d = 0; d < D; d++) {
                    float a = xs[d] * c[d];
                    float b = xs[d < half ? d + half : d - half] * s[d];
                    o[d] = a + b;
                }
            }
        }
    }
}

void rope_store_bf16(const uint16_t *qkv, const uint16_t *cos, const uint16_t *ssin, const int64_t *slots,
                     uint16_t *k, uint16_t *v, int64_t S, int64_t T, int Hq, int Hkv, int D, uint16_t *q_out) {
    rope_store(qkv, 1, cos, ssin, slots, k, v, S, T, Hq, Hkv, D, q_out, 0);
}

void rope_store_f32(const float *qkv, const float *cos, const float *ssin, const int64_t *slots,
                    float *k, float *v, int64_t S, int64_t T, int Hq, int Hkv, int D, float *q_out) {
    rope_store(qkv, 0, cos, ssin, slots, k, v, S, T, Hq, Hkv, D, q_out, 0);
}

/* One row of D floats -> int8 values and their scale, symmetric absmax (engine/kv_pool.py's
 * quantize_int8, bit for bit: scale = absmax / 127, 1 for a zero row; x / scale rounded half to even). */
INLINE void quantize_row(const float *x, int D, int8_t *dst, float *scale) {
    float amax = 0.0f;
    for (int d = 0; d < D; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
    float sc = amax / 127.0f;
    sc = sc == 0.0f ? 1.0f : sc;
    for (int d = 0; d < D; d++) {
        float r = nearbyintf(x[d] / sc);
        dst[d] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
    }
    *scale = sc;
}

/* rope_store into an int8 pool: q rotated as rope_store does (bfloat16 or float32, qbf16), k rotated in
 * the same arithmetic (bfloat16: rounded to bfloat16 first, as torch's rotated tensor is) and v as given,
 * each row quantized into k, v [Hkv, S, D] int8 with its scale in ks, vs [Hkv, S]. */
__attribute__((optimize("fp-contract=off")))
void rope_store_i8(const void *qkv, int qbf16, const void *cos, const void *ssin, const int64_t *slots, int8_t *k,
                   int8_t *v, float *ks, float *vs, int64_t S, int64_t T, int Hq, int Hkv, int D, void *q_out) {
    int H = Hq + 2 * Hkv, half = D / 2;
    int64_t esize = qbf16 ? 2 : 4;
    rope_store(qkv, qbf16, cos, ssin, slots, NULL, NULL, S, T, Hq, Hkv, D, q_out, 1);   /* q heads only */
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++) {
        for (int h = Hq; h < H; h++) {
            const char *x = (const char *)qkv + (t * H + h) * D * esize;
            float row[MAX_D];
            for (int d = 0; d < D; d++) row[d] = qbf16 ? bf16_to_f32(((const uint16_t *)x)[d]) : ((const float *)x)[d];
            int is_k = h < Hq + Hkv, kh = is_k ? h - Hq : h - Hq - Hkv;
            int64_t at = (int64_t)kh * S + slots[t];
            if (is_k) {
                float rot[MAX_D];
                const char *c = (const char *)cos + t * D * esize, *sn = (const char *)ssin + t * D * esize;
                for (int d = 0; d < D; d++) {
                    float cd = qbf16 ? bf16_to_f32(((const uint16_t *)c)[d]) : ((const float *)c)[d];
                    float sd = qbf16 ? bf16_to_f32(((const uint16_t *)sn)[d]) : ((const float *)sn)[d];
                    float a = row[d] * cd, b = row[d < half ? d + half : d - half] * sd;
                    if (qbf16) {
                        a = bf16_to_f32(f32_to_bf16(a));
                        b = bf16_to_f32(f32_to_bf16(b));
                        rot[d] = bf16_to_f32(f32_to_bf16(a + b));
                    } else {
                        rot[d] = a + b;
                    }
                }
                quantize_row(rot, D, k + at * D, ks + at);
            } else {
                quantize_row(row, D, v + at * D, vs + at);
            }
        }
    }
}

/* Whether the bfloat16 scores run on vdpbf16ps (built for a CPU with AVX512-BF16). */
int decode_attention_dpbf16(void) { return HAVE_DPBF16; }

/* The int8 pairs with a loop nest of their own (run_i8): 1000 * G + D for the one of an I8_ONE_G / I8_ONE_D
 * build, 0 for none (I8_NO_CASES), -1 for all 16. */
int decode_attention_i8_cases(void) {
#if defined(I8_ONE_G) && defined(I8_ONE_D)
    return 1000 * I8_ONE_G + I8_ONE_D;
#elif defined(I8_NO_CASES)
    return 0;
#else
    return -1;
#endif
}
