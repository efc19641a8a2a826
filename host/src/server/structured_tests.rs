//! The shapes `structured.rs` accepts and refuses, where the constraint
//! lands in `extra_args`, and the plugins' check as the handlers run it.

use std::sync::Mutex;

use super::*;
use crate::server::params;

fn fields(format: Value, outputs: Value) -> Result<Option<Constraint>, ApiError> {
    from_fields(Some(&format), Some(&outputs))
}

/// The constraint's object, or the error's `param`.
fn outcome(format: Value, outputs: Value) -> Result<Option<Value>, String> {
    fields(format, outputs)
        .map(|c| c.map(|c| c.value))
        .map_err(|e| e.param.unwrap_or_default())
}

#[test]
fn response_format_maps_to_the_plugin_keys() {
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let cases = [
        (json!({"type": "text"}), None),
        (
            json!({"type": "json_object"}),
            Some(json!({"json_object": true})),
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": true}}),
            Some(json!({"json": schema})),
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "a", "schema": schema,
                "strict": null, "description": "what"}}),
            Some(json!({"json": schema})),
        ),
    ];
    for (format, want) in cases {
        assert_eq!(outcome(format.clone(), Value::Null), Ok(want), "{format}");
    }
    let c = fields(json!({"type": "json_object"}), Value::Null)
        .unwrap()
        .unwrap();
    assert_eq!(c.field, "response_format");
}

#[test]
fn bad_response_formats_name_the_field() {
    let cases = [
        (json!("json"), "response_format"),
        (json!({}), "response_format.type"),
        (json!({"type": "xml"}), "response_format.type"),
        (
            json!({"type": "json_schema"}),
            "response_format.json_schema",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"schema": {}}}),
            "response_format.json_schema.name",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "a"}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "a", "schema": "{}"}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}}),
            "response_format.json_schema.strict",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "description": 1}}),
            "response_format.json_schema.description",
        ),
    ];
    for (format, param) in cases {
        assert_eq!(
            outcome(format.clone(), Value::Null),
            Err(param.to_string()),
            "{format}"
        );
    }
    let e = fields(json!({"type": "structural_tag", "format": {}}), Value::Null).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("response_format.type"));
    assert!(
        e.message.contains("`structural_tag` is not supported"),
        "{e:?}"
    );
}

#[test]
fn structured_outputs_set_exactly_one_kind() {
    let schema = json!({"type": "object"});
    for (outputs, want) in [
        (json!({"json": schema}), json!({"json": schema})),
        // vLLM takes the schema as JSON text too; the plugin always gets an object.
        (
            json!({"json": "{\"type\": \"object\"}"}),
            json!({"json": schema}),
        ),
        (json!({"regex": "[a-z]+"}), json!({"regex": "[a-z]+"})),
        (
            json!({"choice": ["yes", "no"]}),
            json!({"choice": ["yes", "no"]}),
        ),
        (
            json!({"grammar": "start: \"a\""}),
            json!({"grammar": "start: \"a\""}),
        ),
        (
            json!({"json_object": true, "regex": null}),
            json!({"json_object": true}),
        ),
        // A boolean schema: `true` takes any JSON.
        (json!({"json": true}), json!({"json": true})),
        (
            json!({"json": schema, "disable_any_whitespace": true, "whitespace_pattern": " ?",
                "disable_additional_properties": false, "disable_fallback": true}),
            json!({"json": schema, "disable_any_whitespace": true, "whitespace_pattern": " ?",
                "disable_additional_properties": false, "disable_fallback": true}),
        ),
    ] {
        assert_eq!(
            outcome(Value::Null, outputs.clone()),
            Ok(Some(want)),
            "{outputs}"
        );
    }
    let c = fields(Value::Null, json!({"regex": "a"})).unwrap().unwrap();
    assert_eq!(c.field, "structured_outputs");
    // Plain text alongside is no conflict.
    assert!(outcome(json!({"type": "text"}), json!({"regex": "a"})).is_ok());
}

