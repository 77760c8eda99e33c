/* Paged decode attention on the CPU: one query token per sequence, read straight from the
 * block-paged KV cache (no gather copy), scores and sums in float32.
 *
 * Layouts (all contiguous, row-major):
 *   q, out        [num_seqs, num_kv_heads * group, head_dim]    (query head = kv head * group + g)
 *   cache         [2, num_blocks, block_size, num_kv_heads, head_dim]   (K then V)
 *   block_tables  int64 [num_seqs, max_blocks]
 *   context_lens  int64 [num_seqs]   (tokens each query attends to, <= max_blocks * block_size)
 *
 * For each sequence, block by block, the `group` query heads that share a kv head are done
 * together, so each K and V row is read once: pass 1 turns every K row into `group` scores,
 * softmax_rows turns the scores into weights e^(s - max), pass 2 adds every V row times its
 * weights, and the sums are divided by the weights' total at the end.
 *
 * Rows are vectors of LANES floats (GCC vector extensions): 16 where -march=native offers
 * AVX-512, else 8, one AVX2 register (16-float vectors on AVX2 were split through memory and
 * general registers: 118 us a layer at a 130-token context on the 2-core EPYC without AVX-512,
 * 1.39 ms at 2048). The lanes split a head's dot products, so the last bits of a sum depend on
 * LANES. head_dim must be a multiple of 16 up to 256 (64 and 128 get their own unrolled copies),
 * group at most MAX_GROUP and the query heads at most MAX_HEADS; the caller checks that, the
 * shapes and the block ids (paged_attention.py), and the kernel trusts them. Returns 0, or -1
 * when its buffers cannot be allocated. A sequence with context 0 gets zeros.
 *
 * Built by loader.py with the host's C compiler, without -ffast-math or -fassociative-math: the
 * first flushes denormals for the whole process, the second may fold vexp's rounding trick.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MAX_GROUP 16
#define MAX_HEADS 1024 /* query heads per sequence */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
#define MAX_CHUNKS (256 / LANES) /* head_dim 256 */

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint32_t vu32 __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t vu16 __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vf4 __attribute__((vector_size(4 * sizeof(float))));

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE vf splat(float x) { return (vf){0} + x; }

ALWAYS_INLINE vf as_vf(vi x) {
    vf v;
    memcpy(&v, &x, sizeof v);
    return v;
}

