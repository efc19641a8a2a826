//! What the interleaved kernels ([`gemv_x8_avx2`](super::gemv_x8_avx2),
//! [`gemv_x16_avx512`](super::gemv_x16_avx512), [`gemm_amx`](super::gemm_amx))
//! share: the loop over a matrix's row groups and tiles of tokens
//! ([`gemv_rows`]), which groups a range of rows touches and where their
//! results go ([`Place`]), and the activations of a tile of tokens
//! ([`Tokens`]). The layouts themselves are [`interleaved`](super::interleaved)'s.

use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
use std::ops::Range;

use super::interleaved::{q4_record, q8_quants};
use super::quant::Q8Acts;
use super::OutPtr;

/// An interleaved matrix's data, borrowed from its `Packed` variant.
#[derive(Clone, Copy)]
pub(crate) enum Interleaved<'a> {
    /// `Packed::Q4Interleaved`'s records.
    Q4(&'a [u8]),
    /// `Packed::Q8Interleaved`'s quants and scales.
    Q8(&'a [u8], &'a [u16]),
}

impl Interleaved<'_> {
    /// Panics unless the data holds `n_rows` rows of `blocks` blocks in
    /// groups of `group`: the bounds the kernels' raw reads rely on.
    pub(crate) fn assert_holds(self, group: usize, n_rows: usize, blocks: usize) {
        let records = n_rows.div_ceil(group) * blocks;
        match self {
            Interleaved::Q4(data) => assert!(data.len() >= records * q4_record(group)),
            Interleaved::Q8(qs, d) => {
                assert!(qs.len() >= records * q8_quants(group) && d.len() >= records * group)
            }
        }
    }
}

/// How one instruction set multiplies a group of interleaved rows by a tile
/// of tokens; [`gemv_rows`] drives it over groups and tiles.
///
/// Implementations are `#[inline(always)]` functions without target
/// features of their own, inlined into a `#[target_feature]` entry point
/// that calls [`gemv_rows`] (which is inlined there too).
pub(crate) trait GroupTiles {
    /// Rows per group: the layout this kernel reads.
    const GROUP: usize;

    /// The tokens of `x` times the `blocks` records of one 4-bit group
    /// starting at `records`; stores the results at `at`.
    ///
    /// # Safety
    /// The CPU has the kernel's features; `records` holds the group's
    /// records, 64-byte aligned; `x` holds `blocks` blocks per token; the
    /// place's output is valid for its rows and no other thread writes them.
    unsafe fn tile_q4<const NT: usize>(
        records: *const u8,
        blocks: usize,
        x: &Tokens<NT>,
        at: Place,
    );

    /// [`tile_q4`](Self::tile_q4) for an 8-bit group: quants at `qs`,
    /// `GROUP` scales per block at `d`.
    ///
    /// # Safety
    /// As [`tile_q4`](Self::tile_q4).
    unsafe fn tile_q8<const NT: usize>(
        qs: *const u8,
        d: *const u16,
        blocks: usize,
        x: &Tokens<NT>,
        at: Place,
    );
}

/// How far ahead of the block being multiplied the kernels ask for
/// weights, in bytes: about 200 ns of one core's stream at 10 GB/s, which
/// covers a DRAM miss. On AMD Zen 1 (AVX2) this raised tg128 from 115 to
/// 150 tokens/s on two threads, 64 to 91 on one (1,536 to 4,096 measured
/// alike; 512 gave 133); on AMD Zen 4 (AVX-512), from a median of 185 to
/// 204 on two threads and 112 to 148 on one.
const PREFETCH_AHEAD: usize = 2048;

/// Asks for the `bytes` at `PREFETCH_AHEAD` past `at`, line by line: a
/// hint, which changes no result and cannot fault (past a matrix's end it
/// names memory that is never read).
#[inline(always)]
pub(crate) unsafe fn prefetch_ahead(at: *const u8, bytes: usize) {
    for line in (0..bytes).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH_AHEAD + line).cast());
    }
}

