/* A decode step's decoder layers in one C call, in bfloat16 or float32 activations: the same kernel calls, in
 * the same order and on the same values, as engine/models/llama.py's ``LlamaModel._forward_fused`` makes from
 * Python one at a time.
 *
 * On GGUF blocks a batch-1 decode step of the default model (30 layers) made ~215 calls through ctypes
 * (per layer: two add + RMSNorm, the fused q/k/v projection, RoPE + the K/V write, decode attention, the
 * output projection, the SwiGLU MLP), each with its Python around it: on a 2-core AVX2 EPYC, 4-5 ms of a
 * 10.4 ms step was the main thread outside the kernels while the second core waited. Here the loop over
 * layers runs in C, and Python makes one call.
 *
 * The kernels themselves stay where they are tested (csrc/qmatmul.c, csrc/layer_ops.c,
 * engine/attention/csrc/decode_attention.c); engine/models/decode_step.py passes their addresses (``FNS``),
 * so this file calls exactly the functions the Python path calls, and needs none of their code. The
 * result is bit for bit the Python path's (tests/engine/test_decode_step.py).
 *
 * The Python path's MLP differs by dtype, and so does this loop's: float32 on 4-bit blocks runs the whole SwiGLU
 * MLP as one kernel call (``qmm_swiglu_q4_f32``), bfloat16 (and float32 with a projection on 8-bit blocks) as three
 * (the gate/up projection, ``silu_mul_bf16`` / ``silu_mul_f32``, the down projection), each rounding to bfloat16
 * as the Python path's tensors do. A projection on 8-bit blocks (a K-quant GGUF's wider layers) goes through
 * ``qmm_q8``, as ``BlockLinear`` sends it.
 *
 * Layer l's addresses (``layers`` [L, LAYER_WORDS] int64): input norm weight, post-attention norm weight
 * (float32 [H]), the packed q/k/v, o, gate/up and down projections (qmatmul.py's ``Packed``), the
 * pool's k and v for the layer ([Hkv, S, D], of the activations' dtype or int8) and, for int8 pages, their
 * scales ([Hkv, S]); then which projections are 8-bit (W_BITS).
 */
#include <stdint.h>
#include <stdlib.h>

/* the activations' functions take float (float32) or uint16_t (bfloat16) buffers: void here */
typedef int (*norm_fn)(void *x, const void *delta, const float *w, float eps, int64_t T, int64_t H, void *out);
typedef int (*qmm_fn)(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y,
                      int y_bf16);
typedef int (*swiglu_fn)(const float *x, int64_t M, int64_t K, const uint8_t *gate_up, int64_t I,
                         const uint8_t *down, int64_t N, float *y);
typedef void (*silu_mul_fn)(const void *gate_up, int64_t T, int64_t I, void *out);
typedef void (*rope_fn)(const void *qkv, const void *cos, const void *ssin, const int64_t *slots, void *k, void *v,
                        int64_t S, int64_t T, int Hq, int Hkv, int D, void *q_out);
typedef void (*rope_i8_fn)(const void *qkv, int qbf16, const void *cos, const void *ssin, const int64_t *slots,
                           int8_t *k, int8_t *v, float *ks, float *vs, int64_t S, int64_t T, int Hq, int Hkv, int D,
                           void *q_out);
typedef int (*attn_fn)(const void *q, const void *k, const void *v, int64_t S, const int32_t *pages,
                       const int64_t *page_start, const int64_t *kv_len, int B, int Hq, int Hkv, int D, int P,
                       float scale, void *out, float *lse);
typedef int (*attn_i8_fn)(const void *q, const int8_t *k, const int8_t *v, const float *ks, const float *vs,
                          int64_t S, const int32_t *pages, const int64_t *page_start, const int64_t *kv_len, int B,
                          int Hq, int Hkv, int D, int P, float scale, int qbf16, void *out, float *lse);

/* a step whose rows share a prefix (scored once for all of them by the backend, engine/attention/torch_backend.py
 * _KernelDecode): the backend's own attention of layer l, q [T, Hq, D] -> out [T, Hq, D] in the activations'
 * dtype, called back into Python; 0 on success */
typedef int (*attend_fn)(int layer, void *q, void *out);

/* the kernels, by address (decode_step.py FNS, in this order) */
typedef struct {
    norm_fn add_rms_norm_f32, add_rms_norm_bf16;
    qmm_fn qmm_q4;
    swiglu_fn swiglu_f32;
    silu_mul_fn silu_mul_bf16;
    rope_fn rope_f32, rope_bf16;
    rope_i8_fn rope_i8;
    attn_fn attn_f32, attn_bf16;
    attn_i8_fn attn_i8;
    qmm_fn qmm_q8;
    silu_mul_fn silu_mul_f32;
} kernels;

/* a layer's words: its norms' and projections' addresses, its pool's, and W_BITS: which projections are on 8-bit
 * blocks (a GGUF's wider layers, Q6_K, Q8_0, ...), bit i for projection i (BIT_QKV ...), the others on 4-bit ones */
enum { W_IN_NORM, W_POST_NORM, W_QKV, W_O, W_GATE_UP, W_DOWN, KV_K, KV_V, KV_KS, KV_VS, W_BITS, LAYER_WORDS };
enum { BIT_QKV = 1, BIT_O = 2, BIT_GATE_UP = 4, BIT_DOWN = 8 };

typedef struct {
    int64_t T, H, I, S;        /* rows, hidden size, MLP intermediate size, pool slots per KV head */
    int32_t L, Hq, Hkv, D, P;  /* layers, query / KV heads, head size, page size */
    int32_t int8_pages;        /* 1: the pool is int8 with scales */
    int32_t bf16;              /* 1: bfloat16 activations (and pages, unless int8), 0: float32 */
    float scale;               /* attention's 1 / sqrt(D), as the Python path rounds it */
} shape;

