// Pack one request's KV blocks of every layer into a contiguous payload, and the reverse.
//
// Each layer's cache: [2, num_cache_blocks, block_size, num_kv_heads, head_dim], K then V,
// contiguous, its base address in layer_ptrs[layer]. A "chunk" is one block of one half
// (block_bytes = block_size * num_kv_heads * head_dim * element size). The payload is
// [num_layers, 2, num_ids, block_size, num_kv_heads, head_dim]: chunk c = (layer * 2 + kv) *
// num_ids + i holds block block_ids[i] of half kv of that layer.
//
// The copies are byte copies (any element type, fp8 included), 16 bytes wide when both
// addresses and block_bytes are multiples of 16, else 4 or 1. One CTA per chunk, grid-stride.
// Block ids are not range-checked here: the Python wrapper checks them before the launch.

__device__ __forceinline__ void copy_chunk(unsigned char* __restrict__ dst,
                                           const unsigned char* __restrict__ src,
                                           long long nbytes) {
    const unsigned long long align =
        (unsigned long long)dst | (unsigned long long)src | (unsigned long long)nbytes;
    if ((align & 15ull) == 0) {
        uint4* d = reinterpret_cast<uint4*>(dst);
        const uint4* s = reinterpret_cast<const uint4*>(src);
        for (long long i = threadIdx.x; i < nbytes / 16; i += blockDim.x) d[i] = s[i];
    } else if ((align & 3ull) == 0) {
        unsigned int* d = reinterpret_cast<unsigned int*>(dst);
        const unsigned int* s = reinterpret_cast<const unsigned int*>(src);
        for (long long i = threadIdx.x; i < nbytes / 4; i += blockDim.x) d[i] = s[i];
    } else {
        for (long long i = threadIdx.x; i < nbytes; i += blockDim.x) dst[i] = src[i];
    }
}

// Address of chunk c's block inside its layer's cache.
__device__ __forceinline__ unsigned char* cache_chunk(
    const unsigned long long* layer_ptrs, const long long* block_ids, long long c, int num_ids,
    long long num_cache_blocks, long long block_bytes) {
    const long long i = c % num_ids;
    const long long kv = (c / num_ids) % 2;
    const long long layer = c / (2LL * num_ids);
    unsigned char* base = reinterpret_cast<unsigned char*>(layer_ptrs[layer]);
    return base + (kv * num_cache_blocks + block_ids[i]) * block_bytes;
}

extern "C" __global__ void pack_blocks(
    unsigned char* payload, const unsigned long long* layer_ptrs, const long long* block_ids,
    int num_ids, int num_layers, long long num_cache_blocks, long long block_bytes) {
    const long long chunks = 2LL * num_layers * num_ids;
    for (long long c = blockIdx.x; c < chunks; c += gridDim.x) {
        copy_chunk(payload + c * block_bytes,
                   cache_chunk(layer_ptrs, block_ids, c, num_ids, num_cache_blocks, block_bytes),
                   block_bytes);
    }
}

extern "C" __global__ void unpack_blocks(
    const unsigned char* payload, const unsigned long long* layer_ptrs,
    const long long* block_ids, int num_ids, int num_layers, long long num_cache_blocks,
    long long block_bytes) {
    const long long chunks = 2LL * num_layers * num_ids;
    for (long long c = blockIdx.x; c < chunks; c += gridDim.x) {
        copy_chunk(cache_chunk(layer_ptrs, block_ids, c, num_ids, num_cache_blocks, block_bytes),
                   payload + c * block_bytes, block_bytes);
    }
}
