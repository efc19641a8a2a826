//! `engine:typical-p`: locally typical sampling (Meister et al., 2022) over
//! the host's top-k candidates. Per row, with the candidates' probabilities
//! renormalised to sum to 1 and `H` their entropy, candidates are ranked by
//! how far their surprisal is from the expected one, `|-ln p - H|`; the
//! smallest prefix of that ranking whose probability reaches `mass` is kept
//! and one is drawn from it (renormalised) with the row's uniform.
//!
//! Option `mass` (default 0.9, in (0, 1]): a tiny mass keeps only the most
//! typical candidate, 1 keeps every candidate.

use plugin_sdk::sampler::{Candidates, CandidatesExt, Metadata, Sampler};

/// The configured mass.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TypicalP {
    mass: f64,
}

/// Parses the options object; the error names the key and its range.
fn parse_mass(options: &str) -> Result<f64, String> {
    let v: serde_json::Value =
        serde_json::from_str(options).map_err(|e| format!("options are not JSON: {e}"))?;
    match v.get("mass") {
        None => Ok(0.9),
        Some(m) => m
            .as_f64()
            .filter(|m| *m > 0.0 && *m <= 1.0)
            .ok_or_else(|| format!("option mass = {m} must be a number in (0, 1]")),
    }
}

/// The position (into `logprobs`) locally typical sampling picks with
/// uniform `u` keeping `mass`.
pub fn typical_choice(logprobs: &[f32], mass: f64, u: f32) -> u32 {
    let max = logprobs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        // No probabilities (every candidate masked): the host's ranking.
        return 0;
    }
    let weights: Vec<f64> = logprobs.iter().map(|&l| f64::from(l - max).exp()).collect();
    let total: f64 = weights.iter().sum();
    let p: Vec<f64> = weights.iter().map(|w| w / total).collect();
    let entropy: f64 = p.iter().filter(|&&p| p > 0.0).map(|&p| -p * p.ln()).sum();
    let distance = |i: usize| {
        if p[i] > 0.0 {
            (-p[i].ln() - entropy).abs()
        } else {
            f64::INFINITY
        }
    };
    let mut order: Vec<usize> = (0..p.len()).collect();
    // Stable: equally typical candidates keep the host's (likelihood) order.
    order.sort_by(|&a, &b| distance(a).total_cmp(&distance(b)));
    let mut kept = 0.0;
    let mut n = 0;
    for &i in &order {
        kept += p[i];
        n += 1;
        if kept >= mass {
            break;
        }
    }
    let target = f64::from(u) * kept;
    let mut cum = 0.0;
    for &i in &order[..n] {
        cum += p[i];
        if cum > target {
            return i as u32;
        }
    }
    order[n - 1] as u32
}

impl Sampler for TypicalP {
    fn metadata() -> Metadata {
        Metadata::new("engine:typical-p", "0.1.0").option(
            "mass",
            "probability mass of the most typical candidates kept, in (0, 1]",
            "0.9",
        )
    }

    fn new(options: &str) -> Result<Self, String> {
        Ok(TypicalP {
            mass: parse_mass(options)?,
        })
    }

    fn choose(&mut self, b: &Candidates) -> Result<Vec<u32>, String> {
        Ok((0..b.ids.len())
            .map(|row| typical_choice(b.row_logprobs(row), self.mass, b.uniforms[row]))
            .collect())
    }
}

plugin_sdk::export_sampler!(TypicalP);

#[cfg(test)]
mod tests {
    use super::*;

    fn ln(p: &[f64]) -> Vec<f32> {
        p.iter().map(|p| p.ln() as f32).collect()
    }

    #[test]
    fn a_tiny_mass_keeps_the_most_typical_candidate_not_the_most_likely() {
        // H = 0.7*0.357 + 0.2*1.609 + 0.1*2.303 = 0.80; surprisals 0.36,
        // 1.61, 2.30: the most likely is also the most typical here...
        assert_eq!(typical_choice(&ln(&[0.7, 0.2, 0.1]), 1e-6, 0.99), 0);
        // ...but with a flat tail the entropy is high and a middle candidate
        // is closer to it: p = [0.4, 0.15, 0.15, 0.1 x3]; H = 1.63;
        // surprisals 0.92, 1.90, 1.90, 2.30 -> 1.90 (position 1) is closest.
        let lp = ln(&[0.4, 0.15, 0.15, 0.1, 0.1, 0.1]);
        assert_eq!(typical_choice(&lp, 1e-6, 0.0), 1);
        assert_eq!(typical_choice(&lp, 1e-6, 0.99), 1);
    }

    #[test]
    fn the_kept_set_grows_with_mass_and_the_uniform_picks_within_it() {
        let lp = ln(&[0.4, 0.15, 0.15, 0.1, 0.1, 0.1]);
        // H = 1.63; distances |-ln p - H|: 0.71, 0.27, 0.27, 0.68, 0.68,
        // 0.68, so the typicality order is 1, 2, 3, 4, 5, 0.
        // mass 0.3 keeps {1, 2}: u below one half picks 1, above picks 2.
        assert_eq!(typical_choice(&lp, 0.3, 0.2), 1);
        assert_eq!(typical_choice(&lp, 0.3, 0.8), 2);
        // Mass 1 keeps everything; u near 1 reaches the least typical (0).
        assert_eq!(typical_choice(&lp, 1.0, 0.999), 0);
    }

    #[test]
    fn candidates_are_renormalised_and_masked_rows_pick_the_first() {
        // The same distribution scaled (top-k of a larger vocabulary).
        let a = ln(&[0.4, 0.15, 0.15, 0.1, 0.1, 0.1]);
        let b: Vec<f32> = a.iter().map(|l| l - 3.0).collect();
        for u in [0.0, 0.3, 0.7, 0.99] {
            assert_eq!(typical_choice(&a, 0.5, u), typical_choice(&b, 0.5, u));
        }
        assert_eq!(typical_choice(&[f32::NEG_INFINITY; 3], 0.9, 0.5), 0);
    }

    #[test]
    fn options_are_checked() {
        assert_eq!(TypicalP::new("{}").unwrap().mass, 0.9);
        assert_eq!(TypicalP::new("{\"mass\": 0.5}").unwrap().mass, 0.5);
        assert!(TypicalP::new("{\"mass\": 0}")
            .unwrap_err()
            .contains("(0, 1]"));
        assert!(TypicalP::new("{\"mass\": \"a\"}").is_err());
    }
}
