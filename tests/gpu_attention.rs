//! Device check, split-K decode attention (needs a CUDA GPU; `--features
//! cuda`): `paged_attention_split` + `paged_attention_reduce` against a CPU
//! softmax reference and against the one-pass `paged_attention`, for a
//! long-context decode batch with a padding row, at several split counts
//! and through `PagedAttention::launch` (the runner's path, its own split
//! count). Outputs and partials are pre-filled with NaN, so anything left
//! unwritten fails. Run by scripts/gpu-check.sh.

use host::cuda::attention::{num_splits, PagedAttention, StepShape};
use host::cuda::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use host::cuda::device::Gpu;
use host::cuda::metadata::AttentionMetadata;
use host::model::dummy;
use host::model_runner::{ModelInput, SeqInput};

const BLOCK: usize = 16;
const NAN_BF16: u16 = 0x7fc0;

fn bf(v: f32) -> u16 {
    let u = v.to_bits();
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

fn unbf(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// Random bf16 values in [-1, 1) from a seeded xorshift (the seed is
/// printed; GPU_CHECK_SEED replays it).
fn random_bf16(n: usize, state: &mut u64) -> Vec<u16> {
    (0..n)
        .map(|_| {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            bf((*state >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        })
        .collect()
}

#[test]
fn split_k_decode_matches_one_pass_attention_and_a_cpu_softmax() {
    let dir = std::env::temp_dir().join("host-gpu-check-ptx");
    let g = Gpu::new(0, &dir).unwrap_or_else(|e| panic!("device check needs a CUDA GPU: {e}"));
    let s = &g.stream;
    let c = dummy::preset("llama-3.1-8b").unwrap();
    let (heads, kvh, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let (width, stride) = (kvh * hd, (heads + 2 * kvh) * hd);
    let mut seed = std::env::var("GPU_CHECK_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x9e37_79b9_7f4a_7c15u64);
    eprintln!("GPU_CHECK_SEED={seed}");

    // Decodes at contexts 5000, 1, 300 and 4097 (each over its own blocks),
    // padded with one empty row as a captured graph would be.
    let contexts = [5000usize, 1, 300, 4097];
    let mut input = ModelInput::default();
    let mut next_block = 0u32;
    for &ctx in &contexts {
        let n = ctx.div_ceil(BLOCK) as u32;
        input.token_ids.push(0);
        input.positions.push(ctx as u32 - 1);
        input.seqs.push(SeqInput {
            query_len: 1,
            context_len: ctx,
            block_table: (next_block..next_block + n).collect(),
        });
        next_block += n;
    }
    let num_blocks = next_block as usize;
    let table_width = 5000usize.div_ceil(BLOCK);
    let meta = AttentionMetadata::build_fixed(&input, BLOCK, 1, table_width).unwrap();
    let layout = meta.layout();
    let (tokens, seqs) = (layout.tokens, layout.seqs);
    let step = s.memcpy_stod(&meta.pack(&input)).unwrap();
    let qkv = random_bf16(tokens * stride, &mut seed);
    let kc = random_bf16(num_blocks * BLOCK * width, &mut seed);
    let vc = random_bf16(num_blocks * BLOCK * width, &mut seed);
    let (qkv_d, kc_d, vc_d) = (
        s.memcpy_stod(&qkv).unwrap(),
        s.memcpy_stod(&kc).unwrap(),
        s.memcpy_stod(&vc).unwrap(),
    );

    // Reference: every key of the sequence is visible to its one query.
    let scale = 1.0 / (hd as f64).sqrt();
    let mut want = vec![0.0f32; tokens * heads * hd];
    for (t, seq) in input.seqs.iter().enumerate() {
        for h in 0..heads {
            let q = &qkv[t * stride + h * hd..][..hd];
            let kv_off = (h / (heads / kvh)) * hd;
            let at = |p: usize| {
                let b = seq.block_table[p / BLOCK] as usize;
                (b * BLOCK + p % BLOCK) * width + kv_off
            };
            let scores: Vec<f64> = (0..seq.context_len)
                .map(|p| {
                    (0..hd)
                        .map(|d| f64::from(unbf(q[d])) * f64::from(unbf(kc[at(p) + d])))
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let big = scores.iter().cloned().fold(f64::MIN, f64::max);
            let w: Vec<f64> = scores.iter().map(|x| (x - big).exp()).collect();
            let sum: f64 = w.iter().sum();
            for d in 0..hd {
                let o: f64 = (0..seq.context_len)
                    .map(|p| w[p] * f64::from(unbf(vc[at(p) + d])))
                    .sum();
                want[(t * heads + h) * hd + d] = (o / sum) as f32;
            }
        }
    }
    let check = |what: &str, out: &CudaSlice<u16>| {
        let got: Vec<f32> = s.memcpy_dtov(out).unwrap().into_iter().map(unbf).collect();
        // Two bf16 ulps of the reference, plus a floor for values near 0
        // (a long context's output averages thousands of values: ~1e-2).
        let mut worst = 0.0f32;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g.is_finite(),
                "{what}: element {i} not written or not finite"
            );
            let err = (g - w).abs() / (w.abs() / 128.0 + 1e-4);
            assert!(err <= 1.0, "{what}: element {i} is {g}, want {w}");
            worst = worst.max(err);
        }
        eprintln!("{what}: worst error {worst:.2} of the bound");
        // The padding row (seq_len 0) is written as zeros.
        assert!(
            got[(tokens - 1) * heads * hd..].iter().all(|&v| v == 0.0),
            "{what}: padding row"
        );
    };

    let (tables, qs, lens) = (
        step.slice(layout.block_tables()),
        step.slice(layout.query_start()),
        step.slice(layout.seq_lens()),
    );
    let (kc_v, vc_v) = (kc_d.slice(..), vc_d.slice(..));
    let ints = |v: usize| v as i32;
    let (tw, st, nh, nk, hdi, bs) = (
        ints(table_width),
        ints(stride),
        ints(heads),
        ints(kvh),
        ints(hd),
        ints(BLOCK),
    );
    let fscale = scale as f32;
    let cfg = |z: usize| LaunchConfig {
        grid_dim: (1, kvh as u32, z as u32),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut out = s.memcpy_stod(&vec![NAN_BF16; tokens * heads * hd]).unwrap();
    let mut b = s.launch_builder(g.func("paged_attention"));
    b.arg(&mut out)
        .arg(&qkv_d)
        .arg(&kc_v)
        .arg(&vc_v)
        .arg(&tables);
    b.arg(&qs)
        .arg(&lens)
        .arg(&tw)
        .arg(&st)
        .arg(&nh)
        .arg(&nk)
        .arg(&hdi);
    b.arg(&bs).arg(&fscale);
    unsafe { b.launch(cfg(seqs)) }.unwrap();
    check("one pass", &out);

    for splits in [2usize, 7, 64] {
        let rows = splits * tokens * heads;
        let mut part_out = s.memcpy_stod(&vec![f32::NAN; rows * hd]).unwrap();
        let mut part_ml = s.memcpy_stod(&vec![f32::NAN; rows * 2]).unwrap();
        let mut out = s.memcpy_stod(&vec![NAN_BF16; tokens * heads * hd]).unwrap();
        let (ns, nt) = (ints(splits), ints(tokens));
        let mut b = s.launch_builder(g.func("paged_attention_split"));
        b.arg(&mut part_out).arg(&mut part_ml).arg(&ns).arg(&nt);
        b.arg(&qkv_d)
            .arg(&kc_v)
            .arg(&vc_v)
            .arg(&tables)
            .arg(&qs)
            .arg(&lens);
        b.arg(&tw)
            .arg(&st)
            .arg(&nh)
            .arg(&nk)
            .arg(&hdi)
            .arg(&bs)
            .arg(&fscale);
        unsafe { b.launch(cfg(seqs * splits)) }.unwrap();
        let mut b = s.launch_builder(g.func("paged_attention_reduce"));
        b.arg(&mut out)
            .arg(&part_out)
            .arg(&part_ml)
            .arg(&ns)
            .arg(&nt);
        b.arg(&nh).arg(&hdi);
        let reduce = LaunchConfig {
            grid_dim: (tokens as u32, heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe { b.launch(reduce) }.unwrap();
        let ml = s.memcpy_dtov(&part_ml).unwrap();
        assert!(
            ml.iter().all(|v| !v.is_nan()),
            "{splits} splits: a partial (max, sum) was not written"
        );
        check(&format!("{splits} splits"), &out);
    }

    // The runner's path: PagedAttention picks the split count itself.
    let mut attn = PagedAttention::new(&g, &c, BLOCK).unwrap();
    let shape = StepShape {
        num_tokens: tokens,
        num_seqs: seqs,
        max_query_len: 1,
        width: table_width,
        max_seq_len: 5000,
    };
    let chosen = attn.splits(&shape);
    let sms = g
        .ctx
        .attribute(
            host::cuda::cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
        .unwrap() as usize;
    assert_eq!(chosen, num_splits(seqs, kvh, 1, 5000, sms));
    assert!(
        chosen > 1,
        "5 decodes x 8 KV heads on {sms} SMs should split"
    );
    let mut out = s.memcpy_stod(&vec![NAN_BF16; tokens * heads * hd]).unwrap();
    attn.launch(
        &g, &mut out, &qkv_d, &kc_v, &vc_v, &tables, &qs, &lens, &shape,
    )
    .unwrap();
    check(&format!("PagedAttention::launch ({chosen} splits)"), &out);
}
