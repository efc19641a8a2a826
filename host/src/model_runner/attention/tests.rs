use std::collections::HashMap;

use super::plan::AttnPlan;
use super::*;
use crate::model_runner::kv_cache::{KvCacheShape, KvDtype};

/// Deterministic pseudo-random values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Textbook attention in f64 on contiguous K/V, `[ctx, kv_heads * hd]`.
fn naive(q: &[f32], k: &[f32], v: &[f32], pos: usize, head: usize, dims: AttnDims) -> Vec<f32> {
    let hd = dims.head_dim;
    let g = head / dims.group();
    let kvw = dims.num_kv_heads * hd;
    let s: Vec<f64> = (0..=pos)
        .map(|j| {
            (0..hd)
                .map(|d| q[d] as f64 * k[j * kvw + g * hd + d] as f64)
                .sum::<f64>()
                / (hd as f64).sqrt()
        })
        .collect();
    let m = s.iter().cloned().fold(f64::MIN, f64::max);
    let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let z: f64 = e.iter().sum();
    (0..hd)
        .map(|d| {
            (0..=pos)
                .map(|j| e[j] / z * v[j * kvw + g * hd + d] as f64)
                .sum::<f64>() as f32
        })
        .collect()
}

/// 6 query heads on 2 KV heads, and blocks of 12 tokens, so block pieces
/// straddle the 128-token chunks' borders.
const DIMS: AttnDims = AttnDims {
    num_heads: 6,
    num_kv_heads: 2,
    head_dim: 8,
    block_size: 12,
};
/// SmolLM2's 64-wide heads (the vector kernels' width): in blocks of 16,
/// whose pieces are whole 16-key groups, and of 12, whose are not.
const WIDE: [AttnDims; 2] = [
    AttnDims {
        head_dim: 64,
        block_size: 16,
        ..DIMS
    },
    AttnDims {
        head_dim: 64,
        ..DIMS
    },
];
const MAX_MODEL_LEN: usize = 320;

/// Sequences' contexts in a cache, their blocks scattered.
struct Fixture {
    cache: KvCache,
    tables: Vec<Vec<u32>>,
    /// The shapes.
    dims: AttnDims,
    /// Per sequence: its K and V, `[ctx, kv_heads * hd]`, as the cache
    /// holds them (rounded to its type).
    kv: Vec<(Vec<f32>, Vec<f32>)>,
}

impl Fixture {
    fn new(contexts: &[usize], dtype: KvDtype, dims: AttnDims) -> Fixture {
        let bs = dims.block_size;
        let num_blocks = 48;
        let shape = KvCacheShape {
            num_layers: 1,
            num_kv_heads: dims.num_kv_heads,
            head_dim: dims.head_dim,
            block_size: bs,
            dtype,
        };
        let mut cache = KvCache::new(shape, num_blocks).unwrap();
        let kvw = dims.num_kv_heads * dims.head_dim;
        let mut next = 0;
        let mut tables = Vec::new();
        let mut kv = Vec::new();
        for (s, &ctx) in contexts.iter().enumerate() {
            let table: Vec<u32> = (0..ctx.div_ceil(bs))
                .map(|_| {
                    next += 1;
                    (next * 29 % num_blocks) as u32
                })
                .collect();
            let (k, v) = (
                values(ctx * kvw, 10 + s as u64),
                values(ctx * kvw, 20 + s as u64),
            );
            for p in 0..ctx {
                let row = p * kvw..(p + 1) * kvw;
                cache.write(0, table[p / bs] as usize, p % bs, &k[row.clone()], &v[row]);
            }
            // What the cache holds, rounded by the `half` crate.
            let round = |x: Vec<f32>| -> Vec<f32> {
                match dtype {
                    KvDtype::F32 => x,
                    KvDtype::F16 => x.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect(),
                    KvDtype::Bf16 => x
                        .iter()
                        .map(|&x| half::bf16::from_f32(x).to_f32())
                        .collect(),
                }
            };
            tables.push(table);
            kv.push((round(k), round(v)));
        }
        Fixture {
            cache,
            tables,
            dims,
            kv,
        }
    }

    /// The query of sequence `seq` at `pos`: the same in every step.
    fn query(&self, seq: usize, pos: usize) -> Vec<f32> {
        values(
            self.dims.num_heads * self.dims.head_dim,
            1000 * seq as u64 + pos as u64,
        )
    }

