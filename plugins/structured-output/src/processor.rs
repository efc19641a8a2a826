//! The logits processor's state across steps: one llguidance matcher per
//! claimed request, fed each sampled token once, asked for the next mask.

use std::collections::BTreeMap;

use llguidance::Matcher;

use crate::compiler::{llg_error, Compiler};
use crate::mask;
use crate::vocab::{self, FlatVocab};

/// One step's rows, as the WIT's `batch` record carries them.
#[derive(Clone, Copy, Debug, Default)]
pub struct Step<'a> {
    /// Requests announced since the last call.
    pub added_ids: &'a [u32],
    /// Their `extra_args` JSON.
    pub added_extra_args: &'a [String],
    /// Where each added request's earlier output ends in
    /// `added_output_tokens`.
    pub added_output_ends: &'a [u32],
    /// The added requests' earlier outputs, flat (non-empty only for a
    /// request announced again after a fault).
    pub added_output_tokens: &'a [u32],
    /// Requests gone since the last call.
    pub removed_ids: &'a [u32],
    /// The request of each row.
    pub ids: &'a [u32],
    /// How many tokens each row's request has generated.
    pub num_output_tokens: &'a [u32],
    /// Each row's newest token.
    pub last_tokens: &'a [u32],
    /// The width of the model's logits rows.
    pub vocab_size: u32,
}

/// One step's answer: an allow-mask per healthy row, a message per failed
/// one (the WIT's `logit-edits`, less the lists this plugin never fills).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepEdits {
    /// Rows that carry a mask.
    pub mask_rows: Vec<u32>,
    /// `mask_rows.len() * vocab_size.div_ceil(64)` words.
    pub mask_words: Vec<u64>,
    /// Rows whose request fails.
    pub fail_rows: Vec<u32>,
    /// Why, same positions.
    pub fail_messages: Vec<String>,
}

/// A claimed request.
struct Tracked {
    /// `Err` once the request cannot go on; reported every step it appears.
    matcher: Result<Matcher, String>,
    /// Output tokens the matcher has consumed.
    consumed: u32,
}

/// The processor: the compiler (once the vocabulary is known) and the
/// claimed requests.
#[derive(Default)]
pub struct Processor {
    compiler: Option<Compiler>,
    requests: BTreeMap<u32, Tracked>,
}

const NO_VOCAB: &str =
    "engine:structured-output has no vocabulary: the host must call set-vocabulary first";

impl Processor {
    /// Learns the vocabulary (again, after a restart), forgetting every
    /// request and compiled grammar.
    pub fn set_vocabulary(&mut self, v: FlatVocab<'_>) -> Result<(), String> {
        let env = vocab::build_tok_env(v)?;
        self.compiler = Some(Compiler::new(&env)?);
        self.requests.clear();
        Ok(())
    }

    /// `check-request`: whether a request with these `extra_args` is
    /// constrained (compiling its constraint, so errors surface now).
    pub fn check_request(&mut self, extra_args: &str) -> Result<bool, String> {
        let compiler = self.compiler.as_mut().ok_or(NO_VOCAB)?;
        Ok(compiler.compile(extra_args)?.is_some())
    }

    /// How many times a request's `extra_args` were compiled rather than
    /// found in the cache (0 before the vocabulary is known).
    pub fn compiles(&self) -> u64 {
        self.compiler.as_ref().map_or(0, Compiler::compiles)
    }

    /// How many requests are being tracked.
    pub fn tracked(&self) -> usize {
        self.requests.len()
    }

    /// `process`: consume each row's new token and compute its mask. An
    /// error means the batch itself is malformed; a request's own trouble
    /// fails only its row.
    pub fn process(&mut self, b: Step<'_>) -> Result<StepEdits, String> {
        check_lengths(&b)?;
        let compiler = self.compiler.as_mut().ok_or(NO_VOCAB)?;
        let n_vocab = compiler.tok_env().tok_trie().vocab_size();
        for id in b.removed_ids {
            self.requests.remove(id);
        }
        let mut start = 0usize;
        for (i, (&id, args)) in b.added_ids.iter().zip(b.added_extra_args).enumerate() {
            let end = b.added_output_ends[i] as usize;
            let earlier = &b.added_output_tokens[start..end];
            start = end;
            let matcher = match compiler.compile(args) {
                Ok(Some(parser)) => {
                    let mut m = Matcher::new(Ok(parser));
                    consume(&mut m, earlier, n_vocab)
                        .map(|()| m)
                        .map_err(|e| format!("replaying its {} earlier tokens: {e}", earlier.len()))
                }
                Ok(None) => Err(format!(
                    "request {id} has no structured_outputs but was announced to \
                     engine:structured-output, which did not claim it"
                )),
                Err(e) => Err(e),
            };
            let consumed = earlier.len() as u32;
            self.requests.insert(id, Tracked { matcher, consumed });
        }
        let mut edits = StepEdits::default();
        for (row, &id) in b.ids.iter().enumerate() {
            let result = match self.requests.get_mut(&id) {
                Some(t) => t.step(
                    b.num_output_tokens[row],
                    b.last_tokens[row],
                    (n_vocab, b.vocab_size),
                    &mut edits.mask_words,
                ),
                None => Err(format!(
                    "request {id} was never announced to engine:structured-output"
                )),
            };
            match result {
                Ok(()) => edits.mask_rows.push(row as u32),
                Err(msg) => {
                    edits.fail_rows.push(row as u32);
                    edits
                        .fail_messages
                        .push(format!("structured output failed: {msg}"));
                }
            }
        }
        Ok(edits)
    }
}

