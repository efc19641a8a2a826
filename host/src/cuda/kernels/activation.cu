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

// Gathers embedding rows: out[t] = table[ids[t]] (bf16 rows of `hidden`).
extern "C" __global__ void embed_tokens(
    bf16* out, const bf16* table, const int* ids, int hidden)
{
    size_t t = blockIdx.x;
    const bf16* src = table + (size_t)ids[t] * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[t * hidden + i] = src[i];
}
