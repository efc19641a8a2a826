//! Reading `structured_outputs` from `extra_args`: which kind, which knobs,
//! and the messages for everything malformed.

use serde_json::json;
use structured_output::constraint::{parse, Constraint};

fn so(inner: serde_json::Value) -> String {
    json!({ "structured_outputs": inner }).to_string()
}

fn err(args: &str) -> String {
    parse(args).expect_err("must be refused")
}

#[test]
fn no_constraint_is_none() {
    assert_eq!(parse("null"), Ok(None));
    assert_eq!(parse(r#"{"temperature_hint": 3}"#), Ok(None));
    assert_eq!(parse(r#"{"structured_outputs": null}"#), Ok(None));
}

#[test]
fn each_kind_is_read() {
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    assert_eq!(
        parse(&so(json!({"json": schema}))),
        Ok(Some(Constraint::Json(schema.clone())))
    );
    // A schema in a string, as vLLM's Python clients often send it.
    let text = schema.to_string();
    assert_eq!(
        parse(&so(json!({"json": text}))),
        Ok(Some(Constraint::Json(schema)))
    );
    assert_eq!(
        parse(&so(json!({"json_object": true}))),
        Ok(Some(Constraint::Json(json!({"type": "object"}))))
    );
    assert_eq!(
        parse(&so(json!({"regex": "[a-z]+"}))),
        Ok(Some(Constraint::Regex("[a-z]+".into())))
    );
    assert_eq!(
        parse(&so(json!({"choice": ["a", "b"]}))),
        Ok(Some(Constraint::Choice(vec!["a".into(), "b".into()])))
    );
    assert_eq!(
        parse(&so(json!({"grammar": "start: \"x\""}))),
        Ok(Some(Constraint::Grammar("start: \"x\"".into())))
    );
}

#[test]
fn defaults_serialized_by_clients_count_as_absent() {
    let args = so(
        json!({"json": null, "regex": "a", "choice": null, "grammar": null,
        "json_object": false, "disable_fallback": false, "whitespace_pattern": null}),
    );
    assert_eq!(parse(&args), Ok(Some(Constraint::Regex("a".into()))));
}

#[test]
fn malformed_constraints_are_named() {
    assert!(err("{").starts_with("extra_args is not valid JSON: "));
    assert_eq!(
        err(&so(json!("json"))),
        "structured_outputs must be an object with one of json, json_object, regex, choice, \
         grammar, not a string"
    );
    assert_eq!(
        err(&so(json!({}))),
        "structured_outputs names no constraint; give exactly one of json, json_object, regex, \
         choice, grammar"
    );
    assert_eq!(
        err(&so(json!({"json_object": true, "grammar": "start: \"a\""}))),
        "structured_outputs gives json_object and grammar at once; give exactly one"
    );
    assert_eq!(
        err(&so(json!({"regex": "a", "structural_tag": "x"}))),
        "structured_outputs.structural_tag is not supported; known keys: json, json_object, \
         regex, choice, grammar, whitespace_pattern, disable_any_whitespace, \
         disable_additional_properties, disable_fallback"
    );
    assert_eq!(
        err(&so(json!({"json": 3}))),
        "structured_outputs.json must be a JSON schema (an object or a boolean, or a string \
         holding one), not a number"
    );
    assert!(err(&so(json!({"json": "{nope"})))
        .starts_with("structured_outputs.json is a string but not valid JSON: "));
    assert_eq!(
        err(&so(json!({"json_object": "yes"}))),
        "structured_outputs.json_object must be true, not a string"
    );
    assert_eq!(
        err(&so(json!({"regex": ""}))),
        "structured_outputs.regex is empty"
    );
    assert_eq!(
        err(&so(json!({"grammar": ["start"]}))),
        "structured_outputs.grammar must be a string, not a list"
    );
    assert_eq!(
        err(&so(json!({"choice": []}))),
        "structured_outputs.choice is empty; give at least one string"
    );
    assert_eq!(
        err(&so(json!({"choice": ["a", 2]}))),
        "structured_outputs.choice[1] must be a string, not a number"
    );
    assert_eq!(
        err(&so(json!({"choice": ["a", ""]}))),
        "structured_outputs.choice[1] is empty; every choice must have text"
    );
    assert_eq!(
        err(&so(json!({"regex": "a", "disable_fallback": "no"}))),
        "structured_outputs.disable_fallback must be a boolean, not a string"
    );
}

#[test]
fn whitespace_knobs_become_llguidance_options() {
    let c = parse(&so(
        json!({"json_object": true, "disable_any_whitespace": true}),
    ));
    assert_eq!(
        c,
        Ok(Some(Constraint::Json(
            json!({"type": "object", "x-guidance": {"whitespace_flexible": false}})
        )))
    );
    let c = parse(&so(json!({"json": true, "whitespace_pattern": " ?"})));
    assert_eq!(
        c,
        Ok(Some(Constraint::Json(
            json!({"x-guidance": {"whitespace_pattern": " ?"}})
        )))
    );
    // Meaningless for a constraint that fixes every byte: accepted, no effect.
    let c = parse(&so(json!({"regex": "a", "disable_any_whitespace": true})));
    assert_eq!(c, Ok(Some(Constraint::Regex("a".into()))));
    assert_eq!(
        err(&so(json!({"regex": "a", "whitespace_pattern": " "}))),
        "structured_outputs.whitespace_pattern applies only to json and json_object, not to regex"
    );
    assert_eq!(
        err(&so(
            json!({"json": {}, "whitespace_pattern": " ", "disable_any_whitespace": true})
        )),
        "structured_outputs.whitespace_pattern and disable_any_whitespace contradict each other; \
         give one"
    );
    assert_eq!(
        err(&so(
            json!({"json": {"x-guidance": 1}, "disable_any_whitespace": true})
        )),
        "structured_outputs.json's \"x-guidance\" must be an object of llguidance options"
    );
}

#[test]
fn disable_additional_properties_closes_open_objects() {
    let schema = json!({
        "type": "object",
        "properties": {
            "inner": {"type": "object", "properties": {"x": {"type": "string"}}},
            "open": {"type": "object", "additionalProperties": true},
            "tags": {"type": "array", "items": {"properties": {"t": {}}}},
            "fixed": {"const": {"type": "object"}}
        }
    });
    let c = parse(&so(
        json!({"json": schema, "disable_additional_properties": true}),
    ));
    let want = json!({
        "type": "object",
        "additionalProperties": false,
        "properties": {
            "inner": {"type": "object", "additionalProperties": false,
                "properties": {"x": {"type": "string"}}},
            "open": {"type": "object", "additionalProperties": true},
            "tags": {"type": "array",
                "items": {"properties": {"t": {}}, "additionalProperties": false}},
            "fixed": {"const": {"type": "object"}}
        }
    });
    assert_eq!(c, Ok(Some(Constraint::Json(want))));
    assert_eq!(
        err(&so(
            json!({"choice": ["a"], "disable_additional_properties": true})
        )),
        "structured_outputs.disable_additional_properties applies only to json and json_object, \
         not to choice"
    );
}
