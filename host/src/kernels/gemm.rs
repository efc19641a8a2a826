//! Matrix x many-vectors products (prefill): dequantize a panel of weight
//! rows to f32 once, then run a register-blocked FMA microkernel over all
//! tokens, so the dequantization cost is amortised over the batch.
//!
//! A panel holds [`NR`] = 16 rows for a chunk of `kc` columns, stored
//! column-major (`panel[k * 16 + r]`) so one column is two AVX registers.
//! The microkernel keeps a tile of [`MR`] = 6 tokens x 16 rows in 12
//! registers; per column it loads two weight vectors, broadcasts six
//! activations and issues 12 FMAs, so every load feeds several FMAs.

use std::cell::RefCell;
use std::ops::Range;

use super::weights::{WeightMatrix, QK};
use super::OutPtr;

/// Weight rows per panel (two 8-lane vectors).
pub(crate) const NR: usize = 16;
/// Tokens per microkernel tile.
const MR: usize = 6;
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

/// Computes `out[t * rows + r]` for every row of the given panels (panel
/// `p` covers rows `16 p .. 16 p + 16`) and every token of `x`, with the
/// AVX2 microkernel when `simd` (the caller checked the CPU) or the portable one.
pub(crate) fn gemm_panels(
    w: &WeightMatrix,
    x: &[f32],
    n_tokens: usize,
    panels: Range<usize>,
    out: OutPtr,
    simd: bool,
) {
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
            let (r0, nr) = (p * NR, NR.min(w.rows() - p * NR));
            for (k0, kc) in column_chunks(w.cols()) {
                pack_panel(w, r0, nr, k0, &mut panel[..kc * NR]);
                let tile = Tile {
                    panel: &panel[..kc * NR],
                    kc,
                    k0,
                    r0,
                    nr,
                    accumulate: k0 > 0,
                };
                let mut t0 = 0;
                while t0 < n_tokens {
                    let mr = MR.min(n_tokens - t0);
                    tile.run(w, x, t0, mr, out, simd);
                    t0 += mr;
                }
            }
        }
    });
}

/// Writes rows `r0 .. r0 + nr`, columns `k0 .. k0 + panel.len() / 16` of
/// `w` into `panel` (column-major, 16 rows per column, missing rows zero).
fn pack_panel(w: &WeightMatrix, r0: usize, nr: usize, k0: usize, panel: &mut [f32]) {
    let kc = panel.len() / NR;
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

/// One packed panel and where its results go.
struct Tile<'a> {
    /// Packed weights, `kc * 16`.
    panel: &'a [f32],
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

impl Tile<'_> {
    /// Multiplies the panel by tokens `t0 .. t0 + mr` and stores the results.
    fn run(&self, w: &WeightMatrix, x: &[f32], t0: usize, mr: usize, out: OutPtr, simd: bool) {
        let (rows, cols) = (w.rows(), w.cols());
        let xs = &x[t0 * cols + self.k0..];
        if self.nr == NR {
            // SAFETY: `out` holds `n_tokens * rows` values and this thread
            // owns rows `r0 .. r0 + 16`.
            let c = unsafe { out.ptr().add(t0 * rows + self.r0) };
            self.micro(xs, cols, mr, c, rows, simd);
            return;
        }
        // A partial panel goes through a full-width scratch tile.
        let mut tmp = [0f32; MR * NR];
        for t in 0..mr {
            for r in 0..self.nr {
                // SAFETY: in bounds, and owned by this thread, as above.
                tmp[t * NR + r] = unsafe { out.read((t0 + t) * rows + self.r0 + r) };
            }
        }
        self.micro(xs, cols, mr, tmp.as_mut_ptr(), NR, simd);
        for t in 0..mr {
            for r in 0..self.nr {
                // SAFETY: as above.
                unsafe { out.write((t0 + t) * rows + self.r0 + r, tmp[t * NR + r]) };
            }
        }
    }

    /// `c[t * ldc + r] (+)= sum_k panel[k * 16 + r] * xs[t * ldx + k]` for
    /// `t < mr`, `r < 16`.
    fn micro(&self, xs: &[f32], ldx: usize, mr: usize, c: *mut f32, ldc: usize, simd: bool) {
        assert!(mr <= MR && xs.len() >= (mr - 1) * ldx + self.kc);
        #[cfg(target_arch = "x86_64")]
        if simd && super::cpu::CpuKernels::Avx2.is_supported() {
            let (p, x, kc, acc) = (self.panel.as_ptr(), xs.as_ptr(), self.kc, self.accumulate);
            // SAFETY: AVX2 is present (`simd`); the panel holds `kc * 16`
            // values, `xs` was checked above, and `c` is valid for `mr` rows
            // of 16 at stride `ldc` (see `run`).
            unsafe {
                match mr {
                    1 => micro_avx2::<1>(p, kc, x, ldx, c, ldc, acc),
                    2 => micro_avx2::<2>(p, kc, x, ldx, c, ldc, acc),
                    3 => micro_avx2::<3>(p, kc, x, ldx, c, ldc, acc),
                    4 => micro_avx2::<4>(p, kc, x, ldx, c, ldc, acc),
                    5 => micro_avx2::<5>(p, kc, x, ldx, c, ldc, acc),
                    _ => micro_avx2::<6>(p, kc, x, ldx, c, ldc, acc),
                }
            }
            return;
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = simd;
        let mut acc = [[0f32; NR]; MR];
        for k in 0..self.kc {
            let wk = &self.panel[k * NR..(k + 1) * NR];
            for (t, acc) in acc.iter_mut().enumerate().take(mr) {
                let xv = xs[t * ldx + k];
                for (a, &wv) in acc.iter_mut().zip(wk) {
                    *a += wv * xv;
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
#[target_feature(enable = "avx2,fma")]
unsafe fn micro_avx2<const MR: usize>(
    panel: *const f32,
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
        let w0 = _mm256_load_ps(panel.add(k * NR));
        let w1 = _mm256_load_ps(panel.add(k * NR + 8));
        for (t, acc) in acc.iter_mut().enumerate() {
            let xb = _mm256_broadcast_ss(&*x.add(t * ldx + k));
            acc[0] = _mm256_fmadd_ps(w0, xb, acc[0]);
            acc[1] = _mm256_fmadd_ps(w1, xb, acc[1]);
        }
    }
    for (t, acc) in acc.iter().enumerate() {
        let dst = c.add(t * ldc);
        let (mut a0, mut a1) = (acc[0], acc[1]);
        if accumulate {
            a0 = _mm256_add_ps(a0, _mm256_loadu_ps(dst));
            a1 = _mm256_add_ps(a1, _mm256_loadu_ps(dst.add(8)));
        }
        _mm256_storeu_ps(dst, a0);
        _mm256_storeu_ps(dst.add(8), a1);
    }
}
