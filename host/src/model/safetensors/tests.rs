//! Safetensors loader tests on checkpoints written by a tiny test writer.

use std::path::Path;

use proptest::prelude::*;

use super::*;
use crate::model::dequant::dequantize;

/// Writes a safetensors file of F32 tensors `(name, shape, values)`.
fn write_f32(path: &Path, tensors: &[(&str, Vec<usize>, Vec<f32>)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape, values) in tensors {
        let begin = data.len();
        data.extend(values.iter().flat_map(|x| x.to_le_bytes()));
        header.insert(
            (*name).into(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [begin, data.len()]}),
        );
    }
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut json = serde_json::to_vec(&header).unwrap();
    json.resize(json.len().div_ceil(8) * 8, b' ');
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend(json);
    bytes.extend(data);
    std::fs::write(path, bytes).unwrap();
}

fn config_json(tied: bool) -> serde_json::Value {
    serde_json::json!({
        "model_type": "llama", "hidden_size": 8, "intermediate_size": 12,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "vocab_size": 5, "rms_norm_eps": 1e-5, "tie_word_embeddings": tied
    })
}

/// A one-layer HF checkpoint whose value at flat index `i` of each tensor is
/// `i + offset`, offsets distinct per tensor. Returns the tensors written.
fn write_checkpoint(
    dir: &Path,
    tied: bool,
    shards: bool,
) -> Vec<(&'static str, Vec<usize>, Vec<f32>)> {
    let shapes: [(&str, Vec<usize>); 11] = [
        ("model.embed_tokens.weight", vec![5, 8]),
        ("model.norm.weight", vec![8]),
        ("lm_head.weight", vec![5, 8]),
        ("model.layers.0.input_layernorm.weight", vec![8]),
        ("model.layers.0.self_attn.q_proj.weight", vec![8, 8]),
        ("model.layers.0.self_attn.k_proj.weight", vec![4, 8]),
        ("model.layers.0.self_attn.v_proj.weight", vec![4, 8]),
        ("model.layers.0.self_attn.o_proj.weight", vec![8, 8]),
        ("model.layers.0.post_attention_layernorm.weight", vec![8]),
        ("model.layers.0.mlp.gate_proj.weight", vec![12, 8]),
        ("model.layers.0.mlp.up_proj.weight", vec![12, 8]),
    ];
    let mut tensors: Vec<_> = shapes
        .into_iter()
        .enumerate()
        .filter(|(_, (name, _))| !(tied && *name == "lm_head.weight"))
        .map(|(k, (name, shape))| {
            let n = shape.iter().product::<usize>();
            (name, shape, (0..n).map(|i| (1000 * k + i) as f32).collect())
        })
        .collect();
    tensors.push((
        "model.layers.0.mlp.down_proj.weight",
        vec![8, 12],
        (0..96).map(|i| -(i as f32)).collect(),
    ));
    std::fs::write(dir.join("config.json"), config_json(tied).to_string()).unwrap();
    if shards {
        let (a, b) = tensors.split_at(5);
        write_f32(&dir.join("model-00001-of-00002.safetensors"), a);
        write_f32(&dir.join("model-00002-of-00002.safetensors"), b);
        let map: serde_json::Map<_, _> = tensors
            .iter()
            .enumerate()
            .map(|(i, (n, _, _))| {
                let file = if i < 5 {
                    "model-00001-of-00002.safetensors"
                } else {
                    "model-00002-of-00002.safetensors"
                };
                ((*n).to_string(), serde_json::json!(file))
            })
            .collect();
        let index = serde_json::json!({"metadata": {}, "weight_map": map});
        std::fs::write(dir.join(INDEX_FILE), index.to_string()).unwrap();
    } else {
        write_f32(&dir.join("model.safetensors"), &tensors);
    }
    tensors
}

#[test]
fn checkpoints_load_renamed_and_with_permuted_q_k() {
    for (tied, shards) in [(true, false), (false, true)] {
        let dir = tempfile::tempdir().unwrap();
        let written = write_checkpoint(dir.path(), tied, shards);
        let w = load_safetensors(dir.path()).unwrap();
        let values = |name: &str| written.iter().find(|t| t.0 == name).unwrap().2.clone();
        assert_eq!(w.config.head_dim, 4);
        assert_eq!(w.layers[0].wq.name, "blk.0.attn_q.weight");
        assert_eq!(dequantize(&w.embed), values("model.embed_tokens.weight"));
        assert_eq!(
            dequantize(&w.layers[0].w_down),
            values("model.layers.0.mlp.down_proj.weight")
        );
        assert_eq!(w.lm_head.is_none(), tied);
        // head_dim 4: rows (0, 1, 2, 3) of each head become (0, 2, 1, 3).
        let q = values("model.layers.0.self_attn.q_proj.weight");
        let row = |r: usize| q[r * 8..(r + 1) * 8].to_vec();
        let want: Vec<f32> = [0, 2, 1, 3, 4, 6, 5, 7].into_iter().flat_map(row).collect();
        assert_eq!(dequantize(&w.layers[0].wq), want);
        let k = values("model.layers.0.self_attn.k_proj.weight");
        let want: Vec<f32> = [0, 2, 1, 3]
            .into_iter()
            .flat_map(|r| k[r * 8..(r + 1) * 8].to_vec())
            .collect();
        assert_eq!(dequantize(&w.layers[0].wk), want);
    }
}