#define PTR(l, w) ((void *)(intptr_t)layers[(int64_t)(l) * LAYER_WORDS + (w)])
/* the matmul of layer l's projection with bit b: on 8-bit or 4-bit blocks */
#define MM(l, b) ((layers[(int64_t)(l) * LAYER_WORDS + W_BITS] & (b)) ? k->qmm_q8 : k->qmm_q4)

/* x [T, H] (float32 or, s->bf16, bfloat16): the embedded tokens, updated in place to the residual stream as
 * the Python path leaves it; eps [L + 1]: each layer's input norm eps then the final norm's (post-attention
 * norms use post_eps [L]); final_w: the final norm's weight; h_out [T, H]: the final norm of the residual
 * stream. cos, ssin [T, D] in x's dtype; slots [T]; pages / page_start / kv_len: the rows' pages as the
 * decode kernel reads them, or attend (then they are unused): the attention of each layer, called back.
 * Returns 0; 100 * layer + op for the first kernel that failed (op: 1 the first norm, 2 q/k/v, 3 attention,
 * 4 o, 5 the post-attention norm, 6 MLP, 7 the next norm); -2 when out of memory. L >= 1. */
int decode_layers(const kernels *k, const int64_t *layers, const shape *s, const float *eps, const float *post_eps,
                  const float *final_w, void *x, const void *cos, const void *ssin, const int64_t *slots,
                  const int32_t *pages, const int64_t *page_start, const int64_t *kv_len, attend_fn attend,
                  void *h_out) {
    const int64_t T = s->T, H = s->H, I = s->I, qd = (int64_t)s->Hq * s->D;
    const int64_t qkvd = (int64_t)(s->Hq + 2 * s->Hkv) * s->D;
    const int bf = s->bf16;
    const size_t es = bf ? 2 : 4;   /* bytes an activation */
    /* qkv, q, attention out, h, d, the gate/up output and silu(gate) * up (bfloat16, or an MLP on 8-bit blocks) */
    int64_t n = T * (qkvd + 2 * qd + 2 * H + 3 * I);
    char *buf = malloc(es * (size_t)n + 64);
    if (!buf) return -2;
    char *qkv = buf, *q = qkv + es * T * qkvd, *att = q + es * T * qd, *h = att + es * T * qd, *d = h + es * T * H;
    char *gu = d + es * T * H, *mid = gu + es * T * 2 * I;
    norm_fn norm = bf ? k->add_rms_norm_bf16 : k->add_rms_norm_f32;
    int rc = norm(x, NULL, PTR(0, W_IN_NORM), eps[0], T, H, h) ? 1 : 0;
    for (int l = 0; l < s->L && rc == 0; l++) {
        int op = 2;
        rc = MM(l, BIT_QKV)(h, bf, T, H, PTR(l, W_QKV), qkvd, qkv, bf);
        if (rc == 0) {
            op = 3;
            if (s->int8_pages)
                k->rope_i8(qkv, bf, cos, ssin, slots, PTR(l, KV_K), PTR(l, KV_V), PTR(l, KV_KS), PTR(l, KV_VS), s->S,
                           T, s->Hq, s->Hkv, s->D, q);
            else
                (bf ? k->rope_bf16 : k->rope_f32)(qkv, cos, ssin, slots, PTR(l, KV_K), PTR(l, KV_V), s->S, T, s->Hq,
                                                  s->Hkv, s->D, q);
            if (attend)
                rc = attend(l, q, att);
            else if (s->int8_pages)
                rc = k->attn_i8(q, PTR(l, KV_K), PTR(l, KV_V), PTR(l, KV_KS), PTR(l, KV_VS), s->S, pages, page_start,
                                kv_len, (int)T, s->Hq, s->Hkv, s->D, s->P, s->scale, bf, att, NULL);
            else
                rc = (bf ? k->attn_bf16 : k->attn_f32)(q, PTR(l, KV_K), PTR(l, KV_V), s->S, pages, page_start,
                                                       kv_len, (int)T, s->Hq, s->Hkv, s->D, s->P, s->scale, att,
                                                       NULL);
        }
        if (rc == 0) op = 4, rc = MM(l, BIT_O)(att, bf, T, qd, PTR(l, W_O), H, d, bf);
        if (rc == 0) op = 5, rc = norm(x, d, PTR(l, W_POST_NORM), post_eps[l], T, H, h);
        if (rc == 0) {
            op = 6;
            if (bf || (layers[(int64_t)l * LAYER_WORDS + W_BITS] & (BIT_GATE_UP | BIT_DOWN))) {
                /* three calls, as the Python loop makes them (the fused float32 SwiGLU takes 4-bit blocks only) */
                rc = MM(l, BIT_GATE_UP)(h, bf, T, H, PTR(l, W_GATE_UP), 2 * I, gu, bf);
                if (rc == 0) {
                    (bf ? k->silu_mul_bf16 : k->silu_mul_f32)(gu, T, I, mid);
                    rc = MM(l, BIT_DOWN)(mid, bf, T, I, PTR(l, W_DOWN), H, d, bf);
                }
            } else {
                rc = k->swiglu_f32((const float *)h, T, H, PTR(l, W_GATE_UP), I, PTR(l, W_DOWN), H, (float *)d);
            }
        }
        if (rc == 0) {
            op = 7;
            const float *w = l + 1 < s->L ? PTR(l + 1, W_IN_NORM) : final_w;
            rc = norm(x, d, w, eps[l + 1], T, H, l + 1 < s->L ? (void *)h : h_out);
        }
        if (rc != 0) rc = 100 * l + op;
    }
    free(buf);
    return rc;
}
