/* hybridkv's CPU kernels for the embedded model's default path (AVX2 + FMA, OpenMP).
 *
 * Compiled at first use by hybridkv.engine.cpu_kernels (the C compiler of the machine, no Python
 * headers) and called through ctypes on torch tensors' memory.
 *
 * The one rule every kernel here keeps: an output element's arithmetic depends on its own row of
 * the input and the weights alone, never on how many rows the call holds, how they are tiled or how
 * the work is split between threads. Each element has one accumulator; its lanes take the products
 * in increasing position order and are summed in a fixed order at the end. So a token computes the
 * same bits as one row of a decode step or as one row of a 2,048-token prefill chunk, and caching,
 * chunking and batching never change an output.
 *
 * Weights are groups of 32 codes along the input dimension, w = scale * code + zero, with one
 * (scale, zero) pair per `group` inputs (a multiple of 32) of each output row:
 *   4-bit: 32 bytes a block of 64 (two groups), 8-bit: 32 bytes a block of 32, laid out lane-major
 *   (decode4 below).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>


static inline float hsum8(__m256 v) {
    /* lanes (0+4, 1+5, 2+6, 3+7), then (0+2, 1+3), then 0+1: a fixed order */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Weight codes are laid out so that no byte shuffle is needed: each 32-byte block is 16 lanes of
 * 16 bits, and lane j holds the codes of weights 16v + j of the block (v = 0, 1, ...): four 4-bit
 * codes (a block of 64 weights, two groups) or two 8-bit ones (a block of 32, one group). wvec gives
 * the two int16 vectors (weights 0-15 and 16-31) of group g of a column. Columns are interleaved in
 * tiles of 8: the blocks at one input offset of 8 consecutive columns are 256 contiguous bytes
 * (col_codes), and so are their scales (col_scales), so a tile of columns reads one stream. */
static inline const uint8_t *col_codes(const uint8_t *codes, int n, int K, int bits) {
    return codes + ((size_t)(n >> 3) * (K * bits / 8) * 8) + (n & 7) * 32;
}

static inline const float *col_scales(const float *scale, int n, int wgroups) {
    return scale + (size_t)(n >> 3) * wgroups * 8 + (n & 7);
}

static inline __attribute__((always_inline)) void wvec(int bits, const uint8_t *col, int g, __m256i *w0, __m256i *w1) {
    if (bits == 4) {
        const __m256i mask = _mm256_set1_epi16(0x0F);
        __m256i lanes = _mm256_loadu_si256((const __m256i *)(col + (g >> 1) * 256));
        if (g & 1) {
            *w0 = _mm256_and_si256(_mm256_srli_epi16(lanes, 8), mask);
            *w1 = _mm256_srli_epi16(lanes, 12);
        } else {
            *w0 = _mm256_and_si256(lanes, mask);
            *w1 = _mm256_and_si256(_mm256_srli_epi16(lanes, 4), mask);
        }
    } else {
        __m256i lanes = _mm256_loadu_si256((const __m256i *)(col + g * 256));
        *w0 = _mm256_srai_epi16(_mm256_slli_epi16(lanes, 8), 8);
        *w1 = _mm256_srai_epi16(lanes, 8);
    }
}

/* The 8 int32 lanes of each of a[0..7] summed: lane c of the result is the sum of a[c] (exact;
 * unpacks and adds, which this CPU runs several a cycle, where hadd takes a few cycles each). */
static inline __m256i reduce8(const __m256i a[8]) {
    __m256i t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = _mm256_add_epi32(_mm256_unpacklo_epi32(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        u[i] = _mm256_add_epi32(_mm256_unpacklo_epi64(t[2 * i], t[2 * i + 1]), _mm256_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(u[0], u[1], 0x20), _mm256_permute2x128_si256(u[0], u[1], 0x31));
}

/* acc + float(the 8 columns' dot products a) * (their weight scales ws * the row's activation scale xd):
 * one group's step of every element, the same in every tile shape. */
static inline __m256 add_group(__m256 acc, const __m256i a[8], __m256 ws, float xd) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(a)), _mm256_mul_ps(ws, _mm256_set1_ps(xd)), acc);
}