ALWAYS_INLINE vf load_f32(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* A bfloat16 is the top half of a float32: widen each to 32 bits and shift it up. GCC 12 builds
 * __builtin_convertvector(vu16 -> vu32) from two 128-bit widenings, a shuffle and an insert (6
 * instructions where one widening load and a shift do), so x86 gets the intrinsic. */
ALWAYS_INLINE vf load_bf16(const uint16_t *p) {
#if LANES == 16 && defined(__AVX512F__)
    const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif LANES == 8 && defined(__AVX2__)
    const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    vu16 h;
    memcpy(&h, p, sizeof h);
    const vu32 w = __builtin_convertvector(h, vu32) << 16;
#endif
    vf v;
    memcpy(&v, &w, sizeof v);
    return v;
}

/* Sum of the lanes as a tree (halves added), not a chain of dependent adds. */
ALWAYS_INLINE float hsum(vf v) {
#if LANES == 16
    vf8 lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    lo += hi;
#else
    vf8 lo = v;
#endif
    vf4 a, b;
    memcpy(&a, &lo, sizeof a);
    memcpy(&b, (const char *)&lo + sizeof a, sizeof b);
    a += b;
    return (a[0] + a[2]) + (a[1] + a[3]);
}

/* e^x for x <= 0 (scores minus their maximum); below -87.3 (where e^x leaves float32's normal
 * range) it gives 0. x = n ln2 + r with |r| <= ln2/2, e^r by Cephes' expf polynomial (about
 * 1 ulp, as the vectorized exp of torch's own CPU attention), times 2^n built in the exponent. */
ALWAYS_INLINE vf vexp(vf x) {
    const vi under = x < splat(-87.3f);
    x = as_vf((vi)x & ~under) + as_vf((vi)splat(-87.3f) & under); /* no NaN/inf from clamped lanes */
    const vf n = (x * splat(1.44269504088896341f) + splat(12582912.0f)) - splat(12582912.0f);
    vf r = x - n * splat(0.693359375f);
    r = r - n * splat(-2.12194440e-4f);
    vf p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * (r * r) + r + splat(1.0f);
    const vi scale = (__builtin_convertvector(n, vi) + 127) << 23;
    return as_vf((vi)(p * as_vf(scale)) & ~under);
}

/* The float32 values of x rounded to bfloat16's precision (nearest, ties to even). */
ALWAYS_INLINE vf round_to_bf16(vf x) {
    vu32 u;
    memcpy(&u, &x, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* The largest of s[0..n) (n >= 1), LANES at a time; a NaN score is passed over unless s[0] is one,
 * as a scalar loop of s[t] > max would. */
ALWAYS_INLINE float row_max(const float *s, int64_t n) {
    float max = s[0];
    int64_t t = 1;
    if (n > LANES) {
        vf m = splat(s[0]);
        for (; t + LANES <= n; t += LANES) {
            const vf x = load_f32(s + t);
            const vi more = x > m;
            m = as_vf(((vi)x & more) | ((vi)m & ~more));
        }
        for (int64_t i = 0; i < LANES; i++) max = m[i] > max ? m[i] : max;
    }
    for (; t < n; t++) max = s[t] > max ? s[t] : max;
    return max;
}

/* Each row of scores (rows of `context`, padded to whole vectors) becomes e^(s - max) and
 * inv_sums[row] 1 / the row's sum, so pass 2 sums unnormalized weights and scales once at the
 * end. With round_weights (the bfloat16 kernel) the weights pass 2 uses are rounded to
 * bfloat16, as torch's CPU SDPA (and so HF's bfloat16 attention) rounds them before its
 * weights x V product; the sum stays the float32 one, as there. */
static void softmax_rows(float *scores, int64_t rows, int64_t context, int64_t padded, int round_weights,
                         float *inv_sums) {
    for (int64_t r = 0; r < rows; r++) {
        float *s = scores + r * padded;
        float max = row_max(s, context);
        for (int64_t t = context; t < padded; t++) s[t] = max - 100.0f; /* e^-100: 0 */
        vf sum = {0};
        for (int64_t t = 0; t < padded; t += LANES) {
            vf e = vexp(load_f32(s + t) - splat(max));
            sum += e;
            if (round_weights) e = round_to_bf16(e);
            memcpy(s + t, &e, sizeof e);
        }
        inv_sums[r] = 1.0f / hsum(sum);
    }
}

#define PREFETCH_BLOCKS 1 /* blocks ahead whose rows are asked for */

/* Asks for the cache lines of one block's rows (K or V) ahead of their use: blocks lie anywhere
 * in the cache, so the hardware prefetcher cannot guess the next one. Measured on the 2-core
 * EPYC, a 2k-token context read from memory (30 layers' caches called in turn): 245 us per
 * layer with the next block asked for into L2 (locality 1), 370 into L1 (locality 3), 360 with
 * no prefetch; 2, 4 or 8 blocks ahead were no better than 1, and asking for the first block
 * before the loop made it slower (measured, not explained). */
ALWAYS_INLINE void prefetch_lines(const void *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off, 0, 1);
}

/* Asks for the h-th of num_kv_heads equal parts of the block PREFETCH_BLOCKS after block b on
 * one side (K or V), if there is one: each kv head's turn in a block asks for its share of the
 * next block, rather than the whole next block at once when the block starts. A whole block
 * (96 lines for SmolLM2) asked for at once was slower, measured on the 2-core EPYC with the
 * pass 1 and pass 2 of this file, a 2k-token context from memory (30 layers' caches called in
 * turn, us per layer): blocks drawn at random 361-381 at once, 241-250 spread; blocks in
 * ascending order 219-232 against 150-157; descending 288-299 against 226-278. */
ALWAYS_INLINE void prefetch_share(const void *side, const int64_t *table, int64_t b, int64_t num_blocks,
                                  int64_t block_bytes, int64_t h, int64_t num_kv_heads) {
    if (b + PREFETCH_BLOCKS >= num_blocks) return;
    const int64_t share = block_bytes / num_kv_heads; /* a block's bytes split by kv head */
    prefetch_lines((const char *)side + table[b + PREFETCH_BLOCKS] * block_bytes + h * share, share);
}

/* Rows of the block starting at token `start` that a context of `context` tokens uses. */
ALWAYS_INLINE int64_t rows_used(int64_t context, int64_t start, int64_t block_size) {
    return context - start < block_size ? context - start : block_size;
}

/* How many sums run side by side. An AVX2 core has 16 vector registers: pass 1 keeps
 * G x rows_at_once(G) dot products in them (G query heads against that many K rows), pass 2
 * G x chunks_at_once(G, CH) accumulators, each beside the one or two vectors it reads. One row
 * at a time ran only G chains of CH dependent FMAs, and keeping all G x CH accumulators (24 for
 * SmolLM2) spilled them to the stack on every row. */
#define IN_FLIGHT 12
#define MAX_ROWS_AT_ONCE 8

ALWAYS_INLINE int64_t rows_at_once(int64_t G) {
    return IN_FLIGHT / G < 1 ? 1 : IN_FLIGHT / G > MAX_ROWS_AT_ONCE ? MAX_ROWS_AT_ONCE : IN_FLIGHT / G;
}

/* The largest divisor of CH that is at most IN_FLIGHT / G (at least 1). */
ALWAYS_INLINE int64_t chunks_at_once(int64_t G, int64_t CH) {
    int64_t cc = IN_FLIGHT / G < 1 ? 1 : IN_FLIGHT / G;
    while (CH % cc) cc--;
    return cc;
}

#define UNROLL _Pragma("GCC unroll 16")

/* Pass 1 for R rows of one kv head (kh: the first row's head, rows row_stride apart): the
 * scores of its G query heads (qh[g * CH + c]) against each row, times scale, into sh[g * padded
 * + j]. Each dot product sums its chunks in order and then hsum, as one row at a time would. */
#define DEFINE_K_ROWS(SUFFIX, T, LOAD)                                                            \
ALWAYS_INLINE void k_rows_##SUFFIX(const vf *qh, const T *kh, int64_t row_stride, const int64_t G, \
                                   const int64_t CH, const int64_t R, float scale, float *sh,     \
                                   int64_t padded) {                                              \
    vf dot[MAX_GROUP * MAX_ROWS_AT_ONCE];                                                         \
    UNROLL for (int64_t j = 0; j < R; j++) {                                                      \
        const vf row = LOAD(kh + j * row_stride);                                                 \
        UNROLL for (int64_t g = 0; g < G; g++) dot[g * R + j] = qh[g * CH] * row;                 \
    }                                                                                             \
    UNROLL for (int64_t c = 1; c < CH; c++)                                                       \
        UNROLL for (int64_t j = 0; j < R; j++) {                                                  \
            const vf row = LOAD(kh + j * row_stride + c * LANES);                                 \
            UNROLL for (int64_t g = 0; g < G; g++) dot[g * R + j] += qh[g * CH + c] * row;        \
        }                                                                                         \
    UNROLL for (int64_t g = 0; g < G; g++)                                                        \
        UNROLL for (int64_t j = 0; j < R; j++) sh[g * padded + j] = hsum(dot[g * R + j]) * scale; \
}

/* Pass 2 for the n rows of one kv head in a block (vh: the first row's head): adds each row
 * times its G weights (sh[g * padded + o]) to the head's accumulators ah[g * CH + c], CC chunks
 * at a time so that G x CC accumulators stay in registers while the rows stream by (the second
 * and later groups read the rows from L1). Each accumulator adds the rows in order. */
#define DEFINE_V_ROWS(SUFFIX, T, LOAD)                                                            \
ALWAYS_INLINE void v_rows_##SUFFIX(vf *ah, const T *vh, int64_t n, int64_t row_stride,          \
                                   const float *sh, int64_t padded, const int64_t G,              \
                                   const int64_t CH, const int64_t CC) {                          \
    for (int64_t c0 = 0; c0 < CH; c0 += CC) {                                                     \
        vf a[MAX_GROUP * MAX_CHUNKS];                                                             \
        UNROLL for (int64_t g = 0; g < G; g++)                                                    \
            UNROLL for (int64_t c = 0; c < CC; c++) a[g * CC + c] = ah[g * CH + c0 + c];          \
        for (int64_t o = 0; o < n; o++) {                                                         \
            vf w[MAX_GROUP];                                                                      \
            UNROLL for (int64_t g = 0; g < G; g++) w[g] = splat(sh[g * padded + o]);              \
            UNROLL for (int64_t c = 0; c < CC; c++) {                                             \
                const vf row = LOAD(vh + o * row_stride + (c0 + c) * LANES);                      \
                UNROLL for (int64_t g = 0; g < G; g++) a[g * CC + c] += w[g] * row;               \
            }                                                                                     \
        }                                                                                         \
        UNROLL for (int64_t g = 0; g < G; g++)                                                    \
            UNROLL for (int64_t c = 0; c < CC; c++) ah[g * CH + c0 + c] = a[g * CC + c];          \
    }                                                                                             \
}

