// Paged decode attention: one query token per sequence over its paged K/V ("flash-decoding").
//
// Shapes (all contiguous):
//   q            [num_seqs, num_heads, head_dim]
//   kv_cache     [2, num_blocks, block_size, num_kv_heads, head_dim]   K half, then V half
//   block_tables [num_seqs, max_blocks_per_seq] int32; token p of a sequence lives in block
//                block_tables[s][p / block_size] at offset p % block_size
//   context_lens [num_seqs] int32; clamped to [0, max_blocks_per_seq * block_size]
//   out          [num_seqs, num_heads, head_dim]
// GQA: query head h reads kv head h / (num_heads / num_kv_heads) (as repeat_interleave does).
//
// Split-K: the context is cut into partitions of partition_size tokens. The partition kernel
// runs one CTA per (kv head, sequence, partition) and handles all the query heads sharing
// that kv head, so each K/V row is read from memory once per CTA. With one partition it
// writes `out` itself; otherwise it writes, per query head, the partition's max logit, its
// sum of exp(logit - max) and its unnormalised exp-weighted V (fp32), and the reduce kernel
// (one CTA per (head, sequence)) combines a sequence's non-empty partitions. A sequence
// with context 0 gets zeros. Every element of `out` is written. All arithmetic is fp32.
//
// Dynamic shared memory of the partition kernel (bytes, the wrapper computes the same):
//   partition_size * 8          token_off: element offset of each token's row in the K half
//   group * head_dim * 4        q_s: the group's queries times scale
//   group * partition_size * 4  logits, then exp(logit - max)
//   group * 8                   row_max, row_sum

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define PA_MAX_PER_LANE 8  // head_dim <= 32 * PA_MAX_PER_LANE = 256

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) {
    return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

__device__ __forceinline__ int clamped_context(const int* context_lens, int seq, int max_context) {
    const int ctx = context_lens[seq];
    return ctx < 0 ? 0 : (ctx > max_context ? max_context : ctx);
}

template <typename T>
__device__ __forceinline__ void partition_impl(
    T* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_max,
    float* __restrict__ part_sum, const T* __restrict__ q, const T* __restrict__ kv_cache,
    const int* __restrict__ block_tables, const int* __restrict__ context_lens, float scale,
    int num_heads, int num_kv_heads, int head_dim, int block_size, long long num_blocks,
    int max_blocks_per_seq, int partition_size, int num_partitions) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int kvh = blockIdx.x, seq = blockIdx.y, part = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, num_warps = blockDim.x >> 5;
    const int group = num_heads / num_kv_heads;
    const int ctx = clamped_context(context_lens, seq, max_blocks_per_seq * block_size);
    const int start = part * partition_size;

    if (ctx == 0) {  // nothing to attend to: zeros (the reduce kernel does the same)
        if (num_partitions == 1) {
            for (int o = tid; o < group * head_dim; o += blockDim.x) {
                const int h = kvh * group + o / head_dim;
                out[((long long)seq * num_heads + h) * head_dim + o % head_dim] = from_float<T>(0.f);
            }
        }
        return;
    }
    if (start >= ctx) return;  // an empty partition: the reduce kernel never reads it
    const int n = min(partition_size, ctx - start);

    long long* token_off = reinterpret_cast<long long*>(smem);
    float* q_s = reinterpret_cast<float*>(token_off + partition_size);
    float* logits = q_s + group * head_dim;
    float* row_max = logits + group * partition_size;
    float* row_sum = row_max + group;

    const long long row_elems = (long long)num_kv_heads * head_dim;
    for (int i = tid; i < n; i += blockDim.x) {
        const int pos = start + i;
        const long long blk = block_tables[(long long)seq * max_blocks_per_seq + pos / block_size];
        token_off[i] = (blk * block_size + pos % block_size) * row_elems + (long long)kvh * head_dim;
    }
    for (int i = tid; i < group * head_dim; i += blockDim.x) {
        const int h = kvh * group + i / head_dim;
        q_s[i] = to_float(q[((long long)seq * num_heads + h) * head_dim + i % head_dim]) * scale;
    }
    __syncthreads();

    // Logits: one warp per token; the K row is loaded once and dotted with every query head.
    const T* k_cache = kv_cache;
    const T* v_cache = kv_cache + num_blocks * block_size * row_elems;
    for (int i = warp; i < n; i += num_warps) {
        const T* k = k_cache + token_off[i];
        float kr[PA_MAX_PER_LANE];
#pragma unroll
        for (int j = 0; j < PA_MAX_PER_LANE; ++j) {
            const int d = lane + 32 * j;
            kr[j] = d < head_dim ? to_float(k[d]) : 0.f;
        }
        for (int g = 0; g < group; ++g) {
            const float* qg = q_s + g * head_dim;
            float acc = 0.f;
#pragma unroll
            for (int j = 0; j < PA_MAX_PER_LANE; ++j) {
                const int d = lane + 32 * j;
                if (d < head_dim) acc += qg[d] * kr[j];
            }
            acc = warp_sum(acc);
            if (lane == 0) logits[g * partition_size + i] = acc;
        }
    }
    __syncthreads();

    // Softmax statistics of this partition: one warp per query head.
    for (int g = warp; g < group; g += num_warps) {
        float* row = logits + g * partition_size;
        float m = neg_inf();
        for (int i = lane; i < n; i += 32) m = fmaxf(m, row[i]);
        m = warp_max(m);
        float s = 0.f;
        for (int i = lane; i < n; i += 32) {
            const float e = expf(row[i] - m);
            row[i] = e;
            s += e;
        }
        s = warp_sum(s);
        if (lane == 0) {
            row_max[g] = m;
            row_sum[g] = s;
        }
    }
    __syncthreads();

    // P.V: one thread per (query head, dim) output; a warp reads consecutive dims of a V row.
    for (int o = tid; o < group * head_dim; o += blockDim.x) {
        const int g = o / head_dim, d = o - g * head_dim;
        const float* p = logits + g * partition_size;
        float acc = 0.f;
#pragma unroll 8
        for (int i = 0; i < n; ++i) acc += p[i] * to_float(v_cache[token_off[i] + d]);
        const long long head = (long long)seq * num_heads + kvh * group + g;
        if (num_partitions == 1) {
            out[head * head_dim + d] = from_float<T>(acc / row_sum[g]);
        } else {
            const long long idx = head * num_partitions + part;
            part_out[idx * head_dim + d] = acc;
            if (d == 0) {
                part_max[idx] = row_max[g];
                part_sum[idx] = row_sum[g];
            }
        }
    }
}

