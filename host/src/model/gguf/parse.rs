//! The GGUF binary layout (v2/v3): header, metadata key/values and tensor
//! infos, read from a byte slice with every length checked against the
//! bytes that remain, so a corrupt length can neither panic nor allocate
//! more than the file could hold.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::{GgufError, Value};

/// Arrays nested deeper than this are rejected: real files use at most
/// one level, and the bound keeps a crafted file from exhausting the stack.
const MAX_ARRAY_DEPTH: usize = 8;

/// ggml's `GGML_MAX_DIMS`.
const MAX_DIMS: u32 = 4;

/// A tensor info as stored, before its type is interpreted.
#[derive(Debug)]
pub(super) struct RawTensorInfo {
    pub name: String,
    pub ne: Vec<u64>,
    pub type_id: u32,
    pub offset: u64,
}

/// Everything before the tensor data.
#[derive(Debug)]
pub(super) struct Header {
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<RawTensorInfo>,
    /// Byte offset just past the last tensor info (before alignment padding).
    pub end: usize,
}

/// A position in the file's bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn truncated(&self, what: &str, needed: u64) -> GgufError {
        GgufError::Truncated {
            path: self.path.to_path_buf(),
            what: what.to_string(),
            offset: self.pos as u64,
            needed,
            len: self.buf.len() as u64,
        }
    }

    fn malformed(&self, context: &str, reason: String) -> GgufError {
        GgufError::Malformed {
            path: self.path.to_path_buf(),
            offset: self.pos as u64,
            context: context.to_string(),
            reason,
        }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(self.truncated(what, n as u64));
        }
        let bytes = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    fn u8(&mut self, what: &str) -> Result<u8, GgufError> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count that must fit in the remaining bytes when each item takes at
    /// least `min_item_bytes`.
    fn count(&mut self, what: &str, min_item_bytes: usize) -> Result<usize, GgufError> {
        let start = self.pos;
        let n = self.u64(what)?;
        let fits = (self.remaining() / min_item_bytes.max(1)) as u64;
        if n > fits {
            self.pos = start;
            let needed = n.saturating_mul(min_item_bytes as u64);
            return Err(self.truncated(&format!("{what} ({n} items)"), needed));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.count(what, 1)?;
        Ok(String::from_utf8_lossy(self.take(len, what)?).into_owned())
    }

    fn value(&mut self, type_id: u32, key: &str, depth: usize) -> Result<Value, GgufError> {
        let what = format!("value of `{key}`");
        Ok(match type_id {
            0 => Value::U8(self.u8(&what)?),
            1 => Value::I8(i8::from_le_bytes(self.array(&what)?)),
            2 => Value::U16(u16::from_le_bytes(self.array(&what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(&what)?)),
            4 => Value::U32(self.u32(&what)?),
            5 => Value::I32(i32::from_le_bytes(self.array(&what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(&what)?)),
            7 => match self.u8(&what)? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => {
                    self.pos -= 1;
                    return Err(self.malformed(&what, format!("bool byte is {b}, expected 0 or 1")));
                }
            },
            8 => Value::String(self.string(&what)?),
            9 => self.array_value(key, depth)?,
            10 => Value::U64(self.u64(&what)?),
            11 => Value::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(&what)?)),
            t => {
                return Err(self.malformed(&what, format!("unknown value type {t} (valid: 0..=12)")))
            }
        })
    }

    fn array_value(&mut self, key: &str, depth: usize) -> Result<Value, GgufError> {
        let what = format!("array `{key}`");
        if depth >= MAX_ARRAY_DEPTH {
            return Err(self.malformed(
                &what,
                format!("arrays nested deeper than {MAX_ARRAY_DEPTH}"),
            ));
        }
        let elem_type = self.u32(&what)?;
        let min_bytes = min_value_bytes(elem_type)
            .ok_or_else(|| self.malformed(&what, format!("unknown element type {elem_type}")))?;
        let n = self.count(&what, min_bytes)?;
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            items.push(self.value(elem_type, key, depth + 1)?);
        }
        Ok(Value::Array(items))
    }

    fn tensor_info(&mut self) -> Result<RawTensorInfo, GgufError> {
        let name = self.string("tensor name")?;
        let what = format!("info of tensor `{name}`");
        let n_dims = self.u32(&what)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            self.pos -= 4;
            return Err(self.malformed(
                &what,
                format!("{n_dims} dimensions (valid: 1..={MAX_DIMS})"),
            ));
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            ne.push(self.u64(&what)?);
        }
        let type_id = self.u32(&what)?;
        let offset = self.u64(&what)?;
        Ok(RawTensorInfo {
            name,
            ne,
            type_id,
            offset,
        })
    }
}

/// The fewest bytes one value of GGUF type `type_id` can occupy, or `None`
/// for an unknown type.
fn min_value_bytes(type_id: u32) -> Option<usize> {
    Some(match type_id {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => return None,
    })
}

/// Smallest possible tensor info: empty name, one dimension, type, offset.
const MIN_TENSOR_INFO_BYTES: usize = 8 + 4 + 8 + 4 + 8;
/// Smallest possible key/value: empty key, type, one-byte value.
const MIN_KV_BYTES: usize = 8 + 4 + 1;

/// Parses the header, metadata and tensor infos of the GGUF bytes `buf`.
pub(super) fn parse_header(buf: &[u8], path: &Path) -> Result<Header, GgufError> {
    let mut c = Cursor { buf, pos: 0, path };
    let magic: [u8; 4] = c.array("magic")?;
    if &magic != b"GGUF" {
        return Err(GgufError::BadMagic {
            path: PathBuf::from(path),
            found: magic,
        });
    }
    let version = c.u32("version")?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion {
            path: path.to_path_buf(),
            version,
        });
    }
    // Tensor infos come after the metadata, so the tensor count can only be
    // bounded once the metadata is read.
    let tensor_count = c.u64("tensor count")?;
    let kv_count = c.count("metadata count", MIN_KV_BYTES)?;
    let mut metadata = BTreeMap::new();
    for _ in 0..kv_count {
        let key_pos = c.pos;
        let key = c.string("metadata key")?;
        let type_id = c.u32(&format!("type of `{key}`"))?;
        let value = c.value(type_id, &key, 0)?;
        if metadata.insert(key.clone(), value).is_some() {
            c.pos = key_pos;
            return Err(c.malformed("metadata", format!("key `{key}` appears twice")));
        }
    }
    let fits = (c.remaining() / MIN_TENSOR_INFO_BYTES) as u64;
    if tensor_count > fits {
        let needed = tensor_count.saturating_mul(MIN_TENSOR_INFO_BYTES as u64);
        return Err(c.truncated(&format!("tensor infos ({tensor_count} tensors)"), needed));
    }
    let mut tensors = Vec::with_capacity(tensor_count as usize);
    for _ in 0..tensor_count {
        tensors.push(c.tensor_info()?);
    }
    Ok(Header {
        version,
        metadata,
        tensors,
        end: c.pos,
    })
}
