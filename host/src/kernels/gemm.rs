//! Matrix x many-vectors products on 16-row panels: a register-blocked FMA
//! microkernel over every token of the batch, so each weight loaded feeds
//! several tokens.
//!
//! A panel holds [`NR`] = 16 rows for a chunk of `kc` columns, stored
//! column-major (`panel[k * 16 + r]`) so one column is two AVX registers.
//! Float matrices are kept in that layout from load on
//! ([`float_panels`](super::float_panels)), in their own element type,
//! widened in registers; quantized ones (when [`MatmulPath::Gemm`] is
//! forced) are dequantized into an f32 panel first.
//! The AVX2 microkernel keeps a tile of [`MR`] = 6 tokens x 16 rows in 12
//! registers; per column it loads two weight vectors, broadcasts six
//! activations and issues 12 FMAs, so every load feeds several FMAs. Where
//! the family has AVX-512, whole groups of [`MR_WIDE`] = 12 tokens run a
//! tile of one 16-lane register per token instead: one weight vector
//! loaded (and, for 16-bit weights, widened) per 12 FMAs, half the AVX2
//! tile's loads and widenings per multiply-add. A
//! single token (a decode) runs [`PANELS_AT_ONCE`] panels side by side
//! instead, so that enough independent FMAs are in flight to keep up with
//! memory.
//!
//! Every output is one chain of fused multiply-adds over its columns in
//! order, a chain per column chunk added in order, whatever the batch,
//! the tile or the family (the portable kernel fuses too): a token's result
//! does not depend on the tokens beside it or on the CPU.
//!
//! [`MatmulPath::Gemm`]: super::MatmulPath::Gemm

use std::cell::RefCell;
use std::ops::Range;

use half::{bf16, f16};

use super::cpu::CpuKernels;
use super::float_panels::{self, elems};
use super::kv_elem::KvElem;
use super::weights::{Packed, WeightMatrix, QK};
use super::OutPtr;
use crate::model::DType;

/// Weight rows per panel (two 8-lane vectors).
pub(crate) const NR: usize = 16;
/// Tokens per microkernel tile.
const MR: usize = 6;
/// Tokens per AVX-512 tile: one 16-lane register per token, so a loaded
/// (and widened) weight vector feeds this many FMAs.
const MR_WIDE: usize = 12;
/// Upper bound on the columns of one panel chunk: 16 x 2048 floats (128 KiB)
/// stays in L2, and every shape of the default model fits in one chunk.
const KC_MAX: usize = 2048;

thread_local! {
    /// Per-thread panel buffer, grown once, so the hot path never allocates.
    static PANEL: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Column chunks of a `cols`-wide matrix: equal-sized, block aligned, at
/// most [`KC_MAX`] wide.
fn column_chunks(cols: usize) -> impl Iterator<Item = (usize, usize)> {
    let chunks = cols.div_ceil(KC_MAX);
    let kc = cols.div_ceil(chunks).div_ceil(QK) * QK;
    (0..cols).step_by(kc).map(move |k0| (k0, kc.min(cols - k0)))
}

/// Panels a single-token product runs side by side (see the module doc).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const PANELS_AT_ONCE: usize = 4;

/// Computes `out[t * rows + r]` for every row of the given panels (panel
/// `p` covers rows `16 p .. 16 p + 16`) and every token of `x`, with the
/// microkernels of family `kernels` (the caller checked the CPU).
pub(crate) fn gemm_panels(
    w: &WeightMatrix,
    x: &[f32],
    n_tokens: usize,
    panels: Range<usize>,
    out: OutPtr,
    kernels: CpuKernels,
) {
    let job = Product {
        w,
        x,
        n_tokens,
        out,
        tiles: Tiles::of(kernels),
    };
    let Packed::FloatPanels(stored) = &w.data else {
        return dequantized_panels(job, panels);
    };
    match w.dtype() {
        DType::F32 => stored_panels(elems::<f32>(stored), job, panels),
        DType::F16 => stored_panels(elems::<f16>(stored), job, panels),
        DType::BF16 => stored_panels(elems::<bf16>(stored), job, panels),
        other => unreachable!("float panels hold F32, F16 or BF16, not {other:?}"),
    }
}

/// One product's operands: `out[t * rows + r] = (W x_t)[r]`.
#[derive(Clone, Copy)]
struct Product<'a> {
    /// The weights.
    w: &'a WeightMatrix,
    /// `n_tokens` rows of `cols` activations.
    x: &'a [f32],
    /// Tokens in `x`.
    n_tokens: usize,
    /// `[n_tokens, rows]` results.
    out: OutPtr,
    /// The microkernels to run.
    tiles: Tiles,
}

