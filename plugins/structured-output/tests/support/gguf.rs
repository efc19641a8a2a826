//! Reads a GGUF file's vocabulary (metadata only) for the tests and the
//! bench, so they can use the default model's real tokens without
//! depending on the host crate. Knows the `gpt2` (byte-level BPE)
//! tokenizer model, which SmolLM2 uses.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

/// A vocabulary in the WIT's flat layout.
pub struct Vocab {
    /// Every token's bytes, back to back.
    pub bytes: Vec<u8>,
    /// Where each token ends in `bytes`.
    pub ends: Vec<u32>,
    /// Control tokens.
    pub special: Vec<u32>,
    /// End of sequence.
    pub eos: u32,
}

/// The default model's GGUF, when it has been downloaded.
pub fn default_model() -> Option<std::path::PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    p.exists().then_some(p)
}

enum Meta {
    Tokens(Vec<String>),
    Types(Vec<i64>),
    Eos(u32),
    Model(String),
    Other,
}

/// Reads the vocabulary of the GGUF at `path`.
pub fn read_vocab(path: &Path) -> Result<Vocab, String> {
    let mut r = BufReader::new(File::open(path).map_err(|e| e.to_string())?);
    let mut magic = [0u8; 4];
    r.read_exact(&mut magic).map_err(|e| e.to_string())?;
    if &magic != b"GGUF" {
        return Err(format!("{} is not a GGUF file", path.display()));
    }
    let _version = u32_(&mut r)?;
    let _tensors = u64_(&mut r)?;
    let kvs = u64_(&mut r)?;
    let (mut tokens, mut types, mut eos, mut model) = (None, None, None, None);
    for _ in 0..kvs {
        let key = string(&mut r)?;
        let ty = u32_(&mut r)?;
        match read_value(&mut r, ty, &key)? {
            Meta::Tokens(t) => tokens = Some(t),
            Meta::Types(t) => types = Some(t),
            Meta::Eos(e) => eos = Some(e),
            Meta::Model(m) => model = Some(m),
            Meta::Other => {}
        }
    }
    if model.as_deref() != Some("gpt2") {
        return Err(format!("tokenizer model {model:?} is not gpt2"));
    }
    let tokens = tokens.ok_or("no tokenizer.ggml.tokens")?;
    let types = types.ok_or("no tokenizer.ggml.token_type")?;
    let unbyte = byte_decoder();
    let mut v = Vocab {
        bytes: Vec::new(),
        ends: Vec::new(),
        special: Vec::new(),
        eos: eos.ok_or("no tokenizer.ggml.eos_token_id")?,
    };
    for (id, (tok, ty)) in tokens.iter().zip(&types).enumerate() {
        // Type 3 is a control token: its text is literal, not byte-level.
        if *ty == 3 {
            v.special.push(id as u32);
            v.bytes.extend_from_slice(tok.as_bytes());
        } else {
            for ch in tok.chars() {
                let b = unbyte(ch).ok_or(format!("token {id} has char {ch:?}"))?;
                v.bytes.push(b);
            }
        }
        v.ends.push(v.bytes.len() as u32);
    }
    Ok(v)
}

/// GPT-2's byte-level alphabet, reversed: printable bytes stand for
/// themselves, the others were shifted to U+0100 and up, in byte order.
fn byte_decoder() -> impl Fn(char) -> Option<u8> {
    let printable = |b: u8| matches!(b, 33..=126 | 161..=172 | 174..=255);
    let mut table = std::collections::HashMap::new();
    let mut shifted = 256u32;
    for b in 0..=255u8 {
        if printable(b) {
            table.insert(char::from(b), b);
        } else {
            table.insert(char::from_u32(shifted).unwrap_or('\0'), b);
            shifted += 1;
        }
    }
    move |c| table.get(&c).copied()
}

fn read_value(r: &mut impl Read, ty: u32, key: &str) -> Result<Meta, String> {
    match (ty, key) {
        (9, "tokenizer.ggml.tokens") => {
            let (et, n) = (u32_(r)?, u64_(r)?);
            if et != 8 {
                return Err("tokens are not strings".into());
            }
            Ok(Meta::Tokens(
                (0..n).map(|_| string(r)).collect::<Result<_, _>>()?,
            ))
        }
        (9, "tokenizer.ggml.token_type") => {
            let (et, n) = (u32_(r)?, u64_(r)?);
            let vals = (0..n).map(|_| scalar(r, et)).collect::<Result<_, _>>()?;
            Ok(Meta::Types(vals))
        }
        (8, "tokenizer.ggml.model") => Ok(Meta::Model(string(r)?)),
        (_, "tokenizer.ggml.eos_token_id") => Ok(Meta::Eos(scalar(r, ty)? as u32)),
        (8, _) => string(r).map(|_| Meta::Other),
        (9, _) => {
            let (et, n) = (u32_(r)?, u64_(r)?);
            for _ in 0..n {
                if et == 8 {
                    string(r)?;
                } else {
                    scalar(r, et)?;
                }
            }
            Ok(Meta::Other)
        }
        _ => scalar(r, ty).map(|_| Meta::Other),
    }
}

/// A scalar of GGUF type `ty`, widened (floats by their bits; only their
/// size matters here).
fn scalar(r: &mut impl Read, ty: u32) -> Result<i64, String> {
    let size = match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        10..=12 => 8,
        _ => return Err(format!("unknown GGUF type {ty}")),
    };
    let mut buf = [0u8; 8];
    r.read_exact(&mut buf[..size]).map_err(|e| e.to_string())?;
    Ok(i64::from_le_bytes(buf))
}

fn u32_(r: &mut impl Read) -> Result<u32, String> {
    scalar(r, 4).map(|v| v as u32)
}

fn u64_(r: &mut impl Read) -> Result<u64, String> {
    scalar(r, 10).map(|v| v as u64)
}

fn string(r: &mut impl Read) -> Result<String, String> {
    let n = u64_(r)? as usize;
    let mut buf = vec![0u8; n];
    r.read_exact(&mut buf).map_err(|e| e.to_string())?;
    String::from_utf8(buf).map_err(|e| e.to_string())
}