/* One sequence, every kv head, CH vectors per row and G query heads per kv head. q rows as
 * vectors: qv[head * CH + c]; scores: one row of `padded` floats per query head. Writes
 * acc[head * CH + c]. Blocks are the outer loop, so each block's rows (all heads) are read from
 * memory once per pass and contiguously. The sums are those of one row and one chunk at a time
 * (k_rows_ and v_rows_ keep each one's order), whatever R and CC are. */
#define DEFINE_SEQ(SUFFIX, T, LOAD, ROUND_WEIGHTS)                                                \
DEFINE_K_ROWS(SUFFIX, T, LOAD)                                                                    \
DEFINE_V_ROWS(SUFFIX, T, LOAD)                                                                    \
ALWAYS_INLINE void seq_##SUFFIX(const vf *qv, const T *k_cache, const T *v_cache,                \
                                const int64_t *table, int64_t context, int64_t block_size,        \
                                int64_t num_kv_heads, const int64_t G, const int64_t CH,          \
                                float scale, float *scores, int64_t padded, vf *acc) {            \
    float inv_sums[MAX_HEADS];                                                                    \
    const int64_t head_dim = CH * LANES, row_stride = num_kv_heads * head_dim;                    \
    const int64_t block_elems = block_size * row_stride, block_bytes = block_elems * (int64_t)sizeof(T); \
    const int64_t num_blocks = (context + block_size - 1) / block_size;                           \
    const int64_t R = rows_at_once(G), CC = chunks_at_once(G, CH);                                \
    for (int64_t b = 0; b < num_blocks; b++) {                                                    \
        const int64_t start = b * block_size, n = rows_used(context, start, block_size);          \
        const T *rows = k_cache + table[b] * block_elems;                                         \
        for (int64_t h = 0; h < num_kv_heads; h++) {                                              \
            prefetch_share(k_cache, table, b, num_blocks, block_bytes, h, num_kv_heads);          \
            const vf *qh = qv + h * G * CH;                                                       \
            const T *kh = rows + h * head_dim;                                                    \
            float *sh = scores + h * G * padded + start;                                          \
            int64_t o = 0;                                                                        \
            for (; o + R <= n; o += R)                                                            \
                k_rows_##SUFFIX(qh, kh + o * row_stride, row_stride, G, CH, R, scale, sh + o, padded); \
            for (; o < n; o++)                                                                    \
                k_rows_##SUFFIX(qh, kh + o * row_stride, row_stride, G, CH, 1, scale, sh + o, padded); \
        }                                                                                         \
    }                                                                                             \
    softmax_rows(scores, num_kv_heads * G, context, padded, ROUND_WEIGHTS, inv_sums);             \
    for (int64_t i = 0; i < num_kv_heads * G * CH; i++) acc[i] = (vf){0};                        \
    for (int64_t b = 0; b < num_blocks; b++) {                                                    \
        const int64_t start = b * block_size, n = rows_used(context, start, block_size);          \
        const T *rows = v_cache + table[b] * block_elems;                                         \
        for (int64_t h = 0; h < num_kv_heads; h++) {                                              \
            prefetch_share(v_cache, table, b, num_blocks, block_bytes, h, num_kv_heads);          \
            v_rows_##SUFFIX(acc + h * G * CH, rows + h * head_dim, n, row_stride,                 \
                            scores + h * G * padded + start, padded, G, CH, CC);                  \
        }                                                                                         \
    }                                                                                             \
    for (int64_t r = 0; r < num_kv_heads * G; r++)                                                \
        for (int64_t c = 0; c < CH; c++) acc[r * CH + c] *= splat(inv_sums[r]);                   \
}