/// The microkernels a product runs: chosen once per product from the
/// kernel family and checked against this CPU, which the unsafe kernels
/// rely on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Tiles {
    /// The portable kernel.
    Portable,
    /// AVX2 + FMA + F16C: [`MR`]-token tiles, side-by-side panels for one
    /// token.
    Avx2,
    /// AVX2's, plus [`MR_WIDE`]-token tiles in AVX-512 registers.
    Avx512,
}

impl Tiles {
    /// The tiles family `kernels` runs on this CPU.
    fn of(kernels: CpuKernels) -> Tiles {
        let x86 = cfg!(target_arch = "x86_64");
        if x86 && kernels >= CpuKernels::Avx512Vnni && CpuKernels::Avx512Vnni.is_supported() {
            Tiles::Avx512
        } else if x86 && kernels >= CpuKernels::Avx2 && CpuKernels::Avx2.is_supported() {
            Tiles::Avx2
        } else {
            Tiles::Portable
        }
    }

    /// The most tokens one tile holds.
    fn most_tokens(self) -> usize {
        if self == Tiles::Avx512 {
            MR_WIDE
        } else {
            MR
        }
    }
}

/// [`gemm_panels`] over a float matrix's own panels.
fn stored_panels<E: KvElem>(data: &[E], job: Product, panels: Range<usize>) {
    let cols = job.w.cols();
    for p in side_by_side(data, job, panels.clone())..panels.end {
        for (k0, kc) in column_chunks(cols) {
            let at = float_panels::index(p * NR, k0, cols);
            Tile::new(&data[at..at + kc * NR], job.w, p, k0).run_tokens(job);
        }
    }
}

/// A lone token's product over whole groups of [`PANELS_AT_ONCE`] panels
/// from the start of `panels` (AVX2 only); returns the first panel left.
fn side_by_side<E: KvElem>(data: &[E], job: Product, panels: Range<usize>) -> usize {
    #[cfg(target_arch = "x86_64")]
    if job.n_tokens == 1 && job.tiles >= Tiles::Avx2 {
        let (rows, cols) = (job.w.rows(), job.w.cols());
        let mut p = panels.start;
        // Whole panels only: a partial one writes through `Tile::run`.
        while p + PANELS_AT_ONCE <= panels.end && (p + PANELS_AT_ONCE) * NR <= rows {
            for (k0, kc) in column_chunks(cols) {
                let at = float_panels::index(p * NR, k0, cols);
                assert!(data.len() >= at + (PANELS_AT_ONCE - 1) * NR * cols + kc * NR);
                // SAFETY: AVX2, FMA and F16C are present; the panels hold
                // the `kc` columns read (asserted) and `x` holds `cols`
                // values; this thread owns rows `16 p .. 16 (p + 4)`.
                unsafe {
                    let c = job.out.ptr().add(p * NR);
                    let (w, stride) = (data.as_ptr().add(at), NR * cols);
                    one_token_avx2::<E>(w, stride, kc, job.x.as_ptr().add(k0), c, k0 > 0);
                }
            }
            p += PANELS_AT_ONCE;
        }
        return p;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, job);
    panels.start
}

/// [`gemm_panels`] for a quantized matrix: each panel dequantized to f32.
fn dequantized_panels(job: Product, panels: Range<usize>) {
    let w = job.w;
    PANEL.with(|buf| {
        let mut buf = buf.borrow_mut();
        let kc_max = column_chunks(w.cols()).map(|(_, kc)| kc).max().unwrap_or(0);
        // 16 extra floats let us start the panel on a 64-byte boundary.
        if buf.len() < kc_max * NR + 16 {
            buf.resize(kc_max * NR + 16, 0.0);
        }
        let skip = buf.as_ptr().align_offset(64).min(16);
        let panel = &mut buf[skip..];
        for p in panels {
            for (k0, kc) in column_chunks(w.cols()) {
                pack_panel(w, p, k0, &mut panel[..kc * NR]);
                Tile::new(&panel[..kc * NR], w, p, k0).run_tokens(job);
            }
        }
    });
}

/// Writes panel `p` (rows `16 p ..`), columns `k0 .. k0 + panel.len() / 16`
/// of `w` into `panel` (column-major, 16 rows per column, missing rows zero).
fn pack_panel(w: &WeightMatrix, p: usize, k0: usize, panel: &mut [f32]) {
    let (kc, r0, nr) = (panel.len() / NR, p * NR, NR.min(w.rows() - p * NR));
    let mut row = [0f32; KC_MAX];
    for rr in 0..NR {
        if rr < nr {
            w.dequantize_range(r0 + rr, k0, &mut row[..kc]);
        } else {
            row[..kc].fill(0.0);
        }
        for (k, &v) in row[..kc].iter().enumerate() {
            panel[k * NR + rr] = v;
        }
    }
}

