//! Logits-processor plugins, applied by the worker once per step over every
//! row it samples. Requests and their `extra_args` are announced once (when
//! they enter the batch), so per-step traffic is ids and two counters per row
//! plus the sparse edits that come back; the full logits never cross.
//!
//! Edits are validated whole before any is applied (rows in range, token ids
//! below the vocabulary, finite biases, parallel lists of equal length,
//! allow-masks of `ceil(vocab / 64)` words that allow at least one token),
//! so a bad answer changes nothing.
//!
//! A 0.3 processor also learns the model's vocabulary ([`Vocabulary`], which
//! the worker receives from the engine, since only the engine holds the
//! tokenizer) through `set-vocabulary`: once when it is given, and again
//! before the next `process` after a fault recreated the instance. A fault (trap, overrun, invalid edits, an
//! error returned) is logged with the plugin's name and the instance is
//! recreated; then, under `on_error = "fallback"`, the step is sampled
//! without that plugin's edits, and under `"fail"` the step fails with the
//! error.

use std::sync::Arc;

use super::bindings::processor::{self as wit, Batch, LogitEdits, LogitsProcessorPlugin};
use super::instance::Sandboxed;
use super::live::{LiveRequests, Pending};
use super::{OnError, PluginError};

/// One row the worker is about to sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Row {
    /// The request's handle.
    pub id: u32,
    /// Tokens it generated so far.
    pub num_output_tokens: u32,
    /// The last token of its sequence.
    pub last_token: u32,
    /// Its row in the step's logits matrix.
    pub logits_row: usize,
}

/// The served model's vocabulary as the engine sends it to the workers
/// (JSON over `collective_rpc`'s `set_vocabulary`): every token's bytes
/// flat, with each token's end offset, the special ids and EOS. What a 0.3
/// logits processor's `set-vocabulary` receives.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Vocabulary {
    /// Every token's bytes, concatenated in id order.
    pub token_bytes: Vec<u8>,
    /// Token `i` ends at `token_ends[i]` (and starts where `i - 1` ends).
    pub token_ends: Vec<u32>,
    /// The special (control) tokens' ids, ascending.
    pub special_ids: Vec<u32>,
    /// The end-of-sequence token.
    pub eos: Option<u32>,
}

impl Vocabulary {
    /// Builds it from each token's bytes and whether it is special.
    pub fn from_tokens<'a>(
        tokens: impl IntoIterator<Item = (&'a [u8], bool)>,
        eos: Option<u32>,
    ) -> Vocabulary {
        let mut v = Vocabulary {
            token_bytes: Vec::new(),
            token_ends: Vec::new(),
            special_ids: Vec::new(),
            eos,
        };
        for (id, (bytes, special)) in tokens.into_iter().enumerate() {
            v.token_bytes.extend_from_slice(bytes);
            v.token_ends.push(v.token_bytes.len() as u32);
            if special {
                v.special_ids.push(id as u32);
            }
        }
        v
    }

    /// Tokens it describes.
    pub fn len(&self) -> usize {
        self.token_ends.len()
    }

    /// Whether it describes no token.
    pub fn is_empty(&self) -> bool {
        self.token_ends.is_empty()
    }

    /// Token `id`'s bytes.
    pub fn token(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        let end = *self.token_ends.get(i)? as usize;
        let start = if i == 0 {
            0
        } else {
            self.token_ends[i - 1] as usize
        };
        self.token_bytes.get(start..end)
    }

    /// Checks the offsets and ids are consistent.
    pub fn validate(&self) -> Result<(), String> {
        if self.token_ends.windows(2).any(|w| w[0] > w[1]) {
            return Err("token_ends is not ascending".into());
        }
        if self.token_ends.last().map_or(0, |&e| e as usize) != self.token_bytes.len() {
            return Err("the last token end is not the length of token_bytes".into());
        }
        let n = self.len();
        if let Some(id) = self
            .special_ids
            .iter()
            .chain(&self.eos)
            .find(|&&id| id as usize >= n)
        {
            return Err(format!(
                "token id {id} is not below the vocabulary's {n} tokens"
            ));
        }
        Ok(())
    }