fn replace_first(bytes: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let at = bytes.windows(from.len()).position(|w| w == from).unwrap();
    [&bytes[..at], to, &bytes[at + from.len()..]].concat()
}

#[test]
fn broken_checkpoints_name_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let e = load_safetensors(dir.path()).unwrap_err().to_string();
    assert!(e.contains("config.json is missing"), "{e}");
    std::fs::write(
        dir.path().join("config.json"),
        config_json(true).to_string(),
    )
    .unwrap();
    let e = load_safetensors(dir.path()).unwrap_err().to_string();
    assert!(e.contains("no .safetensors file"), "{e}");

    write_checkpoint(dir.path(), true, false);
    let file = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (bytes[..bytes.len() - 4].to_vec(), "claims bytes"),
        (bytes[..5].to_vec(), "fewer than the 8-byte header length"),
        (
            [&u64::MAX.to_le_bytes()[..], &bytes[8..]].concat(),
            "header length field",
        ),
        (
            [&bytes[..8], &b"{{{"[..], &bytes[11..]].concat(),
            "JSON header is invalid",
        ),
        (replace_first(&bytes, b"F32", b"I64"), "dtype I64"),
    ];
    for (corrupt, words) in cases {
        std::fs::write(&file, corrupt).unwrap();
        let e = load_safetensors(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains(words) && e.contains("model.safetensors"),
            "{words}: {e}"
        );
    }
}

#[test]
fn missing_tensors_and_wrong_shapes_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let mut tensors = write_checkpoint(dir.path(), false, false);
    tensors.retain(|t| t.0 != "lm_head.weight");
    write_f32(&dir.path().join("model.safetensors"), &tensors);
    let e = load_safetensors(dir.path()).unwrap_err().to_string();
    assert!(e.contains("`lm_head.weight` is missing"), "{e}");

    let mut tensors = write_checkpoint(dir.path(), true, false);
    let q = tensors
        .iter_mut()
        .find(|t| t.0.ends_with("q_proj.weight"))
        .unwrap();
    q.1 = vec![4, 16];
    write_f32(&dir.path().join("model.safetensors"), &tensors);
    let e = load_safetensors(dir.path()).unwrap_err().to_string();
    assert!(e.contains("`blk.0.attn_q.weight` has shape [4, 16]"), "{e}");
}

/// RoPE on `x` at position `pos`, pairing `(i, i + d/2)` (rotate-half,
/// Hugging Face) or `(2i, 2i + 1)` (interleaved, GGUF).
fn rope(x: &[f32], pos: f32, interleaved: bool) -> Vec<f32> {
    let d = x.len();
    let mut out = x.to_vec();
    for i in 0..d / 2 {
        let theta = pos * 10_000f32.powf(-2.0 * i as f32 / d as f32);
        let (a, b) = if interleaved {
            (2 * i, 2 * i + 1)
        } else {
            (i, i + d / 2)
        };
        let (s, c) = theta.sin_cos();
        out[a] = x[a] * c - x[b] * s;
        out[b] = x[a] * s + x[b] * c;
    }
    out
}

fn matvec(w: &[f32], x: &[f32]) -> Vec<f32> {
    w.chunks(x.len())
        .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

proptest! {
    /// The permutation is right exactly when attention scores agree: HF's
    /// rotate-half RoPE on the original rows and GGUF's interleaved RoPE on
    /// the permuted rows give every head the same q·k.
    #[test]
    fn permuted_projections_give_the_same_attention_scores(
        wq in prop::collection::vec(-1.0f32..1.0, 2 * 8 * 6),
        wk in prop::collection::vec(-1.0f32..1.0, 8 * 6),
        x in prop::collection::vec(-1.0f32..1.0, 6),
        y in prop::collection::vec(-1.0f32..1.0, 6),
        (m, n) in (0u32..64, 0u32..64),
    ) {
        let tensor = |v: &Vec<f32>, rows: usize| Tensor {
            name: "t".into(),
            dtype: DType::F32,
            shape: vec![rows, 6],
            storage: Storage::Owned(Arc::new(v.iter().flat_map(|f| f.to_le_bytes()).collect())),
        };
        let wq_perm = dequantize(&permute_rows_for_interleaved_rope(&tensor(&wq, 16), 2));
        let wk_perm = dequantize(&permute_rows_for_interleaved_rope(&tensor(&wk, 8), 1));
        let (q_hf, k_hf) = (matvec(&wq, &x), matvec(&wk, &y));
        let (q_gg, k_gg) = (matvec(&wq_perm, &x), matvec(&wk_perm, &y));
        let k_hf = rope(&k_hf, n as f32, false);
        let k_gg = rope(&k_gg, n as f32, true);
        for head in 0..2 {
            let hq = |q: &[f32], inter| rope(&q[head * 8..(head + 1) * 8], m as f32, inter);
            let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(p, q)| p * q).sum::<f32>();
            let s_hf = dot(&hq(&q_hf, false), &k_hf);
            let s_gg = dot(&hq(&q_gg, true), &k_gg);
            prop_assert!((s_hf - s_gg).abs() <= 1e-4 * (1.0 + s_hf.abs()), "{s_hf} vs {s_gg}");
        }
    }
}
