//! Paged K/V storage: `num_blocks` blocks of `block_size` token slots per
//! layer, for K and for V.
//!
//! Layout (outermost first): `[block][layer][kv_head][slot][head_dim]`. The
//! attention of one query head walks its sequence's blocks and, inside each,
//! reads one `[block_size, head_dim]` tile of its KV head: contiguous memory
//! per block, so decode attention streams whole cache lines. A block's
//! tiles of every layer lie together (360 KiB of K for SmolLM2 in f32),
//! so the cache, which takes memory a 2 MiB page at a time where huge
//! pages are on ([`Pages`]), still holds memory only for the blocks in use
//! and their neighbours, not a huge page per layer for the first block.
//!
//! Values are stored as `cache.cache_dtype` says ([`KvDtype`]): f32 by
//! default, which keeps K and V exactly as computed, or f16 / bf16, which
//! halve the cache and the bytes a decode reads (per token of context
//! SmolLM2 stores 46 KB of f32 K/V, so a decode at context 4096 reads
//! 189 MB of cache beside ~97 MB of weights). Attention widens each value
//! to f32 as it loads it ([`KvElem`]).

use half::{bf16, f16};

use super::RunnerError;
use crate::config::CacheDtype;
use crate::kernels::{KvElem, Pages};

/// The element type of a KV cache, resolved from `cache.cache_dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    /// IEEE single precision.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
}

impl KvDtype {
    /// What `cache.cache_dtype` means on the CPU: `auto` is f32, the type
    /// the CPU runner computes in.
    pub fn for_cpu(dtype: CacheDtype) -> KvDtype {
        match dtype {
            CacheDtype::Auto | CacheDtype::Float32 => KvDtype::F32,
            CacheDtype::Float16 => KvDtype::F16,
            CacheDtype::Bfloat16 => KvDtype::Bf16,
        }
    }

    /// Bytes of one value.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
        }
    }
}

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
    /// The element type.
    pub dtype: KvDtype,
}

impl KvCacheShape {
    /// Values of one block of one layer, for K (or for V).
    fn block_values(&self) -> usize {
        self.num_kv_heads * self.block_size * self.head_dim
    }

    /// Bytes one block takes across all layers, K and V together: the unit
    /// the engine divides its KV-cache memory budget by.
    pub fn bytes_per_block(&self) -> usize {
        2 * self.num_layers * self.block_values() * self.dtype.bytes()
    }

    /// Offset of the `[block_size, head_dim]` tile of (`layer`, `block`,
    /// `head`).
    #[inline]
    fn tile_offset(&self, layer: usize, block: usize, head: usize) -> usize {
        ((block * self.num_layers + layer) * self.num_kv_heads + head)
            * self.block_size
            * self.head_dim
    }
}

/// Keys and values of one element type, `[block][layer][kv_head][slot][head_dim]`,
/// on fresh pages ([`Pages`]): they take no memory until first written, so
/// resident memory follows the blocks in use, and they lie on huge pages
/// where the system allows, which a decode over a long context, reading a
/// tile per block, needs.
struct Planes<E: KvElem> {
    k: Pages<E>,
    v: Pages<E>,
}

/// The cache's storage, by element type.
enum Storage {
    F32(Planes<f32>),
    F16(Planes<f16>),
    Bf16(Planes<bf16>),
}

/// The paged KV cache of every layer.
pub struct KvCache {
    /// Dimensions.
    shape: KvCacheShape,
    /// Number of blocks.
    num_blocks: usize,
    /// Keys and values.
    storage: Storage,
}

