/* The decoder's layers for one token step in one native call: the modern design (pre-norm
 * RMSNorm, rotary positions, grouped-query attention, SwiGLU, no biases), float32 on CPU.
 * nmt/decoder_step.py compiles it on first use and calls `layers` from FastDecoder.step; the
 * matrix products go to the sgemm_ torch itself links (set_sgemm), everything around them is
 * here, so that a step costs one call instead of some hundred operators. It computes what
 * FastDecoder's operators compute, in the same order within each sum where it can;
 * tests/test_decoder_step.py holds it to model.py's decoder. */
#include <math.h>
#include <string.h>

typedef void (*sgemm_t)(const char *, const char *, const int *, const int *, const int *,
                        const float *, const float *, const int *, const float *, const int *,
                        const float *, float *, const int *);
static sgemm_t sgemm;

void set_sgemm(void *function) { sgemm = (sgemm_t)function; }

/* e^x in float32 to about 1 ulp (Cephes' expf: 2^n e^r, |r| <= ln 2 / 2, a polynomial for
 * e^r), written so that the compiler vectorizes the loops that call it (libm's expf is a call
 * per number); 0 below -87.3 (and for -inf), as expf to within 1e-38, and capped at 88.7. */
static inline float exp_approx(float x) {
    float c = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
    float n = __builtin_rintf(c * 1.44269504088896341f);
    float r = c - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int i; float f; } scale = {.i = ((int)n + 127) << 23};
    return x < -87.3f ? 0.0f : p * scale.f;
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

/* o (dk) = softmax(scale q.k_t + bias_t) . v_t over n keys and values (n, dk); s: n scratch */
static void attend(const float *q, const float *k, const float *v, const float *bias, int n,
                   int dk, float scale, float *s, float *o) {
    float top = -INFINITY, sum = 0.0f;
    for (int t = 0; t < n; t++) {
        const float *kt = k + (long)t * dk;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int i = 0; i < dk; i++) dot += q[i] * kt[i];
        s[t] = dot * scale + (bias ? bias[t] : 0.0f);
        top = s[t] > top ? s[t] : top;
    }
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < n; t++) {
        s[t] = exp_approx(s[t] - top);
        sum += s[t];
    }
    for (int i = 0; i < dk; i++) o[i] = 0.0f;
    for (int t = 0; t < n; t++) {
        float p = s[t] / sum;
        const float *vt = v + (long)t * dk;
#pragma omp simd
        for (int i = 0; i < dk; i++) o[i] += p * vt[i];
    }
}

/* One step of every layer, x (rows, d) in place. Per layer l: norms[3l .. 3l+2] (d) the three
 * residual connections' RMSNorm weights; w_qkv (d + 2 kv dk, d), w_o (d, d), w_q_cross (d, d),
 * w_o_cross (d, d), w_13 (2 hidden, d: gate then value), w_2 (d, hidden), as nn.Linear holds
 * them. cache (L, 2, rows kv, capacity, dk): keys and values, this position's written here;
 * cross (L, 2, sentences kv, src_len, dk) and bias (sentences kv, src_len): the encoder's keys
 * and values and the source mask (0 or -inf), `per` rows a sentence; cos, sin (dk / 2): the
 * rotation of this position. Scratch: normed (rows, d), wide (rows, max(d + 2 kv dk, hidden)),
 * heads (rows, d), ffn (rows, 2 hidden), scores (max(capacity, src_len)). */
void layers(float *x, int rows, int d, int h, int kv, int dk, int hidden, int L, int position,
            const float *const *norms, const float *const *w_qkv, const float *const *w_o,
            const float *const *w_q_cross, const float *const *w_o_cross,
            const float *const *w_13, const float *const *w_2, float *cache, int capacity,
            const float *cross, int src_len, int per, const float *bias, const float *cos,
            const float *sin, float eps, float scale, float *normed, float *wide, float *heads,
            float *ffn, float *scores) {
    int group = h / kv, half = dk / 2, width = d + 2 * kv * dk, sentences = rows / per;
    long self_kv = (long)rows * kv * capacity * dk, cross_kv = (long)sentences * kv * src_len * dk;
    for (int l = 0; l < L; l++) {
        /* masked self-attention over the cached positions and this one */
        rms_norm(x, norms[3 * l], normed, rows, d, eps);
        linear(normed, w_qkv[l], wide, rows, d, width, 0.0f);
        float *keys = cache + 2 * l * self_kv, *values = keys + self_kv;
        for (int r = 0; r < rows; r++) {
            float *row = wide + (long)r * width;
            for (int j = 0; j < h + kv; j++) { /* rotary positions: the queries, then the keys */
                float *a = row + j * dk;
                for (int i = 0; i < half; i++) {
                    float x1 = a[i], x2 = a[i + half];
                    a[i] = x1 * cos[i] - x2 * sin[i];
                    a[i + half] = x1 * sin[i] + x2 * cos[i];
                }
            }
            for (int g = 0; g < kv; g++) {
                long slot = ((long)(r * kv + g) * capacity + position) * dk;
                memcpy(keys + slot, row + d + g * dk, dk * sizeof(float));
                memcpy(values + slot, row + d + (kv + g) * dk, dk * sizeof(float));
            }
            for (int j = 0; j < h; j++) {
                long head = (long)(r * kv + j / group) * capacity * dk;
                attend(row + j * dk, keys + head, values + head, 0, position + 1, dk, scale,
                       scores, heads + (long)r * d + j * dk);
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
                       cv + head * src_len * dk, bias + head * src_len, src_len, dk, scale,
                       scores, heads + (long)r * d + j * dk);
            }
        }
        linear(heads, w_o_cross[l], x, rows, d, d, 1.0f);
        /* SwiGLU feed-forward: silu(gate) * value, then W_2 */
        rms_norm(x, norms[3 * l + 2], normed, rows, d, eps);
        linear(normed, w_13[l], ffn, rows, d, 2 * hidden, 0.0f);
        for (int r = 0; r < rows; r++) {
            const float *gate = ffn + (long)r * 2 * hidden, *value = gate + hidden;
            float *out = wide + (long)r * hidden;
#pragma omp simd
            for (int i = 0; i < hidden; i++)
                out[i] = gate[i] / (1.0f + exp_approx(-gate[i])) * value[i];
        }
        linear(wide, w_2[l], x, rows, hidden, d, 1.0f);
    }
}
