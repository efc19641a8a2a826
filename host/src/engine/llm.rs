//! The offline API (vLLM's `LLM` class): a batch of prompts in, completions
//! out, through the engine core. It is also the frontend: it tokenizes,
//! applies the chat template, detokenizes incrementally and watches for stop
//! strings, aborting a request in the core when one matches.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::core::{EngineCore, EngineCoreRequest, EngineStats};
use super::startup;
use crate::config::EngineConfig;
use crate::sampling::{SamplingParams, StopChecker};
use crate::scheduler;
use crate::tokenizer::{ChatMessage, IncrementalDetokenizer, Tokenizer};

/// What to complete.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Raw text, tokenized as is.
    Text(String),
    /// A conversation, rendered with the model's chat template (with the
    /// assistant's turn opened).
    Chat(Vec<ChatMessage>),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
}

/// One request of a batch.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateRequest {
    /// What to complete.
    pub prompt: Prompt,
    /// How to sample.
    pub params: SamplingParams,
    /// Scheduling priority (used by the priority policy).
    pub priority: i32,
}

/// Why a completion ended, as the OpenAI API and vLLM report it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finish {
    /// `"stop"`, `"length"` or `"abort"`.
    pub finish_reason: String,
    /// The stop string or stop token id that matched, if any.
    pub stop_reason: Option<serde_json::Value>,
}

/// A finished completion.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    /// The text generated (after stop-string truncation).
    pub text: String,
    /// The tokens generated.
    pub token_ids: Vec<u32>,
    /// Tokens in the prompt.
    pub num_prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub num_cached_tokens: u32,
    /// Why it ended.
    #[serde(flatten)]
    pub finish: Finish,
}

/// The frontend's state of one live request.
struct Live {
    index: usize,
    detok: IncrementalDetokenizer,
    stops: StopChecker,
    completion: Completion,
}

/// An engine for offline batches.
pub struct Llm {
    core: EngineCore,
    tokenizer: Tokenizer,
    next_id: u64,
}

impl Llm {
    /// Loads the model and starts the engine the configuration describes.
    pub fn new(config: &EngineConfig) -> anyhow::Result<Llm> {
        let (core, tokenizer) = startup::build_engine_core(config)?;
        Ok(Llm { core, tokenizer, next_id: 0 })
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The engine's counters.
    pub fn stats(&self) -> EngineStats {
        self.core.stats()
    }

    /// The engine core (for tests that check its invariants).
    pub fn core(&self) -> &EngineCore {
        &self.core
    }

    /// The prompt's token ids.
    pub fn encode(&self, prompt: &Prompt) -> anyhow::Result<Vec<u32>> {
        Ok(match prompt {
            Prompt::Text(text) => self.tokenizer.encode(text, true)?,
            Prompt::Chat(messages) => {
                let text = self.tokenizer.apply_chat_template(messages, true)?;
                // The template writes the special tokens itself.
                self.tokenizer.encode(&text, false)?
            }
            Prompt::Tokens(ids) => ids.clone(),
        })
    }

    /// Runs every request to completion, all in flight together, and returns
    /// one result per request in order: a completion, or the reason the
    /// request was refused. `on_text(index, delta)` sees each request's text
    /// as it is produced; `on_finish(done, total)` each completion.
    pub fn generate(
        &mut self,
        requests: &[GenerateRequest],
        mut on_text: impl FnMut(usize, &str),
        mut on_finish: impl FnMut(usize, usize),
    ) -> anyhow::Result<Vec<Result<Completion, String>>> {
        let mut results: Vec<Option<Result<Completion, String>>> = vec![None; requests.len()];
        let mut live: HashMap<String, Live> = HashMap::new();
        let mut done = 0;
        for (index, req) in requests.iter().enumerate() {
            let refused = |e: anyhow::Error| Some(Err(format!("{e:#}")));
            let ids = match self.encode(&req.prompt) {
                Ok(ids) => ids,
                Err(e) => {
                    results[index] = refused(e);
                    continue;
                }
            };
            self.next_id += 1;
            let request_id = format!("req-{}", self.next_id);
            let core_req = EngineCoreRequest {
                request_id: request_id.clone(),
                prompt_token_ids: ids.clone(),
                sampling_params: req.params.clone(),
                priority: req.priority,
            };
            if let Err(e) = self.core.add_request(core_req) {
                results[index] = refused(e.into());
                continue;
            }
            let completion = Completion {
                text: String::new(),
                token_ids: Vec::new(),
                num_prompt_tokens: ids.len(),
                num_cached_tokens: 0,
                finish: Finish { finish_reason: String::new(), stop_reason: None },
            };
            live.insert(
                request_id,
                Live {
                    index,
                    detok: self.tokenizer.detokenizer(req.params.skip_special_tokens),
                    stops: StopChecker::from_params(&req.params),
                    completion,
                },
            );
        }
        done += results.iter().filter(|r| r.is_some()).count();
        while !live.is_empty() {
            let mut stopped = Vec::new();
            for out in self.core.step()? {
                let Some(state) = live.get_mut(&out.request_id) else { continue };
                state.completion.num_cached_tokens = out.num_cached_tokens;
                let mut stop_string = None;
                for &t in &out.new_token_ids {
                    state.completion.token_ids.push(t);
                    let update = state.stops.push(state.detok.push(t)?);
                    on_text(state.index, &update.text);
                    state.completion.text.push_str(&update.text);
                    if update.stop.is_some() {
                        stop_string = update.stop;
                        break;
                    }
                }
                let finish = match (stop_string, out.finish_reason) {
                    (Some(s), _) => {
                        stopped.push(out.request_id.clone());
                        Finish { finish_reason: "stop".into(), stop_reason: Some(s.into()) }
                    }
                    (None, Some(reason)) => {
                        let tail = state.stops.finish() + state.detok.finish();
                        on_text(state.index, &tail);
                        state.completion.text.push_str(&tail);
                        let stop_reason = match reason {
                            scheduler::FinishReason::StopToken(t) => Some(t.into()),
                            _ => None,
                        };
                        Finish { finish_reason: reason.as_str().into(), stop_reason }
                    }
                    (None, None) => continue,
                };
                let mut state = live.remove(&out.request_id).expect("looked up above");
                state.completion.finish = finish;
                results[state.index] = Some(Ok(state.completion));
                done += 1;
                on_finish(done, requests.len());
            }
            // A stop string ends the request in the frontend; free its blocks.
            self.core.abort_requests(&stopped);
        }
        Ok(results.into_iter().map(|r| r.expect("every request finished or was refused")).collect())
    }
}