#[test]
fn bad_structured_outputs_name_the_key() {
    let cases = [
        (json!([]), "structured_outputs"),
        (json!({}), "structured_outputs"),
        (json!({"json_object": false}), "structured_outputs"),
        (json!({"regex": "a", "choice": ["a"]}), "structured_outputs"),
        (json!({"regex": ""}), "structured_outputs.regex"),
        (json!({"grammar": 5}), "structured_outputs.grammar"),
        (json!({"choice": []}), "structured_outputs.choice"),
        (json!({"choice": ["a", 1]}), "structured_outputs.choice"),
        (json!({"json": "{oops"}), "structured_outputs.json"),
        (json!({"json": [1]}), "structured_outputs.json"),
        (json!({"json": "3"}), "structured_outputs.json"),
        (
            json!({"json_object": "yes"}),
            "structured_outputs.json_object",
        ),
        (
            json!({"regex": "a", "disable_fallback": 1}),
            "structured_outputs.disable_fallback",
        ),
        (
            json!({"regex": "a", "whitespace_pattern": true}),
            "structured_outputs.whitespace_pattern",
        ),
        (
            json!({"regex": "a", "backend": "xgrammar"}),
            "structured_outputs.backend",
        ),
        (
            json!({"structural_tag": "{}"}),
            "structured_outputs.structural_tag",
        ),
    ];
    for (outputs, param) in cases {
        assert_eq!(
            outcome(Value::Null, outputs.clone()),
            Err(param.to_string()),
            "{outputs}"
        );
    }
    let e = fields(Value::Null, json!({"regex": "a", "choice": ["a"]})).unwrap_err();
    assert!(
        e.message
            .contains("sets regex and choice; set exactly one of"),
        "{e:?}"
    );
    let e = fields(Value::Null, json!({"regex": "a", "frob": 1})).unwrap_err();
    assert!(
        e.message.contains("not a structured_outputs key")
            && e.message.contains("whitespace_pattern")
    );
    // Both fields asking for a format is refused, naming both.
    let e = fields(json!({"type": "json_object"}), json!({"regex": "a"})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("structured_outputs"));
    assert!(e.message.contains("`response_format`"), "{e:?}");
}

#[test]
fn text_format_has_the_schema_beside_its_type() {
    let schema = json!({"type": "object"});
    let format = json!({"type": "json_schema", "name": "a", "schema": schema, "strict": true});
    let c = from_text_format(Some(&format)).unwrap().unwrap();
    assert_eq!((c.field, c.value), ("text.format", json!({"json": schema})));
    assert_eq!(
        from_text_format(Some(&json!({"type": "text"}))).unwrap(),
        None
    );
    let e = from_text_format(Some(&json!({"type": "json_schema", "schema": schema}))).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("text.format.name"));
}

/// `body`'s sampling fields, its merged `extra_args` after [`attach`] of
/// its `response_format` / `structured_outputs`, and the field [`attach`]
/// names.
fn attached(body: Value) -> Result<(Option<Value>, String), ApiError> {
    let sampling: SamplingRequest = params::typed(&body)?;
    let mut p = params::sampling_params(&sampling, None, 16, &params::NO_WORDS)?;
    let constraint = from_fields(body.get("response_format"), body.get("structured_outputs"))?;
    let field = attach(&mut p.extra_args, constraint, &sampling)?;
    Ok((p.extra_args, field))
}

