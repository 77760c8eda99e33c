// Per-chunk checksums to verify a transfer: the sum, wrapping mod 2^32, of a chunk's bytes
// read as little-endian uint32 words. Addition mod 2^32 is associative and commutative, so
// the result is exact and independent of the reduction order (the torch reference agrees
// bit for bit). It catches lost, stale or misplaced blocks, not adversarial edits.
//
// A chunk is one block of one half (K or V) of one layer, block_bytes long (a multiple of
// 4). block_checksum_payload reads chunks from a payload [num_layers, 2, n, ...];
// block_checksum_blocks reads the same chunks straight from the caches (layer_ptrs,
// block_ids as in pack_blocks.cu), so P and D can compare without packing.
// out[c] for chunk c = (layer * 2 + kv) * n + i. One CTA per chunk, grid-stride; the block
// size must be a multiple of 32 and at most 1024.

__device__ __forceinline__ unsigned int chunk_sum(const unsigned char* p, long long nbytes) {
    unsigned int s = 0;
    if ((((unsigned long long)p | (unsigned long long)nbytes) & 15ull) == 0) {
        const uint4* v = reinterpret_cast<const uint4*>(p);
        for (long long i = threadIdx.x; i < nbytes / 16; i += blockDim.x) {
            const uint4 w = v[i];
            s += w.x + w.y + w.z + w.w;
        }
    } else {
        const unsigned int* w = reinterpret_cast<const unsigned int*>(p);
        for (long long i = threadIdx.x; i < nbytes / 4; i += blockDim.x) s += w[i];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    __shared__ unsigned int warp_sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_sums[warp] = s;
    __syncthreads();
    unsigned int total = 0;
    if (threadIdx.x == 0) {
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += warp_sums[w];
    }
    __syncthreads();  // warp_sums is reused by the next chunk
    return total;  // valid in thread 0 only
}

extern "C" __global__ void block_checksum_payload(
    unsigned int* out, const unsigned char* payload, long long num_chunks,
    long long block_bytes) {
    for (long long c = blockIdx.x; c < num_chunks; c += gridDim.x) {
        const unsigned int s = chunk_sum(payload + c * block_bytes, block_bytes);
        if (threadIdx.x == 0) out[c] = s;
    }
}

extern "C" __global__ void block_checksum_blocks(
    unsigned int* out, const unsigned long long* layer_ptrs, const long long* block_ids,
    int num_ids, int num_layers, long long num_cache_blocks, long long block_bytes) {
    const long long chunks = 2LL * num_layers * num_ids;
    for (long long c = blockIdx.x; c < chunks; c += gridDim.x) {
        const long long i = c % num_ids;
        const long long kv = (c / num_ids) % 2;
        const long long layer = c / (2LL * num_ids);
        const unsigned char* base = reinterpret_cast<const unsigned char*>(layer_ptrs[layer]);
        const unsigned int s =
            chunk_sum(base + (kv * num_cache_blocks + block_ids[i]) * block_bytes, block_bytes);
        if (threadIdx.x == 0) out[c] = s;
    }
}
