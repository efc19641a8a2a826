//! The offline API (vLLM's `LLM` class): a batch of prompts in, completions
//! out, through the engine core. It is also the frontend: it tokenizes,
//! applies the chat template, detokenizes incrementally and watches for stop
//! strings, aborting a request in the core when one matches.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::core::{EngineCore, EngineCoreRequest, EngineStats};
use super::output_processor::{Finish, RequestMetrics, RequestState};
use super::startup;
use crate::config::EngineConfig;
use crate::sampling::SamplingParams;
use crate::scheduler::PredictionTokens;
use crate::step::{Logprobs, PromptLogprob};
use crate::tokenizer::{ChatMessage, Tokenizer};

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
    /// Text the output is expected to repeat (OpenAI's predicted output),
    /// verified as speculative drafts; needs speculative decoding on.
    pub prediction: Option<String>,
    /// vLLM's `cache_salt`: the request shares prefix-cache blocks only
    /// with requests of the same salt (a tenant's prompts are not served
    /// from another's cache). `host generate` and the server refuse an
    /// empty salt, as vLLM does.
    pub cache_salt: Option<String>,
}

impl GenerateRequest {
    /// A request for `prompt` sampled with `params`: default priority, no
    /// prediction, no cache salt.
    pub fn new(prompt: Prompt, params: SamplingParams) -> Self {
        GenerateRequest {
            prompt,
            params,
            priority: 0,
            prediction: None,
            cache_salt: None,
        }
    }
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
    /// Logprobs of `token_ids`, when the request asked for them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logprobs: Vec<Logprobs>,
    /// Logprobs of prompt tokens 1.. (token 0 has none), when the request
    /// asked for them (`prompt_logprobs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Vec<PromptLogprob>>,
    /// Why it ended.
    #[serde(flatten)]
    pub finish: Finish,
    /// How the request's prediction fared, when it had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prediction_tokens: Option<PredictionTokens>,
    /// Its latencies.
    pub metrics: RequestMetrics,
}

/// A live request of a batch.
struct Live {
    index: usize,
    state: RequestState,
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
        anyhow::ensure!(
            config.parallel.data_parallel_size == 1,
            "parallel.data_parallel_size is {}, but the offline engine runs one engine core; \
             serve the model (`host serve`) for data parallelism, or set it to 1",
            config.parallel.data_parallel_size
        );
        let (core, tokenizer) = startup::build_engine_core(config)?;
        Ok(Llm {
            core,
            tokenizer,
            next_id: 0,
        })
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

    /// Calls `method` on every worker with `args` (vLLM's
    /// `LLM.collective_rpc`), e.g. a worker extension's
    /// `"engine:weight-tools.stats"`; the replies in rank order.
    pub fn collective_rpc(
        &mut self,
        method: &str,
        args: Option<serde_json::Value>,
    ) -> Result<Vec<serde_json::Value>, String> {
        let mut call = serde_json::json!({ "method": method });
        if let Some(args) = args {
            call["args"] = args;
        }
        match self.core.call_utility("collective_rpc", call)? {
            serde_json::Value::Array(replies) => Ok(replies),
            other => Err(format!(
                "collective_rpc returned {other} instead of a list of replies"
            )),
        }
    }

    /// Puts the workers to sleep (vLLM's `LLM.sleep`): level 1 offloads
    /// the weights to host memory, level 2 drops them; the KV cache and the
    /// cached prefixes are dropped at both. Needs no request running.
    pub fn sleep(&mut self, level: u64) -> Result<(), String> {
        self.core.sleep(level)
    }

    /// Wakes the `tags` (`"weights"`, `"kv_cache"`) of every worker, all
    /// when `None` (vLLM's `LLM.wake_up`).
    pub fn wake_up(&mut self, tags: Option<&[String]>) -> Result<(), String> {
        self.core.wake_up(tags)
    }

    /// Whether the workers sleep.
    pub fn is_sleeping(&self) -> bool {
        self.core.is_sleeping()
    }

    /// Replaces named tensors on every worker, each given in full as f32
    /// (row-major), and forgets the cached prefixes computed with the old
    /// values. Every name and size is checked before anything changes.
    pub fn update_weights(&mut self, updates: &[(&str, &[f32])]) -> Result<(), String> {
        let object: serde_json::Map<String, serde_json::Value> = updates
            .iter()
            .map(|(name, values)| (name.to_string(), serde_json::json!(values)))
            .collect();
        self.core
            .call_utility("update_weights", serde_json::Value::Object(object))
            .map(drop)
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
        if self.is_sleeping() {
            anyhow::bail!("the engine sleeps; call wake_up before generating");
        }
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
            let prediction = match &req.prediction {
                Some(text) => match self.tokenizer.encode(text, false) {
                    Ok(ids) => ids,
                    Err(e) => {
                        results[index] = refused(e.into());
                        continue;
                    }
                },
                None => Vec::new(),
            };
            self.next_id += 1;
            let request_id = format!("req-{}", self.next_id);
            let core_req = EngineCoreRequest {
                request_id: request_id.clone(),
                prompt_token_ids: ids.clone(),
                sampling_params: req.params.clone(),
                priority: req.priority,
                output_token_ids: Vec::new(),
                prediction,
                cache_salt: req.cache_salt.clone(),
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
                logprobs: Vec::new(),
                prompt_logprobs: req.params.prompt_logprobs.map(|_| Vec::new()),
                finish: Finish {
                    finish_reason: String::new(),
                    stop_reason: None,
                    error: None,
                },
                metrics: RequestMetrics::default(),
                prediction_tokens: None,
            };
            let state = RequestState::new(&self.tokenizer, &req.params);
            live.insert(
                request_id,
                Live {
                    index,
                    state,
                    completion,
                },
            );
        }
        done += results.iter().filter(|r| r.is_some()).count();
        while !live.is_empty() {
            let mut stopped = Vec::new();
            // A dead `mp` worker group is replaced (within the restart
            // budget) and its requests replayed, as under the server.
            let outputs = match self.core.step() {
                Ok(outputs) => outputs,
                Err(e) => {
                    self.core.recover(e)?;
                    continue;
                }
            };
            for out in outputs {
                let Some(req) = live.get_mut(&out.request_id) else {
                    continue;
                };
                let delta = req.state.process(&out)?;
                on_text(req.index, &delta.text);
                let c = &mut req.completion;
                c.num_cached_tokens = out.num_cached_tokens;
                c.prediction_tokens = delta.prediction_tokens;
                c.text.push_str(&delta.text);
                c.token_ids.extend_from_slice(&delta.token_ids);
                c.logprobs.extend(delta.logprobs);
                if let Some(p) = delta.prompt_logprobs {
                    c.prompt_logprobs = Some(p);
                }
                let Some(finish) = delta.finish else { continue };
                if out.finish_reason.is_none() {
                    // A stop string ended it in the frontend.
                    stopped.push(out.request_id.clone());
                }
                let mut req = live.remove(&out.request_id).expect("looked up above");
                results[req.index] = Some(match finish.error {
                    // The engine failed this request (a plugin fault) and serves on.
                    Some(error) => Err(error),
                    None => {
                        req.completion.finish = finish;
                        req.completion.metrics = req.state.metrics().clone();
                        Ok(req.completion)
                    }
                });
                done += 1;
                on_finish(done, requests.len());
            }
            // Free the blocks of requests a stop string ended.
            self.core.abort_requests(&stopped);
        }
        Ok(results
            .into_iter()
            .map(|r| r.expect("every request finished or was refused"))
            .collect())
    }
}