impl Tracked {
    /// Follows the row's new token, if any, and appends its mask to
    /// `words`. `sizes` is (the trie's vocabulary, the logits rows' width).
    /// After an error the request stays failed with the same cause.
    fn step(
        &mut self,
        outputs: u32,
        last: u32,
        sizes: (usize, u32),
        words: &mut Vec<u64>,
    ) -> Result<(), String> {
        let m = self.matcher.as_mut().map_err(|e| e.clone())?;
        let result = follow(m, self.consumed, outputs, last, sizes.0)
            .and_then(|()| append_mask(m, sizes.1, words));
        match result {
            Ok(()) => self.consumed = outputs,
            Err(ref msg) => self.matcher = Err(msg.clone()),
        }
        result
    }
}

/// Brings the matcher from `consumed` to `outputs` tokens: at most one new
/// token per step, which is the row's newest.
fn follow(
    m: &mut Matcher,
    consumed: u32,
    outputs: u32,
    last: u32,
    n_vocab: usize,
) -> Result<(), String> {
    if outputs == consumed {
        Ok(())
    } else if consumed.checked_add(1) == Some(outputs) {
        consume(m, &[last], n_vocab)
    } else {
        Err(format!(
            "the request has {outputs} output tokens but {consumed} were seen, and only one new \
             token per step can be followed"
        ))
    }
}

/// Feeds `tokens` to the matcher, naming the first one it rejects.
fn consume(m: &mut Matcher, tokens: &[u32], n_vocab: usize) -> Result<(), String> {
    for &t in tokens {
        if t as usize >= n_vocab {
            return Err(format!(
                "token {t} is outside the vocabulary of {n_vocab} tokens"
            ));
        }
        m.consume_token(t)
            .map_err(|e| format!("token {t} does not fit the constraint: {}", llg_error(&e)))?;
    }
    Ok(())
}

/// The matcher's current mask, appended to `words`.
fn append_mask(m: &mut Matcher, vocab_size: u32, words: &mut Vec<u64>) -> Result<(), String> {
    // When the constraint is complete this is EOS alone, so generation
    // stops with finish reason `stop`.
    let allowed = m
        .compute_mask_or_eos()
        .map_err(|e| format!("computing the mask: {}", llg_error(&e)))?;
    let start = words.len();
    if mask::push_words(&allowed, vocab_size, words) {
        return Ok(());
    }
    words.truncate(start);
    Err(format!(
        "the constraint allows no token below the model's vocabulary size {vocab_size}"
    ))
}

fn check_lengths(b: &Step<'_>) -> Result<(), String> {
    let same = |what: &str, len: usize, like: &str, want: usize| {
        if len == want {
            Ok(())
        } else {
            Err(format!(
                "malformed batch: {what} has {len} entries but {like} has {want}"
            ))
        }
    };
    let added = b.added_ids.len();
    same(
        "added-extra-args",
        b.added_extra_args.len(),
        "added-ids",
        added,
    )?;
    same(
        "added-output-ends",
        b.added_output_ends.len(),
        "added-ids",
        added,
    )?;
    same(
        "num-output-tokens",
        b.num_output_tokens.len(),
        "ids",
        b.ids.len(),
    )?;
    same("last-tokens", b.last_tokens.len(), "ids", b.ids.len())?;
    let mut prev = 0u32;
    for &end in b.added_output_ends {
        if end < prev || end as usize > b.added_output_tokens.len() {
            return Err(format!(
                "malformed batch: added-output-ends entry {end} is outside {prev}..={}",
                b.added_output_tokens.len()
            ));
        }
        prev = end;
    }
    Ok(())
}
