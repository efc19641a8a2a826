//! What one forward pass runs, and the checks that make running it safe.

use super::RunnerError;

/// One sequence's part of a step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SeqInput {
    /// Tokens of this sequence in the step: the prompt chunk for a prefill,
    /// 1 for a decode.
    pub query_len: usize,
    /// Tokens in the KV cache after this step, including this step's; the
    /// step's tokens sit at positions `context_len - query_len ..
    /// context_len`.
    pub context_len: usize,
    /// Physical KV-cache block of each logical block of the sequence;
    /// position `p` lives in block `block_table[p / block_size]`, slot
    /// `p % block_size`.
    pub block_table: Vec<u32>,
}

/// A flattened batch: sequence 0's query tokens, then sequence 1's, and so on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelInput {
    /// Token ids, `sum(query_len)` long.
    pub token_ids: Vec<u32>,
    /// Position of each token, `sum(query_len)` long.
    pub positions: Vec<u32>,
    /// The sequences, in the order of their tokens.
    pub seqs: Vec<SeqInput>,
}

impl ModelInput {
    /// One sequence's step: `tokens` at positions `start..`, after `start`
    /// tokens already in the cache, reading it through `block_table`.
    pub fn single(tokens: &[u32], start: usize, block_table: Vec<u32>) -> ModelInput {
        let end = start + tokens.len();
        ModelInput {
            token_ids: tokens.to_vec(),
            positions: (start as u32..end as u32).collect(),
            seqs: vec![SeqInput {
                query_len: tokens.len(),
                context_len: end,
                block_table,
            }],
        }
    }
}

/// The limits a batch is checked against.
pub(crate) struct Limits {
    /// Vocabulary size (token ids must be smaller).
    pub vocab_size: usize,
    /// Longest context (positions must be smaller).
    pub max_model_len: usize,
    /// Most tokens in one step (the scratch buffers' size).
    pub max_num_batched_tokens: usize,
    /// Blocks in the KV cache (block ids must be smaller).
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
}

