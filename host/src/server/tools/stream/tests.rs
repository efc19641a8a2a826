use serde_json::{json, Value};

use super::*;

/// Two calls whose arguments hold braces, brackets, quotes and escapes
/// inside strings, written as the plugin constrains them (compact).
const TWO_CALLS: &str = r#"{"tool_calls":[{"name":"search","arguments":{"q":"a}b\"{[","n":[1,{"x":"]"}]}},{"name":"now","arguments":{}}]}"#;

/// The calls as serde_json reads the whole text: the independent
/// expectation.
fn expected(text: &str) -> Vec<(String, Value)> {
    let v: Value = serde_json::from_str(text).unwrap();
    v["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_string(),
                c["arguments"].clone(),
            )
        })
        .collect()
}

/// Feeds `text` in pieces of `size` bytes (at char boundaries) and folds
/// the events into calls, checking their order on the way.
fn streamed(text: &str, size: usize) -> Vec<(String, String, bool)> {
    let mut reader = CallReader::default();
    let mut calls: Vec<(String, String, bool)> = Vec::new();
    let mut end = 0;
    while end < text.len() {
        end = (end + size).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        for event in reader.read(&text[..end]) {
            match event {
                CallEvent::Begin { index, name } => {
                    assert_eq!(index, calls.len(), "calls begin in order");
                    calls.push((name, String::new(), false));
                }
                CallEvent::Arguments { index, text } => {
                    assert!(!text.is_empty());
                    let call = &mut calls[index];
                    assert!(!call.2, "arguments after the call ended");
                    call.1.push_str(&text);
                }
                CallEvent::End { index } => {
                    assert_eq!(index + 1, calls.len(), "the last call begun ends");
                    calls[index].2 = true;
                }
            }
        }
    }
    calls
}

#[test]
fn streamed_pieces_add_up_to_each_calls_arguments_however_the_text_is_split() {
    let want = expected(TWO_CALLS);
    for size in 1..=TWO_CALLS.len() {
        let got = streamed(TWO_CALLS, size);
        assert_eq!(got.len(), want.len(), "size {size}");
        for ((name, args, ended), (want_name, want_args)) in got.iter().zip(&want) {
            assert_eq!(name, want_name, "size {size}");
            assert!(ended, "size {size}");
            let args: Value = serde_json::from_str(args).unwrap();
            assert_eq!(&args, want_args, "size {size}");
        }
    }
}

#[test]
fn arguments_stream_before_the_call_ends() {
    let mut reader = CallReader::default();
    let text = r#"{"tool_calls":[{"name":"get_weather","arguments":{"city":"Par"#;
    let events = reader.read(text);
    assert_eq!(
        events,
        [
            CallEvent::Begin {
                index: 0,
                name: "get_weather".into()
            },
            CallEvent::Arguments {
                index: 0,
                text: r#"{"city":"Par"#.into()
            },
        ]
    );
    let text = format!("{text}is\"}}}}]}}");
    assert_eq!(
        reader.read(&text),
        [
            CallEvent::Arguments {
                index: 0,
                text: "is\"}".into()
            },
            CallEvent::End { index: 0 },
        ]
    );
}

/// The events of call 0 read whole: `name`, then all its `arguments`.
fn whole_call(name: &str, arguments: &str) -> [CallEvent; 3] {
    [
        CallEvent::Begin {
            index: 0,
            name: name.into(),
        },
        CallEvent::Arguments {
            index: 0,
            text: arguments.into(),
        },
        CallEvent::End { index: 0 },
    ]
}

#[test]
fn arguments_written_before_the_name_follow_it() {
    let text = r#"{"tool_calls":[{"arguments":{"a":1},"name":"f"}]}"#;
    assert_eq!(
        CallReader::default().read(text),
        whole_call("f", r#"{"a":1}"#)
    );
}

#[test]
fn a_call_cut_short_keeps_what_was_written() {
    let calls = read_calls(r#"{"tool_calls":[{"name":"f","arguments":{"a":[1,"#, "r");
    assert_eq!(
        calls,
        [ToolCall {
            id: "call_r_0".into(),
            name: "f".into(),
            arguments: r#"{"a":[1,"#.into()
        }]
    );
    // Not yet a call, or not the format at all: text.
    assert!(read_calls(r#"{"tool_calls":[{"na"#, "r").is_empty());
    assert!(read_calls(r#"{"name":"f","arguments":{}}"#, "r").is_empty());
    assert!(read_calls("The weather is fine.", "r").is_empty());
}

#[test]
fn calls_are_numbered_densely_even_past_one_without_a_name() {
    // Not what the constrained model writes, but the numbering must not
    // skip: clients index their calls by it.
    let text = r#"{"tool_calls":[{"arguments":{}},{"name":"f","arguments":{"a":1}}]}"#;
    assert_eq!(
        CallReader::default().read(text),
        whole_call("f", r#"{"a":1}"#)
    );
}

#[test]
fn the_arguments_are_kept_as_written() {
    // serde_json would write these differently (`1e2` as `100.0`, the
    // escape as the character): the client gets what the model wrote, in
    // the stream and in the whole answer alike.
    let text = r#"{"tool_calls":[{"name":"f","arguments":{"n":1e2,"s":"\u00e9"}}]}"#;
    let calls = read_calls(text, "r");
    assert_eq!(calls[0].arguments, r#"{"n":1e2,"s":"\u00e9"}"#);
    assert_eq!(streamed(text, 3)[0].1, calls[0].arguments);
    let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
    assert_eq!(args, json!({"n": 100.0, "s": "é"}));
}
