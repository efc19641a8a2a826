//! Corrupted GGUF files must give `Ok` or a clear `Err`, never a panic or
//! a runaway allocation: truncations at every offset of a small synthetic
//! model, random byte flips, huge length fields, and the same on a prefix
//! of the real model (header, metadata and tensor infos).

use std::io::Read;
use std::path::Path;
use std::sync::OnceLock;

use e2e::default_model;
use host::model::dequant::dequantize;
use host::model::dummy::dummy_weights;
use host::model::gguf::writer::GgufWriter;
use host::model::gguf::{GgufFile, Value};
use host::model::{DType, LlamaConfig};
use proptest::prelude::*;

/// A tiny llama with every value type, nested arrays and several tensor
/// types (Q8_0 embedding, Q4_1 matrices, F32 norms, a BF16 and an
/// unsupported extra tensor).
fn synthetic() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| {
        let config = LlamaConfig {
            vocab_size: 8,
            hidden_size: 32,
            intermediate_size: 64,
            num_hidden_layers: 1,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            head_dim: 16,
            rope_dim: 16,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-5,
            max_position_embeddings: 64,
            tie_word_embeddings: true,
        };
        let mut w = dummy_weights(&config, DType::Q4_1, 9).unwrap();
        w.embed = dummy_weights(&config, DType::Q8_0, 9).unwrap().embed;
        let mut g = GgufWriter::from_weights(&w);
        let tokens = (0..8).map(|i| Value::String(format!("tok{i}"))).collect();
        g.kv("tokenizer.ggml.tokens", Value::Array(tokens))
            .kv(
                "tokenizer.ggml.token_type",
                Value::Array(vec![Value::I32(1); 8]),
            )
            .kv("general.alignment", Value::U32(64))
            .kv(
                "x.nested",
                Value::Array(vec![Value::Array(vec![Value::I16(-1), Value::I16(2)])]),
            )
            .kv(
                "x.scalars",
                Value::Array(vec![Value::F64(0.5), Value::F64(1.5)]),
            )
            .kv("x.i8", Value::I8(-1))
            .kv("x.u16", Value::U16(1))
            .kv("x.u64", Value::U64(1 << 40))
            .kv("x.i64", Value::I64(-5))
            .kv("x.bool", Value::Bool(true))
            .kv("x.u8", Value::U8(3))
            .tensor("x.q6_k", 14, &[256], vec![0; 210])
            .tensor("x.bf16", 30, &[16], vec![0x3f; 32]);
        g.to_bytes()
    })
}

/// The first bytes of the real model: everything before its tensor data.
fn real_prefix() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| {
        let path = default_model();
        let data_start = GgufFile::open(&path).unwrap().data_start() as usize;
        let mut bytes = vec![0; data_start + 4096];
        std::fs::File::open(&path)
            .unwrap()
            .read_exact(&mut bytes)
            .unwrap();
        bytes
    })
}

/// Opens `bytes` as a GGUF file and, when that works, exercises every
/// accessor; returns whether it opened. Any panic fails the test.
fn exercise(dir: &Path, bytes: &[u8]) -> bool {
    let path = dir.join("m.gguf");
    std::fs::write(&path, bytes).unwrap();
    let Ok(f) = GgufFile::open(&path) else {
        return false;
    };
    let _ = f.llama_config();
    if let Ok(w) = f.load_weights() {
        dequantize(&w.layers[0].wq);
    }
    for info in &f.tensors {
        dequantize(&f.tensor(&info.name).unwrap());
    }
    let _ = f.tensor("x.q6_k");
    for key in f.metadata.keys() {
        let _ = (f.get_str(key), f.get_u64(key), f.get_f32(key));
        let _ = (f.get_str_array(key), f.get_i32_array(key));
    }
    true
}

#[test]
fn the_uncorrupted_files_load() {
    let dir = tempfile::tempdir().unwrap();
    assert!(exercise(dir.path(), synthetic()));
    let path = dir.path().join("m.gguf");
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.load_weights().unwrap().layers.len(), 1);
    // The real prefix opens too: it only lacks tensor data, which is an error.
    std::fs::write(&path, real_prefix()).unwrap();
    let e = GgufFile::open(&path).unwrap_err().to_string();
    assert!(
        e.contains("runs past the end") || e.contains("spans bytes"),
        "{e}"
    );
}

#[test]
fn every_truncation_of_the_synthetic_file_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = synthetic();
    // Only the alignment padding after the last tensor (x.bf16) may go.
    std::fs::write(dir.path().join("m.gguf"), bytes).unwrap();
    let f = GgufFile::open(&dir.path().join("m.gguf")).unwrap();
    let last = f.tensor_info("x.bf16").unwrap();
    let end = (f.data_start() + last.offset) as usize + 32;
    assert!(end < bytes.len(), "the writer pads the last tensor");
    for len in 0..bytes.len() {
        assert_eq!(
            exercise(dir.path(), &bytes[..len]),
            len >= end,
            "a {len}-byte prefix"
        );
    }
}

#[test]
fn truncations_of_the_real_header_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = real_prefix();
    let step = bytes.len() / 97;
    let lens = (0..64)
        .chain((64..bytes.len()).step_by(step))
        .chain(bytes.len() - 64..bytes.len());
    for len in lens {
        let path = dir.path().join("m.gguf");
        std::fs::write(&path, &bytes[..len]).unwrap();
        let e = GgufFile::open(&path).unwrap_err().to_string();
        assert!(e.contains(path.to_str().unwrap()), "{len}: {e}");
    }
}

/// Huge values a corrupt length or count field might hold.
fn huge() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(u64::MAX),
        Just(u64::MAX / 2),
        Just(1u64 << 32),
        Just(1u64 << 40),
        Just(u64::from(u32::MAX)),
        any::<u64>(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn byte_flips_in_the_synthetic_file_never_panic(
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = synthetic().to_vec();
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        exercise(dir.path(), &bytes);
    }

    #[test]
    fn huge_fields_in_the_synthetic_file_never_panic(
        at in any::<prop::sample::Index>(),
        value in huge(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = synthetic().to_vec();
        let i = at.index(bytes.len() - 8);
        bytes[i..i + 8].copy_from_slice(&value.to_le_bytes());
        exercise(dir.path(), &bytes);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn corrupt_real_headers_never_panic(
        at in any::<prop::sample::Index>(),
        value in huge(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        cut in any::<prop::sample::Index>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = real_prefix().to_vec();
        // Early fields (counts, key lengths) matter most: pick among the
        // first 4 KiB half the time.
        let span = if at.index(2) == 0 { 4096 } else { bytes.len() - 8 };
        let i = at.index(span);
        bytes[i..i + 8].copy_from_slice(&value.to_le_bytes());
        for (j, v) in flips {
            let j = j.index(bytes.len());
            bytes[j] = v;
        }
        let len = bytes.len() - cut.index(bytes.len() / 4);
        exercise(dir.path(), &bytes[..len]);
    }
}
