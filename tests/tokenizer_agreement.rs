//! The tokenizer of the real model against independent references:
//! `tests/reference/tokenize_ref.py` builds a Python `tokenizers` tokenizer
//! from the same GGUF vocabulary and merges (configured like SmolLM2's
//! tokenizer.json) and `tests/reference/chat_template_ref.py` renders the
//! chat template with Python's jinja2, on the corpus in
//! `tests/reference/tokenizer_corpus.json`.

use std::path::PathBuf;
use std::sync::OnceLock;

use e2e::{default_model, repo_root, run_python};
use host::model::gguf::GgufFile;
use host::tokenizer::{ChatMessage, Tokenizer, TokenizerError};
use proptest::prelude::*;
use serde_json::Value;

/// What the Python reference produced, computed once per test binary.
struct Reference {
    texts: Vec<String>,
    conversations: Vec<(Vec<ChatMessage>, bool)>,
    ids: Vec<Vec<u32>>,
    ids_with_special: Vec<Vec<u32>>,
    decoded: Vec<String>,
    bos: u32,
    eos: u32,
    vocab_size: usize,
    tokenizer_json: PathBuf,
    /// Keeps the folder with the saved tokenizer.json alive.
    _dir: tempfile::TempDir,
}

fn corpus_path() -> PathBuf {
    repo_root().join("tests/reference/tokenizer_corpus.json")
}

fn ids_of(v: &Value) -> Vec<Vec<u32>> {
    serde_json::from_value(v.clone()).expect("lists of ids")
}

fn reference() -> &'static Reference {
    static REF: OnceLock<Reference> = OnceLock::new();
    REF.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let model = default_model();
        let corpus = corpus_path();
        let out = run_python(
            "tokenize_ref.py",
            &[
                model.to_str().unwrap(),
                corpus.to_str().unwrap(),
                dir.path().to_str().unwrap(),
            ],
        );
        let out: Value = serde_json::from_str(&out).expect("tokenize_ref.py prints JSON");
        let corpus: Value =
            serde_json::from_str(&std::fs::read_to_string(&corpus).unwrap()).unwrap();
        let conversations = corpus["conversations"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                (
                    serde_json::from_value(c["messages"].clone()).unwrap(),
                    c["add_generation_prompt"].as_bool().unwrap(),
                )
            })
            .collect();
        Reference {
            texts: serde_json::from_value(corpus["texts"].clone()).unwrap(),
            conversations,
            ids: ids_of(&out["ids"]),
            ids_with_special: ids_of(&out["ids_with_special"]),
            decoded: serde_json::from_value(out["decoded"].clone()).unwrap(),
            bos: out["bos_token_id"].as_u64().unwrap() as u32,
            eos: out["eos_token_id"].as_u64().unwrap() as u32,
            vocab_size: out["vocab_size"].as_u64().unwrap() as usize,
            tokenizer_json: PathBuf::from(out["tokenizer_json"].as_str().unwrap()),
            _dir: dir,
        }
    })
}

fn gguf_tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let gguf = GgufFile::open(&default_model()).expect("the default model opens");
        Tokenizer::from_gguf(&gguf).expect("the default model's tokenizer loads")
    })
}

/// Asserts that `tok` encodes every corpus text as the reference does,
/// reporting all mismatches at once.
fn assert_same_ids(tok: &Tokenizer, what: &str) {
    let r = reference();
    assert_eq!(r.texts.len(), r.ids.len());
    let mut mismatches = Vec::new();
    for (i, text) in r.texts.iter().enumerate() {
        let plain = tok.encode(text, false).unwrap();
        let special = tok.encode(text, true).unwrap();
        if plain != r.ids[i] || special != r.ids_with_special[i] {
            mismatches.push(format!(
                "{text:?}:\n  ours   {plain:?} / {special:?}\n  python {:?} / {:?}",
                r.ids[i], r.ids_with_special[i]
            ));
        }
    }
    assert!(
        mismatches.is_empty(),
        "{what}: {} of {} texts differ:\n{}",
        mismatches.len(),
        r.texts.len(),
        mismatches.join("\n")
    );
}

#[test]
fn gguf_tokenizer_matches_python_tokenizers() {
    let tok = gguf_tokenizer();
    let r = reference();
    assert_eq!(
        (tok.vocab_size(), tok.bos_token_id(), tok.eos_token_id()),
        (r.vocab_size, Some(r.bos), Some(r.eos))
    );
    assert_same_ids(tok, "from_gguf");
    // The corpus really exercises special tokens written in the text.
    let im_start = tok.token_to_id("<|im_start|>").unwrap();
    assert!(r.ids.iter().any(|ids| ids.contains(&im_start)));
}