/// Tokens that share one pass over a group's records (their sums live in
/// registers). Eight measured no faster than four with AVX-512 (pp512,
/// AMD EPYC Zen 5), and AVX2 has only 16 vector registers.
const TILE_TOKENS: usize = 4;

/// One multiplication by an interleaved matrix: rows `rows` of `w` (`n_rows`
/// rows of `blocks` blocks) times the `n_tokens` tokens of `acts`, written
/// to `out[t * n_rows + r]`.
pub(crate) struct Job<'a> {
    /// The matrix's data.
    pub(crate) w: Interleaved<'a>,
    /// Its rows.
    pub(crate) n_rows: usize,
    /// Its blocks per row.
    pub(crate) blocks: usize,
    /// The quantized activations.
    pub(crate) acts: &'a Q8Acts,
    /// How many tokens `acts` holds.
    pub(crate) n_tokens: usize,
    /// The rows to compute.
    pub(crate) rows: Range<usize>,
    /// The output, `n_tokens * n_rows` values.
    pub(crate) out: OutPtr,
}

/// Runs `job` in `K::GROUP`-row groups times tiles of up to
/// [`TILE_TOKENS`] tokens. Groups that `rows` covers only in part are
/// computed whole and stored in part.
///
/// # Safety
/// The CPU has `K`'s features and the caller enables them (this is inlined
/// into it); the data is 64-byte aligned ([`AlignedBytes`](super::aligned::AlignedBytes)); `out` must be
/// valid for `n_tokens * n_rows` values, and no other thread may write
/// these rows.
#[inline(always)]
pub(crate) unsafe fn gemv_rows<K: GroupTiles>(job: Job) {
    let Job {
        w,
        n_rows,
        blocks,
        acts,
        n_tokens,
        rows,
        out,
    } = job;
    w.assert_holds(K::GROUP, n_rows, blocks);
    for (g, at) in groups(K::GROUP, n_rows, rows, out) {
        let mut t0 = 0;
        while t0 < n_tokens {
            let nt = (n_tokens - t0).min(TILE_TOKENS);
            let tile = Tile {
                w,
                g,
                blocks,
                t0,
                at,
            };
            // SAFETY: the caller's contract; the group's records are in
            // bounds (asserted above) and `acts` holds the tokens.
            unsafe {
                match nt {
                    1 => tile.run::<K, 1>(acts),
                    2 => tile.run::<K, 2>(acts),
                    3 => tile.run::<K, 3>(acts),
                    _ => tile.run::<K, TILE_TOKENS>(acts),
                }
            }
            t0 += nt;
        }
    }
}

/// One group of rows times one tile of tokens, for [`gemv_rows`].
#[derive(Clone, Copy)]
struct Tile<'a> {
    w: Interleaved<'a>,
    g: usize,
    blocks: usize,
    t0: usize,
    at: Place,
}

impl Tile<'_> {
    /// Runs the tile with `K`'s kernel for `NT` tokens.
    ///
    /// # Safety
    /// As [`gemv_rows`]; group `g` exists and `acts` holds tokens
    /// `t0 .. t0 + NT`.
    #[inline(always)]
    unsafe fn run<K: GroupTiles, const NT: usize>(self, acts: &Q8Acts) {
        let Tile {
            w,
            g,
            blocks,
            t0,
            at,
        } = self;
        let x = Tokens::<NT>::new(acts, t0);
        match w {
            Interleaved::Q4(data) => {
                let records = data.as_ptr().add(g * blocks * q4_record(K::GROUP));
                K::tile_q4(records, blocks, &x, at)
            }
            Interleaved::Q8(qs, d) => {
                let qs = qs.as_ptr().add(g * blocks * q8_quants(K::GROUP));
                let d = d.as_ptr().add(g * blocks * K::GROUP);
                K::tile_q8(qs, d, blocks, &x, at)
            }
        }
    }
}