/* One tile: rows r0 .. r0 + rt of the activations against the 8 output columns n0 .. n0 + 8. The
 * activations are int16 codes per group of 32 (xq, with scale xd[m, g]: x ~ xd * xq). Element
 * (m, n), for each group g of 32 in order: acc = fma(float(dot), scale[n, g'] * xd[m, g], acc),
 * dot the group's integer dot product (exact), g' the weight scale group holding g; for each weight
 * scale group in order: zacc = fma(zero[n, g'], xsum[m, g'], zacc); out = acc + zacc. The vectors
 * hold the 8 columns of one row, so every element takes exactly these steps whatever rt is. Inlined
 * with constant bits, per and rt. */
static inline __attribute__((always_inline)) void tile(
    int bits, int per, int rt, int K, const int16_t *restrict xq, const float *restrict xd,
    const float *restrict xsum, int has_zero, int r0, const uint8_t *restrict codes, const float *restrict scale,
    const float *restrict zero, int n0, float *restrict out, int N) {
    const int groups = K / 32, wgroups = groups / per;
    const uint8_t *cols = col_codes(codes, n0, K, bits);
    const float *scales = col_scales(scale, n0, wgroups), *zeros = col_scales(zero, n0, wgroups);
    __m256 acc[4], zacc[4];
    for (int r = 0; r < rt; r++) { acc[r] = _mm256_setzero_ps(); zacc[r] = _mm256_setzero_ps(); }
    for (int g = 0; g < groups; g++) {
        const int wg = g / per; /* per is a constant: a shift */
        const __m256 ws = _mm256_loadu_ps(scales + wg * 8);
        if (rt == 1) { /* one row (a decode step): each column's codes used as soon as decoded */
            const int16_t *x = xq + (size_t)r0 * K + 32 * g;
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)x), x1 = _mm256_loadu_si256((const __m256i *)(x + 16));
            __m256i a[8];
            for (int c = 0; c < 8; c++) {
                __m256i w0, w1;
                wvec(bits, cols + c * 32, g, &w0, &w1);
                a[c] = _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
            }
            acc[0] = add_group(acc[0], a, ws, xd[(size_t)r0 * groups + g]);
        } else { /* several rows: the 8 columns' codes decoded once for all of them */
            __m256i w[8][2];
            for (int c = 0; c < 8; c++) wvec(bits, cols + c * 32, g, &w[c][0], &w[c][1]);
            for (int r = 0; r < rt; r++) {
                const int16_t *x = xq + (size_t)(r0 + r) * K + 32 * g;
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)x),
                              x1 = _mm256_loadu_si256((const __m256i *)(x + 16));
                __m256i a[8];
                for (int c = 0; c < 8; c++)
                    a[c] = _mm256_add_epi32(_mm256_madd_epi16(w[c][0], x0), _mm256_madd_epi16(w[c][1], x1));
                acc[r] = add_group(acc[r], a, ws, xd[(size_t)(r0 + r) * groups + g]);
            }
        }
        if (has_zero && (g + 1) % per == 0) {
            const __m256 z = _mm256_loadu_ps(zeros + wg * 8);
            for (int r = 0; r < rt; r++)
                zacc[r] = _mm256_fmadd_ps(z, _mm256_set1_ps(xsum[(size_t)(r0 + r) * wgroups + wg]), zacc[r]);
        }
    }
    for (int r = 0; r < rt; r++) _mm256_storeu_ps(out + (size_t)(r0 + r) * N + n0, _mm256_add_ps(acc[r], zacc[r]));
}

#define TILES(b, p)                                                                                    \
    for (int n = n_lo; n < n_hi; n += 8) switch (rt) {                                                 \
        case 1: tile(b, p, 1, K, xq, xd, xsum, has_zero, r0, codes, scale, zero, n, out, N); break;    \
        case 2: tile(b, p, 2, K, xq, xd, xsum, has_zero, r0, codes, scale, zero, n, out, N); break;    \
        case 3: tile(b, p, 3, K, xq, xd, xsum, has_zero, r0, codes, scale, zero, n, out, N); break;    \
        default: tile(b, p, 4, K, xq, xd, xsum, has_zero, r0, codes, scale, zero, n, out, N); break;   \
        }

