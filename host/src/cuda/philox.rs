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
/// request seeded with `seed` (24 random bits, as the kernel does).
pub fn sampler_uniform(seed: u64, position: u32, token: u32) -> f32 {
    let r = philox4x32_10([token, position, 0, 0], [seed as u32, (seed >> 32) as u32])[0];
    ((r >> 8) as f32 + 0.5) * (1.0 / 16_777_216.0)
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
        let mut sum = 0.0f64;
        for t in 0..10_000 {
            let u = sampler_uniform(42, 7, t);
            assert!(u > 0.0 && u < 1.0, "{u}");
            sum += f64::from(u);
        }
        let mean = sum / 10_000.0;
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
        assert_ne!(sampler_uniform(42, 7, 0), sampler_uniform(43, 7, 0));
        assert_ne!(sampler_uniform(42, 7, 0), sampler_uniform(42, 8, 0));
    }
}
