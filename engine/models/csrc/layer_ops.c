/* Small per-layer operations of a CPU step, each one C call instead of several torch calls.
 *
 * add_rms_norm_bf16: a decoder layer ends each half with x = x + f(norm(x)); the next half starts with
 * norm(x). In torch that is an add, a widening, the norm's own operations and a narrowing: some 15 us of
 * dispatch per norm at a decode step's one row, 61 norms a step for a 30-layer model. Here:
 *   x[t] = bf16(x[t] + delta[t])                (as torch adds two bfloat16 tensors; skipped if delta is NULL)
 *   out[t] = bf16(x[t] * rsqrt(mean(x[t]^2) + eps) * w)     (float32 inside, as torch's rms_norm)
 * silu_mul_bf16: SwiGLU's activation on the fused gate/up projection, out = bf16(bf16(silu(gate)) * up),
 * the roundings of torch's silu and multiply on bfloat16 tensors, without the split.
 * add_rms_norm_f32, silu_mul_f32: the same on float32 activations (a CPU without native bf16 runs its steps
 * in float32): the add exact as torch's, the norm and silu in float32 as torch computes them but for the
 * order of the sum of squares and the exponential's last bit.
 * engine/models/cpu_ops.py builds and calls them; engine/models/llama.py's plain layers are the
 * reference they are tested against (tests/engine/test_cpu_ops.py).
 */
#include <math.h>
#include <stdint.h>

#include "kernel_math.h"   /* engine/csrc: bits32, bf16 <-> f32, exp_nonpos, silu_f32 */

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

/* gate_up: [T, 2 I] bfloat16, gate in the first I columns, up in the last I; out: [T, I]. silu: kernel_math.h's
 * silu_f32. */
void silu_mul_bf16(const uint16_t *gate_up, int64_t T, int64_t I, uint16_t *out) {
#pragma omp parallel for schedule(static) if (T >= 32)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = gate_up + t * 2 * I, *u = g + I;
        uint16_t *o = out + t * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) {
            o[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(silu_f32(bf16_to_f32(g[i])))) * bf16_to_f32(u[i]));
        }
    }
}

/* x, delta, out: [T, H] float32 (delta may be NULL); w: [H] float32. Returns -1 if H > MAX_H (the bound is
 * the bfloat16 version's, kept for one limit on the Python side). */
int add_rms_norm_f32(float *x, const float *delta, const float *w, float eps, int64_t T, int64_t H, float *out) {
    if (H > MAX_H) return -1;
#pragma omp parallel for schedule(static) if (T >= 32)
    for (int64_t t = 0; t < T; t++) {
        float *xt = x + t * H;
        float ss = 0.0f;
        if (delta) {
            const float *dt = delta + t * H;
#pragma omp simd reduction(+:ss)
            for (int64_t h = 0; h < H; h++) {
                float s = xt[h] + dt[h];
                xt[h] = s;
                ss += s * s;
            }
        } else {
#pragma omp simd reduction(+:ss)
            for (int64_t h = 0; h < H; h++) ss += xt[h] * xt[h];
        }
        float r = 1.0f / sqrtf(ss / (float)H + eps);
        float *ot = out + t * H;
#pragma omp simd
        for (int64_t h = 0; h < H; h++) ot[h] = xt[h] * r * w[h];
    }
    return 0;
}

/* gate_up: [T, 2 I] float32, gate then up; out: [T, I] = silu(gate) * up. */
void silu_mul_f32(const float *gate_up, int64_t T, int64_t I, float *out) {
#pragma omp parallel for schedule(static) if (T >= 32)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *o = out + t * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) o[i] = silu_f32(g[i]) * u[i];
    }
}
