//! Tool calling, for any chat template: the tools are described to
//! the model in a system message in one generic format, the answer is
//! constrained by the structured-output plugin to that format (the call's
//! arguments by each function's JSON schema), and parsed back into OpenAI's
//! `tool_calls`. A conversation's earlier calls and `tool` results are
//! rendered back in the same format, so the model reads its own calls the
//! way it was asked to write them.
//!
//! The format (documented in docs/structured-outputs.md): a call is the whole answer, one
//! JSON object `{"tool_calls": [{"name": ..., "arguments": {...}}]}`. Under
//! `tool_choice: "auto"` the answer is free text that does not start with
//! `{` (or JSON following the client's JSON format, when it asks for one),
//! or a call; under `"required"` or a named function it is always a call;
//! under `"none"` the tools are not described at all.
//!
//! Chat (`/v1/chat/completions`) and the Responses API (`/v1/responses`)
//! offer the same functions in two shapes ([`Api`]); both read into one
//! [`ToolRequest`].

mod schema;
mod stream;

pub use stream::{call_id, CallEvent, Piece, StreamedAnswer};

use std::collections::{BTreeSet, HashSet};

use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::limits;
use crate::sampling::STRUCTURED_OUTPUTS_KEY;
use crate::tokenizer::ChatMessage;

/// Longest function name OpenAI accepts.
const MAX_NAME_LEN: usize = 64;

/// The fields of a `tools` entry that OpenAI defines, all read here.
pub(super) const TOOL_FIELDS: &[&str] = &["type", "function"];

/// The fields of a tool's `function` that OpenAI defines: all read here
/// but `strict`, which every call already is (its arguments are
/// constrained to the schema, closed as under strict mode).
pub(super) const FUNCTION_FIELDS: &[&str] = &["name", "description", "parameters", "strict"];

/// Which API's shapes a request uses. Chat nests a function's fields under
/// `function` (`{"type": "function", "function": {"name": ...}}`) and
/// `allowed_tools` under its own key; the Responses API writes both flat
/// (`{"type": "function", "name": ...}`), in `tools` and `tool_choice`
/// alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/responses`.
    Responses,
}

impl Api {
    /// The object that holds a function's fields in a tool or choice entry.
    fn function(self, entry: &Value) -> Option<&Value> {
        match self {
            Api::Chat => entry.get("function"),
            Api::Responses => Some(entry),
        }
    }

    /// Where that object sits in the entry, for error paths.
    fn function_path(self) -> &'static str {
        match self {
            Api::Chat => ".function",
            Api::Responses => "",
        }
    }

    /// A function entry as this API writes it, for error messages.
    fn named_shape(self) -> &'static str {
        match self {
            Api::Chat => r#"{"type": "function", "function": {"name": ...}}"#,
            Api::Responses => r#"{"type": "function", "name": ...}"#,
        }
    }

    /// The object holding `allowed_tools`'s `mode` and `tools`, and its
    /// path.
    fn allowed(self, choice: &Value) -> (Option<&Value>, &'static str) {
        match self {
            Api::Chat => (choice.get("allowed_tools"), "tool_choice.allowed_tools"),
            Api::Responses => (Some(choice), "tool_choice"),
        }
    }
}

/// One function the client offers.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    /// Its name (`[A-Za-z0-9_-]{1,64}`).
    pub name: String,
    /// What it does, for the model.
    pub description: Option<String>,
    /// The JSON schema of its arguments (an object schema).
    pub parameters: Value,
}

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// Never call; the tools are not shown to the model.
    None,
    /// Free text or a call, as the model decides.
    Auto,
    /// At least one call.
    Required,
    /// A call of this function.
    Named(String),
    /// OpenAI's `allowed_tools`: only these functions may be called (the
    /// others stay in the request, unseen), under `auto` (`required:
    /// false`) or `required`.
    Allowed {
        /// The functions that may be called, each offered in `tools` (a set:
        /// every tool is looked up in it).
        names: BTreeSet<String>,
        /// `mode: "required"`.
        required: bool,
    },
}