ALWAYS_INLINE void store_f32(float *dst, const vf *src, int64_t n) { memcpy(dst, src, (size_t)n * sizeof(float)); }

ALWAYS_INLINE uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u); /* NaN stays NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(v.u >> 16);
}

ALWAYS_INLINE float bf16_value(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

ALWAYS_INLINE void store_bf16(uint16_t *dst, const vf *src, int64_t n) {
    const float *f = (const float *)src;
    for (int64_t d = 0; d < n; d++) dst[d] = f32_to_bf16(f[d]);
}

#define CH64 (64 / LANES)   /* vectors of a 64-wide head */
#define CH128 (128 / LANES)

/* A copy of seq_ with head_dim / LANES and the group size fixed, so its loops unroll and its
 * vectors stay in registers: the shapes of common models (SmolLM2: 64 and 3, Llama 3 8B: 128
 * and 4, Llama 3 70B: 128 and 8). */
#define SEQ_CASE(SUFFIX, CH, G)                                                                   \
    case CH * 100 + G:                                                                            \
        seq_##SUFFIX(qv, cache, v_cache, table, context, block_size, num_kv_heads, G, CH, scale,  \
                     scores, pad, acc);                                                           \
        break;

#define DEFINE_KERNEL(SUFFIX, T, LOAD, STORE, ROUND_WEIGHTS)                                      \
DEFINE_SEQ(SUFFIX, T, LOAD, ROUND_WEIGHTS)                                                        \
int paged_decode_##SUFFIX(const T *q, const T *cache, T *out, const int64_t *block_tables,       \
                          const int64_t *context_lens, int64_t num_seqs, int64_t max_blocks,      \
                          int64_t num_blocks, int64_t block_size, int64_t num_kv_heads,           \
                          int64_t group, int64_t head_dim, float scale) {                         \
    int64_t max_context = 1;                                                                      \
    for (int64_t s = 0; s < num_seqs; s++)                                                        \
        if (context_lens[s] > max_context) max_context = context_lens[s];                         \
    const int64_t num_heads = num_kv_heads * group;                                              \
    const int64_t padded = (max_context + LANES - 1) / LANES * LANES;                             \
    float *scores = aligned_alloc(64, (size_t)(num_heads * padded) * sizeof(float));             \
    vf *qv = aligned_alloc(64, (size_t)(num_heads * head_dim) * sizeof(float));                  \
    vf *acc = aligned_alloc(64, (size_t)(num_heads * head_dim) * sizeof(float));                 \
    if (scores == NULL || qv == NULL || acc == NULL) {                                            \
        free(scores), free(qv), free(acc);                                                        \
        return -1;                                                                                \
    }                                                                                             \
    const int64_t chunks = head_dim / LANES;                                                      \
    const T *v_cache = cache + num_blocks * block_size * num_kv_heads * head_dim;                 \
    for (int64_t s = 0; s < num_seqs; s++) {                                                      \
        const int64_t context = context_lens[s];                                                  \
        const int64_t pad = (context + LANES - 1) / LANES * LANES;                                \
        const int64_t first = s * num_heads * head_dim;                                          \
        const int64_t *table = block_tables + s * max_blocks;                                     \
        if (context <= 0) {                                                                       \
            for (int64_t i = 0; i < num_heads * chunks; i++) acc[i] = (vf){0};                   \
        } else {                                                                                  \
            for (int64_t i = 0; i < num_heads * chunks; i++) qv[i] = LOAD(q + first + i * LANES); \
            switch (chunks * 100 + group) {                                                       \
            SEQ_CASE(SUFFIX, CH64, 1) SEQ_CASE(SUFFIX, CH64, 2) SEQ_CASE(SUFFIX, CH64, 3)         \
            SEQ_CASE(SUFFIX, CH64, 4) SEQ_CASE(SUFFIX, CH64, 8)                                   \
            SEQ_CASE(SUFFIX, CH128, 1) SEQ_CASE(SUFFIX, CH128, 2) SEQ_CASE(SUFFIX, CH128, 4)      \
            SEQ_CASE(SUFFIX, CH128, 8)                                                            \
            default: /* other shapes: the same code, not unrolled */                              \
                seq_##SUFFIX(qv, cache, v_cache, table, context, block_size, num_kv_heads, group, \
                             chunks, scale, scores, pad, acc);                                    \
            }                                                                                     \
        }                                                                                         \
        STORE(out + first, acc, num_heads * head_dim);                                            \
    }                                                                                             \
    free(scores), free(qv), free(acc);                                                            \
    return 0;                                                                                     \
}

