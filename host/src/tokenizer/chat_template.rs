//! Chat templates: the Jinja template a model ships (GGUF
//! `tokenizer.chat_template`, or tokenizer_config.json) that turns a list of
//! messages into the prompt text.
//!
//! Rendered with minijinja set up like Hugging Face transformers' renderer:
//! `trim_blocks` and `lstrip_blocks` on, loop controls, Python string methods
//! (`.strip()`, `.startswith()`, …) through minijinja-contrib's pycompat, a
//! `raise_exception(message)` function, and the variables `messages`,
//! `add_generation_prompt`, `bos_token` and `eos_token`, beside the
//! caller's own (vLLM's `chat_template_kwargs`, such as `enable_thinking`).

use minijinja::{context, Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

use super::error::TokenizerError;

/// Name of the one template in the environment (shown in error locations).
const TEMPLATE_NAME: &str = "chat_template";

/// The variables the renderer sets itself, which a caller's may not.
pub const RESERVED_VARIABLES: &[&str] = &[
    "messages",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
];

/// A caller's template variables, by name (vLLM's `chat_template_kwargs`).
pub type TemplateKwargs = serde_json::Map<String, serde_json::Value>;

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` (templates may accept others).
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message from `role` with `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template with the model's BOS and EOS token strings.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source`; a syntax error is a [`TokenizerError::ChatTemplate`]
    /// naming the line.
    pub fn new(
        source: &str,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<ChatTemplate, TokenizerError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(template_error)?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    /// The prompt for `messages`; with `add_generation_prompt` it ends with
    /// the header of the assistant's reply. Errors raised by the template
    /// (`raise_exception`, a bad operation) are [`TokenizerError::ChatTemplate`].
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        self.render_with(messages, add_generation_prompt, &TemplateKwargs::new())
    }

    /// [`render`](Self::render) with the caller's variables `kwargs` set
    /// too; those the renderer sets itself ([`RESERVED_VARIABLES`]) keep
    /// the renderer's values.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &TemplateKwargs,
    ) -> Result<String, TokenizerError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(template_error)?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
                ..minijinja::Value::from_serialize(kwargs)
            })
            .map_err(template_error)
    }
}

/// `raise_exception(message)`, as transformers provides it to templates
/// (they call it to reject, for example, a conversation without alternation).
fn raise_exception(message: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

fn template_error(e: Error) -> TokenizerError {
    TokenizerError::ChatTemplate(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str =
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
                          {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    #[test]
    fn renders_messages_and_generation_prompt() {
        let t = ChatTemplate::new(CHATML, "<s>", "</s>").unwrap();
        let msgs = [ChatMessage::new("user", "Hi")];
        assert_eq!(
            t.render(&msgs, false).unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n"
        );
        assert_eq!(
            t.render(&msgs, true).unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn the_callers_variables_reach_the_template_and_cannot_replace_the_renderers() {
        let t = ChatTemplate::new(
            "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}\
             {{ messages[0].content }}{{ bos_token }}",
            "<s>",
            "</s>",
        )
        .unwrap();
        let msgs = [ChatMessage::new("user", "hi")];
        let kwargs = |v: serde_json::Value| v.as_object().unwrap().clone();
        let off = kwargs(serde_json::json!({"enable_thinking": false}));
        assert_eq!(
            t.render_with(&msgs, false, &off).unwrap(),
            "/no_think hi<s>"
        );
        assert_eq!(t.render(&msgs, false).unwrap(), "hi<s>");
        let on = kwargs(serde_json::json!({"enable_thinking": true, "unused": [1, 2]}));
        assert_eq!(t.render_with(&msgs, false, &on).unwrap(), "hi<s>");
        let reserved = kwargs(serde_json::json!({"bos_token": "X", "messages": []}));
        assert_eq!(t.render_with(&msgs, false, &reserved).unwrap(), "hi<s>");
    }

    #[test]
    fn python_string_methods_and_special_token_variables() {
        let t = ChatTemplate::new(
            "{{ bos_token }}{{ messages[0].content.strip().upper() }}{{ eos_token }}",
            "<s>",
            "</s>",
        )
        .unwrap();
        assert_eq!(
            t.render(&[ChatMessage::new("user", "  hi ")], false)
                .unwrap(),
            "<s>HI</s>"
        );
    }

    #[test]
    fn trim_and_lstrip_blocks_like_transformers() {
        // With trim_blocks the newline after a block tag goes; with
        // lstrip_blocks the indentation before it goes.
        let t = ChatTemplate::new("{% for m in messages %}\n    {% if true %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}", "", "")
            .unwrap();
        assert_eq!(
            t.render(
                &[ChatMessage::new("user", "a"), ChatMessage::new("user", "b")],
                false
            )
            .unwrap(),
            "[a]\n[b]\n"
        );
    }

    #[test]
    fn loop_controls_are_available() {
        let t = ChatTemplate::new("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}", "", "")
            .unwrap();
        assert_eq!(
            t.render(
                &[ChatMessage::new("user", "a"), ChatMessage::new("user", "b")],
                false
            )
            .unwrap(),
            "a"
        );
    }

    #[test]
    fn syntax_errors_and_raised_exceptions_are_clear_errors() {
        let err = ChatTemplate::new("{% for m in messages %}", "", "")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("chat template error") && err.contains("chat_template:1"),
            "{err}"
        );

        let t = ChatTemplate::new(
            "{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}",
            "",
            "",
        )
        .unwrap();
        let err = t
            .render(&[ChatMessage::new("user", "a")], false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("system first"), "{err}");
    }
}
