/* The residual stream's add and the next RMSNorm in one pass, bfloat16 activations on the CPU.
 *
 * A decoder layer ends each half with x = x + f(norm(x)); the next half starts with norm(x). In
 * torch that is an add, a widening, the norm's own operations and a narrowing: some 15 us of
 * dispatch per norm at a decode step's one row, 61 norms a step for a 30-layer model. Here:
 *   x[t] = bf16(x[t] + delta[t])                (as torch adds two bfloat16 tensors; skipped if delta is NULL)
 *   out[t] = bf16(x[t] * rsqrt(mean(x[t]^2) + eps) * w)     (float32 inside, as torch's rms_norm)
 * engine/models/fused_norm.py builds and calls it; engine/models/llama.py's unfused layers are the
 * reference it is tested against (tests/engine/test_fused_norm.py).
 */
#include <math.h>
#include <stdint.h>

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

#define MAX_H 16384

/* x, delta, out: [T, H] bfloat16 (delta may be NULL); w: [H] float32. Returns -1 if H > MAX_H. */
int add_rms_norm_bf16(uint16_t *x, const uint16_t *delta, const float *w, float eps, int64_t T, int64_t H,
                      uint16_t *out) {
    if (H > MAX_H) return -1;
#pragma omp parallel for schedule(static) if (T >= 32)
    for (int64_t t = 0; t < T; t++) {
        float v[MAX_H];
        uint16_t *xt = x + t * H;
        float ss = 0.0f;
        if (delta) {
            const uint16_t *dt = delta + t * H;
#pragma omp simd reduction(+:ss)
            for (int64_t h = 0; h < H; h++) {
                uint16_t s = f32_to_bf16(bf16_to_f32(xt[h]) + bf16_to_f32(dt[h]));
                xt[h] = s;
                v[h] = bf16_to_f32(s);
                ss += v[h] * v[h];
            }
        } else {
#pragma omp simd reduction(+:ss)
            for (int64_t h = 0; h < H; h++) {
                v[h] = bf16_to_f32(xt[h]);
                ss += v[h] * v[h];
            }
        }
        float r = 1.0f / sqrtf(ss / (float)H + eps);
        uint16_t *ot = out + t * H;
#pragma omp simd
        for (int64_t h = 0; h < H; h++) ot[h] = f32_to_bf16(v[h] * r * w[h]);
    }
    return 0;
}
