// Store the K/V of this step's tokens into their cache slots.
//
// Cache (one layer): [2, num_blocks, block_size, num_kv_heads, head_dim], K half then V half,
// contiguous. A slot is block_id * block_size + offset; it indexes rows of
// num_kv_heads * head_dim elements inside each half. A slot < 0 is padding and is skipped; a
// slot >= num_slots is skipped too, so a bad slot never writes out of bounds (the torch
// reference raises instead).
//
// key/value: [num_tokens, num_kv_heads, head_dim] with each token's row contiguous; rows may be
// strided (e.g. K and V split out of one fused projection), hence key_stride/value_stride.
// One CTA per token (grid-stride): copies are 16 bytes wide when the row and both addresses
// allow it, else element by element.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

template <typename T>
__device__ __forceinline__ void copy_row(T* __restrict__ dst, const T* __restrict__ src,
                                         long long elems) {
    const unsigned long long bytes = (unsigned long long)elems * sizeof(T);
    const unsigned long long align = (unsigned long long)dst | (unsigned long long)src | bytes;
    if ((align & 15ull) == 0) {
        uint4* d = reinterpret_cast<uint4*>(dst);
        const uint4* s = reinterpret_cast<const uint4*>(src);
        const long long n = (long long)(bytes / 16);
        for (long long i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
    } else {
        for (long long i = threadIdx.x; i < elems; i += blockDim.x) dst[i] = src[i];
    }
}

template <typename T>
__device__ __forceinline__ void store_kv_impl(
    T* __restrict__ kv_cache,               // [2, num_slots, row_elems]
    const T* __restrict__ key,              // [num_tokens, row_elems], token stride key_stride
    const T* __restrict__ value,            // [num_tokens, row_elems], token stride value_stride
    const long long* __restrict__ slot_mapping,  // [num_tokens]
    long long num_tokens, long long num_slots, long long row_elems,
    long long key_stride, long long value_stride) {
    for (long long t = blockIdx.x; t < num_tokens; t += gridDim.x) {
        const long long slot = slot_mapping[t];
        if (slot < 0 || slot >= num_slots) continue;  // uniform across the CTA
        copy_row(kv_cache + slot * row_elems, key + t * key_stride, row_elems);
        copy_row(kv_cache + (num_slots + slot) * row_elems, value + t * value_stride, row_elems);
    }
}

extern "C" __global__ void store_kv_f32(
    float* kv_cache, const float* key, const float* value, const long long* slot_mapping,
    long long num_tokens, long long num_slots, long long row_elems,
    long long key_stride, long long value_stride) {
    store_kv_impl<float>(kv_cache, key, value, slot_mapping, num_tokens, num_slots, row_elems,
                         key_stride, value_stride);
}

extern "C" __global__ void store_kv_f16(
    __half* kv_cache, const __half* key, const __half* value, const long long* slot_mapping,
    long long num_tokens, long long num_slots, long long row_elems,
    long long key_stride, long long value_stride) {
    store_kv_impl<__half>(kv_cache, key, value, slot_mapping, num_tokens, num_slots, row_elems,
                          key_stride, value_stride);
}

extern "C" __global__ void store_kv_bf16(
    __nv_bfloat16* kv_cache, const __nv_bfloat16* key, const __nv_bfloat16* value,
    const long long* slot_mapping, long long num_tokens, long long num_slots,
    long long row_elems, long long key_stride, long long value_stride) {
    store_kv_impl<__nv_bfloat16>(kv_cache, key, value, slot_mapping, num_tokens, num_slots,
                                 row_elems, key_stride, value_stride);
}
