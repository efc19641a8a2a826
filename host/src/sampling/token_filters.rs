//! The request's own edits to its logits, applied before min_tokens and the
//! penalties in vLLM V1's order: the `allowed_token_ids` mask, then the
//! `bad_words` bans, then `logit_bias`.
//!
//! Like the penalties they record each logit they change in `saved`, so the
//! sampler still reports the raw model output's logprob of the chosen token.
//! The allow mask is the exception: recording the whole vocabulary would cost
//! more than the mask itself, and the chosen token is always an allowed one
//! (whose logit the mask keeps), unless every allowed token was banned too.
//! Token ids outside the row are skipped: the server refuses them, and a
//! stray one from elsewhere must not panic the worker.

use super::penalties::{overwrite, TokenHistory};

/// When `allowed` is set, sets every logit but those of the allowed tokens to
/// -inf (vLLM's `allowed_token_ids` mask). `kept` is scratch space.
pub fn apply_allowed_token_ids(
    logits: &mut [f32],
    allowed: Option<&[u32]>,
    kept: &mut Vec<(u32, f32)>,
) {
    let Some(allowed) = allowed else {
        return;
    };
    // Keeping the few allowed values and restoring them after one fill is
    // O(vocab + allowed) with no sort and no per-request state.
    kept.clear();
    kept.extend(
        allowed
            .iter()
            .filter_map(|&t| logits.get(t as usize).map(|&l| (t, l))),
    );
    logits.fill(f32::NEG_INFINITY);
    for &(t, l) in kept.iter() {
        logits[t as usize] = l;
    }
}

/// Bans (sets to -inf) the last token of every `bad_words` sequence whose
/// other tokens are the last tokens of the output so far, as vLLM's
/// `apply_bad_words` does: a one-token sequence is banned at every step, a
/// longer one only where it would be completed.
pub fn apply_bad_words(
    logits: &mut [f32],
    words: &[Vec<u32>],
    history: &TokenHistory,
    saved: &mut Vec<(u32, f32)>,
) {
    for word in words {
        if let Some((&last, prefix)) = word.split_last() {
            if history.output_ends_with(prefix) {
                overwrite(logits, last, |_| f32::NEG_INFINITY, saved);
            }
        }
    }
}

/// Adds each `logit_bias` entry to its token's logit (a banned token stays
/// banned: -inf plus a bias is -inf).
pub fn apply_logit_bias(logits: &mut [f32], bias: &[(u32, f32)], saved: &mut Vec<(u32, f32)>) {
    for &(token, b) in bias {
        overwrite(logits, token, |l| l + b, saved);
    }
}
