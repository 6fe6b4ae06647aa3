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
 * positions gives bit-identical results to decoding them one by one, and so does
 * each node of a draft tree (its softmax sums the keys it sees in plain
 * decoding's order, wherever the step put its ancestors: visible_sum).
 *
 * The same layer body (layer_run, over a step_plan) also runs a draft head's one
 * layer from an attention input the caller gives (ss_head_layer; EAGLE-3's input is
 * built here, ss_eagle3_layer), and ss_norm_logits is a head's norm and LM head;
 * ss_eagle3_chain runs a greedy EAGLE-3 draft chain's every column in one call.
 *
 * Built by specserve/kernels/cpu_decoder.py with gcc; the same OpenMP runtime
 * as torch's is used (libgomp is already loaded by torch).
 *
 * Two builds of this one source, chosen at compile time by the -m flags:
 * AVX512-BF16 (+ AMX) when __AVX512BF16__ is defined, else AVX2 + FMA (+ F16C),
 * where bf16 values are widened to fp32 (a shift) and multiplied with fp32 FMA.
 * The AVX2 build has no AMX: ss_amx_init reports it unavailable and packed
 * weights are ignored.  Both keep the batch invariance above.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__AVX512BF16__)
#define SS_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define SS_AVX2 1
#else
#error "cpu_decoder.c needs -mavx512bf16 (AVX512 build) or -mavx2 -mfma (AVX2 build)"
#endif

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
    /* The same four projections packed for AMX (ss_pack_amx), or NULL: then the
       AVX512-BF16 GEMV reads the row-major weights above. */
    const bf16 *wqkv_p, *wo_p, *wgu_p, *wdown_p;
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
    const bf16 *lm_head;      /* (V, H) */
    const bf16 *lm_head_p;    /* packed for AMX, or NULL */
    int32_t vocab, pad;
} ss_model;

/* ------------------------------------------------------------------ helpers */

#ifdef SS_AVX512
static inline __m512 load_bf16x16(const bf16 *p) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

static inline __m512 load_bf16x16_mask(const bf16 *p, __mmask16 m) {
    __m256i v = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
#endif

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

#ifdef SS_AVX512
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
#else /* SS_AVX2 */

/* 8 bf16 -> 8 fp32 (a bf16 is the top half of an fp32). */
static inline __m256 load_bf16x8(const bf16 *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

/* 8 fp32 -> 8 bf16, round to nearest even with quiet NaNs, as f32_to_bf16. */
static inline __m128i cvt_f32x8_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v), top = _mm256_srli_epi32(u, 16);
    const __m256i odd = _mm256_and_si256(top, _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
    /* 32 -> 16 bits: packus works within 128-bit lanes, so gather 64-bit parts 0 and 2 */
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    return _mm256_castsi256_si128(p);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 exp256(__m256 x) {
    /* as exp512: exp(x) = 2^n * exp(g), the 2^n built in the exponent field
       (n stays within [-126, 127] after the clamp) */
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 g = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    g = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), g);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static float exp_scalar(float x) {
    float buf[8] = {0};
    buf[0] = x;
    float out[8];
    _mm256_storeu_ps(out, exp256(_mm256_loadu_ps(buf)));
    return out[0];
}
#endif

/* Lane sums: a row of softmax numerators is summed as SS_LANES partial sums, its n-th
   term into lane n % SS_LANES in order, the lanes reduced at the end.  lane_add adds n
   more terms (the row's terms *cnt.. on), lane_total reduces. */
#ifdef SS_AVX512
#define SS_LANES 16
static inline void lane_add(float *lanes, int *cnt, const float *e, int n) {
    int i = 0;
    if (*cnt % 16 == 0) {
        __m512 v = _mm512_loadu_ps(lanes);
        for (; i + 16 <= n; i += 16) v = _mm512_add_ps(v, _mm512_loadu_ps(e + i));
        _mm512_storeu_ps(lanes, v);
    }
    for (; i < n; i++) lanes[(*cnt + i) % 16] += e[i];
    *cnt += n;
}

static inline float lane_total(const float *lanes) { return _mm512_reduce_add_ps(_mm512_loadu_ps(lanes)); }
#else
#define SS_LANES 8
static inline void lane_add(float *lanes, int *cnt, const float *e, int n) {
    int i = 0;
    if (*cnt % 8 == 0) {
        __m256 v = _mm256_loadu_ps(lanes);
        for (; i + 8 <= n; i += 8) v = _mm256_add_ps(v, _mm256_loadu_ps(e + i));
        _mm256_storeu_ps(lanes, v);
    }
    for (; i < n; i++) lanes[(*cnt + i) % 8] += e[i];
    *cnt += n;
}

static inline float lane_total(const float *lanes) { return hsum8(_mm256_loadu_ps(lanes)); }
#endif

/* --------------------------------------------------------------------- GEMV */

#ifndef PREFETCH
#define PREFETCH 4096
#endif

#ifdef SS_AVX512
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

#else /* SS_AVX2 */

/* Prefetch distance of the AVX2 GEMV's weight streams (bytes; measured best
   of 0.5 - 32 KB on a Zen box, 8 KB: ~10% over 4 KB). */
#ifndef AVX2_PREFETCH
#define AVX2_PREFETCH 8192
#endif

/* The GEMV reads 16 bf16 weights with one 256-bit load: each 32-bit lane j
   holds columns 2j (low half) and 2j + 1 (high half), so a shift gives the
   even columns and a mask the odd ones as fp32, with no cross-lane shuffle.
   The inputs are widened once per call to match: each block of 16 columns is
   stored as its 8 even then its 8 odd columns, fp32, zero padded to Kp. */
static void split_x(const bf16 *x, int M, long ldx, int K, long Kp, float *xs) {
    for (int m = 0; m < M; m++)
        for (long k0 = 0; k0 < Kp; k0 += 16)
            for (int j = 0; j < 8; j++) {
                const long ke = k0 + 2 * j, ko = ke + 1;
                xs[m * Kp + k0 + j] = ke < K ? bf16_to_f32(x[m * ldx + ke]) : 0.0f;
                xs[m * Kp + k0 + 8 + j] = ko < K ? bf16_to_f32(x[m * ldx + ko]) : 0.0f;
            }
}

/* r[i][m] = dot(w_i, x_m) for NR weight rows and MB input rows.  Every (i, m)
   has one accumulator that takes, per 16 columns in order, the even FMA then
   the odd one (the last partial block from a zero-padded copy), and ends in
   hsum8: the same operations for any NR, MB or M. */
static inline __attribute__((always_inline)) void dot_block(const int NR, const int MB, const float *restrict xs,
                                                            long Kp, const bf16 *const *w, int K, float r[8][2]) {
    __m256 acc[8][2];
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (int i = 0; i < NR; i++)
        for (int m = 0; m < MB; m++) acc[i][m] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        if (!(k & 31))
            for (int i = 0; i < NR; i++) _mm_prefetch((const char *)(w[i] + k) + AVX2_PREFETCH, _MM_HINT_T0);
        __m256 xe[2], xo[2];
        for (int m = 0; m < MB; m++) {
            xe[m] = _mm256_loadu_ps(xs + m * Kp + k);
            xo[m] = _mm256_loadu_ps(xs + m * Kp + k + 8);
        }
        for (int i = 0; i < NR; i++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w[i] + k));
            const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
            for (int m = 0; m < MB; m++) {
                acc[i][m] = _mm256_fmadd_ps(we, xe[m], acc[i][m]);
                acc[i][m] = _mm256_fmadd_ps(wo, xo[m], acc[i][m]);
            }
        }
    }
    if (k < K) {
        for (int i = 0; i < NR; i++) {
            bf16 tail[16] = {0};
            memcpy(tail, w[i] + k, sizeof(bf16) * (K - k));
            const __m256i v = _mm256_loadu_si256((const __m256i *)tail);
            const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
            for (int m = 0; m < MB; m++) {
                acc[i][m] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xs + m * Kp + k), acc[i][m]);
                acc[i][m] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xs + m * Kp + k + 8), acc[i][m]);
            }
        }
    }
    for (int i = 0; i < NR; i++)
        for (int m = 0; m < MB; m++) r[i][m] = hsum8(acc[i][m]);
}

/* y[m, n] (+)= sum_k x[m, k] W[n, k] (+ bias[n]), as the AVX512 gemv.  Threads
   split N in blocks of 8 rows; one input row runs against all 8 (8 FMA
   chains), two rows against 4 at a time. */
