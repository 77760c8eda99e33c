/* Int4 (and Q8_0) linears with int8 activations (--int4-activations int8): llama.cpp's numerics
   for Q4 x Q8, y = x @ W^T with x and y bfloat16.

   Each row of x is quantized per group of 32 as llama.cpp quantizes activations for a Q4_0/Q4_1
   dot product (its Q8_0 / Q8_1 blocks): amax = max |x|, d = amax / 127 stored as float16,
   q = x * (127 / amax) rounded to nearest even (0 where amax is 0), and s = d * sum(q): for a
   Q4_1 weight as llama.cpp's Q8_1 block holds it (amax / 127 times the sum, rounded to float16),
   for a Q4_0 one (m_w = -8 d_w, whose offset llama.cpp applies to the integer sum) the float16 d
   times the sum, unrounded (`sum_half` chooses). A weight group (d_w, m_w) then contributes
       d_w * d * sum(q_w * q) + m_w * s
   to its output: the integer sum in vpdpbusd, or vpmaddubsw on AVX2 (unsigned 4-bit codes
   times signed 8-bit activations), the rest in float32, group after group.

   The weight is repacked for it (engine/cpu_kernels/int4_matmul.pack_int8x) so that the 16 lanes
   of a register are 16 output rows: a group's scales then apply to a whole register at once.
   blocks [ceil(N / 16), K / 32, BLOCK_BYTES] uint8, for each 16 rows (rows past N are zero) and
   group of 32:
     256 bytes of codes: byte 64 c + 4 j + t holds the code of weight 4 c + t of row j in its low
                         nibble and of weight 16 + 4 c + t in its high nibble (c, t 0..3; j 0..15)
      32 bytes: d of rows 0..15, float16
      32 bytes: m of rows 0..15, float16
   0.625 bytes a weight, as int4_linear.c's layout.

   Q8_0 weights (the output head of a Q4 GGUF) go the same way, as llama.cpp multiplies Q8_0 by
   Q8_0: d_w * d * sum(q_w * q), the sum exact. vpdpbusd takes unsigned bytes, so the codes are
   held as q_w + 128 and 128 * sum(q) is taken off the integer sum (the AVX2 build xors them back
   to q_w and sums |q_w| times x with q_w's sign, as llama.cpp does). Per 16 rows and group
   (Q8_BLOCK_BYTES):
     512 bytes of codes: byte 64 c + 4 j + t holds q_w + 128 of weight 4 c + t of row j (c 0..7)
      32 bytes: d of rows 0..15, float16
   1.0625 bytes a weight, as Q8_0's own block.

   Two builds of the same arithmetic, chosen by what -march=native offers: AVX512-VNNI (with
   AVX512-BF16), 16 rows to a register and up to 8 rows of x a block; or AVX2 with FMA and F16C,
   two registers of 8 rows and up to 4 rows of x. Each output is the same float32 operations in
   the same order in both, so their results are equal bit for bit
   (tests/unit/test_int4_int8_activations.py checks each against one reference). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if (defined(__AVX512BF16__) && defined(__AVX512VNNI__)) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

#define GROUP 32       /* weights per (d, m) pair */
#define LANES 16       /* output rows of a block */
#define BLOCK_BYTES 320
#define Q8_BLOCK_BYTES 544
/* How far ahead of the codes a block reads them into L1 (int4_linear.c's PREFETCH_AHEAD). */
#define PREFETCH_AHEAD 8192

/* What quantize_rows keeps of a group's sum(q) for the weight's formula. */
enum { SUM_TIMES_D = 0, SUM_TIMES_D_HALF = 1, SUM_ITSELF = 2 };

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define INT8X_BUILD "avx512-vnni"
#define XMB 8          /* rows of x a block meets at a time */

/* Row m of x as int8 codes xq[m * K + k], with d (dx) and the sum term (sx: s for int4 weights
   as `sums` says, sum(q) itself for Q8_0) per group at [m * K / 32 + g]. */
