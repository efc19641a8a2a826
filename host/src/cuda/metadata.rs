//! The step's attention metadata as the kernels read it: block tables packed
//! into one padded `[num_seqs, max_blocks]` i32 array, the slot of every
//! token, query offsets and sequence lengths (vLLM's
//! `CommonAttentionMetadata`). Built on the host and uploaded in one copy:
//! [`AttentionMetadata::pack`] lays it out with the token ids and positions
//! as one i32 array ([`StepLayout`]), the layout a captured CUDA graph reads
//! from its fixed addresses.

use std::ops::Range;

use crate::model_runner::ModelInput;

/// Device-layout metadata of one step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AttentionMetadata {
    /// `query_start[s]..query_start[s + 1]` are sequence `s`'s tokens;
    /// `num_seqs + 1` entries.
    pub query_start: Vec<i32>,
    /// Tokens of each sequence in the cache after the step; 0 for a padding
    /// sequence (the attention kernels give it no key and write zeros).
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

/// A block table wider than the fixed width of the captured CUDA graphs.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "sequence {seq} needs {blocks} blocks but the CUDA-graph block tables hold {width} \
     (max_model_len / block_size); raise max_model_len or run the step eagerly"
)]
pub struct TableTooWide {
    /// The sequence.
    pub seq: usize,
    /// Blocks its context covers.
    pub blocks: usize,
    /// The fixed width.
    pub width: usize,
}

impl AttentionMetadata {
    /// Packs `input` (already validated by the runner) for a cache of
    /// `block_size`-token blocks, tables as wide as the longest context.
    /// `pad_seqs` extra decode sequences of one padding token each are
    /// appended, so the step matches a captured CUDA-graph batch size; their
    /// tokens write no slot, read no key, and their outputs are dropped.
    pub fn build(input: &ModelInput, block_size: usize, pad_seqs: usize) -> AttentionMetadata {
        let width = input
            .seqs
            .iter()
            .map(|s| s.context_len.div_ceil(block_size))
            .max()
            .unwrap_or(0)
            .max(1);
        Self::build_unchecked(input, block_size, pad_seqs, width)
    }

    /// As [`build`](Self::build), with tables exactly `width` wide (a
    /// CUDA graph's fixed `ceil(max_model_len / block_size)`); a sequence
    /// whose context needs more blocks is an error rather than a truncation.
    pub fn build_fixed(
        input: &ModelInput,
        block_size: usize,
        pad_seqs: usize,
        width: usize,
    ) -> Result<AttentionMetadata, TableTooWide> {
        for (seq, s) in input.seqs.iter().enumerate() {
            let blocks = s.context_len.div_ceil(block_size);
            if blocks > width {
                return Err(TableTooWide { seq, blocks, width });
            }
        }
        Ok(Self::build_unchecked(input, block_size, pad_seqs, width))
    }

    /// The packing; every context fits `width` blocks.
    fn build_unchecked(
        input: &ModelInput,
        block_size: usize,
        pad_seqs: usize,
        max_blocks: usize,
    ) -> AttentionMetadata {
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
            m.seq_lens.push(0);
            m.logits_rows.push(start as i32 - 1);
            m.max_query_len = m.max_query_len.max(1);
        }
        m
    }

    /// The layout [`pack`](Self::pack) writes.
    pub fn layout(&self) -> StepLayout {
        StepLayout {
            tokens: self.slot_mapping.len(),
            seqs: self.seq_lens.len(),
            width: self.max_blocks,
        }
    }

    /// The step's token ids, positions and this metadata as one i32 array in
    /// [`layout`](Self::layout) order, for a single upload. Padding tokens
    /// (those past `input`'s) are token 0 at position 0.
    pub fn pack(&self, input: &ModelInput) -> Vec<i32> {
        let l = self.layout();
        let mut out = Vec::with_capacity(l.size());
        let pad = l.tokens - input.token_ids.len();
        for v in [&input.token_ids, &input.positions] {
            out.extend(v.iter().map(|&x| x as i32));
            out.extend(std::iter::repeat_n(0, pad));
        }
        for part in [
            &self.slot_mapping,
            &self.query_start,
            &self.seq_lens,
            &self.logits_rows,
            &self.block_tables,
        ] {
            out.extend_from_slice(part);
        }
        out
    }
}

/// Where each array of a packed step lies in its i32 buffer: token ids,
/// positions and slots (`tokens` each), query starts (`seqs + 1`), sequence
/// lengths and logits rows (`seqs` each), block tables (`seqs × width`).
/// A function of the three sizes only, so a CUDA graph captured for them
/// reads every later step of the same sizes from the same offsets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepLayout {
    /// Tokens of the step (padding included).
    pub tokens: usize,
    /// Sequences of the step (padding included).
    pub seqs: usize,
    /// Block-table row width.
    pub width: usize,
}

