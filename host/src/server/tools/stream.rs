//! Reading the call format as it is written, so a streamed call's
//! arguments reach the client token by token (as vLLM's tool parsers and
//! OpenAI stream them) rather than whole at the end.
//!
//! The answer is `{"tool_calls":[{"name":…,"arguments":{…}},…]}`,
//! constrained by the structured-output plugin, so it is always a prefix
//! of that JSON; [`CallReader`] follows its nesting byte by byte and says
//! when a call's name is known, which bytes of its arguments arrived, and
//! when it closes. The arguments are passed on as the model wrote them,
//! and [`ToolRequest::parse`] reads the whole answer with the same reader,
//! so the streamed pieces add up to the arguments the answer ends with.

use serde_json::Value;

use super::{Answer, ToolCall, ToolRequest};

/// How every call answer starts: the calls are compact JSON, so text that
/// does not start so is not a call.
pub(super) const CALLS_START: &str = r#"{"tool_calls":"#;

/// Nesting of a call object: the answer's object, its `tool_calls` list,
/// the call.
const CALL_DEPTH: usize = 3;

/// What a call answer said in a piece of text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallEvent {
    /// Call `index` begins, calling `name`.
    Begin {
        /// Its position in the answer's calls.
        index: usize,
        /// The function called.
        name: String,
    },
    /// More of call `index`'s arguments, as the model wrote them.
    Arguments {
        /// Its position in the answer's calls.
        index: usize,
        /// The next bytes of the arguments' JSON text.
        text: String,
    },
    /// Call `index` is complete.
    End {
        /// Its position in the answer's calls.
        index: usize,
    },
}

/// Which key of a call object is being read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Key {
    #[default]
    Other,
    Name,
    Arguments,
}

/// Follows an answer in the call format as it grows (see the module
/// doc). It reads structure only: the plugin has already checked that
/// the text is the format's JSON.
#[derive(Debug, Default)]
pub struct CallReader {
    /// Bytes of the text read so far.
    read: usize,
    /// Open objects and lists.
    depth: usize,
    in_string: bool,
    escaped: bool,
    /// Where the string being read in a call object began.
    string_start: usize,
    /// In a call object: past the current key's colon.
    in_value: bool,
    /// In a call object: the key whose value is being read.
    key: Key,
    /// Calls whose name was read (and announced).
    begun: usize,
    /// The index of the call being read, once its name was.
    current: Option<usize>,
    /// Arguments read before the name (the schema does not fix the order
    /// of a call's two keys), sent once the name is known.
    early: String,
    /// While the arguments are being read: where their unsent bytes begin.
    arguments_from: Option<usize>,
}

impl CallReader {
    /// Reads what `text` (the whole answer so far; earlier calls passed a
    /// prefix of it) adds, as events.
    pub fn read(&mut self, text: &str) -> Vec<CallEvent> {
        let mut events = Vec::new();
        let bytes = text.as_bytes();
        for (i, &b) in bytes.iter().enumerate().skip(self.read) {
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                    if self.depth == CALL_DEPTH {
                        self.string_read(&text[self.string_start..=i], &mut events);
                    }
                }
                continue;
            }
            match b {
                b'"' => {
                    self.in_string = true;
                    self.string_start = i;
                }
                b'{' | b'[' => {
                    self.depth += 1;
                    if self.depth == CALL_DEPTH {
                        self.current = None;
                        self.key = Key::Other;
                        self.in_value = false;
                        self.early.clear();
                    } else if self.depth == CALL_DEPTH + 1 && self.key == Key::Arguments {
                        self.arguments_from = Some(i);
                    }
                }
                b'}' | b']' => {
                    if self.depth == CALL_DEPTH + 1 && self.arguments_from.is_some() {
                        self.send_arguments(text, i + 1, &mut events);
                        self.arguments_from = None;
                        self.key = Key::Other;
                    } else if self.depth == CALL_DEPTH {
                        if let Some(index) = self.current {
                            events.push(CallEvent::End { index });
                        }
                    }
                    self.depth = self.depth.saturating_sub(1);
                }
                b':' if self.depth == CALL_DEPTH => self.in_value = true,
                b',' if self.depth == CALL_DEPTH => self.in_value = false,
                _ => {}
            }
        }
        self.read = bytes.len();
        if self.arguments_from.is_some() {
            self.send_arguments(text, bytes.len(), &mut events);
        }
        events
    }

    /// A string of a call object ended: a key, or the function's name.
    fn string_read(&mut self, json: &str, events: &mut Vec<CallEvent>) {
        let Ok(s) = serde_json::from_str::<String>(json) else {
            return;
        };
        if !self.in_value {
            self.key = match s.as_str() {
                "name" => Key::Name,
                "arguments" => Key::Arguments,
                _ => Key::Other,
            };
        } else if self.key == Key::Name && self.current.is_none() {
            let index = self.begun;
            self.begun += 1;
            self.current = Some(index);
            events.push(CallEvent::Begin { index, name: s });
            if !self.early.is_empty() {
                let text = std::mem::take(&mut self.early);
                events.push(CallEvent::Arguments { index, text });
            }
        }
    }

    /// The arguments' bytes up to `to`, sent (or kept until the name is
    /// known).
    fn send_arguments(&mut self, text: &str, to: usize, events: &mut Vec<CallEvent>) {
        let from = self.arguments_from.replace(to).unwrap_or(to);
        let piece = &text[from..to];
        if piece.is_empty() {
            return;
        }
        if let Some(index) = self.current {
            events.push(CallEvent::Arguments {
                index,
                text: piece.to_string(),
            });
        } else {
            self.early.push_str(piece);
        }
    }
}

