// SiLU(gate) * up over the fused gate/up projection output: `gate_up` rows
// are [gate (inter) | up (inter)]; `out` rows are inter wide.
extern "C" __global__ void silu_and_mul(
    bf16* out, const bf16* gate_up, int inter, int num_tokens)
{
    size_t total = (size_t)num_tokens * inter;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total;
         k += (size_t)gridDim.x * blockDim.x) {
        size_t t = k / inter, i = k % inter;
        float g = bf16_to_f32(gate_up[t * 2 * inter + i]);
        float u = bf16_to_f32(gate_up[t * 2 * inter + inter + i]);
        out[k] = f32_to_bf16(g / (1.0f + __expf(-g)) * u);
    }
}

// Gathers rows: out[t] = table[rows[t]] (bf16 rows of `width`): the token
// embedding, and each sequence's last hidden row before the LM head.
extern "C" __global__ void gather_rows(
    bf16* out, const bf16* table, const int* rows, int width)
{
    size_t t = blockIdx.x;
    const bf16* src = table + (size_t)rows[t] * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) out[t * width + i] = src[i];
}

// Fills bf16 values uniform in [-scale, scale) from a hash of (seed, index):
// dummy weights made on the device, so an 8B-shaped model needs no host
// generation or upload.
extern "C" __global__ void fill_random_bf16(bf16* out, size_t n, u32 seed, float scale)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        u32 h = (u32)i * 0x9E3779B1u ^ (u32)(i >> 32) * 0x85EBCA77u ^ seed;
        h ^= h >> 16; h *= 0x7FEB352Du; h ^= h >> 15; h *= 0x846CA68Bu; h ^= h >> 16;
        out[i] = f32_to_bf16(((float)(h >> 8) * 5.9604644775390625e-8f * 2.0f - 1.0f) * scale);
    }
}
