//! The live requests a per-step plugin has been told about, shared by the
//! logits processors and the sampler: requests and their `extra_args` are
//! announced once (when they enter the batch), so per-step traffic stays
//! ids and numbers, and a recreated instance (after a fault) is told every
//! live request again.

use std::collections::BTreeMap;

/// What one plugin still has to be told before its next call.
#[derive(Debug, Default)]
pub(super) struct Pending {
    /// Requests that entered the batch since the last call.
    pub added_ids: Vec<u32>,
    /// Their `extra_args` as JSON (`null` when none).
    pub added_extra_args: Vec<String>,
    /// Requests that left the batch since the last call.
    pub removed_ids: Vec<u32>,
    /// The plugin's fault count when it was last told; a change means the
    /// instance was recreated and knows nothing.
    faults_seen: u64,
}

impl Pending {
    /// Before a call: if the instance was recreated since (`faults` moved),
    /// replace the news with every live request it is `told` of.
    pub fn resync(&mut self, faults: u64, live: &LiveRequests, told: impl Fn(u32) -> bool) {
        if faults != self.faults_seen {
            self.faults_seen = faults;
            self.clear();
            for (&id, json) in live.0.iter().filter(|(&id, _)| told(id)) {
                self.added_ids.push(id);
                self.added_extra_args.push(json.clone());
            }
        }
    }

    /// Whether there is nothing to tell.
    pub fn is_empty(&self) -> bool {
        self.added_ids.is_empty() && self.removed_ids.is_empty()
    }

    /// After a call: the plugin has been told.
    pub fn clear(&mut self) {
        self.added_ids.clear();
        self.added_extra_args.clear();
        self.removed_ids.clear();
    }
}

/// A request's `extra_args` as the plugins read them: JSON, `null` when
/// none.
pub(super) fn extra_args_json(extra_args: Option<&serde_json::Value>) -> String {
    extra_args.map_or_else(|| "null".to_string(), |v| v.to_string())
}

/// Live requests and their `extra_args` as JSON.
#[derive(Debug, Default)]
pub(super) struct LiveRequests(BTreeMap<u32, String>);

impl LiveRequests {
    /// A request entered the batch with `json` ([`extra_args_json`]):
    /// recorded, and queued for each of `plugins`.
    pub fn add<'a>(
        &mut self,
        id: u32,
        json: String,
        plugins: impl Iterator<Item = &'a mut Pending>,
    ) {
        for p in plugins {
            p.added_ids.push(id);
            p.added_extra_args.push(json.clone());
        }
        self.0.insert(id, json);
    }

    /// A request left the batch: queued for each of `plugins` if it was live.
    pub fn remove<'a>(&mut self, id: u32, plugins: impl Iterator<Item = &'a mut Pending>) {
        if self.0.remove(&id).is_some() {
            for p in plugins {
                p.removed_ids.push(id);
            }
        }
    }
}
