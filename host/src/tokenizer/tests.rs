//! Tests of the whole tokenizer on a small synthetic byte-level vocabulary
//! written as a real GGUF file. Expected ids are spelled out by hand from the
//! merges below, not taken from the code under test.

use proptest::prelude::*;

use super::byte_level::byte_to_char;
use super::*;
use crate::model::gguf::writer::GgufWriter;
use crate::model::gguf::Value;

/// Merges as byte pairs, in priority order. They build tokens that end in
/// the middle of UTF-8 characters (the emoji and 你 halves).
const MERGES: &[(&[u8], &[u8])] = &[
    (b" ", b"t"),
    (b"h", b"e"),
    (b" t", b"he"),
    (b"1", b"2"),
    (b"\xF0", b"\x9F"),
    (b"\x98", b"\x80"),
    (b"\xC3", b"\xA9"),
    (b"\xE4", b"\xBD"),
];

/// Specials first (ids 0..4), then the 256 bytes, then the merged tokens.
const SPECIALS: &[(&str, i32)] = &[
    ("<|endoftext|>", 3),
    ("<|im_start|>", 3),
    ("<|im_end|>", 3),
    ("<tool>", 4),
];
const BYTE_BASE: u32 = 4;
const MERGED_BASE: u32 = BYTE_BASE + 256;

const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Spells bytes in the byte-level alphabet.
fn spell(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| byte_to_char(b)).collect()
}

fn byte_id(b: u8) -> u32 {
    BYTE_BASE + u32::from(b)
}

fn merged_id(left: &[u8], right: &[u8]) -> u32 {
    MERGED_BASE
        + MERGES
            .iter()
            .position(|&(l, r)| l == left && r == right)
            .unwrap() as u32
}

fn strings(items: impl IntoIterator<Item = String>) -> Value {
    Value::Array(items.into_iter().map(Value::String).collect())
}

/// The metadata of the synthetic tokenizer, as llama.cpp would write it.
fn base_kvs() -> Vec<(&'static str, Value)> {
    let mut tokens: Vec<String> = SPECIALS.iter().map(|(t, _)| t.to_string()).collect();
    let mut types: Vec<i32> = SPECIALS.iter().map(|&(_, ty)| ty).collect();
    tokens.extend((0..=255u8).map(|b| spell(&[b])));
    tokens.extend(MERGES.iter().map(|(l, r)| spell(&[*l, *r].concat())));
    types.resize(tokens.len(), 1);
    vec![
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String("smollm".into())),
        ("tokenizer.ggml.tokens", strings(tokens)),
        (
            "tokenizer.ggml.token_type",
            Value::Array(types.into_iter().map(Value::I32).collect()),
        ),
        (
            "tokenizer.ggml.merges",
            strings(
                MERGES
                    .iter()
                    .map(|(l, r)| format!("{} {}", spell(l), spell(r))),
            ),
        ),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", Value::U32(2)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(false)),
        ("tokenizer.chat_template", Value::String(CHATML.into())),
    ]
}

/// Writes `kvs` as a GGUF file and loads its tokenizer; also returns the
/// file's name as error messages show it.
fn load(kvs: Vec<(&str, Value)>) -> (Result<Tokenizer, TokenizerError>, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tok.gguf");
    let mut w = GgufWriter::new(3);
    for (k, v) in kvs {
        w.kv(k, v);
    }
    std::fs::write(&path, w.to_bytes()).unwrap();
    let gguf = GgufFile::open(&path).unwrap();
    (Tokenizer::from_gguf(&gguf), path.display().to_string())
}

fn tokenizer() -> Tokenizer {
    load(base_kvs()).0.unwrap()
}

/// `base_kvs` with `key` replaced by `value` (or removed when `None`).
fn with(key: &'static str, value: Option<Value>) -> Vec<(&'static str, Value)> {
    let mut kvs: Vec<_> = base_kvs().into_iter().filter(|(k, _)| *k != key).collect();
    kvs.extend(value.map(|v| (key, v)));
    kvs
}

fn load_err(kvs: Vec<(&str, Value)>) -> (String, String) {
    let (result, path) = load(kvs);
    (result.unwrap_err().to_string(), path)
}

#[test]
fn encodes_with_merges_specials_and_individual_digits() {
    let t = tokenizer();
    let the = merged_id(b" t", b"he");
    assert_eq!(t.encode("a the", false).unwrap(), vec![byte_id(b'a'), the]);
    // Special tokens in the text are single ids; user-defined ones too.
    assert_eq!(
        t.encode("<|im_start|>x<tool><|im_end|>", false).unwrap(),
        vec![1, byte_id(b'x'), 3, 2]
    );
    // smollm splits digits one by one, so the "1 2" merge never applies.
    assert_eq!(
        t.encode("12", false).unwrap(),
        vec![byte_id(b'1'), byte_id(b'2')]
    );
    // 😀 is F0 9F 98 80: two tokens, each half a character.
    assert_eq!(
        t.encode("😀", false).unwrap(),
        vec![merged_id(b"\xF0", b"\x9F"), merged_id(b"\x98", b"\x80")]
    );
}

