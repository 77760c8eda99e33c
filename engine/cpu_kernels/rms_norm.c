/* RMSNorm of bfloat16 rows, with the residual add before it fused in: what a decoder layer does
 * between its attention and its MLP, one call instead of about ten torch ops.
 *
 *   add_rms_norm_bf16(x, residual, weight, out, rows, hidden, eps)
 *     residual NULL:  s = x
 *     else:           s = x + residual, rounded to bfloat16 and written back into residual
 *     out = weight * bfloat16(s * 1 / sqrt(mean(s^2) + eps))
 *
 * As engine.model.llama.RMSNorm computes it in bfloat16 (HF's way): the mean of squares and the
 * scaling in float32, the normalized row rounded to bfloat16, then the weight product rounded
 * again. The float32 sum of squares is added in an order of its own (row_sum_of_squares): where
 * its last bit differs from torch's, a normalized value moves by one bfloat16 step, on rare
 * elements (about 1 in 100,000 of SmolLM2's activations; tests/unit/test_cpu_fused_decode.py). */
#include <stdint.h>
#include <string.h>
#include <math.h>

#define LANES 16

static inline float value(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

static inline uint16_t round_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u); /* NaN stays NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(v.u >> 16);
}

/* The float32 sum of the squares of n bfloat16 values (n a multiple of 16): 16 lanes, then the
 * lanes added as a tree. Each square is exact in float32; the order of the additions is this
 * file's own (torch's CPU sum has its own, which this does not reproduce). */
static float row_sum_of_squares(const uint16_t *v, int64_t n) {
    float lanes[LANES] = {0};
    for (int64_t i = 0; i < n; i += LANES)
        for (int l = 0; l < LANES; l++) {
            const float x = value(v[i + l]);
            lanes[l] += x * x;
        }
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    return lanes[0];
}

/* 0, or -1 for a bad shape (hidden not a positive multiple of 16). */
int add_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight, uint16_t *out, int64_t rows,
                      int64_t hidden, float eps) {
    if (rows < 0 || hidden <= 0 || hidden % LANES) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * hidden;
        uint16_t *res = residual ? residual + r * hidden : NULL;
        if (res)
            for (int64_t i = 0; i < hidden; i++) res[i] = round_bf16(value(xr[i]) + value(res[i]));
        const uint16_t *s = res ? res : xr;
        const float inv = 1.0f / sqrtf(row_sum_of_squares(s, hidden) / (float)hidden + eps);
        uint16_t *o = out + r * hidden;
        for (int64_t i = 0; i < hidden; i++)
            o[i] = round_bf16(value(weight[i]) * value(round_bf16(value(s[i]) * inv)));
    }
    return 0;
}
