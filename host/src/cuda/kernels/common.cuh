// Shared by every kernel module: prepended to each .cu source before NVRTC
// compiles it (NVRTC has no include path of ours), so it must stay small.
//
// bf16 is stored as its raw 16 bits and converted by hand rather than with
// cuda_bf16.h, so the sources compile with the bare NVRTC library (the PyPI
// wheel CI uses ships no CUDA headers).

// NVRTC has no <math.h>: the float infinity, spelled out.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ float bf16_to_f32(bf16 v) {
    return __uint_as_float(((u32)v) << 16);
}

// Round to nearest even, NaN kept quiet (what __float2bfloat16_rn does).
__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (bf16)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum for blockDim.x a multiple of 32 (<= 1024); every thread gets
// the result. `shared` holds at least 32 floats.
__device__ __forceinline__ float block_sum(float v, float* shared) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    int warps = blockDim.x >> 5;
    v = lane < warps ? shared[lane] : 0.0f;
    return warp_sum(v);
}

// Block-wide max, same contract as block_sum.
__device__ __forceinline__ float block_max(float v, float* shared) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    int warps = blockDim.x >> 5;
    v = lane < warps ? shared[lane] : -INFINITY;
    return warp_max(v);
}
