// Sampling on the device, one block per row of f32 logits, with no host
// synchronisation: the chosen ids stay on the device until the step's copy.
// Order as the CPU sampler (host/src/sampling/sampler.rs): greedy when
// temperature < 1e-5; otherwise temperature, min-p, top-k, top-p, then a
// Gumbel-max draw. No sort: the top-k and top-p thresholds are found by a
// bitwise search over order-preserving 32-bit keys of the values (32 passes).
//
// Kept sets, as the CPU's:
// - top-k keeps exactly k tokens: every token above the k-th largest value,
//   then the tokens tied with it in token-id order (lowest ids first), as
//   `select::top_k_in_index_order` does;
// - top-p keeps the smallest set of most likely tokens whose mass reaches
//   top_p, plus every token tied with its least likely member, as
//   `nucleus::apply_top_p` does (it keeps ties too).
// Where the two may still differ, by float rounding only: min-p compares the
// tempered logits with max + ln(min_p) (the CPU compares raw logits with
// max + T·ln(min_p)); top-p sums __expf weights in f32 (the CPU sums its own
// exp in f64) and ranks logits (the CPU ranks weights, so two logits whose
// f32 weights round equal are tied there and not here). Only tokens within
// rounding of a cut-off can land on different sides of it, which moves
// probability mass of the order of float epsilon: accepted.
//
// The noise is Philox4x32-10 keyed by the request's 64-bit seed (the host
// gives an unseeded request a random one) with counter (token id, position
// of the token being sampled, 0, 0), so a seeded request draws the same
// stream whatever its batch and step layout. The draw has the CPU's
// distribution but not its stream (the CPU draws by inverse CDF from its
// own generator): a seed reproduces its tokens on each path, not across.

#define SAMPLE_THREADS 1024
#define NO_TOKEN 0x7fffffff

// One row's parameters as host/src/cuda/sampler.rs packs them (8 words).
// top_k <= 0 or >= vocab, top_p >= 1 and min_p <= 0 are off.
struct RowParams {
    float temperature;
    int top_k;
    float top_p;
    float min_p;
    u32 seed_lo;
    u32 seed_hi;
    u32 position;
    u32 unused;
};

// One sparse logit edit (3 words): logits[row][token] += value.
struct BiasEntry {
    u32 row;
    u32 token;
    float value;
};

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

// Gumbel noise -ln(-ln u) for the top 24 bits m of a Philox word, with
// u = (m + 0.5) / 2^24 strictly inside (0, 1). Neither u nor 1 - u is
// rounded (each is computed where it is exact in f32) and -ln u is taken by
// log1pf near 1, so the noise of the likeliest winners, u close to 1, is
// accurate (__logf(u) there would be mostly error, and (m + 0.5) / 2^24 in
// one f32 rounds to exactly 1 for the largest m). philox.rs's `gumbel` is
// the host reference.
__device__ __forceinline__ float gumbel_noise(u32 r) {
    u32 m = r >> 8;
    float e;
    if (m < (1u << 23)) {
        e = -logf(((float)m + 0.5f) * 5.9604644775390625e-8f);
    } else {
        e = -log1pf(-((float)((1u << 24) - m) - 0.5f) * 5.9604644775390625e-8f);
    }
    return -logf(e);
}