static void quantize_rows(const uint16_t *x, int64_t M, int64_t K, int sums, int8_t *xq, float *dx, float *sx)
{
    const int64_t groups = K / GROUP;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *xg = x + m * K + g * GROUP;
            const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)xg)), 16));
            const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xg + 16))), 16));
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            const _Float16 d = (_Float16)(amax / 127.f);
            const __m512 id = _mm512_set1_ps(amax != 0.f ? 127.f / amax : 0.f);
            const __m512i qlo = _mm512_cvt_roundps_epi32(_mm512_mul_ps(lo, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512i qhi = _mm512_cvt_roundps_epi32(_mm512_mul_ps(hi, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm_storeu_si128((__m128i *)(xq + m * K + g * GROUP), _mm512_cvtsepi32_epi8(qlo));
            _mm_storeu_si128((__m128i *)(xq + m * K + g * GROUP + 16), _mm512_cvtsepi32_epi8(qhi));
            const float sum = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
            dx[m * groups + g] = (float)d;
            sx[m * groups + g] = sums == SUM_ITSELF ? sum
                                 : sums == SUM_TIMES_D_HALF ? (float)(_Float16)(amax / 127.f * sum) : (float)d * sum;
        }
}

/* One block of 16 output rows (int4 codes, or Q8_0's when bits is 8) against rows 0 .. mb-1 of
   the quantized x: y[i * ldy + j] for the first `valid` rows j. mb and bits are constants in
   each copy below, so the sums stay in registers. */
static inline __attribute__((always_inline)) void block_int8x(
    const uint8_t *block, const int8_t *xq, const float *dx, const float *sx, int64_t K, const int mb,
    const int bits, uint16_t *y, int64_t ldy, int valid)
{
    const int64_t groups = K / GROUP, block_bytes = bits == 4 ? BLOCK_BYTES : Q8_BLOCK_BYTES;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[XMB];
#pragma GCC unroll 8
    for (int i = 0; i < mb; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *b = block + g * block_bytes;
#pragma GCC unroll 9
        for (int line = 0; line < block_bytes; line += 64) _mm_prefetch((const char *)b + PREFETCH_AHEAD + line, _MM_HINT_T0);
        __m512i dot[XMB];
#pragma GCC unroll 8
        for (int i = 0; i < mb; i++) dot[i] = _mm512_setzero_si512();
        if (bits == 8) {
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {
                const __m512i v = _mm512_loadu_si512((const void *)(b + 64 * c));
#pragma GCC unroll 8
                for (int i = 0; i < mb; i++) {
                    int32_t a;
                    memcpy(&a, xq + i * K + g * GROUP + 4 * c, 4);
                    dot[i] = _mm512_dpbusd_epi32(dot[i], v, _mm512_set1_epi32(a));
                }
            }
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 512)));
#pragma GCC unroll 8
            for (int i = 0; i < mb; i++) {  /* sum((q_w + 128) q) - 128 sum(q): exact in float32 */
                const __m512 exact = _mm512_sub_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_set1_ps(128.f * sx[i * groups + g]));
                acc[i] = _mm512_fmadd_ps(exact, _mm512_mul_ps(d, _mm512_set1_ps(dx[i * groups + g])), acc[i]);
            }
            continue;
        }
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512((const void *)(b + 64 * c));
            const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 8
            for (int i = 0; i < mb; i++) {
                const int8_t *xg = xq + i * K + g * GROUP;
                int32_t a, h;
                memcpy(&a, xg + 4 * c, 4);
                memcpy(&h, xg + 16 + 4 * c, 4);
                dot[i] = _mm512_dpbusd_epi32(dot[i], lo, _mm512_set1_epi32(a));
                dot[i] = _mm512_dpbusd_epi32(dot[i], hi, _mm512_set1_epi32(h));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 256)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 288)));
#pragma GCC unroll 8
        for (int i = 0; i < mb; i++) {
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_mul_ps(d, _mm512_set1_ps(dx[i * groups + g])), acc[i]);
            acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[i * groups + g]), acc[i]);
        }
    }
    const __mmask16 keep = valid >= LANES ? 0xffff : (__mmask16)((1u << valid) - 1);
#pragma GCC unroll 8
    for (int i = 0; i < mb; i++)
        _mm256_mask_storeu_epi16(y + i * ldy, keep, (__m256i)_mm512_cvtneps_pbh(acc[i]));
}

typedef void (*block_fn)(const uint8_t *, const int8_t *, const float *, const float *, int64_t, uint16_t *, int64_t, int);
#define BLOCK8(MB, BITS) \
    static void block_##BITS##_##MB(const uint8_t *b, const int8_t *xq, const float *dx, const float *sx, int64_t K, \
                                    uint16_t *y, int64_t ldy, int valid) \
    { block_int8x(b, xq, dx, sx, K, MB, BITS, y, ldy, valid); }
#define BLOCKS_OF(BITS) BLOCK8(1, BITS) BLOCK8(2, BITS) BLOCK8(3, BITS) BLOCK8(4, BITS) \
    BLOCK8(5, BITS) BLOCK8(6, BITS) BLOCK8(7, BITS) BLOCK8(8, BITS)
