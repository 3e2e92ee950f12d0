/* The modern design's layers (pre-norm RMSNorm, rotary positions, grouped-query attention,
 * SwiGLU, no biases) in one native call each, float32 on CPU: the decoder's for one token step
 * (`layers`, from FastDecoder.step) and the encoder's for a batch (`encoder_layers`, once a
 * batch). nmt/decoder_step.py compiles it on first use; the matrix products go to the sgemm_
 * torch itself links (set_sgemm), everything around them is here, so that a step costs one
 * call instead of some hundred operators. It computes what model.py computes, the sums in
 * their own order; tests/test_decoder_step.py holds it to model.py's encoder and decoder.
 * Beside them, for beam search over any design's fast step: `top_logits`, each row's
 * log-softmax normalizer and k largest logits in one visit (held to torch's by the tests). */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef void (*sgemm_t)(const char *, const char *, const int *, const int *, const int *,
                        const float *, const float *, const int *, const float *, const int *,
                        const float *, float *, const int *);
static sgemm_t sgemm;

void set_sgemm(void *function) { sgemm = (sgemm_t)function; }

/* e^x in float32 to about 1 ulp (Cephes' expf: 2^n e^r, |r| <= ln 2 / 2, a polynomial for
 * e^r), written so that the compiler vectorizes the loops that call it (libm's expf is a call
 * per number); 0 below -87.3 (and for -inf), as expf to within 1e-38, and e^88.3 above 88.3
 * (where expf overflows at 88.7). */
static inline float exp_approx(float x) {
    float c = x > -87.3f ? (x < 88.3f ? x : 88.3f) : -87.3f; /* NaN: -87.3, no UB below */
    float n = __builtin_rintf(c * 1.44269504088896341f);
    float r = c - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t i; float f; } scale = {.i = (uint32_t)((int)n + 127) << 23};
    return x < -87.3f ? 0.0f : (x == x ? p * scale.f : x); /* NaN stays NaN */
}

/* Y (rows, out) = beta Y + X (rows, in) W^T, W (out, in): all row-major */
static void linear(const float *X, const float *W, float *Y, int rows, int in, int out,
                   float beta) {
    const float one = 1.0f;
    sgemm("T", "N", &out, &rows, &in, &one, W, &in, X, &in, &beta, Y, &out);
}

/* y = x / sqrt(mean(x^2) + eps) * w, row by row (rows, d) */
static void rms_norm(const float *x, const float *w, float *y, int rows, int d, float eps) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (long)r * d;
        float *yr = y + (long)r * d, squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int i = 0; i < d; i++) squares += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(squares / d + eps);
#pragma omp simd
        for (int i = 0; i < d; i++) yr[i] = xr[i] * inv * w[i];
    }
}

/* A vector register's floats as one value (GCC's and clang's vector extensions), as wide as
 * the CPU's registers (a wider type is split into scalar moves through memory): short sums
 * written with it keep their partial sums in registers, where an `omp simd` reduction adds its
 * lanes one at a time through memory. */
