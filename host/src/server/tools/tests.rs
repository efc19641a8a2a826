//! Tool calling's unit tests: tool definitions, `tool_choice`, rendering
//! calls and parsing answers.

use super::*;

fn weather() -> Value {
    json!({
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    })
}

fn request(extra: Value) -> Result<Option<ToolRequest>, ApiError> {
    let mut body = json!({"tools": [weather(), {"type": "function", "function": {"name": "now"}}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    ToolRequest::from_body(&body, Api::Chat)
}

#[test]
fn choices_parse_and_default_to_auto() {
    let r = request(json!({})).unwrap().unwrap();
    assert_eq!(r.choice, ToolChoice::Auto);
    assert!(r.parallel);
    assert_eq!(r.tools[1].parameters["type"], "object");
    let r = request(json!({"tool_choice": {"type": "function", "function": {"name": "now"}}, "parallel_tool_calls": false}))
            .unwrap()
            .unwrap();
    assert_eq!(r.choice, ToolChoice::Named("now".into()));
    assert!(!r.parallel);
    assert!(ToolRequest::from_body(&json!({}), Api::Chat)
        .unwrap()
        .is_none());
}

#[test]
fn bad_tools_name_the_field() {
    let cases = [
        (json!({"tool_choice": "sometimes"}), "tool_choice"),
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        ),
        (json!({"parallel_tool_calls": "yes"}), "parallel_tool_calls"),
    ];
    for (extra, param) in cases {
        let e = request(extra).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(param), "{e:?}");
    }
    let bodies = [
        (json!({"tools": [{"type": "retrieval"}]}), "tools[0].type"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tools": [weather(), weather()]}),
            "tools[1].function.name",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}),
            "tools[0].function.parameters",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
    ];
    for (body, param) in bodies {
        let e = ToolRequest::from_body(&body, Api::Chat).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(param), "{e:?}");
    }
}

#[test]
fn the_first_repeated_name_is_named() {
    let tools: Vec<Value> = ["a", "b", "c", "b", "a"]
        .iter()
        .map(|n| json!({"type": "function", "function": {"name": n}}))
        .collect();
    let e = ToolRequest::from_body(&json!({ "tools": tools }), Api::Chat).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("tools[3].function.name"));
    assert!(e.message.contains("`b` is offered twice"), "{}", e.message);
}

#[test]
fn a_call_round_trips_through_the_format() {
    let r = request(json!({"tool_choice": "required"}))
        .unwrap()
        .unwrap();
    let answer = r#" {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]} "#;
    let Answer::Calls(calls) = r.parse(answer, "chatcmpl-7") else {
        panic!("not parsed as a call");
    };
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].name, "get_weather");
    assert_eq!(calls[0].id, "call_chatcmpl-7_0");
    let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
    assert_eq!(args, json!({"city": "Paris"}));
    // What the client sends back renders as what the model wrote.
    let back = render_calls("messages[1].tool_calls", &json!([calls[0].to_json()])).unwrap();
    let a: Value = serde_json::from_str(answer.trim()).unwrap();
    assert_eq!(serde_json::from_str::<Value>(&back).unwrap(), a);
}

#[test]
fn text_stays_text() {
    let r = request(json!({})).unwrap().unwrap();
    for t in [
        "It is sunny.",
        "{\"city\": 1}",
        "{\"tool_calls\": []}",
        "{\"tool_calls\": [{\"name\": \"x\"}]}",
    ] {
        assert_eq!(r.parse(t, "x"), Answer::Text(t.into()), "{t}");
    }
    let none = request(json!({"tool_choice": "none"})).unwrap().unwrap();
    assert!(none.system_prompt().is_none() && none.structured_outputs(None).unwrap().is_none());
    let call = r#"{"tool_calls": [{"name": "now", "arguments": {}}]}"#;
    assert_eq!(none.parse(call, "x"), Answer::Text(call.into()));
}

#[test]
fn the_schema_allows_only_callable_functions() {
    let r =
        request(json!({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}))
            .unwrap()
            .unwrap();
    let s = r.calls_schema();
    let each = s["properties"]["tool_calls"]["items"]["anyOf"]
        .as_array()
        .unwrap();
    assert_eq!(each.len(), 1);
    assert_eq!(each[0]["properties"]["name"]["const"], "get_weather");
    assert_eq!(s["properties"]["tool_calls"]["maxItems"], 1);
    let args = &each[0]["properties"]["arguments"];
    assert_eq!(args["additionalProperties"], false);
    assert!(r.tools[0].parameters.get("additionalProperties").is_none());
    assert!(r.system_prompt().unwrap().contains("get_weather"));
    assert!(!r.system_prompt().unwrap().contains("\"now\""));
    let auto = request(json!({})).unwrap().unwrap();
    let g = auto.structured_outputs(None).unwrap().unwrap();
    assert!(g["grammar"]
        .as_str()
        .unwrap()
        .starts_with("start: text | calls\ntext: TEXT\n"));
}

