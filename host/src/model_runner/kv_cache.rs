//! Paged K/V storage: `num_blocks` blocks of `block_size` token slots per
//! layer, for K and for V.
//!
//! Layout (outermost first): `[layer][block][kv_head][slot][head_dim]`. The
//! attention of one query head walks its sequence's blocks and, inside each,
//! reads one `[block_size, head_dim]` tile of its KV head: contiguous memory
//! per block, so decode attention streams whole cache lines and the hardware
//! prefetcher follows.
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
use crate::kernels::KvElem;

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
    /// `head`) in a cache of `num_blocks` blocks.
    #[inline]
    fn tile_offset(&self, num_blocks: usize, layer: usize, block: usize, head: usize) -> usize {
        ((layer * num_blocks + block) * self.num_kv_heads + head) * self.block_size * self.head_dim
    }
}

/// Keys and values of one element type, `[layer][block][kv_head][slot][head_dim]`.
struct Planes<E> {
    k: Vec<E>,
    v: Vec<E>,
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
    num_blocks: usize,
    k: &'a [E],
    v: &'a [E],
}

impl<'a, E> KvTiles<'a, E> {
    /// The `[block_size, head_dim]` tiles of K and V of (`layer`, `block`,
    /// `head`).
    #[inline]
    pub(crate) fn tile(&self, layer: usize, block: usize, head: usize) -> (&'a [E], &'a [E]) {
        let at = self.shape.tile_offset(self.num_blocks, layer, block, head);
        let len = self.shape.block_size * self.shape.head_dim;
        (&self.k[at..at + len], &self.v[at..at + len])
    }
}

/// `len` zeroed values of `E`, from fresh anonymous pages: they take no
/// memory until first written, so resident memory follows the blocks in
/// use. Fails, saying why, when the size is impossible or refused.
fn zeroed<E: KvElem>(len: usize) -> Result<Vec<E>, &'static str> {
    let layout =
        std::alloc::Layout::array::<E>(len).map_err(|_| "the size overflows the address space")?;
    if layout.size() == 0 {
        return Err("a block of this shape holds no values");
    }
    // SAFETY: `layout` is not zero-sized (checked just above).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<E>();
    if ptr.is_null() {
        return Err("the system cannot allocate that much memory");
    }
    // SAFETY: allocated by the global allocator with the layout of `len`
    // values of `E`, all zero bits, which `KvElem` guarantees are valid
    // (0.0), so owning it as a Vec of that length and capacity is sound.
    Ok(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

impl<E: KvElem> Planes<E> {
    /// Zeroed K and V of `len` values each.
    fn zeroed(len: usize) -> Result<Planes<E>, &'static str> {
        Ok(Planes {
            k: zeroed(len)?,
            v: zeroed(len)?,
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
    fn tiles(&self, shape: KvCacheShape, num_blocks: usize) -> KvTiles<'_, E> {
        KvTiles {
            shape,
            num_blocks,
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
        let (shape, n) = (self.shape, self.num_blocks);
        let at = |h| shape.tile_offset(n, layer, block, h) + slot * shape.head_dim;
        match &mut self.storage {
            Storage::F32(p) => p.write(&shape, at, k, v),
            Storage::F16(p) => p.write(&shape, at, k, v),
            Storage::Bf16(p) => p.write(&shape, at, k, v),
        }
    }

    /// The tiles, as their element type.
    pub(crate) fn view(&self) -> KvView<'_> {
        let (shape, n) = (self.shape, self.num_blocks);
        match &self.storage {
            Storage::F32(p) => KvView::F32(p.tiles(shape, n)),
            Storage::F16(p) => KvView::F16(p.tiles(shape, n)),
            Storage::Bf16(p) => KvView::Bf16(p.tiles(shape, n)),
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
            dtype: KvDtype::F32,
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
        assert_eq!(c.tile_f32(29, num_blocks - 1, 2).0[..64], [0.0; 64]);
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