impl StepLayout {
    /// Token ids.
    pub fn token_ids(&self) -> Range<usize> {
        0..self.tokens
    }
    /// Positions.
    pub fn positions(&self) -> Range<usize> {
        self.tokens..2 * self.tokens
    }
    /// Slot mapping.
    pub fn slot_mapping(&self) -> Range<usize> {
        2 * self.tokens..3 * self.tokens
    }
    /// Query starts (`seqs + 1`).
    pub fn query_start(&self) -> Range<usize> {
        let at = 3 * self.tokens;
        at..at + self.seqs + 1
    }
    /// Sequence lengths.
    pub fn seq_lens(&self) -> Range<usize> {
        let at = self.query_start().end;
        at..at + self.seqs
    }
    /// Logits rows.
    pub fn logits_rows(&self) -> Range<usize> {
        let at = self.seq_lens().end;
        at..at + self.seqs
    }
    /// Block tables.
    pub fn block_tables(&self) -> Range<usize> {
        let at = self.logits_rows().end;
        at..at + self.seqs * self.width
    }
    /// Elements of the whole packed step.
    pub fn size(&self) -> usize {
        self.block_tables().end
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
    fn padding_sequences_write_nothing_and_read_nothing() {
        let m = AttentionMetadata::build(&input(), 4, 2);
        assert_eq!(m.block_tables, vec![7, 2, 9, 5, 0, 0, 0, 0]);
        assert_eq!(&m.slot_mapping[6..], &[-1, -1]);
        assert_eq!(m.query_start, vec![0, 5, 6, 7, 8]);
        // Length 0: the attention kernels give a padding row no key.
        assert_eq!(m.seq_lens, vec![8, 5, 0, 0]);
        assert_eq!(m.logits_rows, vec![4, 5, 6, 7]);
    }

    /// Three decodes (contexts 5, 1, 9 over blocks of 4) padded to a
    /// captured batch of 4 with tables of the fixed width 3.
    fn decodes() -> ModelInput {
        let seq = |context_len: usize, block_table: Vec<u32>| SeqInput {
            query_len: 1,
            context_len,
            block_table,
        };
        ModelInput {
            token_ids: vec![41, 42, 43],
            positions: vec![4, 0, 8],
            seqs: vec![seq(5, vec![6, 1]), seq(1, vec![3]), seq(9, vec![2, 7, 5])],
        }
    }

    #[test]
    fn a_padded_decode_batch_packs_into_the_fixed_graph_layout() {
        let m = AttentionMetadata::build_fixed(&decodes(), 4, 1, 3).unwrap();
        let l = m.layout();
        assert_eq!(
            l,
            StepLayout {
                tokens: 4,
                seqs: 4,
                width: 3
            }
        );
        let p = m.pack(&decodes());
        assert_eq!(p.len(), l.size());
        assert_eq!(l.size(), 4 * 3 + 5 + 4 + 4 + 4 * 3);
        assert_eq!(&p[l.token_ids()], &[41, 42, 43, 0]);
        assert_eq!(&p[l.positions()], &[4, 0, 8, 0]);
        // 4 -> block 1 slot 0; 0 -> block 3 slot 0; 8 -> block 5 slot 0.
        assert_eq!(&p[l.slot_mapping()], &[4, 12, 20, -1]);
        assert_eq!(&p[l.query_start()], &[0, 1, 2, 3, 4]);
        assert_eq!(&p[l.seq_lens()], &[5, 1, 9, 0]);
        assert_eq!(&p[l.logits_rows()], &[0, 1, 2, 3]);
        // Rows of the fixed width 3, unused columns and the padding row 0.
        assert_eq!(&p[l.block_tables()], &[6, 1, 0, 3, 0, 0, 2, 7, 5, 0, 0, 0]);
    }

    #[test]
    fn the_layout_depends_only_on_its_sizes() {
        // Two different batches of the same padded size share every offset,
        // which is what lets one captured graph serve both.
        let a = AttentionMetadata::build_fixed(&decodes(), 4, 1, 8).unwrap();
        let one = ModelInput::single(&[9], 30, (0..8).collect());
        let b = AttentionMetadata::build_fixed(&one, 4, 3, 8).unwrap();
        assert_eq!(a.layout(), b.layout());
        let pb = b.pack(&one);
        assert_eq!(&pb[b.layout().seq_lens()], &[31, 0, 0, 0]);
        assert_eq!(&pb[b.layout().slot_mapping()], &[7 * 4 + 2, -1, -1, -1]);
    }

    #[test]
    fn a_table_wider_than_the_graph_width_is_an_error_not_a_truncation() {
        let err = AttentionMetadata::build_fixed(&decodes(), 4, 1, 2).unwrap_err();
        assert_eq!(
            err,
            TableTooWide {
                seq: 2,
                blocks: 3,
                width: 2
            }
        );
        assert!(err.to_string().contains("max_model_len"), "{err}");
    }

    #[test]
    fn an_all_padding_batch_writes_nothing_and_reads_nothing() {
        // What graph capture runs: every row is padding.
        let m = AttentionMetadata::build_fixed(&ModelInput::default(), 16, 3, 5).unwrap();
        let p = m.pack(&ModelInput::default());
        let l = m.layout();
        assert_eq!(&p[l.slot_mapping()], &[-1, -1, -1]);
        assert_eq!(&p[l.seq_lens()], &[0, 0, 0]);
        assert_eq!(&p[l.token_ids()], &[0, 0, 0]);
        assert_eq!(p.len(), l.size());
    }

    #[test]
    fn an_eager_step_packs_at_its_own_width() {
        let m = AttentionMetadata::build(&input(), 4, 0);
        let p = m.pack(&input());
        let l = m.layout();
        assert_eq!(l.width, 2);
        assert_eq!(&p[l.token_ids()], &[10, 11, 12, 13, 14, 20]);
        assert_eq!(&p[l.positions()], &[3, 4, 5, 6, 7, 4]);
        assert_eq!(&p[l.block_tables()], &[7, 2, 9, 5]);
        assert_eq!(&p[l.logits_rows()], &[4, 5]);
    }

    #[test]
    fn an_empty_step_still_has_one_column() {
        let m = AttentionMetadata::build(&ModelInput::default(), 16, 0);
        assert_eq!(m.max_blocks, 1);
        assert_eq!(m.query_start, vec![0]);
        assert!(m.block_tables.is_empty() && m.slot_mapping.is_empty());
    }
}
