//! Randomized scheduler invariants over random configurations, request
//! streams (with shared prefixes), sampled tokens and aborts, with one step
//! in flight (synchronous) or two (async scheduling: step N+1 is scheduled
//! before step N's tokens are applied).
//!
//! A mirror of the worker applies every `SchedulerOutput` by the documented
//! contract, knows the tokens it sampled before the scheduler does, and must
//! always hold the same block tables and computed-token counts as the
//! scheduler; stop decisions are re-derived from the tokens with an
//! independent rule. Each sampled token is a function of the request and
//! its position, so every request's tokens must come out the same whatever
//! the batching, preemption, pipelining or speculative decoding (the mirror
//! keeps each draft that equals the token of its position, as sampling
//! would).

use std::collections::HashMap;

use proptest::prelude::*;

use super::*;
use crate::sampling::SamplingParams;
use crate::step::SchedulerOutput;

const EOS: u32 = 2;
const VOCAB: u64 = 16;
const MAX_STEPS: usize = 5000;

#[derive(Debug, Clone)]
struct Cfg {
    block_size: u32,
    num_blocks: u32,
    max_num_seqs: u32,
    budget: u32,
    chunked: bool,
    threshold: u32,
    caching: bool,
    priority: bool,
    /// `num_speculative_tokens` (0: off) and the n-gram lengths.
    spec: (u32, u32, u32),
}

#[derive(Debug, Clone)]
struct Spec {
    prefix: usize,
    prefix_len: usize,
    suffix_len: u32,
    max_tokens: u32,
    min_tokens: u32,
    stop: Option<u32>,
    ignore_eos: bool,
    priority: i32,
    arrive_step: usize,
    abort_after: Option<usize>,
    /// A predicted output (with drafts on): this many of the request's
    /// true tokens, every k-th one wrong.
    prediction: Option<(usize, usize)>,
}

fn cfg_strategy() -> impl Strategy<Value = Cfg> {
    (
        prop_oneof![Just(1u32), Just(2), Just(4), Just(16)],
        4u32..48,
        1u32..8,
        8u32..96,
        any::<bool>(),
        prop_oneof![Just(0u32), 1u32..24],
        any::<bool>(),
        any::<bool>(),
        (prop_oneof![Just(0u32), 1u32..6], 1u32..3, 0u32..2),
    )
        .prop_map(
            |(
                block_size,
                blocks,
                max_num_seqs,
                budget,
                chunked,
                threshold,
                caching,
                priority,
                (k, min_n, extra),
            )| {
                Cfg {
                    block_size,
                    // Keep the cache small in tokens so preemption happens often.
                    num_blocks: (blocks * 4 / block_size).max(2),
                    max_num_seqs,
                    budget,
                    chunked,
                    threshold,
                    caching,
                    priority,
                    spec: (k, min_n, min_n + extra),
                }
            },
        )
}

fn spec_strategy() -> impl Strategy<Value = Spec> {
    (
        (0usize..3, 0usize..40, 1u32..20),
        (
            1u32..24,
            0u32..24,
            proptest::option::of(3u32..VOCAB as u32),
            any::<bool>(),
        ),
        (
            -2i32..3,
            0usize..30,
            proptest::option::weighted(0.15, 0usize..20),
            proptest::option::weighted(0.3, (0usize..40, 2usize..8)),
        ),
    )
        .prop_map(
            |(
                (prefix, prefix_len, suffix_len),
                (max_tokens, min, stop, ignore_eos),
                (priority, arrive_step, abort_after, prediction),
            )| {
                Spec {
                    prefix,
                    prefix_len,
                    suffix_len,
                    max_tokens,
                    min_tokens: min % (max_tokens + 1),
                    stop,
                    ignore_eos,
                    priority,
                    arrive_step,
                    abort_after,
                    prediction,
                }
            },
        )
}

