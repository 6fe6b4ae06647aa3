/*
 * specserve CPU decoder kernels: one call runs the whole Llama-family decoder
 * stack over a flattened ragged batch, with bf16 weights and a bf16 paged KV
 * cache, fp32 activations and fp32 accumulation (AVX512-BF16 dot products).
 *
 * Why: at 135M parameters a decode step is ~1000 small torch ops whose
 * dispatch costs as much as the weight traffic itself.  Here a forward is one
 * call; the GEMVs stream each weight row once per step for all rows of the
 * batch (decode tokens and K+1 verification positions alike).
 *
 * Every output row is computed by the same instruction sequence whatever the
 * batch holds (no cross-row reductions, fixed blocking along K), so a token's
 * logits do not depend on its neighbours: speculative verification of K+1
 * positions gives bit-identical results to decoding them one by one.
 *
 * Built by specserve/kernels/cpu_decoder.py with gcc; the same OpenMP runtime
 * as torch's is used (libgomp is already loaded by torch).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

typedef struct {
    const bf16 *wqkv;   /* (q + 2kv, H) */
    const float *bqkv;  /* (q + 2kv) or NULL */
    const float *ln1;   /* (H) */
    const float *ln2;   /* (H) */
    const float *qnorm; /* (hd) or NULL (Qwen3 q/k norm) */
    const float *knorm;
    const bf16 *wo;     /* (H, q) */
    const bf16 *wgu;    /* (2I, H): gate rows then up rows */
    const bf16 *wdown;  /* (H, I) */
    bf16 *kcache;       /* (slots, nkv, hd) */
    bf16 *vcache;
} ss_layer;

typedef struct {
    int32_t hidden, inter, n_layers, n_heads, n_kv_heads, head_dim;
    int32_t block_size, window, n_positions, reserved;
    float eps, scale;
    const bf16 *embed;        /* (V, H) */
    const float *final_norm;  /* (H) */
    const float *cos;         /* (n_positions, hd/2), attention scaling included */
    const float *sin;
    const ss_layer *layers;
} ss_model;

/* ------------------------------------------------------------------ helpers */

static inline __m512 load_bf16x16(const bf16 *p) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

static inline __m512 load_bf16x16_mask(const bf16 *p, __mmask16 m) {
    __m256i v = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

static inline float bf16_to_f32(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 conversion does. */
static inline bf16 f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

static void f32_row_to_bf16(const float *src, bf16 *dst, int n) {
    for (int i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}

static inline __m512 exp512(__m512 x) {
    /* exp(x) = 2^n * exp(g), n = round(x log2 e), |g| <= ln2/2; Taylor to g^6
       (relative error ~1e-7). */
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 g = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    g = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), g);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static float exp_scalar(float x) {
    float buf[16] = {0};
    buf[0] = x;
    float out[16];
    _mm512_storeu_ps(out, exp512(_mm512_loadu_ps(buf)));
    return out[0];
}

/* --------------------------------------------------------------------- GEMV */

#ifndef PREFETCH
#define PREFETCH 4096
#endif

/* r[i][m] = dot(w_i, x_m) over K for 4 weight rows and MB input rows. */
static inline __attribute__((always_inline)) void dot_block(
    const int MB, const bf16 *restrict x, long ldx, const bf16 *w0, const bf16 *w1, const bf16 *w2,
    const bf16 *w3, int K, float r[4][4]) {
    __m512 acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int m = 0; m < MB; m++) acc[i][m] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        /* The weight rows are one contiguous stream: fetch PREFETCH bytes ahead. */
        _mm_prefetch((const char *)(w0 + k) + PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)(w1 + k) + PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)(w2 + k) + PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)(w3 + k) + PREFETCH, _MM_HINT_T0);
        __m512i a0 = _mm512_loadu_si512(w0 + k), a1 = _mm512_loadu_si512(w1 + k);
        __m512i a2 = _mm512_loadu_si512(w2 + k), a3 = _mm512_loadu_si512(w3 + k);
        for (int m = 0; m < MB; m++) {
            __m512i xv = _mm512_loadu_si512(x + m * ldx + k);
            acc[0][m] = _mm512_dpbf16_ps(acc[0][m], (__m512bh)a0, (__m512bh)xv);
            acc[1][m] = _mm512_dpbf16_ps(acc[1][m], (__m512bh)a1, (__m512bh)xv);
            acc[2][m] = _mm512_dpbf16_ps(acc[2][m], (__m512bh)a2, (__m512bh)xv);
            acc[3][m] = _mm512_dpbf16_ps(acc[3][m], (__m512bh)a3, (__m512bh)xv);
        }
    }
    if (k < K) {
        __mmask32 mk = (__mmask32)((1ull << (K - k)) - 1ull);
        __m512i a0 = _mm512_maskz_loadu_epi16(mk, w0 + k), a1 = _mm512_maskz_loadu_epi16(mk, w1 + k);
        __m512i a2 = _mm512_maskz_loadu_epi16(mk, w2 + k), a3 = _mm512_maskz_loadu_epi16(mk, w3 + k);
        for (int m = 0; m < MB; m++) {
            __m512i xv = _mm512_maskz_loadu_epi16(mk, x + m * ldx + k);
            acc[0][m] = _mm512_dpbf16_ps(acc[0][m], (__m512bh)a0, (__m512bh)xv);
            acc[1][m] = _mm512_dpbf16_ps(acc[1][m], (__m512bh)a1, (__m512bh)xv);
            acc[2][m] = _mm512_dpbf16_ps(acc[2][m], (__m512bh)a2, (__m512bh)xv);
            acc[3][m] = _mm512_dpbf16_ps(acc[3][m], (__m512bh)a3, (__m512bh)xv);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int m = 0; m < MB; m++) r[i][m] = _mm512_reduce_add_ps(acc[i][m]);
}

