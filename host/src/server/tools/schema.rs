//! A function's parameter schema as a part of the calls' schema: its
//! objects closed, and its local references (`#/$defs/...`, `#`) re-rooted
//! at the place it now sits, so they resolve there as they did in the
//! function's own schema. Only schema positions are visited: a `const`,
//! `enum` or `default` value, or a property that happens to be called
//! `properties`, is data and stays as written.

use serde_json::{Map, Value};

/// Keywords whose value is one subschema, or (`items` before 2020-12, the
/// combinators, `prefixItems`) a list of them.
const SUBSCHEMA: &[&str] = &[
    "additionalItems",
    "additionalProperties",
    "allOf",
    "anyOf",
    "contains",
    "else",
    "if",
    "items",
    "not",
    "oneOf",
    "prefixItems",
    "propertyNames",
    "then",
    "unevaluatedItems",
    "unevaluatedProperties",
];

/// Keywords whose value maps names to subschemas.
const SUBSCHEMA_MAP: &[&str] = &[
    "$defs",
    "definitions",
    "dependentSchemas",
    "patternProperties",
    "properties",
];

/// `parameters` placed at JSON pointer `at` of the calls' schema: every
/// object schema that declares properties and says nothing of others takes
/// no others (`additionalProperties: false`, as OpenAI's strict mode
/// reads a schema), and every local `$ref` points under `at`.
pub(super) fn embed(parameters: &Value, at: &str) -> Value {
    let mut schema = parameters.clone();
    each_schema(&mut schema, &mut |obj| {
        if obj.contains_key("properties") && !obj.contains_key("additionalProperties") {
            obj.insert("additionalProperties".into(), false.into());
        }
        if let Some(Value::String(target)) = obj.get_mut("$ref") {
            let local = target
                .strip_prefix('#')
                .filter(|p| p.is_empty() || p.starts_with('/'));
            if let Some(pointer) = local {
                *target = format!("#{at}{pointer}");
            }
        }
    });
    schema
}

/// Calls `f` on `schema` and every subschema in it, outermost first.
/// (Depth is bounded by the JSON parser's nesting limit on the request.)
fn each_schema(schema: &mut Value, f: &mut dyn FnMut(&mut Map<String, Value>)) {
    let Value::Object(obj) = schema else {
        return;
    };
    f(obj);
    for (key, value) in obj.iter_mut() {
        if SUBSCHEMA.contains(&key.as_str()) {
            match value {
                Value::Array(list) => list.iter_mut().for_each(|s| each_schema(s, f)),
                one => each_schema(one, f),
            }
        } else if SUBSCHEMA_MAP.contains(&key.as_str()) {
            if let Value::Object(map) = value {
                map.values_mut().for_each(|s| each_schema(s, f));
            }
        }
    }
}
