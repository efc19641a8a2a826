//! Paged K/V storage: `num_blocks` blocks of `block_size` token slots per
//! layer, for K and for V.
//!
//! Layout (outermost first): `[layer][block][kv_head][slot][head_dim]`. The
//! attention of one query head walks its sequence's blocks and, inside each,
//! reads one `[block_size, head_dim]` tile of its KV head: contiguous memory
//! per block, so decode attention streams whole cache lines and the hardware
//! prefetcher follows.
//!
//! Values are f32, which keeps a conversion out of the innermost attention
//! loop. Per token of context SmolLM2 stores 46 KB of K/V, so a decode at
//! context 128 reads ~6 MB of cache beside ~97 MB of weights, and at 512
//! ~24 MB: f16 storage would halve that at long contexts. Not yet measured.

use super::RunnerError;

/// The dimensions of a KV cache (everything but the number of blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCacheShape {
    /// Transformer layers.
    pub num_layers: usize,
    /// Key/value heads per layer.
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Token slots per block.
    pub block_size: usize,
}

impl KvCacheShape {
    /// Floats of one block of one layer, for K (or for V).
    fn block_floats(&self) -> usize {
        self.num_kv_heads * self.block_size * self.head_dim
    }

    /// Bytes one block takes across all layers, K and V together: the unit
    /// the engine divides its KV-cache memory budget by.
    pub fn bytes_per_block(&self) -> usize {
        2 * self.num_layers * self.block_floats() * std::mem::size_of::<f32>()
    }
}

/// The paged KV cache of every layer.
pub struct KvCache {
    /// Dimensions.
    shape: KvCacheShape,
    /// Number of blocks.
    num_blocks: usize,
    /// Keys, `[layer][block][kv_head][slot][head_dim]`.
    k: Vec<f32>,
    /// Values, same layout.
    v: Vec<f32>,
}

impl KvCache {
    /// Allocates `num_blocks` zeroed blocks; fails with the size requested
    /// when the memory is not available (instead of aborting the process).
    pub fn new(shape: KvCacheShape, num_blocks: usize) -> Result<KvCache, RunnerError> {
        let alloc_err = |reason: &str| RunnerError::KvAlloc {
            num_blocks,
            bytes: shape.bytes_per_block().saturating_mul(num_blocks),
            reason: reason.to_string(),
        };
        if num_blocks == 0 || shape.block_size == 0 {
            return Err(alloc_err(
                "the cache needs at least one block of at least one slot",
            ));
        }
        let floats = shape
            .num_layers
            .checked_mul(num_blocks)
            .and_then(|x| x.checked_mul(shape.block_floats()))
            .ok_or_else(|| alloc_err("the size overflows usize"))?;
        // Zeroed by the allocator, not by a write: a cache this large comes
        // from fresh anonymous pages, which take no memory until a block is
        // first written, so resident memory follows the blocks in use.
        let zeroed = || -> Result<Vec<f32>, RunnerError> {
            let layout = std::alloc::Layout::array::<f32>(floats)
                .map_err(|_| alloc_err("the size overflows the address space"))?;
            if layout.size() == 0 {
                return Err(alloc_err("a block of this shape holds no values"));
            }
            // SAFETY: `layout` is not zero-sized (checked just above).
            let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<f32>();
            if ptr.is_null() {
                return Err(alloc_err("the system cannot allocate that much memory"));
            }
            // SAFETY: allocated by the global allocator with the layout of
            // `floats` f32s, all zero bits (0.0), so owning it as a Vec of
            // that length and capacity is sound.
            Ok(unsafe { Vec::from_raw_parts(ptr, floats, floats) })
        };
        Ok(KvCache {
            shape,
            num_blocks,
            k: zeroed()?,
            v: zeroed()?,
        })
    }

    /// Dimensions.
    pub fn shape(&self) -> KvCacheShape {
        self.shape
    }

    /// Number of blocks.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Offset of the `[block_size, head_dim]` tile of (`layer`, `block`, `head`).
    #[inline]
    fn tile_offset(&self, layer: usize, block: usize, head: usize) -> usize {
        let s = &self.shape;
        ((layer * self.num_blocks + block) * s.num_kv_heads + head) * s.block_size * s.head_dim
    }

