//! A logits processor's answer for one step (`logit-edits`): validated
//! whole before any edit is applied (rows in range, token ids below the
//! vocabulary, finite biases, parallel lists of equal length, allow-masks
//! of `ceil(vocab / 64)` words that allow at least one token), so a bad
//! answer changes nothing; the rows it fails (0.4) are taken out first,
//! their other edits ignored.

use super::wit::LogitEdits;
use super::Row;

/// 64-bit words in one row's allow-mask over `vocab` tokens.
pub fn mask_words_per_row(vocab: usize) -> usize {
    vocab.div_ceil(64)
}

/// Checks every edit before any is applied.
pub(super) fn validate(e: &LogitEdits, rows: usize, vocab: usize) -> Result<(), String> {
    if e.ban_rows.len() != e.ban_tokens.len() {
        return Err(format!(
            "{} ban rows but {} ban tokens",
            e.ban_rows.len(),
            e.ban_tokens.len()
        ));
    }
    if e.bias_rows.len() != e.bias_tokens.len() || e.bias_rows.len() != e.bias_values.len() {
        return Err("bias-rows, bias-tokens and bias-values differ in length".into());
    }
    let all_rows = e.ban_rows.iter().chain(&e.bias_rows);
    if let Some(r) = all_rows.copied().find(|&r| r as usize >= rows) {
        return Err(format!("row {r} is out of range (batch of {rows})"));
    }
    let all_tokens = e.ban_tokens.iter().chain(&e.bias_tokens);
    if let Some(t) = all_tokens.copied().find(|&t| t as usize >= vocab) {
        return Err(format!(
            "token id {t} is not below the vocabulary size {vocab}"
        ));
    }
    if let Some(v) = e.bias_values.iter().find(|v| !v.is_finite()) {
        return Err(format!("bias {v} is not finite (ban the token instead)"));
    }
    validate_masks(e, rows, vocab)
}

/// Checks the failed rows (0.4: `fail-rows`, `fail-messages`) and takes
/// them out of the edits: what else the answer says about a failed row is
/// ignored (its request will not be sampled), even where it is invalid.
pub(super) fn take_failures(e: &mut LogitEdits, rows: usize, vocab: usize) -> Result<(), String> {
    if e.fail_rows.len() != e.fail_messages.len() {
        return Err(format!(
            "{} fail rows but {} fail messages",
            e.fail_rows.len(),
            e.fail_messages.len()
        ));
    }
    if let Some(r) = e.fail_rows.iter().find(|&&r| r as usize >= rows) {
        return Err(format!("fail row {r} is out of range (batch of {rows})"));
    }
    if e.fail_rows.is_empty() {
        return Ok(());
    }
    let failed = e.fail_rows.clone();
    let kept = |r: &u32| !failed.contains(r);
    // Lists of unequal length are left whole, for `validate` to name.
    if e.ban_rows.len() == e.ban_tokens.len() {
        (e.ban_rows, e.ban_tokens) = e
            .ban_rows
            .iter()
            .zip(&e.ban_tokens)
            .filter(|(r, _)| kept(r))
            .unzip();
    }
    if e.bias_rows.len() == e.bias_tokens.len() && e.bias_rows.len() == e.bias_values.len() {
        let (rows_tokens, values): (Vec<(u32, u32)>, Vec<f32>) = e
            .bias_rows
            .iter()
            .zip(&e.bias_tokens)
            .zip(&e.bias_values)
            .filter(|((r, _), _)| kept(r))
            .map(|((&r, &t), &v)| ((r, t), v))
            .unzip();
        (e.bias_rows, e.bias_tokens) = rows_tokens.into_iter().unzip();
        e.bias_values = values;
    }
    let w = mask_words_per_row(vocab);
    if w > 0 && e.mask_words.len() == e.mask_rows.len() * w {
        let (mask_rows, words): (Vec<u32>, Vec<&[u64]>) = e
            .mask_rows
            .iter()
            .zip(e.mask_words.chunks(w))
            .filter(|(r, _)| kept(r))
            .unzip();
        e.mask_words = words.concat();
        e.mask_rows = mask_rows;
    }
    Ok(())
}

