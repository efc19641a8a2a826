//! Device check, part 1 (needs a CUDA GPU; `--features cuda`): every kernel
//! against a CPU reference on fresh random inputs. Outputs are pre-filled
//! with NaN, so an element a kernel forgets to write fails the check.
//! Run by scripts/gpu-check.sh; on a machine without a GPU these fail (they
//! never skip).

use host::cuda::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use host::cuda::device::{grid, Gpu};
use host::cuda::philox::philox4x32_10;
use host::kernels::RopeTable;

/// Device sampling: exact top-k with ties, the softmax, the CPU reference.
#[path = "gpu_kernels/sampling.rs"]
mod sampling;

fn gpu() -> Gpu {
    let dir = std::env::temp_dir().join("host-gpu-check-ptx");
    Gpu::new(0, &dir).unwrap_or_else(|e| panic!("device check needs a CUDA GPU: {e}"))
}

/// A small xorshift generator: fresh inputs per run (seeded from the clock,
/// printed so a failure can be replayed with GPU_CHECK_SEED).
struct Rng(u64);

impl Rng {
    fn new() -> Rng {
        let seed = std::env::var("GPU_CHECK_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
                    | 1
            });
        eprintln!("GPU_CHECK_SEED={seed}");
        Rng(seed)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}

/// f32 to bf16 bits, round to nearest even.
fn bf(v: f32) -> u16 {
    let u = v.to_bits();
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

fn unbf(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

fn bfs(v: &[f32]) -> Vec<u16> {
    v.iter().map(|&x| bf(x)).collect()
}

/// bf16 round trip, as the device stores a value.
fn round(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| unbf(bf(x))).collect()
}

const NAN_BF16: u16 = 0x7fc0;

/// Every element written and finite, and within `rel` of the reference
/// (relative to the reference's largest magnitude, plus bf16's own rounding).
fn check(what: &str, got: &[f32], want: &[f32], rel: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
    let mut worst = 0.0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.is_finite(),
            "{what}: element {i} is {g} (not written, or overflow)"
        );
        let err = (g - w).abs() / (scale * rel + w.abs() * (1.0 / 128.0));
        worst = worst.max(err);
        assert!(
            err <= 1.0,
            "{what}: element {i}: got {g}, want {w} (scale {scale})"
        );
    }
    eprintln!(
        "{what}: {} elements, worst error {:.2} of the bound",
        got.len(),
        worst
    );
}

#[test]
fn fused_add_rms_norm_matches_the_cpu() {
    let g = gpu();
    let s = &g.stream;
    let mut r = Rng::new();
    let (rows, hidden, eps) = (37usize, 4096usize, 1e-5f32);
    let x = round(&r.vec(rows * hidden, 2.0));
    let res = round(&r.vec(rows * hidden, 2.0));
    let w = r.vec(hidden, 1.0);
    for add in [0i32, 1] {
        let mut out = s.memcpy_stod(&vec![NAN_BF16; rows * hidden]).unwrap();
        let mut res_d = s.memcpy_stod(&bfs(&res)).unwrap();
        let x_d = s.memcpy_stod(&bfs(&x)).unwrap();
        let w_d = s.memcpy_stod(&w).unwrap();
        let hid = hidden as i32;
        let mut b = s.launch_builder(g.func("fused_add_rms_norm"));
        b.arg(&mut out)
            .arg(&mut res_d)
            .arg(&x_d)
            .arg(&w_d)
            .arg(&eps)
            .arg(&hid)
            .arg(&add);
        unsafe { b.launch(grid(rows as u32, 256)) }.unwrap();
        let got: Vec<f32> = s.memcpy_dtov(&out).unwrap().into_iter().map(unbf).collect();
        let got_res: Vec<f32> = s
            .memcpy_dtov(&res_d)
            .unwrap()
            .into_iter()
            .map(unbf)
            .collect();
        let mut want = vec![0.0; rows * hidden];
        let mut want_res = vec![0.0; rows * hidden];
        for t in 0..rows {
            let row: Vec<f32> = (0..hidden)
                .map(|i| x[t * hidden + i] + if add == 1 { res[t * hidden + i] } else { 0.0 })
                .collect();
            let row = round(&row);
            let ms = row
                .iter()
                .map(|v| f64::from(*v) * f64::from(*v))
                .sum::<f64>()
                / hidden as f64;
            let inv = 1.0 / (ms + f64::from(eps)).sqrt();
            for i in 0..hidden {
                want_res[t * hidden + i] = row[i];
                want[t * hidden + i] = (f64::from(row[i]) * inv) as f32 * w[i];
            }
        }
        check(
            &format!("fused_add_rms_norm add={add} residual"),
            &got_res,
            &want_res,
            1e-3,
        );
        check(&format!("fused_add_rms_norm add={add}"), &got, &want, 1e-2);
    }
}

