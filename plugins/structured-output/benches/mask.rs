//! Native mask time per token at the default model's vocabulary: a nested
//! JSON schema's answer is fed token by token and each step's mask is
//! timed, both through the plugin's own step (`Processor::process`, the
//! mask plus its packing into the WIT's words) and through llguidance's
//! `Matcher::compute_mask` alone. This is the "outside WASM" baseline for
//! the sandbox's overhead. Prints p50/p99 per step, then lets criterion
//! time one whole answer.
//!
//! The vocabulary is SmolLM2's, read from `.cache/models/` when present,
//! else a synthetic one of the same size (said so in the output).

#[path = "../tests/support/gguf.rs"]
mod gguf;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use llguidance::Matcher;
use structured_output::compiler::Compiler;
use structured_output::processor::{Processor, Step};
use structured_output::vocab::{build_tok_env, FlatVocab};

const VOCAB: u32 = 49152;

/// Runs of the whole answer for the percentiles.
const RUNS: usize = 20;

/// The nested schema and a valid answer to it, shared with the host's
/// in-sandbox bench (`host/benches/plugins.rs`, `plugin_structured`) so the
/// two figures time the same work.
const NESTED: &str = include_str!("nested.json");

fn nested() -> serde_json::Value {
    serde_json::from_str(NESTED).expect("benches/nested.json is JSON")
}

/// The request's `extra_args`; `run` makes it distinct, so the plugin's
/// cache misses and the grammar is compiled afresh, with cold lexer caches.
fn schema_args(run: usize) -> String {
    serde_json::json!({"structured_outputs": {"json": nested()["schema"]}, "run": run}).to_string()
}

/// SmolLM2's vocabulary, or a synthetic one of the same size.
fn vocabulary() -> (gguf::Vocab, &'static str) {
    if let Some(v) = gguf::default_model().and_then(|p| gguf::read_vocab(&p).ok()) {
        return (v, "SmolLM2-135M (real, from the GGUF)");
    }
    // Every byte, then words of lowercase letters, some with a leading
    // space, from a fixed linear congruential sequence.
    let mut v = gguf::Vocab {
        bytes: Vec::new(),
        ends: Vec::new(),
        special: vec![0],
        eos: 0,
    };
    let push = |v: &mut gguf::Vocab, t: &[u8]| {
        v.bytes.extend_from_slice(t);
        v.ends.push(v.bytes.len() as u32);
    };
    push(&mut v, b"<|endoftext|>");
    (0..=255u8).for_each(|b| push(&mut v, &[b]));
    let mut x = 12345u64;
    while v.ends.len() < VOCAB as usize {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let len = 2 + (x >> 60) as usize % 7;
        let mut t: Vec<u8> = (0..len)
            .map(|i| b'a' + ((x >> (i * 5)) % 26) as u8)
            .collect();
        if x & 1 == 1 {
            t[0] = b' ';
        }
        push(&mut v, &t);
    }
    (v, "synthetic (SmolLM2's GGUF not found)")
}

fn flat(v: &gguf::Vocab) -> FlatVocab<'_> {
    FlatVocab {
        token_bytes: &v.bytes,
        token_ends: &v.ends,
        special_ids: &v.special,
        eos: Some(v.eos),
    }
}

/// Greedy longest-match tokenization of the answer.
fn tokenize(v: &gguf::Vocab, text: &str) -> Vec<u32> {
    let mut by_bytes = HashMap::new();
    let mut start = 0usize;
    for (id, &end) in v.ends.iter().enumerate() {
        if !v.special.contains(&(id as u32)) {
            by_bytes
                .entry(v.bytes[start..end as usize].to_vec())
                .or_insert(id as u32);
        }
        start = end as usize;
    }
    let mut rest = text.as_bytes();
    let mut out = Vec::new();
    while !rest.is_empty() {
        let len = (1..=rest.len().min(32))
            .rev()
            .find(|&l| by_bytes.contains_key(&rest[..l]))
            .unwrap_or(1);
        out.push(by_bytes[&rest[..len]]);
        rest = &rest[len..];
    }
    out
}

