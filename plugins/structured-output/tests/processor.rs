//! The processor driven step by step over a hand-made vocabulary, checked
//! against masks computed by string operations.

mod support;

use std::collections::BTreeSet;

use structured_output::compiler::CACHE_ENTRIES;
use structured_output::processor::{Processor, Step};
use support::{allowed, Hand, Request, EOS, IM_START};

fn so(inner: &str) -> String {
    format!("{{\"structured_outputs\": {inner}}}")
}

fn set(ids: &[u32]) -> BTreeSet<u32> {
    ids.iter().copied().collect()
}

#[test]
fn requests_without_a_constraint_are_not_claimed() {
    let mut h = Hand::new();
    assert_eq!(h.p.check_request("null"), Ok(false));
    assert_eq!(h.p.check_request("{}"), Ok(false));
    assert_eq!(
        h.p.check_request(r#"{"structured_outputs": null}"#),
        Ok(false)
    );
    assert_eq!(h.p.check_request(&so(r#"{"regex": "a+"}"#)), Ok(true));
}

#[test]
fn compile_errors_name_the_field_and_the_cause() {
    let mut h = Hand::new();
    let e = h.p.check_request(&so(r#"{"regex": "a("}"#)).unwrap_err();
    assert!(
        e.starts_with("structured_outputs.regex does not compile: "),
        "{e}"
    );
    let e =
        h.p.check_request(&so(
            r#"{"json": {"type": "object", "minProperties": 3, "maxProperties": 1}}"#,
        ))
        .unwrap_err();
    assert!(
        e.starts_with("structured_outputs.json does not compile: "),
        "{e}"
    );
    let e =
        h.p.check_request(&so(r#"{"json": {"type": "frog"}}"#))
            .unwrap_err();
    assert!(
        e.starts_with("structured_outputs.json does not compile: "),
        "{e}"
    );
    assert!(e.contains("frog"), "{e}");
    let e =
        h.p.check_request(&so(r#"{"grammar": "start: foo"}"#))
            .unwrap_err();
    assert!(
        e.starts_with("structured_outputs.grammar does not compile: "),
        "{e}"
    );
    assert!(e.contains("foo"), "{e}");
    let e =
        h.p.check_request(&so(r#"{"grammar": "root ::= \"yes\" | \"no\""}"#))
            .unwrap_err();
    assert!(e.contains("looks like GBNF"), "{e}");
    // Parse errors come through unchanged.
    let e =
        h.p.check_request(&so(r#"{"regex": "a", "choice": ["b"]}"#))
            .unwrap_err();
    assert_eq!(
        e,
        "structured_outputs gives regex and choice at once; give exactly one"
    );
}

#[test]
fn check_then_announce_compiles_once() {
    let mut h = Hand::new();
    let args = so(r#"{"choice": ["yes", "no"]}"#);
    assert_eq!(h.p.check_request(&args), Ok(true));
    assert_eq!(h.p.check_request(&args), Ok(true));
    let mut r = Request::new(3, &args);
    r.mask(&mut h.p, 128);
    assert_eq!(h.p.compiles(), 1);
    assert_eq!(h.p.tracked(), 1);
    // Errors are remembered too.
    let bad = so(r#"{"regex": "("}"#);
    assert!(h.p.check_request(&bad).is_err());
    assert!(h.p.check_request(&bad).is_err());
    assert_eq!(h.p.compiles(), 2);
    // The cache is bounded: after enough other grammars the first is
    // compiled again.
    for i in 0..CACHE_ENTRIES {
        let other = so(&format!(r#"{{"regex": "a{{{i}}}"}}"#));
        assert_eq!(h.p.check_request(&other), Ok(true));
    }
    assert_eq!(h.p.compiles(), 2 + CACHE_ENTRIES as u64);
    assert_eq!(h.p.check_request(&args), Ok(true));
    assert_eq!(h.p.compiles(), 3 + CACHE_ENTRIES as u64);
}

#[test]
fn choice_allows_prefixes_then_only_eos() {
    let mut h = Hand::new();
    let choices = ["yes", "no", "maybe"];
    let mut r = Request::new(1, &so(r#"{"choice": ["yes", "no", "maybe"]}"#));
    let n = h.tokens.len() as u32;
    assert_eq!(r.mask(&mut h.p, n), h.prefixes_of(&choices));
    r.outputs.push(h.id("ye"));
    assert_eq!(r.mask(&mut h.p, n), set(&[h.id("s")]));
    r.outputs.push(h.id("s"));
    assert_eq!(r.mask(&mut h.p, n), set(&[EOS]));
}

#[test]
fn choice_text_is_literal() {
    let mut h = Hand::new();
    // Quotes, backslashes and regex metacharacters are plain text.
    let args = serde_json::json!({"structured_outputs": {"choice": ["a\"b\\", "x.*", "\u{7f}"]}});
    let mut r = Request::new(1, &args.to_string());
    let n = h.tokens.len() as u32;
    assert_eq!(
        r.mask(&mut h.p, n),
        h.prefixes_of(&["a\"b\\", "x.*", "\u{7f}"])
    );
    for t in h.tokenize("x.*") {
        r.outputs.push(t);
        r.mask(&mut h.p, n);
    }
    assert_eq!(r.mask(&mut h.p, n), set(&[EOS]));
}

#[test]
fn eos_is_allowed_exactly_where_the_regex_accepts() {
    let mut h = Hand::new();
    let mut r = Request::new(1, &so(r#"{"regex": "a+b?"}"#));
    let (a, aa, b) = (h.id("a"), h.id("aa"), h.id("b"));
    assert_eq!(r.mask(&mut h.p, 160), set(&[a, aa]));
    r.outputs.push(aa);
    assert_eq!(r.mask(&mut h.p, 160), set(&[a, aa, b, EOS]));
    r.outputs.push(b);
    assert_eq!(r.mask(&mut h.p, 160), set(&[EOS]));
}

#[test]
fn json_schema_answer_is_followed_to_eos() {
    let mut h = Hand::new();
    let schema = r#"{"type": "object", "properties": {"name": {"type": "string"},
        "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0}},
        "required": ["name", "ok", "n"], "additionalProperties": false}"#;
    let args = serde_json::json!({"structured_outputs": {"json": schema}});
    let mut r = Request::new(9, &args.to_string());
    let n = h.tokens.len() as u32;
    let first = r.mask(&mut h.p, n);
    assert!(first.contains(&h.id("{")) && first.contains(&h.id("{\"")));
    for bad in ["[", "\"", "1", "n", " "] {
        assert!(
            !first.contains(&h.id(bad)),
            "{bad:?} must not start the object"
        );
    }
    assert!(!first.contains(&EOS) && !first.contains(&IM_START));
    let answer = r#"{"name": "Bob", "ok": true, "n": 12}"#;
    for t in h.tokenize(answer) {
        let mask = r.mask(&mut h.p, n);
        assert!(mask.contains(&t), "{:?} refused", h.tokens[t as usize]);
        assert!(!mask.contains(&EOS), "EOS before the object is complete");
        r.outputs.push(t);
    }
    assert_eq!(r.mask(&mut h.p, n), set(&[EOS]));
}

#[test]
fn a_token_the_constraint_rejects_fails_only_its_row() {
    let mut h = Hand::new();
    let mut good = Request::new(1, &so(r#"{"regex": "a+"}"#));
    let mut bad = Request::new(2, &so(r#"{"json_object": true}"#));
    good.mask(&mut h.p, 160);
    bad.mask(&mut h.p, 160);
    good.outputs.push(h.id("a"));
    bad.outputs.push(h.id("x"));
    let e =
        h.p.process(Step {
            ids: &[1, 2],
            num_output_tokens: &[1, 1],
            last_tokens: &[h.id("a"), h.id("x")],
            vocab_size: 160,
            ..Step::default()
        })
        .unwrap();
    assert_eq!(e.mask_rows, vec![0]);
    assert_eq!(allowed(&e.mask_words), set(&[h.id("a"), h.id("aa"), EOS]));
    assert_eq!(e.fail_rows, vec![1]);
    let msg = &e.fail_messages[0];
    let x = h.id("x");
    let head = format!("structured output failed: token {x} does not fit the constraint: ");
    assert!(msg.starts_with(&head), "{msg}");
    assert!(
        msg.contains("\"x\"") && !msg.contains("non-verbose"),
        "{msg}"
    );
    // It stays failed, with the same cause, until the host drops it.
    let again = bad.step(&mut h.p, 160).unwrap();
    assert_eq!(
        (again.fail_rows, again.fail_messages),
        (vec![0], vec![msg.clone()])
    );
}

#[test]
fn a_reannounced_request_replays_its_output() {
    let mut h = Hand::new();
    let args = so(r#"{"choice": ["maybe", "no"]}"#);
    let mut live = Request::new(1, &args);
    live.mask(&mut h.p, 160);
    for t in [h.id("may"), h.id("b")] {
        live.outputs.push(t);
        live.mask(&mut h.p, 160);
    }
    // A new instance learns the output at announcement; the step's row
    // already counts it, so nothing is consumed twice.
    let mut fresh = Hand::new();
    let mut again = Request::new(1, &args);
    again.outputs = live.outputs.clone();
    again.replay = live.outputs.clone();
    assert_eq!(again.mask(&mut fresh.p, 160), set(&[h.id("e")]));
    again.outputs.push(h.id("e"));
    assert_eq!(again.mask(&mut fresh.p, 160), set(&[EOS]));
}

#[test]
fn replaying_a_rejected_output_fails_the_row() {
    let mut h = Hand::new();
    let mut r = Request::new(1, &so(r#"{"choice": ["no"]}"#));
    r.outputs = vec![h.id("y")];
    r.replay = r.outputs.clone();
    let e = r.step(&mut h.p, 160).unwrap();
    assert_eq!(e.fail_rows, vec![0]);
    assert!(
        e.fail_messages[0].contains("replaying its 1 earlier tokens"),
        "{:?}",
        e.fail_messages
    );
}

#[test]
fn removed_requests_are_forgotten() {
    let mut h = Hand::new();
    let mut r = Request::new(4, &so(r#"{"regex": "a"}"#));
    r.mask(&mut h.p, 160);
    assert_eq!(h.p.tracked(), 1);
    let e =
        h.p.process(Step {
            removed_ids: &[4],
            vocab_size: 160,
            ..Step::default()
        })
        .unwrap();
    assert_eq!(e, Default::default());
    assert_eq!(h.p.tracked(), 0);
    let e = r.step(&mut h.p, 160).unwrap();
    assert_eq!(
        e.fail_messages,
        vec!["structured output failed: request 4 was never announced to engine:structured-output"]
    );
}

#[test]
fn impossible_rows_fail_clearly() {
    let mut h = Hand::new();
    // Two new tokens in one step.
    let mut r = Request::new(1, &so(r#"{"regex": "a+"}"#));
    r.mask(&mut h.p, 160);
    r.outputs = vec![h.id("a"), h.id("a")];
    let e = r.step(&mut h.p, 160).unwrap();
    assert!(
        e.fail_messages[0].contains("has 2 output tokens but 0 were seen"),
        "{e:?}"
    );
    // A token id past the vocabulary.
    let mut r = Request::new(2, &so(r#"{"regex": "a+"}"#));
    r.mask(&mut h.p, 160);
    r.outputs = vec![150];
    let e = r.step(&mut h.p, 160).unwrap();
    let n = h.tokens.len();
    assert!(e.fail_messages[0].contains(&format!("token 150 is outside the vocabulary of {n}")));
    // Only "a" fits, but the model's rows are narrower than its id.
    let mut r = Request::new(3, &so(r#"{"regex": "a+"}"#));
    let a = h.id("a");
    let e = r.step(&mut h.p, a).unwrap();
    assert!(e.mask_words.is_empty());
    assert!(e.fail_messages[0].contains("allows no token below the model's vocabulary size"));
}

#[test]
fn malformed_batches_and_missing_vocabulary_are_errors() {
    let mut h = Hand::new();
    let e =
        h.p.process(Step {
            ids: &[1],
            vocab_size: 160,
            ..Step::default()
        })
        .unwrap_err();
    assert_eq!(
        e,
        "malformed batch: num-output-tokens has 0 entries but ids has 1"
    );
    let e =
        h.p.process(Step {
            added_ids: &[1],
            added_extra_args: &["{}".to_string()],
            added_output_ends: &[3],
            vocab_size: 160,
            ..Step::default()
        })
        .unwrap_err();
    assert_eq!(
        e,
        "malformed batch: added-output-ends entry 3 is outside 0..=0"
    );
    let mut none = Processor::default();
    assert!(none
        .check_request("{}")
        .unwrap_err()
        .contains("set-vocabulary"));
}

#[test]
fn lark_grammar_masks_follow_its_terminals() {
    let mut h = Hand::new();
    let grammar = "start: \"call \" NAME\nNAME: /[a-z]+/\n";
    let mut r = Request::new(
        1,
        &so(&serde_json::json!({ "grammar": grammar }).to_string()),
    );
    for t in h.tokenize("call ") {
        r.mask(&mut h.p, 160);
        r.outputs.push(t);
    }
    let lower: BTreeSet<u32> = (2..h.tokens.len() as u32)
        .filter(|&i| h.tokens[i as usize].iter().all(u8::is_ascii_lowercase))
        .collect();
    assert_eq!(r.mask(&mut h.p, 160), lower);
    r.outputs.push(h.id("name"));
    let mut and_eos = lower.clone();
    and_eos.insert(EOS);
    assert_eq!(r.mask(&mut h.p, 160), and_eos);
}

#[test]
fn disable_any_whitespace_removes_whitespace_from_json() {
    let mut h = Hand::new();
    let ws = [h.id(" "), h.id("\n"), h.id("  ")];
    let mut flexible = Request::new(1, &so(r#"{"json_object": true}"#));
    let mut compact = Request::new(
        2,
        &so(r#"{"json_object": true, "disable_any_whitespace": true}"#),
    );
    for r in [&mut flexible, &mut compact] {
        r.mask(&mut h.p, 160);
        r.outputs.push(h.id("{"));
    }
    let after_brace = flexible.mask(&mut h.p, 160);
    assert!(ws.iter().all(|t| after_brace.contains(t)));
    let after_brace = compact.mask(&mut h.p, 160);
    assert!(ws.iter().all(|t| !after_brace.contains(t)));
    // An empty object's end, or a key's opening quote with any text after it.
    let want = ["}", "\"", "\":", "\",", "\"}"].map(|t| h.id(t));
    assert_eq!(after_brace, set(&want));
}

#[test]
fn regex_anchors_are_accepted() {
    let mut h = Hand::new();
    let mut r = Request::new(1, &so(r#"{"regex": "^[0-9]{3}$"}"#));
    let digits: BTreeSet<u32> = (2..h.tokens.len() as u32)
        .filter(|&i| h.tokens[i as usize].iter().all(u8::is_ascii_digit))
        .collect();
    assert_eq!(r.mask(&mut h.p, 160), digits);
    r.outputs.push(h.id("12"));
    r.mask(&mut h.p, 160);
    r.outputs.push(h.id("3"));
    assert_eq!(r.mask(&mut h.p, 160), set(&[EOS]));
}

#[test]
fn pydantic_style_refs_and_lark_embedded_json_schemas_work() {
    let mut h = Hand::new();
    // Nested models as pydantic writes them: `$defs` and `$ref`.
    let schema = serde_json::json!({
        "$defs": {"Pet": {"type": "object", "properties": {"name": {"type": "string"}},
            "required": ["name"], "additionalProperties": false}},
        "type": "object",
        "properties": {"pet": {"$ref": "#/$defs/Pet"}},
        "required": ["pet"], "additionalProperties": false
    });
    let args = serde_json::json!({"structured_outputs": {"json": schema}}).to_string();
    follow_to_eos(&mut h, &args, r#"{"pet": {"name": "Rex"}}"#);
    // A tool call as a grammar would constrain it: fixed markers around a
    // JSON schema (llguidance's `%json` in Lark).
    let grammar = r#"start: "<call>" args "</call>"
args: %json {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": false}
"#;
    let args = serde_json::json!({"structured_outputs": {"grammar": grammar}}).to_string();
    follow_to_eos(&mut h, &args, r#"<call>{"x": 12}</call>"#);
}

/// Feeds `answer` token by token, each allowed by the previous mask and
/// EOS never allowed early, and ends with a mask of EOS alone.
fn follow_to_eos(h: &mut Hand, args: &str, answer: &str) {
    let mut r = Request::new(1, args);
    for t in h.tokenize(answer) {
        let mask = r.mask(&mut h.p, 160);
        assert!(
            mask.contains(&t),
            "{:?} refused in {answer}",
            h.tokens[t as usize]
        );
        assert!(!mask.contains(&EOS));
        r.outputs.push(t);
    }
    assert_eq!(r.mask(&mut h.p, 160), set(&[EOS]));
    h.p.process(Step {
        removed_ids: &[1],
        ..Step::default()
    })
    .unwrap();
}

#[test]
fn unsupported_schema_features_are_refused_by_name() {
    let mut h = Hand::new();
    let mut check = |schema: &str| {
        let args = so(&format!(r#"{{"json": {schema}}}"#));
        h.p.check_request(&args).unwrap_err()
    };
    assert_eq!(
        check(r#"{"type": "array", "uniqueItems": true}"#),
        "structured_outputs.json does not compile: Unimplemented keys: [\"uniqueItems\"]"
    );
    assert_eq!(
        check(r#"{"type": "string", "format": "bogus"}"#),
        "structured_outputs.json does not compile: Unknown format: bogus"
    );
    assert!(check(r#"{"$ref": "http://example.com/x.json"}"#)
        .contains("ref 'http://example.com/x.json'"));
    assert_eq!(
        check("false"),
        "structured_outputs.json does not compile: Unsatisfiable schema: schema is false"
    );
}
