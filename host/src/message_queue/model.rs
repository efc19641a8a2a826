//! An exhaustive interleaving check of the ring protocol in `queue.rs`.
//!
//! The writer and two readers are modelled step by step, one shared-memory
//! access per step, exactly in the order `queue.rs` performs them; a DFS over
//! every interleaving (sequentially consistent) checks that no reader reads a
//! chunk while the writer writes it, that every reader gets every message
//! once and in order, and that no interleaving deadlocks. Mutants of the
//! protocol must be caught, which shows the checker can fail. (The
//! Release/Acquire pairs in `queue.rs` give these steps the same order on
//! every architecture; this model checks the order itself.)

use std::collections::HashSet;

const CHUNKS: usize = 2;
const READERS: usize = 2;
const MESSAGES: u64 = 6;

/// The protocol as implemented, or a deliberately broken variant.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    Correct,
    /// Publishes `written` before clearing the read flags.
    PublishBeforeClear,
    /// Reuses a chunk without checking the read flags.
    NoFlagCheck,
    /// A reader sets its read flag before it reads the payload.
    EarlyRelease,
}

#[derive(Clone, PartialEq, Eq, Hash, Debug)]
struct Chunk {
    written: u64,
    data: Option<u64>,
    writing: bool,
    read: [u8; READERS],
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum WriterPc {
    CheckFlag(usize),
    BeginWrite,
    EndWrite,
    ClearFlag(usize),
    Publish,
    Done,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum ReaderPc {
    Wait,
    Read,
    SetFlag,
    /// `EarlyRelease` only: the flag is set, the payload still to be read.
    ReadAfterRelease,
}

#[derive(Clone, PartialEq, Eq, Hash, Debug)]
struct State {
    chunks: [Chunk; CHUNKS],
    w_seq: u64,
    w_pc: WriterPc,
    r_seq: [u64; READERS],
    r_pc: [ReaderPc; READERS],
}

impl State {
    fn initial(v: Variant) -> State {
        let chunk = Chunk {
            written: 0,
            data: None,
            writing: false,
            read: [1; READERS],
        };
        State {
            chunks: std::array::from_fn(|_| chunk.clone()),
            w_seq: 0,
            w_pc: if v == Variant::NoFlagCheck {
                WriterPc::BeginWrite
            } else {
                WriterPc::CheckFlag(0)
            },
            r_seq: [0; READERS],
            r_pc: [ReaderPc::Wait; READERS],
        }
    }

    /// Advances the writer one step; `None` if it is blocked or done.
    fn step_writer(&self, v: Variant) -> Option<State> {
        let mut s = self.clone();
        let c = (s.w_seq % CHUNKS as u64) as usize;
        let first_step = if v == Variant::NoFlagCheck {
            WriterPc::BeginWrite
        } else {
            WriterPc::CheckFlag(0)
        };
        s.w_pc = match self.w_pc {
            WriterPc::Done => return None,
            WriterPc::CheckFlag(r) if s.chunks[c].read[r] == 1 => {
                if r + 1 < READERS {
                    WriterPc::CheckFlag(r + 1)
                } else {
                    WriterPc::BeginWrite
                }
            }
            WriterPc::CheckFlag(_) => return None,
            WriterPc::BeginWrite => {
                s.chunks[c].writing = true;
                s.chunks[c].data = None;
                WriterPc::EndWrite
            }
            WriterPc::EndWrite => {
                s.chunks[c].writing = false;
                s.chunks[c].data = Some(s.w_seq);
                if v == Variant::PublishBeforeClear {
                    WriterPc::Publish
                } else {
                    WriterPc::ClearFlag(0)
                }
            }
            WriterPc::ClearFlag(r) => {
                s.chunks[c].read[r] = 0;
                match (r + 1 < READERS, v == Variant::PublishBeforeClear) {
                    (true, _) => WriterPc::ClearFlag(r + 1),
                    (false, false) => WriterPc::Publish,
                    (false, true) => s.next_message(first_step),
                }
            }
            WriterPc::Publish => {
                s.chunks[c].written = s.w_seq + 1;
                if v == Variant::PublishBeforeClear {
                    WriterPc::ClearFlag(0)
                } else {
                    s.next_message(first_step)
                }
            }
        };
        Some(s)
    }

    fn next_message(&mut self, first_step: WriterPc) -> WriterPc {
        self.w_seq += 1;
        if self.w_seq == MESSAGES {
            WriterPc::Done
        } else {
            first_step
        }
    }

    /// Advances reader `r` one step; `Err` on a protocol violation.
    fn step_reader(&self, v: Variant, r: usize) -> Result<Option<State>, String> {
        let mut s = self.clone();
        let seq = s.r_seq[r];
        if seq == MESSAGES {
            return Ok(None);
        }
        let c = (seq % CHUNKS as u64) as usize;
        s.r_pc[r] = match self.r_pc[r] {
            ReaderPc::Wait => {
                if s.chunks[c].written <= seq {
                    return Ok(None);
                }
                if v == Variant::EarlyRelease {
                    ReaderPc::SetFlag
                } else {
                    ReaderPc::Read
                }
            }
            ReaderPc::Read | ReaderPc::ReadAfterRelease => {
                let chunk = &s.chunks[c];
                if chunk.writing || chunk.data != Some(seq) {
                    return Err(format!(
                        "reader {r} read {:?} (writing: {}) expecting message {seq}",
                        chunk.data, chunk.writing
                    ));
                }
                if self.r_pc[r] == ReaderPc::Read {
                    ReaderPc::SetFlag
                } else {
                    s.r_seq[r] += 1;
                    ReaderPc::Wait
                }
            }
            ReaderPc::SetFlag => {
                s.chunks[c].read[r] = 1;
                if v == Variant::EarlyRelease {
                    ReaderPc::ReadAfterRelease
                } else {
                    s.r_seq[r] += 1;
                    ReaderPc::Wait
                }
            }
        };
        Ok(Some(s))
    }

    fn finished(&self) -> bool {
        self.w_pc == WriterPc::Done && self.r_seq.iter().all(|&s| s == MESSAGES)
    }
}

/// Explores every interleaving; returns the number of distinct states or the
/// first violation found.
fn check(v: Variant) -> Result<usize, String> {
    let mut seen = HashSet::new();
    let mut stack = vec![State::initial(v)];
    while let Some(s) = stack.pop() {
        if !seen.insert(s.clone()) {
            continue;
        }
        let mut successors = Vec::new();
        successors.extend(s.step_writer(v));
        for r in 0..READERS {
            successors.extend(s.step_reader(v, r)?);
        }
        // A waiting reader that re-polls without change is not progress.
        successors.retain(|n| n != &s);
        if successors.is_empty() && !s.finished() {
            return Err(format!("deadlock in {s:?}"));
        }
        stack.extend(successors);
    }
    Ok(seen.len())
}

#[test]
fn the_protocol_is_safe_and_live_in_every_interleaving() {
    let states = check(Variant::Correct).expect("the protocol must hold");
    assert!(
        states > 500,
        "only {states} states explored; the model is too small to mean much"
    );
}

#[test]
fn the_checker_catches_broken_variants() {
    for v in [
        Variant::PublishBeforeClear,
        Variant::NoFlagCheck,
        Variant::EarlyRelease,
    ] {
        assert!(check(v).is_err(), "{v:?} should violate the protocol");
    }
}
