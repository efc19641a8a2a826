//! The stored responses: what `GET /v1/responses/{id}` returns,
//! `previous_response_id` continues, and cancel reaches. In memory,
//! bounded in number (`server.max_stored_responses`) and in bytes of text
//! (`server.max_stored_response_bytes`); past either the oldest go.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use tokio::sync::watch;

use super::object::{Record, Status};
use crate::server::tools::ToolCall;
use crate::tokenizer::ChatMessage;

/// One stored response.
struct Entry {
    record: Record,
    /// The conversation it answered (instructions excluded, as OpenAI
    /// does not carry them over to a continuation).
    conversation: Vec<ChatMessage>,
    /// Set to `true` to cancel it while it runs; `None` once it ended.
    cancel: Option<watch::Sender<bool>>,
    bytes: usize,
}

impl Entry {
    fn measure(&mut self) {
        self.bytes = self.record.text_bytes()
            + self
                .conversation
                .iter()
                .map(|m| m.content.len() + m.role.len())
                .sum::<usize>();
    }
}

#[derive(Default)]
struct Inner {
    entries: HashMap<String, Entry>,
    /// Ids, oldest first.
    order: VecDeque<String>,
    bytes: usize,
}

/// The bounded store.
pub struct Store {
    inner: Mutex<Inner>,
    max_count: usize,
    max_bytes: usize,
}

/// Why a stored response cannot be continued or cancelled.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No such id (never stored, evicted or deleted).
    NotFound,
    /// It is in a state that does not allow it.
    Status(Status),
}