static void gemv_split(const float *xs, int M, long Kp, const bf16 *W, int N, int K, const float *bias, float *y,
                       long ldy, int accumulate) {
    const int nblocks = (N + 7) / 8;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < nblocks; b++) {
        const int n = b * 8;
        const int nb = N - n < 8 ? N - n : 8;
        const bf16 *w[8];
        for (int i = 0; i < 8; i++) w[i] = W + (long)(n + (i < nb ? i : 0)) * K;
        for (int m0 = 0; m0 < M; m0 += 2) {
            const int mb = M - m0 < 2 ? M - m0 : 2;
            const float *xm = xs + (long)m0 * Kp;
            float r[8][2];
            if (mb == 1) {
                dot_block(8, 1, xm, Kp, w, K, r);
            } else {
                float r2[8][2];
                dot_block(4, 2, xm, Kp, w, K, r);
                if (nb > 4) dot_block(4, 2, xm, Kp, w + 4, K, r2);
                for (int i = 4; i < nb; i++) r[i][0] = r2[i - 4][0], r[i][1] = r2[i - 4][1];
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

static void gemv(const bf16 *x, int M, long ldx, const bf16 *W, int N, int K, const float *bias, float *y,
                 long ldy, int accumulate) {
    const long Kp = (K + 15) / 16 * 16;
    float *xs = aligned_alloc(64, (sizeof(float) * (size_t)M * Kp + 63) & ~(size_t)63);
    if (!xs) { /* no memory for the widened inputs: one row at a time from the stack (rows are independent) */
        float one[Kp] __attribute__((aligned(32)));
        for (int m = 0; m < M; m++) {
            split_x(x + (long)m * ldx, 1, ldx, K, Kp, one);
            gemv_split(one, 1, Kp, W, N, K, bias, y + (long)m * ldy, ldy, accumulate);
        }
        return;
    }
    split_x(x, M, ldx, K, Kp, xs);
    gemv_split(xs, M, Kp, W, N, K, bias, y, ldy, accumulate);
    free(xs);
}
#endif

/* ---------------------------------------------------------------------- AMX */

/* Weights packed for TDPBF16PS: for each block of 16 output rows n and 32
   inputs k, a 16 x 64-byte tile whose row kk holds, for n = 0..15, the pair
   (W[n][2kk], W[n][2kk+1]).  Blocks go in pairs (the two C tiles of one step);
   a pair's two tiles for k block kb are adjacent and its k blocks follow each
   other, so a pair is one sequential 2 KB-per-step stream.  N pads to 32 and
   K to 32 with zeros. */
#ifndef AMX_PREFETCH
#define AMX_PREFETCH 4096
#endif

static inline long amx_kp(int K) { return (K + 31) / 32 * 32; }

long ss_amx_packed_elems(int N, int K) { return (long)((N + 31) / 32) * 32 * amx_kp(K); }

int ss_pack_amx(const bf16 *W, int N, int K, bf16 *out) {
    const int KB = (int)(amx_kp(K) / 32), NB = (N + 31) / 32 * 2;
#pragma omp parallel for schedule(static)
    for (int nb = 0; nb < NB; nb++)
        for (int kb = 0; kb < KB; kb++) {
            bf16 *tile = out + (((long)(nb / 2) * KB + kb) * 2 + nb % 2) * 512;
            for (int kk = 0; kk < 16; kk++)
                for (int n = 0; n < 16; n++)
                    for (int e = 0; e < 2; e++) {
                        const int row = nb * 16 + n, col = kb * 32 + 2 * kk + e;
                        tile[kk * 32 + n * 2 + e] = (row < N && col < K) ? W[(long)row * K + col] : 0;
                    }
        }
    return 0;
}

#ifdef SS_AVX512
/* Linux gives a process the AMX tile state only on request. */
int ss_amx_init(void) {
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) tile_config;

/* y[m, n] (+)= x[m, :] . W[n, :] (+ bias[n]) for any M.  Tiles 0-3 are C (row
   block r of 16, column block c at 2r + c), 4-5 the two A row blocks, 6-7 B.
   Within each column pair the rows go 32 at a time, so the pair's weights come
   from memory once and from cache for the next row blocks.  x: row stride ldx,
   columns zero-padded to a multiple of 32, rows readable up to a multiple of 32
   (rows past M only feed C rows that are dropped).  Each output row depends
   only on its own input row: the same instructions run whatever M is. */
static void gemm_amx(const bf16 *x, int M, long ldx, const bf16 *Wp, int N, int K, const float *bias, float *y,
                     long ldy, int accumulate) {
    const int KB = (int)(amx_kp(K) / 32), pairs = (N + 31) / 32;
#pragma omp parallel
    {
        tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette_id = 1;
        for (int t = 0; t < 8; t++) {
            cfg.colsb[t] = 64;
            cfg.rows[t] = 16;
        }
        _tile_loadconfig(&cfg);
        float c[32][32] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int p = 0; p < pairs; p++) {
            const bf16 *b = Wp + (long)p * KB * 1024;
            for (int m0 = 0; m0 < M; m0 += 32) {
                const int rows = M - m0 < 32 ? M - m0 : 32, two = rows > 16;
                const bf16 *xa = x + (long)m0 * ldx, *xb = xa + 16 * ldx;
                _tile_zero(0);
                _tile_zero(1);
                if (two) {
                    _tile_zero(2);
                    _tile_zero(3);
                }
                for (int kb = 0; kb < KB; kb++) {
                    const bf16 *bk = b + (long)kb * 1024;
                    if (m0 == 0)
                        for (int i = 0; i < 2048; i += 64)
                            _mm_prefetch((const char *)bk + AMX_PREFETCH + i, _MM_HINT_T0);
                    _tile_loadd(6, bk, 64);
                    _tile_loadd(7, bk + 512, 64);
                    _tile_loadd(4, xa + kb * 32, ldx * 2);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (two) {
                        _tile_loadd(5, xb + kb * 32, ldx * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, &c[0][0], 128);
                _tile_stored(1, &c[0][16], 128);
                if (two) {
                    _tile_stored(2, &c[16][0], 128);
                    _tile_stored(3, &c[16][16], 128);
                }
                /* y = c + bias (+ y when accumulating), 16 columns a vector: the same two
                   additions per element as a scalar loop, so the same bits */
                const int nn = N - p * 32 < 32 ? N - p * 32 : 32;
                const __mmask16 k0 = nn >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nn) - 1u);
                const __mmask16 k1 = nn >= 32 ? (__mmask16)0xFFFF : nn > 16 ? (__mmask16)((1u << (nn - 16)) - 1u) : 0;
                const __m512 b0 = bias ? _mm512_maskz_loadu_ps(k0, bias + p * 32) : _mm512_setzero_ps();
                const __m512 b1 = bias ? _mm512_maskz_loadu_ps(k1, bias + p * 32 + 16) : _mm512_setzero_ps();
                for (int m = 0; m < rows; m++) {
                    float *dst = y + (long)(m0 + m) * ldy + p * 32;
                    __m512 v0 = _mm512_add_ps(_mm512_load_ps(&c[m][0]), b0);
                    __m512 v1 = _mm512_add_ps(_mm512_load_ps(&c[m][16]), b1);
                    if (accumulate) {
                        v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(k0, dst), v0);
                        v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(k1, dst + 16), v1);
                    }
                    _mm512_mask_storeu_ps(dst, k0, v0);
                    if (k1) _mm512_mask_storeu_ps(dst + 16, k1, v1);
                }
            }
        }
        _tile_release();
    }
}

/* One projection: AMX on packed weights when given, else the AVX512-BF16 GEMV. */
static void matmul(const bf16 *x, int M, long ldx, const bf16 *W, const bf16 *Wp, int N, int K, const float *bias,
                   float *y, long ldy, int accumulate) {
    if (Wp)
        gemm_amx(x, M, ldx, Wp, N, K, bias, y, ldy, accumulate);
    else
        gemv(x, M, ldx, W, N, K, bias, y, ldy, accumulate);
}

#else /* SS_AVX2: no AMX in this build */

int ss_amx_init(void) { return -1; }

/* Packed weights (Wp) are AMX-only: this build always runs the GEMV. */
static void matmul(const bf16 *x, int M, long ldx, const bf16 *W, const bf16 *Wp, int N, int K, const float *bias,
                   float *y, long ldy, int accumulate) {
    (void)Wp;
    gemv(x, M, ldx, W, N, K, bias, y, ldy, accumulate);
}
#endif

/* ------------------------------------------------------------- elementwise */