/// Checks the allow-masks: `mask_words_per_row(vocab)` words per masked
/// row, rows in range, and at least one token below `vocab` allowed.
fn validate_masks(e: &LogitEdits, rows: usize, vocab: usize) -> Result<(), String> {
    let w = mask_words_per_row(vocab);
    if e.mask_words.len() != e.mask_rows.len() * w {
        return Err(format!(
            "{} mask words for {} masked rows; each mask has {w} words (vocabulary size {vocab})",
            e.mask_words.len(),
            e.mask_rows.len()
        ));
    }
    // Bits at or past `vocab` in the last word are ignored.
    let last = match vocab % 64 {
        0 => u64::MAX,
        r => (1u64 << r) - 1,
    };
    for (j, (&r, words)) in e
        .mask_rows
        .iter()
        .zip(e.mask_words.chunks(w.max(1)))
        .enumerate()
    {
        if r as usize >= rows {
            return Err(format!("mask row {r} is out of range (batch of {rows})"));
        }
        let (&tail, body) = words.split_last().unwrap_or((&0, &[]));
        if body.iter().all(|&x| x == 0) && tail & last == 0 {
            return Err(format!(
                "mask {j} (row {r}) allows no token: at least one must stay allowed"
            ));
        }
    }
    Ok(())
}

/// Applies validated edits to the rows' logits (`[rows, vocab]`).
pub(super) fn apply_edits(e: &LogitEdits, rows: &[Row], logits: &mut [f32], vocab: usize) {
    let w = mask_words_per_row(vocab);
    for (&r, words) in e.mask_rows.iter().zip(e.mask_words.chunks(w.max(1))) {
        let row = rows[r as usize].logits_row;
        apply_mask(words, &mut logits[row * vocab..(row + 1) * vocab]);
    }
    for (&r, &t) in e.ban_rows.iter().zip(&e.ban_tokens) {
        logits[rows[r as usize].logits_row * vocab + t as usize] = f32::NEG_INFINITY;
    }
    for ((&r, &t), &v) in e.bias_rows.iter().zip(&e.bias_tokens).zip(&e.bias_values) {
        logits[rows[r as usize].logits_row * vocab + t as usize] += v;
    }
}