DEFINE_KERNEL(f32, float, load_f32, store_f32, 0)
DEFINE_KERNEL(bf16, uint16_t, load_bf16, store_bf16, 1)

/* A pure decode step's attention in one call (bfloat16): each token's q and k heads rotated,
 * its k and v stored into its cache slot, then paged_decode_bf16 over the cache.
 *
 *   qkv        [num_seqs, (num_heads + 2 * num_kv_heads) * head_dim]   q, then k, then v heads
 *   cos, ssin  [num_seqs, head_dim]   the step's rope factors in bfloat16 (engine.model.rope.StepRope:
 *                                     sin with its first half negated)
 *   slots      int64 [num_seqs]       flat slot (block * block_size + offset) of each token
 *
 * The rotation is StepRope.apply's x * cos + roll(x, head_dim / 2) * ssin with each product and
 * the sum rounded to bfloat16, as torch computes it in bfloat16, so the cache and the attention
 * get the same values as on the torch path. The caller checks the slots and the tables once
 * per step (paged_attention.py). Returns paged_decode_bf16's answer. */
int paged_decode_rope_bf16(const uint16_t *qkv, const uint16_t *cos, const uint16_t *ssin, const int64_t *slots,
                           uint16_t *cache, uint16_t *out, const int64_t *block_tables,
                           const int64_t *context_lens, int64_t num_seqs, int64_t max_blocks, int64_t num_blocks,
                           int64_t block_size, int64_t num_kv_heads, int64_t group, int64_t head_dim, float scale) {
    const int64_t num_heads = num_kv_heads * group, half = head_dim / 2;
    const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim, row = num_kv_heads * head_dim;
    uint16_t *q = malloc((size_t)(num_seqs * num_heads * head_dim) * sizeof(uint16_t));
    if (q == NULL) return -1;
    uint16_t *v_cache = cache + num_blocks * block_size * row;
    for (int64_t s = 0; s < num_seqs; s++) {
        const uint16_t *x = qkv + s * width, *c = cos + s * head_dim, *sn = ssin + s * head_dim;
        uint16_t *k_dst = cache + slots[s] * row, *v_dst = v_cache + slots[s] * row;
        for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {
            const uint16_t *xh = x + h * head_dim;
            uint16_t *dst = h < num_heads ? q + (s * num_heads + h) * head_dim : k_dst + (h - num_heads) * head_dim;
            for (int64_t d = 0; d < head_dim; d++) {
                const float a = bf16_value(f32_to_bf16(bf16_value(xh[d]) * bf16_value(c[d])));
                const float b = bf16_value(f32_to_bf16(bf16_value(xh[(d + half) % head_dim]) * bf16_value(sn[d])));
                dst[d] = f32_to_bf16(a + b);
            }
        }
        memcpy(v_dst, x + (num_heads + num_kv_heads) * head_dim, (size_t)row * sizeof(uint16_t));
    }
    const int rc = paged_decode_bf16(q, cache, out, block_tables, context_lens, num_seqs, max_blocks, num_blocks,
                                     block_size, num_kv_heads, group, head_dim, scale);
    free(q);
    return rc;
}