/* dst (bf16, row stride ldd) = rmsnorm(src) * w, per row of n. */
static void rmsnorm_rows_bf16(const float *src, const float *w, bf16 *dst, long ldd, int rows, int n, float eps) {
#pragma omp parallel for schedule(static) if (rows >= 8)
    for (int t = 0; t < rows; t++) {
        const float *s = src + (long)t * n;
        double ss = 0.0;
        for (int i = 0; i < n; i++) ss += (double)s[i] * s[i];
        float inv = 1.0f / sqrtf((float)(ss / n) + eps);
        bf16 *d = dst + (long)t * ldd;
        for (int i = 0; i < n; i++) d[i] = f32_to_bf16(s[i] * inv * w[i]);
        for (long i = n; i < amx_kp(n); i++) d[i] = 0; /* AMX reads K padded to 32 */
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

/* Draft trees: the rows of one (sequence, kv head) group that verify a tree.  Keys
   before `base` are seen by rotary position (j <= vpos[r], j >= wlo[r] under a
   window), keys from `base` on by bit (j - base) of bits[r]. */
typedef struct {
    int base;
    const int *vpos, *wlo;
    const int64_t *bits;
} ss_tree;

/* Sets the scores of row r's keys in [lo, hi] (S row `sr`, key jlo at index 0) that
   its tree rule hides to -inf; keys outside [lo, hi] are masked by the caller. */
static void tree_mask_row(float *sr, int jlo, int lo, int hi, const ss_tree *tr, int r) {
    const int e = tr->base < hi + 1 ? tr->base : hi + 1; /* end of the keys before the tree */
    for (int j = lo; j < e && j < tr->wlo[r]; j++) sr[j - jlo] = -INFINITY;
    for (int j = lo > tr->vpos[r] + 1 ? lo : tr->vpos[r] + 1; j < e; j++) sr[j - jlo] = -INFINITY;
    for (int j = lo > tr->base ? lo : tr->base; j <= hi; j++)
        if (!(((uint64_t)tr->bits[r] >> (j - tr->base)) & 1)) sr[j - jlo] = -INFINITY;
}

/* The softmax denominator of row r (S row `sr` of numerators, key jlo at index 0, hidden
   keys 0): the lane sum of the keys it sees, ascending, the first in lane 0, as plain
   decoding of its token sums them.  Summing the whole row instead would put each key in
   lane (j - jlo) % SS_LANES, which depends on the rest of the group: on other rows' key
   ranges (jlo) and, for a tree node, on the other branches' keys between its ancestors;
   the sum then rounds differently and the output can differ by a bf16 step. */
static float visible_sum(const float *sr, int jlo, int lo, int hi, const ss_tree *tr, int r) {
    float lanes[SS_LANES] = {0};
    int cnt = 0;
    if (!tr) {
        lane_add(lanes, &cnt, sr + (lo - jlo), hi - lo + 1);
        return lane_total(lanes);
    }
    const int e = tr->base < hi + 1 ? tr->base : hi + 1; /* end of the keys before the tree */
    const int a = lo > tr->wlo[r] ? lo : tr->wlo[r], b = tr->vpos[r] < e - 1 ? tr->vpos[r] : e - 1;
    if (b >= a) lane_add(lanes, &cnt, sr + (a - jlo), b - a + 1);
    for (int j = lo > tr->base ? lo : tr->base; j <= hi; j++)
        if (((uint64_t)tr->bits[r] >> (j - tr->base)) & 1) lane_add(lanes, &cnt, sr + (j - jlo), 1);
    return lane_total(lanes);
}

#ifdef SS_AVX512
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

/* scores[i] = exp(scores[i] - mx) for i < n; returns their sum. */
static inline float exp_shift_sum(float *scores, int n, float mx) {
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
    return sum;
}

/* acc[0..hd) += p * v[0..hd). */
static inline void axpy_bf16(float *acc, float p, const bf16 *v, int hd) {
    __m512 vp = _mm512_set1_ps(p);
    int d = 0;
    for (; d + 16 <= hd; d += 16)
        _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(vp, load_bf16x16(v + d), _mm512_loadu_ps(acc + d)));
    for (; d < hd; d++) acc[d] += p * bf16_to_f32(v[d]);
}

/* In-register transpose of a 16 x 16 matrix of 32-bit elements (row i in r[i]). */
static inline void transpose16x16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* r[4i + e], 128-bit lane L: rows 4i..4i+3 of column 4L + e */
    for (int i = 0; i < 4; i++) {
        r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int e = 0; e < 4; e++) {
        const __m512i ab_lo = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x44), ab_hi = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xEE);
        const __m512i cd_lo = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x44);
        const __m512i cd_hi = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xEE);
        t[e] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0x88);
        t[4 + e] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0xDD);
        t[8 + e] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0x88);
        t[12 + e] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* out[r] = bf16(sum_n S[r][n] v_n * inv[r]) for RC rows, fp32 accumulators in registers. */
static inline __attribute__((always_inline)) void pv_rows(const int HD, const int RC, int nk, int nkp, const float *S,
                                                          const bf16 *vc, const long *slots, const float *inv,
                                                          bf16 *const *out) {
    __m512 acc[RC][HD / 16];
    for (int rr = 0; rr < RC; rr++)
        for (int c = 0; c < HD / 16; c++) acc[rr][c] = _mm512_setzero_ps();
    for (int n = 0; n < nk; n++) {
        const bf16 *v = vc + slots[n];
        __m512 vv[HD / 16];
        for (int c = 0; c < HD / 16; c++) vv[c] = load_bf16x16(v + 16 * c);
        for (int rr = 0; rr < RC; rr++) {
            const __m512 pr = _mm512_set1_ps(S[(long)rr * nkp + n]);
            for (int c = 0; c < HD / 16; c++) acc[rr][c] = _mm512_fmadd_ps(pr, vv[c], acc[rr][c]);
        }
    }
    for (int rr = 0; rr < RC; rr++) {
        const __m512 sc = _mm512_set1_ps(inv[rr]);
        for (int c = 0; c < HD / 16; c++)
            _mm256_storeu_si256((__m256i *)(out[rr] + 16 * c), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[rr][c], sc)));
    }
}

/* All query rows of one (sequence, kv head) group at once: the G query heads
   of the group for each new token of the sequence (R rows, row r attends to
   keys lo[r]..hi[r]).  Keys are visited once per group: scores come 16 keys
   at a time from a pair-transposed key block with AVX512-BF16 dot products (q
   rounded to bf16, as a bf16 SDPA does), P.V accumulates in fp32 registers.
   HD = head dim, RC = rows per P.V register block. */
static inline __attribute__((always_inline)) void attend_group_hd(
    const int HD, const int RC, int R, const float *const *q, const int *lo, const int *hi, const bf16 *kc,
    const bf16 *vc, int kv_stride, int g, const int32_t *bt, int bs, float scale, float *S, uint32_t *qb,
    uint32_t *kt, long *slots, bf16 *const *out, const ss_tree *tree) {
    const int P = HD / 2;
    int jlo = lo[0], jhi = hi[0];
    for (int r = 1; r < R; r++) {
        jlo = lo[r] < jlo ? lo[r] : jlo;
        jhi = hi[r] > jhi ? hi[r] : jhi;
    }
    const int nk = jhi - jlo + 1, nkp = (nk + 15) & ~15;
    for (int j = jlo, n = 0; j <= jhi;) { /* one division per cache block */
        const int blk = j / bs;
        const long base = (long)bt[blk] * bs;
        for (int off = j - blk * bs; off < bs && j <= jhi; off++, j++)
            slots[n++] = (base + off) * kv_stride + (long)g * HD;
    }
    for (int r = 0; r < R + 4; r++)
        for (int p = 0; p < P; p++) {
            if (r >= R) {
                qb[r * P + p] = 0;
                continue;
            }
            const uint32_t a = f32_to_bf16(q[r][2 * p] * scale), b = f32_to_bf16(q[r][2 * p + 1] * scale);
            qb[r * P + p] = a | (b << 16);
        }
    /* scores S[r][n] = q_r . k_(jlo + n) */
    for (int n0 = 0; n0 < nkp; n0 += 16) {
        for (int blk = 0; blk < P / 16; blk++) { /* 16 keys x 16 bf16 pairs -> pair-major */
            __m512i rows[16];
            for (int n = 0; n < 16; n++) {
                const int nn = n0 + n < nk ? n0 + n : nk - 1;
                rows[n] = _mm512_loadu_si512(kc + slots[nn] + 32 * blk);
            }
            transpose16x16_epi32(rows);
            for (int p = 0; p < 16; p++) _mm512_store_si512(kt + (blk * 16 + p) * 16, rows[p]);
        }
        for (int r0 = 0; r0 < R; r0 += 4) {
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            const uint32_t *q0 = qb + r0 * P;
            for (int p = 0; p < P; p++) {
                const __m512i kv = _mm512_load_si512(kt + p * 16);
                a0 = _mm512_dpbf16_ps(a0, (__m512bh)kv, (__m512bh)_mm512_set1_epi32((int)q0[p]));
                a1 = _mm512_dpbf16_ps(a1, (__m512bh)kv, (__m512bh)_mm512_set1_epi32((int)q0[P + p]));
                a2 = _mm512_dpbf16_ps(a2, (__m512bh)kv, (__m512bh)_mm512_set1_epi32((int)q0[2 * P + p]));
                a3 = _mm512_dpbf16_ps(a3, (__m512bh)kv, (__m512bh)_mm512_set1_epi32((int)q0[3 * P + p]));
            }
            _mm512_store_ps(S + (long)r0 * nkp + n0, a0);
            if (r0 + 1 < R) _mm512_store_ps(S + (long)(r0 + 1) * nkp + n0, a1);
            if (r0 + 2 < R) _mm512_store_ps(S + (long)(r0 + 2) * nkp + n0, a2);
            if (r0 + 3 < R) _mm512_store_ps(S + (long)(r0 + 3) * nkp + n0, a3);
        }
    }
    /* masked softmax numerators, per row */
    float inv[R];
    for (int r = 0; r < R; r++) {
        float *sr = S + (long)r * nkp;
        const int a = lo[r] - jlo, b = hi[r] - jlo;
        for (int n = 0; n < a; n++) sr[n] = -INFINITY;
        for (int n = b + 1; n < nkp; n++) sr[n] = -INFINITY;
        if (tree) tree_mask_row(sr, jlo, lo[r], hi[r], tree, r);
        __m512 vmx = _mm512_set1_ps(-INFINITY);
        for (int n = 0; n < nkp; n += 16) vmx = _mm512_max_ps(vmx, _mm512_load_ps(sr + n));
        vmx = _mm512_set1_ps(_mm512_reduce_max_ps(vmx));
        for (int n = 0; n < nkp; n += 16) {
            __m512 e = exp512(_mm512_sub_ps(_mm512_load_ps(sr + n), vmx));
            e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(_mm512_load_ps(sr + n), _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), e);
            _mm512_store_ps(sr + n, e);
        }
        inv[r] = 1.0f / visible_sum(sr, jlo, lo[r], hi[r], tree, r);
    }
    /* out_r = sum_n P[r][n] v_n / sum, RC rows at a time (the last block with as many as remain) */
    for (int r0 = 0; r0 < R; r0 += RC) {
        switch (R - r0 < RC ? R - r0 : RC) {
        case 1: pv_rows(HD, 1, nk, nkp, S + (long)r0 * nkp, vc, slots, inv + r0, out + r0); break;
        case 2: pv_rows(HD, 2, nk, nkp, S + (long)r0 * nkp, vc, slots, inv + r0, out + r0); break;
        case 3: pv_rows(HD, 3, nk, nkp, S + (long)r0 * nkp, vc, slots, inv + r0, out + r0); break;
        case 4: pv_rows(HD, 4, nk, nkp, S + (long)r0 * nkp, vc, slots, inv + r0, out + r0); break;
        case 5: pv_rows(HD, 5, nk, nkp, S + (long)r0 * nkp, vc, slots, inv + r0, out + r0); break;
        default: pv_rows(HD, 6, nk, nkp, S + (long)r0 * nkp, vc, slots, inv + r0, out + r0); break;
        }
    }
}