#[test]
fn the_constraint_lands_in_extra_args() {
    let (args, field) = attached(json!({"structured_outputs": {"regex": "a+"}})).unwrap();
    assert_eq!(args, Some(json!({"structured_outputs": {"regex": "a+"}})));
    assert_eq!(field, "structured_outputs");
    let body = json!({"response_format": {"type": "json_object"}, "extra_args": {"k": 1},
        "vllm_xargs": {"j": 2}});
    let (args, field) = attached(body).unwrap();
    assert_eq!(
        args,
        Some(json!({"k": 1, "j": 2, "structured_outputs": {"json_object": true}}))
    );
    assert_eq!(field, "response_format");
    // The client's own key is checked and normalized the same way.
    let (args, field) =
        attached(json!({"vllm_xargs": {"structured_outputs": {"json": "{}"}}})).unwrap();
    assert_eq!(args, Some(json!({"structured_outputs": {"json": {}}})));
    assert_eq!(field, "vllm_xargs");
    let e = attached(json!({"extra_args": {"structured_outputs": {"regex": 1}}})).unwrap_err();
    assert_eq!(
        e.param.as_deref(),
        Some("extra_args.structured_outputs.regex")
    );
    // `null` asks for nothing, and does not reach the plugin.
    let (args, field) =
        attached(json!({"extra_args": {"structured_outputs": null, "k": 1}})).unwrap();
    assert_eq!(
        (args, field.as_str()),
        (Some(json!({"k": 1})), "extra_args")
    );
    assert_eq!(
        attached(json!({})).unwrap(),
        (None, "extra_args".to_string())
    );
}

#[test]
fn a_constraint_set_twice_names_both_places() {
    for (own, place) in [("extra_args", "extra_args"), ("vllm_xargs", "vllm_xargs")] {
        let body = json!({"response_format": {"type": "json_object"},
            own: {"structured_outputs": {"regex": "a"}}});
        let e = attached(body).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("response_format"));
        assert!(
            e.message.contains(&format!("`{place}.structured_outputs`")),
            "{e:?}"
        );
    }
    let e = attached(json!({"structured_outputs": {"regex": "a"}, "extra_args": [1]})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("extra_args"));
    assert!(e.message.contains("must be an object"), "{e:?}");
}

/// A check that records what it was given and refuses a `regex` of `(`.
#[derive(Default)]
struct FakeCheck(Mutex<Vec<Value>>);

impl RequestCheck for FakeCheck {
    fn check(&self, extra_args: Option<&Value>) -> Result<(), String> {
        let args = extra_args.cloned().unwrap_or_default();
        self.0.lock().unwrap().push(args.clone());
        match args.pointer("/structured_outputs/regex") {
            Some(r) if r == "(" => {
                Err("engine:structured-output: the regex `(` does not compile".into())
            }
            _ => Ok(()),
        }
    }
}

#[tokio::test]
async fn the_check_sees_the_final_extra_args_and_its_refusal_is_a_400() {
    let fake = Arc::new(FakeCheck::default());
    let check: Option<Arc<dyn RequestCheck>> = Some(fake.clone());
    let (args, field) =
        attached(json!({"structured_outputs": {"regex": "("}, "vllm_xargs": {"k": 1}})).unwrap();
    let e = run_check(check.clone(), args.as_ref(), &field)
        .await
        .unwrap_err();
    assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
    assert_eq!(e.param.as_deref(), Some("structured_outputs"));
    assert_eq!(
        e.message,
        "engine:structured-output: the regex `(` does not compile"
    );
    let ok = json!({"structured_outputs": {"regex": "a"}});
    run_check(check.clone(), Some(&ok), "structured_outputs")
        .await
        .unwrap();
    // A request without extra_args is not checked, nor anything without a checker.
    run_check(check, None, "extra_args").await.unwrap();
    run_check(
        None,
        Some(&json!({"structured_outputs": {"regex": "("}})),
        "x",
    )
    .await
    .unwrap();
    let seen = fake.0.lock().unwrap().clone();
    assert_eq!(
        seen,
        vec![json!({"k": 1, "structured_outputs": {"regex": "("}}), ok]
    );
}