#[test]
fn gpt2_pre_tokenizer_keeps_digit_runs() {
    let t = load(with(
        "tokenizer.ggml.pre",
        Some(Value::String("gpt2".into())),
    ))
    .0
    .unwrap();
    assert_eq!(t.encode("12", false).unwrap(), vec![merged_id(b"1", b"2")]);
}

#[test]
fn add_bos_token_applies_only_with_special_tokens() {
    let t = load(with(
        "tokenizer.ggml.add_bos_token",
        Some(Value::Bool(true)),
    ))
    .0
    .unwrap();
    assert_eq!(t.encode("a", true).unwrap(), vec![1, byte_id(b'a')]);
    assert_eq!(t.encode("a", false).unwrap(), vec![byte_id(b'a')]);
    assert_eq!(tokenizer().encode("a", true).unwrap(), vec![byte_id(b'a')]);
}

#[test]
fn accessors() {
    let t = tokenizer();
    assert_eq!(t.vocab_size(), MERGED_BASE as usize + MERGES.len());
    assert_eq!((t.bos_token_id(), t.eos_token_id()), (Some(1), Some(2)));
    assert_eq!(t.special_token_ids().pad, None);
    assert_eq!(t.token_to_id("Ġthe"), Some(merged_id(b" t", b"he")));
    assert_eq!(t.id_to_token(byte_id(b' ')).as_deref(), Some("Ġ"));
    assert!(t.is_special(1) && !t.is_special(3) && !t.is_special(byte_id(b'a')));
}

#[test]
fn decode_round_trips_and_skips_specials() {
    let t = tokenizer();
    let text = "<|im_start|>user\né 你 😀 12 the<tool><|im_end|>";
    let ids = t.encode(text, false).unwrap();
    assert_eq!(t.decode(&ids, false).unwrap(), text);
    assert_eq!(t.decode(&ids, true).unwrap(), "user\né 你 😀 12 the<tool>");
    // Half an emoji is not valid UTF-8.
    assert_eq!(
        t.decode(&[merged_id(b"\xF0", b"\x9F")], false).unwrap(),
        "\u{FFFD}"
    );
}

#[test]
fn out_of_vocabulary_ids_are_errors() {
    let t = tokenizer();
    let n = t.vocab_size() as u32;
    for id in [n, u32::MAX] {
        let err = t.decode(&[byte_id(b'a'), id], false).unwrap_err();
        assert!(
            matches!(err, TokenizerError::InvalidTokenId { id: bad, .. } if bad == id),
            "{err}"
        );
        assert!(t.detokenizer(false).push(id).is_err());
    }
}

