//! vLLM's beam search (`use_beam_search`, `length_penalty`), run the way
//! vLLM's frontend runs it: every step extends each live beam by one token
//! through an engine request for one token with the `2 × width` most
//! likely tokens' logprobs (the prefix cache serves each beam's earlier
//! tokens), keeps the `width` best extensions, and sets aside those that
//! drew the end-of-sequence token as complete. The answer is the `width`
//! best of the complete and the still-live beams, each scored as vLLM
//! scores it: cumulative logprob / length^`length_penalty`, the length
//! counting the prompt and not a final EOS.

use std::cmp::Ordering;

use crate::engine::Finish;
use crate::sampling::{SamplingParams, MAX_LOGPROBS};

use super::error::ApiError;
use super::generate::{self, Choice, Extras};
use super::protocol::{AnswerRequest, PromptTokens, Usage};
use super::AppState;

/// The widest beam search: each step asks for `2 × width` logprobs.
pub const MAX_BEAM_WIDTH: u32 = MAX_LOGPROBS / 2;

/// One beam search: its width (the request's `n`), its length penalty and
/// how far it runs.
#[derive(Clone, Copy, Debug)]
pub struct BeamSearch {
    width: usize,
    length_penalty: f64,
    max_tokens: u32,
    ignore_eos: bool,
    skip_special_tokens: bool,
}

