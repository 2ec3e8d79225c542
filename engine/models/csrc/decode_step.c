/* A float32 decode step's decoder layers in one C call: the same kernel calls, in the same order and on the
 * same values, as engine/models/llama.py's ``LlamaModel._forward_fused`` makes from Python one at a time.
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
 * Layer l's addresses (``layers`` [L, LAYER_WORDS] int64): input norm weight, post-attention norm weight
 * (float32 [H]), the 4-bit packed q/k/v, o, gate/up and down projections (qmatmul.py's ``Packed``), the
 * pool's k and v for the layer ([Hkv, S, D], float32 or int8) and, for int8 pages, their scales ([Hkv, S]).
 */
#include <stdint.h>
#include <stdlib.h>

typedef int (*norm_fn)(float *x, const float *delta, const float *w, float eps, int64_t T, int64_t H, float *out);
typedef int (*qmm_fn)(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N, void *y,
                      int y_bf16);
typedef int (*swiglu_fn)(const float *x, int64_t M, int64_t K, const uint8_t *gate_up, int64_t I,
                         const uint8_t *down, int64_t N, float *y);
typedef void (*rope_f32_fn)(const float *qkv, const float *cos, const float *ssin, const int64_t *slots, float *k,
                            float *v, int64_t S, int64_t T, int Hq, int Hkv, int D, float *q_out);
typedef void (*rope_i8_fn)(const void *qkv, int qbf16, const void *cos, const void *ssin, const int64_t *slots,
                           int8_t *k, int8_t *v, float *ks, float *vs, int64_t S, int64_t T, int Hq, int Hkv, int D,
                           void *q_out);
typedef int (*attn_f32_fn)(const float *q, const float *k, const float *v, int64_t S, const int32_t *pages,
                           const int64_t *page_start, const int64_t *kv_len, int B, int Hq, int Hkv, int D, int P,
                           float scale, float *out, float *lse);
typedef int (*attn_i8_fn)(const void *q, const int8_t *k, const int8_t *v, const float *ks, const float *vs,
                          int64_t S, const int32_t *pages, const int64_t *page_start, const int64_t *kv_len, int B,
                          int Hq, int Hkv, int D, int P, float scale, int qbf16, void *out, float *lse);

/* a step whose rows share a prefix (scored once for all of them by the backend, engine/attention/torch_backend.py
 * _KernelDecode): the backend's own attention of layer l, q [T, Hq, D] -> out [T, Hq, D], called back into
 * Python; 0 on success */
typedef int (*attend_fn)(int layer, float *q, float *out);

/* the kernels, by address (decode_step.py FNS, in this order) */
typedef struct {
    norm_fn add_rms_norm;
    qmm_fn qmm_q4;
    swiglu_fn swiglu;
    rope_f32_fn rope_f32;
    rope_i8_fn rope_i8;
    attn_f32_fn attn_f32;
    attn_i8_fn attn_i8;
} kernels;

enum { W_IN_NORM, W_POST_NORM, W_QKV, W_O, W_GATE_UP, W_DOWN, KV_K, KV_V, KV_KS, KV_VS, LAYER_WORDS };

typedef struct {
    int64_t T, H, I, S;        /* rows, hidden size, MLP intermediate size, pool slots per KV head */
    int32_t L, Hq, Hkv, D, P;  /* layers, query / KV heads, head size, page size */
    int32_t int8_pages;        /* 1: the pool is int8 with scales */
    float scale;               /* attention's 1 / sqrt(D), as the Python path rounds it */
} shape;

#define PTR(l, w) ((void *)(intptr_t)layers[(int64_t)(l) * LAYER_WORDS + (w)])

/* x [T, H] float32: the embedded tokens, updated in place to the residual stream as the Python path
 * leaves it; eps [L + 1]: each layer's input norm eps then the final norm's (post-attention norms use
 * post_eps [L]); final_w: the final norm's weight; h_out [T, H]: the final norm of the residual stream.
 * cos, ssin [T, D]; slots [T]; pages / page_start / kv_len: the rows' pages as the decode kernel reads them,
 * or attend (then they are unused): the attention of each layer, called back.
 * Returns 0; 100 * layer + op for the first kernel that failed (op: 1 the first norm, 2 q/k/v, 3 attention,
 * 4 o, 5 the post-attention norm, 6 MLP, 7 the next norm); -2 when out of memory. L >= 1. */
int decode_layers_f32(const kernels *k, const int64_t *layers, const shape *s, const float *eps,
                      const float *post_eps, const float *final_w, float *x, const float *cos, const float *ssin,
                      const int64_t *slots, const int32_t *pages, const int64_t *page_start, const int64_t *kv_len,
                      attend_fn attend, float *h_out) {
    const int64_t T = s->T, H = s->H, qd = (int64_t)s->Hq * s->D, qkvd = (int64_t)(s->Hq + 2 * s->Hkv) * s->D;
    float *buf = malloc(sizeof(float) * (size_t)(T * (qkvd + 2 * qd + 2 * H)) + 64);
    if (!buf) return -2;
    float *qkv = buf, *q = qkv + T * qkvd, *att = q + T * qd, *h = att + T * qd, *d = h + T * H;
    int rc = k->add_rms_norm(x, NULL, PTR(0, W_IN_NORM), eps[0], T, H, h) ? 1 : 0;
    for (int l = 0; l < s->L && rc == 0; l++) {
        int op = 2;
        rc = k->qmm_q4(h, 0, T, H, PTR(l, W_QKV), qkvd, qkv, 0);
        if (rc == 0) {
            op = 3;
            if (s->int8_pages)
                k->rope_i8(qkv, 0, cos, ssin, slots, PTR(l, KV_K), PTR(l, KV_V), PTR(l, KV_KS), PTR(l, KV_VS), s->S,
                           T, s->Hq, s->Hkv, s->D, q);
            else
                k->rope_f32(qkv, cos, ssin, slots, PTR(l, KV_K), PTR(l, KV_V), s->S, T, s->Hq, s->Hkv, s->D, q);
            if (attend)
                rc = attend(l, q, att);
            else if (s->int8_pages)
                rc = k->attn_i8(q, PTR(l, KV_K), PTR(l, KV_V), PTR(l, KV_KS), PTR(l, KV_VS), s->S, pages, page_start,
                                kv_len, (int)T, s->Hq, s->Hkv, s->D, s->P, s->scale, 0, att, NULL);
            else
                rc = k->attn_f32(q, PTR(l, KV_K), PTR(l, KV_V), s->S, pages, page_start, kv_len, (int)T, s->Hq,
                                 s->Hkv, s->D, s->P, s->scale, att, NULL);
        }
        if (rc == 0) op = 4, rc = k->qmm_q4(att, 0, T, qd, PTR(l, W_O), H, d, 0);
        if (rc == 0) op = 5, rc = k->add_rms_norm(x, d, PTR(l, W_POST_NORM), post_eps[l], T, H, h);
        if (rc == 0) op = 6, rc = k->swiglu(h, T, H, PTR(l, W_GATE_UP), s->I, PTR(l, W_DOWN), H, d);
        if (rc == 0) {
            op = 7;
            const float *w = l + 1 < s->L ? PTR(l + 1, W_IN_NORM) : final_w;
            rc = k->add_rms_norm(x, d, w, eps[l + 1], T, H, l + 1 < s->L ? h : h_out);
        }
        if (rc != 0) rc = 100 * l + op;
    }
    free(buf);
    return rc;
}