    /// One step of the last `query_len` tokens of each `(seq, query_len)`,
    /// planned for `plan_threads` and run on `threads`: the outputs by
    /// (seq, pos), and the plan.
    fn step(
        &self,
        step: &[(usize, usize)],
        plan_threads: usize,
        threads: usize,
    ) -> (HashMap<(usize, usize), Vec<f32>>, AttnPlan) {
        let dims = self.dims;
        let width = dims.num_heads * dims.head_dim;
        let mut seqs = Vec::new();
        let mut q = Vec::new();
        let mut tables = Vec::new();
        for &(seq, query_len) in step {
            let ctx = self.kv[seq].0.len() / (dims.num_kv_heads * dims.head_dim);
            seqs.push(SeqSpan {
                token_start: q.len() / width,
                query_len,
                context_len: ctx,
            });
            for pos in ctx - query_len..ctx {
                q.extend(self.query(seq, pos));
            }
            tables.push(&self.tables[seq][..]);
        }
        let mut plan = AttnPlan::default();
        plan.build(&seqs, dims, plan_threads);
        let pool = ThreadPool::new(threads);
        let mut out = vec![f32::NAN; q.len()];
        let mut scratch = AttnScratch::new(dims, threads, MAX_MODEL_LEN);
        let args = AttnArgs {
            cache: &self.cache,
            layer: 0,
            seqs: &seqs,
            block_tables: &tables,
            plan: &plan,
            q: &q,
            q_stride: width,
        };
        paged_attention(&pool, dims, &args, &mut out, &mut scratch);
        let mut by_query = HashMap::new();
        for (&(seq, _), span) in step.iter().zip(&seqs) {
            for qi in 0..span.query_len {
                let t = span.token_start + qi;
                by_query.insert(
                    (seq, span.pos(qi)),
                    out[t * width..(t + 1) * width].to_vec(),
                );
            }
        }
        (by_query, plan)
    }
}

/// Every plan shape — per KV head, per query head, and one item per
/// chunk merged after — on one to three threads gives textbook attention
/// over the K/V the cache holds, and a query gets the same bits in every
/// step and plan it is part of, whatever the cache's element type and with
/// SmolLM2's 64-wide heads too, where the vector kernels' own paths run (the
/// half-width chunk widened once for a prefill's queries, three heads
/// sharing each row) beside a decode's.
#[test]
fn every_plan_gives_textbook_attention_and_the_same_bits() {
    for dims in [DIMS].iter().chain(&WIDE) {
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16] {
            every_plan_agrees(dtype, *dims);
        }
    }
}

fn every_plan_agrees(dtype: KvDtype, dims: AttnDims) {
    // A decode over 300 tokens (three chunks), a 150-token prefill, a
    // five-token tail of a 20-token context, and the last 50 tokens of the
    // 300, whose 16-query items straddle the chunk border at 256.
    let fx = Fixture::new(&[300, 150, 20], dtype, dims);
    let steps: [&[(usize, usize)]; 5] = [
        &[(0, 1), (1, 150), (2, 5)],
        &[(0, 50), (2, 5)],
        &[(0, 1), (2, 5)],
        &[(2, 5)],
        &[(2, 1)],
    ];
    let hd = dims.head_dim;
    let mut first: HashMap<(usize, usize), Vec<f32>> = HashMap::new();
    let (mut split, mut per_kv, mut per_head) = (false, false, false);
    for step in steps {
        for (plan_threads, threads) in [(1, 1), (1, 3), (2, 2), (3, 3), (2, 1)] {
            let (outs, plan) = fx.step(step, plan_threads, threads);
            split |= !plan.split.is_empty();
            per_kv |= plan.split.is_empty() && plan.items.iter().all(|it| it.heads == 3);
            per_head |= plan.items.iter().all(|it| it.heads == 1);
            for (&(seq, pos), out) in &outs {
                let q = fx.query(seq, pos);
                let (k, v) = &fx.kv[seq];
                for h in 0..dims.num_heads {
                    let want = naive(&q[h * hd..(h + 1) * hd], k, v, pos, h, dims);
                    for (d, want) in want.iter().enumerate() {
                        let got = out[h * hd + d];
                        assert!(
                            (got - want).abs() < 1e-5,
                            "{dims:?} {dtype:?} {step:?} seq {seq} pos {pos} head {h}: {got} vs {want}"
                        );
                    }
                }
                let first = first.entry((seq, pos)).or_insert_with(|| out.clone());
                let same = out
                    .iter()
                    .zip(first.iter())
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{dims:?} {dtype:?} seq {seq} pos {pos} changed in step {step:?} planned for {plan_threads} on {threads} threads"
                );
            }
        }
    }
    assert!(
        split && per_kv && per_head,
        "a plan shape was not exercised"
    );
}

/// The split shape: a small decode batch over long contexts gets one item
/// per (query, KV head, chunk), two per thread at least; a batch with
/// more queries than the partials buffer holds, or short contexts, does
/// not.
#[test]
fn small_decode_batches_over_long_contexts_split_by_chunk() {
    let decode = |ctx: usize, token_start: usize| SeqSpan {
        token_start,
        query_len: 1,
        context_len: ctx,
    };
    let mut plan = AttnPlan::default();
    plan.build(&[decode(300, 0)], DIMS, 2);
    assert_eq!(plan.split.len(), 1);
    assert_eq!(plan.items.len(), 3 * 2, "3 chunks x 2 KV heads");
    assert!(plan.items.iter().all(|it| it.heads == 3));
    plan.build(&[decode(100, 0)], DIMS, 2);
    assert!(
        plan.split.is_empty(),
        "one chunk x 2 KV heads is one item per thread"
    );
    assert!(plan.items.iter().all(|it| it.heads == 1));
    let many: Vec<SeqSpan> = (0..SPLIT_MAX_QUERIES + 1).map(|i| decode(300, i)).collect();
    plan.build(&many, DIMS, 8);
    assert!(plan.split.is_empty());
}
