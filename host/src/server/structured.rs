//! Structured outputs on the API: OpenAI's `response_format`, vLLM's
//! `structured_outputs` and the Responses API's `text.format` read into one
//! constraint shaped like vLLM's `StructuredOutputsParams`, which travels to
//! the logits processors in `extra_args.structured_outputs` (the
//! `engine:structured-output` plugin reads it there).
//!
//! Only shapes are checked here, so every 400 names the field at fault;
//! whether a schema, regex or grammar compiles is the plugin's to say,
//! through the [`RequestCheck`] run on the final `extra_args` before the
//! request is queued.

use std::sync::Arc;

use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::fields::IGNORED_NAME_CHARS;
use super::limits;
use super::protocol::SamplingRequest;
use super::tools::ToolRequest;
use super::{AppState, RequestCheck};
use crate::sampling::{SamplingParams, STRUCTURED_OUTPUTS_KEY as KEY};

/// What a `structured_outputs` object must set exactly one of.
const KINDS: &str = "json, regex, choice, grammar or json_object";

/// An option of `structured_outputs`: its key, whether a value has the
/// right type, and that type in words.
type Knob = (&'static str, fn(&Value) -> bool, &'static str);

/// vLLM's options beside the constraint: passed to the plugin, which
/// honours or refuses them (through the check), once their type is right.
const OPTIONS: &[Knob] = &[
    ("disable_fallback", Value::is_boolean, "true or false"),
    ("disable_any_whitespace", Value::is_boolean, "true or false"),
    (
        "disable_additional_properties",
        Value::is_boolean,
        "true or false",
    ),
    ("whitespace_pattern", Value::is_string, "a string"),
];

/// A request's constraint (the `structured_outputs` object the plugin
/// reads) and the request field it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Constraint {
    /// `response_format`, `structured_outputs` or `text.format`.
    pub field: &'static str,
    /// The normalized `structured_outputs` object.
    pub value: Value,
}

/// The constraint of a chat or completions request: its `response_format`
/// (other than `text`) or its `structured_outputs`, never both.
pub fn from_fields(
    response_format: Option<&Value>,
    structured_outputs: Option<&Value>,
) -> Result<Option<Constraint>, ApiError> {
    let format = match response_format {
        None | Some(Value::Null) => None,
        Some(f) => format_constraint(f, "response_format", false)?,
    };
    let outputs = match structured_outputs {
        None | Some(Value::Null) => None,
        Some(s) => Some(outputs_object(s, "structured_outputs")?),
    };
    Ok(match (format, outputs) {
        (Some(_), Some(_)) => {
            return Err(ApiError::field(
                "structured_outputs",
                "`response_format` asks for a format too; send only one of the two",
            ))
        }
        (Some(value), None) => Some(Constraint {
            field: "response_format",
            value,
        }),
        (None, Some(value)) => Some(Constraint {
            field: "structured_outputs",
            value,
        }),
        (None, None) => None,
    })
}

/// The answer's constraint when the request may also offer tools: the
/// client's own (`constraint`), or the tool-call format when a call may be
/// made. Under `auto` a text answer still follows the client's format when
/// that is JSON (a schema or `json_object`, as the Agents SDK's
/// `output_type` asks), joined with the calls in one grammar; any other
/// format beside a possible call is a 400 naming it. A required call has
/// no text answer for a format to shape.
pub fn or_tool_calls(
    constraint: Option<Constraint>,
    tools: Option<&ToolRequest>,
) -> Result<Option<Constraint>, ApiError> {
    let Some(tools) = tools.filter(|t| t.may_call()) else {
        return Ok(constraint);
    };
    let answer = match &constraint {
        Some(c) if !tools.must_call() => Some(json_answer(c)?),
        _ => None,
    };
    Ok(tools
        .structured_outputs(answer.as_ref())?
        .map(|value| Constraint {
            field: "tools",
            value,
        }))
}

/// The JSON schema a constraint asks a text answer to follow, when that is
/// all it asks; bounded as the plugins parse it, since inside a grammar it
/// escapes the check on `extra_args`.
fn json_answer(c: &Constraint) -> Result<Value, ApiError> {
    let only = |key: &str| c.value.as_object().filter(|o| o.len() == 1)?.get(key);
    let schema = match (only("json"), only("json_object")) {
        (Some(schema), _) => schema.clone(),
        (_, Some(Value::Bool(true))) => json!({"type": "object"}),
        _ => {
            return Err(ApiError::field(
                c.field,
                "cannot be combined with `tools` unless `tool_choice` is `none` or a call is \
                 required: beside a possible call only a JSON format (a JSON schema or \
                 json_object, without options) can shape the answer",
            ))
        }
    };
    limits::check_nesting(c.field, &json!({ KEY: {"json": &schema} }))?;
    Ok(schema)
}

/// The constraint of a `/v1/responses` request's `text.format`, whose
/// `json_schema` type carries `name` and `schema` beside `type`.
pub fn from_text_format(format: Option<&Value>) -> Result<Option<Constraint>, ApiError> {
    let value = match format {
        None | Some(Value::Null) => None,
        Some(f) => format_constraint(f, "text.format", true)?,
    };
    Ok(value.map(|value| Constraint {
        field: "text.format",
        value,
    }))
}