/// A chat request's tools and how it lets the model use them.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolRequest {
    /// The functions offered.
    pub tools: Vec<Tool>,
    /// `tool_choice` (default `auto` when tools are given).
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (default true): more than one call per answer.
    pub parallel: bool,
}

/// One call the model made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// `call_<n>`-style id, unique within the answer.
    pub id: String,
    /// The function's name.
    pub name: String,
    /// The arguments as a JSON text (OpenAI sends them as a string).
    pub arguments: String,
}

impl ToolCall {
    /// The call as an OpenAI `tool_calls` entry.
    pub fn to_json(&self) -> Value {
        json!({
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        })
    }
}

impl ToolRequest {
    /// The request's `tools`, `tool_choice` and `parallel_tool_calls`, in
    /// `api`'s shapes; `None` when it offers no tools. Every shape error is
    /// a 400 naming the field.
    pub fn from_body(body: &Value, api: Api) -> Result<Option<ToolRequest>, ApiError> {
        let tools = match body.get("tools") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(list)) => list
                .iter()
                .enumerate()
                .map(|(i, t)| tool(i, t, api))
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(ApiError::field("tools", "must be a list of tools")),
        };
        if let Some(i) = duplicate(&tools) {
            return Err(ApiError::field(
                &format!("tools[{i}]{}.name", api.function_path()),
                format!("`{}` is offered twice; names must be unique", tools[i].name),
            ));
        }
        let choice = choice(body.get("tool_choice").unwrap_or(&Value::Null), &tools, api)?;
        let parallel = match body.get("parallel_tool_calls") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                return Err(ApiError::field(
                    "parallel_tool_calls",
                    "must be true or false",
                ))
            }
        };
        if tools.is_empty() {
            return match choice {
                ToolChoice::None | ToolChoice::Auto => Ok(None),
                _ => Err(ApiError::field(
                    "tool_choice",
                    "asks for a call, but `tools` offers none",
                )),
            };
        }
        let request = ToolRequest {
            tools,
            choice,
            parallel,
        };
        Ok(Some(request))
    }

    /// Whether the answer may or must be a call (`tool_choice` is not
    /// `none`).
    pub fn may_call(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// Whether the answer must be a call.
    pub fn must_call(&self) -> bool {
        match self.choice {
            ToolChoice::Required | ToolChoice::Named(_) => true,
            ToolChoice::Allowed { required, .. } => required,
            ToolChoice::None | ToolChoice::Auto => false,
        }
    }

    /// The functions a call may name.
    fn callable(&self) -> impl Iterator<Item = &Tool> {
        self.tools.iter().filter(move |t| match &self.choice {
            ToolChoice::Named(n) => &t.name == n,
            ToolChoice::Allowed { names, .. } => names.contains(&t.name),
            _ => true,
        })
    }

    /// The system message that describes the tools and the call format;
    /// `None` under `tool_choice: "none"`.
    pub fn system_prompt(&self) -> Option<String> {
        if !self.may_call() {
            return None;
        }
        let list: Vec<Value> = self
            .callable()
            .map(|t| {
                let mut f = Map::new();
                f.insert("name".into(), t.name.clone().into());
                if let Some(d) = &t.description {
                    f.insert("description".into(), d.clone().into());
                }
                f.insert("parameters".into(), t.parameters.clone());
                Value::Object(f)
            })
            .collect();
        let how = match self.must_call() {
            false => "If a function helps to answer, reply with only a JSON object calling it, in this form; otherwise reply in plain text.",
            true => "Reply with only a JSON object calling the function, in this form.",
        };
        let many = if self.parallel {
            " List one entry per call."
        } else {
            " Make one call."
        };
        Some(format!(
            "You can call these functions:\n{}\n{how}{many}\n{{\"tool_calls\": [{{\"name\": \"<function name>\", \"arguments\": {{<its arguments>}}}}]}}",
            Value::Array(list)
        ))
    }

    /// Tells the model of the tools: the description goes after the
    /// conversation's system message, or becomes one when it has none.
    pub fn describe_to(&self, messages: &mut Vec<ChatMessage>) {
        let Some(text) = self.system_prompt() else {
            return;
        };
        match messages.first_mut() {
            Some(m) if m.role == "system" => {
                m.content.push_str("\n\n");
                m.content.push_str(&text);
            }
            _ => messages.insert(0, ChatMessage::new("system", text)),
        }
    }

    /// The JSON schema of a call answer: `tool_calls` holds one or more
    /// (one when calls are not parallel) objects naming a callable
    /// function with arguments that follow its schema, closed: an object
    /// that does not say otherwise takes only the properties it declares,
    /// as under OpenAI's strict function calling (a small model otherwise
    /// invents arguments until its budget runs out). The functions' local
    /// references (`$defs`, as Pydantic writes them) still resolve.
    pub fn calls_schema(&self) -> Value {
        let each: Vec<Value> = self
            .callable()
            .enumerate()
            .map(|(i, t)| {
                let at = format!("/properties/tool_calls/items/anyOf/{i}/properties/arguments");
                let arguments = schema::embed(&t.parameters, &at);
                json!({
                    "type": "object",
                    "properties": {"name": {"const": t.name}, "arguments": arguments},
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let mut calls = json!({"type": "array", "items": {"anyOf": each}, "minItems": 1});
        // A named choice asks for a call of that function: one.
        if !self.parallel || matches!(self.choice, ToolChoice::Named(_)) {
            calls["maxItems"] = 1.into();
        }
        json!({
            "type": "object",
            "properties": {"tool_calls": calls},
            "required": ["tool_calls"],
            "additionalProperties": false,
        })
    }

    /// The constraint for the structured-output plugin (`extra_args`
    /// `structured_outputs`): the calls' schema when a call is required,
    /// under `auto` a Lark grammar of "a call, or else free text not
    /// starting with `{`" (or, when the client asks text answers to follow
    /// the JSON schema `answer`, JSON that does), none under `none`. Calls
    /// are compact JSON (no free whitespace), the form models learn
    /// function calls in, and fewer tokens.
    ///
    /// The calls' schema reaches the plugin in extra_args (a call required)
    /// or inside a grammar (`auto`); it is held to the plugins' nesting
    /// bound as the former (a 400 naming `tools`), so a tools list is taken
    /// or refused alike under every choice.
    pub fn structured_outputs(&self, answer: Option<&Value>) -> Result<Option<Value>, ApiError> {
        if !self.may_call() {
            return Ok(None);
        }
        let mut calls = self.calls_schema();
        // llguidance's own option, read inside `%json` too.
        calls["x-guidance"] = json!({"whitespace_flexible": false});
        let calls = json!({ "json": calls });
        limits::check_nesting("tools", &json!({ STRUCTURED_OUTPUTS_KEY: &calls }))?;
        if self.must_call() {
            return Ok(Some(calls));
        }
        let text = match answer {
            Some(schema) => format!("%json {schema}"),
            None => "TEXT\nTEXT: /[^{](.|\\n)*/".to_string(),
        };
        let calls = &calls["json"];
        Ok(Some(json!({
            "grammar": format!("start: text | calls\ntext: {text}\ncalls: %json {calls}\n")
        })))
    }

    /// The model's answer split into text or calls: an answer in the call
    /// format (after any whitespace) is calls, with ids
    /// `call_<request id>_<n>` and the arguments as the model wrote them
    /// (so they equal what a stream of it sent); a call cut short keeps the
    /// arguments written so far. Anything else is text (under `auto` the
    /// grammar keeps the two apart).
    pub fn parse(&self, text: &str, request_id: &str) -> Answer {
        let calls = if self.may_call() {
            stream::read_calls(text, request_id)
        } else {
            Vec::new()
        };
        if calls.is_empty() {
            return Answer::Text(text.to_string());
        }
        Answer::Calls(calls)
    }
}

/// An answer, as the client gets it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Plain `content`.
    Text(String),
    /// `tool_calls`, with `finish_reason: "tool_calls"`.
    Calls(Vec<ToolCall>),
}

/// An assistant message's `tool_calls` rendered as the text the model
/// writes for them, so it reads its earlier calls in its own format.
pub fn render_calls(field: &str, calls: &Value) -> Result<String, ApiError> {
    let bad = |why: &str| ApiError::field(field, why);
    let list = calls
        .as_array()
        .ok_or_else(|| bad("must be a list of tool calls"))?;
    let mut out = Vec::with_capacity(list.len());
    for c in list {
        let f = c
            .get("function")
            .ok_or_else(|| bad("each call needs a `function` with `name` and `arguments`"))?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("each call's function needs a string `name`"))?;
        let args = arguments(f.get("arguments"))
            .map_err(|why| bad(&format!("`arguments` of `{name}` {why}")))?;
        out.push((name, args));
    }
    Ok(calls_text(out))
}

/// Calls, each a function's name and its arguments object, as the text the
/// model writes for them.
pub fn calls_text<'a>(calls: impl IntoIterator<Item = (&'a str, Value)>) -> String {
    let list: Vec<Value> = calls
        .into_iter()
        .map(|(name, args)| json!({"name": name, "arguments": args}))
        .collect();
    json!({ "tool_calls": list }).to_string()
}