impl BeamSearch {
    /// The beam search a request asks for with `use_beam_search`, `None`
    /// without it. `params` are the request's validated sampling
    /// parameters: `n` is the width; a field beam search does not use
    /// (it ranks by the model's own logprobs) is a 400 naming it rather
    /// than ignored. `features` pairs the endpoint's own features beam
    /// search cannot go with (tools, `echo`, …) with whether the request
    /// asked for them; streaming is one for every endpoint.
    pub fn requested(
        answer: &AnswerRequest,
        params: &SamplingParams,
        features: &[(bool, &'static str)],
    ) -> Result<Option<BeamSearch>, ApiError> {
        if !answer.use_beam_search {
            if answer.length_penalty.is_some_and(|p| p != 1.0) {
                return Err(ApiError::field(
                    "length_penalty",
                    "applies to beam search; set `use_beam_search: true` or leave it out",
                ));
            }
            return Ok(None);
        }
        let feature = std::iter::once(&(answer.stream, "stream"))
            .chain(features)
            .find_map(|&(set, field)| set.then_some(field));
        if let Some(field) = feature.or_else(|| unused_field(params)) {
            return Err(ApiError::field(
                field,
                "is not used by beam search, which ranks beams by the model's own logprobs; \
                 leave it out or set `use_beam_search: false`",
            ));
        }
        if params.n > MAX_BEAM_WIDTH {
            return Err(ApiError::field(
                "n",
                format!(
                    "is the beam width under beam search: at most {MAX_BEAM_WIDTH}, got {}",
                    params.n
                ),
            ));
        }
        let length_penalty = answer.length_penalty.unwrap_or(1.0);
        if !length_penalty.is_finite() {
            return Err(ApiError::field("length_penalty", "must be a finite number"));
        }
        Ok(Some(BeamSearch {
            width: params.n as usize,
            length_penalty,
            max_tokens: params.max_tokens,
            ignore_eos: params.ignore_eos,
            skip_special_tokens: params.skip_special_tokens,
        }))
    }

    /// Runs the search on every prompt and returns `width` choices per
    /// prompt (`prompt × width + rank`, best first) with the answer's token
    /// counts.
    pub async fn run(
        &self,
        app: &AppState,
        request_id: &str,
        prompts: Vec<Vec<u32>>,
        extras: Extras<'_>,
    ) -> Result<(Vec<Choice>, Usage), ApiError> {
        let eos = app.tokenizer.eos_token_id().filter(|_| !self.ignore_eos);
        let step = SamplingParams {
            max_tokens: 1,
            logprobs: Some(2 * self.width as u32),
            temperature: 0.0,
            ignore_eos: true,
            ..SamplingParams::default()
        };
        let mut searches: Vec<Search> = prompts.into_iter().map(Search::new).collect();
        let mut prompt = PromptTokens::default();
        for round in 0..self.max_tokens {
            // Every live beam of every prompt, as one batch for the engine.
            let batch: Vec<Vec<u32>> = searches
                .iter()
                .flat_map(|s| s.live.iter().map(|b| [&s.prompt[..], &b.tokens].concat()))
                .collect();
            if batch.is_empty() {
                break;
            }
            let step_id = format!("{request_id}-beam{round}");
            let seqs = generate::start(app, &step_id, batch, &step, extras).await?;
            if round == 0 {
                prompt = generate::prompt_tokens(&seqs);
            }
            let (outputs, _) = generate::collect(app, seqs).await?;
            let mut outputs = outputs.into_iter();
            for search in &mut searches {
                let extended = search
                    .live
                    .iter()
                    .zip(outputs.by_ref())
                    .flat_map(|(beam, out)| beam.extensions(&out))
                    .collect();
                search.advance(extended, eos, self);
            }
        }
        let mut choices = Vec::new();
        let mut completion_tokens = 0;
        for (p, search) in searches.into_iter().enumerate() {
            for (rank, beam) in search.best(eos, self).into_iter().enumerate() {
                completion_tokens += beam.tokens.len();
                choices.push(self.choice(app, p * self.width + rank, beam, eos)?);
            }
        }
        Ok((choices, Usage::new(prompt, completion_tokens)))
    }

    /// vLLM's beam score.
    fn score(&self, prompt_len: usize, beam: &Beam, eos: Option<u32>) -> f64 {
        let ends = beam.tokens.last().is_some_and(|t| Some(*t) == eos);
        let len = prompt_len + beam.tokens.len() - usize::from(ends);
        beam.cum_logprob / (len as f64).powf(self.length_penalty)
    }

    /// A finished beam as a choice: `stop` when it drew EOS, else `length`.
    fn choice(
        &self,
        app: &AppState,
        index: usize,
        beam: Beam,
        eos: Option<u32>,
    ) -> Result<Choice, ApiError> {
        let stopped = beam.tokens.last().is_some_and(|t| Some(*t) == eos);
        let text = app
            .tokenizer
            .decode(&beam.tokens, self.skip_special_tokens)
            .map_err(|e| ApiError::internal(format!("detokenizing a beam: {e}")))?;
        Ok(Choice {
            index,
            text,
            token_ids: beam.tokens,
            finish: Some(Finish {
                finish_reason: if stopped { "stop" } else { "length" }.into(),
                stop_reason: None,
                error: None,
            }),
            ..Choice::default()
        })
    }
}

/// The first sampling field set that beam search does not use.
fn unused_field(p: &SamplingParams) -> Option<&'static str> {
    let d = SamplingParams::default();
    [
        ("top_p", p.top_p != d.top_p),
        ("top_k", p.top_k > 0),
        ("min_p", p.min_p != d.min_p),
        ("presence_penalty", p.presence_penalty != d.presence_penalty),
        (
            "frequency_penalty",
            p.frequency_penalty != d.frequency_penalty,
        ),
        (
            "repetition_penalty",
            p.repetition_penalty != d.repetition_penalty,
        ),
        ("min_tokens", p.min_tokens != d.min_tokens),
        ("stop", !p.stop.is_empty()),
        ("stop_token_ids", !p.stop_token_ids.is_empty()),
        ("logprobs", p.logprobs.is_some()),
        ("prompt_logprobs", p.prompt_logprobs.is_some()),
        ("logit_bias", !p.logit_bias.is_empty()),
        ("allowed_token_ids", p.allowed_token_ids.is_some()),
        ("bad_words", !p.bad_words_token_ids.is_empty()),
        ("extra_args", p.extra_args.is_some()),
    ]
    .into_iter()
    .find_map(|(field, set)| set.then_some(field))
}

/// One prompt's search.
struct Search {
    prompt: Vec<u32>,
    live: Vec<Beam>,
    complete: Vec<Beam>,
}

/// A beam: the tokens generated so far and their summed logprob.
#[derive(Clone, Debug)]
struct Beam {
    tokens: Vec<u32>,
    cum_logprob: f64,
}

impl Beam {
    /// This beam extended by each of the most likely next tokens `out`
    /// reports.
    fn extensions(&self, out: &Choice) -> Vec<Beam> {
        let top = out.logprobs.first().map_or(&[][..], |l| &l.top[..]);
        top.iter()
            .map(|&(token, logprob)| Beam {
                tokens: [&self.tokens[..], &[token]].concat(),
                cum_logprob: self.cum_logprob + f64::from(logprob),
            })
            .collect()
    }
}

impl Search {
    fn new(prompt: Vec<u32>) -> Search {
        Search {
            prompt,
            live: vec![Beam {
                tokens: Vec::new(),
                cum_logprob: 0.0,
            }],
            complete: Vec::new(),
        }
    }