    /// Stores one token's keys and values (`[kv_heads * head_dim]` each) in
    /// `slot` of `block`. The caller has validated `block` and `slot`.
    pub(crate) fn write(&mut self, layer: usize, block: usize, slot: usize, k: &[f32], v: &[f32]) {
        let hd = self.shape.head_dim;
        for h in 0..self.shape.num_kv_heads {
            let at = self.tile_offset(layer, block, h) + slot * hd;
            self.k[at..at + hd].copy_from_slice(&k[h * hd..(h + 1) * hd]);
            self.v[at..at + hd].copy_from_slice(&v[h * hd..(h + 1) * hd]);
        }
    }

    /// The key tile `[block_size, head_dim]` of (`layer`, `block`, `head`).
    #[inline]
    pub(crate) fn k_tile(&self, layer: usize, block: usize, head: usize) -> &[f32] {
        let at = self.tile_offset(layer, block, head);
        &self.k[at..at + self.shape.block_size * self.shape.head_dim]
    }

    /// The value tile `[block_size, head_dim]` of (`layer`, `block`, `head`).
    #[inline]
    pub(crate) fn v_tile(&self, layer: usize, block: usize, head: usize) -> &[f32] {
        let at = self.tile_offset(layer, block, head);
        &self.v[at..at + self.shape.block_size * self.shape.head_dim]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: KvCacheShape = KvCacheShape {
        num_layers: 2,
        num_kv_heads: 3,
        head_dim: 4,
        block_size: 5,
    };

    #[test]
    fn bytes_per_block_counts_k_and_v_of_every_layer() {
        assert_eq!(SHAPE.bytes_per_block(), 2 * 2 * 3 * 5 * 4 * 4);
    }

    #[test]
    fn writes_land_in_their_own_tile_and_slot() {
        let mut c = KvCache::new(SHAPE, 3).unwrap();
        let k: Vec<f32> = (0..12).map(|x| x as f32).collect();
        let v: Vec<f32> = (0..12).map(|x| -(x as f32)).collect();
        c.write(1, 2, 3, &k, &v);
        for layer in 0..2 {
            for block in 0..3 {
                for head in 0..3 {
                    let (kt, vt) = (c.k_tile(layer, block, head), c.v_tile(layer, block, head));
                    for slot in 0..5 {
                        let hit = (layer, block, slot) == (1, 2, 3);
                        let want_k: Vec<f32> = if hit {
                            k[head * 4..head * 4 + 4].to_vec()
                        } else {
                            vec![0.0; 4]
                        };
                        let want_v: Vec<f32> = if hit {
                            v[head * 4..head * 4 + 4].to_vec()
                        } else {
                            vec![0.0; 4]
                        };
                        assert_eq!(&kt[slot * 4..slot * 4 + 4], &want_k[..]);
                        assert_eq!(&vt[slot * 4..slot * 4 + 4], &want_v[..]);
                    }
                }
            }
        }
    }

    /// A cache takes memory only for the blocks written: 4 GiB of blocks
    /// allocated and one written leave the resident set nearly unchanged.
    #[cfg(target_os = "linux")]
    #[test]
    fn untouched_blocks_take_no_memory() {
        let rss_mib = || {
            let status = std::fs::read_to_string("/proc/self/status").unwrap();
            let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
            line.split_whitespace()
                .nth(1)
                .unwrap()
                .parse::<usize>()
                .unwrap()
                / 1024
        };
        let shape = KvCacheShape {
            num_layers: 30,
            num_kv_heads: 3,
            head_dim: 64,
            block_size: 16,
        };
        let num_blocks = (4 << 30) / shape.bytes_per_block();
        let before = rss_mib();
        let mut c = KvCache::new(shape, num_blocks).unwrap();
        c.write(0, 0, 0, &[1.0; 192], &[1.0; 192]);
        let grown = rss_mib().saturating_sub(before);
        assert!(
            grown < 1024,
            "a 4 GiB cache with one slot written grew RSS by {grown} MiB"
        );
        assert_eq!(c.k_tile(29, num_blocks - 1, 2)[..64], [0.0; 64]);
    }

    #[test]
    fn refuses_empty_and_overflowing_caches() {
        assert!(matches!(
            KvCache::new(SHAPE, 0),
            Err(RunnerError::KvAlloc { .. })
        ));
        let err = KvCache::new(SHAPE, usize::MAX / 4)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("overflows") || err.contains("allocate"),
            "{err}"
        );
    }
}
