//! The step's attention metadata as the kernels read it: block tables packed
//! into one padded `[num_seqs, max_blocks]` i32 array, the slot of every
//! token, query offsets and sequence lengths (vLLM's
//! `CommonAttentionMetadata`). Built on the host, copied once per step.

use crate::model_runner::ModelInput;

/// Device-layout metadata of one step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AttentionMetadata {
    /// `query_start[s]..query_start[s + 1]` are sequence `s`'s tokens;
    /// `num_seqs + 1` entries.
    pub query_start: Vec<i32>,
    /// Tokens of each sequence in the cache after the step.
    pub seq_lens: Vec<i32>,
    /// Row `s` holds sequence `s`'s block table, padded with block 0 (never
    /// read: a sequence reads only the blocks its length covers).
    pub block_tables: Vec<i32>,
    /// Row width of `block_tables`.
    pub max_blocks: usize,
    /// Cache slot (`block * block_size + offset`) each token writes; -1 for
    /// a padding token, which writes nothing.
    pub slot_mapping: Vec<i32>,
    /// Longest query of the step (sizes the attention grid).
    pub max_query_len: usize,
    /// Index of each sequence's last token (the rows the LM head reads).
    pub logits_rows: Vec<i32>,
}

impl AttentionMetadata {
    /// Packs `input` (already validated by the runner) for a cache of
    /// `block_size`-token blocks. `pad_seqs` extra decode sequences of one
    /// padding token each are appended, so the step matches a captured
    /// CUDA-graph batch size; their tokens write no slot and their outputs
    /// are dropped.
    pub fn build(input: &ModelInput, block_size: usize, pad_seqs: usize) -> AttentionMetadata {
        let max_blocks = input
            .seqs
            .iter()
            .map(|s| s.context_len.div_ceil(block_size))
            .max()
            .unwrap_or(0)
            .max(1);
        let num_seqs = input.seqs.len() + pad_seqs;
        let mut m = AttentionMetadata {
            query_start: Vec::with_capacity(num_seqs + 1),
            seq_lens: Vec::with_capacity(num_seqs),
            block_tables: vec![0; num_seqs * max_blocks],
            max_blocks,
            slot_mapping: Vec::with_capacity(input.token_ids.len() + pad_seqs),
            max_query_len: 0,
            logits_rows: Vec::with_capacity(num_seqs),
        };
        let mut start = 0usize;
        m.query_start.push(0);
        for (s, seq) in input.seqs.iter().enumerate() {
            let used = seq.context_len.div_ceil(block_size);
            for (dst, &b) in m.block_tables[s * max_blocks..]
                .iter_mut()
                .zip(&seq.block_table[..used])
            {
                *dst = b as i32;
            }
            for t in start..start + seq.query_len {
                let p = input.positions[t] as usize;
                let block = seq.block_table[p / block_size] as usize;
                m.slot_mapping
                    .push((block * block_size + p % block_size) as i32);
            }
            start += seq.query_len;
            m.query_start.push(start as i32);
            m.seq_lens.push(seq.context_len as i32);
            m.logits_rows.push(start as i32 - 1);
            m.max_query_len = m.max_query_len.max(seq.query_len);
        }
        for _ in 0..pad_seqs {
            m.slot_mapping.push(-1);
            start += 1;
            m.query_start.push(start as i32);
            m.seq_lens.push(1);
            m.logits_rows.push(start as i32 - 1);
            m.max_query_len = m.max_query_len.max(1);
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model_runner::SeqInput;

    /// A prefill chunk of 5 tokens after 3 cached ones (blocks 7, 2) and a
    /// decode at position 4 (blocks 9, 5), block size 4.
    fn input() -> ModelInput {
        ModelInput {
            token_ids: vec![10, 11, 12, 13, 14, 20],
            positions: vec![3, 4, 5, 6, 7, 4],
            seqs: vec![
                SeqInput {
                    query_len: 5,
                    context_len: 8,
                    block_table: vec![7, 2, 4],
                },
                SeqInput {
                    query_len: 1,
                    context_len: 5,
                    block_table: vec![9, 5],
                },
            ],
        }
    }

    #[test]
    fn packs_tables_slots_and_offsets_as_the_kernels_read_them() {
        let m = AttentionMetadata::build(&input(), 4, 0);
        assert_eq!(m.max_blocks, 2);
        // Only the blocks each length covers; the third block of sequence 0
        // is beyond its 8 tokens.
        assert_eq!(m.block_tables, vec![7, 2, 9, 5]);
        // Position 3 -> block 7 slot 3 = 31; 4..7 -> block 2 slots 0..3 = 8..11;
        // decode position 4 -> block 5 slot 0 = 20.
        assert_eq!(m.slot_mapping, vec![31, 8, 9, 10, 11, 20]);
        assert_eq!(m.query_start, vec![0, 5, 6]);
        assert_eq!(m.seq_lens, vec![8, 5]);
        assert_eq!(m.logits_rows, vec![4, 5]);
        assert_eq!(m.max_query_len, 5);
    }

    #[test]
    fn padding_sequences_write_nothing_and_read_one_token() {
        let m = AttentionMetadata::build(&input(), 4, 2);
        assert_eq!(m.block_tables, vec![7, 2, 9, 5, 0, 0, 0, 0]);
        assert_eq!(&m.slot_mapping[6..], &[-1, -1]);
        assert_eq!(m.query_start, vec![0, 5, 6, 7, 8]);
        assert_eq!(m.seq_lens, vec![8, 5, 1, 1]);
        assert_eq!(m.logits_rows, vec![4, 5, 6, 7]);
    }

    #[test]
    fn an_empty_step_still_has_one_column() {
        let m = AttentionMetadata::build(&ModelInput::default(), 16, 0);
        assert_eq!(m.max_blocks, 1);
        assert_eq!(m.query_start, vec![0]);
        assert!(m.block_tables.is_empty() && m.slot_mapping.is_empty());
    }
}