#else /* SS_AVX2 */

static inline float dot_f32_bf16(const float *q, const bf16 *k, int hd) {
    __m256 acc = _mm256_setzero_ps();
    int d = 0;
    for (; d + 8 <= hd; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load_bf16x8(k + d), acc);
    float s = hsum8(acc);
    for (; d < hd; d++) s += q[d] * bf16_to_f32(k[d]);
    return s;
}

/* scores[i] = exp(scores[i] - mx) for i < n; returns their sum. */
static inline float exp_shift_sum(float *scores, int n, float mx) {
    __m256 vmx = _mm256_set1_ps(mx), vsum = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + i), vmx));
        _mm256_storeu_ps(scores + i, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum8(vsum);
    for (; i < n; i++) {
        scores[i] = exp_scalar(scores[i] - mx);
        sum += scores[i];
    }
    return sum;
}

/* acc[0..hd) += p * v[0..hd). */
static inline void axpy_bf16(float *acc, float p, const bf16 *v, int hd) {
    __m256 vp = _mm256_set1_ps(p);
    int d = 0;
    for (; d + 8 <= hd; d += 8)
        _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(vp, load_bf16x8(v + d), _mm256_loadu_ps(acc + d)));
    for (; d < hd; d++) acc[d] += p * bf16_to_f32(v[d]);
}

/* In-register transpose of an 8 x 8 fp32 matrix (row i in r[i]). */
static inline void transpose8x8_ps(__m256 r[8]) {
    __m256 t[8], s[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    /* s[4h + c], lane L: column c + 4L of rows 4h..4h+3 */
    for (int h = 0; h < 2; h++) {
        s[4 * h + 0] = _mm256_shuffle_ps(t[4 * h + 0], t[4 * h + 2], _MM_SHUFFLE(1, 0, 1, 0));
        s[4 * h + 1] = _mm256_shuffle_ps(t[4 * h + 0], t[4 * h + 2], _MM_SHUFFLE(3, 2, 3, 2));
        s[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], _MM_SHUFFLE(1, 0, 1, 0));
        s[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x20);
        r[4 + c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x31);
    }
}

/* out[r] (32 columns from c0) = bf16(sum_n S[r][n] v_n * inv[r]) for RC (1 or 2)
   rows: each output accumulates over n in order in one fp32 register. */
static inline __attribute__((always_inline)) void pv_cols32(const int RC, int c0, int nk, int nkp, const float *S,
                                                            const bf16 *vc, const long *slots, const float *inv,
                                                            bf16 *const *out) {
    __m256 acc[2][4];
    for (int rr = 0; rr < RC; rr++)
        for (int c = 0; c < 4; c++) acc[rr][c] = _mm256_setzero_ps();
    for (int n = 0; n < nk; n++) {
        const bf16 *v = vc + slots[n] + c0;
        __m256 vv[4];
        for (int c = 0; c < 4; c++) vv[c] = load_bf16x8(v + 8 * c);
        for (int rr = 0; rr < RC; rr++) {
            const __m256 pr = _mm256_broadcast_ss(S + (long)rr * nkp + n);
            for (int c = 0; c < 4; c++) acc[rr][c] = _mm256_fmadd_ps(pr, vv[c], acc[rr][c]);
        }
    }
    for (int rr = 0; rr < RC; rr++) {
        const __m256 sc = _mm256_set1_ps(inv[rr]);
        for (int c = 0; c < 4; c++)
            _mm_storeu_si128((__m128i *)(out[rr] + c0 + 8 * c), cvt_f32x8_bf16(_mm256_mul_ps(acc[rr][c], sc)));
    }
}

/* All query rows of one (sequence, kv head) group at once, as the AVX512
   attend_group_hd: keys are visited once per group, 8 at a time from a
   transposed fp32 block kt[d][8]; row r's score for a key is
   sum_d (q_r[d] * scale) k[d] in fp32, even d and odd d in two accumulators
   added at the end; P.V accumulates in fp32 registers.  No step depends on R
   or on the other rows.  qb_ holds (R + 4) rows of HD fp32, kt_ 8 * HD fp32.
   HD = head dim (a multiple of 32); RC is the AVX512 build's and unused. */
static inline __attribute__((always_inline)) void attend_group_hd(
    const int HD, const int RC, int R, const float *const *q, const int *lo, const int *hi, const bf16 *kc,
    const bf16 *vc, int kv_stride, int g, const int32_t *bt, int bs, float scale, float *S, uint32_t *qb_,
    uint32_t *kt_, long *slots, bf16 *const *out, const ss_tree *tree) {
    (void)RC;
    float *qs = (float *)qb_, *kt = (float *)kt_;
    int jlo = lo[0], jhi = hi[0];
    for (int r = 1; r < R; r++) {
        jlo = lo[r] < jlo ? lo[r] : jlo;
        jhi = hi[r] > jhi ? hi[r] : jhi;
    }
    const int nk = jhi - jlo + 1, nkp = (nk + 7) & ~7;
    for (int j = jlo, n = 0; j <= jhi;) { /* one division per cache block */
        const int blk = j / bs;
        const long base = (long)bt[blk] * bs;
        for (int off = j - blk * bs; off < bs && j <= jhi; off++, j++)
            slots[n++] = (base + off) * kv_stride + (long)g * HD;
    }
    for (int r = 0; r < R + 4; r++)
        for (int d = 0; d < HD; d++) qs[r * HD + d] = r < R ? q[r][d] * scale : 0.0f;
    /* scores S[r][n] = q_r . k_(jlo + n) */
    for (int n0 = 0; n0 < nkp; n0 += 8) {
        for (int d0 = 0; d0 < HD; d0 += 8) { /* 8 keys x 8 dims -> dim-major */
            __m256 rows[8];
            for (int n = 0; n < 8; n++) {
                const int nn = n0 + n < nk ? n0 + n : nk - 1;
                rows[n] = load_bf16x8(kc + slots[nn] + d0);
            }
            transpose8x8_ps(rows);
            for (int p = 0; p < 8; p++) _mm256_store_ps(kt + (d0 + p) * 8, rows[p]);
        }
        for (int r0 = 0; r0 < R; r0 += 4) {
            __m256 e[4], o[4];
            for (int i = 0; i < 4; i++) e[i] = o[i] = _mm256_setzero_ps();
            const float *q0 = qs + (long)r0 * HD;
            for (int d = 0; d < HD; d += 2) {
                const __m256 ka = _mm256_load_ps(kt + d * 8), kb = _mm256_load_ps(kt + (d + 1) * 8);
                for (int i = 0; i < 4; i++) {
                    e[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(q0 + i * HD + d), ka, e[i]);
                    o[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(q0 + i * HD + d + 1), kb, o[i]);
                }
            }
            for (int i = 0; i < 4 && r0 + i < R; i++)
                _mm256_store_ps(S + (long)(r0 + i) * nkp + n0, _mm256_add_ps(e[i], o[i]));
        }
    }
    /* masked softmax numerators, per row */
    float inv[R];
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int r = 0; r < R; r++) {
        float *sr = S + (long)r * nkp;
        const int a = lo[r] - jlo, b = hi[r] - jlo;
        for (int n = 0; n < a; n++) sr[n] = -INFINITY;
        for (int n = b + 1; n < nkp; n++) sr[n] = -INFINITY;
        if (tree) tree_mask_row(sr, jlo, lo[r], hi[r], tree, r);
        __m256 vmx = ninf;
        for (int n = 0; n < nkp; n += 8) vmx = _mm256_max_ps(vmx, _mm256_load_ps(sr + n));
        vmx = _mm256_set1_ps(hmax8(vmx));
        for (int n = 0; n < nkp; n += 8) {
            const __m256 s = _mm256_load_ps(sr + n);
            __m256 ex = exp256(_mm256_sub_ps(s, vmx));
            ex = _mm256_and_ps(ex, _mm256_cmp_ps(s, ninf, _CMP_NEQ_OQ));
            _mm256_store_ps(sr + n, ex);
        }
        inv[r] = 1.0f / visible_sum(sr, jlo, lo[r], hi[r], tree, r);
    }
    /* out_r = sum_n P[r][n] v_n / sum: 32 columns and two rows at a time */
    for (int c0 = 0; c0 < HD; c0 += 32)
        for (int r0 = 0; r0 < R; r0 += 2) {
            if (R - r0 >= 2)
                pv_cols32(2, c0, nk, nkp, S + (long)r0 * nkp, vc, slots, inv + r0, out + r0);
            else
                pv_cols32(1, c0, nk, nkp, S + (long)r0 * nkp, vc, slots, inv + r0, out + r0);
        }
}
#endif