#[test]
fn rope_matches_the_cpu_table() {
    let g = gpu();
    let s = &g.stream;
    let mut r = Rng::new();
    let (tokens, heads, kv_heads, head_dim, theta) =
        (19usize, 8usize, 2usize, 128usize, 500_000.0f32);
    let stride = (heads + 2 * kv_heads) * head_dim;
    let qkv = round(&r.vec(tokens * stride, 1.0));
    let positions: Vec<i32> = (0..tokens)
        .map(|i| (r.next() % 100_000) as i32 * (i as i32 % 3))
        .collect();
    let mut d = s.memcpy_stod(&bfs(&qkv)).unwrap();
    let pos_d = s.memcpy_stod(&positions).unwrap();
    let (st, nh, nkv, hd) = (
        stride as i32,
        heads as i32,
        kv_heads as i32,
        head_dim as i32,
    );
    let mut b = s.launch_builder(g.func("rope_qk"));
    b.arg(&mut d)
        .arg(&pos_d)
        .arg(&st)
        .arg(&nh)
        .arg(&nkv)
        .arg(&hd)
        .arg(&hd)
        .arg(&theta);
    unsafe { b.launch(grid(tokens as u32, 256)) }.unwrap();
    let got: Vec<f32> = s.memcpy_dtov(&d).unwrap().into_iter().map(unbf).collect();
    let table = RopeTable::new(head_dim, theta, 16);
    let mut want = qkv.clone();
    for t in 0..tokens {
        for h in 0..heads + kv_heads {
            let at = t * stride + h * head_dim;
            table.apply(&mut want[at..at + head_dim], positions[t] as usize);
        }
    }
    check("rope_qk", &got, &want, 1e-2);
    // The values are untouched.
    let v0 = (heads + kv_heads) * head_dim;
    assert_eq!(&got[v0..stride], &qkv[v0..stride], "rope_qk wrote into V");
}

#[test]
fn silu_and_mul_and_gather_match_the_cpu() {
    let g = gpu();
    let s = &g.stream;
    let mut r = Rng::new();
    let (tokens, inter) = (23usize, 14_336usize);
    let gu = round(&r.vec(tokens * 2 * inter, 4.0));
    let gu_d = s.memcpy_stod(&bfs(&gu)).unwrap();
    let mut out = s.memcpy_stod(&vec![NAN_BF16; tokens * inter]).unwrap();
    let (i_, n_) = (inter as i32, tokens as i32);
    let mut b = s.launch_builder(g.func("silu_and_mul"));
    b.arg(&mut out).arg(&gu_d).arg(&i_).arg(&n_);
    unsafe { b.launch(grid(1024, 256)) }.unwrap();
    let got: Vec<f32> = s.memcpy_dtov(&out).unwrap().into_iter().map(unbf).collect();
    let want: Vec<f32> = (0..tokens * inter)
        .map(|k| {
            let (t, i) = (k / inter, k % inter);
            let (gate, up) = (gu[t * 2 * inter + i], gu[t * 2 * inter + inter + i]);
            gate / (1.0 + (-gate).exp()) * up
        })
        .collect();
    check("silu_and_mul", &got, &want, 1e-2);

    let rows: Vec<i32> = (0..tokens).map(|_| (r.next() % 2000) as i32).collect();
    let table = round(&r.vec(2000 * 64, 1.0));
    let table_d = s.memcpy_stod(&bfs(&table)).unwrap();
    let rows_d = s.memcpy_stod(&rows).unwrap();
    let mut out = s.memcpy_stod(&vec![NAN_BF16; tokens * 64]).unwrap();
    let mut b = s.launch_builder(g.func("gather_rows"));
    let w = 64i32;
    b.arg(&mut out).arg(&table_d).arg(&rows_d).arg(&w);
    unsafe { b.launch(grid(tokens as u32, 64)) }.unwrap();
    let got: Vec<f32> = s.memcpy_dtov(&out).unwrap().into_iter().map(unbf).collect();
    let want: Vec<f32> = rows
        .iter()
        .flat_map(|&r| table[r as usize * 64..(r as usize + 1) * 64].to_vec())
        .collect();
    assert_eq!(got, want, "gather_rows");
}

