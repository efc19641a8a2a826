//! Logits processors: the trait, its plain data types and
//! [`export_logits_processor!`](crate::export_logits_processor).

/// The WIT bindings of this kind's world: `engine:plugins@0.4.0`, or
/// `0.2.0` with the `wit-0-2` feature (both vendored in `plugin-sdk/wit/`).
#[doc(hidden)]
pub mod bindings {
    #[cfg(not(feature = "wit-0-2"))]
    wit_bindgen::generate!({
        path: "wit/v0.4.0",
        world: "engine:plugins/logits-processor-plugin@0.4.0",
        with: {
            "engine:plugins/logging@0.4.0": crate::log::bindings::engine::plugins::logging,
            "engine:plugins/types@0.4.0": crate::types::bindings::engine::plugins::types,
        },
        pub_export_macro: true,
        export_macro_name: "__export_logits_processor_world",
        default_bindings_module: "plugin_sdk::logits_processor::bindings",
        runtime_path: "plugin_sdk::__wit_bindgen_rt",
    });
    #[cfg(feature = "wit-0-2")]
    wit_bindgen::generate!({
        path: "wit/v0.2.0",
        world: "engine:plugins/logits-processor-plugin@0.2.0",
        with: { "engine:plugins/types@0.2.0": crate::types::bindings::engine::plugins::types },
        pub_export_macro: true,
        export_macro_name: "__export_logits_processor_world",
        default_bindings_module: "plugin_sdk::logits_processor::bindings",
        runtime_path: "plugin_sdk::__wit_bindgen_rt",
    });
}

pub use crate::{Metadata, OptionSpec};
use bindings::exports::engine::plugins::logits_processor as wit;

/// One step's rows as parallel columns, plus the requests that entered
/// (with their `extra_args` JSON and, since 0.4, their output so far) and
/// left the batch since the last call. [`BatchExt`] reads the outputs.
pub type Batch = wit::Batch;

/// Reading a [`Batch`]'s announced requests (since 0.4).
#[cfg(not(feature = "wit-0-2"))]
pub trait BatchExt {
    /// The tokens added request `added_ids[i]` already generated: empty for
    /// a new request, its whole output so far when it is announced again to
    /// an instance the host recreated after a fault (so a constraint can
    /// resume where it stood); empty for `i` out of range.
    fn added_output(&self, i: usize) -> &[u32];
}

#[cfg(not(feature = "wit-0-2"))]
impl BatchExt for Batch {
    fn added_output(&self, i: usize) -> &[u32] {
        let Some(&end) = self.added_output_ends.get(i) else {
            return &[];
        };
        let start = if i == 0 {
            0
        } else {
            self.added_output_ends[i - 1]
        };
        self.added_output_tokens
            .get(start as usize..end as usize)
            .unwrap_or(&[])
    }
}

/// Sparse edits as parallel lists (built with [`EditsExt`]).
pub type Edits = wit::LogitEdits;

/// The served model's vocabulary (since 0.3), given once to
/// [`LogitsProcessor::set_vocabulary`]: every token's bytes flat
/// (`token_bytes`, with each token's end in `token_ends`), the special ids
/// and EOS. [`VocabularyExt`] reads it.
#[cfg(not(feature = "wit-0-2"))]
pub type Vocabulary = wit::Vocabulary;

/// Reading a [`Vocabulary`].
#[cfg(not(feature = "wit-0-2"))]
pub trait VocabularyExt {
    /// Tokens the tokenizer knows (ids `0..len()`); the model's
    /// `Batch::vocab_size` may be larger (padding, no text).
    fn len(&self) -> usize;
    /// Whether it has no token.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Token `id`'s bytes (a special token's text included).
    fn token(&self, id: u32) -> Option<&[u8]>;
    /// Whether `id` is a special (control) token.
    fn is_special(&self, id: u32) -> bool;
}

#[cfg(not(feature = "wit-0-2"))]
impl VocabularyExt for Vocabulary {
    fn len(&self) -> usize {
        self.token_ends.len()
    }
    fn token(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        let end = *self.token_ends.get(i)? as usize;
        let start = if i == 0 {
            0
        } else {
            self.token_ends[i - 1] as usize
        };
        self.token_bytes.get(start..end)
    }
    fn is_special(&self, id: u32) -> bool {
        self.special_ids.binary_search(&id).is_ok()
    }
}

