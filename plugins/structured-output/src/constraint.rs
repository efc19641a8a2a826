//! Reading a request's constraint from its `extra_args`: the
//! `"structured_outputs"` object, shaped like vLLM's
//! `StructuredOutputsParams`, turned into an llguidance grammar.
//!
//! Exactly one kind: `json` (a schema object or boolean, or a string
//! holding one), `json_object: true`, `regex` (Rust `regex` syntax, matched
//! by the whole output), `choice` (a non-empty list of strings, taken
//! literally) or `grammar` (Lark as llguidance reads it, including its
//! `%json {schema}` terminals and GBNF-style `{m,n}` repetition; GBNF's
//! `::=` rules are not translated, and a grammar that fails to compile with
//! them gets a hint saying so). JSON properties come out in the schema's
//! order, as llguidance generates them. Knobs:
//! `whitespace_pattern` and `disable_any_whitespace` (JSON kinds only; the
//! latter is accepted and has no effect elsewhere, since a regex, choice or
//! grammar already fixes every byte), `disable_additional_properties` (JSON
//! kinds: objects without `additionalProperties` get `false`, as vLLM does)
//! and `disable_fallback` (accepted; there is no other backend to fall back
//! to). A kind set to `null` (or `json_object: false`) counts as absent, so
//! clients that serialize every field with its default work.

use llguidance::api::TopLevelGrammar;
use serde_json::{Map, Value};

/// The key of `extra_args` that holds the constraint.
pub const KEY: &str = "structured_outputs";

/// The constraint kinds, in the order error messages list them.
const KINDS: [&str; 5] = ["json", "json_object", "regex", "choice", "grammar"];

/// Knobs understood besides the kinds.
const KNOBS: [&str; 4] = [
    "whitespace_pattern",
    "disable_any_whitespace",
    "disable_additional_properties",
    "disable_fallback",
];

/// Keys of schema objects whose values are data, not schemas: the
/// `disable_additional_properties` rewrite must not touch them.
const DATA_KEYWORDS: [&str; 4] = ["enum", "const", "default", "examples"];

/// What a request asks for, before it is compiled.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// A JSON schema (already carrying the knobs in llguidance's
    /// `x-guidance` options).
    Json(Value),
    /// A regular expression (Rust `regex` syntax) the whole output matches.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark grammar.
    Grammar(String),
}

impl Constraint {
    /// The name of the kind, as the request spelled it (for messages).
    pub fn kind(&self) -> &'static str {
        match self {
            Constraint::Json(_) => "json",
            Constraint::Regex(_) => "regex",
            Constraint::Choice(_) => "choice",
            Constraint::Grammar(_) => "grammar",
        }
    }

    /// The llguidance grammar for this constraint.
    pub fn to_grammar(&self) -> TopLevelGrammar {
        match self {
            Constraint::Json(schema) => TopLevelGrammar::from_json_schema(schema.clone()),
            Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Constraint::Choice(choices) => TopLevelGrammar::from_lark(choice_grammar(choices)),
            Constraint::Grammar(lark) => TopLevelGrammar::from_lark(lark.clone()),
        }
    }
}

/// Reads the constraint from a request's `extra_args` JSON: `Ok(None)`
/// when there is none (not this plugin's request), an error naming the
/// problem when it is malformed.
pub fn parse(extra_args: &str) -> Result<Option<Constraint>, String> {
    let args: Value = serde_json::from_str(extra_args)
        .map_err(|e| format!("extra_args is not valid JSON: {e}"))?;
    let so = match args.get(KEY) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(so)) => so,
        Some(other) => {
            return Err(format!(
                "{KEY} must be an object with one of {}, not {}",
                KINDS.join(", "),
                type_name(other)
            ))
        }
    };
    if let Some(unknown) = so
        .keys()
        .find(|k| !KINDS.contains(&k.as_str()) && !KNOBS.contains(&k.as_str()))
    {
        return Err(format!(
            "{KEY}.{unknown} is not supported; known keys: {}, {}",
            KINDS.join(", "),
            KNOBS.join(", ")
        ));
    }
    let given: Vec<&str> = KINDS
        .iter()
        .copied()
        .filter(|k| match so.get(*k) {
            None | Some(Value::Null) => false,
            Some(Value::Bool(false)) => *k != "json_object",
            Some(_) => true,
        })
        .collect();
    let kind = match given.as_slice() {
        [one] => *one,
        [] => {
            return Err(format!(
                "{KEY} names no constraint; give exactly one of {}",
                KINDS.join(", ")
            ))
        }
        many => {
            return Err(format!(
                "{KEY} gives {} at once; give exactly one",
                many.join(" and ")
            ))
        }
    };
    let value = &so[kind];
    let constraint = match kind {
        "json" => Constraint::Json(json_schema(value)?),
        "json_object" => match value {
            Value::Bool(true) => Constraint::Json(serde_json::json!({"type": "object"})),
            other => {
                return Err(format!(
                    "{KEY}.json_object must be true, not {}",
                    type_name(other)
                ))
            }
        },
        "regex" => Constraint::Regex(string_field(value, "regex")?),
        "choice" => Constraint::Choice(choices(value)?),
        _ => Constraint::Grammar(string_field(value, "grammar")?),
    };
    apply_knobs(constraint, so)
}

