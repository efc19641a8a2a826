//! A minimal GGUF v2/v3 writer: builds files for tests and fixtures (tiny
//! synthetic models, deliberately corrupted variants) and can save any
//! [`ModelWeights`] as a llama GGUF that [`super::GgufFile`] reads back.

use super::{ggml_type_id, Value, DEFAULT_ALIGNMENT};
use crate::model::ModelWeights;

/// One tensor to write: GGML type id, `ne` (innermost first) and raw bytes.
#[derive(Clone, Debug)]
struct TensorEntry {
    name: String,
    type_id: u32,
    ne: Vec<u64>,
    data: Vec<u8>,
}

/// Collects metadata and tensors, then serialises them with
/// [`GgufWriter::to_bytes`]. The writer checks nothing, so tests can write
/// invalid files on purpose.
#[derive(Clone, Debug, Default)]
pub struct GgufWriter {
    version: u32,
    kvs: Vec<(String, Value)>,
    tensors: Vec<TensorEntry>,
}

/// The GGUF value type id of `v`.
fn value_type(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// Writes `v`'s payload (without its type id). An array's element type is
/// its first element's (u8 for an empty array).
fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend(x.to_le_bytes()),
        Value::U16(x) => out.extend(x.to_le_bytes()),
        Value::I16(x) => out.extend(x.to_le_bytes()),
        Value::U32(x) => out.extend(x.to_le_bytes()),
        Value::I32(x) => out.extend(x.to_le_bytes()),
        Value::U64(x) => out.extend(x.to_le_bytes()),
        Value::I64(x) => out.extend(x.to_le_bytes()),
        Value::F32(x) => out.extend(x.to_le_bytes()),
        Value::F64(x) => out.extend(x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_str(out, s),
        Value::Array(items) => {
            out.extend(items.first().map_or(0, value_type).to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
    }
}

impl GgufWriter {
    /// An empty file of GGUF `version` (2 and 3 share one layout).
    pub fn new(version: u32) -> GgufWriter {
        GgufWriter {
            version,
            ..GgufWriter::default()
        }
    }

    /// Adds metadata `key = value`.
    pub fn kv(&mut self, key: &str, value: Value) -> &mut GgufWriter {
        self.kvs.push((key.into(), value));
        self
    }

    /// Adds a tensor of GGML type `type_id`, shape `ne` (innermost first).
    pub fn tensor(
        &mut self,
        name: &str,
        type_id: u32,
        ne: &[u64],
        data: Vec<u8>,
    ) -> &mut GgufWriter {
        self.tensors.push(TensorEntry {
            name: name.into(),
            type_id,
            ne: ne.to_vec(),
            data,
        });
        self
    }

    fn alignment(&self) -> u64 {
        self.kvs
            .iter()
            .find(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| v.as_u64())
            .filter(|a| a.is_power_of_two())
            .unwrap_or(DEFAULT_ALIGNMENT)
    }

    /// The file's bytes: header, metadata, tensor infos, then each tensor's
    /// data padded to the alignment.
    pub fn to_bytes(&self) -> Vec<u8> {
        let align = self.alignment() as usize;
        let pad = |n: usize| n.div_ceil(align) * align;
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.kvs.len() as u64).to_le_bytes());
        for (k, v) in &self.kvs {
            put_str(&mut out, k);
            out.extend(value_type(v).to_le_bytes());
            put_value(&mut out, v);
        }
        let mut offset = 0usize;
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend((t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.type_id.to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offset += pad(t.data.len());
        }
        out.resize(pad(out.len()), 0);
        for t in &self.tensors {
            out.extend(&t.data);
            out.resize(pad(out.len()), 0);
        }
        out
    }

    /// A llama GGUF holding `w`: llama.cpp's metadata keys and tensor names,
    /// each tensor in its own type.
    pub fn from_weights(w: &ModelWeights) -> GgufWriter {
        let c = &w.config;
        let mut g = GgufWriter::new(3);
        let u32v = |x: usize| Value::U32(x as u32);
        g.kv("general.architecture", Value::String("llama".into()))
            .kv("llama.vocab_size", u32v(c.vocab_size))
            .kv("llama.embedding_length", u32v(c.hidden_size))
            .kv("llama.feed_forward_length", u32v(c.intermediate_size))
            .kv("llama.block_count", u32v(c.num_hidden_layers))
            .kv("llama.attention.head_count", u32v(c.num_attention_heads))
            .kv("llama.attention.head_count_kv", u32v(c.num_key_value_heads))
            .kv("llama.attention.key_length", u32v(c.head_dim))
            .kv("llama.rope.dimension_count", u32v(c.rope_dim))
            .kv("llama.rope.freq_base", Value::F32(c.rope_theta))
            .kv(
                "llama.attention.layer_norm_rms_epsilon",
                Value::F32(c.rms_norm_eps),
            )
            .kv("llama.context_length", u32v(c.max_position_embeddings));
        for t in w.tensors() {
            let ne: Vec<u64> = t.shape.iter().rev().map(|&d| d as u64).collect();
            g.tensor(
                &t.name,
                ggml_type_id(t.dtype),
                &ne,
                t.storage.bytes().to_vec(),
            );
        }
        g
    }
}
