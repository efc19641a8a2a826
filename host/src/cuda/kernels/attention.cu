// Paged attention over the block tables, GQA, for prefill chunks and decodes
// alike (a decode is a query of length 1).
//
// KV cache, per layer: K and V each [num_blocks, block_size, num_kv_heads,
// head_dim] bf16; token position p of a sequence lives in physical block
// block_tables[seq][p / block_size], slot p % block_size.

#define ATTN_WARPS 4
#define ATTN_ROWS 16       // query rows (token, head-in-group) per block
#define ATTN_KEYS 32       // keys per tile: one per lane
#define ATTN_MAX_DIM 128   // head_dim <= 128, a multiple of 32

// Writes each step token's K and V (from the fused QKV rows, after RoPE) into
// its cache slot. slot_mapping[t] < 0 marks a padding token (skipped).
extern "C" __global__ void reshape_and_cache(
    bf16* k_cache, bf16* v_cache, const bf16* qkv, const int* slot_mapping,
    int stride, int num_heads, int num_kv_heads, int head_dim)
{
    size_t t = blockIdx.x;
    long long slot = slot_mapping[t];
    if (slot < 0) return;
    int width = num_kv_heads * head_dim;
    const bf16* k = qkv + t * stride + num_heads * head_dim;
    const bf16* v = k + width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        k_cache[slot * width + i] = k[i];
        v_cache[slot * width + i] = v[i];
    }
}

