// Sampling on the device, one block per row of f32 logits, with no host
// synchronisation: the chosen ids stay on the device until the step's copy.
// Order as the CPU sampler (host/src/sampling/sampler.rs): greedy when
// temperature < 1e-5; otherwise temperature, min-p, top-k, top-p, then a
// Gumbel-max draw. No sort: the top-k and top-p thresholds are found by a
// bitwise search over order-preserving 32-bit keys of the values (32 passes),
// exact up to ties (tied values at a threshold are all kept).
//
// The noise is Philox4x32-10 keyed by the request's 64-bit seed (the host
// gives an unseeded request a random one) with counter (token id, position
// of the token being sampled, 0, 0), so a seeded request draws the same
// stream whatever its batch and step layout.

#define SAMPLE_THREADS 1024

__device__ __forceinline__ void philox_round(u32 ctr[4], const u32 key[2]) {
    u64 p0 = (u64)0xD2511F53u * ctr[0];
    u64 p1 = (u64)0xCD9E8D57u * ctr[2];
    u32 hi0 = (u32)(p0 >> 32), lo0 = (u32)p0;
    u32 hi1 = (u32)(p1 >> 32), lo1 = (u32)p1;
    u32 c0 = hi1 ^ ctr[1] ^ key[0];
    u32 c2 = hi0 ^ ctr[3] ^ key[1];
    ctr[0] = c0; ctr[1] = lo1; ctr[2] = c2; ctr[3] = lo0;
}

// Philox4x32-10 (Random123): the first output word.
__device__ __forceinline__ u32 philox4x32_10(u32 c0, u32 c1, u32 c2, u32 c3, u32 k0, u32 k1) {
    u32 ctr[4] = {c0, c1, c2, c3};
    u32 key[2] = {k0, k1};
    for (int r = 0; r < 10; r++) {
        if (r > 0) { key[0] += 0x9E3779B9u; key[1] += 0xBB67AE85u; }
        philox_round(ctr, key);
    }
    return ctr[0];
}

// Whole Philox block, for the device test against the Rust reference.
extern "C" __global__ void philox_test(u32* out, const u32* inputs, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const u32* in = inputs + 6 * i;
    u32 ctr[4] = {in[0], in[1], in[2], in[3]};
    u32 key[2] = {in[4], in[5]};
    for (int r = 0; r < 10; r++) {
        if (r > 0) { key[0] += 0x9E3779B9u; key[1] += 0xBB67AE85u; }
        philox_round(ctr, key);
    }
    for (int w = 0; w < 4; w++) out[4 * i + w] = ctr[w];
}

__device__ __forceinline__ u32 order_key(float f) {
    u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Adds sparse values to logits: logits[rows[i]][tokens[i]] += values[i]; a
// ban is a value of -inf. This is how logits-processor plugins' masks and
// biases reach the device (a handful of entries per row, not a dense row).
extern "C" __global__ void apply_sparse_bias(
    float* logits, int vocab, const int* rows, const int* tokens,
    const float* values, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    atomicAdd(&logits[(size_t)rows[i] * vocab + tokens[i]], values[i]);
}

// Block-wide argmax of (value, index): the larger value, then the smaller index.
__device__ void block_argmax(float& v, int& idx, float* sv, int* si) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
    }
    __syncthreads();
    if (lane == 0) { sv[warp] = v; si[warp] = idx; }
    __syncthreads();
    if (warp == 0) {
        int warps = blockDim.x >> 5;
        v = lane < warps ? sv[lane] : -INFINITY;
        idx = lane < warps ? si[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, v, o);
            int oi = __shfl_xor_sync(0xffffffffu, idx, o);
            if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
        }
        if (lane == 0) { sv[0] = v; si[0] = idx; }
    }
    __syncthreads();
    v = sv[0];
    idx = si[0];
}

// The largest key K with f(K) >= target, where f(K) sums `weight(x)` over
// the kept values whose key is >= K (monotone in K), built bit by bit.
template <typename W>
__device__ u32 search_threshold(const float* x, int vocab, u32 floor_key, float target,
                                W weight, float* red) {
    u32 ans = 0;
    for (int bit = 31; bit >= 0; bit--) {
        u32 cand = ans | (1u << bit);
        float s = 0.0f;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            u32 k = order_key(x[i]);
            if (k >= cand && k >= floor_key) s += weight(x[i]);
        }
        if (block_sum(s, red) >= target) ans = cand;
    }
    return ans;
}

struct CountWeight { __device__ float operator()(float) const { return 1.0f; } };
struct ExpWeight {
    float max;
    __device__ float operator()(float v) const { return __expf(v - max); }
};

// One row per block (SAMPLE_THREADS threads). Scales the row in place by
// 1/temperature. top_k <= 0 or >= vocab, top_p >= 1 and min_p <= 0 are off.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_rows(
    int* out, float* logits, int vocab, const float* temperature,
    const int* top_k, const float* top_p, const float* min_p,
    const u64* seeds, const int* positions)
{
    __shared__ float red[32];
    __shared__ float sv[32];
    __shared__ int si[32];
    int row = blockIdx.x;
    float* x = logits + (size_t)row * vocab;
    float temp = temperature[row];
    float best = -INFINITY;
    int best_i = 0x7fffffff;
    if (temp < 1e-5f) {
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            if (x[i] > best) { best = x[i]; best_i = i; }
        }
        block_argmax(best, best_i, sv, si);
        // A row with every token banned still yields a valid id (0).
        if (threadIdx.x == 0) out[row] = best_i == 0x7fffffff ? 0 : best_i;
        return;
    }
    float inv_t = 1.0f / temp, local_max = -INFINITY;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        x[i] *= inv_t;
        local_max = fmaxf(local_max, x[i]);
    }
    __syncthreads();
    float xmax = block_max(local_max, red);
    // Everything kept has a key >= floor_key.
    u32 floor_key = 0;
    if (min_p[row] > 0.0f) floor_key = order_key(xmax + __logf(min_p[row]));
    int k = top_k[row];
    if (k > 0 && k < vocab) {
        u32 kk = search_threshold(x, vocab, floor_key, (float)k, CountWeight{}, red);
        floor_key = max(floor_key, kk);
    }
    if (top_p[row] < 1.0f) {
        ExpWeight w{xmax};
        float z = 0.0f;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            if (order_key(x[i]) >= floor_key) z += w(x[i]);
        }
        z = block_sum(z, red);
        u32 pk = search_threshold(x, vocab, floor_key, top_p[row] * z, w, red);
        floor_key = max(floor_key, pk);
    }
    u64 seed = seeds[row];
    u32 pos = (u32)positions[row];
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        if (order_key(x[i]) < floor_key || x[i] == -INFINITY) continue;
        u32 r = philox4x32_10((u32)i, pos, 0u, 0u, (u32)seed, (u32)(seed >> 32));
        // 24 random bits: exact in f32, strictly inside (0, 1).
        float u = ((float)(r >> 8) + 0.5f) * 5.9604644775390625e-8f;
        float g = x[i] - __logf(-__logf(u));
        if (g > best) { best = g; best_i = i; }
    }
    block_argmax(best, best_i, sv, si);
    if (threadIdx.x == 0) out[row] = best_i == 0x7fffffff ? 0 : best_i;
}