    fn to_wit(&self) -> wit::Vocabulary {
        wit::Vocabulary {
            token_bytes: self.token_bytes.clone(),
            token_ends: self.token_ends.clone(),
            special_ids: self.special_ids.clone(),
            eos: self.eos,
        }
    }
}

/// One logits-processor plugin and what it has been told.
struct Processor {
    plugin: Sandboxed<LogitsProcessorPlugin>,
    /// Requests entered and left since its last call.
    pending: Pending,
    batch: Batch,
    /// The fault count when the vocabulary was last given (the instance
    /// that got it); a different count means a recreated instance.
    vocabulary_told: Option<u64>,
}

/// The configured logits processors, in order, with the live requests'
/// `extra_args`.
pub struct LogitsProcessors {
    processors: Vec<Processor>,
    on_error: OnError,
    live: LiveRequests,
    /// The model's vocabulary, for 0.3 processors, once given.
    vocabulary: Option<Arc<wit::Vocabulary>>,
}

impl std::fmt::Debug for LogitsProcessors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.processors.iter().map(|p| p.plugin.name()).collect();
        f.debug_struct("LogitsProcessors")
            .field("names", &names)
            .field("on_error", &self.on_error)
            .finish()
    }
}

fn empty_batch() -> Batch {
    Batch {
        added_ids: Vec::new(),
        added_extra_args: Vec::new(),
        removed_ids: Vec::new(),
        ids: Vec::new(),
        num_output_tokens: Vec::new(),
        last_tokens: Vec::new(),
        vocab_size: 0,
    }
}

impl LogitsProcessors {
    pub(super) fn new(
        plugins: Vec<Sandboxed<LogitsProcessorPlugin>>,
        on_error: OnError,
    ) -> LogitsProcessors {
        let processors = plugins
            .into_iter()
            .map(|plugin| Processor {
                plugin,
                pending: Pending::default(),
                batch: empty_batch(),
                vocabulary_told: None,
            })
            .collect();
        LogitsProcessors {
            processors,
            on_error,
            live: LiveRequests::default(),
            vocabulary: None,
        }
    }

    /// Gives every 0.3 processor the model's vocabulary (`set-vocabulary`);
    /// a processor's error refuses the configuration. Given again to an
    /// instance recreated after a fault, before its next `process`.
    pub fn set_vocabulary(&mut self, vocabulary: &Vocabulary) -> Result<(), PluginError> {
        vocabulary
            .validate()
            .map_err(|e| PluginError::Config(format!("invalid vocabulary: {e}")))?;
        let vocab = Arc::new(vocabulary.to_wit());
        for p in &mut self.processors {
            p.vocabulary_told = None;
            tell_vocabulary(p, &vocab)?;
        }
        self.vocabulary = Some(vocab);
        Ok(())
    }

    /// The plugins' qualified names, in application order.
    pub fn names(&self) -> Vec<&str> {
        self.processors.iter().map(|p| p.plugin.name()).collect()
    }

    /// A request entered the batch.
    pub fn add(&mut self, id: u32, extra_args: Option<&serde_json::Value>) {
        let pending = self.processors.iter_mut().map(|p| &mut p.pending);
        self.live.add(id, extra_args, pending);
    }

    /// A request left the batch.
    pub fn remove(&mut self, id: u32) {
        let pending = self.processors.iter_mut().map(|p| &mut p.pending);
        self.live.remove(id, pending);
    }

