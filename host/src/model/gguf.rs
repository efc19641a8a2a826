//! GGUF model files (versions 2 and 3), as written by llama.cpp's
//! converters: metadata, tensor infos, and tensor data read in place from a
//! memory map.
//!
//! The file is mapped read-only; like every mmap-based loader, it assumes
//! the file is not modified while the engine runs.

mod error;
mod llama;
mod parse;
mod value;
pub mod writer;

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use super::{DType, Storage, Tensor};

pub use error::GgufError;
pub use value::Value;

/// Alignment of the tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// One tensor's entry in the file.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// The tensor's name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape, outermost first (GGUF's `ne` reversed).
    pub shape: Vec<usize>,
    /// Offset of the data, relative to the start of the data section.
    pub offset: u64,
}

/// An open GGUF file: parsed metadata and tensor infos over a memory map.
#[derive(Debug)]
pub struct GgufFile {
    /// The file, for error messages.
    pub path: PathBuf,
    /// GGUF version (2 or 3).
    pub version: u32,
    /// All metadata key/values.
    pub metadata: BTreeMap<String, Value>,
    /// Tensors of supported types, in file order.
    pub tensors: Vec<TensorInfo>,
    /// Tensors of unsupported types (name, GGML type id): the file still
    /// opens, so its metadata (e.g. the tokenizer) stays usable.
    unsupported: Vec<(String, u32)>,
    index: HashMap<String, usize>,
    map: Arc<Mmap>,
    data_start: u64,
}

/// Our [`DType`] for a GGML type id, if supported.
fn dtype_of(type_id: u32) -> Option<DType> {
    Some(match type_id {
        0 => DType::F32,
        1 => DType::F16,
        2 => DType::Q4_0,
        3 => DType::Q4_1,
        8 => DType::Q8_0,
        30 => DType::BF16,
        _ => return None,
    })
}

/// The GGML type id for a [`DType`].
pub fn ggml_type_id(dtype: DType) -> u32 {
    match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q4_1 => 3,
        DType::Q8_0 => 8,
        DType::BF16 => 30,
    }
}

