//! Device sampling (`DeviceSampler` over kernels/sampling.cu) against the
//! CPU sampler: top-k keeps exactly k tokens (ties: lowest ids), draws
//! follow the softmax, and on random logits greedy equals the CPU's argmax
//! and every draw is the host Philox Gumbel-max over the CPU sampler's
//! support (`host_draw`'s, which also draws it on the host).

use host::cuda::device::Gpu;
use host::cuda::host_draw::{device_support, draw_like_device};
use host::cuda::philox::gumbel;
use host::cuda::sampler::{DeviceRow, DeviceSampler, SparseBias};
use host::sampling::select;

use super::{gpu, Rng};

/// A device sampler for up to `max_rows` rows.
fn sampler(g: &Gpu, max_rows: usize) -> DeviceSampler {
    DeviceSampler::new(g, max_rows).unwrap()
}

/// Samples `rows` of `logits` on the device from a fresh copy of the logits
/// (the sampler scales sampled rows in place).
fn device_sample(
    g: &Gpu,
    s: &mut DeviceSampler,
    logits: &[f32],
    vocab: usize,
    rows: &[DeviceRow],
    biases: &[SparseBias],
) -> Vec<u32> {
    let mut l = g.stream.memcpy_stod(logits).unwrap();
    s.sample(g, &mut l, vocab, rows, biases).unwrap()
}

/// A sampled row with `temperature` and the given cuts.
fn row(
    temperature: f32,
    top_k: i32,
    top_p: f32,
    min_p: f32,
    seed: u64,
    position: u32,
) -> DeviceRow {
    DeviceRow {
        temperature,
        top_k,
        top_p,
        min_p,
        seed,
        position,
    }
}

/// The device's draw by the host references: Gumbel-max with the host
/// Philox noise over `support`; the winner and its margin over the runner-up.
fn gumbel_reference(logits: &[f32], p: &DeviceRow, support: &[u32]) -> (u32, f64) {
    let mut scores: Vec<(f64, u32)> = support
        .iter()
        .map(|&t| {
            let x = f64::from(logits[t as usize]) / f64::from(p.temperature);
            (x + gumbel(p.seed, p.position, t), t)
        })
        .collect();
    scores.sort_by(|a, b| b.0.total_cmp(&a.0));
    let margin = scores.get(1).map_or(f64::INFINITY, |s| scores[0].0 - s.0);
    (scores[0].1, margin)
}

/// The CPU's support at slightly looser cuts (top-p + 1e-4, min-p
/// × (1 − 1e-4)): the device may also draw from it, where its f32 mass sums
/// and its tempered min-p comparison round otherwise than the CPU's f64
/// sums and raw-logit comparison. Top-k's cut is exact on both.
fn loose_support(logits: &[f32], p: &DeviceRow) -> Vec<u32> {
    let looser = DeviceRow {
        top_p: (p.top_p + 1e-4).min(1.0),
        min_p: p.min_p * (1.0 - 1e-4),
        ..*p
    };
    device_support(logits, &looser)
}

#[test]
fn top_k_keeps_exactly_k_tokens_with_ties_lowest_ids_first() {
    let g = gpu();
    let mut r = Rng::new();
    let vocab = 4096usize;
    // Below every tie: random in [-9, -1].
    let background =
        |r: &mut Rng| -> Vec<f32> { r.vec(vocab, 4.0).iter().map(|v| v - 5.0).collect() };
    let with = |r: &mut Rng, set: &[(usize, f32)]| {
        let mut l = background(r);
        for &(t, v) in set {
            l[t] = v;
        }
        l
    };
    let ties: Vec<(usize, f32)> = (100..200).map(|t| (t, 5.0)).collect();
    let above_and_ties: Vec<(usize, f32)> = ties.iter().copied().chain([(7, 6.0)]).collect();
    // Tied ids in several 1024-id chunks of the kernel's prefix count.
    let spread: Vec<(usize, f32)> = [4095, 3000, 2500, 1000, 1023, 1024]
        .into_iter()
        .map(|t| (t, 2.0))
        .chain([(3500, 3.0)])
        .collect();
    // (name, logits, top_k, top_p, min_p, the tokens that may be drawn)
    let cases: Vec<(&str, Vec<f32>, i32, f32, f32, Vec<u32>)> = vec![
        (
            "ties only",
            with(&mut r, &ties),
            3,
            1.0,
            0.0,
            vec![100, 101, 102],
        ),
        (
            "one above",
            with(&mut r, &above_and_ties),
            4,
            1.0,
            0.0,
            vec![7, 100, 101, 102],
        ),
        // top-p over the four keeps the ties it reaches (all of them here).
        (
            "with top-p",
            with(&mut r, &above_and_ties),
            4,
            0.9,
            0.0,
            vec![7, 100, 101, 102],
        ),
        (
            "with min-p",
            with(&mut r, &ties),
            2,
            1.0,
            0.5,
            vec![100, 101],
        ),
        (
            "all tied",
            vec![0.0; vocab],
            5,
            1.0,
            0.0,
            vec![0, 1, 2, 3, 4],
        ),
        (
            "chunks",
            with(&mut r, &spread),
            4,
            1.0,
            0.0,
            vec![1000, 1023, 1024, 3500],
        ),
    ];
    let per_case = 64usize;
    let mut logits = Vec::new();
    let mut rows = Vec::new();
    for (c, case) in cases.iter().enumerate() {
        for i in 0..per_case {
            logits.extend_from_slice(&case.1);
            rows.push(row(
                1.0,
                case.2,
                case.3,
                case.4,
                r.next(),
                (c * per_case + i) as u32,
            ));
        }
    }
    let mut s = sampler(&g, rows.len());
    let got = device_sample(&g, &mut s, &logits, vocab, &rows, &[]);
    for (c, (name, l, k, _, _, allowed)) in cases.iter().enumerate() {
        // The CPU keeps the same tokens (the hand-written set is the spec).
        assert_eq!(
            &device_support(l, &rows[c * per_case]),
            allowed,
            "{name}: the CPU's support"
        );
        let mut drawn: Vec<u32> = got[c * per_case..(c + 1) * per_case].to_vec();
        drawn.sort_unstable();
        drawn.dedup();
        assert!(
            drawn.len() <= *k as usize,
            "{name}: {} distinct tokens for top_k {k}: {drawn:?}",
            drawn.len()
        );
        // Each allowed token has probability >= 0.17: all of them show up.
        assert_eq!(&drawn, allowed, "{name}: drawn tokens");
    }
}