/* One (query token, head): softmax(q K^T * scale) V over keys [lo, hi] of a
   sequence whose key j lives in slot bt[j / bs] * bs + j % bs (either build's
   dot_f32_bf16, exp_shift_sum and axpy_bf16). */
static void attend_one(const float *q, const bf16 *kc, const bf16 *vc, int kv_stride, int g, int hd,
                       const int32_t *bt, int bs, int lo, int hi, float scale, float *scores, float *acc,
                       bf16 *out) {
    float mx = -INFINITY;
    for (int j = lo; j <= hi; j++) {
        long slot = (long)bt[j / bs] * bs + j % bs;
        float s = dot_f32_bf16(q, kc + slot * kv_stride + (long)g * hd, hd) * scale;
        scores[j - lo] = s;
        mx = s > mx ? s : mx;
    }
    const float sum = exp_shift_sum(scores, hi - lo + 1, mx);
    for (int d = 0; d < hd; d++) acc[d] = 0.0f;
    for (int j = lo; j <= hi; j++) {
        long slot = (long)bt[j / bs] * bs + j % bs;
        axpy_bf16(acc, scores[j - lo], vc + slot * kv_stride + (long)g * hd, hd);
    }
    const float inv = 1.0f / sum;
    for (int d = 0; d < hd; d++) out[d] = f32_to_bf16(acc[d] * inv);
}

/* attend_one over the keys listed in keys[0..nk) (a tree row's visible keys). */
static void attend_keys(const float *q, const bf16 *kc, const bf16 *vc, int kv_stride, int g, int hd,
                        const int32_t *bt, int bs, const int *keys, int nk, float scale, float *scores, float *acc,
                        bf16 *out) {
    float mx = -INFINITY;
    for (int n = 0; n < nk; n++) {
        const int j = keys[n];
        long slot = (long)bt[j / bs] * bs + j % bs;
        float s = dot_f32_bf16(q, kc + slot * kv_stride + (long)g * hd, hd) * scale;
        scores[n] = s;
        mx = s > mx ? s : mx;
    }
    const float sum = exp_shift_sum(scores, nk, mx);
    for (int d = 0; d < hd; d++) acc[d] = 0.0f;
    for (int n = 0; n < nk; n++) {
        const int j = keys[n];
        long slot = (long)bt[j / bs] * bs + j % bs;
        axpy_bf16(acc, scores[n], vc + slot * kv_stride + (long)g * hd, hd);
    }
    const float inv = 1.0f / sum;
    for (int d = 0; d < hd; d++) out[d] = f32_to_bf16(acc[d] * inv);
}

/* The keys a tree row sees, ascending, into keys; returns how many.  c: the row's
   context index, vpos its rotary position, wlo its first key by the window. */
static int tree_keys(int c, int vpos, int wlo, int base, int64_t bits, int *keys) {
    int n = 0;
    const int e = base < c + 1 ? base : c + 1, top = vpos < e - 1 ? vpos : e - 1;
    for (int j = wlo; j <= top; j++) keys[n++] = j;
    for (int j = base; j <= c; j++)
        if (((uint64_t)bits >> (j - base)) & 1) keys[n++] = j;
    return n;
}

/* ------------------------------------------------------------------ forward */

/* per query row, 32-bit words of the grouped attention's q buffer: bf16 pairs
   (AVX512) or fp32 (AVX2) */
#ifdef SS_AVX512
#define SS_QB_WORDS(hd) ((hd) / 2)
#else
#define SS_QB_WORDS(hd) (hd)
#endif

static void *scratch_alloc(size_t bytes) {
    size_t rounded = (bytes + 63) & ~(size_t)63;
    return aligned_alloc(64, rounded ? rounded : 64);
}

/* One step's plan and scratch: where each token sits (its sequence, rotary position
   and context index), the attention tasks, and the buffers every layer reuses.
   Filled by step_plan, freed by step_free whatever happened in between. */
typedef struct {
    int T, B, max_blocks, any_tree, grouped, tc, n_tasks, max_rows, nthr, max_ctx;
    long actw;
    size_t scr_n, ws_bytes;
    const int32_t *seq_info, *block_tables, *tree_base;
    const int64_t *tree_masks;
    int32_t *tok_seq, *tok_pos, *tok_ctx, *task_seq, *task_chunk;
    bf16 *act;
    float *qkv, *gu, *att_scr;
    char *att_ws;
} ss_step;

static void step_free(ss_step *s) {
    free(s->tok_seq);
    free(s->tok_pos);
    free(s->tok_ctx);
    free(s->act);
    free(s->qkv);
    free(s->gu);
    free(s->att_scr);
    free(s->att_ws);
    free(s->task_seq);
    free(s->task_chunk);
}

/* Checks the step's layout and allocates its scratch (the activation buffer holds
   rows of at least in_width columns: the widest projection input).  Context indexes
   stay below ctx_limit and inside the block tables, rotary positions inside the
   tables.  Returns 0, -2 for a bad layout, -4 when out of memory; the caller frees
   with step_free either way. */