BLOCKS_OF(4) BLOCKS_OF(8)
/* Indexed by [bits == 8][mb]. */
static const block_fn BLOCKS[2][XMB + 1] = {
    {0, block_4_1, block_4_2, block_4_3, block_4_4, block_4_5, block_4_6, block_4_7, block_4_8},
    {0, block_8_1, block_8_2, block_8_3, block_8_4, block_8_5, block_8_6, block_8_7, block_8_8}};

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define INT8X_BUILD "avx2"
#define XMB 4          /* rows of x a block meets at a time (16 ymm registers) */

/* Row m of x as int8 codes, as the AVX512 quantize_rows: the same values (the same float32
   operations, rounding to nearest even in both), 8 lanes at a time. */
static inline __m256 bf16_to_float8(const uint16_t *h)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h)), 16));
}

static void quantize_rows(const uint16_t *x, int64_t M, int64_t K, int sums, int8_t *xq, float *dx, float *sx)
{
    const int64_t groups = K / GROUP;
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *xg = x + m * K + g * GROUP;
            __m256 v[4];
            for (int k = 0; k < 4; k++) v[k] = bf16_to_float8(xg + 8 * k);
            const __m256 most = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                              _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
            __m128 half = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
            half = _mm_max_ps(half, _mm_movehl_ps(half, half));
            half = _mm_max_ss(half, _mm_movehdup_ps(half));
            const float amax = _mm_cvtss_f32(half);
            const _Float16 d = (_Float16)(amax / 127.f);
            const __m256 id = _mm256_set1_ps(amax != 0.f ? 127.f / amax : 0.f);
            __m256i q[4];
            for (int k = 0; k < 4; k++) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], id)); /* MXCSR: nearest even */
            /* 32 int32 -> 32 int8 in order: the packs interleave 128-bit lanes, the permute undoes it */
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(xq + m * K + g * GROUP), _mm256_permutevar8x32_epi32(bytes, order));
            const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            __m128i s = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
            const float sum = (float)_mm_cvtsi128_si32(s);
            dx[m * groups + g] = (float)d;
            sx[m * groups + g] = sums == SUM_ITSELF ? sum
                                 : sums == SUM_TIMES_D_HALF ? (float)(_Float16)(amax / 127.f * sum) : (float)d * sum;
        }
}

/* 8 float32 lanes rounded to bfloat16 (nearest even; NaN stays NaN), as _mm512_cvtneps_pbh. */
static inline __m128i float8_to_bf16(__m256 f)
{
    const __m256i u = _mm256_castps_si256(f);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i h = _mm256_blendv_epi8(rounded, quiet, nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* sum(u * s) of each 4 bytes, as 8 int32: vpdpbusd without VNNI. Each pair's 16-bit sum must not
   saturate (the callers' bounds say why it cannot). */
static inline __m256i dot4(__m256i u, __m256i s)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* Halves h0 .. h0 + nh - 1 of one block (half h: output rows 8 h .. 8 h + 7, bytes 32 h ..
   32 h + 31 of each 64 of codes) against rows 0 .. mb-1 of the quantized x, as the AVX512
   block_int8x computes those rows: the same integer sums, then the same float32 operations lane
   by lane. Both halves at once share each broadcast of x; from 3 rows of x on their sums and
   accumulators no longer fit the 16 ymm registers, so block_int8x then takes a half at a time
   (at 256 rows of x a third less time than both halves spilled to the stack).
   int4: 4-bit codes times int8 activations in vpmaddubsw, whose pairs (at most 2 * 15 * 127)
   and sums of 8 of them (30480) fit 16 bits, so a group's 8 products per row take one widening.
   Q8_0: the codes are held as q_w + 128; xor 128 gives q_w, and vpmaddubsw takes |q_w| times x
   with q_w's sign (llama.cpp's way): pairs up to 2 * 128 * 127 fit 16 bits, and each is widened. */
static inline __attribute__((always_inline)) void halves_int8x(
    const uint8_t *block, const int8_t *xq, const float *dx, const float *sx, int64_t K, const int mb,
    const int bits, const int h0, const int nh, uint16_t *y, int64_t ldy, int valid)
{
    const int64_t groups = K / GROUP, block_bytes = bits == 4 ? BLOCK_BYTES : Q8_BLOCK_BYTES;
    __m256 acc[XMB][2];
#pragma GCC unroll 4
    for (int i = 0; i < mb; i++)
#pragma GCC unroll 2
        for (int h = 0; h < nh; h++) acc[i][h] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *b = block + g * block_bytes;
#pragma GCC unroll 9
        for (int line = 0; line < block_bytes; line += 64) _mm_prefetch((const char *)b + PREFETCH_AHEAD + line, _MM_HINT_T0);
        const int8_t *xg = xq + g * GROUP;
        __m256i sums[XMB][2];
#pragma GCC unroll 4
        for (int i = 0; i < mb; i++)
#pragma GCC unroll 2
            for (int h = 0; h < nh; h++) sums[i][h] = _mm256_setzero_si256();
        if (bits == 8) {
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {
                __m256i w[2], magnitude[2];
#pragma GCC unroll 2
                for (int h = 0; h < nh; h++) {
                    w[h] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 64 * c + 32 * (h0 + h))),
                                            _mm256_set1_epi8((char)0x80));
                    magnitude[h] = _mm256_sign_epi8(w[h], w[h]);
                }
#pragma GCC unroll 4
                for (int i = 0; i < mb; i++) {
                    int32_t a;
                    memcpy(&a, xg + i * K + 4 * c, 4);
                    const __m256i x = _mm256_set1_epi32(a);
#pragma GCC unroll 2
                    for (int h = 0; h < nh; h++)
                        sums[i][h] = _mm256_add_epi32(sums[i][h], dot4(magnitude[h], _mm256_sign_epi8(x, w[h])));
                }
            }
#pragma GCC unroll 2
            for (int h = 0; h < nh; h++) {
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 512 + 16 * (h0 + h))));
#pragma GCC unroll 4
                for (int i = 0; i < mb; i++)
                    acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i][h]),
                                                _mm256_mul_ps(d, _mm256_set1_ps(dx[i * groups + g])), acc[i][h]);
            }
            continue;
        }
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            __m256i lo[2], hi[2];
#pragma GCC unroll 2
            for (int h = 0; h < nh; h++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 64 * c + 32 * (h0 + h)));
                lo[h] = _mm256_and_si256(v, _mm256_set1_epi8(15));
                hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15));
            }
