//! `{{name}}`: a sampler for the `host` engine.
//!
//! Once per engine step the host hands the sampler, for every row it
//! samples (one per request), that request's `k` most likely tokens (after
//! its penalties, logits processors and temperature), most likely first,
//! with their log-probabilities over the whole vocabulary, and one uniform
//! in [0, 1) from the request's own seeded generator (a plugin has no
//! randomness of its own, so a seeded request stays reproducible). The
//! sampler answers one candidate position per row.
//!
//! This one is top-n sampling: it draws among the `n` most likely
//! candidates (option `n`, default 3) in proportion to their probability.
//! `n = 1` is greedy. Greedy requests (temperature 0) reach a sampler too,
//! at temperature 1: a sampler that wants them greedy picks position 0.
//!
//! Build: `host plugin build`. Load: `host --plugin <the .wasm> --set
//! plugins.sampler={{name}} generate --prompt "Hello" --temperature 1`.

use plugin_sdk::sampler::{Candidates, CandidatesExt, Metadata, Sampler};

/// The sampler.
pub struct TopN {
    /// Candidates drawn among, per row (at most the host's `k`).
    n: usize,
}

/// The position chosen among `logprobs` (most likely first) by the uniform
/// `u`, drawing among the first `n` in proportion to their probability.
pub fn top_n_choice(logprobs: &[f32], n: usize, u: f32) -> u32 {
    let n = n.clamp(1, logprobs.len().max(1));
    let probs: Vec<f64> = logprobs[..n].iter().map(|&l| f64::from(l).exp()).collect();
    let total: f64 = probs.iter().sum();
    let mut target = f64::from(u) * total;
    for (i, p) in probs.iter().enumerate() {
        if target < *p {
            return i as u32;
        }
        target -= p;
    }
    (n - 1) as u32
}

impl Sampler for TopN {
    /// Name (`plugins.sampler = "{{name}}"`), version and options.
    fn metadata() -> Metadata {
        Metadata::new("{{name}}", env!("CARGO_PKG_VERSION")).option(
            "n",
            "candidates drawn among, most likely first (at least 1; 1 is greedy)",
            "3",
        )
    }

    /// Reads option `n` from the options JSON object (`{}` when none).
    fn new(options: &str) -> Result<Self, String> {
        let options: serde_json::Value =
            serde_json::from_str(options).map_err(|e| format!("options are not JSON: {e}"))?;
        let n = match options.get("n") {
            None => 3,
            Some(v) => v
                .as_u64()
                .filter(|&n| n >= 1)
                .ok_or_else(|| format!("option n must be a whole number >= 1, got {v}"))?
                as usize,
        };
        plugin_sdk::info!("started: top-{n} sampling");
        Ok(TopN { n })
    }

    /// One position below `batch.k` per row (`batch.ids`).
    fn choose(&mut self, batch: &Candidates) -> Result<Vec<u32>, String> {
        Ok((0..batch.ids.len())
            .map(|row| top_n_choice(batch.row_logprobs(row), self.n, batch.uniforms[row]))
            .collect())
    }
}

// Exports `TopN` as the component's `engine:plugins/sampler`.
plugin_sdk::export_sampler!(TopN);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_in_proportion_among_the_first_n() {
        let lp: Vec<f32> = [0.5f32, 0.3, 0.2].iter().map(|p| p.ln()).collect();
        assert_eq!(top_n_choice(&lp, 1, 0.99), 0, "n = 1 is greedy");
        assert_eq!(top_n_choice(&lp, 2, 0.1), 0);
        assert_eq!(top_n_choice(&lp, 2, 0.9), 1, "renormalised over two");
        assert_eq!(top_n_choice(&lp, 3, 0.95), 2);
    }

    #[test]
    fn options_are_checked() {
        assert_eq!(TopN::new("{}").unwrap().n, 3);
        assert_eq!(TopN::new(r#"{"n": 1}"#).unwrap().n, 1);
        assert!(TopN::new(r#"{"n": 0}"#).is_err());
    }
}