/// Where a group's results go: its lanes `lane .. lane + len` are rows
/// `first .. first + len` of `out`, which has `n_rows` values per token.
#[derive(Clone, Copy)]
pub(crate) struct Place {
    out: OutPtr,
    n_rows: usize,
    first: usize,
    lane: usize,
    len: usize,
}

impl Place {
    /// Writes the lanes this place names of `lanes`, one token's results
    /// for the group, as token `t` of the output.
    ///
    /// A whole group, the usual case, is one fixed-size copy the compiler
    /// turns into vector moves; only a group the row range cuts pays for
    /// a `memcpy` call of its variable length. (Every group calling it cost
    /// a batch of 64 decodes 8% of its time: 800,000 calls per step.)
    ///
    /// # Safety
    /// The output holds `n_rows` values for token `t`, and no other thread
    /// writes these rows.
    #[inline(always)]
    pub(crate) unsafe fn store<const G: usize>(self, lanes: &[f32; G], t: usize) {
        let dst = self.out.ptr().add(t * self.n_rows + self.first);
        if self.len == G {
            dst.cast::<[f32; G]>().write_unaligned(*lanes);
        } else {
            std::ptr::copy_nonoverlapping(lanes.as_ptr().add(self.lane), dst, self.len);
        }
    }
}

/// The groups of `group` rows that `rows` (of a matrix of `n_rows`) touches,
/// with the place in `out` of each one's results.
pub(crate) fn groups(
    group: usize,
    n_rows: usize,
    rows: Range<usize>,
    out: OutPtr,
) -> impl Iterator<Item = (usize, Place)> {
    assert!(
        rows.end <= n_rows,
        "rows {rows:?} past the matrix's {n_rows}"
    );
    (rows.start / group..rows.end.div_ceil(group)).map(move |g| {
        let first = (g * group).max(rows.start);
        let place = Place {
            out,
            n_rows,
            first,
            lane: first - g * group,
            len: ((g + 1) * group).min(rows.end) - first,
        };
        (g, place)
    })
}

/// Tokens `t0 .. t0 + NT` of a [`Q8Acts`]: per token its quants, block
/// scales, block `d * sum(q)` and block `sum(q)`.
pub(crate) struct Tokens<const NT: usize> {
    /// The first token's index.
    pub(crate) t0: usize,
    /// Quants.
    pub(crate) xq: [*const i8; NT],
    /// Block scales.
    pub(crate) dx: [*const f32; NT],
    /// Block `d * sum(q)`.
    pub(crate) sx: [*const f32; NT],
    /// Block `sum(q)`.
    pub(crate) sums: [*const i32; NT],
}

impl<const NT: usize> Tokens<NT> {
    /// Tokens `t0 .. t0 + NT` of `acts`.
    pub(crate) fn new(acts: &Q8Acts, t0: usize) -> Tokens<NT> {
        let mut x = Tokens {
            t0,
            xq: [std::ptr::null(); NT],
            dx: [std::ptr::null(); NT],
            sx: [std::ptr::null(); NT],
            sums: [std::ptr::null(); NT],
        };
        for t in 0..NT {
            x.xq[t] = acts.row_qs(t0 + t).as_ptr();
            let (d, s) = acts.row_scales(t0 + t);
            (x.dx[t], x.sx[t]) = (d.as_ptr(), s.as_ptr());
            x.sums[t] = acts.row_sums(t0 + t).as_ptr();
        }
        x
    }

    /// Token `t`'s four activation bytes from column `col`, as one word.
    ///
    /// # Safety
    /// `col + 4` is within the token's row.
    #[inline(always)]
    pub(crate) unsafe fn word(&self, t: usize, col: usize) -> i32 {
        self.xq[t].add(col).cast::<i32>().read_unaligned()
    }
}