/// What attention reads: the cache's tiles as their element type.
pub(crate) enum KvView<'a> {
    /// An f32 cache.
    F32(KvTiles<'a, f32>),
    /// An f16 cache.
    F16(KvTiles<'a, f16>),
    /// A bf16 cache.
    Bf16(KvTiles<'a, bf16>),
}

/// The tiles of a cache whose values are `E`.
#[derive(Clone, Copy)]
pub(crate) struct KvTiles<'a, E> {
    shape: KvCacheShape,
    k: &'a [E],
    v: &'a [E],
}

impl<'a, E> KvTiles<'a, E> {
    /// The `[block_size, head_dim]` tiles of K and V of (`layer`, `block`,
    /// `head`).
    #[inline]
    pub(crate) fn tile(&self, layer: usize, block: usize, head: usize) -> (&'a [E], &'a [E]) {
        let at = self.shape.tile_offset(layer, block, head);
        let len = self.shape.block_size * self.shape.head_dim;
        (&self.k[at..at + len], &self.v[at..at + len])
    }
}

impl<E: KvElem> Planes<E> {
    /// Zeroed K and V of `len` values each.
    fn zeroed(len: usize) -> Result<Planes<E>, &'static str> {
        if len == 0 {
            return Err("a block of this shape holds no values");
        }
        // SAFETY: `KvElem` guarantees that zero bits are a valid value
        // (0.0).
        let zeroed = || unsafe { Pages::<E>::zeroed(len) };
        Ok(Planes {
            k: zeroed()?,
            v: zeroed()?,
        })
    }

    /// Rounds one token's keys and values into their slot, which starts
    /// at `at(head)` for each KV head.
    fn write(&mut self, shape: &KvCacheShape, at: impl Fn(usize) -> usize, k: &[f32], v: &[f32]) {
        let hd = shape.head_dim;
        for h in 0..shape.num_kv_heads {
            let (dst, src) = (at(h)..at(h) + hd, h * hd..(h + 1) * hd);
            E::store(&k[src.clone()], &mut self.k[dst.clone()]);
            E::store(&v[src], &mut self.v[dst]);
        }
    }

    /// The view attention reads.
    fn tiles(&self, shape: KvCacheShape) -> KvTiles<'_, E> {
        KvTiles {
            shape,
            k: &self.k,
            v: &self.v,
        }
    }
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
        let len = shape
            .num_layers
            .checked_mul(num_blocks)
            .and_then(|x| x.checked_mul(shape.block_values()))
            .ok_or_else(|| alloc_err("the size overflows usize"))?;
        let storage = match shape.dtype {
            KvDtype::F32 => Planes::zeroed(len).map(Storage::F32),
            KvDtype::F16 => Planes::zeroed(len).map(Storage::F16),
            KvDtype::Bf16 => Planes::zeroed(len).map(Storage::Bf16),
        }
        .map_err(alloc_err)?;
        Ok(KvCache {
            shape,
            num_blocks,
            storage,
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

    /// Stores one token's keys and values (`[kv_heads * head_dim]` each,
    /// rounded to the cache's type) in `slot` of `block`. The caller has
    /// validated `block` and `slot`.
    pub(crate) fn write(&mut self, layer: usize, block: usize, slot: usize, k: &[f32], v: &[f32]) {
        let shape = self.shape;
        let at = |h| shape.tile_offset(layer, block, h) + slot * shape.head_dim;
        match &mut self.storage {
            Storage::F32(p) => p.write(&shape, at, k, v),
            Storage::F16(p) => p.write(&shape, at, k, v),
            Storage::Bf16(p) => p.write(&shape, at, k, v),
        }
    }

    /// The tiles, as their element type.
    pub(crate) fn view(&self) -> KvView<'_> {
        match &self.storage {
            Storage::F32(p) => KvView::F32(p.tiles(self.shape)),
            Storage::F16(p) => KvView::F16(p.tiles(self.shape)),
            Storage::Bf16(p) => KvView::Bf16(p.tiles(self.shape)),
        }
    }

    /// The K and V tiles of (`layer`, `block`, `head`) widened to f32 (for
    /// tests).
    #[cfg(test)]
    pub(crate) fn tile_f32(&self, layer: usize, block: usize, head: usize) -> (Vec<f32>, Vec<f32>) {
        fn widen<E: KvElem>(
            t: KvTiles<'_, E>,
            l: usize,
            b: usize,
            h: usize,
        ) -> (Vec<f32>, Vec<f32>) {
            let (k, v) = t.tile(l, b, h);
            let f = |x: &[E]| x.iter().map(|e| e.to_f32()).collect();
            (f(k), f(v))
        }
        match self.view() {
            KvView::F32(t) => widen(t, layer, block, head),
            KvView::F16(t) => widen(t, layer, block, head),
            KvView::Bf16(t) => widen(t, layer, block, head),
        }
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
        dtype: KvDtype::F32,
    };

    /// How a type rounds an f32.
    type Rounding = fn(f32) -> f32;

    /// Each type, with the rounding the `half` crate gives its values.
    const TYPES: [(KvDtype, Rounding); 3] = [
        (KvDtype::F32, |x| x),
        (KvDtype::F16, |x| f16::from_f32(x).to_f32()),
        (KvDtype::Bf16, |x| bf16::from_f32(x).to_f32()),
    ];

    #[test]
    fn bytes_per_block_counts_k_and_v_of_every_layer() {
        assert_eq!(SHAPE.bytes_per_block(), 2 * 2 * 3 * 5 * 4 * 4);
        let half = KvCacheShape {
            dtype: KvDtype::F16,
            ..SHAPE
        };
        assert_eq!(half.bytes_per_block(), 2 * 2 * 3 * 5 * 4 * 2);
    }

    #[test]
    fn auto_is_f32_on_the_cpu() {
        assert_eq!(KvDtype::for_cpu(CacheDtype::Auto), KvDtype::F32);
        assert_eq!(KvDtype::for_cpu(CacheDtype::Float16), KvDtype::F16);
        assert_eq!(KvDtype::for_cpu(CacheDtype::Bfloat16), KvDtype::Bf16);
    }

    /// A write lands, rounded to the cache's type, in its own tile and slot
    /// and nowhere else.
    #[test]
    fn writes_land_rounded_in_their_own_tile_and_slot() {
        for (dtype, round) in TYPES {
            let mut c = KvCache::new(KvCacheShape { dtype, ..SHAPE }, 3).unwrap();
            let k: Vec<f32> = (0..12).map(|x| x as f32 / 3.0).collect();
            let v: Vec<f32> = (0..12).map(|x| -(x as f32) * 1.001).collect();
            c.write(1, 2, 3, &k, &v);
            for layer in 0..2 {
                for block in 0..3 {
                    for head in 0..3 {
                        let (kt, vt) = c.tile_f32(layer, block, head);
                        for slot in 0..5 {
                            let hit = (layer, block, slot) == (1, 2, 3);
                            let want = |x: &[f32]| -> Vec<f32> {
                                if hit {
                                    x[head * 4..head * 4 + 4]
                                        .iter()
                                        .map(|&x| round(x))
                                        .collect()
                                } else {
                                    vec![0.0; 4]
                                }
                            };
                            assert_eq!(kt[slot * 4..slot * 4 + 4], want(&k), "{dtype:?}");
                            assert_eq!(vt[slot * 4..slot * 4 + 4], want(&v), "{dtype:?}");
                        }
                    }
                }
            }
        }
    }

    /// A cache takes memory only for the blocks written, even on huge
    /// pages: 4 GiB of blocks allocated and one block written in every
    /// layer (a 16-token prompt) leave K and V a few MiB resident, not a
    /// page per layer.
    #[cfg(target_os = "linux")]
    #[test]
    fn untouched_blocks_take_no_memory() {
        // Resident KiB of the mapping that holds `addr`.
        let resident_kib = |addr: usize| -> usize {
            let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
            let mut lines = smaps.lines();
            while let Some(line) = lines.next() {
                let range = line.split_whitespace().next().unwrap_or_default();
                let Some((start, end)) = range.split_once('-') else {
                    continue;
                };
                let hex = |x| usize::from_str_radix(x, 16).unwrap_or(0);
                if (hex(start)..hex(end)).contains(&addr) {
                    let rss = lines.find(|l| l.starts_with("Rss:")).unwrap();
                    return rss.split_whitespace().nth(1).unwrap().parse().unwrap();
                }
            }
            panic!("no mapping holds {addr:#x}");
        };
        let shape = KvCacheShape {
            num_layers: 30,
            num_kv_heads: 3,
            head_dim: 64,
            block_size: 16,
            dtype: KvDtype::F32,
        };
        let num_blocks = (4 << 30) / shape.bytes_per_block();
        let mut c = KvCache::new(shape, num_blocks).unwrap();
        for layer in 0..30 {
            for slot in 0..16 {
                c.write(layer, 0, slot, &[1.0; 192], &[1.0; 192]);
            }
        }
        let KvView::F32(tiles) = c.view() else {
            unreachable!("an f32 cache");
        };
        let kib = resident_kib(tiles.k.as_ptr() as usize) + resident_kib(tiles.v.as_ptr() as usize);
        assert!(
            kib <= 8 << 10,
            "a 4 GiB cache with one block written holds {kib} KiB"
        );
        assert_eq!(c.tile_f32(29, num_blocks - 1, 2).0[..64], [0.0; 64]);
        assert_eq!(c.tile_f32(29, 0, 2).0[..64], [1.0; 64]);
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
