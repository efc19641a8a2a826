//! Tool calling on chat, for any chat template: the tools are described to
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
//! `{`, or a call; under `"required"` or a named function it is always a
//! call; under `"none"` the tools are not described at all.

mod schema;

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
        /// The functions that may be called, each offered in `tools`.
        names: Vec<String>,
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
    /// The request's `tools`, `tool_choice` and `parallel_tool_calls`;
    /// `None` when it offers no tools. Every shape error is a 400 naming
    /// the field.
    pub fn from_body(body: &Value) -> Result<Option<ToolRequest>, ApiError> {
        let tools = match body.get("tools") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(list)) => list
                .iter()
                .enumerate()
                .map(|(i, t)| tool(i, t))
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(ApiError::field("tools", "must be a list of tools")),
        };
        if let Some(i) = duplicate(&tools) {
            return Err(ApiError::field(
                &format!("tools[{i}].function.name"),
                format!("`{}` is offered twice; names must be unique", tools[i].name),
            ));
        }
        let choice = choice(body.get("tool_choice").unwrap_or(&Value::Null), &tools)?;
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
        if request.may_call() {
            // The calls' schema reaches the plugin in extra_args (a call
            // required) or inside a grammar (`auto`); held to the plugins'
            // nesting bound as the former, so a tools list is taken or
            // refused alike under every choice.
            let as_sent = json!({ STRUCTURED_OUTPUTS_KEY: {"json": request.calls_schema()} });
            limits::check_nesting("tools", &as_sent)?;
        }
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
    /// a Lark grammar of "free text not starting with `{`, or a call" under
    /// `auto`, none under `none`. Calls are compact JSON (no free
    /// whitespace), the form models learn function calls in, and fewer
    /// tokens.
    pub fn structured_outputs(&self) -> Option<Value> {
        let mut calls = self.calls_schema();
        // llguidance's own option, read inside `%json` too.
        calls["x-guidance"] = json!({"whitespace_flexible": false});
        match (self.may_call(), self.must_call()) {
            (false, _) => None,
            (true, true) => Some(json!({ "json": calls })),
            (true, false) => Some(json!({
                "grammar": format!("start: TEXT | calls\nTEXT: /[^{{](.|\\n)*/\ncalls: %json {calls}\n")
            })),
        }
    }

    /// The model's answer split into text or calls: an answer that is the
    /// call format (ignoring surrounding whitespace) becomes calls, with
    /// ids `call_<request id>_<n>`; anything else is text (under `auto`
    /// the grammar keeps the two apart).
    pub fn parse(&self, text: &str, request_id: &str) -> Answer {
        if !self.may_call() {
            return Answer::Text(text.to_string());
        }
        let Ok(Value::Object(mut obj)) = serde_json::from_str::<Value>(text.trim()) else {
            return Answer::Text(text.to_string());
        };
        let Some(Value::Array(calls)) = obj.remove("tool_calls") else {
            return Answer::Text(text.to_string());
        };
        let mut out = Vec::with_capacity(calls.len());
        for (n, c) in calls.into_iter().enumerate() {
            let (Some(name), Some(args)) = (
                c.get("name").and_then(Value::as_str),
                c.get("arguments").filter(|a| a.is_object()),
            ) else {
                return Answer::Text(text.to_string());
            };
            out.push(ToolCall {
                id: format!("call_{request_id}_{n}"),
                name: name.to_string(),
                arguments: args.to_string(),
            });
        }
        if out.is_empty() || !obj.is_empty() {
            return Answer::Text(text.to_string());
        }
        Answer::Calls(out)
    }
}

/// One choice's stream under tools: text streams as it comes, but an
/// answer that is (or may be) a call is held back and sent whole at the
/// end, as one `tool_calls` delta, since only the complete text parses.
#[derive(Debug, Default)]
pub struct StreamedAnswer {
    /// The text held back so far.
    held: String,
    /// Whether the answer is text (`Some(false)`), a call (`Some(true)`),
    /// or not known yet (only whitespace so far).
    is_call: Option<bool>,
}

