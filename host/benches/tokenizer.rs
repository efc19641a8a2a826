//! Tokenizer benchmarks on the default model's vocabulary (SmolLM2, 49152
//! tokens, `tokenizers` with the fancy-regex backend):
//!
//! - `tokenizer/load_gguf`: `Tokenizer::from_gguf` (vocabulary, merges, chat template);
//! - `tokenizer/encode/<text>`: `encode` of English prose, code and mixed
//!   unicode (about 2 KiB each), reported in bytes per second;
//! - `tokenizer/decode`: `decode` of the prose's ids;
//! - `tokenizer/stream`: the prose's ids through an `IncrementalDetokenizer`,
//!   one `push` per token, as the API server streams;
//! - `tokenizer/chat_template`: a four-message ChatML prompt.
//!
//! Needs the model (`bash scripts/fetch-model.sh`). Run:
//! `cargo bench -p host --bench tokenizer`.

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use host::model::gguf::GgufFile;
use host::tokenizer::{ChatMessage, Tokenizer};

const PROSE: &str = "The scheduler admits waiting requests in order of arrival while the KV cache has free blocks; \
a running request that cannot grow is preempted and its blocks are returned to the pool. ";
const CODE: &str =
    "fn main() {\n    let xs: Vec<u64> = (0..1024).map(|i| i * 31 % 17).collect();\n    \
println!(\"{}\", xs.iter().sum::<u64>());\n}\n";
const MIXED: &str = "Café 東京 naïve 😀👨‍👩‍👧 مرحبا 1234567 שלום — ünïcödé ";

/// `unit` repeated to about 2 KiB.
fn about_2k(unit: &str) -> String {
    unit.repeat(2048 / unit.len() + 1)
}

fn open_model() -> GgufFile {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    let path = host::config::default_model_path(&root);
    GgufFile::open(&path).unwrap_or_else(|e| panic!("{e}; run `bash scripts/fetch-model.sh` first"))
}

fn bench(c: &mut Criterion) {
    let gguf = open_model();
    let tok = Tokenizer::from_gguf(&gguf).unwrap();
    let mut g = c.benchmark_group("tokenizer");

    g.sample_size(10);
    g.bench_function("load_gguf", |b| {
        b.iter(|| Tokenizer::from_gguf(black_box(&gguf)).unwrap())
    });
    g.sample_size(50);

    for (name, unit) in [("prose", PROSE), ("code", CODE), ("mixed", MIXED)] {
        let text = about_2k(unit);
        g.throughput(Throughput::Bytes(text.len() as u64));
        g.bench_function(format!("encode/{name}"), |b| {
            b.iter(|| tok.encode(black_box(&text), false).unwrap())
        });
    }

    let ids = tok.encode(&about_2k(PROSE), false).unwrap();
    g.throughput(Throughput::Elements(ids.len() as u64));
    g.bench_function("decode", |b| {
        b.iter(|| tok.decode(black_box(&ids), true).unwrap())
    });
    g.bench_function("stream", |b| {
        b.iter(|| {
            let mut d = tok.detokenizer(true);
            let mut bytes = 0;
            for &id in &ids {
                bytes += d.push(id).unwrap().len();
            }
            bytes
        })
    });

    let messages = [
        ChatMessage::new("system", "You are terse."),
        ChatMessage::new("user", PROSE),
        ChatMessage::new("assistant", "Understood."),
        ChatMessage::new("user", "Summarise it."),
    ];
    g.throughput(Throughput::Elements(1));
    g.bench_function("chat_template", |b| {
        b.iter(|| tok.apply_chat_template(black_box(&messages), true).unwrap())
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