/// One request through the plugin's step, timing each step.
fn plugin_run(p: &mut Processor, args: &str, answer: &[u32], id: u32, times: &mut Vec<Duration>) {
    let args = [args.to_owned()];
    for i in 0..=answer.len() {
        let added: &[u32] = if i == 0 { &[id] } else { &[] };
        let t0 = Instant::now();
        let e = p
            .process(Step {
                added_ids: added,
                added_extra_args: if i == 0 { &args } else { &[] },
                added_output_ends: if i == 0 { &[0] } else { &[] },
                ids: &[id],
                num_output_tokens: &[i as u32],
                last_tokens: &[if i == 0 { 0 } else { answer[i - 1] }],
                vocab_size: VOCAB,
                ..Step::default()
            })
            .expect("a well-formed step");
        times.push(t0.elapsed());
        assert!(e.fail_rows.is_empty(), "{:?}", e.fail_messages);
    }
    p.process(Step {
        removed_ids: &[id],
        vocab_size: VOCAB,
        ..Step::default()
    })
    .expect("removal");
}

/// The same masks from llguidance alone.
fn llguidance_run(c: &mut Compiler, args: &str, answer: &[u32], times: &mut Vec<Duration>) {
    let parser = c.compile(args).expect("compiles").expect("constrained");
    let mut m = Matcher::new(Ok(parser));
    for &t in answer {
        let t0 = Instant::now();
        let mask = m.compute_mask().expect("mask");
        times.push(t0.elapsed());
        assert!(mask.is_allowed(t));
        m.consume_token(t).expect("valid answer");
    }
}

fn percentiles(name: &str, mut times: Vec<Duration>) {
    times.sort();
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    println!(
        "{name}: {} steps, p50 {:.1} us, p99 {:.1} us, max {:.1} us",
        times.len(),
        at(0.5).as_secs_f64() * 1e6,
        at(0.99).as_secs_f64() * 1e6,
        at(1.0).as_secs_f64() * 1e6
    );
}

fn bench(c: &mut Criterion) {
    let (v, source) = vocabulary();
    let args = schema_args(0);
    let answer = tokenize(&v, nested()["answer"].as_str().expect("an answer string"));
    println!(
        "vocabulary: {source}, {} tokens; answer: {} tokens",
        v.ends.len(),
        answer.len()
    );

    let mut p = Processor::default();
    let t0 = Instant::now();
    p.set_vocabulary(flat(&v)).expect("vocabulary");
    println!("set-vocabulary: {:.1} ms", t0.elapsed().as_secs_f64() * 1e3);
    let t0 = Instant::now();
    assert_eq!(p.check_request(&args), Ok(true));
    println!(
        "check-request (compile): {:.1} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );

    // A grammar's first request meets cold lexer caches; later requests
    // with the same grammar share the warmed ones, as in a serving engine.
    let mut cold = Vec::new();
    for run in 1..=RUNS {
        plugin_run(&mut p, &schema_args(run), &answer, run as u32, &mut cold);
    }
    percentiles("plugin step (mask + packing), native, cold grammar", cold);
    let mut warm = Vec::new();
    for run in 1..=RUNS {
        plugin_run(&mut p, &args, &answer, 100 + run as u32, &mut warm);
    }
    percentiles("plugin step (mask + packing), native, warm grammar", warm);

    let mut compiler = Compiler::new(&build_tok_env(flat(&v)).expect("env")).expect("compiler");
    let (mut cold, mut warm) = (Vec::new(), Vec::new());
    for run in 1..=RUNS {
        llguidance_run(&mut compiler, &schema_args(run), &answer, &mut cold);
        llguidance_run(&mut compiler, &args, &answer, &mut warm);
    }
    percentiles("llguidance compute_mask, native, cold grammar", cold);
    percentiles("llguidance compute_mask, native, warm grammar", warm);

    let mut id = 1000;
    c.bench_function("whole answer through Processor::process", |b| {
        b.iter(|| {
            id += 1;
            plugin_run(&mut p, &args, &answer, id, &mut Vec::new());
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10);
    targets = bench
}
criterion_main!(benches);
