/* Block-quantized linears on the CPU: y = x @ W^T with W kept as 4-bit (or 8-bit) codes, x and y
 * in bfloat16.
 *
 * The int4 layout is GGUF's Q4_1 block, split into two arrays:
 *   codes [N, K/2] uint8   per group g of 32 weights of a row, 16 bytes: byte j holds the code of
 *                          weight g*32 + j in its low nibble and of weight g*32 + 16 + j in its high
 *   dm    [N, K/32, 2]     float16 (d, m) per group:  w = q * d + m,  q in 0..15
 * (Q4_0's w = (q - 8) * d is d and m = -8 d; engine/cpu_kernels/int4_matmul.py packs both.)
 *
 * int4_linear_bf16: the small batches of decode (a few rows of x). Each group's 32 weights are
 * dequantized once per call (q * d + m in float32, rounded to bfloat16: the same weights the
 * dense bfloat16 path holds; the group's 16 possible values are computed and looked up by code)
 * and meet each row of x in one vdpbf16ps, 32 products summed in float32. Up to 8 rows of x share a dequantized group; 4 output rows (2 from 5 rows of x on)
 * are computed together. Output rows are split across the calling thread's OpenMP team, the
 * one torch runs its own ops on (the library links the libgomp torch has loaded).
 *
 * int4_dequantize_bf16: the whole weight in bfloat16 (those same values), for large batches,
 * where a dense matmul on it beats recomputing each group per 8 rows.
 *
 * q8_linear_bf16: the same for GGUF's Q8_0 block (SmolLM2's output projection), split likewise:
 *   codes [N, K]      int8
 *   d     [N, K/32]   float16:  w = q * d
 * each weight q * d in float32 (exact: 8 bits times 11), rounded to bfloat16, as the dense path
 * holds the dequantized tensor. It reads 1.06 bytes a weight against bfloat16's 2.
 *
 * Both need AVX512-BF16 (int4_linear_supported says whether this build has it); elsewhere the
 * callers keep torch's int4 kernel. The same weights with int8 activations (llama.cpp's
 * numerics, also on AVX2) are int8x_linear.c's.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define GROUP 32   /* weights per (d, m) pair */
#define MAX_MB 8   /* rows of x sharing one dequantized group */
#define CHUNK 16   /* output rows a thread takes at a time */

int int4_linear_supported(void)
{
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__)

static inline uint16_t bf16_round(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fff + ((u >> 16) & 1); /* round to nearest even, as torch's .to(bfloat16) */
    return (uint16_t)(u >> 16);
}

/* The 32 weights of one group of one row, dequantized and rounded to bfloat16 in order: the
   group's 16 possible values q * d + m (q = 0..15) are computed once and looked up by code. */
static inline __m512bh group_weights_f(const uint8_t *codes, float d, float m)
{
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i values = _mm512_castsi256_si512(
        (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(q, _mm512_set1_ps(d), _mm512_set1_ps(m))));
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)codes));
    const __m512i index = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_and_si256(bytes, _mm256_set1_epi16(15))), _mm256_srli_epi16(bytes, 4), 1);
    return (__m512bh)_mm512_permutexvar_epi16(index, values); /* 0..15: low nibbles, 16..31: high */
}

/* The same with the group's (d, m) read as float16 from the weight. */
static inline __m512bh group_weights(const uint8_t *codes, const uint16_t *dm)
{
    _Float16 dh, mh;
    memcpy(&dh, dm, 2);
    memcpy(&mh, dm + 1, 2);
    return group_weights_f(codes, (float)dh, (float)mh);
}

/* The 32 weights of one Q8_0 group, q * d rounded to bfloat16 in order. */
static inline __m512bh group_weights_q8(const int8_t *codes, float d)
{
    const __m512 scale = _mm512_set1_ps(d);
    const __m512i q_lo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)codes));
    const __m512i q_hi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16)));
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(q_lo), scale);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(q_hi), scale);
    return _mm512_cvtne2ps_pbh(hi, lo); /* weights 0..15 in the low half */
}

