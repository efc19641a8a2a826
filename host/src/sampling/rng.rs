//! A small, fast, well-known PRNG for per-request sampling: xoshiro256** seeded
//! through splitmix64 (Blackman and Vigna, <https://prng.di.unimi.it/>).
//!
//! Written here rather than pulled from a crate so that a seed's token sequence
//! is fixed by this file alone and cannot change with a dependency upgrade.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::time::{SystemTime, UNIX_EPOCH};

/// splitmix64: expands one 64-bit seed into well-mixed words; its recommended
/// use is seeding xoshiro so that nearby seeds give unrelated states.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator starting from `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64-bit output.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// xoshiro256**: 256 bits of state, period 2^256 - 1, passes BigCrush.
#[derive(Debug, Clone)]
pub struct Xoshiro256StarStar {
    s: [u64; 4],
}

impl Xoshiro256StarStar {
    /// A generator whose whole output sequence is determined by `seed`.
    pub fn from_seed(seed: u64) -> Self {
        let mut sm = SplitMix64::new(seed);
        // splitmix64 never yields four zero words in a row, so the state is
        // never the all-zero fixed point.
        Self {
            s: [sm.next_u64(), sm.next_u64(), sm.next_u64(), sm.next_u64()],
        }
    }

    /// A generator seeded from OS randomness (std's per-process random hash
    /// keys) mixed with the clock, for requests that gave no seed.
    pub fn from_entropy() -> Self {
        let mut h = RandomState::new().build_hasher();
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        h.write_u128(nanos);
        h.write_u32(std::process::id());
        Self::from_seed(h.finish())
    }

    /// The next 64-bit output.
    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// A uniform double in [0, 1) built from the top 53 bits, so every value
    /// is an exact multiple of 2^-53.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Expected words below were computed with an independent Python
    // transcription of the reference C code (arbitrary-precision ints masked
    // to 64 bits), not with this file.

    #[test]
    fn splitmix64_matches_reference_vector() {
        let mut sm = SplitMix64::new(1234567);
        let got: Vec<u64> = (0..5).map(|_| sm.next_u64()).collect();
        assert_eq!(
            got,
            vec![
                6457827717110365317,
                3203168211198807973,
                9817491932198370423,
                4593380528125082431,
                16408922859458223821
            ]
        );
    }

    #[test]
    fn xoshiro_seeded_via_splitmix_matches_reference_vector() {
        let mut g = Xoshiro256StarStar::from_seed(0);
        let got: Vec<u64> = (0..4).map(|_| g.next_u64()).collect();
        assert_eq!(
            got,
            vec![
                11091344671253066420,
                13793997310169335082,
                1900383378846508768,
                7684712102626143532
            ]
        );
        let mut g = Xoshiro256StarStar::from_seed(42);
        let got: Vec<u64> = (0..4).map(|_| g.next_u64()).collect();
        assert_eq!(
            got,
            vec![
                1546998764402558742,
                6990951692964543102,
                12544586762248559009,
                17057574109182124193
            ]
        );
    }

    #[test]
    fn same_seed_same_stream_different_seed_differs() {
        let a: Vec<u64> = {
            let mut g = Xoshiro256StarStar::from_seed(42);
            (0..8).map(|_| g.next_u64()).collect()
        };
        let b: Vec<u64> = {
            let mut g = Xoshiro256StarStar::from_seed(42);
            (0..8).map(|_| g.next_u64()).collect()
        };
        let c: Vec<u64> = {
            let mut g = Xoshiro256StarStar::from_seed(43);
            (0..8).map(|_| g.next_u64()).collect()
        };
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn next_f64_is_in_unit_interval_with_mean_one_half() {
        let mut g = Xoshiro256StarStar::from_seed(7);
        let n = 100_000;
        let mut sum = 0.0;
        for _ in 0..n {
            let x = g.next_f64();
            assert!((0.0..1.0).contains(&x));
            sum += x;
        }
        // Standard error of the mean is 1/sqrt(12 n) ~ 0.0009.
        assert!((sum / n as f64 - 0.5).abs() < 0.005);
    }
}
