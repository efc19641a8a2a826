//! Logits-processor plugins, applied by the worker once per step over the
//! rows it samples. Requests and their `extra_args` are announced once (when
//! they enter the batch), so per-step traffic is ids and two counters per row
//! plus the sparse edits that come back ([`edits`]); the full logits never
//! cross.
//!
//! A 0.3 or later processor learns the model's vocabulary ([`Vocabulary`],
//! which the worker receives from the engine, since only the engine holds
//! the tokenizer) through `set-vocabulary`: once when it is given, and again
//! before the next call after a fault recreated the instance.
//!
//! A 0.4 processor claims requests (`check-request`, asked once when a
//! request enters the batch; an error fails that request): it is told only
//! of the requests it claimed, each in a call of its own with no rows under
//! the per-request budget (starting a request compiles its constraint),
//! sees only their rows, and is not called in a step that has none of them
//! and nothing to tell. It may fail single rows (`fail-rows`). After a
//! fault its recreated instance is told every live request it claimed
//! again, with the output each has so far, and asked for
//! each row of the faulting call alone: a row whose call faults again fails,
//! whatever `on_error` says, since sampling it unconstrained would break its
//! constraint.
//!
//! An older processor is told of every request and sees every row. A fault
//! (trap, overrun, invalid edits, an error returned) is logged with the
//! plugin's name and the instance is recreated; then, under
//! `on_error = "fallback"`, the step is sampled without that plugin's edits,
//! and under `"fail"` the step fails with the error.

mod edits;

use std::collections::BTreeSet;
use std::sync::Arc;

use super::bindings::processor::{self as wit, Batch, LogitEdits, LogitsProcessorPlugin};
use super::instance::Sandboxed;
use super::live::{extra_args_json, LiveRequests, Pending};
use super::{OnError, PluginError};
use crate::sampling::Vocabulary;

pub use edits::mask_words_per_row;

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

/// Requests that fail this step: each request's id and why.
pub type Failures = Vec<(u32, String)>;

/// One logits-processor plugin and what it has been told.
struct Processor {
    plugin: Sandboxed<LogitsProcessorPlugin>,
    /// The live requests it claimed (0.4); `None` for an older processor,
    /// which is told of every request.
    claimed: Option<BTreeSet<u32>>,
    /// Requests entered and left since its last call.
    pending: Pending,
    batch: Batch,
    /// This step's rows of the requests it claimed (reused).
    rows: Vec<Row>,
    /// The fault count when the vocabulary was last given (the instance
    /// that got it); a different count means a recreated instance.
    vocabulary_told: Option<u64>,
    /// The `extra_args` key without which it claims no request (the
    /// structured-output backend's), when the host knows one: it is not
    /// asked about other requests, and learns the vocabulary only when the
    /// first request carrying the key comes.
    only_with: Option<String>,
}

/// Whether a processor that `claimed` these requests (`None`: every one)
/// is told of request `id`.
fn claims(claimed: &Option<BTreeSet<u32>>, id: u32) -> bool {
    claimed.as_ref().is_none_or(|c| c.contains(&id))
}

impl Processor {
    /// Whether it claims a request with these `extra_args` (JSON): `Err`
    /// refuses the request, naming the plugin. An older processor claims
    /// every request without being asked.
    fn check(
        &mut self,
        extra_args: Option<&serde_json::Value>,
        json: &str,
        vocab: Option<&wit::Vocabulary>,
    ) -> Result<bool, String> {
        if self.claimed.is_none() {
            return Ok(true);
        }
        if let Some(key) = &self.only_with {
            if !crate::sampling::params::extra_args_carry(extra_args, key) {
                return Ok(false);
            }
        }
        // The answer may depend on the vocabulary, which a recreated
        // instance has not been given yet.
        if let Some(vocab) = vocab {
            tell_vocabulary(self, vocab).map_err(|e| e.to_string())?;
        }
        let answer = self.plugin.call_once("check-request", |w, s| {
            w.engine_plugins_logits_processor()
                .call_check_request(s, json)
        });
        match answer {
            Ok(Ok(claims)) => Ok(claims),
            Ok(Err(message)) => Err(format!("{}: {message}", self.plugin.name())),
            Err(e) => Err(e.to_string()),
        }
    }
}