/// A call's `arguments` as the object the model wrote: OpenAI sends them as
/// a JSON text (an object is taken too). The error completes "`arguments`
/// …".
pub fn arguments(v: Option<&Value>) -> Result<Value, String> {
    match v {
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(v @ Value::Object(_)) => Ok(v),
            Ok(_) => Err("is not a JSON object".into()),
            Err(e) => Err(format!("is not JSON: {e}")),
        },
        Some(v @ Value::Object(_)) => Ok(v.clone()),
        _ => Err("is missing: it must be the call's arguments as a JSON text".into()),
    }
}

/// A `tool` message's content as a user turn (templates without tool
/// support know no `tool` role): which call it answers, then the result.
pub fn render_result(name: Option<&str>, call_id: Option<&str>, content: &str) -> String {
    match (name, call_id) {
        (Some(n), _) => format!("Result of the call to {n}:\n{content}"),
        (None, Some(id)) => format!("Result of call {id}:\n{content}"),
        (None, None) => format!("Result of the function call:\n{content}"),
    }
}

/// `tools[i]`, checked.
fn tool(i: usize, t: &Value, api: Api) -> Result<Tool, ApiError> {
    let field = |f: &str| format!("tools[{i}]{f}");
    let fun = |f: &str| format!("tools[{i}]{}{f}", api.function_path());
    match t.get("type").and_then(Value::as_str) {
        Some("function") => {}
        Some(other) => {
            return Err(ApiError::field(
                &field(".type"),
                format!("is `{other}`; only `function` tools are supported"),
            ))
        }
        None => return Err(ApiError::field(&field(".type"), "must be `function`")),
    }
    let f = api
        .function(t)
        .and_then(Value::as_object)
        .ok_or_else(|| ApiError::field(&field(api.function_path()), "must be an object"))?;
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::field(&fun(".name"), "must be a string"))?;
    let valid = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !valid {
        return Err(ApiError::field(
            &fun(".name"),
            format!("must be 1 to {MAX_NAME_LEN} letters, digits, `_` or `-`"),
        ));
    }
    let description = match f.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(ApiError::field(&fun(".description"), "must be a string")),
    };
    // No parameters: a function of no arguments (OpenAI's reading).
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => {
            return Err(ApiError::field(
                &fun(".parameters"),
                "must be a JSON schema object",
            ))
        }
    };
    Ok(Tool {
        name: name.to_string(),
        description,
        parameters,
    })
}