/// xorshift64*: a tiny deterministic token source.
fn next(rng: &mut u64) -> u64 {
    *rng ^= *rng >> 12;
    *rng ^= *rng << 25;
    *rng ^= *rng >> 27;
    rng.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

/// The worker's view of one request, built only from scheduler outputs.
#[derive(Debug, Default)]
struct Mirror {
    blocks: Vec<u32>,
    computed: usize,
    /// Prompt and sampled tokens, as the worker knows them.
    known: usize,
    prompt_len: usize,
}

/// The token "sampled" at output position `pos` of request `i`.
fn token_at(i: usize, pos: usize) -> u32 {
    let mut x = ((i as u64) << 32 | pos as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
    (next(&mut x) % VOCAB) as u32
}

/// Expected finish of a token sequence under `spec`'s stop rules, derived
/// independently of the scheduler: the first position where a stop applies.
fn expected_finish(spec: &Spec, tokens: &[u32]) -> Option<(usize, FinishReason)> {
    tokens.iter().enumerate().find_map(|(k, &t)| {
        let n = k as u32 + 1;
        let reason = if n >= spec.min_tokens && !spec.ignore_eos && t == EOS {
            Some(FinishReason::Eos)
        } else if n >= spec.min_tokens && spec.stop == Some(t) {
            Some(FinishReason::StopToken(t))
        } else if n >= spec.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        };
        reason.map(|r| (k + 1, r))
    })
}

fn run(cfg: Cfg, specs: Vec<Spec>, seed: u64, depth: usize) -> Result<(), TestCaseError> {
    let max_model_len = 80u32;
    let config = SchedulerConfig {
        max_num_seqs: cfg.max_num_seqs,
        max_num_batched_tokens: if cfg.chunked {
            cfg.budget
        } else {
            cfg.budget.max(max_model_len)
        },
        max_model_len,
        long_prefill_token_threshold: cfg.threshold,
        enable_chunked_prefill: cfg.chunked,
        block_size: cfg.block_size,
        num_blocks: cfg.num_blocks,
        enable_prefix_caching: cfg.caching,
        eos_token_id: Some(EOS),
        policy: if cfg.priority {
            "builtin:priority"
        } else {
            "builtin:fcfs"
        }
        .into(),
        num_speculative_tokens: cfg.spec.0,
        prompt_lookup_min: cfg.spec.1,
        prompt_lookup_max: cfg.spec.2,
    };
    let budget = config.max_num_batched_tokens;
    let mut s = Scheduler::new(config).unwrap();
    let mut rng = seed | 1;
    let prefixes: Vec<Vec<u32>> = (0..3)
        .map(|p| (0..40).map(|j| 1000 * (p + 1) + j).collect())
        .collect();

    let mut handle_spec: HashMap<ReqHandle, usize> = HashMap::new();
    let mut admitted_at: HashMap<usize, usize> = HashMap::new();
    let mut tokens_of: Vec<Vec<u32>> = vec![Vec::new(); specs.len()];
    let mut finish_of: Vec<Option<FinishReason>> = vec![None; specs.len()];
    let mut accepted = vec![false; specs.len()];
    let mut predicted: Vec<Option<PredictionTokens>> = vec![None; specs.len()];
    let mut mirror: HashMap<ReqHandle, Mirror> = HashMap::new();
    let mut in_flight = std::collections::VecDeque::new();

    let mut step = 0;
    loop {
        for (i, spec) in specs
            .iter()
            .enumerate()
            .filter(|(_, sp)| sp.arrive_step == step)
        {
            let mut prompt = prefixes[spec.prefix][..spec.prefix_len].to_vec();
            prompt.extend((0..spec.suffix_len).map(|_| 100 + (next(&mut rng) % 500) as u32));
            let params = SamplingParams {
                max_tokens: spec.max_tokens,
                min_tokens: spec.min_tokens,
                stop_token_ids: spec.stop.into_iter().collect(),
                ignore_eos: spec.ignore_eos,
                ..SamplingParams::default()
            };
            let total = prompt.len() as u32 + spec.max_tokens;
            let fits_len = total <= max_model_len;
            let fits_kv = (total - 1).div_ceil(cfg.block_size) <= cfg.num_blocks;
            let mut req = Request::new(
                format!("r{i}"),
                prompt,
                params,
                step as f64 + i as f64 * 1e-3,
                spec.priority,
            );
            if let Some((len, k)) = spec.prediction.filter(|_| cfg.spec.0 > 0) {
                let wrong = |pos: usize, t: u32| match pos % k == k - 1 {
                    true => (t + 1) % VOCAB as u32,
                    false => t,
                };
                req =
                    req.with_prediction((0..len).map(|pos| wrong(pos, token_at(i, pos))).collect());
            }
            match s.add_request(req) {
                Ok(h) => {
                    prop_assert!(fits_len && fits_kv, "accepted an impossible request {i}");
                    handle_spec.insert(h, i);
                    admitted_at.insert(i, step);
                    accepted[i] = true;
                }
                Err(SchedulerError::ExceedsMaxModelLen { .. }) => prop_assert!(!fits_len),
                Err(SchedulerError::ExceedsKvCache { .. }) => prop_assert!(fits_len && !fits_kv),
                Err(e) => return Err(TestCaseError::fail(format!("unexpected rejection: {e}"))),
            }
        }
        for (i, spec) in specs.iter().enumerate() {
            if accepted[i]
                && finish_of[i].is_none()
                && spec.abort_after.map(|a| admitted_at[&i] + a) == Some(step)
            {
                let id = format!("r{i}");
                prop_assert!(s.abort_request(&id));
                finish_of[i] = Some(FinishReason::Abort);
            }
        }
        let all_arrived = specs.iter().all(|sp| sp.arrive_step < step);
        if all_arrived && !s.has_unfinished_requests() && in_flight.is_empty() {
            break;
        }
        prop_assert!(
            step < MAX_STEPS,
            "requests never finished: {:?}",
            s.make_stats()
        );

        let out = s.schedule();
        let submitted = !(out.is_empty() && out.finished_req_ids.is_empty());
        if submitted {
            let sampled = execute(
                &cfg,
                &mut s,
                &out,
                &mut mirror,
                &handle_spec,
                &specs,
                budget,
            )?;
            in_flight.push_back((out, sampled));
        }
        if !(submitted && in_flight.len() < depth) {
            if let Some((out, sampled)) = in_flight.pop_front() {
                let outputs = s.update_from_output(&out, &sampled);
                for o in &outputs {
                    let i = handle_spec[&o.handle];
                    tokens_of[i].extend_from_slice(&o.new_token_ids);
                    predicted[i] = o.prediction_tokens;
                    if let Some(reason) = o.finish_reason {
                        finish_of[i] = Some(reason);
                    } else {
                        prop_assert_eq!(
                            s.request(o.handle).unwrap().output_token_ids(),
                            &tokens_of[i][..]
                        );
                    }
                }
            }
        }
        s.check_invariants().map_err(TestCaseError::fail)?;
        step += 1;
    }

    for (i, spec) in specs.iter().enumerate().filter(|(i, _)| accepted[*i]) {
        let reason = finish_of[i];
        prop_assert!(reason.is_some(), "request {} never finished", i);
        let expected: Vec<u32> = (0..tokens_of[i].len())
            .map(|pos| token_at(i, pos))
            .collect();
        prop_assert_eq!(
            &tokens_of[i],
            &expected,
            "request {} lost, repeated or reordered tokens",
            i
        );
        if reason != Some(FinishReason::Abort) {
            let expected = expected_finish(spec, &tokens_of[i]);
            prop_assert_eq!(expected, Some((tokens_of[i].len(), reason.unwrap())));
        }
    }
    prop_assert_eq!(
        s.kv_cache_manager().num_free_blocks(),
        cfg.num_blocks,
        "blocks leaked"
    );
    let spec = s.make_stats().spec_decoding;
    prop_assert!(spec.num_accepted_tokens <= spec.num_draft_tokens);
    if cfg.spec.0 == 0 {
        prop_assert_eq!(spec.num_draft_tokens, 0);
    }
    // A draft is kept only after every draft before it: the counts per
    // position fall, and together they are the kept total.
    let per_pos = &spec.num_accepted_tokens_per_pos;
    prop_assert_eq!(per_pos.len(), cfg.spec.0 as usize);
    prop_assert!(per_pos.windows(2).all(|w| w[0] >= w[1]));
    prop_assert!(per_pos.first().is_none_or(|&n| n <= spec.num_drafts));
    prop_assert_eq!(per_pos.iter().sum::<u64>(), spec.num_accepted_tokens);
    // Predicted drafts are drafts: their tallies fit in the totals, and
    // only requests that sent a prediction have one.
    let (mut kept, mut verified) = (0, 0);
    for (i, tally) in predicted.iter().enumerate() {
        let sent = cfg.spec.0 > 0 && specs[i].prediction.is_some_and(|(len, _)| len > 0);
        prop_assert!(
            tally.is_none() || sent,
            "request {} has a tally without a prediction",
            i
        );
        if let Some(t) = tally {
            kept += u64::from(t.accepted);
            verified += u64::from(t.accepted + t.rejected);
        }
    }
    prop_assert!(kept <= spec.num_accepted_tokens);
    prop_assert!(verified <= spec.num_draft_tokens);
    let stats = s.make_stats().prefix_cache;
    prop_assert!(stats.hits <= stats.queries);
    if !cfg.caching {
        prop_assert_eq!(stats.queries, 0);
    }
    Ok(())
}

/// Checks one scheduled step and runs it on the mirror worker: applies the
/// deltas, advances the computed tokens and samples a token for each
/// request that reached the end of the tokens the worker knows, keeping
/// the drafts that equal their position's token and one token after them.
fn execute(
    cfg: &Cfg,
    s: &mut Scheduler,
    out: &SchedulerOutput,
    mirror: &mut HashMap<ReqHandle, Mirror>,
    handle_spec: &HashMap<ReqHandle, usize>,
    specs: &[Spec],
    budget: u32,
) -> Result<Vec<(ReqHandle, Vec<u32>)>, TestCaseError> {
    let bs = cfg.block_size as usize;
    // Budget, batch size and shape.
    let total: u32 = out.num_scheduled_tokens.iter().map(|(_, n)| n).sum();
    prop_assert_eq!(total, out.total_num_scheduled_tokens);
    prop_assert!(total <= budget);
    prop_assert!(s.num_running() <= cfg.max_num_seqs as usize);
    prop_assert!(out.num_scheduled_tokens.iter().all(|(_, n)| *n >= 1));
    prop_assert_eq!(
        out.num_scheduled_tokens.len(),
        out.scheduled_new_reqs.len() + out.scheduled_cached_reqs.len()
    );
    for f in &out.finished_req_ids {
        prop_assert!(
            out.scheduled_new_reqs.iter().all(|n| n.handle != *f),
            "handle reused in its finish output"
        );
    }
    // Apply the delta as the worker would.
    for f in &out.finished_req_ids {
        mirror.remove(f);
    }
    for n in &out.scheduled_new_reqs {
        prop_assert!(!mirror.contains_key(&n.handle));
        let m = Mirror {
            blocks: n.block_ids.clone(),
            computed: n.num_computed_tokens as usize,
            known: n.prompt_token_ids.len(),
            prompt_len: n.prompt_token_ids.len(),
        };
        mirror.insert(n.handle, m);
    }
    let c = &out.scheduled_cached_reqs;
    for i in 0..c.len() {
        let m = mirror
            .get_mut(&c.handles[i])
            .expect("cached request unknown to the worker");
        if c.resumed_from_preemption[i] {
            m.blocks = c.new_block_ids(i).to_vec();
        } else {
            prop_assert_eq!(
                m.computed,
                c.num_computed_tokens[i] as usize,
                "tokens skipped or repeated"
            );
            m.blocks.extend_from_slice(c.new_block_ids(i));
        }
        m.computed = c.num_computed_tokens[i] as usize;
    }
    let mut sampled = Vec::new();
    let spec = &out.scheduled_spec_decode_tokens;
    for &(h, n) in &out.num_scheduled_tokens {
        let drafts = match spec.handles.iter().position(|&d| d == h) {
            Some(k) => spec.drafts(k),
            None => &[],
        };
        prop_assert!(drafts.len() <= cfg.spec.0 as usize);
        let m = mirror.get_mut(&h).unwrap();
        m.computed += n as usize;
        let r = s.request(h).unwrap();
        prop_assert_eq!(&m.blocks[..], r.block_ids(), "worker block table diverged");
        prop_assert_eq!(m.computed, r.num_computed_tokens());
        prop_assert!(
            m.blocks.len() * bs >= m.computed,
            "block table does not cover computed tokens"
        );
        prop_assert!(
            m.computed <= m.known + drafts.len(),
            "scheduled a token the worker has not sampled"
        );
        prop_assert!(
            drafts.is_empty() || m.computed == m.known + drafts.len(),
            "drafts that do not follow the last known token"
        );
        let i = handle_spec[&h];
        prop_assert!(
            m.computed < m.prompt_len + specs[i].max_tokens as usize,
            "computed past the request's last possible token"
        );
        if m.computed == m.known + drafts.len() {
            let mut tokens = Vec::new();
            for j in 0..=drafts.len() {
                let t = token_at(i, m.known + j - m.prompt_len);
                tokens.push(t);
                if drafts.get(j) != Some(&t) {
                    break;
                }
            }
            m.computed -= drafts.len() + 1 - tokens.len();
            m.known += tokens.len();
            sampled.push((h, tokens));
        }
    }
    Ok(sampled)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(192))]

    #[test]
    fn random_streams_keep_every_invariant(
        cfg in cfg_strategy(),
        specs in proptest::collection::vec(spec_strategy(), 1..24),
        seed in any::<u64>(),
    ) {
        run(cfg, specs, seed, 1)?;
    }

    #[test]
    fn async_scheduling_keeps_every_invariant(
        cfg in cfg_strategy(),
        specs in proptest::collection::vec(spec_strategy(), 1..24),
        seed in any::<u64>(),
    ) {
        run(cfg, specs, seed, 2)?;
    }
}
