//! Which decode batch sizes get a captured CUDA graph, and the padding of a
//! batch to the next captured size (vLLM's `cudagraph_capture_sizes`).
//!
//! vLLM captures 1, 2, 4, then every multiple of 8 below 256, then every
//! multiple of 16, up to the largest size (by default `max_num_seqs`, at most
//! 512). A batch runs the graph of the smallest captured size that holds it,
//! its extra rows padding; a larger batch runs eagerly.

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

#[cfg(test)]
mod tests {
    use super::*;

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