impl StreamedAnswer {
    /// Takes a delta's text; returns what to stream as content now.
    pub fn push(&mut self, request: &ToolRequest, text: &str) -> Option<String> {
        if !request.may_call() || self.is_call == Some(false) {
            return Some(text.to_string());
        }
        self.held.push_str(text);
        if self.is_call.is_none() {
            // Under `auto` the grammar keeps text from starting with `{`.
            match self.held.trim_start().chars().next() {
                None => return None,
                Some('{') => self.is_call = Some(true),
                Some(_) if request.must_call() => self.is_call = Some(true),
                Some(_) => {
                    self.is_call = Some(false);
                    return Some(std::mem::take(&mut self.held));
                }
            }
        }
        None
    }

    /// At the end: the held-back answer, parsed.
    pub fn finish(&mut self, request: &ToolRequest, request_id: &str) -> Answer {
        request.parse(&std::mem::take(&mut self.held), request_id)
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
        // OpenAI sends the arguments as a JSON text; the model wrote them
        // as an object.
        let args = match f.get("arguments") {
            Some(Value::String(s)) => serde_json::from_str::<Value>(s)
                .map_err(|e| bad(&format!("`arguments` of `{name}` is not JSON: {e}")))?,
            Some(v @ Value::Object(_)) => v.clone(),
            _ => return Err(bad("each call's function needs `arguments` (a JSON text)")),
        };
        out.push(json!({"name": name, "arguments": args}));
    }
    Ok(json!({ "tool_calls": out }).to_string())
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
fn tool(i: usize, t: &Value) -> Result<Tool, ApiError> {
    let field = |f: &str| format!("tools[{i}]{f}");
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
    let f = t
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| ApiError::field(&field(".function"), "must be an object"))?;
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::field(&field(".function.name"), "must be a string"))?;
    let valid = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !valid {
        return Err(ApiError::field(
            &field(".function.name"),
            format!("must be 1 to {MAX_NAME_LEN} letters, digits, `_` or `-`"),
        ));
    }
    let description = match f.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            return Err(ApiError::field(
                &field(".function.description"),
                "must be a string",
            ))
        }
    };
    // No parameters: a function of no arguments (OpenAI's reading).
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => {
            return Err(ApiError::field(
                &field(".function.parameters"),
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

/// The position of the first tool whose name an earlier one has.
fn duplicate(tools: &[Tool]) -> Option<usize> {
    (1..tools.len()).find(|&i| tools[..i].iter().any(|t| t.name == tools[i].name))
}

/// `tool_choice`, checked against the tools.
fn choice(v: &Value, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
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
                format!("is `{other}`; use none, auto, required or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
            )),
        },
        Value::Object(o) => match (
            o.get("type").and_then(Value::as_str),
            o.get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str),
        ) {
            (Some("function"), Some(name)) => named(name),
            (Some("allowed_tools"), _) => allowed(o.get("allowed_tools"), tools),
            _ => Err(ApiError::field(
                "tool_choice",
                "a choice object is {\"type\": \"function\", \"function\": {\"name\": ...}} \
                 or {\"type\": \"allowed_tools\", \"allowed_tools\": {\"mode\": ..., \"tools\": [...]}}",
            )),
        },
        _ => Err(ApiError::field(
            "tool_choice",
            "must be none, auto, required or a named function",
        )),
    }
}

/// `tool_choice.allowed_tools`: `mode` (`auto` or `required`) and `tools`,
/// a non-empty list of `{"type": "function", "function": {"name": ...}}`
/// naming offered functions.
fn allowed(v: Option<&Value>, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    let field = |f: &str| format!("tool_choice.allowed_tools{f}");
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
    let mut names = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let name = match (
            t.get("type").and_then(Value::as_str),
            t.pointer("/function/name"),
        ) {
            (Some("function"), Some(Value::String(name))) => name,
            _ => {
                return Err(ApiError::field(
                    &field(&format!(".tools[{i}]")),
                    "must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                ))
            }
        };
        if !tools.iter().any(|t| &t.name == name) {
            return Err(ApiError::field(
                &field(&format!(".tools[{i}]")),
                format!("names `{name}`, which `tools` does not offer"),
            ));
        }
        names.push(name.clone());
    }
    Ok(ToolChoice::Allowed { names, required })
}

#[cfg(test)]
mod tests;