/* The same with d read as float16. */
static inline __m512bh group_weights_q8_h(const int8_t *codes, const uint16_t *d)
{
    _Float16 dh;
    memcpy(&dh, d, 2);
    return group_weights_q8(codes, (float)dh);
}

/* How far ahead of the codes it reads a tile asks for them: into L1 at PREFETCH_AHEAD bytes, into L2
   at four times that. The weights are read once a token, straight from memory; without it a call
   on 1 thread streamed them at 4-7 GB/s (SmolLM2's 49152 x 576 Q8_0 head: 6.4 ms; with it 2.9). */
#define PREFETCH_AHEAD 8192

/* Where a tile's weights come from. */
enum { FROM_INT4 = 0, FROM_DENSE = 1, FROM_Q8 = 2 };

/* Most groups per row whose (d, m) a tile converts to float32 up front (rows of up to 32768
   weights); wider rows convert each pair as it is used. */
#define TILE_GROUPS 1024

/* n float16 values as float32 (exact), 16 at a time. */
static inline void halves_to_floats(const uint16_t *h, float *f, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(f + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
    for (; i < n; i++) {
        _Float16 x;
        memcpy(&x, h + i, 2);
        f[i] = (float)x;
    }
}

/* Output rows n .. n+R-1 for rows 0 .. mb-1 of x: y[i * ldy + r]. The weights come from `codes`
   and `scales` (int4: (d, m) pairs; Q8_0: d) or, already dequantized, from `dense` (rows of K
   bfloat16), as `from` says. R, mb and from are constants in each copy below, so the
   accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(
    const uint8_t *codes, const uint16_t *scales, const uint16_t *dense, const uint16_t *x, int64_t K, const int R,
    const int mb, const int from, uint16_t *y, int64_t ldy)
{
    __m512 acc[4][MAX_MB];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int i = 0; i < mb; i++) acc[r][i] = _mm512_setzero_ps();
    const int64_t groups = K / GROUP;
    const int64_t row_bytes = from == FROM_Q8 ? K : K / 2, row_scales = from == FROM_Q8 ? groups : groups * 2;
    /* Each group's scales as float32, converted 16 at a time before the loop: converted one by
       one inside it they were about half the instructions of expanding a group at 1 row of x. */
    float sf[4][2 * TILE_GROUPS];
    const int converted = from != FROM_DENSE && groups <= TILE_GROUPS;
    if (converted)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) halves_to_floats(scales + r * row_scales, sf[r], row_scales);
    for (int64_t g = 0; g < groups; g++) {
        __m512bh w[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const uint8_t *c = codes + r * row_bytes;
            const uint16_t *sc = scales + r * row_scales;
            if (from != FROM_DENSE) {
                _mm_prefetch((const char *)c + g * (row_bytes / groups) + PREFETCH_AHEAD, _MM_HINT_T0);
                _mm_prefetch((const char *)c + g * (row_bytes / groups) + 4 * PREFETCH_AHEAD, _MM_HINT_T1);
            }
            if (from == FROM_DENSE)
                w[r] = (__m512bh)_mm512_loadu_si512((const void *)(dense + r * K + g * GROUP));
            else if (from == FROM_Q8)
                w[r] = converted ? group_weights_q8((const int8_t *)c + g * GROUP, sf[r][g])
                                 : group_weights_q8_h((const int8_t *)c + g * GROUP, sc + g);
            else
                w[r] = converted ? group_weights_f(c + g * 16, sf[r][2 * g], sf[r][2 * g + 1])
                                 : group_weights(c + g * 16, sc + g * 2);
        }
        const uint16_t *xg = x + g * GROUP;
#pragma GCC unroll 8
        for (int i = 0; i < mb; i++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xg + i * K));
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], w[r], xv);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < mb; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) y[i * ldy + r] = bf16_round(_mm512_reduce_add_ps(acc[r][i]));
}

typedef void (*tile_fn)(const uint8_t *, const uint16_t *, const uint16_t *, const uint16_t *, int64_t, uint16_t *,
                        int64_t);