#pragma GCC unroll 4
            for (int i = 0; i < mb; i++) {
                int32_t a, e;
                memcpy(&a, xg + i * K + 4 * c, 4);
                memcpy(&e, xg + i * K + 16 + 4 * c, 4);
                const __m256i xa = _mm256_set1_epi32(a), xe = _mm256_set1_epi32(e);
#pragma GCC unroll 2
                for (int h = 0; h < nh; h++) {
                    sums[i][h] = _mm256_add_epi16(sums[i][h], _mm256_maddubs_epi16(lo[h], xa));
                    sums[i][h] = _mm256_add_epi16(sums[i][h], _mm256_maddubs_epi16(hi[h], xe));
                }
            }
        }
#pragma GCC unroll 2
        for (int h = 0; h < nh; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 256 + 16 * (h0 + h))));
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 288 + 16 * (h0 + h))));
#pragma GCC unroll 4
            for (int i = 0; i < mb; i++) {
                const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[i][h], _mm256_set1_epi16(1)));
                acc[i][h] = _mm256_fmadd_ps(sum, _mm256_mul_ps(d, _mm256_set1_ps(dx[i * groups + g])), acc[i][h]);
                acc[i][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[i * groups + g]), acc[i][h]);
            }
        }
    }
#pragma GCC unroll 2
    for (int h = 0; h < nh; h++) {
        const int rows = valid - 8 * (h0 + h) >= 8 ? 8 : valid - 8 * (h0 + h);
        if (rows <= 0) break;
#pragma GCC unroll 4
        for (int i = 0; i < mb; i++) {
            uint16_t out[8];
            _mm_storeu_si128((__m128i *)out, float8_to_bf16(acc[i][h]));
            memcpy(y + i * ldy + 8 * (h0 + h), out, (size_t)rows * sizeof(uint16_t));
        }
    }
}

/* One block of 16 output rows: both halves together for 1 or 2 rows of x, else one at a time. */
static inline __attribute__((always_inline)) void block_int8x(
    const uint8_t *block, const int8_t *xq, const float *dx, const float *sx, int64_t K, const int mb,
    const int bits, uint16_t *y, int64_t ldy, int valid)
{
    if (mb <= 2) {
        halves_int8x(block, xq, dx, sx, K, mb, bits, 0, 2, y, ldy, valid);
        return;
    }
    halves_int8x(block, xq, dx, sx, K, mb, bits, 0, 1, y, ldy, valid);
    halves_int8x(block, xq, dx, sx, K, mb, bits, 1, 1, y, ldy, valid);
}

typedef void (*block_fn)(const uint8_t *, const int8_t *, const float *, const float *, int64_t, uint16_t *, int64_t, int);
#define BLOCK8(MB, BITS) \
    static void block_##BITS##_##MB(const uint8_t *b, const int8_t *xq, const float *dx, const float *sx, int64_t K, \
                                    uint16_t *y, int64_t ldy, int valid) \
    { block_int8x(b, xq, dx, sx, K, MB, BITS, y, ldy, valid); }