#[test]
fn tokenizer_json_saved_by_python_gives_the_same_ids() {
    let r = reference();
    let tok = Tokenizer::from_file(&r.tokenizer_json).unwrap();
    assert_eq!(
        (tok.vocab_size(), tok.bos_token_id(), tok.eos_token_id()),
        (r.vocab_size, Some(r.bos), Some(r.eos))
    );
    assert_same_ids(&tok, "from_file");
    let msgs = [ChatMessage::new("user", "Hi")];
    assert_eq!(
        tok.apply_chat_template(&msgs, true).unwrap(),
        gguf_tokenizer().apply_chat_template(&msgs, true).unwrap()
    );
}

#[test]
fn decode_round_trips_the_corpus() {
    let tok = gguf_tokenizer();
    let r = reference();
    let specials: Vec<String> = (0..tok.vocab_size() as u32)
        .filter(|&id| tok.is_special(id))
        .map(|id| tok.decode(&[id], false).unwrap())
        .collect();
    assert_eq!(specials.len(), 17, "SmolLM2 has 17 control tokens");
    for (i, text) in r.texts.iter().enumerate() {
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(&tok.decode(&ids, false).unwrap(), text);
        assert_eq!(&r.decoded[i], text, "the reference round-trips too");
        let without = specials
            .iter()
            .fold(text.clone(), |t, s| t.replace(s.as_str(), ""));
        assert_eq!(
            tok.decode(&ids, true).unwrap(),
            without,
            "skip_special_tokens on {text:?}"
        );
    }
}

/// The deltas of streaming `ids`, the last from `finish`.
fn stream(tok: &Tokenizer, ids: &[u32], skip: bool) -> Vec<String> {
    let mut d = tok.detokenizer(skip);
    let mut out: Vec<String> = ids
        .iter()
        .map(|&id| d.push(id).unwrap().to_owned())
        .collect();
    out.push(d.finish().to_owned());
    out
}