/* Every tile of rows r0 .. r0 + rt over columns n_lo .. n_hi; weight scale groups of 32 or 128. */
static void tiles_of_rows(int bits, int rt, int K, int group, const int16_t *xq, const float *xd, const float *xsum,
                          int has_zero, int r0, const uint8_t *codes, const float *scale, const float *zero,
                          int n_lo, int n_hi, float *out, int N) {
    if (bits == 4 && group == 128) {
        TILES(4, 4)
    } else if (bits == 4) {
        TILES(4, 1)
    } else if (group == 128) {
        TILES(8, 4)
    } else {
        TILES(8, 1)
    }
}

/* The activations of M rows as the kernels take them: per group of 32, xd = max |x| / 32767 and
 * xq = x / xd rounded to the nearest integer (ties to even); xsum[m, g'] = the float32 sum of x over
 * each weight scale group g' of `group` inputs, in order. Each row on its own. */
static void quantize_rows(int M, int K, int group, const float *x, int16_t *xq, float *xd, float *xsum) {
    const int groups = K / 32, wgroups = K / group;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int m = 0; m < M; m++) {
        for (int g = 0; g < groups; g++) {
            const float *v = x + (size_t)m * K + 32 * g;
            __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(v));
            for (int i = 1; i < 4; i++) a = _mm256_max_ps(a, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8 * i)));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            const float amax = _mm_cvtss_f32(h);
            const float d = amax / 32767.0f, inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
            xd[(size_t)m * groups + g] = d;
            const __m256 iv = _mm256_set1_ps(inv);
            __m256i q[4];
            for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * i), iv));
            /* packs works within 128-bit lanes: permute back to position order */
            __m256i p0 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
            __m256i p1 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
            _mm256_storeu_si256((__m256i *)(xq + (size_t)m * K + 32 * g), p0);
            _mm256_storeu_si256((__m256i *)(xq + (size_t)m * K + 32 * g + 16), p1);
        }
        for (int g = 0; g < wgroups; g++) {
            float s = 0.0f;
            for (int k = g * group; k < (g + 1) * group; k++) s += x[(size_t)m * K + k];
            xsum[(size_t)m * wgroups + g] = s;
        }
    }
}

/* out[M, N] = x[M, K] @ W[N, K].T in float32, W as 4- or 8-bit codes (`has_zero`: some zero is not
 * 0). scratch: M * K int16 then M * (K / 32 + K / group) floats. Threads split the output columns in
 * blocks; each runs every row tile over its columns. */
void hkv_qmatmul(int bits, int M, int N, int K, int group, const float *x, const uint8_t *codes,
                 const float *scale, const float *zero, int has_zero, float *out, void *scratch, int threads) {
    const int block = 64;
    int16_t *xq = (int16_t *)scratch;
    float *xd = (float *)(xq + (size_t)M * K), *xsum = xd + (size_t)M * (K / 32);
    quantize_rows(M, K, group, x, xq, xd, xsum);
    const int blocks = (N + block - 1) / block;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int b = 0; b < blocks; b++) {
        int n_lo = b * block, n_hi = n_lo + block < N ? n_lo + block : N;
        for (int r0 = 0; r0 < M; r0 += 4) {
            int rt = M - r0 < 4 ? M - r0 : 4;
            tiles_of_rows(bits, rt, K, group, xq, xd, xsum, has_zero, r0, codes, scale, zero, n_lo, n_hi, out, N);
        }
    }
}

/* ------------------------------------------------------------------ the rest of a decoder layer
 * Each works on rows independently; reductions run in 8 lanes in position order, summed by hsum8. */

static inline float sum_squares(const float *x, int n) {
    __m256 a = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        a = _mm256_fmadd_ps(v, v, a);
    }
    return hsum8(a);
}

static inline void norm_row(const float *x, int n, const float *w, float eps, float *y, float *residual) {
    const __m256 iv = _mm256_set1_ps(1.0f / sqrtf(sum_squares(x, n) / (float)n + eps));
    float *out = residual ? residual : y;
    for (int i = 0; i < n; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), iv);
        if (w) v = _mm256_mul_ps(v, _mm256_loadu_ps(w + i));
        if (residual) v = _mm256_add_ps(_mm256_loadu_ps(residual + i), v);
        _mm256_storeu_ps(out + i, v);
    }
}