#define TILE(R, MB, FROM) \
    static void tile_##R##_##MB##_##FROM(const uint8_t *c, const uint16_t *s, const uint16_t *w, const uint16_t *x, \
                                         int64_t K, uint16_t *y, int64_t ldy) \
    { tile(c, s, w, x, K, R, MB, FROM, y, ldy); }
#define TILES(FROM) \
    TILE(4, 1, FROM) TILE(4, 2, FROM) TILE(4, 3, FROM) TILE(4, 4, FROM) \
    TILE(2, 5, FROM) TILE(2, 6, FROM) TILE(2, 7, FROM) TILE(2, 8, FROM) \
    TILE(1, 1, FROM) TILE(1, 2, FROM) TILE(1, 3, FROM) TILE(1, 4, FROM) \
    TILE(1, 5, FROM) TILE(1, 6, FROM) TILE(1, 7, FROM) TILE(1, 8, FROM)
TILES(0) TILES(1) TILES(2)
#define ROW(R, FROM) {0, tile_##R##_1_##FROM, tile_##R##_2_##FROM, tile_##R##_3_##FROM, tile_##R##_4_##FROM, \
                      tile_##R##_5_##FROM, tile_##R##_6_##FROM, tile_##R##_7_##FROM, tile_##R##_8_##FROM}
/* Indexed by [from][mb]: the widest tile (at most 16 accumulators of 32 registers), and one
   row for the tail. */
static const tile_fn WIDE[3][MAX_MB + 1] = {
    {0, tile_4_1_0, tile_4_2_0, tile_4_3_0, tile_4_4_0, tile_2_5_0, tile_2_6_0, tile_2_7_0, tile_2_8_0},
    {0, tile_4_1_1, tile_4_2_1, tile_4_3_1, tile_4_4_1, tile_2_5_1, tile_2_6_1, tile_2_7_1, tile_2_8_1},
    {0, tile_4_1_2, tile_4_2_2, tile_4_3_2, tile_4_4_2, tile_2_5_2, tile_2_6_2, tile_2_7_2, tile_2_8_2}};
static const int WIDE_ROWS[MAX_MB + 1] = {0, 4, 4, 4, 4, 2, 2, 2, 2};
static const tile_fn ONE[3][MAX_MB + 1] = {ROW(1, 0), ROW(1, 1), ROW(1, 2)};

/* Rows n0 .. n1-1 of the weight in bfloat16, as the kernel uses them (int4 codes, or Q8_0's when
   `q8`), into out[(n - n0) * K]. */
static void expand_rows(const uint8_t *codes, const uint16_t *scales, int q8, int64_t K, int64_t n0, int64_t n1,
                        uint16_t *out)
{
    const int64_t groups = K / GROUP;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t g = 0; g < groups; g++) {
            const __m512bh w = q8 ? group_weights_q8_h((const int8_t *)codes + n * K + g * GROUP,
                                                       scales + n * groups + g)
                                  : group_weights(codes + n * (K / 2) + g * 16, scales + (n * groups + g) * 2);
            _mm512_storeu_si512((void *)(out + (n - n0) * K + g * GROUP), (__m512i)w);
        }
}

/* This thread's buffer for CHUNK dequantized rows (kept for the thread's life, grown as needed). */
static __thread uint16_t *chunk_buffer;
static __thread size_t chunk_buffer_len;

static uint16_t *rows_buffer(size_t len)
{
    if (len > chunk_buffer_len) {
        void *grown = realloc(chunk_buffer, len * sizeof(uint16_t));
        if (!grown) return NULL;
        chunk_buffer = grown;
        chunk_buffer_len = len;
    }
    return chunk_buffer;
}

/* Output rows n0 .. n1-1 for every row of x. With more than MAX_MB rows of x the chunk's weights are
   dequantized once into this thread's buffer and every 8 rows of x read them from there (L1/L2);
   with fewer, each group is dequantized in registers as it is used. 0, or -1 if no memory. */