static int step_plan(const ss_model *m, ss_step *s, int T, int B, const int32_t *seq_info,
                     const int32_t *block_tables, int max_blocks, const int32_t *positions, const int32_t *tree_base,
                     const int64_t *tree_masks, int in_width, long ctx_limit) {
    const int H = m->hidden, I = m->inter, nh = m->n_heads, nkv = m->n_kv_heads, hd = m->head_dim;
    const int qs = nh * hd, kvs = nkv * hd, nqkv = qs + 2 * kvs, bs = m->block_size;
    const int G = nh / nkv;
    memset(s, 0, sizeof *s);
    s->T = T;
    s->B = B;
    s->max_blocks = max_blocks;
    s->seq_info = seq_info;
    s->block_tables = block_tables;
    s->tree_base = tree_base;
    s->tree_masks = tree_masks;
    s->tok_seq = scratch_alloc(sizeof(int32_t) * T);
    s->tok_pos = scratch_alloc(sizeof(int32_t) * T);
    s->tok_ctx = scratch_alloc(sizeof(int32_t) * T);
    if (!s->tok_seq || !s->tok_pos || !s->tok_ctx) return -4;
    if ((tree_base == NULL) != (tree_masks == NULL)) return -2;
    int max_ctx = 1, next = 0;
    for (int b = 0; b < B; b++) {
        /* sequences must tile the token axis in order */
        const int t0 = seq_info[3 * b], n = seq_info[3 * b + 1], start = seq_info[3 * b + 2];
        if (t0 != next || n <= 0 || t0 + n > T || start < 0 || (long)start + n > ctx_limit ||
            (start + n + bs - 1) / bs > max_blocks)
            return -2;
        if (tree_base && tree_base[b] < start + n) {
            if (tree_base[b] < 0 || tree_base[b] > start || start + n - tree_base[b] > 64) return -2;
            s->any_tree = 1;
        }
        next += n;
        for (int i = 0; i < n; i++) {
            const int p = positions ? positions[t0 + i] : start + i;
            if (p < 0 || p >= m->n_positions) return -2;
            s->tok_seq[t0 + i] = b;
            s->tok_ctx[t0 + i] = start + i;
            s->tok_pos[t0 + i] = p;
        }
        if (start + n > max_ctx) max_ctx = start + n;
    }
    if (next != T) return -2;
    s->max_ctx = max_ctx;
    /* one bf16 activation buffer, rows padded for AMX (pads are zeroed by each writer) */
    long actw = amx_kp(H) > amx_kp(qs) ? amx_kp(H) : amx_kp(qs);
    actw = actw > amx_kp(I) ? actw : amx_kp(I);
    actw = actw > amx_kp(in_width) ? actw : amx_kp(in_width);
    s->actw = actw;
    const long Tp = (T + 31) / 32 * 32; /* AMX reads whole 32-row blocks */
    s->act = scratch_alloc(sizeof(bf16) * (size_t)Tp * actw);
    if (s->act) memset(s->act, 0, sizeof(bf16) * (size_t)Tp * actw);
    s->qkv = scratch_alloc(sizeof(float) * (size_t)T * nqkv);
    s->gu = scratch_alloc(sizeof(float) * (size_t)T * 2 * I);
    s->nthr = omp_get_max_threads();
    /* grouped attention (attend_group_hd) for head_dim 64 / 128, else one task
       per (token, head) with attend_one */
    s->grouped = hd == 64 || hd == 128;
    /* per thread: scores (max_ctx), acc (hd) and, for tree rows, their key list (max_ctx) */
    s->scr_n = (size_t)max_ctx * (s->any_tree ? 2 : 1) + hd + 16;
    if (!s->grouped) s->att_scr = scratch_alloc(sizeof(float) * (size_t)s->nthr * s->scr_n);
    /* grouped attention tasks: rows of one (sequence, kv head) go in chunks of
       tc tokens (about 48 query rows), so that prefill spreads over threads and
       the per-thread workspace stays bounded.  A small step (a verification, a
       draft tree's frontier) whose (sequence, kv head) groups are fewer than two
       per thread splits its tokens further, so the threads share the work evenly:
       a row's result does not depend on the rows it is grouped with. */
    int tc = G >= 48 ? 1 : 48 / G, max_n = 1;
    for (int b = 0; b < B; b++) max_n = seq_info[3 * b + 1] > max_n ? seq_info[3 * b + 1] : max_n;
    if ((long)B * nkv < 2L * s->nthr) {
        const int chunks = (int)((2L * s->nthr + (long)B * nkv - 1) / ((long)B * nkv));
        const int even = (max_n + chunks - 1) / chunks;
        tc = even < tc ? (even > 0 ? even : 1) : tc;
    }
    s->tc = tc;
    int n_tasks = 0;
    for (int b = 0; b < B && s->grouped; b++) n_tasks += (seq_info[3 * b + 1] + tc - 1) / tc * nkv;
    if (s->grouped) {
        s->task_seq = scratch_alloc(sizeof(int32_t) * (n_tasks ? n_tasks : 1));
        s->task_chunk = scratch_alloc(sizeof(int32_t) * (n_tasks ? n_tasks : 1));
    }
    n_tasks = 0;
    for (int b = 0; b < B && s->task_seq && s->task_chunk; b++)
        for (int c = 0; c < (seq_info[3 * b + 1] + tc - 1) / tc; c++)
            for (int g = 0; g < nkv; g++) {
                s->task_seq[n_tasks] = b * nkv + g;
                s->task_chunk[n_tasks++] = c;
            }
    s->n_tasks = n_tasks;
    s->max_rows = tc * G;
    const int ctx_pad = (max_ctx + 15) & ~15;
    s->ws_bytes =
        ((size_t)s->max_rows * (2 * sizeof(void *) + 4 * sizeof(int) + sizeof(int64_t)) + sizeof(long) * ctx_pad + 64 +
         sizeof(uint32_t) * (16 * (hd / 2) + (s->max_rows + 4) * SS_QB_WORDS(hd)) + 64 +
         sizeof(float) * (size_t)s->max_rows * ctx_pad + 63) &
        ~(size_t)63;
    if (s->grouped) s->att_ws = scratch_alloc(s->ws_bytes * s->nthr);
    if (!s->act || !s->qkv || !s->gu || (s->grouped ? !s->att_ws || !s->task_seq || !s->task_chunk : !s->att_scr))
        return -4;
    return 0;
}

/* One decoder layer over the step: s->act holds its attention input (T rows of
   in_width bf16 columns, zero-padded to 32: the input norm already applied), x (T, H)
   fp32 its residual stream, which leaves holding the layer's output.  q/k/v, rotary,
   the K/V cache write, attention (trees included), o, the MLP. */
static void layer_run(const ss_model *m, const ss_layer *L, ss_step *s, int in_width, float *x) {
    const int H = m->hidden, I = m->inter, nh = m->n_heads, nkv = m->n_kv_heads, hd = m->head_dim;
    const int qs = nh * hd, kvs = nkv * hd, nqkv = qs + 2 * kvs, half = hd / 2, bs = m->block_size;
    const int G = nh / nkv, T = s->T, tc = s->tc, max_rows = s->max_rows, max_ctx = s->max_ctx;
    const int max_blocks = s->max_blocks, ctx_pad = (max_ctx + 15) & ~15;
    const long actw = s->actw;
    const size_t ws_bytes = s->ws_bytes, scr_n = s->scr_n;
    const int32_t *seq_info = s->seq_info, *block_tables = s->block_tables, *tree_base = s->tree_base;
    const int64_t *tree_masks = s->tree_masks;
    const int32_t *tok_seq = s->tok_seq, *tok_pos = s->tok_pos, *tok_ctx = s->tok_ctx;
    const int32_t *task_seq = s->task_seq, *task_chunk = s->task_chunk;
    bf16 *act = s->act;
    float *qkv = s->qkv, *gu = s->gu, *att_scr = s->att_scr;
    char *att_ws = s->att_ws;

    matmul(act, T, actw, L->wqkv, L->wqkv_p, nqkv, in_width, L->bqkv, qkv, nqkv, 0);

    /* q/k norm (Qwen3), rotary, and the K/V cache write */
#pragma omp parallel for schedule(static) if (T >= 8)
    for (int t = 0; t < T; t++) {
        float *row = qkv + (long)t * nqkv;
        const int pos = tok_pos[t], ctx = tok_ctx[t];
        const float *c = m->cos + (long)pos * half, *sn = m->sin + (long)pos * half;
        for (int h = 0; h < nh + nkv; h++) {
            float *v = row + h * hd;
            if (L->qnorm) rmsnorm_inplace(v, h < nh ? L->qnorm : L->knorm, hd, m->eps);
            rotate(v, c, sn, half);
        }
        const int32_t *bt = block_tables + (long)tok_seq[t] * max_blocks;
        const long slot = (long)bt[ctx / bs] * bs + ctx % bs;
        f32_row_to_bf16(row + qs, L->kcache + slot * kvs, kvs);
        f32_row_to_bf16(row + qs + kvs, L->vcache + slot * kvs, kvs);
    }

    if (s->grouped) {
        /* attention: one task per (sequence, kv head, chunk of up to tc tokens) */
#pragma omp parallel for schedule(dynamic, 1)
        for (int task = 0; task < s->n_tasks; task++) {
            const int b = task_seq[task] / nkv, g = task_seq[task] % nkv, c0 = task_chunk[task] * tc;
            const int n = seq_info[3 * b + 1] - c0 < tc ? seq_info[3 * b + 1] - c0 : tc;
            const int t0 = seq_info[3 * b] + c0, start = seq_info[3 * b + 2] + c0;
            const int R = n * G;
            char *w = att_ws + (size_t)omp_get_thread_num() * ws_bytes;
            const float **qp = (const float **)w;
            bf16 **op = (bf16 **)(qp + max_rows);
            int *lo = (int *)(op + max_rows), *hi = lo + max_rows;
            long *slots = (long *)(hi + max_rows);
            int64_t *tbits = (int64_t *)(slots + ctx_pad);
            int *tvpos = (int *)(tbits + max_rows), *twlo = tvpos + max_rows;
            uint32_t *kt = (uint32_t *)(((uintptr_t)(twlo + max_rows) + 63) & ~(uintptr_t)63);
            uint32_t *qb = kt + (hd / 2) * 16;
            float *S = (float *)(((uintptr_t)(qb + (max_rows + 4) * SS_QB_WORDS(hd)) + 63) & ~(uintptr_t)63);
            const int tb = tree_base ? tree_base[b] : 0;
            const int is_tree = tree_base && tb < seq_info[3 * b + 2] + seq_info[3 * b + 1];
            for (int r = 0; r < R; r++) {
                const int i = r / G, h = g * G + r % G, t = t0 + i;
                qp[r] = qkv + (long)t * nqkv + h * hd;
                op[r] = act + (long)t * actw + h * hd;
                hi[r] = start + i;
                lo[r] = m->window > 0 && hi[r] - m->window + 1 > 0 ? hi[r] - m->window + 1 : 0;
                if (is_tree) { /* keys before the tree by rotary position; tree keys are not windowed */
                    tvpos[r] = tok_pos[t];
                    twlo[r] = m->window > 0 && tvpos[r] - m->window + 1 > 0 ? tvpos[r] - m->window + 1 : 0;
                    tbits[r] = tree_masks[t];
                    lo[r] = twlo[r] < tb ? twlo[r] : tb;
                }
            }
            const ss_tree tree = {tb, tvpos, twlo, tbits};
            const int32_t *bt = block_tables + (long)b * max_blocks;
            if (hd == 64)
                attend_group_hd(64, 6, R, qp, lo, hi, L->kcache, L->vcache, kvs, g, bt, bs, m->scale, S, qb, kt,
                                slots, op, is_tree ? &tree : NULL);
            else
                attend_group_hd(128, 3, R, qp, lo, hi, L->kcache, L->vcache, kvs, g, bt, bs, m->scale, S, qb, kt,
                                slots, op, is_tree ? &tree : NULL);
        }
    } else {
        /* attention: one task per (token, head) */
#pragma omp parallel for schedule(dynamic, 4)
        for (int task = 0; task < T * nh; task++) {
            const int t = task / nh, h = task % nh, b = tok_seq[t];
            const int ctx = tok_ctx[t];
            float *scr = att_scr + (size_t)omp_get_thread_num() * scr_n;
            const int32_t *bt = block_tables + (long)b * max_blocks;
            if (tree_base && tree_base[b] < seq_info[3 * b + 2] + seq_info[3 * b + 1]) {
                const int vpos = tok_pos[t];
                const int wlo = m->window > 0 && vpos - m->window + 1 > 0 ? vpos - m->window + 1 : 0;
                int *keys = (int *)(scr + max_ctx + hd + 16);
                const int nk = tree_keys(ctx, vpos, wlo, tree_base[b], tree_masks[t], keys);
                attend_keys(qkv + (long)t * nqkv + h * hd, L->kcache, L->vcache, kvs, h / G, hd, bt, bs, keys, nk,
                            m->scale, scr, scr + max_ctx, act + (long)t * actw + h * hd);
                continue;
            }
            const int lo = m->window > 0 && ctx - m->window + 1 > 0 ? ctx - m->window + 1 : 0;
            attend_one(qkv + (long)t * nqkv + h * hd, L->kcache, L->vcache, kvs, h / G, hd, bt, bs, lo, ctx,
                       m->scale, scr, scr + max_ctx, act + (long)t * actw + h * hd);
        }
    }
    for (int t = 0; t < T; t++)
        for (long i = qs; i < amx_kp(qs); i++) act[t * actw + i] = 0;
    matmul(act, T, actw, L->wo, L->wo_p, H, qs, NULL, x, H, 1);

    rmsnorm_rows_bf16(x, L->ln2, act, actw, T, H, m->eps);
    matmul(act, T, actw, L->wgu, L->wgu_p, 2 * I, H, NULL, gu, 2 * I, 0);
#pragma omp parallel for schedule(static) if (T >= 4)
    for (int t = 0; t < T; t++) {
        const float *g = gu + (long)t * 2 * I, *u = g + I;
        bf16 *a = act + (long)t * actw;
        int i = 0;
#ifdef SS_AVX512
        for (; i + 16 <= I; i += 16) {
            __m512 gv = _mm512_loadu_ps(g + i);
            __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.0f),
                                       _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            __m512 r = _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_loadu_ps(u + i));
            _mm256_storeu_si256((__m256i *)(a + i), (__m256i)_mm512_cvtneps_pbh(r));
        }
