//! The model loaders on the real SmolLM2 GGUF: its config and tensor types,
//! agreement with the `gguf` package's GGUFReader (metadata, offsets,
//! dequantized values), and the safetensors loader on a Hugging Face
//! checkpoint converted from it by an independent Python script.

use std::path::Path;

use e2e::{default_model, run_python};
use host::model::dequant::dequantize;
use host::model::gguf::{ggml_type_id, GgufFile, Value};
use host::model::quant::quantize;
use host::model::{load, DType, LlamaConfig, LoadFormat};
use serde_json::Value as Json;

fn smollm2_config() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 49_152,
        hidden_size: 576,
        intermediate_size: 1536,
        num_hidden_layers: 30,
        num_attention_heads: 9,
        num_key_value_heads: 3,
        head_dim: 64,
        rope_dim: 64,
        rope_theta: 100_000.0,
        rms_norm_eps: 1e-5,
        max_position_embeddings: 8192,
        tie_word_embeddings: true,
    }
}

#[test]
fn real_model_has_the_smollm2_config_and_types() {
    let f = GgufFile::open(&default_model()).unwrap();
    assert_eq!(f.version, 3);
    assert_eq!(f.llama_config().unwrap(), smollm2_config());
    let w = load(&default_model(), LoadFormat::Auto).unwrap();
    assert_eq!(w.config, smollm2_config());
    assert!(w.lm_head.is_none());
    assert_eq!(
        (w.embed.dtype, w.embed.shape.as_slice()),
        (DType::Q8_0, &[49_152, 576][..])
    );
    assert_eq!(w.final_norm.dtype, DType::F32);
    for l in &w.layers {
        for t in [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down] {
            assert_eq!(t.dtype, DType::Q4_1, "{}", t.name);
        }
        assert_eq!(
            (l.attn_norm.dtype, l.ffn_norm.dtype),
            (DType::F32, DType::F32)
        );
    }
    assert_eq!(w.layers[0].wk.shape, vec![192, 576]);
    assert_eq!(w.layers[29].w_down.shape, vec![576, 1536]);
    assert_eq!(
        f.get_str_array("tokenizer.ggml.tokens").unwrap().len(),
        49_152
    );
    assert_eq!(
        f.get_i32_array("tokenizer.ggml.token_type").unwrap().len(),
        49_152
    );
    assert_eq!(f.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
}

/// Whether our value equals GGUFReader's JSON rendering of it.
fn same_value(ours: &Value, theirs: &Json) -> bool {
    match ours {
        Value::String(s) => theirs.as_str() == Some(s),
        Value::Bool(b) => theirs.as_bool() == Some(*b),
        Value::F32(_) | Value::F64(_) => theirs.as_f64() == ours.as_f64(),
        _ => match (ours.as_i64(), ours.as_u64()) {
            (Some(i), _) if theirs.as_i64() == Some(i) => true,
            (_, Some(u)) => theirs.as_u64() == Some(u),
            _ => false,
        },
    }
}

const DUMPED: [&str; 6] = [
    "token_embd.weight",
    "blk.0.attn_q.weight",
    "blk.0.attn_norm.weight",
    "blk.17.attn_k.weight",
    "blk.29.ffn_down.weight",
    "output_norm.weight",
];

#[test]
fn gguf_agrees_with_python_gguf_reader() {
    let model = default_model();
    let out = tempfile::tempdir().unwrap();
    let mut args = vec![model.to_str().unwrap(), out.path().to_str().unwrap()];
    args.extend(DUMPED);
    let dump: Json = serde_json::from_str(&run_python("gguf_dump.py", &args)).unwrap();
    let f = GgufFile::open(&model).unwrap();
    assert_eq!(Some(u64::from(f.version)), dump["version"].as_u64());

    let meta = dump["metadata"].as_object().unwrap();
    assert_eq!(meta.len(), f.metadata.len());
    for (key, theirs) in meta {
        let ours = f.get(key).unwrap_or_else(|| panic!("{key} missing"));
        if let Some(items) = ours.as_array() {
            assert_eq!(
                Some(items.len() as u64),
                theirs["array_len"].as_u64(),
                "{key}"
            );
            let first = theirs["first"].as_array().unwrap();
            let last = theirs["last"].as_array().unwrap();
            assert!(
                items.iter().zip(first).all(|(o, t)| same_value(o, t)),
                "{key}"
            );
            assert!(
                items
                    .iter()
                    .rev()
                    .zip(last.iter().rev())
                    .all(|(o, t)| same_value(o, t)),
                "{key}"
            );
        } else {
            let scalar = theirs
                .get("scalar")
                .or_else(|| theirs.get("float"))
                .unwrap();
            assert!(same_value(ours, scalar), "{key}: {ours:?} vs {scalar}");
        }
    }

    let tensors = dump["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), f.tensors.len());
    for (info, theirs) in f.tensors.iter().zip(tensors) {
        assert_eq!(Some(info.name.as_str()), theirs["name"].as_str());
        assert_eq!(
            Some(u64::from(ggml_type_id(info.dtype))),
            theirs["type"].as_u64()
        );
        let ne: Vec<usize> = info.shape.iter().rev().copied().collect();
        assert_eq!(serde_json::json!(ne), theirs["ne"], "{}", info.name);
        let t = f.tensor(&info.name).unwrap();
        assert_eq!(
            Some(f.data_start() + info.offset),
            theirs["data_offset"].as_u64()
        );
        assert_eq!(
            Some(t.storage.bytes().len() as u64),
            theirs["n_bytes"].as_u64()
        );
    }

    for name in DUMPED {
        let raw = std::fs::read(out.path().join(format!("{name}.f32"))).unwrap();
        let theirs: Vec<f32> = raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let ours = dequantize(&f.tensor(name).unwrap());
        assert_eq!(ours.len(), theirs.len(), "{name}");
        let worst = ours
            .iter()
            .zip(&theirs)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(worst <= 1e-6, "{name}: largest difference {worst}");
    }
}

/// Converts the real GGUF to a Hugging Face checkpoint in Python, loads
/// both, and checks every tensor agrees after dequantization (`round`
/// models the checkpoint's precision).
fn check_converted(dtype: &str, shards: &str, round: fn(f32) -> f32, stored: DType) {
    let model = default_model();
    let dir = tempfile::tempdir().unwrap();
    run_python(
        "gguf_to_hf.py",
        &[
            model.to_str().unwrap(),
            dir.path().to_str().unwrap(),
            dtype,
            shards,
        ],
    );
    let gguf = load(&model, LoadFormat::Gguf).unwrap();
    let hf = load(dir.path(), LoadFormat::Auto).unwrap();
    assert_eq!(hf.config, gguf.config);
    assert_eq!(hf.layers[3].wq.dtype, stored);
    assert_eq!(hf.final_norm.dtype, DType::F32);
    let (a, b) = (gguf.tensors(), hf.tensors());
    assert_eq!(a.len(), b.len());
    for (g, h) in a.into_iter().zip(b) {
        assert_eq!((&g.name, &g.shape), (&h.name, &h.shape));
        let want: Vec<f32> = dequantize(g).into_iter().map(round).collect();
        assert!(dequantize(h) == want, "{}: values differ", g.name);
    }
}

#[test]
fn safetensors_f32_single_file_matches_gguf() {
    check_converted("f32", "1", |x| x, DType::F32);
}

#[test]
fn safetensors_bf16_sharded_matches_gguf() {
    // bfloat16 keeps the top 16 bits, rounding to nearest even.
    let round = |x: f32| {
        let bits = x.to_bits();
        f32::from_bits(bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000)
    };
    check_converted("bf16", "3", round, DType::BF16);
}

#[test]
fn quantizers_match_python_gguf_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    // Random blocks plus edge cases: all zero, constant, one outlier,
    // all negative.
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut values: Vec<f32> = (0..32 * 60)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect();
    values.extend([0.0; 32]);
    values.extend([0.75; 32]);
    values.extend((0..32).map(|i| if i == 5 { -40.0 } else { 0.01 * i as f32 }));
    values.extend((0..32).map(|i| -1.0 - i as f32));
    let input = dir.path().join("in.f32");
    std::fs::write(
        &input,
        values
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect::<Vec<u8>>(),
    )
    .unwrap();
    run_python(
        "quantize_ref.py",
        &[input.to_str().unwrap(), dir.path().to_str().unwrap()],
    );
    for (dtype, file) in [
        (DType::Q8_0, "q8_0.bin"),
        (DType::Q4_0, "q4_0.bin"),
        (DType::Q4_1, "q4_1.bin"),
    ] {
        let theirs = std::fs::read(dir.path().join(file)).unwrap();
        let ours = quantize(dtype, &values).unwrap();
        assert_eq!(ours.len(), theirs.len(), "{dtype:?}");
        let diff = ours
            .chunks(dtype.block_bytes())
            .zip(theirs.chunks(dtype.block_bytes()))
            .position(|(a, b)| a != b);
        assert_eq!(diff, None, "{dtype:?}: first differing block");
    }
}

#[test]
fn dummy_preset_has_the_real_shape() {
    let c = host::model::dummy_config(Path::new("smollm2-135m")).unwrap();
    assert_eq!(c, smollm2_config());
}

/// Resident KiB of the mapping that starts at `addr`, from /proc/self/smaps.
fn resident_kib_of_mapping(addr: usize) -> usize {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut lines = smaps.lines();
    while let Some(line) = lines.next() {
        let range = line.split_whitespace().next().unwrap_or_default();
        let Some((start, _)) = range.split_once('-') else {
            continue;
        };
        if usize::from_str_radix(start, 16) != Ok(addr) {
            continue;
        }
        let rss = lines.find(|l| l.starts_with("Rss:")).unwrap();
        return rss.split_whitespace().nth(1).unwrap().parse().unwrap();
    }
    panic!("no mapping at {addr:#x} in /proc/self/smaps");
}

/// After `release_mapped_pages` the process holds (almost) none of the
/// mapped file, and every tensor still reads the same bytes.
#[test]
fn released_pages_leave_the_process_and_come_back_on_read() {
    let w = load(&default_model(), LoadFormat::Auto).unwrap();
    let host::model::Storage::Mapped { map, .. } = &w.embed.storage else {
        panic!("a GGUF's tensors are mapped");
    };
    let (addr, kib) = (map.as_ptr() as usize, map.len() / 1024);
    let checksum = |w: &host::model::ModelWeights| {
        w.tensors().iter().fold(0u64, |h, t| {
            t.storage
                .bytes()
                .iter()
                .fold(h, |h, &b| h.rotate_left(5) ^ u64::from(b))
        })
    };
    let before = checksum(&w);
    let touched = resident_kib_of_mapping(addr);
    assert!(
        touched > kib * 9 / 10,
        "read all: {touched} of {kib} KiB resident"
    );
    w.release_mapped_pages();
    let released = resident_kib_of_mapping(addr);
    assert!(
        released < kib / 20,
        "released: {released} of {kib} KiB still resident"
    );
    assert_eq!(checksum(&w), before);
}
