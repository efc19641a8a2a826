//! What a worker hands back for one step (vLLM's `ModelRunnerOutput`): the
//! token each request sampled and, where asked for, its logprobs. It is
//! serde so it can cross the message queue from a worker process.

use serde::{Deserialize, Serialize};

use crate::scheduler::ReqHandle;

/// The sampled token's logprob and the most likely alternatives, under the
/// raw model output (vLLM's `raw_logprobs`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Logprobs {
    /// `log_softmax(logits)[sampled token]`.
    pub logprob: f32,
    /// `(token, logprob)` of the `SamplingParams::logprobs` most likely
    /// tokens, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// One step's sampled tokens.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelRunnerOutput {
    /// Each request that reached the end of its known tokens, with the token
    /// it sampled.
    pub sampled: Vec<(ReqHandle, [u32; 1])>,
    /// Parallel to `sampled`: logprobs for the requests that asked for them.
    pub logprobs: Vec<Option<Logprobs>>,
}

impl ModelRunnerOutput {
    /// The logprobs sampled for `h` this step, if it asked for them.
    pub fn logprobs_of(&self, h: ReqHandle) -> Option<&Logprobs> {
        // Only requests that asked carry logprobs, so the scan is skipped
        // in the common case.
        if self.logprobs.iter().all(Option::is_none) {
            return None;
        }
        let i = self.sampled.iter().position(|(s, _)| *s == h)?;
        self.logprobs[i].as_ref()
    }
}