impl GgufFile {
    /// Opens, maps and parses `path`, checking every tensor's info and
    /// that its data lies inside the file.
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the map is read-only and the file is not expected to
        // change while mapped (documented at module level); every access
        // is bounds-checked against the map's length.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let header = parse::parse_header(&map, path)?;
        let mut f = GgufFile {
            path: path.to_path_buf(),
            version: header.version,
            metadata: header.metadata,
            tensors: Vec::new(),
            unsupported: Vec::new(),
            index: HashMap::new(),
            map: Arc::new(map),
            data_start: 0,
        };
        let alignment = f.alignment()?;
        f.data_start = (header.end as u64).div_ceil(alignment) * alignment;
        for raw in header.tensors {
            f.add_tensor(raw, alignment)?;
        }
        Ok(f)
    }

    /// `general.alignment`, defaulting to 32; must be a power of two.
    fn alignment(&self) -> Result<u64, GgufError> {
        let key = "general.alignment";
        let Some(v) = self.get(key) else {
            return Ok(DEFAULT_ALIGNMENT);
        };
        match v.as_u64() {
            Some(a) if a.is_power_of_two() && a <= 1 << 20 => Ok(a),
            _ => Err(self.bad_value(key, "a power of two up to 2^20", v)),
        }
    }

    /// Validates one tensor info and records it.
    fn add_tensor(&mut self, raw: parse::RawTensorInfo, alignment: u64) -> Result<(), GgufError> {
        let bad = |reason: String| GgufError::BadTensor {
            path: self.path.clone(),
            tensor: raw.name.clone(),
            reason,
        };
        if self.index.contains_key(&raw.name)
            || self.unsupported.iter().any(|(n, _)| *n == raw.name)
        {
            return Err(bad("the name appears twice".into()));
        }
        let Some(dtype) = dtype_of(raw.type_id) else {
            self.unsupported.push((raw.name, raw.type_id));
            return Ok(());
        };
        let shape: Vec<usize> = raw.ne.iter().rev().map(|&d| d as usize).collect();
        let numel = raw
            .ne
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(usize::try_from(d).ok()?))
            .ok_or_else(|| bad(format!("dimensions {:?} overflow", raw.ne)))?;
        if !raw.ne[0].is_multiple_of(dtype.block_len() as u64) {
            return Err(bad(format!(
                "rows of {} elements are not a whole number of {dtype:?} blocks of {}",
                raw.ne[0],
                dtype.block_len()
            )));
        }
        if !raw.offset.is_multiple_of(alignment) {
            return Err(bad(format!(
                "data offset {} is not a multiple of {alignment}",
                raw.offset
            )));
        }
        let len = dtype
            .bytes_for(numel)
            .ok_or_else(|| bad("byte size overflows".into()))?;
        let file_len = self.map.len() as u64;
        let start = self.data_start.saturating_add(raw.offset);
        let end = start.saturating_add(len as u64);
        if end > file_len {
            return Err(GgufError::TensorOutOfBounds {
                path: self.path.clone(),
                tensor: raw.name,
                start,
                end,
                len: file_len,
            });
        }
        self.index.insert(raw.name.clone(), self.tensors.len());
        self.tensors.push(TensorInfo {
            name: raw.name,
            dtype,
            shape,
            offset: raw.offset,
        });
        Ok(())
    }

    /// The value of metadata `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey {
            path: self.path.clone(),
            key: key.into(),
        })
    }

    fn bad_value(&self, key: &str, expected: &str, found: &Value) -> GgufError {
        let found = match found {
            Value::Array(items) => format!("an array of {} items", items.len()),
            Value::String(s) => format!("the string {s:?}"),
            v => format!("{} {v:?}", v.type_name()),
        };
        GgufError::BadValue {
            path: self.path.clone(),
            key: key.into(),
            expected: expected.into(),
            found,
        }
    }

    /// Metadata `key` as a string.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| self.bad_value(key, "a string", v))
    }

    /// Metadata `key` as a non-negative integer (any integer type).
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.require(key)?;
        v.as_u64()
            .ok_or_else(|| self.bad_value(key, "a non-negative integer", v))
    }

    /// Metadata `key` as `f32` (any numeric type).
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        let v = self.require(key)?;
        v.as_f64()
            .map(|x| x as f32)
            .ok_or_else(|| self.bad_value(key, "a number", v))
    }

    /// Metadata `key` as an array of strings (tokenizer tokens, merges).
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        let v = self.require(key)?;
        v.as_array()
            .and_then(|items| items.iter().map(Value::as_str).collect())
            .ok_or_else(|| self.bad_value(key, "an array of strings", v))
    }

    /// Metadata `key` as an array of integers that fit `i32` (token types).
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>, GgufError> {
        let v = self.require(key)?;
        v.as_array()
            .and_then(|items| {
                items
                    .iter()
                    .map(|x| x.as_i64().and_then(|i| i32::try_from(i).ok()))
                    .collect()
            })
            .ok_or_else(|| self.bad_value(key, "an array of 32-bit integers", v))
    }

    /// The info of tensor `name`, if present with a supported type.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// Whether the file has a tensor called `name` (of any type).
    pub fn has_tensor(&self, name: &str) -> bool {
        self.index.contains_key(name) || self.unsupported.iter().any(|(n, _)| n == name)
    }

    /// Tensor `name`, its data borrowed from the memory map.
    pub fn tensor(&self, name: &str) -> Result<Tensor, GgufError> {
        if let Some(info) = self.tensor_info(name) {
            let len = info
                .dtype
                .bytes_for(info.shape.iter().product())
                .unwrap_or(0);
            return Ok(Tensor {
                name: info.name.clone(),
                dtype: info.dtype,
                shape: info.shape.clone(),
                storage: Storage::Mapped {
                    map: Arc::clone(&self.map),
                    offset: (self.data_start + info.offset) as usize,
                    len,
                },
            });
        }
        match self.unsupported.iter().find(|(n, _)| n == name) {
            Some((_, type_id)) => Err(GgufError::UnsupportedTensorType {
                path: self.path.clone(),
                tensor: name.into(),
                type_id: *type_id,
            }),
            None => Err(GgufError::MissingTensor {
                path: self.path.clone(),
                tensor: name.into(),
            }),
        }
    }

    /// Absolute file offset where the tensor data section starts.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }
}

#[cfg(test)]
mod tests;