/// A packed allow-mask over a vocabulary (since 0.3): bit `t` set = token
/// `t` may be sampled. Give it to a row with [`EditsExt::mask`]; the host
/// sets every other token's logit to -infinity. It crosses the boundary as
/// `vocab_size / 64` words (6 KiB at 49152 tokens).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowMask {
    words: Vec<u64>,
    vocab_size: u32,
}

impl AllowMask {
    /// A mask allowing no token yet (allow at least one before use).
    pub fn none(vocab_size: u32) -> AllowMask {
        AllowMask {
            words: vec![0; (vocab_size as usize).div_ceil(64)],
            vocab_size,
        }
    }

    /// A mask allowing every token.
    pub fn all(vocab_size: u32) -> AllowMask {
        let mut m = AllowMask {
            words: vec![u64::MAX; (vocab_size as usize).div_ceil(64)],
            vocab_size,
        };
        if !vocab_size.is_multiple_of(64) {
            *m.words.last_mut().unwrap() = (1u64 << (vocab_size % 64)) - 1;
        }
        m
    }

    /// The vocabulary size it covers.
    pub fn vocab_size(&self) -> u32 {
        self.vocab_size
    }

    /// Allows `token` (ignored at or past the vocabulary size).
    pub fn allow(&mut self, token: u32) {
        if token < self.vocab_size {
            self.words[token as usize / 64] |= 1 << (token % 64);
        }
    }

    /// Disallows `token`.
    pub fn disallow(&mut self, token: u32) {
        if token < self.vocab_size {
            self.words[token as usize / 64] &= !(1 << (token % 64));
        }
    }

    /// Whether `token` is allowed.
    pub fn is_allowed(&self, token: u32) -> bool {
        token < self.vocab_size && self.words[token as usize / 64] >> (token % 64) & 1 == 1
    }

    /// How many tokens are allowed.
    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The packed words, least significant bit first.
    pub fn words(&self) -> &[u64] {
        &self.words
    }
}

/// Builders for [`Edits`].
pub trait EditsExt {
    /// No edits.
    fn none() -> Self;
    /// Row `row` (a position in `Batch::ids`) must not sample `token`.
    fn ban(&mut self, row: u32, token: u32);
    /// Adds `value` (finite) to row `row`'s logit of `token`.
    fn bias(&mut self, row: u32, token: u32, value: f32);
    /// Row `row` may sample only the tokens `mask` allows (since 0.3; the
    /// mask's vocabulary size must be the batch's, and it must allow at
    /// least one token, else the host faults the plugin).
    #[cfg(not(feature = "wit-0-2"))]
    fn mask(&mut self, row: u32, mask: &AllowMask);
    /// Fails row `row`'s request with `message` (since 0.4; finish reason
    /// `error`), e.g. when its sampled token broke its constraint; the
    /// other rows' edits still apply, this row's are ignored.
    #[cfg(not(feature = "wit-0-2"))]
    fn fail(&mut self, row: u32, message: &str);
}

impl EditsExt for Edits {
    fn none() -> Self {
        Edits {
            ban_rows: Vec::new(),
            ban_tokens: Vec::new(),
            bias_rows: Vec::new(),
            bias_tokens: Vec::new(),
            bias_values: Vec::new(),
            #[cfg(not(feature = "wit-0-2"))]
            mask_rows: Vec::new(),
            #[cfg(not(feature = "wit-0-2"))]
            mask_words: Vec::new(),
            #[cfg(not(feature = "wit-0-2"))]
            fail_rows: Vec::new(),
            #[cfg(not(feature = "wit-0-2"))]
            fail_messages: Vec::new(),
        }
    }

    #[cfg(not(feature = "wit-0-2"))]
    fn fail(&mut self, row: u32, message: &str) {
        self.fail_rows.push(row);
        self.fail_messages.push(message.to_string());
    }

    #[cfg(not(feature = "wit-0-2"))]
    fn mask(&mut self, row: u32, mask: &AllowMask) {
        self.mask_rows.push(row);
        self.mask_words.extend_from_slice(&mask.words);
    }

    fn ban(&mut self, row: u32, token: u32) {
        self.ban_rows.push(row);
        self.ban_tokens.push(token);
    }