/// `response_format` (or `text.format`, where the schema's fields sit
/// beside `type`: `flat`) as a `structured_outputs` object; `None` for
/// plain text.
fn format_constraint(format: &Value, field: &str, flat: bool) -> Result<Option<Value>, ApiError> {
    let types = "the types accepted are text, json_object and json_schema";
    let Some(object) = format.as_object() else {
        return Err(ApiError::field(
            field,
            format!("must be an object with a `type`; {types}"),
        ));
    };
    let type_field = format!("{field}.type");
    match object.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"json_object": true}))),
        Some("json_schema") if flat => Ok(Some(json!({"json": json_schema(object, field)?}))),
        Some("json_schema") => {
            let at = format!("{field}.json_schema");
            match object.get("json_schema") {
                Some(Value::Object(spec)) => Ok(Some(json!({"json": json_schema(spec, &at)?}))),
                _ => Err(ApiError::field(
                    &at,
                    "must be an object with `name` and `schema` (a JSON schema), as \
                     {\"name\": \"answer\", \"schema\": {\"type\": \"object\"}}",
                )),
            }
        }
        Some("structural_tag") => Err(ApiError::field(
            &type_field,
            format!("`structural_tag` is not supported; {types}"),
        )),
        Some(other) => Err(ApiError::field(
            &type_field,
            format!("is `{}`; {types}", clip(other)),
        )),
        None => Err(ApiError::field(
            &type_field,
            format!("is missing or not a string; {types}"),
        )),
    }
}

/// The schema of a `json_schema` format whose fields are `spec` (at
/// `field`): `name` is required, as OpenAI has it; `strict` is accepted
/// either way, since the output always follows the schema as compiled.
fn json_schema(spec: &Map<String, Value>, field: &str) -> Result<Value, ApiError> {
    let at = |name: &str| format!("{field}.{name}");
    if !spec.get("name").is_some_and(Value::is_string) {
        return Err(ApiError::field(
            &at("name"),
            "must be a string naming the schema (OpenAI requires one), as \"answer\"",
        ));
    }
    if spec
        .get("strict")
        .is_some_and(|s| !s.is_null() && !s.is_boolean())
    {
        return Err(ApiError::field(&at("strict"), "must be true or false"));
    }
    if spec
        .get("description")
        .is_some_and(|d| !d.is_null() && !d.is_string())
    {
        return Err(ApiError::field(&at("description"), "must be a string"));
    }
    match spec.get("schema") {
        Some(Value::Object(schema)) => Ok(Value::Object(schema.clone())),
        None | Some(Value::Null) => Err(ApiError::field(
            &at("schema"),
            "is missing; give the JSON schema the output must follow \
             (for any JSON object, use the type json_object)",
        )),
        Some(_) => Err(ApiError::field(
            &at("schema"),
            "must be a JSON schema object, as {\"type\": \"object\"}",
        )),
    }
}

/// A `structured_outputs` object (at `field`) checked and normalized:
/// exactly one constraint kind, `json` as an object (vLLM also takes it as
/// JSON text), vLLM's options typed, `null` values dropped.
fn outputs_object(value: &Value, field: &str) -> Result<Value, ApiError> {
    let Some(object) = value.as_object() else {
        return Err(ApiError::field(
            field,
            format!("must be an object setting one of {KINDS}"),
        ));
    };
    let mut out = Map::new();
    let mut kinds = Vec::new();
    for (key, v) in object.iter().filter(|(_, v)| !v.is_null()) {
        let at = format!("{field}.{}", clip(key));
        let normalized = match key.as_str() {
            "json" => json_value(v, &at)?,
            "regex" | "grammar" => match v.as_str() {
                Some(s) if !s.is_empty() => v.clone(),
                _ => return Err(ApiError::field(&at, "must be a non-empty string")),
            },
            "choice" => match v.as_array() {
                Some(c) if !c.is_empty() && c.iter().all(Value::is_string) => v.clone(),
                _ => {
                    return Err(ApiError::field(
                        &at,
                        "must be a non-empty list of strings, as [\"yes\", \"no\"]",
                    ))
                }
            },
            "json_object" => match v {
                Value::Bool(true) => v.clone(),
                Value::Bool(false) => continue,
                _ => return Err(ApiError::field(&at, "must be true or false")),
            },
            "structural_tag" => {
                return Err(ApiError::field(
                    &at,
                    format!("structural tags are not supported; set one of {KINDS}"),
                ))
            }
            other => match OPTIONS.iter().find(|(name, ..)| *name == other) {
                Some((_, typed, _)) if typed(v) => {
                    out.insert(key.clone(), v.clone());
                    continue;
                }
                Some((.., what)) => return Err(ApiError::field(&at, format!("must be {what}"))),
                None => {
                    let options: Vec<&str> = OPTIONS.iter().map(|(name, ..)| *name).collect();
                    return Err(ApiError::field(
                        &at,
                        format!(
                            "is not a structured_outputs key; the keys are {KINDS}, and the \
                             options {}",
                            options.join(", ")
                        ),
                    ));
                }
            },
        };
        kinds.push(key.as_str());
        // In the order KINDS names them, whatever order the map keeps.
        kinds.sort_by_key(|k| KINDS.find(k));
        out.insert(key.clone(), normalized);
    }
    match kinds.as_slice() {
        [_] => Ok(Value::Object(out)),
        [] => Err(ApiError::field(
            field,
            format!("sets no constraint; set one of {KINDS}"),
        )),
        many => Err(ApiError::field(
            field,
            format!("sets {}; set exactly one of {KINDS}", many.join(" and ")),
        )),
    }
}