#[test]
fn streaming_the_corpus_gives_the_text_without_broken_characters() {
    let tok = gguf_tokenizer();
    for text in &reference().texts {
        let ids = tok.encode(text, false).unwrap();
        let deltas = stream(tok, &ids, false);
        assert_eq!(&deltas.concat(), text);
        assert!(
            deltas
                .iter()
                .all(|d| !d.contains(char::REPLACEMENT_CHARACTER)),
            "{text:?}: {deltas:?}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Random ids over the whole vocabulary (many are parts of multi-byte
    /// characters) mixed with the ids of random text, whose rare characters
    /// the vocabulary splits into byte tokens: the deltas add up to the full
    /// decode, and show U+FFFD only where the decode does.
    #[test]
    fn streamed_ids_equal_the_full_decode(
        segments in proptest::collection::vec(
            prop_oneof![
                (0u32..49_152).prop_map(|id| vec![id]),
                "\\PC{1,6}".prop_map(|text| gguf_tokenizer().encode(&text, false).unwrap()),
            ],
            0..24,
        ),
        skip in any::<bool>(),
    ) {
        let ids = segments.concat();
        let tok = gguf_tokenizer();
        let full = tok.decode(&ids, skip).unwrap();
        let deltas = stream(tok, &ids, skip);
        prop_assert_eq!(deltas.concat(), full.clone());
        if !full.contains(char::REPLACEMENT_CHARACTER) {
            prop_assert!(deltas.iter().all(|d| !d.contains(char::REPLACEMENT_CHARACTER)), "{:?}", deltas);
        }
    }
}

/// vLLM's `spaces_between_special_tokens`, for the tokenizers this engine
/// loads (byte-level BPE): what vLLM's fast detokenizer streams under either
/// value (Python `tokenizers`' `DecodeStream`, with vLLM's rule for `false`)
/// is what ours streams, special tokens kept, on texts with runs of special
/// tokens between them. So the server meets both values with one
/// detokenizer.
#[test]
fn streamed_special_tokens_match_vllm_under_either_spacing() {
    let r = reference();
    let tok = gguf_tokenizer();
    let specials: Vec<u32> = (0..tok.vocab_size() as u32)
        .filter(|&id| tok.is_special(id))
        .collect();
    // A fixed linear congruential sequence: the same cases every run.
    let mut state = 0x2545_f491_u64;
    let mut next = |n: usize| {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1);
        (state >> 33) as usize % n
    };
    let sequences: Vec<Vec<u32>> = (0..60)
        .map(|_| {
            let mut ids = Vec::new();
            for _ in 0..1 + next(6) {
                let run = (0..1 + next(3)).map(|_| specials[next(specials.len())]);
                ids.extend(run);
                ids.extend(&r.ids[next(r.ids.len())]);
            }
            ids
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("sequences.json");
    std::fs::write(&input, serde_json::to_string(&sequences).unwrap()).unwrap();
    let out = run_python(
        "decode_stream_ref.py",
        &[r.tokenizer_json.to_str().unwrap(), input.to_str().unwrap()],
    );
    let out: Value = serde_json::from_str(&out).expect("decode_stream_ref.py prints JSON");
    let texts = |key: &str| -> Vec<String> { serde_json::from_value(out[key].clone()).unwrap() };
    let ours: Vec<String> = sequences
        .iter()
        .map(|ids| stream(tok, ids, false).concat())
        .collect();
    assert!(
        ours.iter().any(|t| t.contains("|><|")),
        "some case has adjacent special tokens"
    );
    assert_eq!(ours, texts("spaced"), "spaces_between_special_tokens: true");
    assert_eq!(
        ours,
        texts("unspaced"),
        "spaces_between_special_tokens: false"
    );
}

#[test]
fn ids_outside_the_vocabulary_are_errors() {
    let tok = gguf_tokenizer();
    for id in [49_152, u32::MAX] {
        assert!(
            matches!(tok.decode(&[1, id], false), Err(TokenizerError::InvalidTokenId { id: bad, vocab_size: 49_152 }) if bad == id)
        );
        assert!(tok.detokenizer(true).push(id).is_err());
    }
}

/// Splits a ChatML prompt into (role, content) turns and whether it ends
/// with an open assistant header; panics if it is not ChatML.
fn chatml_turns(prompt: &str) -> (Vec<(String, String)>, bool) {
    let mut turns = Vec::new();
    let mut rest = prompt;
    while let Some(turn) = rest.strip_prefix("<|im_start|>") {
        let (role, after) = turn.split_once('\n').expect("a role line");
        match after.split_once("<|im_end|>\n") {
            Some((content, next)) => {
                turns.push((role.to_owned(), content.to_owned()));
                rest = next;
            }
            None => {
                assert_eq!(
                    (role, after),
                    ("assistant", ""),
                    "only the generation prompt is left open"
                );
                return (turns, true);
            }
        }
    }
    assert_eq!(rest, "", "trailing text after the last turn");
    (turns, false)
}

#[test]
fn chat_template_matches_jinja2_and_is_chatml() {
    let tok = gguf_tokenizer();
    let r = reference();
    let model = default_model();
    let corpus = corpus_path();
    let out = run_python(
        "chat_template_ref.py",
        &[model.to_str().unwrap(), corpus.to_str().unwrap()],
    );
    let expected: Vec<String> =
        serde_json::from_str(&out).expect("chat_template_ref.py prints a JSON list");
    assert_eq!(expected.len(), r.conversations.len());
    for ((messages, add_generation_prompt), want) in r.conversations.iter().zip(&expected) {
        let got = tok
            .apply_chat_template(messages, *add_generation_prompt)
            .unwrap();
        assert_eq!(&got, want, "conversation {messages:?}");

        let (turns, open) = chatml_turns(&got);
        assert_eq!(open, *add_generation_prompt);
        let given: Vec<(String, String)> = messages
            .iter()
            .map(|m| (m.role.clone(), m.content.clone()))
            .collect();
        let default_system = !messages.is_empty() && messages[0].role != "system";
        let (system, rest) = turns.split_at(usize::from(default_system));
        assert_eq!(rest, &given[..], "every message is one turn, in order");
        if let Some((role, content)) = system.first() {
            assert!(
                role == "system" && content.contains("SmolLM"),
                "default system prompt: {content:?}"
            );
        }
        // The markers become the special tokens when the prompt is encoded.
        let ids = tok.encode(&got, false).unwrap();
        let count = |id| ids.iter().filter(|&&x| x == id).count();
        assert_eq!(count(r.bos), turns.len() + usize::from(open));
        assert_eq!(count(r.eos), turns.len());
    }
}