/// The position of the first tool whose name an earlier one has (in one
/// pass: a client may send thousands).
fn duplicate(tools: &[Tool]) -> Option<usize> {
    let mut seen = HashSet::with_capacity(tools.len());
    tools.iter().position(|t| !seen.insert(t.name.as_str()))
}

/// `tool_choice`, checked against the tools.
fn choice(v: &Value, tools: &[Tool], api: Api) -> Result<ToolChoice, ApiError> {
    let named = |name: &str| {
        if tools.iter().any(|t| t.name == name) {
            Ok(ToolChoice::Named(name.to_string()))
        } else {
            Err(ApiError::field(
                "tool_choice",
                format!("names `{name}`, which `tools` does not offer"),
            ))
        }
    };
    match v {
        Value::Null => Ok(if tools.is_empty() {
            ToolChoice::None
        } else {
            ToolChoice::Auto
        }),
        Value::String(s) => match s.as_str() {
            "none" => Ok(ToolChoice::None),
            "auto" => Ok(ToolChoice::Auto),
            "required" => Ok(ToolChoice::Required),
            other => Err(ApiError::field(
                "tool_choice",
                format!(
                    "is `{other}`; use none, auto, required or {}",
                    api.named_shape()
                ),
            )),
        },
        Value::Object(o) => match (
            o.get("type").and_then(Value::as_str),
            api.function(v)
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str),
        ) {
            (Some("function"), Some(name)) => named(name),
            (Some("allowed_tools"), _) => allowed(v, tools, api),
            _ => {
                let allowed = match api {
                    Api::Chat => {
                        r#"{"type": "allowed_tools", "allowed_tools": {"mode": ..., "tools": [...]}}"#
                    }
                    Api::Responses => r#"{"type": "allowed_tools", "mode": ..., "tools": [...]}"#,
                };
                Err(ApiError::field(
                    "tool_choice",
                    format!("a choice object is {} or {allowed}", api.named_shape()),
                ))
            }
        },
        _ => Err(ApiError::field(
            "tool_choice",
            "must be none, auto, required or a named function",
        )),
    }
}