/// One panel chunk and where its results go.
struct Tile<'a, E> {
    /// The panel's columns `k0 .. k0 + kc`, `kc * 16` values.
    panel: &'a [E],
    /// Columns in the panel.
    kc: usize,
    /// First column of the panel.
    k0: usize,
    /// First row of the panel.
    r0: usize,
    /// Valid rows in the panel (16 except at the bottom edge).
    nr: usize,
    /// Add to `out` (later column chunks) instead of overwriting it.
    accumulate: bool,
}

impl<'a, E: KvElem> Tile<'a, E> {
    /// Columns `k0 .. k0 + panel.len() / 16` of panel `p` of `w`, held in
    /// `panel`.
    fn new(panel: &'a [E], w: &WeightMatrix, p: usize, k0: usize) -> Tile<'a, E> {
        Tile {
            panel,
            kc: panel.len() / NR,
            k0,
            r0: p * NR,
            nr: NR.min(w.rows() - p * NR),
            accumulate: k0 > 0,
        }
    }

    /// Multiplies the panel by every token: [`MR_WIDE`] at a time where
    /// the family has AVX-512, then [`MR`] at a time.
    fn run_tokens(&self, job: Product) {
        let mut t0 = 0;
        if job.tiles == Tiles::Avx512 {
            while t0 + MR_WIDE <= job.n_tokens {
                self.run(job, t0, MR_WIDE);
                t0 += MR_WIDE;
            }
        }
        while t0 < job.n_tokens {
            let mr = MR.min(job.n_tokens - t0);
            self.run(job, t0, mr);
            t0 += mr;
        }
    }

    /// Multiplies the panel by tokens `t0 .. t0 + mr` and stores the results.
    fn run(&self, job: Product, t0: usize, mr: usize) {
        let Product {
            w, x, out, tiles, ..
        } = job;
        let (rows, cols) = (w.rows(), w.cols());
        let xs = &x[t0 * cols + self.k0..];
        if self.nr == NR {
            // SAFETY: `out` holds `n_tokens * rows` values and this thread
            // owns rows `r0 .. r0 + 16`.
            let c = unsafe { out.ptr().add(t0 * rows + self.r0) };
            self.micro(xs, cols, mr, c, rows, tiles);
            return;
        }
        // A partial panel goes through a full-width scratch tile.
        let mut tmp = [0f32; MR_WIDE * NR];
        for t in 0..mr {
            for r in 0..self.nr {
                // SAFETY: in bounds, and owned by this thread, as above.
                tmp[t * NR + r] = unsafe { out.read((t0 + t) * rows + self.r0 + r) };
            }
        }
        self.micro(xs, cols, mr, tmp.as_mut_ptr(), NR, tiles);
        for t in 0..mr {
            for r in 0..self.nr {
                // SAFETY: as above.
                unsafe { out.write((t0 + t) * rows + self.r0 + r, tmp[t * NR + r]) };
            }
        }
    }

    /// `c[t * ldc + r] (+)= sum_k panel[k * 16 + r] * xs[t * ldx + k]` for
    /// `t < mr`, `r < 16`; `mr` is at most `tiles.most_tokens()`.
    fn micro(&self, xs: &[f32], ldx: usize, mr: usize, c: *mut f32, ldc: usize, tiles: Tiles) {
        assert!(mr <= tiles.most_tokens() && xs.len() >= (mr - 1) * ldx + self.kc);
        #[cfg(target_arch = "x86_64")]
        if tiles >= Tiles::Avx2 {
            let (p, x, kc, acc) = (self.panel.as_ptr(), xs.as_ptr(), self.kc, self.accumulate);
            // SAFETY: AVX2, FMA and F16C are present, and AVX-512 F too
            // where `MR_WIDE` tokens pass the assert (`Tiles::of` checked
            // the CPU); the panel holds `kc * 16`
            // values, `xs` was checked above, and `c` is valid for `mr`
            // rows of 16 at stride `ldc` (see `run`).
            unsafe {
                match mr {
                    1 => micro_avx2::<E, 1>(p, kc, x, ldx, c, ldc, acc),
                    2 => micro_avx2::<E, 2>(p, kc, x, ldx, c, ldc, acc),
                    3 => micro_avx2::<E, 3>(p, kc, x, ldx, c, ldc, acc),
                    4 => micro_avx2::<E, 4>(p, kc, x, ldx, c, ldc, acc),
                    5 => micro_avx2::<E, 5>(p, kc, x, ldx, c, ldc, acc),
                    MR => micro_avx2::<E, MR>(p, kc, x, ldx, c, ldc, acc),
                    MR_WIDE => micro_avx512::<E>(p, kc, x, ldx, c, ldc, acc),
                    _ => unreachable!("tiles hold 1..={MR} or {MR_WIDE} tokens, not {mr}"),
                }
            }
            return;
        }
        let mut acc = [[0f32; NR]; MR];
        for k in 0..self.kc {
            let wk = &self.panel[k * NR..(k + 1) * NR];
            for (t, acc) in acc.iter_mut().enumerate().take(mr) {
                let xv = xs[t * ldx + k];
                for (a, &wv) in acc.iter_mut().zip(wk) {
                    // Fused, as the SIMD kernels are: the same bits.
                    *a = wv.to_f32().mul_add(xv, *a);
                }
            }
        }
        for (t, acc) in acc.iter().enumerate().take(mr) {
            for (r, &a) in acc.iter().enumerate() {
                // SAFETY: `c` is valid for `mr` rows of 16 at stride `ldc`.
                unsafe {
                    let dst = c.add(t * ldc + r);
                    *dst = if self.accumulate { *dst + a } else { a };
                }
            }
        }
    }
}

/// The AVX2 microkernel for `MR` tokens (see [`Tile::micro`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn micro_avx2<E: KvElem, const MR: usize>(
    panel: *const E,
    kc: usize,
    x: *const f32,
    ldx: usize,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); 2]; MR];
    for k in 0..kc {
        let w0 = E::load8(panel.add(k * NR));
        let w1 = E::load8(panel.add(k * NR + 8));
        for (t, acc) in acc.iter_mut().enumerate() {
            let xb = _mm256_broadcast_ss(&*x.add(t * ldx + k));
            acc[0] = _mm256_fmadd_ps(w0, xb, acc[0]);
            acc[1] = _mm256_fmadd_ps(w1, xb, acc[1]);
        }
    }
    for (t, acc) in acc.iter().enumerate() {
        store_rows(acc, c.add(t * ldc), accumulate);
    }
}