// Flash-style causal attention over keys [split_begin, split_end) of each
// sequence, for the block (row tile, KV head, sequence) given. ATTN_WARPS * 32
// threads. A block's rows are the (query token, head of the GQA group) pairs
// of one sequence and one KV head, so every K/V tile loaded into shared memory
// serves the whole group. Lane j of a warp scores key j of the tile against
// one row; the softmax is online (running max and sum), accumulation in f32,
// so no score matrix is ever stored.
//
// query_start[s] .. query_start[s+1] are sequence s's tokens in the step;
// seq_lens[s] counts its tokens in the cache after the step (the step's
// tokens are the last ones); a sequence of length 0 (a CUDA-graph padding
// row) sees no key. With part_ml == nullptr the rows are finished and written
// as bf16 to `out` ([num_tokens, num_heads * head_dim]); otherwise the
// unnormalised partial (max, sum, acc) of this key range goes to the split-K
// workspace at index `split` (see paged_attention_split).
__device__ __forceinline__ void attend(
    bf16* out, float* part_out, float* part_ml, int split, int num_splits,
    int num_tokens, const bf16* qkv, const bf16* k_cache, const bf16* v_cache,
    const int* block_tables, const int* query_start, const int* seq_lens,
    int seq, int kvh, int max_blocks, int stride, int num_heads,
    int num_kv_heads, int head_dim, int block_size, float scale)
{
    __shared__ float qs[ATTN_ROWS][ATTN_MAX_DIM];
    __shared__ float ks[ATTN_KEYS][ATTN_MAX_DIM + 1];  // +1: lanes read rows conflict-free
    __shared__ float vs[ATTN_KEYS][ATTN_MAX_DIM];

    int group = num_heads / num_kv_heads;
    int q0 = query_start[seq];
    int query_len = query_start[seq + 1] - q0;
    int seq_len = seq_lens[seq];
    int row0 = blockIdx.x * ATTN_ROWS;
    int rows = min(ATTN_ROWS, query_len * group - row0);
    if (rows <= 0) return;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int out_width = num_heads * head_dim;

    // Scaled queries of this tile into shared memory.
    for (int k = threadIdx.x; k < rows * head_dim; k += blockDim.x) {
        int r = k / head_dim, d = k % head_dim;
        int t = (row0 + r) / group, g = (row0 + r) % group;
        const bf16* q = qkv + (size_t)(q0 + t) * stride + (kvh * group + g) * head_dim;
        qs[r][d] = bf16_to_f32(q[d]) * scale;
    }
    // The last query position of the tile bounds the keys it can see; a
    // split sees only its own whole tiles of the sequence's keys.
    int last_t = (row0 + rows - 1) / group;
    int key_end = min(seq_len, seq_len - query_len + last_t + 1);
    int part_len = (seq_len + num_splits - 1) / num_splits;
    part_len = (part_len + ATTN_KEYS - 1) / ATTN_KEYS * ATTN_KEYS;
    int key_begin = split * part_len;
    key_end = min(key_end, key_begin + part_len);

    const int per_warp = ATTN_ROWS / ATTN_WARPS;
    float m[per_warp], l[per_warp], acc[per_warp][ATTN_MAX_DIM / 32];
#pragma unroll
    for (int i = 0; i < per_warp; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
#pragma unroll
        for (int c = 0; c < ATTN_MAX_DIM / 32; c++) acc[i][c] = 0.0f;
    }
    int width = num_kv_heads * head_dim;
    const int* table = block_tables + (size_t)seq * max_blocks;

    for (int k0 = key_begin; k0 < key_end; k0 += ATTN_KEYS) {
        __syncthreads();  // the previous tile is no longer read
        for (int k = threadIdx.x; k < ATTN_KEYS * head_dim; k += blockDim.x) {
            int j = k / head_dim, d = k % head_dim;
            int p = k0 + j;
            float kv = 0.0f, vv = 0.0f;
            if (p < key_end) {
                size_t slot = (size_t)table[p / block_size] * block_size + p % block_size;
                size_t at = slot * width + (size_t)kvh * head_dim + d;
                kv = bf16_to_f32(k_cache[at]);
                vv = bf16_to_f32(v_cache[at]);
            }
            ks[j][d] = kv;
            vs[j][d] = vv;
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < per_warp; i++) {
            int r = warp + i * ATTN_WARPS;
            if (r >= rows) break;
            int qpos = seq_len - query_len + (row0 + r) / group;
            int p = k0 + lane;
            float s = -INFINITY;
            if (p < key_end && p <= qpos) {
                s = 0.0f;
                for (int d = 0; d < head_dim; d++) s += qs[r][d] * ks[lane][d];
            }
            float m_new = fmaxf(m[i], warp_max(s));
            if (m_new == -INFINITY) continue;  // nothing visible yet
            float pj = s == -INFINITY ? 0.0f : __expf(s - m_new);
            float alpha = m[i] == -INFINITY ? 0.0f : __expf(m[i] - m_new);
            l[i] = l[i] * alpha + warp_sum(pj);
            m[i] = m_new;
#pragma unroll
            for (int c = 0; c < ATTN_MAX_DIM / 32; c++) acc[i][c] *= alpha;
            for (int j = 0; j < ATTN_KEYS; j++) {
                float w = __shfl_sync(0xffffffffu, pj, j);
#pragma unroll
                for (int c = 0; c < ATTN_MAX_DIM / 32; c++) {
                    int d = lane + 32 * c;
                    if (d < head_dim) acc[i][c] += w * vs[j][d];
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < per_warp; i++) {
        int r = warp + i * ATTN_WARPS;
        if (r >= rows) break;
        int t = (row0 + r) / group, h = kvh * group + (row0 + r) % group;
        if (part_ml == nullptr) {
            bf16* o = out + (size_t)(q0 + t) * out_width + h * head_dim;
            float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
#pragma unroll
            for (int c = 0; c < ATTN_MAX_DIM / 32; c++) {
                int d = lane + 32 * c;
                if (d < head_dim) o[d] = f32_to_bf16(acc[i][c] * inv);
            }
        } else {
            // Every (split, token, head) is written, an empty split as
            // (-inf, 0, 0), so the reduction never reads a stale partial.
            size_t at = ((size_t)split * num_tokens + q0 + t) * num_heads + h;
            if (lane == 0) {
                part_ml[2 * at] = m[i];
                part_ml[2 * at + 1] = l[i];
            }
#pragma unroll
            for (int c = 0; c < ATTN_MAX_DIM / 32; c++) {
                int d = lane + 32 * c;
                if (d < head_dim) part_out[at * head_dim + d] = acc[i][c];
            }
        }
    }
}

// Paged attention, one block per (row tile, KV head, sequence): grid
// (row tiles, num_kv_heads, num_seqs).
extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) paged_attention(
    bf16* out, const bf16* qkv, const bf16* k_cache, const bf16* v_cache,
    const int* block_tables, const int* query_start, const int* seq_lens,
    int max_blocks, int stride, int num_heads, int num_kv_heads,
    int head_dim, int block_size, float scale)
{
    attend(out, nullptr, nullptr, 0, 1, 0, qkv, k_cache, v_cache, block_tables,
           query_start, seq_lens, blockIdx.z, blockIdx.y, max_blocks, stride,
           num_heads, num_kv_heads, head_dim, block_size, scale);
}

// Split-K paged attention (flash-decoding): grid (row tiles, num_kv_heads,
// num_seqs * num_splits), block z = seq * num_splits + split. Each sequence's
// keys are cut into num_splits ranges of whole 32-key tiles (the range length
// is computed here from seq_lens, so a CUDA graph with a fixed num_splits
// still divides every sequence evenly); each block leaves its range's
// unnormalised partial in f32: part_ml[split][token][head] = (max, sum) and
// part_out[split][token][head][head_dim]. paged_attention_reduce merges them.
extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) paged_attention_split(
    float* part_out, float* part_ml, int num_splits, int num_tokens,
    const bf16* qkv, const bf16* k_cache, const bf16* v_cache,
    const int* block_tables, const int* query_start, const int* seq_lens,
    int max_blocks, int stride, int num_heads, int num_kv_heads,
    int head_dim, int block_size, float scale)
{
    int seq = blockIdx.z / num_splits, split = blockIdx.z % num_splits;
    attend(nullptr, part_out, part_ml, split, num_splits, num_tokens, qkv,
           k_cache, v_cache, block_tables, query_start, seq_lens, seq,
           blockIdx.y, max_blocks, stride, num_heads, num_kv_heads, head_dim,
           block_size, scale);
}

// Merges the split-K partials (log-sum-exp): out = sum_s e^(m_s - M) acc_s /
// sum_s e^(m_s - M) l_s with M = max_s m_s. Grid (num_tokens, num_heads),
// head_dim threads or more. A row no split saw (M = -inf: a padding row of
// length 0) is written as zeros, like paged_attention does.
extern "C" __global__ void paged_attention_reduce(
    bf16* out, const float* part_out, const float* part_ml, int num_splits,
    int num_tokens, int num_heads, int head_dim)
{
    int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    if (d >= head_dim) return;
    size_t row = (size_t)t * num_heads + h, split_stride = (size_t)num_tokens * num_heads;
    float big = -INFINITY;
    for (int s = 0; s < num_splits; s++) big = fmaxf(big, part_ml[2 * (s * split_stride + row)]);
    float num = 0.0f, den = 0.0f;
    if (big != -INFINITY) {
        for (int s = 0; s < num_splits; s++) {
            size_t at = s * split_stride + row;
            float m = part_ml[2 * at];
            if (m == -INFINITY) continue;
            float w = __expf(m - big);
            den += w * part_ml[2 * at + 1];
            num += w * part_out[at * head_dim + d];
        }
    }
    float v = den > 0.0f ? num / den : 0.0f;
    out[(size_t)t * num_heads * head_dim + (size_t)h * head_dim + d] = f32_to_bf16(v);
}