#else
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 sig = _mm256_div_ps(_mm256_set1_ps(1.0f),
                                       _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
            __m256 r = _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i));
            _mm_storeu_si128((__m128i *)(a + i), cvt_f32x8_bf16(r));
        }
#endif
        for (; i < I; i++) {
            float gs = g[i] / (1.0f + exp_scalar(-g[i]));
            a[i] = f32_to_bf16(gs * u[i]);
        }
        for (long j = I; j < amx_kp(I); j++) a[j] = 0;
    }
    matmul(act, T, actw, L->wdown, L->wdown_p, H, I, NULL, x, H, 1);
}

/*
 * Runs the decoder stack for T tokens of B sequences.  seq_info is (B, 3)
 * int32: offset of the sequence's first token on the T axis, its number of
 * new tokens, and the number of its tokens already in the cache (so token i of
 * the sequence sits at context index start + i, its K/V goes there, and it
 * attends to keys 0..start + i).  block_tables is (B, max_blocks) int32.  The
 * new tokens' K/V are written to the cache.  out: (T, H) fp32 final-normed
 * hidden states.  aux (may be NULL): per layer, NULL or a (T, H) fp32 buffer
 * that receives the residual stream entering that layer.
 * positions (T,) int32, may be NULL: the tokens' rotary positions (default
 * start + i).  tree_base (B,) int32 and tree_masks (T,) int64, both NULL or
 * both given: a sequence with tree_base[b] < start + n verifies a draft tree
 * (tree_base <= start, span start + n - tree_base <= 64): its token t sees key
 * j < tree_base iff j <= positions[t] (and positions[t] - j < window), and key
 * j >= tree_base iff bit j - tree_base of tree_masks[t] is set.
 * x_in (T, H) fp32, may be NULL: the input rows themselves (a speech prompt's
 * audio rows beside looked-up token embeddings); NULL looks every row up in
 * the embedding table by ids.
 * Returns 0, or a negative code for a bad argument.
 */
int ss_forward(const ss_model *m, int T, const int64_t *ids, int B, const int32_t *seq_info,
               const int32_t *block_tables, int max_blocks, float *out, float *const *aux, const int32_t *positions,
               const int32_t *tree_base, const int64_t *tree_masks, const float *x_in) {
    const int H = m->hidden;
    if (T <= 0 || B <= 0 || (m->n_heads / m->n_kv_heads) * m->n_kv_heads != m->n_heads) return -1;
    for (int t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= m->vocab) return -3;
    ss_step s;
    int rc = step_plan(m, &s, T, B, seq_info, block_tables, max_blocks, positions, tree_base, tree_masks, H,
                       m->n_positions);
    if (rc == 0) {
        float *x = out;
        if (x_in)
            memcpy(x, x_in, sizeof(float) * (size_t)T * H);
        else
            for (int t = 0; t < T; t++) {
                const bf16 *e = m->embed + ids[t] * (long)H;
                for (int i = 0; i < H; i++) x[(long)t * H + i] = bf16_to_f32(e[i]);
            }
        for (int l = 0; l < m->n_layers; l++) {
            const ss_layer *L = &m->layers[l];
            if (aux && aux[l]) memcpy(aux[l], x, sizeof(float) * (size_t)T * H);
            rmsnorm_rows_bf16(x, L->ln1, s.act, s.actw, T, H, m->eps);
            layer_run(m, L, &s, H, x);
        }
        for (int t = 0; t < T; t++) rmsnorm_inplace(x + (long)t * H, m->final_norm, H, m->eps);
    }
    step_free(&s);
    return rc;
}

/*
 * One decoder layer (m->layers[0]) whose attention input is given: a draft head's
 * layer (EAGLE's), whose q/k/v read something other than the normed residual
 * stream (EAGLE-3: the normed embedding beside the normed features, 2H wide).
 * xin (T, in_width) bf16: the attention input as q/k/v read it; x (T, H) fp32:
 * the residual stream in, the layer's output (before any final norm) out.  The
 * sequence layout, positions and trees are ss_forward's; the new K/V go to the
 * layer's cache.  Returns 0, or ss_forward's negative codes.
 */
int ss_head_layer(const ss_model *m, int in_width, int T, const bf16 *xin, float *x, int B, const int32_t *seq_info,
                  const int32_t *block_tables, int max_blocks, const int32_t *positions, const int32_t *tree_base,
                  const int64_t *tree_masks) {
    if (T <= 0 || B <= 0 || in_width <= 0 || m->n_layers < 1 ||
        (m->n_heads / m->n_kv_heads) * m->n_kv_heads != m->n_heads)
        return -1;
    ss_step s;
    /* a head stores draft-tree nodes past the last position its rotary tables cover:
       only the block tables bound its context indexes */
    int rc = step_plan(m, &s, T, B, seq_info, block_tables, max_blocks, positions, tree_base, tree_masks, in_width,
                       (long)max_blocks * m->block_size);
    if (rc == 0) {
        for (int t = 0; t < T; t++) {
            bf16 *a = s.act + (long)t * s.actw;
            memcpy(a, xin + (long)t * in_width, sizeof(bf16) * (size_t)in_width);
            for (long i = in_width; i < amx_kp(in_width); i++) a[i] = 0; /* AMX reads K padded to 32 */
        }
        layer_run(m, &m->layers[0], &s, in_width, x);
    }
    step_free(&s);
    return rc;
}

/* dst (bf16, n) = rmsnorm(src) * w for one fp32 row (no padding written). */
static void rmsnorm_row_bf16(const float *src, const float *w, bf16 *dst, int n, float eps) {
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)src[i] * src[i];
    const float inv = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i] * inv * w[i]);
}

/*
 * An EAGLE-3 head step: ss_head_layer with the attention input built here.  Row t's
 * q/k/v read [rmsnorm(embed[ids[t]]) * ln_in, rmsnorm(g[t]) * hnorm] (2H wide, bf16)
 * and its residual is g[t] (the normed g with norm_before_residual).  embed (vocab,
 * H) bf16: the token embeddings; g (T, H) bf16: the head's hidden input.  x (T, H)
 * fp32 receives the layer's output (before the final norm).  Returns 0, -3 for a
 * token outside the vocabulary, or ss_forward's other negative codes.
 */
