//! Rotary position embedding (RoPE) in GGUF / llama.cpp's "normal" layout:
//! adjacent pairs `(x[2i], x[2i+1])` are rotated by `position * freq_i`,
//! `freq_i = theta^(-2i / rope_dim)`, for `i < rope_dim / 2`; dimensions
//! past `rope_dim` are left alone.

/// Precomputed `cos` / `sin` of every (position, pair) angle.
pub struct RopeTable {
    /// Rotated dimensions (even).
    rope_dim: usize,
    /// `freq_i` for each pair, for positions beyond the table.
    freqs: Vec<f64>,
    /// `[position][pair]` cosines.
    cos: Vec<f32>,
    /// `[position][pair]` sines.
    sin: Vec<f32>,
    /// Positions covered by `cos` / `sin`.
    max_positions: usize,
}

impl RopeTable {
    /// Tables for positions `0 .. max_positions`; later positions are
    /// computed on the fly. Angles are computed in f64 so that large
    /// positions keep full f32 accuracy. An odd `rope_dim` rotates
    /// `rope_dim - 1` dimensions.
    pub fn new(rope_dim: usize, theta: f32, max_positions: usize) -> RopeTable {
        let pairs = rope_dim / 2;
        let freqs: Vec<f64> = (0..pairs)
            .map(|i| f64::from(theta).powf(-2.0 * i as f64 / rope_dim as f64))
            .collect();
        let mut cos = Vec::with_capacity(max_positions * pairs);
        let mut sin = Vec::with_capacity(max_positions * pairs);
        for p in 0..max_positions {
            for &f in &freqs {
                let (s, c) = (p as f64 * f).sin_cos();
                cos.push(c as f32);
                sin.push(s as f32);
            }
        }
        RopeTable {
            rope_dim: pairs * 2,
            freqs,
            cos,
            sin,
            max_positions,
        }
    }

    /// Rotates one head (at least `rope_dim` long) for `position`.
    ///
    /// Panics if `head` is shorter than `rope_dim` (a caller bug).
    pub fn apply(&self, head: &mut [f32], position: usize) {
        assert!(
            head.len() >= self.rope_dim,
            "RoPE: head of {} values is shorter than rope_dim {}",
            head.len(),
            self.rope_dim
        );
        let pairs = self.rope_dim / 2;
        let head = &mut head[..self.rope_dim];
        if position < self.max_positions {
            let at = position * pairs..(position + 1) * pairs;
            rotate(head, &self.cos[at.clone()], &self.sin[at]);
        } else {
            let (c, s): (Vec<f32>, Vec<f32>) = self
                .freqs
                .iter()
                .map(|&f| {
                    let (s, c) = (position as f64 * f).sin_cos();
                    (c as f32, s as f32)
                })
                .unzip();
            rotate(head, &c, &s);
        }
    }
}

/// `(x0, x1) -> (x0 c - x1 s, x0 s + x1 c)` for each adjacent pair.
fn rotate(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    for ((pair, &c), &s) in head.chunks_exact_mut(2).zip(cos).zip(sin) {
        let (x0, x1) = (pair[0], pair[1]);
        pair[0] = x0 * c - x1 * s;
        pair[1] = x0 * s + x1 * c;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::Rng;

    /// Straight from the definition, in f64.
    fn reference(head: &[f32], position: usize, rope_dim: usize, theta: f32) -> Vec<f32> {
        let mut out = head.to_vec();
        for i in 0..rope_dim / 2 {
            let angle = position as f64 * f64::from(theta).powf(-2.0 * i as f64 / rope_dim as f64);
            let (x0, x1) = (f64::from(head[2 * i]), f64::from(head[2 * i + 1]));
            out[2 * i] = (x0 * angle.cos() - x1 * angle.sin()) as f32;
            out[2 * i + 1] = (x0 * angle.sin() + x1 * angle.cos()) as f32;
        }
        out
    }

    #[test]
    fn matches_the_definition_inside_and_beyond_the_table() {
        let mut rng = Rng::new(3);
        let table = RopeTable::new(64, 100_000.0, 100);
        for position in [0, 1, 7, 99, 100, 5000] {
            let head = rng.normals(64);
            let mut got = head.clone();
            table.apply(&mut got, position);
            for (g, e) in got.iter().zip(reference(&head, position, 64, 100_000.0)) {
                assert!((g - e).abs() < 1e-5, "position {position}: {g} vs {e}");
            }
        }
    }

    #[test]
    fn partial_rotation_leaves_the_tail_alone_and_keeps_norms() {
        let mut rng = Rng::new(4);
        let table = RopeTable::new(32, 10_000.0, 16);
        let head = rng.normals(64);
        let mut got = head.clone();
        table.apply(&mut got, 9);
        assert_eq!(&got[32..], &head[32..]);
        for i in 0..16 {
            let before = head[2 * i].hypot(head[2 * i + 1]);
            let after = got[2 * i].hypot(got[2 * i + 1]);
            assert!((before - after).abs() < 1e-5);
        }
        // Position 0 is the identity.
        let mut same = head.clone();
        table.apply(&mut same, 0);
        assert_eq!(same, head);
    }
}