#ifndef LANES /* -DLANES=4 or 8: the narrower widths' code, built on any x86-64 (the tests) */
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
#endif
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef int lane_index __attribute__((vector_size(LANES * sizeof(int))));
#ifdef __clang__
#define SWAPPED(x, ...) __builtin_shufflevector(x, x, __VA_ARGS__)
#else
#define SWAPPED(x, ...) __builtin_shuffle(x, (lane_index){__VA_ARGS__})
#endif

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* the sum of the lanes, halves added to halves */
static inline float lane_sum(vec x) {
#if LANES == 16
    x += SWAPPED(x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x += SWAPPED(x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    x += SWAPPED(x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    x += SWAPPED(x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#elif LANES == 8
    x += SWAPPED(x, 4, 5, 6, 7, 0, 1, 2, 3);
    x += SWAPPED(x, 2, 3, 0, 1, 6, 7, 4, 5);
    x += SWAPPED(x, 1, 0, 3, 2, 5, 4, 7, 6);
#else
    x += SWAPPED(x, 2, 3, 0, 1);
    x += SWAPPED(x, 1, 0, 3, 2);
#endif
    return x[0];
}

/* a . b over n numbers */
static inline float dot(const float *a, const float *b, int n) {
    vec partial = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES) partial += load(a + i) * load(b + i);
    float sum = lane_sum(partial);
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* o (dk) = softmax(scale q.k_t + bias_t) . v_t over n keys and values: k_t = k + at[t] where
 * `at` is given (the numbers a cache's rows lie at), else k + t stride; s: n scratch. */
static inline __attribute__((always_inline)) void attention(
        const float *q, const float *k, const float *v, long stride, const int64_t *at,
        const float *bias, int n, int dk, float scale, float *s, float *o) {
    float top = -INFINITY;
    for (int t = 0; t < n; t++) {
        s[t] = dot(q, k + (at ? at[t] : t * stride), dk) * scale + (bias ? bias[t] : 0.0f);
        top = s[t] > top ? s[t] : top;
    }
#pragma omp simd
    for (int t = 0; t < n; t++) s[t] = exp_approx(s[t] - top);
    vec partial = {0};
    int t = 0;
    for (; t + LANES <= n; t += LANES) partial += load(s + t);
    float sum = lane_sum(partial);
    for (; t < n; t++) sum += s[t];
    float inv = 1.0f / sum;
    if (dk % LANES == 0 && dk <= 64) { /* the output in registers, each key's at once */
        vec out[64 / LANES] = {{0}};
        for (t = 0; t < n; t++) {
            const float *vt = v + (at ? at[t] : t * stride);
            for (int b = 0; b < dk / LANES; b++) out[b] += s[t] * load(vt + LANES * b);
        }
        for (int b = 0; b < dk / LANES; b++) {
            out[b] *= inv;
            memcpy(o + LANES * b, &out[b], sizeof out[b]);
        }
        return;
    }
    for (int i = 0; i < dk; i++) {
        float out = 0.0f;
        for (t = 0; t < n; t++) out += s[t] * v[(at ? at[t] : t * stride) + i];
        o[i] = out * inv;
    }
}

/* attention() compiled apart for the common head widths, so that its loops are unrolled */
static void attend(const float *q, const float *k, const float *v, long stride,
                   const int64_t *at, const float *bias, int n, int dk, float scale, float *s,
                   float *o) {
    if (dk == 32)
        attention(q, k, v, stride, at, bias, n, 32, scale, s, o);
    else if (dk == 64)
        attention(q, k, v, stride, at, bias, n, 64, scale, s, o);
    else
        attention(q, k, v, stride, at, bias, n, dk, scale, s, o);
}

/* Rotary positions on each of the n heads (dk each) of a row: x1' = x1 cos - x2 sin,
 * x2' = x1 sin + x2 cos, over the two halves of the head */
static void rotate(float *row, int n, int dk, const float *cos, const float *sin) {
    int half = dk / 2;
    for (int j = 0; j < n; j++) {
        float *a = row + j * dk;
        for (int i = 0; i < half; i++) {
            float x1 = a[i], x2 = a[i + half];
            a[i] = x1 * cos[i] - x2 * sin[i];
            a[i + half] = x1 * sin[i] + x2 * cos[i];
        }
    }
}

/* x += SwiGLU(RMSNorm(x)): silu(gate) * value, then W_2; scratch normed (rows, d), ffn
 * (rows, 2 hidden), out (rows, hidden) */
static void swiglu(float *x, const float *norm, const float *w_13, const float *w_2, int rows,
                   int d, int hidden, float eps, float *normed, float *ffn, float *out) {
    rms_norm(x, norm, normed, rows, d, eps);
    linear(normed, w_13, ffn, rows, d, 2 * hidden, 0.0f);
    for (int r = 0; r < rows; r++) {
        const float *gate = ffn + (long)r * 2 * hidden, *value = gate + hidden;
        float *o = out + (long)r * hidden;
#pragma omp simd
        for (int i = 0; i < hidden; i++) o[i] = gate[i] / (1.0f + exp_approx(-gate[i])) * value[i];
    }
    linear(out, w_2, x, rows, hidden, d, 1.0f);
}

/* One step of every layer, x (rows, d) in place. Per layer l: norms[3l .. 3l+2] (d) the three
 * residual connections' RMSNorm weights; w_qkv (d + 2 kv dk, d), w_o (d, d), w_q_cross (d, d),
 * w_o_cross (d, d), w_13 (2 hidden, d: gate then value), w_2 (d, hidden), as nn.Linear holds
 * them. cache (L, 2, capacity, slots kv, dk): keys and values, each position's in `slots` rows
 * of their own, written once: row r's at this position into row r; where (rows, capacity) the
 * row that holds each row's keys and values at each position, this one's set here (beams
 * that follow other rows' prefixes take their rows of `where`, nothing of the cache moves).
 * cross (L, 2, sentences kv, src_len, dk) and bias (sentences kv, src_len): the encoder's keys
 * and values and the source mask (0 or -inf), `per` rows a sentence; cos, sin (dk / 2): the
 * rotation of this position. Scratch: normed (rows, d), wide (rows, max(d + 2 kv dk, hidden)),
 * heads (rows, d), ffn (rows, 2 hidden), scores (max(position + 1, src_len)), at
 * (rows, position + 1). Returns 0, or -1 (nothing done) where an earlier position's row of
 * `where` lies outside the cache's rows [0, slots). */
int layers(float *x, int rows, int d, int h, int kv, int dk, int hidden, int L, int position,
           const float *const *norms, const float *const *w_qkv, const float *const *w_o,
           const float *const *w_q_cross, const float *const *w_o_cross,
           const float *const *w_13, const float *const *w_2, float *cache, int capacity,
           int slots, int *where, const float *cross, int src_len, int per, const float *bias,
           const float *cos, const float *sin, float eps, float scale, float *normed,
           float *wide, float *heads, float *ffn, float *scores, int64_t *at) {
    int group = h / kv, width = d + 2 * kv * dk, sentences = rows / per, n = position + 1;
    long self_kv = (long)capacity * slots * kv * dk, cross_kv = (long)sentences * kv * src_len * dk;
    for (int r = 0; r < rows; r++) { /* where each row's keys lie, the same in every layer */
        for (int t = 0; t < position; t++) {
            int row = where[(long)r * capacity + t];
            if (row < 0 || row >= slots) return -1; /* nothing written */
            at[(long)r * n + t] = ((long)t * slots + row) * kv * dk;
        }
        at[(long)r * n + position] = ((long)position * slots + r) * kv * dk;
    }
    for (int r = 0; r < rows; r++) where[(long)r * capacity + position] = r;
    for (int l = 0; l < L; l++) {
        /* masked self-attention over the cached positions and this one */
        rms_norm(x, norms[3 * l], normed, rows, d, eps);
        linear(normed, w_qkv[l], wide, rows, d, width, 0.0f);
        float *keys = cache + 2 * l * self_kv, *values = keys + self_kv;
        for (int r = 0; r < rows; r++) {
            float *row = wide + (long)r * width;
            rotate(row, h + kv, dk, cos, sin); /* the queries, then the keys */
            long own = ((long)position * slots + r) * kv * dk;
            memcpy(keys + own, row + d, kv * dk * sizeof(float));
            memcpy(values + own, row + d + kv * dk, kv * dk * sizeof(float));
            for (int j = 0; j < h; j++) {
                long head = (long)(j / group) * dk;
                attend(row + j * dk, keys + head, values + head, 0, at + (long)r * n, 0, n, dk,
                       scale, scores, heads + (long)r * d + j * dk);
            }
        }
        linear(heads, w_o[l], x, rows, d, d, 1.0f); /* x + heads W_O */
        /* cross-attention over the encoder output */
        rms_norm(x, norms[3 * l + 1], normed, rows, d, eps);
        linear(normed, w_q_cross[l], wide, rows, d, d, 0.0f);
        const float *ck = cross + 2 * l * cross_kv, *cv = ck + cross_kv;
        for (int r = 0; r < rows; r++) {
            for (int j = 0; j < h; j++) {
                long head = (long)(r / per * kv + j / group);
                attend(wide + (long)r * d + j * dk, ck + head * src_len * dk,
                       cv + head * src_len * dk, dk, 0, bias + head * src_len, src_len, dk,
                       scale, scores, heads + (long)r * d + j * dk);
            }
        }
        linear(heads, w_o_cross[l], x, rows, d, d, 1.0f);
        swiglu(x, norms[3 * l + 2], w_13[l], w_2[l], rows, d, hidden, eps, normed, ffn, wide);
    }
    return 0;
}

/* The encoder's layers, x (batch len, d) in place: per layer l, norms[2l], norms[2l + 1] the
 * two residual connections' RMSNorm weights, w_qkv, w_o, w_13, w_2 as in `layers`; bias
 * (batch, len): the source mask (0 or -inf); cos, sin (len, dk / 2): the rotations of the
 * positions. Scratch as in `layers`, for batch len rows; scores (len). */
void encoder_layers(float *x, int batch, int len, int d, int h, int kv, int dk, int hidden,
                    int L, const float *const *norms, const float *const *w_qkv,
                    const float *const *w_o, const float *const *w_13,
                    const float *const *w_2, const float *bias, const float *cos,
                    const float *sin, float eps, float scale, float *normed, float *wide,
                    float *heads, float *ffn, float *scores) {
    int rows = batch * len, group = h / kv, half = dk / 2, width = d + 2 * kv * dk;
    for (int l = 0; l < L; l++) {
        rms_norm(x, norms[2 * l], normed, rows, d, eps);
        linear(normed, w_qkv[l], wide, rows, d, width, 0.0f);
        for (int r = 0; r < rows; r++)
            rotate(wide + (long)r * width, h + kv, dk, cos + (r % len) * half,
                   sin + (r % len) * half);
        for (int r = 0; r < rows; r++) {
            int b = r / len;
            for (int j = 0; j < h; j++) {
                const float *k = wide + (long)b * len * width + d + (j / group) * dk;
                attend(wide + (long)r * width + j * dk, k, k + kv * dk, width, 0,
                       bias + (long)b * len, len, dk, scale, scores, heads + (long)r * d + j * dk);
            }
        }
        linear(heads, w_o[l], x, rows, d, d, 1.0f);
        swiglu(x, norms[2 * l + 1], w_13[l], w_2[l], rows, d, hidden, eps, normed, ffn, wide);
    }
}

/* Beam search's candidates over the vocabulary, each row of x (rows, n) visited once, swept
 * three times while it is in the cache (its blocks' maxima, the sum of exponentials, the k
 * largest): its log-sum-exp (lse, rows) over every column (-inf where every column is), and
 * its k largest values (values, columns: rows, k), largest first, the first of equal values
 * first, with the column `skip` taken as -inf there (-1: none). blocks: n / 16 + 1 scratch,
 * the maxima of 16 columns. */
void top_logits(const float *x, int rows, int n, int k, int skip, float *lse, float *values,
                int64_t *columns, float *blocks) {
    int nb = (n + 15) / 16;
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (long)r * n;
        float top = -INFINITY, sum = 0.0f, *v = values + (long)r * k;
        int64_t *c = columns + (long)r * k;
        for (int b = 0; b < nb; b++) {
            int end = b * 16 + 16 < n ? b * 16 + 16 : n;
            float m = -INFINITY;
#pragma omp simd reduction(max : m)
            for (int i = b * 16; i < end; i++) m = xr[i] > m ? xr[i] : m;
            blocks[b] = m;
            top = m > top ? m : top;
        }
        if (top == -INFINITY) { /* every column barred */
            lse[r] = -INFINITY;
        } else {
#pragma omp simd reduction(+ : sum)
            for (int i = 0; i < n; i++) sum += exp_approx(xr[i] - top);
            lse[r] = top + logf(sum);
        }
        int filled = 0;
        for (int b = 0; b < nb; b++) {
            if (filled == k && !(blocks[b] > v[k - 1])) continue; /* nothing larger in it */
            int end = b * 16 + 16 < n ? b * 16 + 16 : n;
            for (int i = b * 16; i < end; i++) {
                float value = i == skip ? -INFINITY : xr[i];
                if (filled == k && !(value > v[k - 1])) continue;
                int p = filled < k ? filled++ : k - 1; /* the last place, then moved up */
                while (p > 0 && v[p - 1] < value) {
                    v[p] = v[p - 1];
                    c[p] = c[p - 1];
                    p--;
                }
                v[p] = value;
                c[p] = i;
            }
        }
    }
}
