/* Scalar helpers every CPU kernel shares (engine/attention/csrc/decode_attention.c,
 * engine/models/csrc/layer_ops.c, engine/models/csrc/qmatmul.c, engine/loader/csrc/gguf_dequant.c): bfloat16 <-> float32
 * as torch converts, float16 -> float32, and exp(x) for x <= 0 as
 * exp2 of a polynomial, so that the loops around it vectorise. engine/cpu_build.py compiles every kernel
 * with this folder on the include path and keys its cache by these headers too. */
#ifndef AGENTRT_KERNEL_MATH_H
#define AGENTRT_KERNEL_MATH_H

#include <math.h>
#include <stdint.h>

#define INLINE static inline __attribute__((always_inline))

typedef union { uint32_t u; float f; } bits32;

INLINE float bf16_to_f32(uint16_t x) {
    bits32 c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

INLINE uint16_t f32_to_bf16(float f) {
    bits32 c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40u);  /* NaN stays NaN */
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);                   /* nearest even */
}

/* IEEE half -> float, exactly (every half is a float) */
INLINE float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    bits32 c;
    if (exp == 0x1F) c.u = sign | 0x7F800000u | (man << 13);                /* inf, NaN */
    else if (exp) c.u = sign | ((exp + 112) << 23) | (man << 13);           /* normal */
    else {                                                                  /* zero, subnormal */
        c.f = (float)man * 5.9604644775390625e-8f;                          /* man * 2^-24 */
        c.u |= sign;
    }
    return c.f;
}

/* Subnormal float32s flushed to zero, as operands and as results, in the calling thread (the FTZ and DAZ bits of
 * its SSE control register) until subnormals_restored puts back what was there. An attention kernel runs its
 * threads so: in a very peaked softmax many keys' exp(s - max) sit at float32's floor (scores ~87 below the
 * best; the default model's heads did not reach it in a measured decode, sink-heavy heads of larger models
 * can), their products with the values and the sums that start from them are subnormal, and an x86 core takes a
 * microcode assist for every multiply-add with a subnormal operand or result: one decode call of 64 rows x 2,048
 * keys with the query 10x a standard normal (benchmarks/decode_kernel_ab.py --query-scale 10, x86-64-v3 build,
 * 2-core Xeon) took 23 ms over bfloat16 pages against 6 ms with scores of an ordinary spread. Flushed, what is
 * lost is below 1.2e-38 of a term; torch's own kernels are untouched (the bits go back as they were). Elsewhere
 * (no SSE) nothing is changed. */
#if defined(__SSE__)
#include <xmmintrin.h>
INLINE unsigned int subnormals_flushed(void) {
    unsigned int was = _mm_getcsr();
    _mm_setcsr(was | 0x8040u);                 /* FTZ (bit 15), DAZ (bit 6) */
    return was;
}
INLINE void subnormals_restored(unsigned int was) { _mm_setcsr(was); }
#else
INLINE unsigned int subnormals_flushed(void) { return 0; }
INLINE void subnormals_restored(unsigned int was) { (void)was; }
#endif

/* exp(x) for x <= 0 (clamped at -87, where it is below float32's smallest normal anyway): 2^t with
 * t = x log2(e) = n + f, 2^f by a least-squares polynomial of degree 6 (relative error below 1e-7).
 * EXP2_POLY(step) evaluates it by Horner's rule, one coefficient per step, so that the scalar form below and
 * the 16-lane one share the coefficients. */
#define EXP_LOG2E 1.4426950408889634f
#define EXP2_POLY(step, p)                   \
    p = step(p, 1.2387821452754277e-3f);     \
    p = step(p, 9.6845804549791600e-3f);     \
    p = step(p, 5.5480426324716045e-2f);     \
    p = step(p, 2.4023050204510465e-1f);     \
    p = step(p, 6.9314692869304260e-1f);     \
    p = step(p, 1.0000000025868887f)
#define EXP2_POLY_LEAD 2.1877504861477862e-4f

INLINE float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * EXP_LOG2E;
    float n = floorf(t);
    float f = t - n;                            /* [0, 1) */
    float p = EXP2_POLY_LEAD;
#define EXP2_SCALAR_STEP(p, c) ((p) * f + (c))
    EXP2_POLY(EXP2_SCALAR_STEP, p);
#undef EXP2_SCALAR_STEP
    bits32 c;
    c.u = (uint32_t)((int32_t)n + 127) << 23;   /* 2^n, n in [-126, 0] */
    return p * c.f;
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* exp_nonpos on 16 lanes (2^n applied by vscalefps). */
INLINE __m512 exp_nonpos16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(EXP2_POLY_LEAD);
#define EXP2_VEC_STEP(p, c) _mm512_fmadd_ps((p), f, _mm512_set1_ps(c))
    EXP2_POLY(EXP2_VEC_STEP, p);
#undef EXP2_VEC_STEP
    return _mm512_scalef_ps(p, n);
}
#endif

/* silu(x) = x / (1 + exp(-x)), with exp of -|x| only: x * e / (1 + e) for x < 0, e = exp(x); below -87 it is
 * 0 (torch's exp(-x) overflows there, or nearly: |silu(x)| < 1e-36). SwiGLU's activation in
 * engine/models/csrc/layer_ops.c and in the fused MLP of engine/models/csrc/qmatmul.c: one formula, so the
 * two give the same values. */
INLINE float silu_f32(float x) {
    float e = exp_nonpos(x < 0.0f ? x : -x);
    return x < -87.0f ? 0.0f : (x < 0.0f ? x * e : x) / (1.0f + e);
}

#endif