#[test]
fn chat_template_from_metadata() {
    let t = tokenizer();
    let msgs = [
        ChatMessage::new("system", "S"),
        ChatMessage::new("user", "U"),
    ];
    assert_eq!(
        t.apply_chat_template(&msgs, true).unwrap(),
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn missing_and_broken_chat_templates_are_clear_errors() {
    let (t, path) = load(with("tokenizer.chat_template", None));
    let err = t
        .unwrap()
        .apply_chat_template(&[], true)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no chat template") && err.contains(&path),
        "{err}"
    );

    let mut t = load(with(
        "tokenizer.chat_template",
        Some(Value::String("{% if %}".into())),
    ))
    .0
    .unwrap();
    let err = t.apply_chat_template(&[], true).unwrap_err().to_string();
    assert!(
        err.starts_with("chat template error: syntax error"),
        "{err}"
    );
    t.set_chat_template("{{ bos_token }}|{{ eos_token }}")
        .unwrap();
    assert_eq!(
        t.apply_chat_template(&[], false).unwrap(),
        "<|im_start|>|<|im_end|>"
    );
}

/// Metadata and the words its error must contain.
type MetadataCase = (Vec<(&'static str, Value)>, &'static [&'static str]);

#[test]
fn metadata_errors_name_the_key_and_the_file() {
    let cases: Vec<MetadataCase> = vec![
        (
            with("tokenizer.ggml.tokens", None),
            &["tokenizer.ggml.tokens", "missing"],
        ),
        (
            with("tokenizer.ggml.model", Some(Value::String("llama".into()))),
            &["\"llama\"", "gpt2"],
        ),
        (
            with("tokenizer.ggml.model", Some(Value::U32(2))),
            &["tokenizer.ggml.model"],
        ),
        (
            with("tokenizer.ggml.pre", Some(Value::String("qwen2".into()))),
            &["\"qwen2\"", "default, gpt2, smollm"],
        ),
        (
            with("tokenizer.ggml.merges", Some(strings(["Ġt".to_string()]))),
            &["tokenizer.ggml.merges", "merge 0"],
        ),
        (
            with("tokenizer.ggml.merges", Some(strings(["x y".to_string()]))),
            &["tokenizer.ggml.merges"],
        ),
        (
            with(
                "tokenizer.ggml.tokens",
                Some(Value::Array(vec![Value::U32(1)])),
            ),
            &["tokenizer.ggml.tokens"],
        ),
        (
            with(
                "tokenizer.ggml.token_type",
                Some(Value::Array(vec![Value::I32(1)])),
            ),
            &["tokenizer.ggml.token_type", "1 entries"],
        ),
        (
            with("tokenizer.ggml.bos_token_id", Some(Value::U32(1 << 20))),
            &["tokenizer.ggml.bos_token_id", "outside"],
        ),
        (
            with("tokenizer.ggml.add_bos_token", Some(Value::U32(1))),
            &["tokenizer.ggml.add_bos_token", "bool"],
        ),
        (
            with("tokenizer.chat_template", Some(Value::U8(0))),
            &["tokenizer.chat_template"],
        ),
    ];
    for (kvs, needles) in cases {
        let (err, path) = load_err(kvs);
        assert!(err.contains(&path), "file not named: {err}");
        for needle in needles {
            assert!(err.contains(needle), "{needle:?} not in: {err}");
        }
    }
}

#[test]
fn duplicate_tokens_are_an_error() {
    let mut kvs = base_kvs();
    let Value::Array(tokens) = &mut kvs[2].1 else {
        unreachable!()
    };
    tokens[5] = tokens[6].clone();
    let (err, _) = load_err(kvs);
    assert!(err.contains("appears twice"), "{err}");
}

#[test]
fn from_file_matches_from_gguf_and_reads_the_config() {
    let t = tokenizer();
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("tokenizer.json");
    t.hf.save(&json, false).unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        serde_json::json!({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML}).to_string(),
    )
    .unwrap();
    let f = Tokenizer::from_file(&json).unwrap();
    let text = "<|im_start|>é 你 😀 12 the<tool>";
    assert_eq!(f.encode(text, true).unwrap(), t.encode(text, true).unwrap());
    assert_eq!((f.bos_token_id(), f.eos_token_id()), (Some(1), Some(2)));
    let msgs = [ChatMessage::new("user", "U")];
    assert_eq!(
        f.apply_chat_template(&msgs, true).unwrap(),
        t.apply_chat_template(&msgs, true).unwrap()
    );
}

#[test]
fn from_file_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("tokenizer.json");
    let err = Tokenizer::from_file(&missing).unwrap_err().to_string();
    assert!(err.contains("tokenizer.json"), "{err}");

    std::fs::write(&missing, "{\"model\": 1}").unwrap();
    let err = Tokenizer::from_file(&missing).unwrap_err().to_string();
    assert!(err.contains("not a usable tokenizer.json"), "{err}");

    // A tokenizer whose decoder is not byte-level.
    let mut t = tokenizer();
    t.hf.with_decoder(None::<tokenizers::decoders::DecoderWrapper>);
    t.hf.save(&missing, false).unwrap();
    let err = Tokenizer::from_file(&missing).unwrap_err().to_string();
    assert!(err.contains("only byte-level BPE"), "{err}");

    // A config naming a token the vocabulary does not have.
    tokenizer().hf.save(&missing, false).unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"eos_token": "</s>"}"#,
    )
    .unwrap();
    let err = Tokenizer::from_file(&missing).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer_config.json") && err.contains("`eos_token` is \"</s>\""),
        "{err}"
    );
}

#[test]
fn tokenizer_is_shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<IncrementalDetokenizer>();
}

/// Feeds `ids` one at a time and returns the deltas, the last from `finish`.
fn stream(t: &Tokenizer, ids: &[u32], skip: bool) -> Vec<String> {
    let mut d = t.detokenizer(skip);
    let mut out: Vec<String> = ids
        .iter()
        .map(|&id| d.push(id).unwrap().to_owned())
        .collect();
    out.push(d.finish().to_owned());
    out
}

proptest! {
    /// Random ids, most of them bytes and half-characters: the deltas add up
    /// to the full decode, and a delta shows U+FFFD only if the decode does.
    #[test]
    fn deltas_concatenate_to_the_full_decode(
        ids in proptest::collection::vec(0u32..MERGED_BASE + MERGES.len() as u32, 0..40),
        skip in any::<bool>(),
    ) {
        let t = tokenizer();
        let full = t.decode(&ids, skip).unwrap();
        let deltas = stream(&t, &ids, skip);
        prop_assert_eq!(deltas.concat(), full.clone());
        if !full.contains('\u{FFFD}') {
            prop_assert!(deltas.iter().all(|d| !d.contains(char::REPLACEMENT_CHARACTER)), "a delta holds U+FFFD: {:?}", deltas);
        }
    }

    /// Any text, split into tokens that cut characters apart, streams back
    /// unchanged and without a single replacement character.
    #[test]
    fn encoded_text_streams_back_exactly(text in "(\\PC|[😀你é12 ]|<\\|im_end\\|>){0,30}") {
        let t = tokenizer();
        let ids = t.encode(&text, false).unwrap();
        let deltas = stream(&t, &ids, false);
        prop_assert_eq!(deltas.concat(), text.clone());
        if !text.contains(char::REPLACEMENT_CHARACTER) {
            prop_assert!(deltas.iter().all(|d| !d.contains(char::REPLACEMENT_CHARACTER)), "a delta holds U+FFFD: {:?}", deltas);
        }
    }
}