/* y[m, n] (+)= sum_k x[m, k] W[n, k] (+ bias[n]) for bf16 x (M, K; row stride
   ldx) and bf16 W (N, K) row-major; fp32 y (row stride ldy).  Threads split N. */
static void gemv(const bf16 *x, int M, long ldx, const bf16 *W, int N, int K, const float *bias, float *y,
                 long ldy, int accumulate) {
    const int nblocks = (N + 3) / 4;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < nblocks; b++) {
        const int n = b * 4;
        const int nb = N - n < 4 ? N - n : 4;
        const bf16 *w0 = W + (long)n * K;
        const bf16 *w1 = nb > 1 ? w0 + K : w0;
        const bf16 *w2 = nb > 2 ? w0 + 2L * K : w0;
        const bf16 *w3 = nb > 3 ? w0 + 3L * K : w0;
        for (int m0 = 0; m0 < M; m0 += 4) {
            const int mb = M - m0 < 4 ? M - m0 : 4;
            const bf16 *xm = x + (long)m0 * ldx;
            float r[4][4];
            switch (mb) {
            case 4: dot_block(4, xm, ldx, w0, w1, w2, w3, K, r); break;
            case 3: dot_block(3, xm, ldx, w0, w1, w2, w3, K, r); break;
            case 2: dot_block(2, xm, ldx, w0, w1, w2, w3, K, r); break;
            default: dot_block(1, xm, ldx, w0, w1, w2, w3, K, r); break;
            }
            for (int m = 0; m < mb; m++) {
                float *dst = y + (long)(m0 + m) * ldy + n;
                for (int i = 0; i < nb; i++) {
                    float v = r[i][m] + (bias ? bias[n + i] : 0.0f);
                    dst[i] = accumulate ? dst[i] + v : v;
                }
            }
        }
    }
}

/* ------------------------------------------------------------- elementwise */

/* dst (bf16) = rmsnorm(src) * w, per row of n. */
static void rmsnorm_rows_bf16(const float *src, const float *w, bf16 *dst, int rows, int n, float eps) {
#pragma omp parallel for schedule(static) if (rows >= 8)
    for (int t = 0; t < rows; t++) {
        const float *s = src + (long)t * n;
        double ss = 0.0;
        for (int i = 0; i < n; i++) ss += (double)s[i] * s[i];
        float inv = 1.0f / sqrtf((float)(ss / n) + eps);
        bf16 *d = dst + (long)t * n;
        for (int i = 0; i < n; i++) d[i] = f32_to_bf16(s[i] * inv * w[i]);
    }
}

static void rmsnorm_inplace(float *v, const float *w, int n, float eps) {
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)v[i] * v[i];
    float inv = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int i = 0; i < n; i++) v[i] = v[i] * inv * w[i];
}

/* x[: half] , x[half :] -> (x1 cos - x2 sin, x2 cos + x1 sin) */
static inline void rotate(float *x, const float *c, const float *s, int half) {
    for (int i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * c[i] - b * s[i];
        x[i + half] = b * c[i] + a * s[i];
    }
}

/* ---------------------------------------------------------------- attention */

