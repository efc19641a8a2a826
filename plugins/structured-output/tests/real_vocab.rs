//! The default model's real vocabulary (SmolLM2, 49152 tokens), read from
//! its GGUF when it has been downloaded; skipped otherwise.

mod support;

use std::collections::HashMap;

use structured_output::processor::Processor;
use structured_output::vocab::FlatVocab;
use support::gguf::{default_model, read_vocab, Vocab};
use support::Request;

/// Greedy longest-match tokenization (any tokenization of valid text must
/// be accepted; the model's own BPE merges are not needed for that).
fn tokenize(v: &Vocab, text: &str) -> Vec<u32> {
    let mut by_bytes = HashMap::new();
    let mut start = 0usize;
    for (id, &end) in v.ends.iter().enumerate() {
        if !v.special.contains(&(id as u32)) {
            by_bytes
                .entry(&v.bytes[start..end as usize])
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
            .expect("every byte is a token");
        out.push(by_bytes[&rest[..len]]);
        rest = &rest[len..];
    }
    out
}

#[test]
fn smollm2_vocabulary_drives_a_json_schema_to_eos() {
    let Some(path) = default_model() else {
        eprintln!("skipped: the default model's GGUF is not in .cache/models");
        return;
    };
    let v = read_vocab(&path).expect("the GGUF's vocabulary");
    assert_eq!(v.ends.len(), 49152);
    let mut p = Processor::default();
    p.set_vocabulary(FlatVocab {
        token_bytes: &v.bytes,
        token_ends: &v.ends,
        special_ids: &v.special,
        eos: Some(v.eos),
    })
    .unwrap();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "population": {"type": "integer", "minimum": 0},
            "tags": {"type": "array", "items": {"enum": ["coast", "capital"]}}
        },
        "required": ["city", "population", "tags"],
        "additionalProperties": false
    });
    let args = serde_json::json!({"structured_outputs": {"json": schema}}).to_string();
    assert_eq!(p.check_request(&args), Ok(true));
    let mut r = Request::new(1, &args);
    let answer =
        r#"{"city": "Lisbon <|im_end|>", "population": 545000, "tags": ["coast", "capital"]}"#;
    for t in tokenize(&v, answer) {
        let mask = r.mask(&mut p, 49152);
        assert!(mask.contains(&t), "token {t} refused");
        assert!(!mask.contains(&v.eos), "EOS before the object is complete");
        // No control token may appear in the middle of the answer, even
        // where its text would fit (inside a string).
        assert!(v.special.iter().all(|s| !mask.contains(s)));
        r.outputs.push(t);
    }
    let end = r.mask(&mut p, 49152);
    assert_eq!(end.into_iter().collect::<Vec<_>>(), vec![v.eos]);
}