#[test]
fn paged_attention_matches_naive_attention_for_prefill_and_decode() {
    use host::cuda::metadata::AttentionMetadata;
    use host::model_runner::{ModelInput, SeqInput};
    let g = gpu();
    let s = &g.stream;
    let mut r = Rng::new();
    let (heads, kvh, hd, bs) = (32usize, 8usize, 128usize, 16usize);
    let width = kvh * hd;
    let stride = (heads + 2 * kvh) * hd;
    // (query_len, context_len): decodes, a whole prefill, chunked prefills.
    let shapes = [
        (1usize, 1usize),
        (1, 300),
        (17, 17),
        (40, 100),
        (1, 2049),
        (64, 64),
        (5, 1000),
    ];
    let num_blocks: usize = shapes.iter().map(|&(_, c)| c.div_ceil(bs)).sum::<usize>() + 3;
    // Physical blocks handed out in a shuffled order.
    let mut free: Vec<u32> = (0..num_blocks as u32).collect();
    for i in (1..free.len()).rev() {
        free.swap(i, r.next() as usize % (i + 1));
    }
    let mut input = ModelInput::default();
    for &(q, c) in &shapes {
        let table: Vec<u32> = (0..c.div_ceil(bs)).map(|_| free.pop().unwrap()).collect();
        for p in c - q..c {
            input.token_ids.push(0);
            input.positions.push(p as u32);
        }
        input.seqs.push(SeqInput {
            query_len: q,
            context_len: c,
            block_table: table,
        });
    }
    let n = input.token_ids.len();
    let meta = AttentionMetadata::build(&input, bs, 0);
    let qkv = round(&r.vec(n * stride, 1.0));
    let kc = round(&r.vec(num_blocks * bs * width, 1.0));
    let vc = round(&r.vec(num_blocks * bs * width, 1.0));
    let mut kc_d = s.memcpy_stod(&bfs(&kc)).unwrap();
    let mut vc_d = s.memcpy_stod(&bfs(&vc)).unwrap();
    let qkv_d = s.memcpy_stod(&bfs(&qkv)).unwrap();
    let slots = s.memcpy_stod(&meta.slot_mapping).unwrap();
    let (st, nh, nk, hdi, bsi) = (
        stride as i32,
        heads as i32,
        kvh as i32,
        hd as i32,
        bs as i32,
    );
    let mut b = s.launch_builder(g.func("reshape_and_cache"));
    b.arg(&mut kc_d)
        .arg(&mut vc_d)
        .arg(&qkv_d)
        .arg(&slots)
        .arg(&st)
        .arg(&nh)
        .arg(&nk)
        .arg(&hdi);
    unsafe { b.launch(grid(n as u32, 256)) }.unwrap();
    // The cache as the reference sees it: the step's K/V at their slots.
    let (mut kref, mut vref) = (kc.clone(), vc.clone());
    for (t, &slot) in meta.slot_mapping.iter().enumerate() {
        let k0 = t * stride + heads * hd;
        kref[slot as usize * width..(slot as usize + 1) * width]
            .copy_from_slice(&qkv[k0..k0 + width]);
        vref[slot as usize * width..(slot as usize + 1) * width]
            .copy_from_slice(&qkv[k0 + width..k0 + 2 * width]);
    }
    let got_k: Vec<f32> = s
        .memcpy_dtov(&kc_d)
        .unwrap()
        .into_iter()
        .map(unbf)
        .collect();
    assert_eq!(got_k, kref, "reshape_and_cache: K cache");

    let mut out = s.memcpy_stod(&vec![NAN_BF16; n * heads * hd]).unwrap();
    let tables = s.memcpy_stod(&meta.block_tables).unwrap();
    let qs = s.memcpy_stod(&meta.query_start).unwrap();
    let lens = s.memcpy_stod(&meta.seq_lens).unwrap();
    let mb = meta.max_blocks as i32;
    let scale = 1.0 / (hd as f32).sqrt();
    let tiles = (meta.max_query_len * heads / kvh).div_ceil(16) as u32;
    let cfg = LaunchConfig {
        grid_dim: (tiles, kvh as u32, shapes.len() as u32),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = s.launch_builder(g.func("paged_attention"));
    b.arg(&mut out)
        .arg(&qkv_d)
        .arg(&kc_d)
        .arg(&vc_d)
        .arg(&tables)
        .arg(&qs)
        .arg(&lens);
    b.arg(&mb)
        .arg(&st)
        .arg(&nh)
        .arg(&nk)
        .arg(&hdi)
        .arg(&bsi)
        .arg(&scale);
    unsafe { b.launch(cfg) }.unwrap();
    let got: Vec<f32> = s.memcpy_dtov(&out).unwrap().into_iter().map(unbf).collect();

    let mut want = vec![0.0f32; n * heads * hd];
    let mut t0 = 0;
    for seq in &input.seqs {
        for t in 0..seq.query_len {
            let qpos = seq.context_len - seq.query_len + t;
            for h in 0..heads {
                let kv = h / (heads / kvh);
                let q = &qkv[(t0 + t) * stride + h * hd..][..hd];
                let slot = |p: usize| seq.block_table[p / bs] as usize * bs + p % bs;
                let scores: Vec<f64> = (0..=qpos)
                    .map(|p| {
                        let k = &kref[slot(p) * width + kv * hd..][..hd];
                        q.iter()
                            .zip(k)
                            .map(|(a, b)| f64::from(*a) * f64::from(*b))
                            .sum::<f64>()
                            * f64::from(scale)
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..hd {
                    let v: f64 = (0..=qpos)
                        .map(|p| e[p] * f64::from(vref[slot(p) * width + kv * hd + d]))
                        .sum();
                    want[((t0 + t) * heads + h) * hd + d] = (v / z) as f32;
                }
            }
        }
        t0 += seq.query_len;
    }
    check("paged_attention", &got, &want, 2e-2);
}

#[test]
fn philox_on_the_device_matches_the_host_reference() {
    let g = gpu();
    let s = &g.stream;
    let mut r = Rng::new();
    let n = 1000;
    let inputs: Vec<u32> = (0..6 * n).map(|_| r.next() as u32).collect();
    let in_d = s.memcpy_stod(&inputs).unwrap();
    let mut out: CudaSlice<u32> = s.alloc_zeros(4 * n).unwrap();
    let ni = n as i32;
    let mut b = s.launch_builder(g.func("philox_test"));
    b.arg(&mut out).arg(&in_d).arg(&ni);
    unsafe { b.launch(grid((n as u32).div_ceil(128), 128)) }.unwrap();
    let got = s.memcpy_dtov(&out).unwrap();
    for i in 0..n {
        let c = &inputs[6 * i..6 * i + 6];
        let want = philox4x32_10([c[0], c[1], c[2], c[3]], [c[4], c[5]]);
        assert_eq!(&got[4 * i..4 * i + 4], &want, "philox block {i}");
    }
}
