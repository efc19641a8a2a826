//! What Hugging Face keeps next to tokenizer.json: tokenizer_config.json
//! (the BOS / EOS / UNK / PAD token strings and the chat template) and, in
//! newer checkpoints, the template on its own in chat_template.jinja.

use std::path::{Path, PathBuf};

use serde_json::Value as Json;

use super::error::TokenizerError;

/// The config file's name.
pub(crate) const CONFIG_FILE: &str = "tokenizer_config.json";
/// The separate template file, preferred over the config's `chat_template`.
const TEMPLATE_FILE: &str = "chat_template.jinja";

/// The parts of tokenizer_config.json the engine uses; all optional.
#[derive(Clone, Debug, Default)]
pub(crate) struct HfTokenizerConfig {
    /// `bos_token`.
    pub bos_token: Option<String>,
    /// `eos_token`.
    pub eos_token: Option<String>,
    /// `unk_token`.
    pub unk_token: Option<String>,
    /// `pad_token`.
    pub pad_token: Option<String>,
    /// The chat template.
    pub chat_template: Option<String>,
    /// Where the template was looked for, for the "no chat template" error.
    pub where_looked: String,
}

impl HfTokenizerConfig {
    /// Reads the files in `dir`; missing files give an empty config.
    pub fn read(dir: &Path) -> Result<HfTokenizerConfig, TokenizerError> {
        let config_path = dir.join(CONFIG_FILE);
        let template_path = dir.join(TEMPLATE_FILE);
        let mut config = match read_optional(&config_path)? {
            Some(text) => parse(&config_path, &text)?,
            None => HfTokenizerConfig::default(),
        };
        if let Some(template) = read_optional(&template_path)? {
            config.chat_template = Some(template);
        }
        config.where_looked = format!(
            "{} and no `chat_template` in {}",
            template_path.display(),
            config_path.display()
        );
        Ok(config)
    }
}

/// The file's text, or `None` when it does not exist.
fn read_optional(path: &Path) -> Result<Option<String>, TokenizerError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizerError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn parse(path: &Path, text: &str) -> Result<HfTokenizerConfig, TokenizerError> {
    let invalid = |reason: String| TokenizerError::Invalid {
        path: PathBuf::from(path),
        reason,
    };
    let json: Json =
        serde_json::from_str(text).map_err(|e| invalid(format!("not valid JSON: {e}")))?;
    let token = |key: &str| -> Result<Option<String>, TokenizerError> {
        match json.get(key) {
            None | Some(Json::Null) => Ok(None),
            Some(Json::String(s)) => Ok(Some(s.clone())),
            // An AddedToken written out as an object.
            Some(Json::Object(o)) => match o.get("content") {
                Some(Json::String(s)) => Ok(Some(s.clone())),
                _ => Err(invalid(format!(
                    "`{key}` is an object without a string `content`"
                ))),
            },
            Some(other) => Err(invalid(format!("`{key}` must be a string, found {other}"))),
        }
    };
    Ok(HfTokenizerConfig {
        bos_token: token("bos_token")?,
        eos_token: token("eos_token")?,
        unk_token: token("unk_token")?,
        pad_token: token("pad_token")?,
        chat_template: chat_template(&json).map_err(invalid)?,
        where_looked: String::new(),
    })
}

/// `chat_template`: a string, or a list of `{name, template}` of which the
/// one named `default` is the chat template.
fn chat_template(json: &Json) -> Result<Option<String>, String> {
    match json.get("chat_template") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Array(items)) => {
            let named = |item: &Json| match (item.get("name"), item.get("template")) {
                (Some(Json::String(n)), Some(Json::String(t))) => Some((n.clone(), t.clone())),
                _ => None,
            };
            let templates = items.iter().map(named).collect::<Option<Vec<_>>>().ok_or_else(|| {
                "`chat_template` is a list whose items are not all {\"name\": .., \"template\": ..}".to_string()
            })?;
            Ok(templates
                .into_iter()
                .find(|(n, _)| n == "default")
                .map(|(_, t)| t))
        }
        Some(other) => Err(format!(
            "`chat_template` must be a string or a list, found {other}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_with(files: &[(&str, &str)]) -> Result<HfTokenizerConfig, TokenizerError> {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        HfTokenizerConfig::read(dir.path())
    }

    #[test]
    fn reads_strings_and_added_token_objects() {
        let c = read_with(&[(
            CONFIG_FILE,
            r#"{"bos_token": {"content": "<s>", "special": true}, "eos_token": "</s>", "pad_token": null,
                "chat_template": "{{ messages }}"}"#,
        )])
        .unwrap();
        assert_eq!(c.bos_token.as_deref(), Some("<s>"));
        assert_eq!(c.eos_token.as_deref(), Some("</s>"));
        assert_eq!(c.pad_token, None);
        assert_eq!(c.chat_template.as_deref(), Some("{{ messages }}"));
    }

    #[test]
    fn template_file_and_named_templates() {
        let c = read_with(&[
            (CONFIG_FILE, r#"{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}"#),
        ])
        .unwrap();
        assert_eq!(c.chat_template.as_deref(), Some("D"));
        let c = read_with(&[
            (CONFIG_FILE, r#"{"chat_template": "old"}"#),
            (TEMPLATE_FILE, "new"),
        ])
        .unwrap();
        assert_eq!(c.chat_template.as_deref(), Some("new"));
        let c = read_with(&[]).unwrap();
        assert!(c.chat_template.is_none() && c.where_looked.contains(TEMPLATE_FILE));
    }

    #[test]
    fn malformed_config_names_the_file_and_key() {
        let err = read_with(&[(CONFIG_FILE, "{not json")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(CONFIG_FILE) && err.contains("not valid JSON"),
            "{err}"
        );
        let err = read_with(&[(CONFIG_FILE, r#"{"eos_token": 7}"#)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("`eos_token`"), "{err}");
    }
}
