//! Which decode batch sizes get a captured CUDA graph, and the padding of a
//! batch to the next captured size (vLLM's `cudagraph_capture_sizes`).
//!
//! vLLM captures 1, 2, 4, then every multiple of 8 below 256, then every
//! multiple of 16, up to the largest size (by default `max_num_seqs`, at most
//! 512). A batch runs the graph of the smallest captured size that holds it,
//! its extra rows padding; a larger batch runs eagerly.

use crate::model_runner::ModelInput;

/// The largest batch vLLM captures by default.
pub const MAX_CAPTURE_SIZE: usize = 512;

/// The captured sizes for `max_num_seqs`, ascending.
pub fn capture_sizes(max_num_seqs: usize) -> Vec<usize> {
    let max = max_num_seqs.min(MAX_CAPTURE_SIZE);
    let sizes = [1, 2, 4]
        .into_iter()
        .chain((8..256).step_by(8))
        .chain((256..=MAX_CAPTURE_SIZE).step_by(16));
    let mut out: Vec<usize> = sizes.take_while(|&s| s <= max).collect();
    // The largest batch the scheduler can form must have a graph too.
    if max > 0 && out.last() != Some(&max) {
        out.push(max);
    }
    out
}

/// The captured size a batch of `num_seqs` runs at, or `None` to run it
/// eagerly (empty, or larger than every captured size).
pub fn padded_batch_size(sizes: &[usize], num_seqs: usize) -> Option<usize> {
    if num_seqs == 0 {
        return None;
    }
    let at = sizes.partition_point(|&s| s < num_seqs);
    sizes.get(at).copied()
}

/// The captured size `input` replays, or `None` to run it eagerly: only a
/// pure decode batch (every sequence has exactly one query token) that some
/// captured size holds. `captured` is ascending (empty when graphs are off,
/// `enforce_eager`, or not captured yet). A prefill or mixed batch has a
/// per-step attention grid and token count, which a graph cannot follow.
pub fn decode_graph_size(captured: &[usize], input: &ModelInput) -> Option<usize> {
    let decode_only =
        input.token_ids.len() == input.seqs.len() && input.seqs.iter().all(|s| s.query_len == 1);
    if !decode_only {
        return None;
    }
    padded_batch_size(captured, input.seqs.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model_runner::SeqInput;

    fn batch(query_lens: &[usize]) -> ModelInput {
        let mut input = ModelInput::default();
        for &q in query_lens {
            for p in 0..q {
                input.token_ids.push(1);
                input.positions.push(p as u32);
            }
            input.seqs.push(SeqInput {
                query_len: q,
                context_len: q + 10,
                block_table: vec![0; 2],
            });
        }
        input
    }

    #[test]
    fn only_pure_decode_batches_that_fit_replay_a_graph() {
        let sizes = capture_sizes(8);
        assert_eq!(decode_graph_size(&sizes, &batch(&[1])), Some(1));
        assert_eq!(decode_graph_size(&sizes, &batch(&[1, 1, 1])), Some(4));
        assert_eq!(decode_graph_size(&sizes, &batch(&[1; 8])), Some(8));
        // Too large for every captured size: eager.
        assert_eq!(decode_graph_size(&sizes, &batch(&[1; 9])), None);
        // A prefill, or a decode mixed with a prefill chunk: eager.
        assert_eq!(decode_graph_size(&sizes, &batch(&[5])), None);
        assert_eq!(decode_graph_size(&sizes, &batch(&[1, 2, 1])), None);
        // Nothing captured (enforce_eager) or an empty step: eager.
        assert_eq!(decode_graph_size(&[], &batch(&[1])), None);
        assert_eq!(decode_graph_size(&sizes, &ModelInput::default()), None);
    }

    #[test]
    fn vllm_list_for_256_sequences() {
        let mut want = vec![1, 2, 4];
        want.extend((1..32).map(|i| 8 * i)); // 8 .. 248
        want.push(256);
        assert_eq!(capture_sizes(256), want);
    }

    #[test]
    fn above_256_steps_by_16_and_caps_at_512() {
        let s = capture_sizes(1024);
        assert_eq!(&s[s.len() - 3..], &[480, 496, 512]);
        assert!(s.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(s.iter().filter(|&&x| x > 256).count(), 16);
    }

    #[test]
    fn small_and_odd_maxima_include_the_maximum() {
        assert_eq!(capture_sizes(1), vec![1]);
        assert_eq!(capture_sizes(3), vec![1, 2, 3]);
        assert_eq!(capture_sizes(20), vec![1, 2, 4, 8, 16, 20]);
        assert_eq!(capture_sizes(0), Vec::<usize>::new());
    }

    #[test]
    fn batches_pad_to_the_next_captured_size() {
        let s = capture_sizes(256);
        assert_eq!(padded_batch_size(&s, 1), Some(1));
        assert_eq!(padded_batch_size(&s, 3), Some(4));
        assert_eq!(padded_batch_size(&s, 5), Some(8));
        assert_eq!(padded_batch_size(&s, 9), Some(16));
        assert_eq!(padded_batch_size(&s, 249), Some(256));
        assert_eq!(padded_batch_size(&s, 256), Some(256));
        assert_eq!(padded_batch_size(&s, 257), None);
        assert_eq!(padded_batch_size(&s, 0), None);
        // Every size up to the maximum pads to at most 2x (and at most +15 past 8).
        for n in 1..=256 {
            let p = padded_batch_size(&s, n).unwrap();
            assert!(p >= n && (p - n < 16 || p < 2 * n), "{n} -> {p}");
        }
    }
}