#[test]
fn extra_args_the_plugins_cannot_parse_are_refused_naming_the_constraint() {
    // The bound is serde_json's own: the final extra_args as JSON text
    // parses at the deepest nesting let through, and not one level deeper.
    let fits = json!({"structured_outputs": {"json": limits::nested_schema(limits::MAX_EXTRA_ARGS_NESTING - 2)}});
    let text = serde_json::to_string(&fits).unwrap();
    assert!(serde_json::from_str::<Value>(&text).is_ok());
    let deeper = json!({"structured_outputs": {"json": limits::nested_schema(limits::MAX_EXTRA_ARGS_NESTING - 1)}});
    let text = serde_json::to_string(&deeper).unwrap();
    let e = serde_json::from_str::<Value>(&text).unwrap_err();
    assert!(e.to_string().contains("recursion limit"), "{e}");

    // Through the API: a schema given as JSON text parses under the body's
    // limit but lands two levels deeper in extra_args.
    let at = |levels: usize| {
        let schema = serde_json::to_string(&limits::nested_schema(levels)).unwrap();
        attached(json!({"structured_outputs": {"json": schema}}))
    };
    let (args, field) = at(limits::MAX_EXTRA_ARGS_NESTING - 2).unwrap();
    assert_eq!((args, field.as_str()), (Some(fits), "structured_outputs"));
    let e = at(limits::MAX_EXTRA_ARGS_NESTING - 1).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("structured_outputs"));
    assert!(
        e.message.contains("128 levels of nesting") && e.message.contains("flatten"),
        "{}",
        e.message
    );
}

#[test]
fn a_json_format_shapes_the_text_answer_beside_tools() {
    let weather = json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}});
    let tools = |choice: &str| {
        let body = json!({"tools": [weather.clone()], "tool_choice": choice});
        ToolRequest::from_body(&body, crate::server::tools::Api::Chat)
            .unwrap()
            .unwrap()
    };
    let answer = json!({"type": "object", "properties": {"temp": {"type": "integer"}}});
    let schema = fields(
        json!({"type": "json_schema", "json_schema": {"name": "a", "schema": answer}}),
        json!(null),
    )
    .unwrap();
    let object = fields(json!({"type": "json_object"}), json!(null)).unwrap();
    let regex = fields(json!(null), json!({"regex": "[a-z]+"})).unwrap();

    // Under auto: a call, or text in the format: one grammar holding both.
    let auto = tools("auto");
    for (format, text) in [(&schema, &answer), (&object, &json!({"type": "object"}))] {
        let c = or_tool_calls(format.clone(), Some(&auto)).unwrap().unwrap();
        assert_eq!(c.field, "tools");
        let grammar = c.value["grammar"].as_str().unwrap();
        assert!(
            grammar.starts_with(&format!("start: text | calls\ntext: %json {text}\n")),
            "{grammar}"
        );
        let mut calls = auto.calls_schema();
        calls["x-guidance"] = json!({"whitespace_flexible": false});
        assert!(
            grammar.ends_with(&format!("\ncalls: %json {calls}\n")),
            "{grammar}"
        );
    }
    // A format other than JSON cannot join the calls.
    let e = or_tool_calls(regex.clone(), Some(&auto)).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("structured_outputs"));
    // A required call has no text answer: the calls alone.
    let required = tools("required");
    for format in [&schema, &regex] {
        let c = or_tool_calls(format.clone(), Some(&required))
            .unwrap()
            .unwrap();
        assert_eq!(Some(c.value), required.structured_outputs(None).unwrap());
    }
    // Under none the format alone; without tools too.
    let none = tools("none");
    assert_eq!(or_tool_calls(regex.clone(), Some(&none)).unwrap(), regex);
    assert_eq!(or_tool_calls(schema.clone(), None).unwrap(), schema);
    // A format schema too deep for the plugins is refused naming it, though
    // inside a grammar it escapes the check on extra_args.
    let deep = limits::nested_schema(limits::MAX_EXTRA_ARGS_NESTING);
    let deep = fields(
        json!({"type": "json_schema", "json_schema": {"name": "a", "schema": deep}}),
        json!(null),
    )
    .unwrap();
    let e = or_tool_calls(deep, Some(&auto)).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("response_format"));
}