/// `structured_outputs.json`: a JSON schema (an object, or a boolean:
/// `true` takes any JSON), or JSON text of one.
fn json_value(v: &Value, field: &str) -> Result<Value, ApiError> {
    let schema = match v {
        Value::String(text) => serde_json::from_str(text)
            .map_err(|e| ApiError::field(field, format!("is a string that is not JSON: {e}")))?,
        other => other.clone(),
    };
    if !schema.is_object() && !schema.is_boolean() {
        return Err(ApiError::field(
            field,
            "must be a JSON schema (or its JSON text), as {\"type\": \"object\"}",
        ));
    }
    Ok(schema)
}

/// Puts the request's `constraint` into its merged `extra_args` under
/// [`KEY`], or checks and normalizes the one the client put there itself;
/// both at once is refused. Returns the field a refusal by the plugins'
/// check should name: where the constraint came from, else `extra_args`.
pub fn attach(
    extra_args: &mut Option<Value>,
    constraint: Option<Constraint>,
    sampling: &SamplingRequest,
) -> Result<String, ApiError> {
    // A `null` there asks for nothing, as everywhere else.
    let sets = |v: Option<&Value>| v.is_some_and(|v| !v.is_null());
    let own = if sets(sampling.vllm_xargs.as_ref().and_then(|x| x.get(KEY))) {
        Some("vllm_xargs")
    } else if sets(sampling.extra_args.as_ref().and_then(|e| e.get(KEY))) {
        Some("extra_args")
    } else {
        None
    };
    if constraint.is_none() && own.is_none() {
        if let Some(Value::Object(args)) = extra_args {
            args.remove(KEY);
        }
        return Ok("extra_args".into());
    }
    let args = match extra_args.get_or_insert_with(|| Value::Object(Map::new())) {
        Value::Object(args) => args,
        // Only a constraint from a field gets here: `own` is in an object.
        _ => {
            let field = constraint.as_ref().map_or("extra_args", |c| c.field);
            return Err(ApiError::field(
                "extra_args",
                format!("must be an object to carry the constraint `{field}` asks for"),
            ));
        }
    };
    let (field, value) = match (constraint, own) {
        (Some(c), Some(own)) => {
            return Err(ApiError::field(
                c.field,
                format!(
                "`{own}.{KEY}` sets a structured-output constraint too; send only one of the two"
            ),
            ))
        }
        (Some(c), None) => (c.field.to_string(), c.value),
        (None, Some(own)) => {
            let field = format!("{own}.{KEY}");
            let value = outputs_object(args.get(KEY).unwrap_or(&Value::Null), &field)?;
            (own.to_string(), value)
        }
        (None, None) => return Ok("extra_args".into()),
    };
    args.insert(KEY.into(), value);
    if let Some(args) = extra_args {
        limits::check_nesting(&field, args)?;
    }
    Ok(field)
}

impl AppState {
    /// Puts `constraint` into `params.extra_args` ([`attach`]), then runs
    /// the plugins' [`RequestCheck`] on the final `extra_args` (none: no
    /// check); the last step before a request is queued.
    pub async fn constrain(
        &self,
        params: &mut SamplingParams,
        constraint: Option<Constraint>,
        sampling: &SamplingRequest,
    ) -> Result<(), ApiError> {
        let field = attach(&mut params.extra_args, constraint, sampling)?;
        run_check(self.check.clone(), params.extra_args.as_ref(), &field).await
    }
}

/// Runs `check` on `extra_args` on a blocking thread: compiling a grammar
/// may take milliseconds the HTTP runtime should not wait on.
async fn run_check(
    check: Option<Arc<dyn RequestCheck>>,
    extra_args: Option<&Value>,
    field: &str,
) -> Result<(), ApiError> {
    let (Some(check), Some(args)) = (check, extra_args) else {
        return Ok(());
    };
    let args = args.clone();
    tokio::task::spawn_blocking(move || check.check(Some(&args)))
        .await
        .map_err(|_| ApiError::internal("the plugins' check of the request's extra_args panicked"))?
        .map_err(|why| ApiError::bad_request(Some(field.to_string()), why))
}

/// A client's name cut to a length fit for an error message.
fn clip(name: &str) -> String {
    name.chars().take(IGNORED_NAME_CHARS).collect()
}

#[cfg(test)]
#[path = "structured_tests.rs"]
mod tests;