/// An `allowed_tools` choice: `mode` (`auto` or `required`) and `tools`, a
/// non-empty list of function entries naming offered functions.
fn allowed(choice: &Value, tools: &[Tool], api: Api) -> Result<ToolChoice, ApiError> {
    let (v, path) = api.allowed(choice);
    let field = |f: &str| format!("{path}{f}");
    let obj = v
        .and_then(Value::as_object)
        .ok_or_else(|| ApiError::field(&field(""), "must be an object with `mode` and `tools`"))?;
    let required = match obj.get("mode").and_then(Value::as_str) {
        Some("auto") => false,
        Some("required") => true,
        _ => {
            return Err(ApiError::field(
                &field(".mode"),
                "must be `auto` or `required`",
            ))
        }
    };
    let list = obj
        .get("tools")
        .and_then(Value::as_array)
        .filter(|l| !l.is_empty())
        .ok_or_else(|| {
            ApiError::field(&field(".tools"), "must be a non-empty list of functions")
        })?;
    let offered: HashSet<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    let mut names = BTreeSet::new();
    for (i, t) in list.iter().enumerate() {
        let name = match (
            t.get("type").and_then(Value::as_str),
            api.function(t).and_then(|f| f.get("name")),
        ) {
            (Some("function"), Some(Value::String(name))) => name,
            _ => {
                return Err(ApiError::field(
                    &field(&format!(".tools[{i}]")),
                    format!("must be {}", api.named_shape()),
                ))
            }
        };
        if !offered.contains(name.as_str()) {
            return Err(ApiError::field(
                &field(&format!(".tools[{i}]")),
                format!("names `{name}`, which `tools` does not offer"),
            ));
        }
        names.insert(name.clone());
    }
    Ok(ToolChoice::Allowed { names, required })
}

#[cfg(test)]
mod tests;
