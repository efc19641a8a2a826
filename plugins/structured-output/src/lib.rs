//! `engine:structured-output`: a logits processor that constrains chosen
//! requests' output to a JSON schema, a regular expression, a list of
//! choices or a Lark grammar, with llguidance computing each step's
//! allow-mask.
//!
//! A request opts in through its `extra_args`: `{"structured_outputs":
//! {...}}`, shaped like vLLM's `StructuredOutputsParams` (see
//! [`constraint`]). `check-request` compiles the constraint (so the API
//! server can refuse a bad one with a 400), `process` feeds each row's
//! sampled token to the request's matcher and answers its mask; EOS is
//! allowed only where the constraint accepts. A token the constraint
//! rejects fails that request alone (`fail-rows`).
//!
//! The logic lives in plain modules that build natively (tests, bench);
//! this file is only the glue to `engine:plugins@0.4.0`, generated with
//! wit-bindgen directly, as a plugin in any language would be.

pub mod compiler;
pub mod constraint;
pub mod mask;
pub mod processor;
pub mod vocab;

wit_bindgen::generate!({
    path: "../../wit/v0.4.0",
    world: "engine:plugins/logits-processor-plugin@0.4.0",
});

use std::cell::RefCell;

use engine::plugins::types::PluginKind;
use exports::engine::plugins::logits_processor::{
    Batch, Guest, LogitEdits, PluginMetadata, Vocabulary,
};

use processor::{Processor, Step};
use vocab::FlatVocab;

thread_local! {
    static STATE: RefCell<Processor> = RefCell::new(Processor::default());
}

struct StructuredOutput;

impl Guest for StructuredOutput {
    fn metadata() -> PluginMetadata {
        PluginMetadata {
            name: "engine:structured-output".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            kind: PluginKind::LogitsProcessor,
            options: Vec::new(),
        }
    }

    fn init(options: String) -> Result<(), String> {
        match serde_json::from_str::<serde_json::Value>(&options) {
            Ok(serde_json::Value::Null) => {}
            Ok(serde_json::Value::Object(o)) if o.is_empty() => {}
            Ok(other) => {
                return Err(format!(
                    "engine:structured-output takes no options, got {other}"
                ))
            }
            Err(e) => return Err(format!("options are not valid JSON: {e}")),
        }
        STATE.with(|s| *s.borrow_mut() = Processor::default());
        Ok(())
    }

    fn set_vocabulary(v: Vocabulary) -> Result<(), String> {
        STATE.with(|s| {
            s.borrow_mut().set_vocabulary(FlatVocab {
                token_bytes: &v.token_bytes,
                token_ends: &v.token_ends,
                special_ids: &v.special_ids,
                eos: v.eos,
            })
        })
    }

    fn check_request(extra_args: String) -> Result<bool, String> {
        STATE.with(|s| s.borrow_mut().check_request(&extra_args))
    }

    fn process(b: Batch) -> Result<LogitEdits, String> {
        let e = STATE.with(|s| {
            s.borrow_mut().process(Step {
                added_ids: &b.added_ids,
                added_extra_args: &b.added_extra_args,
                added_output_ends: &b.added_output_ends,
                added_output_tokens: &b.added_output_tokens,
                removed_ids: &b.removed_ids,
                ids: &b.ids,
                num_output_tokens: &b.num_output_tokens,
                last_tokens: &b.last_tokens,
                vocab_size: b.vocab_size,
            })
        })?;
        Ok(LogitEdits {
            ban_rows: Vec::new(),
            ban_tokens: Vec::new(),
            bias_rows: Vec::new(),
            bias_tokens: Vec::new(),
            bias_values: Vec::new(),
            mask_rows: e.mask_rows,
            mask_words: e.mask_words,
            fail_rows: e.fail_rows,
            fail_messages: e.fail_messages,
        })
    }
}

#[cfg(target_arch = "wasm32")]
export!(StructuredOutput);