#[test]
fn device_draws_follow_the_softmax() {
    let g = gpu();
    let mut r = Rng::new();
    // p = (1, 2, 3, 4) / 10 at temperature 0.5 on logits ln(p) / 2.
    let logits: Vec<f32> = (1..=4).map(|i| (i as f32 / 10.0).ln() * 0.5).collect();
    let n = 8192usize;
    let rows: Vec<DeviceRow> = (0..n)
        .map(|i| row(0.5, 0, 1.0, 0.0, r.next(), i as u32))
        .collect();
    let all: Vec<f32> = logits.iter().copied().cycle().take(4 * n).collect();
    let mut s = sampler(&g, n);
    let got = device_sample(&g, &mut s, &all, 4, &rows, &[]);
    for t in 0..4u32 {
        let freq = got.iter().filter(|&&x| x == t).count() as f64 / n as f64;
        let want = f64::from(t + 1) / 10.0;
        // Standard error <= 0.0055: five of them.
        assert!(
            (freq - want).abs() < 0.028,
            "token {t}: frequency {freq}, want {want}"
        );
    }
}

#[test]
fn device_sampler_matches_the_cpu_reference() {
    let g = gpu();
    let mut r = Rng::new();
    let (n, vocab) = (64usize, 128_256usize);
    let raw = r.vec(n * vocab, 8.0);
    let mut logits = raw.clone();
    // (temperature, top_k, top_p, min_p); temperature 0 is greedy.
    let configs = [
        (0.0, 0, 1.0, 0.0),
        (0.7, 0, 1.0, 0.0),
        (1.0, 50, 1.0, 0.0),
        (1.0, 0, 0.8, 0.0),
        (1.0, 0, 1.0, 0.1),
        (1.2, 40, 0.9, 0.05),
        (1.3, 1, 1.0, 0.0),
        (0.9, 0, 0.3, 0.0),
    ];
    let rows: Vec<DeviceRow> = (0..n)
        .map(|i| {
            let (t, k, p, m) = configs[i % configs.len()];
            row(t, k, p, m, r.next(), 100 + i as u32)
        })
        .collect();
    // Ban each greedy row's argmax, and lift a random token of every
    // sampled row to 0.5 above its maximum in two halves (edits add up):
    // the answers must move with the edits. Top-k 1 must then draw it.
    let mut biases = Vec::new();
    for (i, p) in rows.iter().enumerate() {
        let row_l = &logits[i * vocab..(i + 1) * vocab];
        let argmax = select::argmax(row_l);
        if p.temperature == 0.0 {
            biases.push(SparseBias {
                row: i as u32,
                token: argmax as u32,
                value: f32::NEG_INFINITY,
            });
        } else {
            let t = (r.next() % vocab as u64) as u32;
            let half = (row_l[argmax] + 0.5 - row_l[t as usize]) / 2.0;
            biases.push(SparseBias {
                row: i as u32,
                token: t,
                value: half,
            });
            biases.push(SparseBias {
                row: i as u32,
                token: t,
                value: half,
            });
        }
    }
    let mut s = sampler(&g, n);
    let got = device_sample(&g, &mut s, &raw, vocab, &rows, &biases);
    for b in &biases {
        logits[b.row as usize * vocab + b.token as usize] += b.value;
    }
    let (mut sampled, mut compared, mut not_argmax) = (0, 0, 0);
    for (i, p) in rows.iter().enumerate() {
        let l = &logits[i * vocab..(i + 1) * vocab];
        let argmax = select::argmax(l) as u32;
        if p.temperature == 0.0 {
            assert_eq!(got[i], argmax, "greedy row {i}");
            continue;
        }
        sampled += 1;
        not_argmax += usize::from(got[i] != argmax);
        let support = device_support(l, p);
        let loose = loose_support(l, p);
        assert!(
            loose.binary_search(&got[i]).is_ok(),
            "row {i} {p:?}: token {} ({}) is outside the CPU's support",
            got[i],
            l[got[i] as usize]
        );
        // The exact winner where neither float noise in the score nor a
        // token at a cut-off can decide it.
        let (want, margin) = gumbel_reference(l, p, &support);
        if margin > 1e-3 && gumbel_reference(l, p, &loose).0 == want {
            assert_eq!(got[i], want, "row {i} {p:?}: the Philox Gumbel-max draw");
            // What a worker draws for this row when it samples on the host.
            assert_eq!(
                draw_like_device(l, p),
                want,
                "row {i} {p:?}: draw_like_device"
            );
            compared += 1;
        }
    }
    assert!(
        compared * 10 >= sampled * 9,
        "only {compared} of {sampled} sampled rows were clear-cut"
    );
    assert!(not_argmax > 0, "every sampled row drew its argmax");
    // Seeded draws: the same again, and the same for each request when the
    // batch is laid out in reverse.
    assert_eq!(
        device_sample(&g, &mut s, &raw, vocab, &rows, &biases),
        got,
        "seeded draws are not reproducible"
    );
    let rev_logits: Vec<f32> = raw.chunks(vocab).rev().flatten().copied().collect();
    let rev_rows: Vec<DeviceRow> = rows.iter().rev().copied().collect();
    let rev_biases: Vec<SparseBias> = biases
        .iter()
        .map(|b| SparseBias {
            row: (n - 1) as u32 - b.row,
            ..*b
        })
        .collect();
    let mut rev = device_sample(&g, &mut s, &rev_logits, vocab, &rev_rows, &rev_biases);
    rev.reverse();
    assert_eq!(
        rev, got,
        "a request's draw depends on its place in the batch"
    );
    // Another position is another draw.
    let moved: Vec<DeviceRow> = rows
        .iter()
        .map(|p| DeviceRow {
            position: p.position + 1,
            ..*p
        })
        .collect();
    let other = device_sample(&g, &mut s, &raw, vocab, &moved, &biases);
    assert!(
        other
            .iter()
            .zip(&got)
            .zip(&rows)
            .any(|((a, b), p)| p.temperature > 0.0 && a != b),
        "the next position drew the same tokens"
    );
}