/// The configured logits processors, in order, with the live requests'
/// `extra_args`.
pub struct LogitsProcessors {
    processors: Vec<Processor>,
    on_error: OnError,
    live: LiveRequests,
    /// The model's vocabulary, for 0.3 and later processors, once given.
    vocabulary: Option<Arc<wit::Vocabulary>>,
}

impl std::fmt::Debug for LogitsProcessors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogitsProcessors")
            .field("names", &self.names())
            .field("on_error", &self.on_error)
            .finish()
    }
}

fn empty_batch() -> Batch {
    Batch {
        added_ids: Vec::new(),
        added_extra_args: Vec::new(),
        added_output_ends: Vec::new(),
        added_output_tokens: Vec::new(),
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
                claimed: plugin.pre().claims_requests().then(BTreeSet::new),
                plugin,
                pending: Pending::default(),
                batch: empty_batch(),
                rows: Vec::new(),
                vocabulary_told: None,
                only_with: None,
            })
            .collect();
        LogitsProcessors {
            processors,
            on_error,
            live: LiveRequests::default(),
            vocabulary: None,
        }
    }

    /// Marks the 0.4 processor `name` as claiming only requests whose
    /// `extra_args` carry `key` (a non-null value): the structured-output
    /// backend, whose constraint travels under `structured_outputs`. It is
    /// not asked about other requests, and is given the vocabulary (for
    /// llguidance a token trie, its largest state) only when the first
    /// request carrying `key` comes, so a server that serves none holds none
    /// of that memory. Call before [`Self::set_vocabulary`]. Other names are
    /// left alone.
    pub fn claim_only_with(&mut self, name: &str, key: &str) {
        for p in &mut self.processors {
            if p.plugin.name() == name && p.claimed.is_some() {
                p.only_with = Some(key.to_string());
            }
        }
    }

    /// Gives every 0.3 and later processor the model's vocabulary
    /// (`set-vocabulary`); a processor's error refuses the configuration.
    /// Given again to an instance recreated after a fault, before its next
    /// call; given first then to a processor that claims only requests
    /// with a key ([`Self::claim_only_with`]).
    pub fn set_vocabulary(&mut self, vocabulary: &Vocabulary) -> Result<(), PluginError> {
        vocabulary
            .validate()
            .map_err(|e| PluginError::Config(format!("invalid vocabulary: {e}")))?;
        let vocab = Arc::new(wit_vocabulary(vocabulary));
        for p in &mut self.processors {
            p.vocabulary_told = None;
            if p.only_with.is_none() {
                tell_vocabulary(p, &vocab)?;
            }
        }
        self.vocabulary = Some(vocab);
        Ok(())
    }

    /// Each processor's qualified name and its faults so far (each one
    /// recreated the instance), in application order.
    pub fn faults(&self) -> impl Iterator<Item = (&str, u64)> + '_ {
        self.processors
            .iter()
            .map(|p| (p.plugin.name(), p.plugin.faults()))
    }

    /// The plugins' qualified names, in application order.
    pub fn names(&self) -> Vec<&str> {
        self.processors.iter().map(|p| p.plugin.name()).collect()
    }

    /// Each processor's qualified name and the bytes of linear memory its
    /// instance holds, in application order.
    pub fn memory_used(&self) -> Vec<(&str, usize)> {
        self.processors
            .iter()
            .map(|p| (p.plugin.name(), p.plugin.memory_used()))
            .collect()
    }

    /// Whether any processor claims requests (0.4), so that
    /// [`Self::check`] can refuse one.
    pub fn checks_requests(&self) -> bool {
        self.processors.iter().any(|p| p.claimed.is_some())
    }

    /// Asks every 0.4 processor whether it accepts a request with these
    /// `extra_args` (`check-request`), without announcing anything: the
    /// first refusal, prefixed with the plugin's qualified name.
    pub fn check(&mut self, extra_args: Option<&serde_json::Value>) -> Result<(), String> {
        let json = extra_args_json(extra_args);
        let vocab = self.vocabulary.as_deref();
        for p in &mut self.processors {
            p.check(extra_args, &json, vocab)?;
        }
        Ok(())
    }

    /// A request entered the batch: each 0.4 processor is asked whether it
    /// claims it. A refusal (or a fault while asking) is returned, naming
    /// the plugin, and no processor is told of the request: it fails.
    pub fn add(&mut self, id: u32, extra_args: Option<&serde_json::Value>) -> Result<(), String> {
        let json = extra_args_json(extra_args);
        let vocab = self.vocabulary.as_deref();
        let mut claims = Vec::with_capacity(self.processors.len());
        for p in &mut self.processors {
            claims.push(p.check(extra_args, &json, vocab)?);
        }
        for (p, claims) in self.processors.iter_mut().zip(&claims) {
            if let (Some(claimed), true) = (p.claimed.as_mut(), *claims) {
                claimed.insert(id);
            }
        }
        let told = self
            .processors
            .iter_mut()
            .zip(claims)
            .filter(|(_, claims)| *claims)
            .map(|(p, _)| &mut p.pending);
        self.live.add(id, json, told);
        Ok(())
    }

    /// A request left the batch.
    pub fn remove(&mut self, id: u32) {
        let told = self
            .processors
            .iter_mut()
            .filter(|p| claims(&p.claimed, id))
            .map(|p| &mut p.pending);
        self.live.remove(id, told);
        for p in &mut self.processors {
            if let Some(claimed) = p.claimed.as_mut() {
                claimed.remove(&id);
            }
        }
    }

    /// Asks every processor for its edits to `rows` (each 0.4 processor for
    /// its claimed rows only) and applies them to `logits` (`[rows, vocab]`,
    /// row-major). `outputs(id)` is a request's output so far, for a
    /// recreated 0.4 instance. Returns the requests that fail (a 0.4
    /// processor's `fail-rows`, or its fault); they leave the processors
    /// and must not be sampled. `Err` is an older processor's fault under
    /// `on_error = "fail"`: the whole step fails.
    pub fn apply<'o>(
        &mut self,
        rows: &[Row],
        logits: &mut [f32],
        vocab: usize,
        outputs: impl Fn(u32) -> &'o [u32],
    ) -> Result<Failures, PluginError> {
        let mut failed = Failures::new();
        let cx = Context {
            vocabulary: self.vocabulary.as_deref(),
            live: &self.live,
            vocab,
            outputs: &outputs,
        };
        for p in &mut self.processors {
            p.rows.clear();
            let claimed = &p.claimed;
            p.rows.extend(
                rows.iter()
                    .filter(|r| claims(claimed, r.id) && !failed.iter().any(|f| f.0 == r.id)),
            );
            if p.claimed.is_some() && p.rows.is_empty() && p.pending.is_empty() {
                continue;
            }
            match call(p, &cx, &mut failed) {
                Ok(Some(edits)) => take(p, &edits, logits, vocab, &mut failed),
                Ok(None) => {}
                // A 0.4 processor's rows cannot be sampled without it. Which
                // row made it fault is unknown, so the recreated instance is
                // asked for each row alone: only the rows that fault again
                // fail, and the others keep their constraint.
                Err(e) if p.claimed.is_some() && p.rows.len() == 1 => {
                    fail(&mut failed, p.rows[0].id, e.to_string());
                }
                Err(_) if p.claimed.is_some() => {
                    let all = std::mem::take(&mut p.rows);
                    for &row in &all {
                        p.rows.clear();
                        p.rows.push(row);
                        match call(p, &cx, &mut failed) {
                            Ok(Some(edits)) => take(p, &edits, logits, vocab, &mut failed),
                            Ok(None) => {}
                            Err(e) => fail(&mut failed, row.id, e.to_string()),
                        }
                    }
                    p.rows = all;
                }
                Err(e) => match self.on_error {
                    OnError::Fail => return Err(e),
                    OnError::Fallback => {
                        tracing::warn!("{e}; sampling this step without its edits")
                    }
                },
            }
        }
        for (id, _) in &failed {
            self.remove(*id);
        }
        Ok(failed)
    }
}