#define BLOCKS_OF(BITS) BLOCK8(1, BITS) BLOCK8(2, BITS) BLOCK8(3, BITS) BLOCK8(4, BITS)
BLOCKS_OF(4) BLOCKS_OF(8)
/* Indexed by [bits == 8][mb]. */
static const block_fn BLOCKS[2][XMB + 1] = {
    {0, block_4_1, block_4_2, block_4_3, block_4_4},
    {0, block_8_1, block_8_2, block_8_3, block_8_4}};
#endif

#if defined(INT8X_BUILD)
/* The calling thread's quantized x, kept for the thread's life and grown as needed. */
static __thread void *x8_buffer;
static __thread size_t x8_buffer_len;
#endif

#if defined(INT8X_BUILD)
/* Quantize x into this thread's buffer, then each block of 16 output rows on the OpenMP team. */
static int linear_int8x(const uint16_t *x, const uint8_t *blocks, uint16_t *y, int64_t M, int64_t N, int64_t K,
                        int sums, int bits)
{
    if (M <= 0 || N <= 0 || K <= 0 || K % GROUP) return -1;
    const int64_t groups = K / GROUP, nblocks = (N + LANES - 1) / LANES;
    const int64_t block_bytes = bits == 4 ? BLOCK_BYTES : Q8_BLOCK_BYTES;
    const size_t need = (size_t)M * ((size_t)K + 8 * (size_t)groups);
    if (need > x8_buffer_len) {
        void *grown = realloc(x8_buffer, need);
        if (!grown) return -2;
        x8_buffer = grown;
        x8_buffer_len = need;
    }
    float *dx = (float *)x8_buffer, *sx = dx + M * groups;
    int8_t *xq = (int8_t *)(sx + M * groups);
    quantize_rows(x, M, K, sums, xq, dx, sx);
    const block_fn *by_rows = BLOCKS[bits == 8];
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < nblocks; nb++) {
        const uint8_t *block = blocks + nb * groups * block_bytes;
        const int valid = N - nb * LANES < LANES ? (int)(N - nb * LANES) : LANES;
        for (int64_t m0 = 0; m0 < M; m0 += XMB) {
            const int mb = M - m0 < XMB ? (int)(M - m0) : XMB;
            by_rows[mb](block, xq + m0 * K, dx + m0 * groups, sx + m0 * groups, K, y + m0 * N + nb * LANES, N, valid);
        }
    }
    return 0;
}
#endif

/* y[M, N] = x[M, K] @ W^T with W in the int8-activation layout (pack_int8x) and each row of x
   quantized to 8 bits per group of 32 first: llama.cpp's numerics (this file's first comment;
   sum_half: the weight is Q4_1-like, s rounds to float16). Every batch size goes through the
   kernel. Needs AVX512-VNNI and AVX512-BF16, or AVX2 with FMA and F16C (int4_linear_int8x_supported,
   int8x_build). 0 on success, -1 for bad shapes or a build without them, -2 when the quantized x
   could not be allocated. */
int int4_linear_int8x(const uint16_t *x, const uint8_t *blocks, uint16_t *y, int64_t M, int64_t N, int64_t K,
                      int sum_half)
{
#if defined(INT8X_BUILD)
    return linear_int8x(x, blocks, y, M, N, K, sum_half ? SUM_TIMES_D_HALF : SUM_TIMES_D, 4);
#else
    (void)x; (void)blocks; (void)y; (void)M; (void)N; (void)K; (void)sum_half;
    return -1;
#endif
}

/* The same for Q8_0 weights in their int8-activation layout (pack_q8_int8x): llama.cpp's Q8_0 x
   Q8_0 product. */
int q8_linear_int8x(const uint16_t *x, const uint8_t *blocks, uint16_t *y, int64_t M, int64_t N, int64_t K)
{
#if defined(INT8X_BUILD)
    return linear_int8x(x, blocks, y, M, N, K, SUM_ITSELF, 8);
#else
    (void)x; (void)blocks; (void)y; (void)M; (void)N; (void)K;
    return -1;
#endif
}

int int4_linear_int8x_supported(void)
{
#if defined(INT8X_BUILD)
    return 1;
#else
    return 0;
#endif
}

/* Which build this is: "avx512-vnni", "avx2", or "" (none: the CPU lacks the instructions). */
const char *int8x_build(void)
{
#if defined(INT8X_BUILD)
    return INT8X_BUILD;
#else
    return "";
#endif
}