/* Gemma's RMSNorm of rows of n values (a multiple of 8): y = x / sqrt(mean(x^2) + eps) * w (w may
 * be NULL: 1). With `residual` (not NULL), residual += y instead of storing y (a post-norm), and
 * then, with `next` (not NULL), y = the RMSNorm of the updated residual times `next` (the pre-norm
 * that follows it). Rows of x are x_stride apart; residual and y are contiguous rows. */
void hkv_rms_norm(int rows, int n, const float *x, int x_stride, const float *w, float eps, float *y,
                  float *residual, const float *next) {
    for (int r = 0; r < rows; r++) {
        float *res = residual ? residual + (size_t)r * n : NULL;
        norm_row(x + (size_t)r * x_stride, n, w, eps, y + (size_t)r * n, res);
        if (res && next) norm_row(res, n, next, eps, y + (size_t)r * n, NULL);
    }
}

/* Per-head RMSNorm (weights w[head, d]) then rotate-half RoPE of `heads` heads of d values at the
 * start of each row of x (stride x_stride), in place; cos, sin [rows, d]. */
void hkv_qk_norm_rope(int rows, int heads, int d, float *x, int x_stride, const float *w, float eps,
                      const float *cos, const float *sin) {
    const int half = d / 2;
    float tmp[1024];
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++) {
            float *v = x + (size_t)r * x_stride + (size_t)h * d;
            const float *c = cos + (size_t)r * d, *s = sin + (size_t)r * d, *wh = w + (size_t)h * d;
            const __m256 iv = _mm256_set1_ps(1.0f / sqrtf(sum_squares(v, d) / (float)d + eps));
            for (int i = 0; i < d; i += 8)
                _mm256_storeu_ps(tmp + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(v + i), iv), _mm256_loadu_ps(wh + i)));
            const __m256 neg = _mm256_set1_ps(-0.0f);
            for (int i = 0; i < d; i += 8) {
                __m256 rot = i < half ? _mm256_xor_ps(_mm256_loadu_ps(tmp + i + half), neg) : _mm256_loadu_ps(tmp + i - half);
                __m256 out = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(tmp + i), _mm256_loadu_ps(c + i)),
                                           _mm256_mul_ps(rot, _mm256_loadu_ps(s + i)));
                _mm256_storeu_ps(v + i, out);
            }
        }
}

/* d bfloat16 values as float32 (exact: the top 16 bits of each). */
static inline void bf16_to_float(const void *src, int d, float *dst) {
    const uint16_t *h = (const uint16_t *)src;
    for (int i = 0; i < d; i += 8) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
}

/* exp(x) for x <= 0, lane by lane (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times
 * 2^n; about 1 ulp; 0 below -87). */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* out[r, i] = gelu_tanh(gu[r, i]) * gu[r, n + i]: GeGLU over rows of gate then up (2n values, n a
 * multiple of 8). tanh(y) = sign(y) (1 - e) / (1 + e) with e = exp8(-2 |y|), lane by lane. */
void hkv_gelu_mul(int rows, int n, const float *gu, float *out) {
    const __m256 k = _mm256_set1_ps(0.7978845608028654f), c = _mm256_set1_ps(0.044715f);
    const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f), sign = _mm256_set1_ps(-0.0f);
    for (int r = 0; r < rows; r++) {
        const float *g = gu + (size_t)r * 2 * n, *u = g + n;
        float *o = out + (size_t)r * n;
        for (int i = 0; i < n; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 y = _mm256_mul_ps(k, _mm256_fmadd_ps(_mm256_mul_ps(c, x), _mm256_mul_ps(x, x), x));
            const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), _mm256_andnot_ps(sign, y)));
            const __m256 t = _mm256_or_ps(_mm256_and_ps(sign, y), _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)));
            const __m256 gelu = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, t));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(u + i)));
        }
    }
}

/* out[r] = log(sum_i exp(x[r, i])) of rows of n float32 values (n a multiple of 8): m = the row's
 * maximum, then exp8(x - m) summed in 8 lanes of float64 in order, the lanes added in order;
 * out = m + log(sum). Rows in parallel, each on its own. */