static int output_rows(const uint8_t *codes, const uint16_t *scales, int q8, const uint16_t *x, int64_t M,
                       int64_t N, int64_t K, int64_t n0, int64_t n1, uint16_t *y)
{
    const int64_t row_bytes = q8 ? K : K / 2, row_scales = q8 ? K / GROUP : K / GROUP * 2;
    const uint16_t *dense = NULL;
    if (M > MAX_MB) {
        uint16_t *buffer = rows_buffer((size_t)((n1 - n0) * K));
        if (!buffer) return -1;
        expand_rows(codes, scales, q8, K, n0, n1, buffer);
        dense = buffer;
    }
    const int from = dense ? FROM_DENSE : q8 ? FROM_Q8 : FROM_INT4;
    for (int64_t m0 = 0; m0 < M; m0 += MAX_MB) {
        const int mb = M - m0 < MAX_MB ? (int)(M - m0) : MAX_MB;
        const int R = WIDE_ROWS[mb];
        int64_t n = n0;
        for (; n + R <= n1; n += R)
            WIDE[from][mb](codes + n * row_bytes, scales + n * row_scales, dense + (dense ? (n - n0) * K : 0),
                           x + m0 * K, K, y + m0 * N + n, N);
        for (; n < n1; n++)
            ONE[from][mb](codes + n * row_bytes, scales + n * row_scales, dense + (dense ? (n - n0) * K : 0),
                          x + m0 * K, K, y + m0 * N + n, N);
    }
    return 0;
}

/* Output rows in chunks of CHUNK across the calling thread's OpenMP team. */
static int linear(const uint16_t *x, const uint8_t *codes, const uint16_t *scales, int q8, uint16_t *y, int64_t M,
                  int64_t N, int64_t K)
{
    const int64_t chunks = (N + CHUNK - 1) / CHUNK;
    int failed = 0;
#pragma omp parallel for schedule(static) reduction(| : failed)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * CHUNK, n1 = n0 + CHUNK < N ? n0 + CHUNK : N;
        failed |= output_rows(codes, scales, q8, x, M, N, K, n0, n1, y);
    }
    return failed ? -2 : 0;
}


#endif /* __AVX512BF16__ */

/* y[M, N] = x[M, K] @ W^T, all contiguous, x and y bfloat16, W as int4 codes and (d, m) pairs.
   0 on success, -1 for bad shapes or a build without AVX512-BF16, -2 when a thread's row buffer
   could not be allocated. */
int int4_linear_bf16(const uint16_t *x, const uint8_t *codes, const uint16_t *dm, uint16_t *y,
                     int64_t M, int64_t N, int64_t K)
{
#if defined(__AVX512BF16__)
    if (M <= 0 || N <= 0 || K <= 0 || K % GROUP) return -1;
    return linear(x, codes, dm, 0, y, M, N, K);
#else
    (void)x; (void)codes; (void)dm; (void)y; (void)M; (void)N; (void)K;
    return -1;
#endif
}

/* The same with W as Q8_0 codes (int8) and one float16 d per group of 32. */
int q8_linear_bf16(const uint16_t *x, const int8_t *codes, const uint16_t *d, uint16_t *y,
                   int64_t M, int64_t N, int64_t K)
{
#if defined(__AVX512BF16__)
    if (M <= 0 || N <= 0 || K <= 0 || K % GROUP) return -1;
    return linear(x, (const uint8_t *)codes, d, 1, y, M, N, K);
#else
    (void)x; (void)codes; (void)d; (void)y; (void)M; (void)N; (void)K;
    return -1;
#endif
}

/* w[N, K] bfloat16: every weight as int4_linear_bf16 uses it. */
int int4_dequantize_bf16(const uint8_t *codes, const uint16_t *dm, uint16_t *w, int64_t N, int64_t K)
{
#if defined(__AVX512BF16__)
    if (N <= 0 || K <= 0 || K % GROUP) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) expand_rows(codes, dm, 0, K, n, n + 1, w + n * K);
    return 0;
#else
    (void)codes; (void)dm; (void)w; (void)N; (void)K;
    return -1;
#endif
}