#[test]
fn sparse_biases_and_bans_reach_the_logits() {
    let g = gpu();
    let (n, vocab) = (4usize, 1000usize);
    let mut l = g.stream.memcpy_stod(&vec![0.5f32; n * vocab]).unwrap();
    let bias = |row: u32, token: u32, value: f32| SparseBias { row, token, value };
    let biases = [
        bias(0, 7, 1.0),
        bias(0, 7, 2.0),
        bias(2, 999, f32::NEG_INFINITY),
        bias(3, 0, -3.0),
        bias(3, 1, 4.0),
        bias(1, 5, f32::NEG_INFINITY),
        bias(1, 5, 9.0),
    ];
    let greedy: Vec<DeviceRow> = (0..n).map(|i| row(0.0, 0, 1.0, 0.0, 0, i as u32)).collect();
    let mut s = sampler(&g, n);
    let ids = s.sample(&g, &mut l, vocab, &greedy, &biases).unwrap();
    let got = g.stream.memcpy_dtov(&l).unwrap();
    let mut want = vec![0.5f32; n * vocab];
    want[7] = 3.5; // both entries of the same token add up
    want[vocab + 5] = f32::NEG_INFINITY; // a ban stays a ban whatever is added
    want[2 * vocab + 999] = f32::NEG_INFINITY;
    want[3 * vocab] = -2.5;
    want[3 * vocab + 1] = 4.5;
    assert_eq!(
        got, want,
        "logits after the edits (greedy rows are not scaled)"
    );
    assert_eq!(ids, [7, 0, 0, 1], "greedy ids after the edits");
    // An edit outside the step is refused before anything runs.
    let err = s
        .sample(&g, &mut l, vocab, &greedy, &[bias(4, 0, 1.0)])
        .unwrap_err();
    assert!(err.to_string().contains("row 4 token 0"), "{err}");
}