template <typename T>
__device__ __forceinline__ void reduce_impl(
    T* __restrict__ out, const float* __restrict__ part_out, const float* __restrict__ part_max,
    const float* __restrict__ part_sum, const int* __restrict__ context_lens, int num_heads,
    int head_dim, int max_context, int partition_size, int num_partitions) {
    const int h = blockIdx.x, seq = blockIdx.y;
    const long long head = (long long)seq * num_heads + h;
    const int ctx = clamped_context(context_lens, seq, max_context);
    if (ctx == 0) {
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x)
            out[head * head_dim + d] = from_float<T>(0.f);
        return;
    }
    const int used = (ctx + partition_size - 1) / partition_size;
    const float* pm = part_max + head * num_partitions;
    const float* ps = part_sum + head * num_partitions;
    float m = neg_inf();
    for (int p = 0; p < used; ++p) m = fmaxf(m, pm[p]);
    float total = 0.f;  // >= 1: the partition holding the max contributes exp(0) * sum >= 1
    for (int p = 0; p < used; ++p) total += ps[p] * expf(pm[p] - m);
    const float inv = 1.f / total;
    const float* po = part_out + head * num_partitions * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.f;
        for (int p = 0; p < used; ++p) acc += expf(pm[p] - m) * po[(long long)p * head_dim + d];
        out[head * head_dim + d] = from_float<T>(acc * inv);
    }
}

extern "C" __global__ void __launch_bounds__(256) paged_attention_partition_f32(
    float* out, float* part_out, float* part_max, float* part_sum, const float* q,
    const float* kv_cache, const int* block_tables, const int* context_lens, float scale,
    int num_heads, int num_kv_heads, int head_dim, int block_size, long long num_blocks,
    int max_blocks_per_seq, int partition_size, int num_partitions) {
    partition_impl<float>(out, part_out, part_max, part_sum, q, kv_cache, block_tables,
                          context_lens, scale, num_heads, num_kv_heads, head_dim, block_size,
                          num_blocks, max_blocks_per_seq, partition_size, num_partitions);
}

extern "C" __global__ void __launch_bounds__(256) paged_attention_partition_f16(
    __half* out, float* part_out, float* part_max, float* part_sum, const __half* q,
    const __half* kv_cache, const int* block_tables, const int* context_lens, float scale,
    int num_heads, int num_kv_heads, int head_dim, int block_size, long long num_blocks,
    int max_blocks_per_seq, int partition_size, int num_partitions) {
    partition_impl<__half>(out, part_out, part_max, part_sum, q, kv_cache, block_tables,
                           context_lens, scale, num_heads, num_kv_heads, head_dim, block_size,
                           num_blocks, max_blocks_per_seq, partition_size, num_partitions);
}

extern "C" __global__ void __launch_bounds__(256) paged_attention_partition_bf16(
    __nv_bfloat16* out, float* part_out, float* part_max, float* part_sum,
    const __nv_bfloat16* q, const __nv_bfloat16* kv_cache, const int* block_tables,
    const int* context_lens, float scale, int num_heads, int num_kv_heads, int head_dim,
    int block_size, long long num_blocks, int max_blocks_per_seq, int partition_size,
    int num_partitions) {
    partition_impl<__nv_bfloat16>(out, part_out, part_max, part_sum, q, kv_cache, block_tables,
                                  context_lens, scale, num_heads, num_kv_heads, head_dim,
                                  block_size, num_blocks, max_blocks_per_seq, partition_size,
                                  num_partitions);
}

extern "C" __global__ void paged_attention_reduce_f32(
    float* out, const float* part_out, const float* part_max, const float* part_sum,
    const int* context_lens, int num_heads, int head_dim, int max_context, int partition_size,
    int num_partitions) {
    reduce_impl<float>(out, part_out, part_max, part_sum, context_lens, num_heads, head_dim,
                       max_context, partition_size, num_partitions);
}

extern "C" __global__ void paged_attention_reduce_f16(
    __half* out, const float* part_out, const float* part_max, const float* part_sum,
    const int* context_lens, int num_heads, int head_dim, int max_context, int partition_size,
    int num_partitions) {
    reduce_impl<__half>(out, part_out, part_max, part_sum, context_lens, num_heads, head_dim,
                        max_context, partition_size, num_partitions);
}

extern "C" __global__ void paged_attention_reduce_bf16(
    __nv_bfloat16* out, const float* part_out, const float* part_max, const float* part_sum,
    const int* context_lens, int num_heads, int head_dim, int max_context, int partition_size,
    int num_partitions) {
    reduce_impl<__nv_bfloat16>(out, part_out, part_max, part_sum, context_lens, num_heads,
                               head_dim, max_context, partition_size, num_partitions);
}