void hkv_logsumexp(int rows, int n, const float *x, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 1)
    for (int r = 0; r < rows; r++) {
        const float *v = x + (size_t)r * n;
        __m256 mv = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        for (int i = 0; i < n; i += 8) {
            __m256 e = _mm256_loadu_ps(v + i);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(e, e, _CMP_UNORD_Q));
            mv = _mm256_max_ps(mv, e);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, mv);
        float m = lanes[0];
        for (int i = 1; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
        if (_mm256_movemask_ps(nan)) {
            out[r] = NAN;
            continue;
        }
        if (m == -INFINITY || m == INFINITY) { /* what log-sum-exp gives */
            out[r] = m;
            continue;
        }
        const __m256 mb = _mm256_set1_ps(m);
        __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
        for (int i = 0; i < n; i += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(v + i), mb));
            lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
        }
        double d[8];
        _mm256_storeu_pd(d, lo);
        _mm256_storeu_pd(d + 4, hi);
        double s = 0.0;
        for (int i = 0; i < 8; i++) s += d[i];
        out[r] = m + (float)log(s);
    }
}

#define QT 8   /* queries a task takes together: each key is read and converted once for all of them */
#define KB 256 /* keys converted to float32 at a time */

static inline __m256 load8(const char *p, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)p);
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* scores[r, n] = scale * dot(q_r, k_n) for rows r0 .. r0 + R and keys n0 .. n0 + C of a block:
 * per (row, key) one 8-lane accumulator over the d / 8 vectors in order, then hsum8. Inlined with
 * constant R and C (R * C accumulators in registers, each loaded vector shared). */