/// Applies a processor's edits to its rows (`p.rows`) and records the
/// rows it failed.
fn take(
    p: &Processor,
    edits: &LogitEdits,
    logits: &mut [f32],
    vocab: usize,
    failed: &mut Failures,
) {
    edits::apply_edits(edits, &p.rows, logits, vocab);
    let name = p.plugin.name();
    for (&r, message) in edits.fail_rows.iter().zip(&edits.fail_messages) {
        fail(failed, p.rows[r as usize].id, format!("{name}: {message}"));
    }
}

/// Records that request `id` fails with `why`, unless it already does.
fn fail(failed: &mut Failures, id: u32, why: String) {
    if !failed.iter().any(|f| f.0 == id) {
        failed.push((id, why));
    }
}

/// What a step's calls need besides the processor.
struct Context<'a, F> {
    /// The model's vocabulary, once given.
    vocabulary: Option<&'a wit::Vocabulary>,
    live: &'a LiveRequests,
    /// The logits rows' width.
    vocab: usize,
    /// A request's output so far.
    outputs: &'a F,
}

/// One processor's `process` over its rows (`p.rows`), the instance told
/// the vocabulary and its news first: the edits, validated, with the failed
/// rows' other edits taken out, or `None` when no row is left to ask
/// about; a fault is returned, the instance recreated. A 0.4 processor is
/// told of its new requests in calls of their own ([`announce`]); those
/// that fail there are added to `failed` and leave `p.rows`.
fn call<'o, F: Fn(u32) -> &'o [u32]>(
    p: &mut Processor,
    cx: &Context<'_, F>,
    failed: &mut Failures,
) -> Result<Option<LogitEdits>, PluginError> {
    if p.claimed.is_some() {
        announce(p, cx, failed)?;
        let claimed = &p.claimed;
        p.rows.retain(|r| claims(claimed, r.id));
        if p.rows.is_empty() && p.pending.is_empty() {
            return Ok(None);
        }
    } else {
        if let Some(vocabulary) = cx.vocabulary {
            tell_vocabulary(p, vocabulary)?;
        }
        p.pending.resync(p.plugin.faults(), cx.live, |_| true);
    }
    let b = &mut p.batch;
    std::mem::swap(&mut b.added_ids, &mut p.pending.added_ids);
    std::mem::swap(&mut b.added_extra_args, &mut p.pending.added_extra_args);
    std::mem::swap(&mut b.removed_ids, &mut p.pending.removed_ids);
    set_rows(b, &p.rows, cx.vocab);
    let batch = &p.batch;
    let answer = p.plugin.call("process", batch.ids.len(), |w, s| {
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
    let rows = p.rows.len();
    checked(p, answer?, rows, cx.vocab).map(Some)
}

/// Tells a 0.4 processor of each request it claimed and has not been told
/// of (every live one after a fault recreated it), one request a call,
/// with no rows, under the per-request budget (`init_deadline_ms`, as
/// `check-request`): this is where a constraint compiles and replays a
/// request's earlier output, work that a step's budget is not sized for.
/// A request whose call faults fails alone; the recreated instance is
/// told of the others again. The newest requests go first: they were
/// checked last, so their compiled constraints are the freshest in the
/// plugin's cache.
fn announce<'o, F: Fn(u32) -> &'o [u32]>(
    p: &mut Processor,
    cx: &Context<'_, F>,
    failed: &mut Failures,
) -> Result<(), PluginError> {
    loop {
        if let Some(vocabulary) = cx.vocabulary {
            tell_vocabulary(p, vocabulary)?;
        }
        let claimed = &p.claimed;
        p.pending
            .resync(p.plugin.faults(), cx.live, |id| claims(claimed, id));
        let (Some(id), Some(extra_args)) =
            (p.pending.added_ids.pop(), p.pending.added_extra_args.pop())
        else {
            return Ok(());
        };
        let b = &mut p.batch;
        set_rows(b, &[], cx.vocab);
        b.added_ids.clear();
        b.added_ids.push(id);
        b.added_extra_args.clear();
        b.added_extra_args.push(extra_args);
        b.added_output_tokens.extend_from_slice((cx.outputs)(id));
        b.added_output_ends.push(b.added_output_tokens.len() as u32);
        b.removed_ids.clear();
        b.removed_ids.append(&mut p.pending.removed_ids);
        let batch = &p.batch;
        let answer = p.plugin.call_once("process", |w, s| {
            w.engine_plugins_logits_processor().call_process(s, batch)
        });
        // Told: the step's call carries none of it.
        let b = &mut p.batch;
        b.added_ids.clear();
        b.added_extra_args.clear();
        b.removed_ids.clear();
        let told = answer.and_then(|answer| checked(p, answer, 0, cx.vocab));
        if let Err(e) = told {
            fail(failed, id, e.to_string());
            if let Some(claimed) = p.claimed.as_mut() {
                claimed.remove(&id);
            }
        }
    }
}

/// Sets `b`'s rows to `rows` at width `vocab`, with no output tokens for
/// added requests: [`call`] sends none, [`announce`] adds its request's.
fn set_rows(b: &mut Batch, rows: &[Row], vocab: usize) {
    b.ids.clear();
    b.ids.extend(rows.iter().map(|r| r.id));
    b.num_output_tokens.clear();
    b.num_output_tokens
        .extend(rows.iter().map(|r| r.num_output_tokens));
    b.last_tokens.clear();
    b.last_tokens.extend(rows.iter().map(|r| r.last_token));
    b.added_output_ends.clear();
    b.added_output_tokens.clear();
    b.vocab_size = vocab as u32;
}

/// A `process` answer over `rows` rows, validated: the edits, with the
/// failed rows' other edits taken out, or a fault (the instance recreated).
fn checked(
    p: &mut Processor,
    answer: Result<LogitEdits, String>,
    rows: usize,
    vocab: usize,
) -> Result<LogitEdits, PluginError> {
    match answer {
        Ok(mut edits) => {
            let checked = edits::take_failures(&mut edits, rows, vocab)
                .and_then(|()| edits::validate(&edits, rows, vocab));
            match checked {
                Ok(()) => Ok(edits),
                Err(why) => Err(p
                    .plugin
                    .fault("process", format!("returned invalid edits: {why}"))),
            }
        }
        Err(message) => Err(p
            .plugin
            .fault("process", format!("returned an error: {message}"))),
    }
}

/// Calls `set-vocabulary` unless this instance was already told.
fn tell_vocabulary(p: &mut Processor, vocab: &wit::Vocabulary) -> Result<(), PluginError> {
    let faults = p.plugin.faults();
    if p.vocabulary_told == Some(faults) {
        return Ok(());
    }
    let told = p.plugin.call_once("set-vocabulary", |w, s| {
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

/// The vocabulary as the WIT's `vocabulary` record.
fn wit_vocabulary(v: &Vocabulary) -> wit::Vocabulary {
    wit::Vocabulary {
        token_bytes: v.token_bytes.clone(),
        token_ends: v.token_ends.clone(),
        special_ids: v.special_ids.clone(),
        eos: v.eos,
    }
}