#[test]
fn streams_hold_back_only_calls() {
    let auto = request(json!({})).unwrap().unwrap();
    let nothing = Piece::Calls {
        events: Vec::new(),
        logprobs: Vec::new(),
    };
    let calls = |events: Vec<CallEvent>| Piece::Calls {
        events,
        logprobs: Vec::new(),
    };
    let text = |t: &str| Piece::Text {
        text: t.into(),
        logprobs: Vec::new(),
    };
    let mut s = StreamedAnswer::default();
    assert_eq!(s.push(&auto, " ", Vec::new()), nothing);
    assert_eq!(s.push(&auto, " It", Vec::new()), text("  It"));
    assert_eq!(s.push(&auto, " is", Vec::new()), text(" is"));
    assert!(!s.called());
    // A call streams as events: its name once written, its arguments as
    // they come.
    let mut s = StreamedAnswer::default();
    assert_eq!(
        s.push(&auto, "{\"tool_calls\": [{\"na", Vec::new()),
        nothing
    );
    let begin = |name: &str| CallEvent::Begin {
        index: 0,
        name: name.into(),
    };
    let arguments = |text: &str| CallEvent::Arguments {
        index: 0,
        text: text.into(),
    };
    assert_eq!(
        s.push(&auto, "me\": \"now\", \"arguments\": {", Vec::new()),
        calls(vec![begin("now"), arguments("{")])
    );
    assert_eq!(
        s.push(&auto, "}}]}", Vec::new()),
        calls(vec![arguments("}"), CallEvent::End { index: 0 }])
    );
    assert!(s.called());
    let (Answer::Calls(calls), _) = s.finish(&auto, "r") else {
        panic!("not a call");
    };
    assert_eq!(
        (calls[0].name.as_str(), calls[0].arguments.as_str()),
        ("now", "{}")
    );
    // JSON that is not a call (a text answer in the client's JSON format)
    // streams once it leaves the calls' opening.
    let mut s = StreamedAnswer::default();
    assert_eq!(s.push(&auto, "{\"", Vec::new()), nothing);
    assert_eq!(s.push(&auto, "tool", Vec::new()), nothing);
    assert_eq!(s.push(&auto, "s\": 1", Vec::new()), text("{\"tools\": 1"));
    assert_eq!(s.push(&auto, "}", Vec::new()), text("}"));
    assert!(!s.called());
    let mut messages = vec![ChatMessage::new("user", "hi")];
    auto.describe_to(&mut messages);
    assert_eq!(messages[0].role, "system");
    auto.describe_to(&mut messages);
    assert_eq!(
        messages.len(),
        2,
        "a second description joins the system message"
    );
}