    fn bias(&mut self, row: u32, token: u32, value: f32) {
        self.bias_rows.push(row);
        self.bias_tokens.push(token);
        self.bias_values.push(value);
    }
}

/// A logits processor. One value lives per plugin instance; the host calls
/// `process` once per step with the rows about to be sampled of the
/// requests it claimed (`check_request`).
pub trait LogitsProcessor: Sized + 'static {
    /// Name (`namespace:name`), version and options.
    fn metadata() -> Metadata;

    /// Builds the processor from the configuration's `options` JSON object
    /// (`{}` when none); an error refuses the configuration.
    fn new(options: &str) -> Result<Self, String>;

    /// The model's vocabulary, once after `new` (since 0.3; never called
    /// with the `wit-0-2` feature). The default ignores it; an error
    /// refuses the configuration.
    #[cfg(not(feature = "wit-0-2"))]
    fn set_vocabulary(&mut self, vocab: &Vocabulary) -> Result<(), String> {
        let _ = vocab;
        Ok(())
    }

    /// Whether this processor edits a request with these `extra_args`
    /// (JSON, `null` when none), asked once per request (since 0.4):
    /// `Ok(true)` claims it (it is announced to `process` and its rows come
    /// there), `Ok(false)` leaves it alone, `Err(message)` refuses it (the
    /// API server answers 400 with the message). The host may ask another
    /// instance than the one `process` runs on, so answer from the
    /// arguments and the vocabulary only.
    ///
    /// The default claims every request, so a processor that does not
    /// override it sees every request and every row, as before 0.4. Claim
    /// only the requests you edit: the host then skips your call in steps
    /// without them, and a fault of yours fails only the requests you
    /// claimed.
    #[cfg(not(feature = "wit-0-2"))]
    fn check_request(&self, extra_args: &str) -> Result<bool, String> {
        let _ = extra_args;
        Ok(true)
    }

    /// Edits for this step's rows. `batch.added_ids` / `added_extra_args`
    /// announce new requests once (with their output so far,
    /// [`BatchExt::added_output`]); `batch.removed_ids` those that left.
    /// An `Err` (or a trap) fails every row of the call (since 0.4). A
    /// processor that claims requests is told of each in a call of its
    /// own with no rows, under the per-request budget (`init_deadline_ms`),
    /// so that is the place for a request's costly start.
    fn process(&mut self, batch: &Batch) -> Result<Edits, String>;
}

/// The exports newer than 0.2 (`set-vocabulary`, `check-request`; nothing
/// for 0.2), inside
/// [`export_logits_processor!`](crate::export_logits_processor)'s impl.
#[cfg(not(feature = "wit-0-2"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __logits_processor_newer_exports {
    ($processor:ty, $wit:ty) => {
        fn set_vocabulary(vocab: $wit) -> ::std::result::Result<(), ::std::string::String> {
            $crate::state::with(|p: &mut $processor| {
                $crate::logits_processor::LogitsProcessor::set_vocabulary(p, &vocab)
            })
        }
        fn check_request(
            extra_args: ::std::string::String,
        ) -> ::std::result::Result<bool, ::std::string::String> {
            $crate::state::with(|p: &mut $processor| {
                $crate::logits_processor::LogitsProcessor::check_request(p, &extra_args)
            })
        }
    };
}

/// The exports newer than 0.2 (nothing for 0.2).
#[cfg(feature = "wit-0-2")]
#[doc(hidden)]
#[macro_export]
macro_rules! __logits_processor_newer_exports {
    ($processor:ty, $wit:ty) => {};
}

