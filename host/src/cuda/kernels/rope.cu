// Rotary position embedding in GGUF / llama.cpp's "normal" layout, as the CPU
// runner applies it (host/src/kernels/rope.rs): adjacent pairs
// (x[2i], x[2i+1]) of each Q and K head rotate by position * theta^(-2i/rope_dim)
// for i < rope_dim / 2; later dimensions stay. Angles in f64 so large
// positions keep f32 accuracy, like the CPU table.
//
// `qkv` is the fused projection output, `stride` values per token: the
// query heads first, then the key heads (then the values, untouched).
// One block per token.
extern "C" __global__ void rope_qk(
    bf16* qkv, const int* positions, int stride, int num_heads,
    int num_kv_heads, int head_dim, int rope_dim, float theta)
{
    size_t t = blockIdx.x;
    bf16* row = qkv + t * stride;
    double pos = (double)positions[t];
    int pairs = rope_dim / 2;
    int total = (num_heads + num_kv_heads) * pairs;
    for (int k = threadIdx.x; k < total; k += blockDim.x) {
        int head = k / pairs, i = k % pairs;
        double freq = pow((double)theta, -2.0 * (double)i / (double)rope_dim);
        double s, c;
        sincos(pos * freq, &s, &c);
        bf16* h = row + head * head_dim + 2 * i;
        float x0 = bf16_to_f32(h[0]), x1 = bf16_to_f32(h[1]);
        float cf = (float)c, sf = (float)s;
        h[0] = f32_to_bf16(x0 * cf - x1 * sf);
        h[1] = f32_to_bf16(x0 * sf + x1 * cf);
    }
}