#[test]
fn every_tokens_logprobs_stream_once_in_order() {
    let auto = request(json!({})).unwrap().unwrap();
    // One logprob entry per token, numbered so their order shows.
    let lp = |n: u64| vec![json!({"token": n})];
    let entries = |ns: &[u64]| ns.iter().map(|&n| json!({"token": n})).collect::<Vec<_>>();
    let nothing = Piece::Calls {
        events: Vec::new(),
        logprobs: Vec::new(),
    };
    // Text held while it may open a call goes with every held token's
    // entry.
    let mut s = StreamedAnswer::default();
    assert_eq!(s.push(&auto, " ", lp(0)), nothing);
    assert_eq!(s.push(&auto, "{\"", lp(1)), nothing);
    assert_eq!(
        s.push(&auto, "x", lp(2)),
        Piece::Text {
            text: " {\"x".into(),
            logprobs: entries(&[0, 1, 2])
        }
    );
    assert_eq!(
        s.push(&auto, "\"", lp(3)),
        Piece::Text {
            text: "\"".into(),
            logprobs: entries(&[3])
        }
    );
    // An answer that ends while still held gives its entries at the end.
    let mut s = StreamedAnswer::default();
    s.push(&auto, "\n", lp(0));
    s.push(&auto, " ", lp(1));
    let (answer, logprobs) = s.finish(&auto, "r");
    assert_eq!(answer, Answer::Text("\n ".into()));
    assert_eq!(logprobs, entries(&[0, 1]));
    // A call's pieces carry the entries of the tokens that wrote them;
    // those that wrote no name or arguments (the opening, the closing) go
    // with the next piece that does, or at the end.
    let mut s = StreamedAnswer::default();
    assert_eq!(s.push(&auto, "{\"tool_calls\":", lp(0)), nothing);
    assert_eq!(s.push(&auto, "[{\"name\":\"", lp(1)), nothing);
    let Piece::Calls { events, logprobs } = s.push(&auto, "now\",", lp(2)) else {
        panic!("not calls");
    };
    assert_eq!(events.len(), 1);
    assert_eq!(logprobs, entries(&[0, 1, 2]));
    let Piece::Calls { logprobs, .. } = s.push(&auto, "\"arguments\":{}", lp(3)) else {
        panic!("not calls");
    };
    assert_eq!(logprobs, entries(&[3]));
    // `}` only closes the call, `]}` writes nothing: theirs go at the end.
    assert_eq!(
        s.push(&auto, "}", lp(4)),
        Piece::Calls {
            events: vec![CallEvent::End { index: 0 }],
            logprobs: Vec::new()
        }
    );
    assert_eq!(s.push(&auto, "]}", lp(5)), nothing);
    let (answer, logprobs) = s.finish(&auto, "r");
    assert!(matches!(answer, Answer::Calls(_)));
    assert_eq!(logprobs, entries(&[4, 5]));
}

#[test]
fn results_name_their_call() {
    assert_eq!(
        render_result(Some("now"), Some("c1"), "12:00"),
        "Result of the call to now:\n12:00"
    );
    assert!(render_calls("m", &json!([{"function": {"name": "f", "arguments": "{"}}])).is_err());
}

/// Every `$ref` under `schema`, with the JSON pointer of the object that
/// holds it.
fn refs(schema: &Value, at: String, out: &mut Vec<(String, String)>) {
    match schema {
        Value::Object(obj) => {
            if let Some(Value::String(r)) = obj.get("$ref") {
                out.push((at.clone(), r.clone()));
            }
            for (k, v) in obj {
                refs(
                    v,
                    format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")),
                    out,
                );
            }
        }
        Value::Array(list) => {
            for (i, v) in list.iter().enumerate() {
                refs(v, format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
}

/// The node a local `$ref` names in `root`.
fn resolve<'a>(root: &'a Value, target: &str) -> &'a Value {
    let pointer = target.strip_prefix('#').expect("a local reference");
    root.pointer(pointer)
        .unwrap_or_else(|| panic!("`{target}` resolves to nothing"))
}

#[test]
fn local_references_resolve_where_the_parameters_are_placed() {
    // As Pydantic writes a model with nested models ($defs), an older
    // generator's `definitions`, and a recursive reference to the root.
    let ship = json!({
        "title": "Shipment",
        "type": "object",
        "properties": {
            "sender": {"$ref": "#/$defs/Address"},
            "recipient": {"$ref": "#/$defs/Address"},
            "size": {"$ref": "#/definitions/Size"},
            "parts": {"type": "array", "items": {"$ref": "#"}},
        },
        "required": ["sender", "recipient"],
        "$defs": {"Address": {"title": "Address", "type": "object", "properties": {"city": {"type": "string"}}}},
        "definitions": {"Size": {"title": "Size", "enum": ["S", "M", "L"]}},
    });
    let body = json!({
        "tools": [weather(), {"type": "function", "function": {"name": "ship", "parameters": ship}}],
        "tool_choice": "required",
    });
    let r = ToolRequest::from_body(&body, Api::Chat).unwrap().unwrap();
    let calls = r.calls_schema();
    let mut original = Vec::new();
    refs(&ship, String::new(), &mut original);
    let args = "/properties/tool_calls/items/anyOf/1/properties/arguments";
    let placed = calls.pointer(args).unwrap();
    let mut moved = Vec::new();
    refs(placed, String::new(), &mut moved);
    assert_eq!(original.len(), 4);
    assert_eq!(moved.len(), original.len());
    for ((at, before), (at_now, after)) in original.iter().zip(&moved) {
        assert_eq!(at, at_now);
        // The same definition, found from the whole calls schema.
        let (was, is) = (resolve(&ship, before), resolve(&calls, after));
        assert_eq!(was["title"], is["title"], "{before} -> {after}");
        assert_eq!(
            was.get("properties")
                .map(|p| p.as_object().unwrap().keys().collect::<Vec<_>>()),
            is.get("properties")
                .map(|p| p.as_object().unwrap().keys().collect::<Vec<_>>()),
        );
    }
    // The definitions are closed like the rest; the functions' own
    // schemas are not touched.
    assert_eq!(resolve(&calls, &moved[0].1)["additionalProperties"], false);
    assert_eq!(r.tools[1].parameters, ship);
    // A reference elsewhere is left as written (llguidance refuses it
    // with a message naming it).
    let remote =
        json!({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}});
    let body =
        json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": remote}}]});
    let r = ToolRequest::from_body(&body, Api::Chat).unwrap().unwrap();
    let placed = &r.calls_schema()["properties"]["tool_calls"]["items"]["anyOf"][0];
    assert_eq!(
        placed["properties"]["arguments"]["properties"]["a"]["$ref"],
        "https://example.com/a.json"
    );
}

#[test]
fn only_schemas_are_closed_not_the_data_in_them() {
    let parameters = json!({
        "type": "object",
        "properties": {
            // A property named `properties`, and one whose schema is open.
            "properties": {"type": "string"},
            "extra": {"type": "object", "properties": {}, "additionalProperties": true},
            "either": {"anyOf": [{"type": "object", "properties": {"x": {}}}, {"type": "null"}]},
        },
        "default": {"properties": {"x": 1}},
        "examples": [{"properties": {}}],
        "const": {"properties": {}},
    });
    let body = json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]});
    let r = ToolRequest::from_body(&body, Api::Chat).unwrap().unwrap();
    let calls = r.calls_schema();
    let args = &calls["properties"]["tool_calls"]["items"]["anyOf"][0]["properties"]["arguments"];
    assert_eq!(args["additionalProperties"], false);
    let props = args["properties"].as_object().unwrap();
    assert_eq!(
        props.keys().collect::<Vec<_>>(),
        ["properties", "extra", "either"]
    );
    assert_eq!(props["extra"]["additionalProperties"], true);
    assert_eq!(props["either"]["anyOf"][0]["additionalProperties"], false);
    for data in ["default", "examples", "const"] {
        assert_eq!(args[data], parameters[data], "{data} is data");
    }
}