static inline float dot_f32_bf16(const float *q, const bf16 *k, int hd) {
    __m512 acc = _mm512_setzero_ps();
    int d = 0;
    for (; d + 16 <= hd; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load_bf16x16(k + d), acc);
    if (d < hd) {
        __mmask16 m = (__mmask16)((1u << (hd - d)) - 1u);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + d), load_bf16x16_mask(k + d, m), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* One (query token, head): softmax(q K^T * scale) V over keys [lo, hi] of a
   sequence whose key j lives in slot bt[j / bs] * bs + j % bs. */
static void attend_one(const float *q, const bf16 *kc, const bf16 *vc, int kv_stride, int g, int hd,
                       const int32_t *bt, int bs, int lo, int hi, float scale, float *scores, float *acc,
                       bf16 *out) {
    const int n = hi - lo + 1;
    float mx = -INFINITY;
    for (int j = lo; j <= hi; j++) {
        long slot = (long)bt[j / bs] * bs + j % bs;
        float s = dot_f32_bf16(q, kc + slot * kv_stride + (long)g * hd, hd) * scale;
        scores[j - lo] = s;
        mx = s > mx ? s : mx;
    }
    __m512 vmx = _mm512_set1_ps(mx), vsum = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(scores + i), vmx));
        _mm512_storeu_ps(scores + i, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    float sum = _mm512_reduce_add_ps(vsum);
    for (; i < n; i++) {
        scores[i] = exp_scalar(scores[i] - mx);
        sum += scores[i];
    }
    for (int d = 0; d < hd; d++) acc[d] = 0.0f;
    for (int j = lo; j <= hi; j++) {
        long slot = (long)bt[j / bs] * bs + j % bs;
        const bf16 *v = vc + slot * kv_stride + (long)g * hd;
        __m512 p = _mm512_set1_ps(scores[j - lo]);
        int d = 0;
        for (; d + 16 <= hd; d += 16)
            _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(p, load_bf16x16(v + d), _mm512_loadu_ps(acc + d)));
        for (; d < hd; d++) acc[d] += scores[j - lo] * bf16_to_f32(v[d]);
    }
    const float inv = 1.0f / sum;
    for (int d = 0; d < hd; d++) out[d] = f32_to_bf16(acc[d] * inv);
}

/* ------------------------------------------------------------------ forward */

static void *scratch_alloc(size_t bytes) {
    size_t rounded = (bytes + 63) & ~(size_t)63;
    return aligned_alloc(64, rounded ? rounded : 64);
}

/*
 * Runs the decoder stack for T tokens of B sequences.  seq_info is (B, 3)
 * int32: offset of the sequence's first token on the T axis, its number of
 * new tokens, and the number of its tokens already in the cache (so token i of
 * the sequence sits at position start + i and attends to keys 0..start + i).
 * block_tables is (B, max_blocks) int32.  The new tokens' K/V are written to
 * the cache.  out: (T, H) fp32 final-normed hidden states.  aux (may be NULL):
 * per layer, NULL or a (T, H) fp32 buffer that receives the residual stream
 * entering that layer.  Returns 0, or a negative code for a bad argument.
 */