/// The AVX-512 microkernel for [`MR_WIDE`] tokens: per column one
/// 16-row weight vector, widened once, and an FMA per token into that
/// token's register. Each output is the same chain of FMAs as in
/// [`micro_avx2`], so the bits are the same.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn micro_avx512<E: KvElem>(
    panel: *const E,
    kc: usize,
    x: *const f32,
    ldx: usize,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_ps(); MR_WIDE];
    for k in 0..kc {
        let w = E::load16(panel.add(k * NR));
        for (t, acc) in acc.iter_mut().enumerate() {
            *acc = _mm512_fmadd_ps(w, _mm512_set1_ps(*x.add(t * ldx + k)), *acc);
        }
    }
    for (t, acc) in acc.iter().enumerate() {
        let dst = c.add(t * ldc);
        let sum = if accumulate {
            _mm512_add_ps(*acc, _mm512_loadu_ps(dst))
        } else {
            *acc
        };
        _mm512_storeu_ps(dst, sum);
    }
}

/// One token times [`PANELS_AT_ONCE`] whole panels `stride` values apart
/// (`kc` columns each), into `c[0 .. 64]`: the decode's kernel. Each
/// output is the same chain of FMAs as in [`micro_avx2`]; side by side,
/// eight chains keep both FMA units busy where two waited on each other.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn one_token_avx2<E: KvElem>(
    panels: *const E,
    stride: usize,
    kc: usize,
    x: *const f32,
    c: *mut f32,
    accumulate: bool,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); 2]; PANELS_AT_ONCE];
    for k in 0..kc {
        let xb = _mm256_broadcast_ss(&*x.add(k));
        for (j, acc) in acc.iter_mut().enumerate() {
            let w = panels.add(j * stride + k * NR);
            acc[0] = _mm256_fmadd_ps(E::load8(w), xb, acc[0]);
            acc[1] = _mm256_fmadd_ps(E::load8(w.add(8)), xb, acc[1]);
        }
    }
    for (j, acc) in acc.iter().enumerate() {
        store_rows(acc, c.add(j * NR), accumulate);
    }
}

/// Stores (or adds to) 16 outputs at `dst`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn store_rows(acc: &[std::arch::x86_64::__m256; 2], dst: *mut f32, accumulate: bool) {
    use std::arch::x86_64::*;
    let (mut a0, mut a1) = (acc[0], acc[1]);
    if accumulate {
        a0 = _mm256_add_ps(a0, _mm256_loadu_ps(dst));
        a1 = _mm256_add_ps(a1, _mm256_loadu_ps(dst.add(8)));
    }
    _mm256_storeu_ps(dst, a0);
    _mm256_storeu_ps(dst.add(8), a1);
}