/// A JSON schema given as an object, a boolean, or a string holding one.
fn json_schema(value: &Value) -> Result<Value, String> {
    let schema = match value {
        Value::String(text) => serde_json::from_str(text)
            .map_err(|e| format!("{KEY}.json is a string but not valid JSON: {e}"))?,
        other => other.clone(),
    };
    match schema {
        Value::Object(_) | Value::Bool(_) => Ok(schema),
        other => Err(format!(
            "{KEY}.json must be a JSON schema (an object or a boolean, or a string holding one), \
             not {}",
            type_name(&other)
        )),
    }
}

fn string_field(value: &Value, name: &str) -> Result<String, String> {
    match value {
        Value::String(s) if !s.is_empty() => Ok(s.clone()),
        Value::String(_) => Err(format!("{KEY}.{name} is empty")),
        other => Err(format!(
            "{KEY}.{name} must be a string, not {}",
            type_name(other)
        )),
    }
}

fn choices(value: &Value) -> Result<Vec<String>, String> {
    let Value::Array(items) = value else {
        return Err(format!(
            "{KEY}.choice must be a list of strings, not {}",
            type_name(value)
        ));
    };
    if items.is_empty() {
        return Err(format!("{KEY}.choice is empty; give at least one string"));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, item)| match item {
            Value::String(s) if !s.is_empty() => Ok(s.clone()),
            Value::String(_) => Err(format!(
                "{KEY}.choice[{i}] is empty; every choice must have text"
            )),
            other => Err(format!(
                "{KEY}.choice[{i}] must be a string, not {}",
                type_name(other)
            )),
        })
        .collect()
}

/// Applies the knobs, refusing those that make no sense for the kind.
fn apply_knobs(c: Constraint, so: &Map<String, Value>) -> Result<Option<Constraint>, String> {
    let flag = |name: &str| -> Result<bool, String> {
        match so.get(name) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(other) => Err(format!(
                "{KEY}.{name} must be a boolean, not {}",
                type_name(other)
            )),
        }
    };
    let compact = flag("disable_any_whitespace")?;
    let closed = flag("disable_additional_properties")?;
    flag("disable_fallback")?;
    let pattern = match so.get("whitespace_pattern") {
        None | Some(Value::Null) => None,
        Some(v) => Some(string_field(v, "whitespace_pattern")?),
    };
    let Constraint::Json(mut schema) = c else {
        if pattern.is_some() || closed {
            let knob = if closed {
                "disable_additional_properties"
            } else {
                "whitespace_pattern"
            };
            return Err(format!(
                "{KEY}.{knob} applies only to json and json_object, not to {}",
                c.kind()
            ));
        }
        return Ok(Some(c));
    };
    if compact && pattern.is_some() {
        return Err(format!(
            "{KEY}.whitespace_pattern and disable_any_whitespace contradict each other; give one"
        ));
    }
    if closed {
        close_objects(&mut schema);
    }
    if compact || pattern.is_some() {
        // A boolean schema has nowhere to carry options: `true` is `{}`;
        // `false` stays unsatisfiable and fails to compile.
        if schema == Value::Bool(true) {
            schema = Value::Object(Map::new());
        }
        if let Value::Object(obj) = &mut schema {
            let entry = obj
                .entry("x-guidance")
                .or_insert_with(|| Value::Object(Map::new()));
            let Some(opts) = entry.as_object_mut() else {
                return Err(format!(
                    "{KEY}.json's \"x-guidance\" must be an object of llguidance options"
                ));
            };
            if let Some(p) = pattern {
                opts.insert("whitespace_pattern".into(), Value::String(p));
            } else {
                opts.insert("whitespace_flexible".into(), Value::Bool(false));
            }
        }
    }
    Ok(Some(Constraint::Json(schema)))
}

/// Sets `additionalProperties: false` on every object schema that does not
/// say, as vLLM's `disable_additional_properties` does.
fn close_objects(schema: &mut Value) {
    match schema {
        Value::Object(obj) => {
            let is_object = match obj.get("type") {
                Some(Value::String(t)) => t == "object",
                Some(Value::Array(ts)) => ts.iter().any(|t| t == "object"),
                _ => obj.contains_key("properties"),
            };
            if is_object && !obj.contains_key("additionalProperties") {
                obj.insert("additionalProperties".into(), Value::Bool(false));
            }
            for (k, v) in obj.iter_mut() {
                if !DATA_KEYWORDS.contains(&k.as_str()) {
                    close_objects(v);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(close_objects),
        _ => {}
    }
}

/// A Lark grammar whose only sentences are the choices.
fn choice_grammar(choices: &[String]) -> String {
    let alts: Vec<String> = choices.iter().map(|c| lark_literal(c)).collect();
    format!("start: {}\n", alts.join(" | "))
}

/// A Lark string literal for `text`: llguidance's lexer wants `"`, `\`, the
/// C0 controls and DEL escaped (as JSON escapes); everything else verbatim.
fn lark_literal(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for ch in text.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                out.push_str(&format!("\\u{:04x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}