impl ModelInput {
    /// Checks every invariant the forward pass relies on, so that a bad
    /// batch is an error naming the problem instead of a panic or a read of
    /// another sequence's cache.
    pub(crate) fn validate(&self, lim: &Limits) -> Result<(), RunnerError> {
        let bad = |msg: String| Err(RunnerError::Input(msg));
        if self.seqs.is_empty() {
            return bad("the batch has no sequences".into());
        }
        let n = self.token_ids.len();
        if self.positions.len() != n {
            return bad(format!(
                "{n} token ids but {} positions; give one position per token",
                self.positions.len()
            ));
        }
        let total: usize = self.seqs.iter().map(|s| s.query_len).sum();
        if total != n {
            return bad(format!(
                "the sequences' query_len sum to {total} but the batch has {n} tokens"
            ));
        }
        if n > lim.max_num_batched_tokens {
            return bad(format!(
                "{n} tokens exceed max_num_batched_tokens = {}; split the step or raise the limit",
                lim.max_num_batched_tokens
            ));
        }
        if let Some((i, &t)) = self
            .token_ids
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= lim.vocab_size)
        {
            return bad(format!(
                "token {i} has id {t}, outside the vocabulary of {} tokens",
                lim.vocab_size
            ));
        }
        let mut start = 0;
        for (s, seq) in self.seqs.iter().enumerate() {
            if seq.query_len == 0 {
                return bad(format!(
                    "sequence {s} has query_len 0; every sequence needs at least one token"
                ));
            }
            if seq.context_len < seq.query_len {
                return bad(format!(
                    "sequence {s}: context_len {} is smaller than query_len {}; context_len counts this step's tokens too",
                    seq.context_len, seq.query_len
                ));
            }
            if seq.context_len > lim.max_model_len {
                return bad(format!(
                    "sequence {s}: context_len {} exceeds max_model_len = {}",
                    seq.context_len, lim.max_model_len
                ));
            }
            let first = seq.context_len - seq.query_len;
            for (i, &p) in self.positions[start..start + seq.query_len]
                .iter()
                .enumerate()
            {
                if p as usize != first + i {
                    return bad(format!(
                        "sequence {s}: token {i} has position {p} but the step covers positions {first}..{}; \
                         positions must be the last query_len positions of the context",
                        seq.context_len
                    ));
                }
            }
            let needed = seq.context_len.div_ceil(lim.block_size);
            if seq.block_table.len() < needed {
                return bad(format!(
                    "sequence {s}: {} tokens need {needed} blocks of {} but the block table has {}",
                    seq.context_len,
                    lim.block_size,
                    seq.block_table.len()
                ));
            }
            if let Some(&b) = seq.block_table[..needed]
                .iter()
                .find(|&&b| b as usize >= lim.num_blocks)
            {
                return bad(format!(
                    "sequence {s}: block id {b} is outside the KV cache of {} blocks",
                    lim.num_blocks
                ));
            }
            start += seq.query_len;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            vocab_size: 100,
            max_model_len: 64,
            max_num_batched_tokens: 32,
            num_blocks: 8,
            block_size: 4,
        }
    }

    fn ok_input() -> ModelInput {
        ModelInput {
            token_ids: vec![1, 2, 3, 4],
            positions: vec![4, 5, 6, 9],
            seqs: vec![
                SeqInput {
                    query_len: 3,
                    context_len: 7,
                    block_table: vec![0, 1],
                },
                SeqInput {
                    query_len: 1,
                    context_len: 10,
                    block_table: vec![2, 3, 4],
                },
            ],
        }
    }

    fn err(input: &ModelInput) -> String {
        match input.validate(&limits()) {
            Err(RunnerError::Input(m)) => m,
            other => panic!("expected an input error, got {other:?}"),
        }
    }

    #[test]
    fn accepts_a_mixed_batch() {
        ok_input().validate(&limits()).unwrap();
    }

    #[test]
    fn rejects_each_broken_invariant() {
        let mut i = ok_input();
        i.seqs.clear();
        assert!(err(&i).contains("no sequences"));

        let mut i = ok_input();
        i.positions.pop();
        assert!(err(&i).contains("positions"));

        let mut i = ok_input();
        i.seqs[0].query_len = 2;
        assert!(err(&i).contains("sum to"));

        let mut i = ok_input();
        i.token_ids[2] = 100;
        assert!(err(&i).contains("outside the vocabulary"));

        let mut i = ok_input();
        i.seqs[1].context_len = 65;
        i.seqs[1].block_table = vec![0; 17];
        i.positions[3] = 64;
        assert!(err(&i).contains("max_model_len"));

        let mut i = ok_input();
        i.positions[1] = 7;
        assert!(err(&i).contains("position 7"));

        let mut i = ok_input();
        i.seqs[1].block_table.pop();
        assert!(err(&i).contains("need 3 blocks"));

        let mut i = ok_input();
        i.seqs[0].block_table[1] = 8;
        assert!(err(&i).contains("block id 8"));

        let mut i = ok_input();
        i.seqs[0].context_len = 2;
        assert!(err(&i).contains("smaller than query_len"));

        let mut i = ok_input();
        i.seqs[1].query_len = 0;
        i.seqs[0].query_len = 4;
        i.positions = vec![3, 4, 5, 6];
        assert!(err(&i).contains("query_len 0"));
    }

    #[test]
    fn rejects_oversized_steps() {
        let n = 33;
        let i = ModelInput {
            token_ids: vec![0; n],
            positions: (0..n as u32).collect(),
            seqs: vec![SeqInput {
                query_len: n,
                context_len: n,
                block_table: (0..9).collect(),
            }],
        };
        assert!(err(&i).contains("max_num_batched_tokens"));
    }
}