int ss_eagle3_layer(const ss_model *m, int T, const int64_t *ids, const bf16 *embed, int vocab, const float *ln_in,
                    const float *hnorm, int norm_before_residual, const bf16 *g, float *x, int B,
                    const int32_t *seq_info, const int32_t *block_tables, int max_blocks, const int32_t *positions,
                    const int32_t *tree_base, const int64_t *tree_masks) {
    const int H = m->hidden;
    if (T <= 0 || B <= 0 || m->n_layers < 1 || (m->n_heads / m->n_kv_heads) * m->n_kv_heads != m->n_heads) return -1;
    for (int t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= vocab) return -3;
    ss_step s;
    int rc = step_plan(m, &s, T, B, seq_info, block_tables, max_blocks, positions, tree_base, tree_masks, 2 * H,
                       (long)max_blocks * m->block_size);
    float *e = rc == 0 ? scratch_alloc(sizeof(float) * (size_t)H) : NULL;
    if (rc == 0 && !e) rc = -4;
    if (rc == 0) {
        for (int t = 0; t < T; t++) {
            bf16 *a = s.act + (long)t * s.actw;
            float *xr = x + (long)t * H;
            const bf16 *er = embed + ids[t] * (long)H, *gr = g + (long)t * H;
            for (int i = 0; i < H; i++) e[i] = bf16_to_f32(er[i]);
            rmsnorm_row_bf16(e, ln_in, a, H, m->eps);
            for (int i = 0; i < H; i++) xr[i] = bf16_to_f32(gr[i]);
            rmsnorm_row_bf16(xr, hnorm, a + H, H, m->eps);
            if (norm_before_residual)
                for (int i = 0; i < H; i++) xr[i] = bf16_to_f32(a[H + i]);
            for (long i = 2 * H; i < amx_kp(2 * H); i++) a[i] = 0; /* AMX reads K padded to 32 */
        }
        layer_run(m, &m->layers[0], &s, 2 * H, x);
    }
    free(e);
    step_free(&s);
    return rc;
}

/* A head's logits (N, vocab) fp32 = bf16(rmsnorm(x) * final_norm) (N, H) @ lm_head^T
   (no norm where final_norm is NULL). */
int ss_norm_logits(const ss_model *m, const float *x, int N, float *logits) {
    if (N <= 0) return 0;
    const int H = m->hidden;
    const long ld = amx_kp(H);
    bf16 *hb = scratch_alloc(sizeof(bf16) * ((size_t)(N + 31) / 32 * 32) * ld);
    if (!hb) return -4;
    memset(hb, 0, sizeof(bf16) * ((size_t)(N + 31) / 32 * 32) * ld);
    for (int t = 0; t < N; t++) {
        if (m->final_norm)
            rmsnorm_row_bf16(x + (long)t * H, m->final_norm, hb + t * ld, H, m->eps);
        else
            f32_row_to_bf16(x + (long)t * H, hb + t * ld, H);
    }
    matmul(hb, N, ld, m->lm_head, m->lm_head_p, m->vocab, H, NULL, logits, m->vocab, 0);
    free(hb);
    return 0;
}

/* logits (N, V) fp32 = bf16(hidden) (N, H) @ lm_head^T. */
int ss_logits(const ss_model *m, const float *hidden, int N, float *logits) {
    if (N <= 0) return 0;
    const int H = m->hidden;
    const long ld = amx_kp(H);
    bf16 *hb = scratch_alloc(sizeof(bf16) * ((size_t)(N + 31) / 32 * 32) * ld);
    memset(hb, 0, sizeof(bf16) * ((size_t)(N + 31) / 32 * 32) * ld);
    for (int t = 0; t < N; t++)
        for (long i = 0; i < ld; i++) hb[t * ld + i] = i < H ? f32_to_bf16(hidden[(long)t * H + i]) : 0;
    matmul(hb, N, ld, m->lm_head, m->lm_head_p, m->vocab, H, NULL, logits, m->vocab, 0);
    free(hb);
    return 0;
}

/*
 * A greedy EAGLE-3 draft chain for B requests in one call: what the eager loop of
 * ss_norm_logits / argmax / ss_eagle3_layer does a column at a time, with no
 * return to the caller between columns.  g0 (B, H) bf16: each request's head
 * output at its last real position last[b].  Column j = 0, 1, ...: the logits of
 * the requests still drafting (ss_norm_logits of their bf16 state, widened), each
 * row's argmax (the first of equal maxima, NaN above all, as torch's), mapped to
 * a target id through d2t (NULL: draft ids are target ids) into drafts[b * K + j];
 * a request with want[b] > j + 1 then runs the layer on that token and its state
 * at position last[b] + j + 1 (its K/V written through its block table, row b of
 * block_tables (B, max_blocks)), and its output rounded to bf16 (as the caller's
 * tensors hold it) is its next state.  want[b] <= K; a request with want[b] <= 0
 * drafts nothing.  Returns 0 or ss_eagle3_layer's negative codes.
 */
int ss_eagle3_chain(const ss_model *m, int B, const int32_t *want, const int32_t *last, const int32_t *block_tables,
                    int max_blocks, const bf16 *g0, const bf16 *embed, int vocab, const float *ln_in,
                    const float *hnorm, int norm_before_residual, const int64_t *d2t, int K, int64_t *drafts) {
    const int H = m->hidden, V = m->vocab;
    if (B <= 0) return 0;
    if (V <= 0 || K <= 0 || max_blocks <= 0) return -1;
    int *live = malloc(sizeof(int) * (size_t)B);
    int32_t *info = malloc(sizeof(int32_t) * 3 * (size_t)B);
    int32_t *tables = malloc(sizeof(int32_t) * (size_t)B * max_blocks);
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)B);
    bf16 *g = malloc(sizeof(bf16) * (size_t)B * H);
    float *x = scratch_alloc(sizeof(float) * (size_t)B * H);
    float *logits = scratch_alloc(sizeof(float) * (size_t)B * V);
    int rc = (live && info && tables && ids && g && x && logits) ? 0 : -4;
    int n = 0;
    for (int b = 0; rc == 0 && b < B; b++) {
        if (want[b] > K) rc = -2;
        if (want[b] <= 0) continue;
        memcpy(g + (long)n * H, g0 + (long)b * H, sizeof(bf16) * (size_t)H);
        live[n++] = b;
    }
    for (int j = 0; rc == 0 && n > 0; j++) {
        for (long i = 0; i < (long)n * H; i++) x[i] = bf16_to_f32(g[i]);
        rc = ss_norm_logits(m, x, n, logits);
        if (rc != 0) break;
        int kept = 0;
        for (int r = 0; r < n; r++) {
            const float *lr = logits + (long)r * V;
            int best = 0;
            for (int v = 1; v < V; v++)
                if (!isnan(lr[best]) && (lr[v] > lr[best] || isnan(lr[v]))) best = v;
            const int b = live[r];
            const int64_t tok = d2t ? d2t[best] : best;
            drafts[(long)b * K + j] = tok;
            if (want[b] <= j + 1) continue;
            /* still drafting: compact its row to the front */
            live[kept] = b;
            ids[kept] = tok;
            if (kept != r) memmove(g + (long)kept * H, g + (long)r * H, sizeof(bf16) * (size_t)H);
            info[3 * kept] = kept;
            info[3 * kept + 1] = 1;
            info[3 * kept + 2] = last[b] + j + 1;
            memcpy(tables + (long)kept * max_blocks, block_tables + (long)b * max_blocks,
                   sizeof(int32_t) * (size_t)max_blocks);
            kept++;
        }
        n = kept;
        if (n == 0) break;
        rc = ss_eagle3_layer(m, n, ids, embed, vocab, ln_in, hnorm, norm_before_residual, g, x, n, info, tables,
                             max_blocks, NULL, NULL, NULL);
        if (rc == 0) f32_row_to_bf16(x, g, n * H);
    }
    free(live);
    free(info);
    free(tables);
    free(ids);
    free(g);
    free(x);
    free(logits);
    return rc;
}

/* Exposed for tests: y (M, N) fp32 = x (M, K) bf16 @ W (N, K)^T (+ bias), through
   AMX when Wp (ss_pack_amx of W) is given. */
int ss_matmul(const bf16 *x, int M, const bf16 *W, const bf16 *Wp, int N, int K, const float *bias, float *y) {
    const long ld = amx_kp(K);
    bf16 *xp = scratch_alloc(sizeof(bf16) * ((size_t)(M + 31) / 32 * 32) * ld);
    memset(xp, 0, sizeof(bf16) * ((size_t)(M + 31) / 32 * 32) * ld);
    for (int t = 0; t < M; t++)
        for (long i = 0; i < ld; i++) xp[t * ld + i] = i < K ? x[(long)t * K + i] : 0;
    matmul(xp, M, ld, W, Wp, N, K, bias, y, N, 0);
    free(xp);
    return 0;
}

/* OpenMP's thread count is per calling thread: the engine's step thread sets
   it to torch's intra-op count before each call. */
int ss_set_num_threads(int n) {
    if (n > 0) omp_set_num_threads(n);
    return omp_get_max_threads();
}

int ss_abi_version(void) { return 7; }

/* Which build this is (the Python side logs it). */
const char *ss_isa(void) {
#ifdef SS_AVX512
    return "avx512";
#else
    return "avx2";
#endif
}