/// Exports a [`LogitsProcessor`] as the component's
/// `engine:plugins/logits-processor` interface. Use it once, at the crate
/// root of a `cdylib` built for `wasm32-wasip2`.
#[macro_export]
macro_rules! export_logits_processor {
    ($processor:ty) => {
        const _: () = {
            use $crate::logits_processor::bindings::exports::engine::plugins::logits_processor as __wit;
            struct __Export;
            impl __wit::Guest for __Export {
                fn metadata() -> __wit::PluginMetadata {
                    $crate::types::wit_metadata(
                        <$processor as $crate::logits_processor::LogitsProcessor>::metadata(),
                        $crate::types::PluginKind::LogitsProcessor,
                    )
                }
                fn init(options: ::std::string::String) -> ::std::result::Result<(), ::std::string::String> {
                    let p = <$processor as $crate::logits_processor::LogitsProcessor>::new(&options)?;
                    $crate::state::set(p);
                    Ok(())
                }
                $crate::__logits_processor_newer_exports!($processor, __wit::Vocabulary);
                fn process(batch: __wit::Batch) -> ::std::result::Result<__wit::LogitEdits, ::std::string::String> {
                    $crate::state::with(|p: &mut $processor| {
                        $crate::logits_processor::LogitsProcessor::process(p, &batch)
                    })
                }
            }
            // Native builds (the plugin's unit tests) export nothing: the
            // component symbol names are not valid native linker names.
            #[cfg(target_arch = "wasm32")]
            $crate::logits_processor::bindings::__export_logits_processor_world!(
                __Export with_types_in $crate::logits_processor::bindings
            );
        };
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_mask_sets_and_clears_bits() {
        let mut m = AllowMask::none(130);
        assert_eq!(m.words().len(), 3);
        assert_eq!(m.count(), 0);
        m.allow(0);
        m.allow(64);
        m.allow(129);
        m.allow(130); // past the vocabulary: ignored
        assert!(m.is_allowed(64) && m.is_allowed(129) && !m.is_allowed(1));
        m.disallow(64);
        assert_eq!(m.count(), 2);
        let all = AllowMask::all(130);
        assert_eq!(all.count(), 130);
        assert!(!all.is_allowed(130));
    }

    #[cfg(not(feature = "wit-0-2"))]
    #[test]
    fn a_mask_goes_into_the_edits_and_the_vocabulary_reads_back() {
        let mut m = AllowMask::none(70);
        m.allow(69);
        let mut e = Edits::none();
        e.mask(2, &m);
        assert_eq!(e.mask_rows, [2]);
        assert_eq!(e.mask_words, [0, 1 << 5]);
        let v = Vocabulary {
            token_bytes: b"<s>ab".to_vec(),
            token_ends: vec![3, 5],
            special_ids: vec![0],
            eos: Some(0),
        };
        assert_eq!(v.token(1), Some(&b"ab"[..]));
        assert!(v.is_special(0) && !v.is_special(1));
        assert_eq!(v.len(), 2);
    }

    #[cfg(not(feature = "wit-0-2"))]
    #[test]
    fn failed_rows_and_announced_outputs() {
        let mut e = Edits::none();
        e.fail(1, "the schema allows no more tokens");
        assert_eq!(e.fail_rows, [1]);
        assert_eq!(e.fail_messages, ["the schema allows no more tokens"]);
        let b = Batch {
            added_ids: vec![7, 8, 9],
            added_extra_args: vec!["null".into(); 3],
            added_output_ends: vec![0, 3, 4],
            added_output_tokens: vec![10, 11, 12, 13],
            removed_ids: Vec::new(),
            ids: Vec::new(),
            num_output_tokens: Vec::new(),
            last_tokens: Vec::new(),
            vocab_size: 100,
        };
        assert_eq!(b.added_output(0), &[] as &[u32]);
        assert_eq!(b.added_output(1), [10, 11, 12]);
        assert_eq!(b.added_output(2), [13]);
        assert_eq!(b.added_output(3), &[] as &[u32]);
    }

    /// A processor that does not override `check_request`.
    #[cfg(not(feature = "wit-0-2"))]
    struct EveryRow;

    #[cfg(not(feature = "wit-0-2"))]
    impl LogitsProcessor for EveryRow {
        fn metadata() -> Metadata {
            Metadata::new("test:every-row", "0.1.0")
        }
        fn new(_options: &str) -> Result<Self, String> {
            Ok(EveryRow)
        }
        fn process(&mut self, _batch: &Batch) -> Result<Edits, String> {
            Ok(Edits::none())
        }
    }

    #[cfg(not(feature = "wit-0-2"))]
    #[test]
    fn by_default_every_request_is_claimed() {
        let p = EveryRow::new("{}").unwrap();
        assert_eq!(p.check_request("null"), Ok(true));
        assert_eq!(p.check_request(r#"{"anything": 1}"#), Ok(true));
    }
}
