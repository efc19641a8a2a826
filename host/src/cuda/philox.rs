//! Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
//! 3", Random123), the counter-based generator the device sampler draws its
//! Gumbel noise from. This host copy is the reference the GPU check compares
//! the kernel against, and pins the constants to the published test vectors.

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Ten rounds on `counter` under `key`.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = u64::from(M0) * u64::from(c[0]);
        let p1 = u64::from(M1) * u64::from(c[2]);
        c = [
            (p1 >> 32) as u32 ^ c[1] ^ k[0],
            p1 as u32,
            (p0 >> 32) as u32 ^ c[3] ^ k[1],
            p0 as u32,
        ];
    }
    c
}

/// The uniform in (0, 1) the sampler derives for `token` at `position` of a
/// request seeded with `seed`: the top 24 bits m of the first Philox word,
/// u = (m + 0.5) / 2^24 (exact in f64).
pub fn sampler_uniform(seed: u64, position: u32, token: u32) -> f64 {
    let r = philox4x32_10([token, position, 0, 0], [seed as u32, (seed >> 32) as u32])[0];
    uniform_of_bits(r >> 8)
}

/// u = (m + 0.5) / 2^24 for 24 bits `m`: strictly inside (0, 1).
fn uniform_of_bits(m: u32) -> f64 {
    (f64::from(m) + 0.5) / 16_777_216.0
}

/// The Gumbel noise -ln(-ln u) the kernel adds to `token`'s tempered logit
/// (`gumbel_noise` in sampling.cu), in f64: the device check's reference.
/// -ln u is taken by `ln_1p` near 1, where the likeliest winners are.
pub fn gumbel(seed: u64, position: u32, token: u32) -> f64 {
    gumbel_of_uniform(sampler_uniform(seed, position, token))
}

fn gumbel_of_uniform(u: f64) -> f64 {
    let e = if u < 0.5 {
        -u.ln()
    } else {
        -(-(1.0 - u)).ln_1p()
    };
    -e.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's known-answer vectors for philox4x32-10.
    #[test]
    fn matches_the_random123_known_answers() {
        assert_eq!(
            philox4x32_10([0, 0, 0, 0], [0, 0]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn uniforms_are_strictly_inside_the_unit_interval_and_spread() {
        // The extremes of the 24 bits: in one f32, (2^24 - 1 + 0.5) / 2^24
        // would round to exactly 1 and its noise to +inf.
        assert!(uniform_of_bits(0) > 0.0 && uniform_of_bits((1 << 24) - 1) < 1.0);
        for m in [0, 1, (1 << 23) - 1, 1 << 23, (1 << 24) - 1] {
            assert!(gumbel_of_uniform(uniform_of_bits(m)).is_finite(), "m = {m}");
        }
        let mut sum = 0.0f64;
        for t in 0..10_000 {
            let u = sampler_uniform(42, 7, t);
            assert!(u > 0.0 && u < 1.0, "{u}");
            sum += u;
        }
        let mean = sum / 10_000.0;
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
        assert_ne!(sampler_uniform(42, 7, 0), sampler_uniform(43, 7, 0));
        assert_ne!(sampler_uniform(42, 7, 0), sampler_uniform(42, 8, 0));
    }

    #[test]
    fn the_noise_is_standard_gumbel() {
        // Mean: the Euler-Mascheroni constant; variance pi^2 / 6. The
        // standard error of the mean over 100k draws is 0.004.
        let n = 100_000;
        let draws: Vec<f64> = (0..n).map(|t| gumbel(9, 3, t)).collect();
        let mean = draws.iter().sum::<f64>() / f64::from(n);
        let var = draws.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / f64::from(n);
        assert!((mean - 0.577_215_7).abs() < 0.02, "mean {mean}");
        assert!(
            (var - std::f64::consts::PI.powi(2) / 6.0).abs() < 0.05,
            "variance {var}"
        );
        // Both branches agree where they meet.
        let (lo, hi) = (uniform_of_bits((1 << 23) - 1), uniform_of_bits(1 << 23));
        assert!(gumbel_of_uniform(lo) < gumbel_of_uniform(hi));
        assert!(gumbel_of_uniform(hi) - gumbel_of_uniform(lo) < 1e-6);
    }

    #[test]
    fn gumbel_max_draws_from_the_softmax() {
        // argmax(l + g) over positions: frequencies of softmax([0, ln 2, ln 3]).
        let logits = [0.0, 2f64.ln(), 3f64.ln()];
        let n = 60_000u32;
        let mut counts = [0u32; 3];
        for pos in 0..n {
            let best = (0..3u32)
                .max_by(|&a, &b| {
                    let sa = logits[a as usize] + gumbel(5, pos, a);
                    let sb = logits[b as usize] + gumbel(5, pos, b);
                    sa.total_cmp(&sb)
                })
                .unwrap();
            counts[best as usize] += 1;
        }
        for (t, &c) in counts.iter().enumerate() {
            let want = (t + 1) as f64 / 6.0;
            let got = f64::from(c) / f64::from(n);
            // Standard error below 0.002.
            assert!((got - want).abs() < 0.01, "token {t}: {got} vs {want}");
        }
    }
}