__device__ __forceinline__ u32 order_key(float f) {
    u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Adds sparse values to logits: logits[row][token] += value; a ban is a
// value of -inf, and entries for the same token add up (as the CPU applies
// logits-processor edits). This is how plugins' masks and biases reach the
// device: a handful of entries per row, not a dense row. The host checks
// rows and tokens against the batch before the launch.
extern "C" __global__ void apply_sparse_bias(
    float* logits, int vocab, const BiasEntry* entries, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    BiasEntry e = entries[i];
    atomicAdd(&logits[(size_t)e.row * vocab + e.token], e.value);
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
        idx = lane < warps ? si[lane] : NO_TOKEN;
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

// The CPU's argmax: the first largest value, NaN skipped; a row with every
// token banned still yields a valid id (0, as the CPU's).
__device__ int row_argmax(const float* x, int vocab, float* sv, int* si) {
    float best = -INFINITY;
    int best_i = NO_TOKEN;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        if (x[i] > best) { best = x[i]; best_i = i; }
    }
    block_argmax(best, best_i, sv, si);
    return best_i == NO_TOKEN ? 0 : best_i;
}

// The tokens still in the running: key >= floor_key, and of the tokens whose
// key is tie_key only those with id <= tie_last (top-k's partial tie).
struct Keep {
    u32 floor_key;
    u32 tie_key;
    int tie_last;
    __device__ bool operator()(u32 key, int i) const {
        return key >= floor_key && (key != tie_key || i <= tie_last);
    }
};

// The largest key K with f(K) >= target, where f(K) sums `weight(x)` over
// the kept values whose key is >= K (monotone in K), built bit by bit.
template <typename W>
__device__ u32 search_threshold(const float* x, int vocab, Keep keep, float target,
                                W weight, float* red) {
    u32 ans = 0;
    for (int bit = 31; bit >= 0; bit--) {
        u32 cand = ans | (1u << bit);
        float s = 0.0f;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            u32 k = order_key(x[i]);
            if (k >= cand && keep(k, i)) s += weight(x[i]);
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

// The id of the `need`-th token (1-based, in id order) whose key is `key`,
// by a block-wide prefix count over chunks of blockDim.x ids that stops at
// the chunk holding it.
__device__ int nth_tied(const float* x, int vocab, u32 key, int need, int* counts) {
    __shared__ int found;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    // Not reached only if fewer than `need` ids tie: then nothing is cut.
    if (threadIdx.x == 0) found = vocab;
    int before = 0;
    for (int base = 0; base < vocab; base += blockDim.x) {
        int i = base + threadIdx.x;
        bool tied = i < vocab && order_key(x[i]) == key;
        u32 ballot = __ballot_sync(0xffffffffu, tied);
        if (lane == 0) counts[warp] = __popc(ballot);
        __syncthreads();
        int rank = before + __popc(ballot & ((1u << lane) - 1u)), total = before;
        for (int w = 0; w < warps; w++) {
            rank += w < warp ? counts[w] : 0;
            total += counts[w];
        }
        if (tied && rank == need - 1) found = i;
        __syncthreads();
        before = total;
        if (before >= need) break;
    }
    __syncthreads();
    return found;
}

// One row per block (SAMPLE_THREADS threads). Scales a sampled row in place
// by 1/temperature (a greedy row is left as it is).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_rows(
    int* out, float* logits, int vocab, const RowParams* params)
{
    __shared__ float red[32];
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ int counts[32];
    int row = blockIdx.x;
    float* x = logits + (size_t)row * vocab;
    RowParams p = params[row];
    if (p.temperature < 1e-5f) {
        int best = row_argmax(x, vocab, sv, si);
        if (threadIdx.x == 0) out[row] = best;
        return;
    }
    float inv_t = 1.0f / p.temperature, local_max = -INFINITY;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        x[i] *= inv_t;
        local_max = fmaxf(local_max, x[i]);
    }
    __syncthreads();
    float xmax = block_max(local_max, red);
    if (!(fabsf(xmax) < INFINITY)) {
        // Everything banned, or an infinite logit: no distribution exists,
        // and the CPU takes the argmax.
        int best = row_argmax(x, vocab, sv, si);
        if (threadIdx.x == 0) out[row] = best;
        return;
    }
    // Nothing restricts ties until top-k does.
    Keep keep{0u, 0u, vocab};
    if (p.min_p > 0.0f) keep.floor_key = order_key(xmax + logf(p.min_p));
    int k = p.top_k;
    if (k > 0 && k < vocab) {
        u32 kk = search_threshold(x, vocab, keep, (float)k, CountWeight{}, red);
        // At least k kept tokens have a key >= kk, fewer than k one > kk:
        // keep those above and the lowest ids among the ties.
        float above = 0.0f, tied = 0.0f;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            u32 key = order_key(x[i]);
            if (keep(key, i)) {
                above += key > kk ? 1.0f : 0.0f;
                tied += key == kk ? 1.0f : 0.0f;
            }
        }
        above = block_sum(above, red);
        tied = block_sum(tied, red);
        int need = k - (int)above;
        keep.floor_key = max(keep.floor_key, kk);
        if (tied > (float)need) {
            keep.tie_key = kk;
            keep.tie_last = nth_tied(x, vocab, kk, need, counts);
        }
    }
    if (p.top_p < 1.0f) {
        ExpWeight w{xmax};
        float z = 0.0f;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            if (keep(order_key(x[i]), i)) z += w(x[i]);
        }
        z = block_sum(z, red);
        u32 pk = search_threshold(x, vocab, keep, p.top_p * z, w, red);
        keep.floor_key = max(keep.floor_key, pk);
    }
    float best = -INFINITY;
    int best_i = NO_TOKEN;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        if (!keep(order_key(x[i]), i) || x[i] == -INFINITY) continue;
        u32 r = philox4x32_10((u32)i, p.position, 0u, 0u, p.seed_lo, p.seed_hi);
        float g = x[i] + gumbel_noise(r);
        if (g > best) { best = g; best_i = i; }
    }
    block_argmax(best, best_i, sv, si);
    if (threadIdx.x == 0) out[row] = best_i == NO_TOKEN ? 0 : best_i;
}
