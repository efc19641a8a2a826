//! Errors of the GGUF reader: each names the file and the key or tensor,
//! and says what to do.

use std::path::PathBuf;

use thiserror::Error;

use crate::model::check::ShapeError;

/// Why a GGUF file cannot be used. Every variant names the file.
#[derive(Debug, Error)]
pub enum GgufError {
    /// The file cannot be opened or mapped.
    #[error("cannot read GGUF file {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The first four bytes are not `GGUF`.
    #[error(
        "{} is not a GGUF file (it starts with {found:?}, expected \"GGUF\"); \
         pass a .gguf model file",
        path.display()
    )]
    BadMagic {
        /// The file.
        path: PathBuf,
        /// The first four bytes.
        found: [u8; 4],
    },
    /// A GGUF version other than 2 or 3.
    #[error(
        "{} is GGUF version {version}, but only versions 2 and 3 are supported; \
         re-convert the model with a current llama.cpp (convert_hf_to_gguf.py)",
        path.display()
    )]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// The version field.
        version: u32,
    },
    /// The file ends before a structure it declares.
    #[error(
        "{} is truncated: {what} at byte {offset} needs {needed} bytes but the file \
         has {len}; the download or copy is incomplete or corrupt, fetch the file again",
        path.display()
    )]
    Truncated {
        /// The file.
        path: PathBuf,
        /// What was being read.
        what: String,
        /// Where it starts.
        offset: u64,
        /// How many bytes it needs.
        needed: u64,
        /// The file's length.
        len: u64,
    },
    /// A structure holds an impossible value.
    #[error(
        "{} is corrupt at byte {offset} ({context}): {reason}; fetch or convert the file again",
        path.display()
    )]
    Malformed {
        /// The file.
        path: PathBuf,
        /// Where the bad value is.
        offset: u64,
        /// What was being read.
        context: String,
        /// What is wrong.
        reason: String,
    },
    /// A tensor uses a GGML type this engine has no kernels for.
    #[error(
        "{}: tensor `{tensor}` has GGML type {type_id} ({}), which is not supported; \
         use a model quantized to F32, F16, BF16, Q8_0, Q4_0 or Q4_1",
        path.display(), ggml_type_name(*type_id)
    )]
    UnsupportedTensorType {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The GGML type id.
        type_id: u32,
    },
    /// A tensor's data lies (partly) outside the file.
    #[error(
        "{}: the data of tensor `{tensor}` spans bytes {start}..{end} but the file has {len}; \
         the file is truncated, fetch it again",
        path.display()
    )]
    TensorOutOfBounds {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// First byte (absolute).
        start: u64,
        /// One past the last byte (absolute).
        end: u64,
        /// The file's length.
        len: u64,
    },
    /// A tensor's info is inconsistent on its own (shape, block layout,
    /// alignment, duplicate name).
    #[error("{}: tensor `{tensor}`: {reason}; the file is corrupt or was written by a \
             buggy converter", path.display())]
    BadTensor {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// A tensor the model needs is absent.
    #[error("{}: tensor `{tensor}` is missing; the file is not a complete llama checkpoint",
            path.display())]
    MissingTensor {
        /// The file.
        path: PathBuf,
        /// The tensor.
        tensor: String,
    },
    /// A metadata key the caller needs is absent.
    #[error("{}: metadata key `{key}` is missing; the file was not converted for this use \
             (re-convert it with llama.cpp's convert_hf_to_gguf.py)", path.display())]
    MissingKey {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
    },
    /// A metadata value has the wrong type or an unusable value.
    #[error("{}: metadata key `{key}` is {found}, expected {expected}", path.display())]
    BadValue {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// What the caller needs.
        expected: String,
        /// What the file holds.
        found: String,
    },
    /// `general.architecture` is not a llama-family model.
    #[error(
        "{}: architecture `{arch}` is not supported; this engine runs llama-family models \
         (general.architecture = \"llama\")",
        path.display()
    )]
    UnsupportedArchitecture {
        /// The file.
        path: PathBuf,
        /// The architecture.
        arch: String,
    },
    /// The config or the tensors do not form a runnable llama.
    #[error("{}: {source}", path.display())]
    Shape {
        /// The file.
        path: PathBuf,
        /// The inconsistency.
        source: ShapeError,
    },
}

/// ggml's name of a type id, for error messages.
pub(super) fn ggml_type_name(type_id: u32) -> &'static str {
    #[rustfmt::skip]
    const NAMES: [&str; 31] = [
        "F32", "F16", "Q4_0", "Q4_1", "Q4_2 (removed)", "Q4_3 (removed)", "Q5_0", "Q5_1",
        "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS",
        "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64",
        "F64", "IQ1_M", "BF16",
    ];
    NAMES.get(type_id as usize).copied().unwrap_or("unknown")
}
