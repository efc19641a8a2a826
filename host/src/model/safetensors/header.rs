//! The safetensors file layout: an 8-byte little-endian header length, a
//! JSON header mapping each tensor name to its dtype, shape and byte range,
//! then the data, which is memory-mapped and borrowed in place.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use memmap2::Mmap;
use serde::Deserialize;

use super::SafetensorsError;
use crate::model::{DType, Storage, Tensor};

/// The safetensors format's own cap on the JSON header.
const MAX_HEADER_BYTES: u64 = 100 * 1024 * 1024;

/// One header entry as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: [u64; 2],
}

/// Our [`DType`] for a safetensors dtype name, if supported.
fn dtype_of(name: &str) -> Option<DType> {
    Some(match name {
        "F32" => DType::F32,
        "F16" => DType::F16,
        "BF16" => DType::BF16,
        _ => return None,
    })
}

/// Maps `path` and returns its tensors by their names in the file, each
/// borrowing the map. Every byte range is checked against the file.
pub(super) fn read_tensors(path: &Path) -> Result<HashMap<String, Tensor>, SafetensorsError> {
    let bad = |reason: String| SafetensorsError::Header {
        path: path.to_path_buf(),
        reason,
    };
    let io = |source| SafetensorsError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    // SAFETY: read-only map of a checkpoint that is not modified while the
    // engine runs; every access below is bounds-checked.
    let map = Arc::new(unsafe { Mmap::map(&file) }.map_err(io)?);
    let Some(len_bytes) = map.get(..8) else {
        return Err(bad(format!(
            "the file has {} bytes, fewer than the 8-byte header length",
            map.len()
        )));
    };
    let header_len = u64::from_le_bytes(len_bytes.try_into().unwrap_or_default());
    let file_len = map.len() as u64;
    if header_len > MAX_HEADER_BYTES || header_len > file_len - 8 {
        return Err(bad(format!(
            "the header length field is {header_len} but the file has {file_len} bytes; \
             the file is truncated or not a safetensors file"
        )));
    }
    let data_start = 8 + header_len as usize;
    let mut raw: HashMap<String, serde_json::Value> =
        serde_json::from_slice(&map[8..data_start])
            .map_err(|e| bad(format!("the JSON header is invalid: {e}")))?;
    raw.remove("__metadata__");
    let data_len = (map.len() - data_start) as u64;
    let mut tensors = HashMap::with_capacity(raw.len());
    for (name, value) in raw {
        let entry: Entry = serde_json::from_value(value)
            .map_err(|e| bad(format!("the entry of tensor `{name}` is invalid: {e}")))?;
        let dtype = dtype_of(&entry.dtype).ok_or_else(|| SafetensorsError::UnsupportedDtype {
            path: path.to_path_buf(),
            tensor: name.clone(),
            dtype: entry.dtype.clone(),
        })?;
        let [begin, end] = entry.data_offsets;
        let numel = entry
            .shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d));
        let want = numel.and_then(|n| dtype.bytes_for(n)).map(|n| n as u64);
        if begin > end || end > data_len || want != Some(end - begin) {
            return Err(bad(format!(
                "tensor `{name}` ({} {:?}) claims bytes {begin}..{end} of a {data_len}-byte data \
                 section, which does not fit its shape or the file; the file is truncated or corrupt",
                entry.dtype, entry.shape
            )));
        }
        let storage = Storage::Mapped {
            map: Arc::clone(&map),
            offset: data_start + begin as usize,
            len: (end - begin) as usize,
        };
        tensors.insert(
            name.clone(),
            Tensor {
                name,
                dtype,
                shape: entry.shape,
                storage,
            },
        );
    }
    Ok(tensors)
}
