//! The API server's request checker: one instance of each configured
//! logits processor, given the served model's vocabulary, that answers
//! `check-request` before a request is queued, so a constraint a 0.4
//! processor refuses (a schema that does not compile) is a 400 at once
//! instead of a failed request later. The workers' instances ask again when
//! the request reaches them; the WIT requires the same answer from any
//! instance.

use std::sync::Mutex;

use super::processor::LogitsProcessors;
use super::registry::PluginHost;
use super::PluginError;
use crate::sampling::Vocabulary;

/// Asks the logits processors whether they accept a request's
/// `extra_args`. Shared by the server's threads; one check at a time.
#[derive(Debug)]
pub struct RequestChecker {
    processors: Mutex<LogitsProcessors>,
}

impl RequestChecker {
    /// Instantiates the logits processors `names` (`plugins.logits_processors`)
    /// from `host` and gives them `vocabulary` (the structured-output
    /// `backend` only once a request asks for structured output); `None`
    /// when none of them checks requests (none is built against WIT 0.4 or
    /// later), so nothing is ever refused.
    pub fn new(
        host: &PluginHost,
        names: &[String],
        backend: &str,
        vocabulary: &Vocabulary,
    ) -> Result<Option<RequestChecker>, PluginError> {
        let Some(mut processors) = host.logits_processors(names)? else {
            return Ok(None);
        };
        if !processors.checks_requests() {
            return Ok(None);
        }
        processors.claim_only_with(backend, crate::sampling::STRUCTURED_OUTPUTS_KEY);
        processors.set_vocabulary(vocabulary)?;
        Ok(Some(RequestChecker {
            processors: Mutex::new(processors),
        }))
    }

    /// `Ok` when every processor accepts a request with these `extra_args`;
    /// else the first refusal, prefixed with the plugin's qualified name.
    pub fn check(&self, extra_args: Option<&serde_json::Value>) -> Result<(), String> {
        // A panic while checking leaves the instances as sound as a fault
        // does (they are recreated on their next fault), so a poisoned
        // lock is taken over.
        let mut processors = self
            .processors
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        processors.check(extra_args)
    }
}