    /// Asks every processor for its edits to `rows` and applies them to
    /// `logits` (`[rows, vocab]`, row-major).
    pub fn apply(
        &mut self,
        rows: &[Row],
        logits: &mut [f32],
        vocab: usize,
    ) -> Result<(), PluginError> {
        for p in &mut self.processors {
            if let Some(vocab) = &self.vocabulary {
                if let Err(e) = tell_vocabulary(p, vocab) {
                    match self.on_error {
                        OnError::Fail => return Err(e),
                        OnError::Fallback => {
                            tracing::warn!("{e}; sampling this step without its edits");
                            continue;
                        }
                    }
                }
            }
            p.pending.resync(p.plugin.faults(), &self.live);
            let b = &mut p.batch;
            std::mem::swap(&mut b.added_ids, &mut p.pending.added_ids);
            std::mem::swap(&mut b.added_extra_args, &mut p.pending.added_extra_args);
            std::mem::swap(&mut b.removed_ids, &mut p.pending.removed_ids);
            b.ids.clear();
            b.num_output_tokens.clear();
            b.last_tokens.clear();
            b.ids.extend(rows.iter().map(|r| r.id));
            b.num_output_tokens
                .extend(rows.iter().map(|r| r.num_output_tokens));
            b.last_tokens.extend(rows.iter().map(|r| r.last_token));
            b.vocab_size = vocab as u32;
            let batch = &p.batch;
            let answer = p.plugin.call("process", |w, s| {
                w.engine_plugins_logits_processor().call_process(s, batch)
            });
            // Told: the lists go back (emptied) to be reused.
            std::mem::swap(&mut p.batch.added_ids, &mut p.pending.added_ids);
            std::mem::swap(
                &mut p.batch.added_extra_args,
                &mut p.pending.added_extra_args,
            );
            std::mem::swap(&mut p.batch.removed_ids, &mut p.pending.removed_ids);
            p.pending.clear();
            let result = match answer {
                Ok(Ok(edits)) => match validate(&edits, rows.len(), vocab) {
                    Ok(()) => {
                        apply_edits(&edits, rows, logits, vocab);
                        Ok(())
                    }
                    Err(why) => Err(p
                        .plugin
                        .fault("process", format!("returned invalid edits: {why}"))),
                },
                Ok(Err(message)) => Err(p
                    .plugin
                    .fault("process", format!("returned an error: {message}"))),
                Err(e) => Err(e),
            };
            if let Err(e) = result {
                match self.on_error {
                    OnError::Fail => return Err(e),
                    OnError::Fallback => {
                        tracing::warn!("{e}; sampling this step without its edits")
                    }
                }
            }
        }
        Ok(())
    }
}

/// Calls `set-vocabulary` unless this instance was already told.
fn tell_vocabulary(p: &mut Processor, vocab: &wit::Vocabulary) -> Result<(), PluginError> {
    let faults = p.plugin.faults();
    if p.vocabulary_told == Some(faults) {
        return Ok(());
    }
    let told = p.plugin.call("set-vocabulary", |w, s| {
        w.engine_plugins_logits_processor()
            .call_set_vocabulary(s, vocab)
    })?;
    match told {
        Ok(()) => {
            p.vocabulary_told = Some(faults);
            Ok(())
        }
        Err(message) => Err(p
            .plugin
            .fault("set-vocabulary", format!("returned an error: {message}"))),
    }
}

/// 64-bit words in one row's allow-mask over `vocab` tokens.
pub fn mask_words_per_row(vocab: usize) -> usize {
    vocab.div_ceil(64)
}

/// Checks every edit before any is applied.
fn validate(e: &LogitEdits, rows: usize, vocab: usize) -> Result<(), String> {
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

fn apply_edits(e: &LogitEdits, rows: &[Row], logits: &mut [f32], vocab: usize) {
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
    fn vocabulary_offsets_round_trip() {
        let toks: [(&[u8], bool); 3] = [(b"<s>", true), (b"ab", false), (b"", false)];
        let v = Vocabulary::from_tokens(toks, Some(0));
        v.validate().unwrap();
        assert_eq!(v.len(), 3);
        assert_eq!(v.token(1), Some(&b"ab"[..]));
        assert_eq!(v.token(2), Some(&b""[..]));
        assert_eq!(v.token(3), None);
        assert_eq!(v.special_ids, [0]);
        let mut bad = v.clone();
        bad.eos = Some(3);
        assert!(bad.validate().unwrap_err().contains("token id 3"));
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