/// Sets every logit whose bit in `words` is clear to -infinity.
fn apply_mask(words: &[u64], logits: &mut [f32]) {
    for (chunk, &word) in logits.chunks_mut(64).zip(words) {
        if word == u64::MAX {
            continue;
        }
        if word == 0 {
            chunk.fill(f32::NEG_INFINITY);
            continue;
        }
        for (i, x) in chunk.iter_mut().enumerate() {
            if word >> i & 1 == 0 {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn edits(ban: &[(u32, u32)], bias: &[(u32, u32, f32)]) -> LogitEdits {
        LogitEdits {
            ban_rows: ban.iter().map(|b| b.0).collect(),
            ban_tokens: ban.iter().map(|b| b.1).collect(),
            bias_rows: bias.iter().map(|b| b.0).collect(),
            bias_tokens: bias.iter().map(|b| b.1).collect(),
            bias_values: bias.iter().map(|b| b.2).collect(),
            mask_rows: Vec::new(),
            mask_words: Vec::new(),
            fail_rows: Vec::new(),
            fail_messages: Vec::new(),
        }
    }

    /// A mask over `vocab` tokens allowing `allowed`.
    fn mask(vocab: usize, allowed: &[u32]) -> Vec<u64> {
        let mut words = vec![0u64; mask_words_per_row(vocab)];
        for &t in allowed {
            words[t as usize / 64] |= 1 << (t % 64);
        }
        words
    }

    #[test]
    fn a_mask_leaves_only_its_tokens() {
        let vocab = 130;
        let rows = [
            Row {
                id: 1,
                num_output_tokens: 0,
                last_token: 0,
                logits_row: 1,
            },
            Row {
                id: 2,
                num_output_tokens: 0,
                last_token: 0,
                logits_row: 0,
            },
        ];
        let mut logits = vec![1.0f32; 2 * vocab];
        let mut e = edits(&[(0, 5)], &[(0, 129, 0.5)]);
        e.mask_rows = vec![0];
        e.mask_words = mask(vocab, &[5, 64, 129]);
        validate(&e, 2, vocab).unwrap();
        apply_edits(&e, &rows, &mut logits, vocab);
        // Row 0 of the batch is logits row 1; logits row 0 is untouched.
        assert!(logits[..vocab].iter().all(|&x| x == 1.0));
        let row = &logits[vocab..];
        let finite: Vec<usize> = (0..vocab).filter(|&t| row[t].is_finite()).collect();
        assert_eq!(finite, [64, 129], "5 is allowed by the mask but banned");
        assert_eq!(row[129], 1.5);
    }

    #[test]
    fn invalid_masks_are_named() {
        let vocab = 130;
        let mut e = edits(&[], &[]);
        e.mask_rows = vec![0];
        e.mask_words = mask(vocab, &[1]);
        validate(&e, 1, vocab).unwrap();
        // Wrong length: a 128-token mask for 130 tokens.
        e.mask_words = mask(128, &[1]);
        let err = validate(&e, 1, vocab).unwrap_err();
        assert!(err.contains("each mask has 3 words"), "{err}");
        // Nothing allowed (a bit past the vocabulary does not count).
        e.mask_words = mask(192, &[130, 191]);
        let err = validate(&e, 1, vocab).unwrap_err();
        assert!(err.contains("allows no token"), "{err}");
        // A row past the batch.
        e.mask_words = mask(vocab, &[1]);
        e.mask_rows = vec![1];
        let err = validate(&e, 1, vocab).unwrap_err();
        assert!(err.contains("mask row 1"), "{err}");
    }

    #[test]
    fn edits_land_on_the_rows_logits_row() {
        let rows = [Row {
            id: 9,
            num_output_tokens: 0,
            last_token: 0,
            logits_row: 2,
        }];
        let mut logits = vec![0.0f32; 3 * 4];
        let e = edits(&[(0, 1)], &[(0, 3, 2.5)]);
        validate(&e, 1, 4).unwrap();
        apply_edits(&e, &rows, &mut logits, 4);
        assert_eq!(&logits[8..], &[0.0, f32::NEG_INFINITY, 0.0, 2.5]);
        assert!(logits[..8].iter().all(|&x| x == 0.0));
    }

    #[test]
    fn a_failed_rows_other_edits_are_ignored() {
        let vocab = 130;
        // Row 1 fails: its ban, bias and (empty, so invalid) mask go; row
        // 0's stay.
        let mut e = edits(&[(1, 3), (0, 4)], &[(1, 5, 1.0), (0, 6, 2.0)]);
        e.mask_rows = vec![1, 0];
        e.mask_words = [mask(vocab, &[]), mask(vocab, &[4, 6])].concat();
        e.fail_rows = vec![1];
        e.fail_messages = vec!["constraint broken".into()];
        take_failures(&mut e, 2, vocab).unwrap();
        validate(&e, 2, vocab).unwrap();
        assert_eq!((e.ban_rows, e.ban_tokens), (vec![0], vec![4]));
        assert_eq!(
            (e.bias_rows, e.bias_tokens, e.bias_values),
            (vec![0], vec![6], vec![2.0])
        );
        assert_eq!(e.mask_rows, [0]);
        assert_eq!(e.mask_words, mask(vocab, &[4, 6]));
        assert_eq!(e.fail_messages, ["constraint broken"]);
    }

    #[test]
    fn invalid_failures_are_named() {
        let mut e = edits(&[], &[]);
        e.fail_rows = vec![2];
        e.fail_messages = vec!["x".into()];
        let err = take_failures(&mut e, 2, 4).unwrap_err();
        assert!(err.contains("fail row 2"), "{err}");
        e.fail_rows = vec![0, 1];
        let err = take_failures(&mut e, 2, 4).unwrap_err();
        assert!(err.contains("2 fail rows but 1 fail messages"), "{err}");
    }

    #[test]
    fn invalid_edits_are_named() {
        assert!(validate(&edits(&[(1, 0)], &[]), 1, 4)
            .unwrap_err()
            .contains("row 1"));
        assert!(validate(&edits(&[(0, 4)], &[]), 1, 4)
            .unwrap_err()
            .contains("token id 4"));
        assert!(validate(&edits(&[], &[(0, 1, f32::NAN)]), 1, 4)
            .unwrap_err()
            .contains("not finite"));
        let mut e = edits(&[(0, 1)], &[]);
        e.ban_tokens.push(2);
        assert!(validate(&e, 1, 4).is_err());
    }
}