static inline __attribute__((always_inline)) void score_tile(int R, int C, const float *const *q, int r0,
                                                            const char *const *key, int n0, int bf16, int d,
                                                            float scale, float *scores, int stride) {
    const int es = bf16 ? 2 : 4;
    __m256 a[12];
    for (int t = 0; t < R * C; t++) a[t] = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) {
        __m256 k[8];
        for (int c = 0; c < C; c++) k[c] = load8(key[n0 + c] + i * es, bf16);
        for (int r = 0; r < R; r++) {
            const __m256 qv = _mm256_loadu_ps(q[r0 + r] + i);
            for (int c = 0; c < C; c++) a[r * C + c] = _mm256_fmadd_ps(qv, k[c], a[r * C + c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) scores[(size_t)(r0 + r) * stride + n0 + c] = hsum8(a[r * C + c]) * scale;
}

/* scores[r, n] = scale * dot(q_r, k_n) for the rows r < rows and keys n < nk of a block, k_n at
 * key[n] (float32, or bfloat16 with `bf16`: converted exactly, so either gives the same bits);
 * score_tile states the arithmetic, the same in every tile shape. */
static void block_scores(int rows, const float *const *q, const char *const *key, int bf16, int nk, int d,
                         float scale, float *scores, int stride) {
    int r = 0;
    for (; r + 3 <= rows; r += 3) {
        int n = 0;
        for (; n + 4 <= nk; n += 4) score_tile(3, 4, q, r, key, n, bf16, d, scale, scores, stride);
        for (; n < nk; n++) score_tile(3, 1, q, r, key, n, bf16, d, scale, scores, stride);
    }
    for (; r < rows; r++) {
        int n = 0;
        for (; n + 8 <= nk; n += 8) score_tile(1, 8, q, r, key, n, bf16, d, scale, scores, stride);
        for (; n < nk; n++) score_tile(1, 1, q, r, key, n, bf16, d, scale, scores, stride);
    }
}

/* acc[r] += sum_n p[r, n] v_n for rows r0 .. r0 + R over the keys n < nv of a block (v_n at value[n],
 * as block_scores' keys), in order of n, lane by lane, 32 values at a time. Inlined with constant R. */
static inline __attribute__((always_inline)) void value_tile(int R, const float *p, int stride, int r0,
                                                            const char *const *value, int bf16, int nv, int d,
                                                            float *acc) {
    const int es = bf16 ? 2 : 4;
    for (int i = 0; i < d; i += 32) {
        __m256 a[3][4];
        for (int r = 0; r < R; r++)
            for (int v = 0; v < 4; v++) a[r][v] = _mm256_loadu_ps(acc + (size_t)(r0 + r) * d + i + 8 * v);
        for (int n = 0; n < nv; n++) {
            __m256 x[4];
            for (int v = 0; v < 4; v++) x[v] = load8(value[n] + (i + 8 * v) * es, bf16);
            for (int r = 0; r < R; r++) {
                const __m256 pr = _mm256_set1_ps(p[(size_t)(r0 + r) * stride + n]);
                for (int v = 0; v < 4; v++) a[r][v] = _mm256_fmadd_ps(pr, x[v], a[r][v]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int v = 0; v < 4; v++) _mm256_storeu_ps(acc + (size_t)(r0 + r) * d + i + 8 * v, a[r][v]);
    }
}

static void block_values(int rows, const float *p, int stride, const char *const *value, int bf16, int nv, int d,
                         float *acc) {
    int r = 0;
    for (; r + 3 <= rows; r += 3) value_tile(3, p, stride, r, value, bf16, nv, d, acc);
    for (; r + 2 <= rows; r += 2) value_tile(2, p, stride, r, value, bf16, nv, d, acc);
    for (; r < rows; r++) value_tile(1, p, stride, r, value, bf16, nv, d, acc);
}

/* A per-thread buffer of at least `bytes`, grown as needed and kept for the thread's life. */
static float *scratch(size_t bytes) {
    static __thread float *buffer = NULL;
    static __thread size_t size = 0;
    if (bytes > size) {
        free(buffer);
        size = bytes + bytes / 2;
        buffer = malloc(size);
        if (!buffer) abort();
    }
    return buffer;
}

/* where[n] = the cache row of key keys[n] (its KV head at head_offset); with `scratch`, the bf16
 * rows converted there to float32 (exactly) and where[n] pointing at them. */
static void gather(const void *cache, const int64_t *slots, const int *keys, int nb, size_t slot_bytes,
                   size_t head_offset, int d, float *scratch, const char **where) {
    for (int n = 0; n < nb; n++) {
        where[n] = (const char *)cache + (size_t)slots[keys[n]] * slot_bytes + head_offset;
        if (scratch) {
            bf16_to_float(where[n], d, scratch + (size_t)n * d);
            where[n] = (const char *)(scratch + (size_t)n * d);
        }
    }
}

/* Attention of one part of a step: queries q[query_rows[b, i], head] (rows of q_stride floats, head
 * h at h * d) over the keys at key_slots[b, j] (j < L) of the cache where mask[b, i, j], written to
 * out[query_rows[b, i], head] (rows of out_stride). Query head h reads KV head h / (heads / kv_heads).
 * Per query and head, over the keys it sees in order of j: s_j = scale * dot(q, k_j) (block_scores),
 * m = max s_j, p_j = exp8(s_j - m), out = (sum p_j v_j) / (sum p_j), both sums in order of j; the
 * keys another query of the task sees and this one does not add exact zeros (p = 0) to its values'
 * sum, which leaves every bit as it was, and nothing to its denominator. A key no query of the task
 * sees is not read at all (its page may hold anything). The cache is float32 or bfloat16 (`bf16`),
 * kv_heads * d values a slot; d <= 512, a multiple of 32, and heads / kv_heads <= 8 (checked by
 * the caller). */
void hkv_attention(int B, int Q, int L, int heads, int kv_heads, int d, const float *q, int q_stride,
                   const int64_t *query_rows, const int64_t *key_slots, const uint8_t *mask, const void *k_cache,
                   const void *v_cache, int bf16, float scale, float *out, int out_stride, int threads) {
    const int all_heads = heads / kv_heads, esize = bf16 ? 2 : 4, tiles = (Q + QT - 1) / QT;
    const size_t slot_bytes = (size_t)kv_heads * d * esize;
    /* fewer (query tile, KV head) tasks than threads (a decode step): each takes part of the heads */
    const int split = B * tiles * kv_heads < threads ? (threads < all_heads ? threads : all_heads) : 1;
    const int tasks = B * tiles * kv_heads * split;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && tasks > 1)
    for (int task = 0; task < tasks; task++) {
        const int part = task % split, rest = task / split;
        const int kvh = rest % kv_heads, b = rest / kv_heads / tiles, i0 = rest / kv_heads % tiles * QT;
        const int h0 = all_heads * part / split, group = all_heads * (part + 1) / split - h0;
        const int nq = Q - i0 < QT ? Q - i0 : QT, rows = nq * group;
        const int64_t *slots = key_slots + (size_t)b * L;
        const uint8_t *masks = mask + ((size_t)b * Q + i0) * L;
        /* the keys some query of the task sees, in order */
        /* this thread's scratch, kept between calls (no page faults on every part of every step) */
        const size_t n_keys = (size_t)L + 8, n_scores = (size_t)rows * (L + 8), n_acc = (size_t)rows * d;
        float *arena = scratch((n_keys + n_scores + n_acc + (size_t)KB * d) * sizeof(float));
        int *keys = (int *)arena;
        int nk = 0;
        for (int j = 0; j < L; j++) {
            int any = 0;
            for (int i = 0; i < nq; i++) any |= masks[(size_t)i * L + j];
            if (any) keys[nk++] = j;
        }
        const int stride = nk + 8;
        float *scores = arena + n_keys, *acc = scores + n_scores;
        memset(acc, 0, n_acc * sizeof(float));
        /* many rows: each block's keys and values converted to float32 once; few: read where they are */
        const int convert = bf16 && rows > 4;
        float *kf = convert ? acc + n_acc : NULL;
        const char *kp[KB];
        const float *qh[QT * 8];
        float mx[QT * 8], den[QT * 8];
        for (int i = 0; i < nq; i++)
            for (int g = 0; g < group; g++)
                qh[i * group + g] = q + (size_t)query_rows[(size_t)b * Q + i0 + i] * q_stride
                                    + (size_t)(kvh * all_heads + h0 + g) * d;
        const size_t head_offset = (size_t)kvh * d * esize;
        for (int n0 = 0; n0 < nk; n0 += KB) {
            const int nb = nk - n0 < KB ? nk - n0 : KB;
            gather(k_cache, slots, keys + n0, nb, slot_bytes, head_offset, d, convert ? kf : NULL, kp);
            block_scores(rows, qh, kp, bf16 && !convert, nb, d, scale, scores + n0, stride);
        }
        /* the weights: exp8 of each score less the row's maximum over the keys its query sees; 0 where
         * it does not see the key */
        for (int i = 0; i < nq; i++)
            for (int g = 0; g < group; g++) {
                const int r = i * group + g;
                float *sr = scores + (size_t)r * stride;
                const uint8_t *seen = masks + (size_t)i * L;
                float m = -INFINITY;
                for (int n = 0; n < nk; n++)
                    if (seen[keys[n]] && sr[n] > m) m = sr[n];
                mx[r] = m;
                const __m256 mv = _mm256_set1_ps(m);
                for (int n = 0; n < nk; n += 8) _mm256_storeu_ps(sr + n, exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + n), mv)));
                float sum = 0.0f;
                for (int n = 0; n < nk; n++) {
                    if (seen[keys[n]]) sum += sr[n];
                    else sr[n] = 0.0f;
                }
                den[r] = sum;
            }
        for (int n0 = 0; n0 < nk; n0 += KB) {
            const int nb = nk - n0 < KB ? nk - n0 : KB;
            gather(v_cache, slots, keys + n0, nb, slot_bytes, head_offset, d, convert ? kf : NULL, kp);
            block_values(rows, scores + n0, stride, kp, bf16 && !convert, nb, d, acc);
        }
        for (int i = 0; i < nq; i++)
            for (int g = 0; g < group; g++) {
                const int r = i * group + g;
                float *o = out + (size_t)query_rows[(size_t)b * Q + i0 + i] * out_stride
                           + (size_t)(kvh * all_heads + h0 + g) * d;
                const __m256 inv = _mm256_set1_ps(mx[r] == -INFINITY ? 0.0f : 1.0f / den[r]);
                for (int e = 0; e < d; e += 8) _mm256_storeu_ps(o + e, _mm256_mul_ps(_mm256_loadu_ps(acc + (size_t)r * d + e), inv));
            }
    }
}

int hkv_abi_version(void) { return 1; }