/// The calls an answer in the call format makes, each with the arguments
/// as written: whole when the answer is, cut where the answer was cut
/// short (by `max_tokens`, say). Empty when `text` is not the format: not
/// its opening, or whole JSON of another shape.
pub(super) fn read_calls(text: &str, request_id: &str) -> Vec<ToolCall> {
    if !text.trim_start().starts_with(CALLS_START) {
        return Vec::new();
    }
    let whole_or_cut = match serde_json::from_str::<Value>(text) {
        Ok(v) => is_call_format(&v),
        Err(e) => e.is_eof(),
    };
    if !whole_or_cut {
        return Vec::new();
    }
    let mut calls: Vec<ToolCall> = Vec::new();
    for event in CallReader::default().read(text) {
        match event {
            CallEvent::Begin { index, name } => calls.push(ToolCall {
                id: call_id(request_id, index),
                name,
                arguments: String::new(),
            }),
            CallEvent::Arguments { text, .. } => {
                if let Some(c) = calls.last_mut() {
                    c.arguments.push_str(&text);
                }
            }
            CallEvent::End { .. } => {}
        }
    }
    calls
}

/// Whether whole JSON is the call format: only `tool_calls`, a non-empty
/// list of calls, each a string `name` and object `arguments`.
fn is_call_format(v: &Value) -> bool {
    let Some(obj) = v.as_object().filter(|o| o.len() == 1) else {
        return false;
    };
    let Some(calls) = obj.get("tool_calls").and_then(Value::as_array) else {
        return false;
    };
    !calls.is_empty()
        && calls
            .iter()
            .all(|c| c["name"].is_string() && c["arguments"].is_object())
}

/// The id of call `n` of a request's answer.
pub fn call_id(request_id: &str, n: usize) -> String {
    format!("call_{request_id}_{n}")
}

/// What a piece of a streamed answer under tools is, for the client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// Text to stream as content, with its tokens' logprob entries (those
    /// of any text held back before it included).
    Text {
        /// The text.
        text: String,
        /// One entry per token, as the caller passed them.
        logprobs: Vec<Value>,
    },
    /// What the calls said (nothing while it is not known yet whether the
    /// answer is text or calls), with the logprob entries of the tokens
    /// that wrote it (held until a piece writes a name or arguments, or
    /// the end).
    Calls {
        /// The calls' events.
        events: Vec<CallEvent>,
        /// One entry per token, as the caller passed them.
        logprobs: Vec<Value>,
    },
}

impl Piece {
    /// Nothing to stream yet.
    fn nothing() -> Piece {
        Piece::Calls {
            events: Vec::new(),
            logprobs: Vec::new(),
        }
    }
}

/// One choice's stream under tools: text streams as it comes; an answer
/// in the call format streams as call events, each call's name once
/// known and its arguments as they are written. Whatever is held back
/// keeps its tokens' logprob entries, so every token's entry goes out
/// once, in order, with the piece its token helped write.
#[derive(Debug, Default)]
pub struct StreamedAnswer {
    /// The answer so far, while it is (or may be) calls.
    held: String,
    /// The logprob entries of the tokens not streamed yet.
    held_logprobs: Vec<Value>,
    /// Whether the answer is text (`Some(false)`), calls (`Some(true)`),
    /// or not known yet (only whitespace, or a prefix of the calls'
    /// opening, so far).
    is_call: Option<bool>,
    reader: CallReader,
}

impl StreamedAnswer {
    /// Takes a delta's text and its tokens' logprob entries (empty when
    /// none were asked for); says what to stream now.
    pub fn push(&mut self, request: &ToolRequest, text: &str, logprobs: Vec<Value>) -> Piece {
        if !request.may_call() || self.is_call == Some(false) {
            let text = text.to_string();
            return Piece::Text { text, logprobs };
        }
        self.held.push_str(text);
        self.held_logprobs.extend(logprobs);
        if self.is_call.is_none() {
            let start = self.held.trim_start();
            if request.must_call() || start.starts_with(CALLS_START) {
                self.is_call = Some(true);
            } else if !CALLS_START.starts_with(start) {
                self.is_call = Some(false);
                let (text, logprobs) = self.held_back();
                return Piece::Text { text, logprobs };
            }
        }
        if self.is_call != Some(true) {
            return Piece::nothing();
        }
        let events = self.reader.read(&self.held);
        // The entries go with what writes a call's text (a name, arguments);
        // a piece that only closes calls leaves them for the next.
        let writes = events.iter().any(|e| !matches!(e, CallEvent::End { .. }));
        let logprobs = if writes {
            std::mem::take(&mut self.held_logprobs)
        } else {
            Vec::new()
        };
        Piece::Calls { events, logprobs }
    }

    /// Whether the answer has begun a call the client was told of.
    pub fn called(&self) -> bool {
        self.reader.begun > 0
    }

    /// The text held back so far (the whole answer while it is calls),
    /// with the logprob entries of the tokens not streamed yet.
    pub fn held_back(&mut self) -> (String, Vec<Value>) {
        (
            std::mem::take(&mut self.held),
            std::mem::take(&mut self.held_logprobs),
        )
    }

    /// At the end: the whole answer, parsed (a text answer's held-back
    /// rest, when the stream held some), and the logprob entries of the
    /// tokens not streamed yet.
    pub fn finish(&mut self, request: &ToolRequest, request_id: &str) -> (Answer, Vec<Value>) {
        let (text, logprobs) = self.held_back();
        (request.parse(&text, request_id), logprobs)
    }
}

#[cfg(test)]
mod tests;