#[test]
fn allowed_tools_narrow_the_callable_functions() {
    let allowed = |mode: &str, names: &[&str]| {
        let tools: Vec<Value> = names
            .iter()
            .map(|n| json!({"type": "function", "function": {"name": n}}))
            .collect();
        request(
            json!({"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}}}),
        )
    };
    let names_in = |schema: &Value| -> Vec<String> {
        schema["properties"]["tool_calls"]["items"]["anyOf"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                c["properties"]["name"]["const"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect()
    };
    // `required`: a call, of `now` only, as many as parallel calls allow.
    let r = allowed("required", &["now"]).unwrap().unwrap();
    assert!(r.may_call() && r.must_call());
    assert_eq!(names_in(&r.calls_schema()), ["now"]);
    assert!(r.calls_schema()["properties"]["tool_calls"]
        .get("maxItems")
        .is_none());
    let so = r.structured_outputs(None).unwrap().unwrap();
    assert_eq!(names_in(&so["json"]), ["now"]);
    let prompt = r.system_prompt().unwrap();
    assert!(
        prompt.contains("\"now\"") && !prompt.contains("get_weather"),
        "{prompt}"
    );
    // `auto`: text or a call of the allowed functions.
    let r = allowed("auto", &["get_weather"]).unwrap().unwrap();
    assert!(r.may_call() && !r.must_call());
    assert_eq!(names_in(&r.calls_schema()), ["get_weather"]);
    let grammar = r.structured_outputs(None).unwrap().unwrap()["grammar"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(grammar.starts_with("start: text | calls") && !grammar.contains("\"now\""));
    // Every shape error names its field.
    let field = |e: ApiError| e.param.unwrap();
    assert_eq!(
        field(allowed("sometimes", &["now"]).unwrap_err()),
        "tool_choice.allowed_tools.mode"
    );
    assert_eq!(
        field(allowed("auto", &[]).unwrap_err()),
        "tool_choice.allowed_tools.tools"
    );
    assert_eq!(
        field(allowed("auto", &["now", "mul"]).unwrap_err()),
        "tool_choice.allowed_tools.tools[1]"
    );
    let e = request(json!({"tool_choice": {"type": "allowed_tools"}})).unwrap_err();
    assert_eq!(field(e), "tool_choice.allowed_tools");
    let e =
        request(json!({"tool_choice": {"type": "custom", "custom": {"name": "now"}}})).unwrap_err();
    assert_eq!(field(e), "tool_choice");
}

#[test]
fn a_schema_too_deep_for_the_plugins_is_refused_under_every_choice() {
    let body = |levels: usize, choice: Value| {
        json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": limits::nested_schema(levels)}}],
               "tool_choice": choice})
    };
    // Nine levels of extra_args and the calls' schema lie above the
    // parameters where the plugins read them.
    let fits = limits::MAX_EXTRA_ARGS_NESTING - 9;
    let constraint = |levels: usize, choice: Value| {
        ToolRequest::from_body(&body(levels, choice), Api::Chat)
            .unwrap()
            .unwrap()
            .structured_outputs(None)
    };
    for choice in [
        json!("auto"),
        json!("required"),
        json!({"type": "function", "function": {"name": "f"}}),
    ] {
        assert!(constraint(fits, choice.clone()).is_ok(), "{choice}");
        let e = constraint(fits + 1, choice.clone()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools"), "{choice}");
        assert!(e.message.contains("flatten the schema"), "{}", e.message);
    }
    // Under `none` the schema goes nowhere.
    assert_eq!(constraint(fits + 1, json!("none")).unwrap(), None);
}

/// A chat-shaped tool or choice entry in the Responses API's flat shape.
fn flat(entry: &Value) -> Value {
    let mut out = entry.as_object().unwrap().clone();
    if let Some(Value::Object(f)) = out.remove("function") {
        out.extend(f);
    }
    if let Some(Value::Object(a)) = out.remove("allowed_tools") {
        out.extend(a);
    }
    if let Some(Value::Array(tools)) = out.get_mut("tools") {
        *tools = tools.iter().map(flat).collect();
    }
    Value::Object(out)
}

#[test]
fn the_responses_api_shapes_read_as_chat_shapes_do() {
    let now = json!({"type": "function", "function": {"name": "now"}});
    let choices = [
        json!(null),
        json!("required"),
        json!("none"),
        json!({"type": "function", "function": {"name": "now"}}),
        json!({"type": "allowed_tools", "allowed_tools": {"mode": "required",
            "tools": [{"type": "function", "function": {"name": "get_weather"}}]}}),
    ];
    for choice in choices {
        let chat = json!({"tools": [weather(), now], "tool_choice": choice,
            "parallel_tool_calls": false});
        let responses = json!({"tools": [flat(&weather()), flat(&now)],
            "tool_choice": if choice.is_object() { flat(&choice) } else { choice.clone() },
            "parallel_tool_calls": false});
        let want = ToolRequest::from_body(&chat, Api::Chat).unwrap().unwrap();
        let got = ToolRequest::from_body(&responses, Api::Responses)
            .unwrap()
            .unwrap();
        assert_eq!(got, want, "{responses}");
    }
    // Each shape error names the field where this API puts it.
    let bodies = [
        (
            json!({"tools": [{"type": "function", "name": "a b"}]}),
            "tools[0].name",
        ),
        (
            json!({"tools": [flat(&weather()), flat(&weather())]}),
            "tools[1].name",
        ),
        (
            json!({"tools": [{"type": "function", "name": "f", "parameters": 1}]}),
            "tools[0].parameters",
        ),
        (json!({"tools": [{"type": "web_search"}]}), "tools[0].type"),
        (
            json!({"tools": [flat(&weather())], "tool_choice": {"type": "function", "name": "now"}}),
            "tool_choice",
        ),
        (
            json!({"tools": [flat(&weather())], "tool_choice": {"type": "allowed_tools",
                "mode": "auto", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}}),
            "tool_choice.tools[0]",
        ),
        (
            json!({"tools": [flat(&weather())], "tool_choice": {"type": "allowed_tools", "tools": []}}),
            "tool_choice.mode",
        ),
    ];
    for (body, param) in bodies {
        let e = ToolRequest::from_body(&body, Api::Responses).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
    }
    // Chat's nested shape is not the Responses API's.
    let e = ToolRequest::from_body(&json!({"tools": [weather()]}), Api::Responses).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("tools[0].name"), "{e:?}");
}