impl Store {
    /// An empty store holding at most `max_count` responses and
    /// `max_bytes` bytes of their text.
    pub fn new(max_count: usize, max_bytes: usize) -> Store {
        Store {
            inner: Mutex::new(Inner::default()),
            max_count,
            max_bytes,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Every update leaves the maps consistent before it could panic.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stores a response that is starting; `cancel` reaches its run.
    pub fn insert(
        &self,
        record: Record,
        conversation: Vec<ChatMessage>,
        cancel: watch::Sender<bool>,
    ) {
        let mut inner = self.lock();
        let id = record.id.clone();
        let mut entry = Entry {
            record,
            conversation,
            cancel: Some(cancel),
            bytes: 0,
        };
        entry.measure();
        inner.bytes += entry.bytes;
        inner.entries.insert(id.clone(), entry);
        inner.order.push_back(id);
        self.evict(&mut inner);
    }

    /// Records how a response ended. A response cancelled meanwhile stays
    /// cancelled (with what it had generated).
    pub fn finish(&self, mut record: Record) {
        let mut inner = self.lock();
        let inner = &mut *inner;
        let Some(entry) = inner.entries.get_mut(&record.id) else {
            return; // evicted or deleted while it ran
        };
        if entry.record.status == Status::Cancelled {
            record.status = Status::Cancelled;
        }
        inner.bytes -= entry.bytes;
        entry.record = record;
        entry.cancel = None;
        entry.measure();
        inner.bytes += entry.bytes;
        self.evict(inner);
    }

    /// Drops the oldest responses until both bounds hold.
    fn evict(&self, inner: &mut Inner) {
        while inner.entries.len() > self.max_count || inner.bytes > self.max_bytes {
            let Some(id) = inner.order.pop_front() else {
                break;
            };
            if let Some(entry) = inner.entries.remove(&id) {
                inner.bytes -= entry.bytes;
            }
        }
    }

    /// A stored response as it stands.
    pub fn get(&self, id: &str) -> Option<Record> {
        self.lock().entries.get(id).map(|e| e.record.clone())
    }

    /// The conversation a continuation of `id` starts from: what it
    /// answered, then its answer; and the functions that answer calls,
    /// whose outputs the continuation may give. Only a finished (completed
    /// or incomplete) response can be continued.
    pub fn conversation(&self, id: &str) -> Result<(Vec<ChatMessage>, Vec<ToolCall>), Refusal> {
        let inner = self.lock();
        let entry = inner.entries.get(id).ok_or(Refusal::NotFound)?;
        match entry.record.status {
            Status::Completed | Status::Incomplete => {
                let mut messages = entry.conversation.clone();
                messages.push(ChatMessage::new("assistant", entry.record.text.clone()));
                Ok((messages, entry.record.calls.clone()))
            }
            other => Err(Refusal::Status(other)),
        }
    }

    /// Cancels a running response: it is marked cancelled at once and its
    /// run stops at its next token (aborting its engine request).
    pub fn cancel(&self, id: &str) -> Result<Record, Refusal> {
        let mut inner = self.lock();
        let entry = inner.entries.get_mut(id).ok_or(Refusal::NotFound)?;
        match (&entry.cancel, entry.record.status) {
            (Some(cancel), Status::InProgress) => {
                let _ = cancel.send(true);
                entry.record.status = Status::Cancelled;
                Ok(entry.record.clone())
            }
            (_, status) => Err(Refusal::Status(status)),
        }
    }

    /// Removes a response (cancelling it if it runs); whether it existed.
    pub fn delete(&self, id: &str) -> bool {
        let mut inner = self.lock();
        let Some(entry) = inner.entries.remove(id) else {
            return false;
        };
        if let Some(cancel) = &entry.cancel {
            let _ = cancel.send(true);
        }
        inner.bytes -= entry.bytes;
        inner.order.retain(|o| o != id);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::super::object::Echo;
    use super::*;

    fn record(id: &str, text: &str) -> Record {
        Record {
            id: id.into(),
            created_at: 0,
            status: Status::InProgress,
            model: "m".into(),
            message_id: format!("msg_{id}"),
            text: text.into(),
            calls: Vec::new(),
            logprobs: Vec::new(),
            usage: None,
            error: None,
            echo: Echo::default(),
        }
    }

    fn insert(store: &Store, id: &str, said: &str) -> watch::Receiver<bool> {
        let (tx, rx) = watch::channel(false);
        store.insert(record(id, ""), vec![ChatMessage::new("user", said)], tx);
        rx
    }

    fn finished(id: &str, text: &str) -> Record {
        Record {
            status: Status::Completed,
            ..record(id, text)
        }
    }

    #[test]
    fn the_oldest_go_past_the_count() {
        let store = Store::new(2, 1 << 20);
        for id in ["a", "b", "c"] {
            insert(&store, id, "hi");
        }
        assert!(store.get("a").is_none());
        assert!(store.get("b").is_some() && store.get("c").is_some());
    }

    #[test]
    fn the_oldest_go_past_the_bytes() {
        // "user" + 6 bytes each: 10 bytes a conversation.
        let store = Store::new(100, 25);
        insert(&store, "a", "123456");
        insert(&store, "b", "123456");
        assert!(store.get("a").is_some());
        // Its answer brings b to 20 bytes: a goes.
        store.finish(finished("b", "0123456789"));
        assert!(store.get("a").is_none());
        assert_eq!(store.get("b").unwrap().text, "0123456789");
        // Nothing is stored at all with a count of 0.
        let none = Store::new(0, 1 << 20);
        insert(&none, "a", "x");
        assert!(none.get("a").is_none());
    }

    #[test]
    fn a_finished_response_continues_with_its_answer() {
        let store = Store::new(10, 1 << 20);
        insert(&store, "a", "Hi");
        assert_eq!(
            store.conversation("a"),
            Err(Refusal::Status(Status::InProgress))
        );
        store.finish(finished("a", "Hello!"));
        let c = store.conversation("a").unwrap();
        let said = vec![
            ChatMessage::new("user", "Hi"),
            ChatMessage::new("assistant", "Hello!"),
        ];
        assert_eq!(c, (said, Vec::new()));
        assert_eq!(store.conversation("zz"), Err(Refusal::NotFound));
        // An answer that calls functions hands its calls on, for the
        // outputs that answer them.
        insert(&store, "b", "Weather?");
        let call = ToolCall {
            id: "call_1".into(),
            name: "get_weather".into(),
            arguments: r#"{"city":"Paris"}"#.into(),
        };
        let text = r#"{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}}]}"#;
        store.finish(Record {
            calls: vec![call.clone()],
            ..finished("b", text)
        });
        let (c, calls) = store.conversation("b").unwrap();
        assert_eq!(c[1], ChatMessage::new("assistant", text));
        assert_eq!(calls, vec![call]);
    }

    #[test]
    fn cancel_reaches_a_running_response_only() {
        let store = Store::new(10, 1 << 20);
        let rx = insert(&store, "a", "Hi");
        assert_eq!(store.cancel("a").unwrap().status, Status::Cancelled);
        assert!(*rx.borrow());
        // Its run's last word does not undo the cancel.
        store.finish(finished("a", "partial"));
        let r = store.get("a").unwrap();
        assert_eq!((r.status, r.text.as_str()), (Status::Cancelled, "partial"));
        assert_eq!(
            store.cancel("a").unwrap_err(),
            Refusal::Status(Status::Cancelled)
        );
        assert_eq!(store.cancel("b").unwrap_err(), Refusal::NotFound);
        assert!(store.delete("a") && !store.delete("a"));
        assert!(store.get("a").is_none());
    }
}