int ss_forward(const ss_model *m, int T, const int64_t *ids, int B, const int32_t *seq_info,
               const int32_t *block_tables, int max_blocks, float *out, float *const *aux) {
    const int H = m->hidden, I = m->inter, nh = m->n_heads, nkv = m->n_kv_heads, hd = m->head_dim;
    const int qs = nh * hd, kvs = nkv * hd, nqkv = qs + 2 * kvs, half = hd / 2, bs = m->block_size;
    const int G = nh / nkv;
    if (T <= 0 || B <= 0 || G * nkv != nh) return -1;

    int32_t *tok_seq = scratch_alloc(sizeof(int32_t) * T);
    int32_t *tok_pos = scratch_alloc(sizeof(int32_t) * T);
    int max_ctx = 1;
    for (int b = 0; b < B; b++) {
        const int t0 = seq_info[3 * b], n = seq_info[3 * b + 1], start = seq_info[3 * b + 2];
        if (t0 < 0 || n <= 0 || t0 + n > T || start < 0 || start + n > m->n_positions ||
            (start + n + bs - 1) / bs > max_blocks) {
            free(tok_seq);
            free(tok_pos);
            return -2;
        }
        for (int i = 0; i < n; i++) {
            tok_seq[t0 + i] = b;
            tok_pos[t0 + i] = start + i;
        }
        if (start + n > max_ctx) max_ctx = start + n;
    }
    const int wide = H > qs ? H : qs;
    const int actw = wide > I ? wide : I;
    bf16 *act = scratch_alloc(sizeof(bf16) * (size_t)T * actw);
    float *qkv = scratch_alloc(sizeof(float) * (size_t)T * nqkv);
    float *gu = scratch_alloc(sizeof(float) * (size_t)T * 2 * I);
    const int nthr = omp_get_max_threads();
    float *att_scr = scratch_alloc(sizeof(float) * (size_t)nthr * (max_ctx + hd + 16));
    float *x = out;

    for (int t = 0; t < T; t++) {
        const bf16 *e = m->embed + ids[t] * (long)H;
        for (int i = 0; i < H; i++) x[(long)t * H + i] = bf16_to_f32(e[i]);
    }

    for (int l = 0; l < m->n_layers; l++) {
        const ss_layer *L = &m->layers[l];
        if (aux && aux[l]) memcpy(aux[l], x, sizeof(float) * (size_t)T * H);

        rmsnorm_rows_bf16(x, L->ln1, act, T, H, m->eps);
        gemv(act, T, H, L->wqkv, nqkv, H, L->bqkv, qkv, nqkv, 0);

        /* q/k norm (Qwen3), rotary, and the K/V cache write */
#pragma omp parallel for schedule(static) if (T >= 8)
        for (int t = 0; t < T; t++) {
            float *row = qkv + (long)t * nqkv;
            const int pos = tok_pos[t];
            const float *c = m->cos + (long)pos * half, *s = m->sin + (long)pos * half;
            for (int h = 0; h < nh + nkv; h++) {
                float *v = row + h * hd;
                if (L->qnorm) rmsnorm_inplace(v, h < nh ? L->qnorm : L->knorm, hd, m->eps);
                rotate(v, c, s, half);
            }
            const int32_t *bt = block_tables + (long)tok_seq[t] * max_blocks;
            const long slot = (long)bt[pos / bs] * bs + pos % bs;
            f32_row_to_bf16(row + qs, L->kcache + slot * kvs, kvs);
            f32_row_to_bf16(row + qs + kvs, L->vcache + slot * kvs, kvs);
        }

        /* attention: one task per (token, head) */
#pragma omp parallel for schedule(dynamic, 4)
        for (int task = 0; task < T * nh; task++) {
            const int t = task / nh, h = task % nh;
            const int pos = tok_pos[t];
            const int lo = m->window > 0 && pos - m->window + 1 > 0 ? pos - m->window + 1 : 0;
            float *scr = att_scr + (size_t)omp_get_thread_num() * (max_ctx + hd + 16);
            attend_one(qkv + (long)t * nqkv + h * hd, L->kcache, L->vcache, kvs, h / G, hd,
                       block_tables + (long)tok_seq[t] * max_blocks, bs, lo, pos, m->scale, scr,
                       scr + max_ctx, act + (long)t * qs + h * hd);
        }
        gemv(act, T, qs, L->wo, H, qs, NULL, x, H, 1);

        rmsnorm_rows_bf16(x, L->ln2, act, T, H, m->eps);
        gemv(act, T, H, L->wgu, 2 * I, H, NULL, gu, 2 * I, 0);
#pragma omp parallel for schedule(static) if (T >= 4)
        for (int t = 0; t < T; t++) {
            const float *g = gu + (long)t * 2 * I, *u = g + I;
            bf16 *a = act + (long)t * I;
            int i = 0;
            for (; i + 16 <= I; i += 16) {
                __m512 gv = _mm512_loadu_ps(g + i);
                __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.0f),
                                           _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
                __m512 r = _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_loadu_ps(u + i));
                _mm256_storeu_si256((__m256i *)(a + i), (__m256i)_mm512_cvtneps_pbh(r));
            }
            for (; i < I; i++) {
                float gs = g[i] / (1.0f + exp_scalar(-g[i]));
                a[i] = f32_to_bf16(gs * u[i]);
            }
        }
        gemv(act, T, I, L->wdown, H, I, NULL, x, H, 1);
    }
    for (int t = 0; t < T; t++) rmsnorm_inplace(x + (long)t * H, m->final_norm, H, m->eps);

    free(tok_seq);
    free(tok_pos);
    free(act);
    free(qkv);
    free(gu);
    free(att_scr);
    return 0;
}

/* logits (N, V) fp32 = bf16(hidden) (N, H) @ W^T, W (V, H) bf16. */
int ss_logits(const bf16 *W, int V, int H, const float *hidden, int N, float *logits) {
    if (N <= 0) return 0;
    bf16 *hb = scratch_alloc(sizeof(bf16) * (size_t)N * H);
    for (long i = 0; i < (long)N * H; i++) hb[i] = f32_to_bf16(hidden[i]);
    gemv(hb, N, H, W, V, H, NULL, logits, V, 0);
    free(hb);
    return 0;
}

/* Exposed for tests: y (M, N) fp32 = x (M, K) bf16 @ W (N, K)^T (+ bias). */
int ss_gemv(const bf16 *x, int M, const bf16 *W, int N, int K, const float *bias, float *y) {
    gemv(x, M, K, W, N, K, bias, y, N, 0);
    return 0;
}

int ss_abi_version(void) { return 1; }
