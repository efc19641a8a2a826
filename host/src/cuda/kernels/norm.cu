// RMSNorm fused with the residual add (vLLM's fused_add_rms_norm):
//   residual = add ? residual + x : x      (stored back, bf16)
//   out      = residual * rsqrt(mean(residual^2) + eps) * weight
// One block per token row; f32 accumulation. `out` may alias `x`.
extern "C" __global__ void fused_add_rms_norm(
    bf16* out, bf16* residual, const bf16* x, const float* weight,
    float eps, int hidden, int add)
{
    __shared__ float red[32];
    size_t row = blockIdx.x;
    const bf16* xr = x + row * hidden;
    bf16* rr = residual + row * hidden;
    bf16* orow = out + row * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = bf16_to_f32(xr[i]);
        if (add) v += bf16_to_f32(rr[i]);
        bf16 r = f32_to_bf16(v);
        rr[i] = r;
        float rv = bf16_to_f32(r);
        ss += rv * rv;
    }
    float inv = rsqrtf(block_sum(ss, red) / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        orow[i] = f32_to_bf16(bf16_to_f32(rr[i]) * inv * weight[i]);
    }
}