    /// Keeps the `width` best of `extended` live; those ending in EOS are
    /// complete.
    fn advance(&mut self, extended: Vec<Beam>, eos: Option<u32>, search: &BeamSearch) {
        let (done, mut live): (Vec<Beam>, Vec<Beam>) = extended
            .into_iter()
            .partition(|b| b.tokens.last().is_some_and(|t| Some(*t) == eos));
        self.complete.extend(done);
        self.sort(&mut live, eos, search);
        live.truncate(search.width);
        self.live = live;
    }

    /// The `width` best of the complete and live beams, best first.
    fn best(mut self, eos: Option<u32>, search: &BeamSearch) -> Vec<Beam> {
        let mut all = std::mem::take(&mut self.complete);
        all.append(&mut self.live);
        self.sort(&mut all, eos, search);
        all.truncate(search.width);
        all
    }

    /// Best score first; ties keep their order (a stable sort, as vLLM's).
    fn sort(&self, beams: &mut [Beam], eos: Option<u32>, search: &BeamSearch) {
        let len = self.prompt.len();
        beams.sort_by(|a, b| {
            let (a, b) = (search.score(len, a, eos), search.score(len, b, eos));
            b.partial_cmp(&a).unwrap_or(Ordering::Equal)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn beams(length_penalty: Option<f64>) -> AnswerRequest {
        AnswerRequest {
            use_beam_search: true,
            length_penalty,
            ..AnswerRequest::default()
        }
    }

    fn search(length_penalty: f64) -> BeamSearch {
        let params = SamplingParams {
            n: 2,
            ..SamplingParams::default()
        };
        BeamSearch::requested(&beams(Some(length_penalty)), &params, &[])
            .unwrap()
            .unwrap()
    }

    #[test]
    fn beams_score_as_vllm_scores_them() {
        let beam = Beam {
            tokens: vec![5, 6, 2],
            cum_logprob: -3.0,
        };
        // Prompt 3 + 3 tokens, the final EOS not counted: 5.
        assert_eq!(search(1.0).score(3, &beam, Some(2)), -3.0 / 5.0);
        assert_eq!(search(1.0).score(3, &beam, None), -3.0 / 6.0);
        assert_eq!(search(0.5).score(3, &beam, Some(2)), -3.0 / 5f64.sqrt());
    }

    #[test]
    fn the_best_complete_or_live_beams_win_in_score_order() {
        let mut s = Search::new(vec![1, 1, 1]);
        let beam = |tokens: Vec<u32>, cum_logprob| Beam {
            tokens,
            cum_logprob,
        };
        let extended = vec![
            beam(vec![7], -1.0),
            beam(vec![2], -0.5),
            beam(vec![8], -0.7),
            beam(vec![9], -2.0),
        ];
        s.advance(extended, Some(2), &search(1.0));
        let live: Vec<_> = s.live.iter().map(|b| b.tokens.clone()).collect();
        assert_eq!(live, [vec![8], vec![7]], "the EOS beam is set aside");
        let best: Vec<_> = s
            .best(Some(2), &search(1.0))
            .into_iter()
            .map(|b| b.tokens)
            .collect();
        // -0.5 / 3 (EOS not counted) beats -0.7 / 4 and -1.0 / 4.
        assert_eq!(best, [vec![2], vec![8]]);
    }

    #[test]
    fn what_beam_search_does_not_use_is_named() {
        let params = SamplingParams {
            top_p: 0.5,
            ..SamplingParams::default()
        };
        let e = BeamSearch::requested(&beams(None), &params, &[]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_p"));
        let streamed = AnswerRequest {
            stream: true,
            ..beams(None)
        };
        let plain = SamplingParams::default();
        let e = BeamSearch::requested(&streamed, &plain, &[]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stream"));
        let features = [(false, "tools"), (true, "echo")];
        let e = BeamSearch::requested(&beams(None), &plain, &features).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("echo"));
        assert!(BeamSearch::requested(&beams(None), &plain, &features[..1])
            .unwrap()
            .is_some());
        let wide = SamplingParams {
            n: MAX_BEAM_WIDTH + 1,
            ..SamplingParams::default()
        };
        let e = BeamSearch::requested(&beams(None), &wide, &[]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("n"));
        let penalised = |p| AnswerRequest {
            length_penalty: Some(p),
            ..AnswerRequest::default()
        };
        let e = BeamSearch::requested(&penalised(0.5), &params, &[]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("length_penalty"));
        assert!(BeamSearch::requested(&penalised(1.0), &params, &[])
            .unwrap()
            .is_none());
    }
}
