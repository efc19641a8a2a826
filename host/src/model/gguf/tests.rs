//! GGUF reader tests on files built with [`super::writer::GgufWriter`].

use std::io::Write;

use super::writer::GgufWriter;
use super::*;
use crate::model::dequant::dequantize;
use crate::model::dummy::dummy_weights;
use crate::model::LlamaConfig;

fn open_bytes(bytes: &[u8]) -> Result<GgufFile, GgufError> {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(bytes).unwrap();
    GgufFile::open(f.path())
}

fn open(w: &GgufWriter) -> Result<GgufFile, GgufError> {
    open_bytes(&w.to_bytes())
}

fn f32_bytes(xs: &[f32]) -> Vec<u8> {
    xs.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn every_value() -> Vec<(&'static str, Value)> {
    vec![
        ("u8", Value::U8(200)),
        ("i8", Value::I8(-100)),
        ("u16", Value::U16(60_000)),
        ("i16", Value::I16(-30_000)),
        ("u32", Value::U32(4_000_000_000)),
        ("i32", Value::I32(-2_000_000_000)),
        ("u64", Value::U64(u64::MAX)),
        ("i64", Value::I64(i64::MIN)),
        ("f32", Value::F32(-1.5e-7)),
        ("f64", Value::F64(std::f64::consts::PI)),
        ("bool.t", Value::Bool(true)),
        ("bool.f", Value::Bool(false)),
        ("string", Value::String("héllo ▁world".into())),
        ("empty", Value::String(String::new())),
        ("arr.i32", Value::Array(vec![Value::I32(-1), Value::I32(7)])),
        (
            "arr.str",
            Value::Array(vec![Value::String("a".into()), Value::String("bc".into())]),
        ),
        ("arr.empty", Value::Array(vec![])),
        (
            "arr.nested",
            Value::Array(vec![
                Value::Array(vec![Value::U16(1), Value::U16(2)]),
                Value::Array(vec![Value::U16(3)]),
            ]),
        ),
    ]
}

#[test]
fn every_value_type_round_trips_in_v2_and_v3() {
    for version in [2, 3] {
        let mut w = GgufWriter::new(version);
        for (k, v) in every_value() {
            w.kv(k, v);
        }
        let f = open(&w).unwrap();
        assert_eq!(f.version, version);
        for (k, v) in every_value() {
            assert_eq!(f.get(k), Some(&v), "v{version} {k}");
        }
        assert_eq!(f.metadata.len(), every_value().len());
        assert!(f.tensors.is_empty());
    }
}

#[test]
fn typed_getters_convert_or_name_the_file_and_key() {
    let mut w = GgufWriter::new(3);
    for (k, v) in every_value() {
        w.kv(k, v);
    }
    let f = open(&w).unwrap();
    assert_eq!(f.get_u64("u8").unwrap(), 200);
    assert_eq!(f.get_u64("u64").unwrap(), u64::MAX);
    assert_eq!(f.get_f32("f64").unwrap(), std::f32::consts::PI);
    assert_eq!(f.get_f32("i16").unwrap(), -30_000.0);
    assert_eq!(f.get_str("string").unwrap(), "héllo ▁world");
    assert_eq!(f.get_str_array("arr.str").unwrap(), vec!["a", "bc"]);
    assert_eq!(f.get_i32_array("arr.i32").unwrap(), vec![-1, 7]);
    let path = f.path.display().to_string();
    for (result, key, words) in [
        (f.get_u64("i8").map(|_| ()), "i8", "non-negative integer"),
        (f.get_u64("nope").map(|_| ()), "nope", "missing"),
        (f.get_str("u8").map(|_| ()), "u8", "a string"),
        (f.get_f32("string").map(|_| ()), "string", "a number"),
        (
            f.get_str_array("arr.i32").map(|_| ()),
            "arr.i32",
            "array of strings",
        ),
        (
            f.get_i32_array("arr.nested").map(|_| ()),
            "arr.nested",
            "32-bit integers",
        ),
        (f.get_i32_array("u64").map(|_| ()), "u64", "32-bit integers"),
    ] {
        let msg = result.unwrap_err().to_string();
        assert!(
            msg.contains(&path) && msg.contains(&format!("`{key}`")),
            "{msg}"
        );
        assert!(msg.contains(words), "{msg}");
    }
}

#[test]
fn header_errors_are_specific() {
    let good = GgufWriter::new(3).to_bytes();
    let mut v1 = good.clone();
    v1[4] = 1;
    let e = open_bytes(&v1).unwrap_err();
    assert!(
        matches!(e, GgufError::UnsupportedVersion { version: 1, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("versions 2 and 3"), "{e}");
    let mut magic = good.clone();
    magic[..4].copy_from_slice(b"GGML");
    assert!(matches!(
        open_bytes(&magic).unwrap_err(),
        GgufError::BadMagic { .. }
    ));
    assert!(matches!(
        open_bytes(&good[..10]).unwrap_err(),
        GgufError::Truncated { .. }
    ));
    assert!(matches!(
        open_bytes(b"").unwrap_err(),
        GgufError::Truncated { .. }
    ));
    let missing = GgufFile::open(Path::new("/nonexistent/x.gguf")).unwrap_err();
    assert!(
        missing.to_string().contains("/nonexistent/x.gguf"),
        "{missing}"
    );
}

#[test]
fn corrupt_metadata_is_malformed_not_a_panic() {
    let mut w = GgufWriter::new(3);
    w.kv("flag", Value::Bool(true));
    let mut bytes = w.to_bytes();
    // header 24 + key (8 + 4) + type 4 = 40: the bool's byte.
    bytes[40] = 2;
    let e = open_bytes(&bytes).unwrap_err();
    assert!(e.to_string().contains("bool byte is 2"), "{e}");

    let mut w = GgufWriter::new(3);
    w.kv("k", Value::U8(1)).kv("k", Value::U8(2));
    assert!(open(&w)
        .unwrap_err()
        .to_string()
        .contains("`k` appears twice"));

    let mut deep = Value::U8(0);
    for _ in 0..12 {
        deep = Value::Array(vec![deep]);
    }
    let mut w = GgufWriter::new(3);
    w.kv("deep", deep);
    assert!(open(&w).unwrap_err().to_string().contains("nested deeper"));
}

#[test]
fn huge_counts_are_bounded_by_the_file_size() {
    let mut w = GgufWriter::new(3);
    w.kv("arr", Value::Array(vec![Value::U64(1)]));
    let mut bytes = w.to_bytes();
    // header 24 + key (8 + 3) + type 4 + elem type 4 = 43: the array count.
    bytes[43..51].copy_from_slice(&u64::MAX.to_le_bytes());
    let e = open_bytes(&bytes).unwrap_err();
    assert!(matches!(e, GgufError::Truncated { .. }), "{e}");
    // tensor and metadata counts
    for at in [8, 16] {
        let mut bytes = w.to_bytes();
        bytes[at..at + 8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
        assert!(matches!(
            open_bytes(&bytes).unwrap_err(),
            GgufError::Truncated { .. }
        ));
    }
}

#[test]
fn tensors_reverse_ne_and_honour_alignment() {
    for alignment in [None, Some(64u32), Some(1)] {
        let mut w = GgufWriter::new(3);
        if let Some(a) = alignment {
            w.kv("general.alignment", Value::U32(a));
        }
        let a: Vec<f32> = (0..12).map(|i| i as f32).collect();
        w.tensor("a", 0, &[1], f32_bytes(&[9.0]));
        w.tensor("m", 0, &[4, 3], f32_bytes(&a));
        let f = open(&w).unwrap();
        let align = u64::from(alignment.unwrap_or(32));
        assert_eq!(f.data_start() % align, 0);
        let m = f.tensor("m").unwrap();
        assert_eq!(m.shape, vec![3, 4]);
        assert_eq!((m.rows(), m.cols()), (3, 4));
        assert_eq!(dequantize(&m), a);
        assert_eq!(f.tensor_info("m").unwrap().offset, align.max(4));
        assert_eq!(dequantize(&f.tensor("a").unwrap()), vec![9.0]);
    }
    let mut w = GgufWriter::new(3);
    w.kv("general.alignment", Value::U32(48));
    let e = open(&w).unwrap_err();
    assert!(e.to_string().contains("general.alignment") && e.to_string().contains("power of two"));
}

#[test]
fn tensor_errors_name_the_tensor() {
    let mut w = GgufWriter::new(3);
    w.tensor("k6", 14, &[256], vec![0; 210]);
    let f = open(&w).unwrap();
    let e = f.tensor("k6").unwrap_err().to_string();
    assert!(
        e.contains("`k6`") && e.contains("GGML type 14 (Q6_K)"),
        "{e}"
    );
    assert!(f
        .tensor("nope")
        .unwrap_err()
        .to_string()
        .contains("`nope` is missing"));

    let mut w = GgufWriter::new(3);
    w.tensor("q", 8, &[16, 2], vec![0; 34]);
    let e = open(&w).unwrap_err().to_string();
    assert!(
        e.contains("`q`") && e.contains("whole number of Q8_0 blocks"),
        "{e}"
    );

    let mut w = GgufWriter::new(3);
    w.tensor("t", 0, &[8], vec![0; 32]);
    let bytes = w.to_bytes();
    let e = open_bytes(&bytes[..bytes.len() - 1]).unwrap_err();
    assert!(
        matches!(e, GgufError::TensorOutOfBounds { ref tensor, .. } if tensor == "t"),
        "{e}"
    );

    let mut w = GgufWriter::new(3);
    w.tensor("t", 0, &[8], vec![0; 32])
        .tensor("t", 0, &[8], vec![0; 32]);
    assert!(open(&w).unwrap_err().to_string().contains("appears twice"));

    let mut w = GgufWriter::new(3);
    w.tensor("t", 0, &[1, 2, 3, 4, 5], vec![0; 480]);
    assert!(open(&w).unwrap_err().to_string().contains("5 dimensions"));

    let mut w = GgufWriter::new(3);
    w.tensor("t", 0, &[u64::MAX / 2, 4], vec![]);
    assert!(matches!(open(&w).unwrap_err(), GgufError::BadTensor { .. }));
}

fn tiny(tied: bool) -> LlamaConfig {
    LlamaConfig {
        vocab_size: 64,
        hidden_size: 64,
        intermediate_size: 96,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 16,
        rope_dim: 16,
        rope_theta: 50_000.0,
        rms_norm_eps: 1e-6,
        max_position_embeddings: 256,
        tie_word_embeddings: tied,
    }
}

#[test]
fn llama_weights_round_trip_through_gguf() {
    for (dtype, tied) in [
        (DType::Q4_1, true),
        (DType::Q8_0, false),
        (DType::BF16, false),
    ] {
        let want = dummy_weights(&tiny(tied), dtype, 3).unwrap();
        let f = open(&GgufWriter::from_weights(&want)).unwrap();
        let got = f.load_weights().unwrap();
        assert_eq!(got.config, want.config);
        assert_eq!(got.lm_head.is_none(), tied);
        let pairs = [
            (&got.embed, &want.embed),
            (&got.final_norm, &want.final_norm),
            (&got.layers[1].wq, &want.layers[1].wq),
            (&got.layers[1].w_down, &want.layers[1].w_down),
            (&got.layers[0].attn_norm, &want.layers[0].attn_norm),
        ];
        for (g, w) in pairs {
            assert_eq!((&g.name, g.dtype, &g.shape), (&w.name, w.dtype, &w.shape));
            assert_eq!(g.storage.bytes(), w.storage.bytes(), "{}", g.name);
            assert!(matches!(g.storage, Storage::Mapped { .. }));
        }
    }
}

/// A tiny llama GGUF whose metadata the test then edits.
fn llama_writer(edit: impl FnOnce(&mut Vec<(String, Value)>)) -> GgufWriter {
    let w = dummy_weights(&tiny(true), DType::F32, 1).unwrap();
    let full = GgufWriter::from_weights(&w);
    let bytes = full.to_bytes();
    let f = open_bytes(&bytes).unwrap();
    let mut kvs: Vec<(String, Value)> = f.metadata.clone().into_iter().collect();
    edit(&mut kvs);
    let mut g = GgufWriter::new(3);
    for (k, v) in kvs {
        g.kv(&k, v);
    }
    for info in &f.tensors {
        let t = f.tensor(&info.name).unwrap();
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

#[test]
fn llama_config_defaults_follow_llama_cpp() {
    let g = llama_writer(|kvs| {
        kvs.retain(|(k, _)| {
            ![
                "llama.attention.key_length",
                "llama.rope.dimension_count",
                "llama.vocab_size",
            ]
            .contains(&k.as_str())
                && k != "llama.rope.freq_base"
                && k != "llama.attention.head_count_kv"
        });
        let tokens = (0..64).map(|i| Value::String(format!("t{i}"))).collect();
        kvs.push(("tokenizer.ggml.tokens".into(), Value::Array(tokens)));
    });
    let c = open(&g).unwrap().llama_config().unwrap();
    assert_eq!((c.head_dim, c.rope_dim, c.vocab_size), (16, 16, 64));
    assert_eq!((c.rope_theta, c.num_key_value_heads), (10_000.0, 4));
    assert!(c.tie_word_embeddings);
}

/// An edit of a file's metadata.
type Edit = fn(&mut Vec<(String, Value)>);

#[test]
fn llama_metadata_errors_name_the_key() {
    let cases: [(Edit, &str); 4] = [
        (
            |kvs| kvs.retain(|(k, _)| k != "llama.block_count"),
            "`llama.block_count` is missing",
        ),
        (
            |kvs| {
                kvs.iter_mut().for_each(|(k, v)| {
                    if k == "general.architecture" {
                        *v = Value::String("gpt2".into())
                    }
                })
            },
            "architecture `gpt2` is not supported",
        ),
        (
            |kvs| {
                kvs.iter_mut().for_each(|(k, v)| {
                    if k == "llama.attention.head_count_kv" {
                        *v = Value::U32(3)
                    }
                })
            },
            "num_key_value_heads (3) must divide",
        ),
        (
            |kvs| {
                kvs.iter_mut().for_each(|(k, v)| {
                    if k == "llama.feed_forward_length" {
                        *v = Value::U32(64)
                    }
                })
            },
            "tensor `blk.0.ffn_gate.weight` has shape [96, 64] but the config implies [64, 64]",
        ),
    ];
    for (edit, words) in cases {
        let f = open(&llama_writer(edit)).unwrap();
        let e = f.load_weights().unwrap_err().to_string();
        assert!(
            e.contains(words) && e.contains(&f.path.display().to_string()),
            "{e}"
        );
    }
}

#[test]
fn narrow_norms_load_as_f32() {
    let mut w = dummy_weights(&tiny(true), DType::F16, 2).unwrap();
    w.final_norm = crate::model::Tensor {
        dtype: DType::F16,
        storage: Storage::Owned(std::sync::Arc::new(
            half::f16::from_f32(0.5).to_le_bytes().repeat(64),
        )),
        ..w.final_norm
    };
    let got = open(&GgufWriter::from_weights(&w))
        .unwrap()
        .load_weights()
        .unwrap();
    assert_eq!(got.final_norm.dtype, DType::F32);
    assert!(dequantize(&got.final_norm).iter().all(|&x| x == 0.5));
}
