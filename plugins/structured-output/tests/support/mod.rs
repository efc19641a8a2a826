//! A small hand-made vocabulary and helpers to drive the processor the way
//! the host does, with expectations computed by plain string operations.
#![allow(dead_code)] // each test binary uses a different part

pub mod gguf;

use std::collections::BTreeSet;

use structured_output::processor::{Processor, Step, StepEdits};
use structured_output::vocab::FlatVocab;

/// End of sequence (special).
pub const EOS: u32 = 0;
/// Another special token, never allowed by a constraint.
pub const IM_START: u32 = 1;

/// The hand-made vocabulary: two specials, every printable ASCII byte and
/// newline, and a few longer tokens so masks have multi-byte choices.
pub struct Hand {
    /// Token bytes by id (special tokens as their text).
    pub tokens: Vec<Vec<u8>>,
    /// The processor under test, with this vocabulary set.
    pub p: Processor,
}

const LONGER: [&str; 16] = [
    "{\"", "\":", "\",", "\"}", "true", "false", "null", "name", "yes", "ye", "no", "may", "be",
    "aa", "12", "  ",
];

impl Hand {
    /// A processor with the hand-made vocabulary.
    pub fn new() -> Hand {
        let mut tokens: Vec<Vec<u8>> = vec![b"<|endoftext|>".to_vec(), b"<|im_start|>".to_vec()];
        tokens.push(b"\n".to_vec());
        tokens.extend((0x20u8..0x7f).map(|b| vec![b]));
        tokens.extend(LONGER.iter().map(|s| s.as_bytes().to_vec()));
        let mut bytes = Vec::new();
        let mut ends = Vec::new();
        for t in &tokens {
            bytes.extend_from_slice(t);
            ends.push(bytes.len() as u32);
        }
        let mut p = Processor::default();
        p.set_vocabulary(FlatVocab {
            token_bytes: &bytes,
            token_ends: &ends,
            special_ids: &[EOS, IM_START],
            eos: Some(EOS),
        })
        .expect("the hand vocabulary is valid");
        Hand { tokens, p }
    }

    /// The id of the token with exactly these bytes.
    pub fn id(&self, text: &str) -> u32 {
        self.tokens
            .iter()
            .position(|t| t == text.as_bytes())
            .unwrap_or_else(|| panic!("no token {text:?}")) as u32
    }

    /// Greedy longest-match tokenization over the normal tokens.
    pub fn tokenize(&self, text: &str) -> Vec<u32> {
        let mut rest = text.as_bytes();
        let mut out = Vec::new();
        while !rest.is_empty() {
            let (id, len) = (2..self.tokens.len())
                .filter(|&i| rest.starts_with(&self.tokens[i]))
                .map(|i| (i as u32, self.tokens[i].len()))
                .max_by_key(|&(_, len)| len)
                .unwrap_or_else(|| panic!("cannot tokenize {rest:?}"));
            out.push(id);
            rest = &rest[len..];
        }
        out
    }

    /// The normal tokens whose text is a non-empty prefix of one of `texts`
    /// (what a constraint whose language is exactly `texts` allows first).
    pub fn prefixes_of(&self, texts: &[&str]) -> BTreeSet<u32> {
        (2..self.tokens.len() as u32)
            .filter(|&i| {
                let t = &self.tokens[i as usize];
                texts.iter().any(|s| s.as_bytes().starts_with(t))
            })
            .collect()
    }
}

/// The set of ids a mask allows.
pub fn allowed(words: &[u64]) -> BTreeSet<u32> {
    let mut set = BTreeSet::new();
    for (i, w) in words.iter().enumerate() {
        for bit in 0..64 {
            if w & (1 << bit) != 0 {
                set.insert((i * 64 + bit) as u32);
            }
        }
    }
    set
}

/// One request's view of the host: announces it, then reports one sampled
/// token per step, as the worker does.
pub struct Request {
    /// Its id.
    pub id: u32,
    /// Tokens it has generated.
    pub outputs: Vec<u32>,
    args: Option<String>,
    /// Tokens the next announcement replays (a request re-announced after a
    /// fault).
    pub replay: Vec<u32>,
}

impl Request {
    /// A request with this `extra_args` JSON, not yet announced.
    pub fn new(id: u32, args: &str) -> Request {
        Request {
            id,
            outputs: Vec::new(),
            args: Some(args.to_owned()),
            replay: Vec::new(),
        }
    }

    /// One step for this request alone (announcing it the first time),
    /// with the rows `vocab_size` wide.
    pub fn step(&mut self, p: &mut Processor, vocab_size: u32) -> Result<StepEdits, String> {
        let args: Vec<String> = self.args.take().into_iter().collect();
        let ids: Vec<u32> = args.iter().map(|_| self.id).collect();
        let ends: Vec<u32> = args.iter().map(|_| self.replay.len() as u32).collect();
        let replay = std::mem::take(&mut self.replay);
        p.process(Step {
            added_ids: &ids,
            added_extra_args: &args,
            added_output_ends: &ends,
            added_output_tokens: &replay,
            ids: &[self.id],
            num_output_tokens: &[self.outputs.len() as u32],
            last_tokens: &[self.outputs.last().copied().unwrap_or(7)],
            vocab_size,
            ..Step::default()
        })
    }

    /// A step whose single row must get a mask: the allowed ids.
    pub fn mask(&mut self, p: &mut Processor, vocab_size: u32) -> BTreeSet<u32> {
        let e = self.step(p, vocab_size).expect("a well-formed batch");
        assert_eq!(e.fail_messages, Vec::<String>::new());
        assert_eq!(e.mask_rows, vec![0]);
        assert_eq!(e.mask_words.len(), (vocab_size as usize).div_ceil(64));
        allowed(&e.mask_words)
    }
}
