//! Many tokens times 4-bit weights on AVX2 (prefill): the rows are unpacked
//! once into an interleaved panel, then every token runs over it.
//!
//! The row-major kernel ([`gemv_simd`](super::gemv_simd)) multiplies one
//! row's block by one token's block and must add each vector's eight lanes
//! into one block sum, per row and token; it re-unpacks the nibbles for
//! every four tokens. Here a panel holds [`ROWS`] = 8 rows with their
//! nibbles already widened to bytes and interleaved four columns at a time:
//! one 32-byte vector holds columns `4s .. 4s + 4` of a block for all eight
//! rows. Broadcasting a token's four activation bytes of those columns and
//! `maddubs`-ing them against that vector gives eight rows' partial sums in
//! eight lanes, so a block's sums for eight rows need no horizontal
//! reduction, and the float part works on eight rows per instruction.
//!
//! Exactness: weights are 0..=15 and activations -127..=127, so a `maddubs`
//! pair is at most 3810 in magnitude and the eight of a block (30480) fit
//! the i16 lanes; `madd` by ones then widens to the exact i32 block sum.
//! The float part is the scalar path's, per lane: `acc += (d_w * d_x) *
//! isum + m_w * s_x`, block after block, without FMA. So the result is bit
//! for bit [`gemv_rows_scalar`](super::gemv::gemv_rows_scalar)'s.

use std::arch::x86_64::*;
use std::cell::RefCell;
use std::ops::Range;

use super::aligned::AlignedBytes;
use super::quant::Q8Acts;
use super::weights::QK;
use super::OutPtr;

/// Rows of one panel: one i32 lane each in a 256-bit vector.
const ROWS: usize = 8;
/// Tokens that share one pass over a panel (their sums live in registers).
const TOKENS: usize = 4;
/// Column groups of four per block.
const STEPS: usize = QK / 4;

/// Fewest tokens for which unpacking a panel pays; below it the row-major
/// kernel is faster (`cargo bench -p host --bench kernels -- families`).
pub(crate) const MIN_TOKENS: usize = 8;

/// Eight rows of a 4-bit matrix, unpacked and interleaved (see the module).
#[derive(Default)]
struct Panel {
    /// `blocks * STEPS` vectors of 32 bytes: for block `b` and step `s`,
    /// row `i`'s values of columns `4s .. 4s + 4` at `((b * STEPS + s) * ROWS + i) * 4`.
    qs: AlignedBytes,
    /// The rows' scales as f32, `ROWS` per block.
    d: Vec<f32>,
    /// The rows' minimums as f32, `ROWS` per block.
    m: Vec<f32>,
}

thread_local! {
    /// Per-thread panel, grown once, so the hot path never allocates.
    static PANEL: RefCell<Panel> = RefCell::new(Panel::default());
}

impl Panel {
    /// Unpacks rows `rows` (at most [`ROWS`]) of a matrix with `blocks`
    /// blocks per row; rows past its end are zeros.
    ///
    /// Per block, each row's 16 bytes widen to 32 (low nibbles, then high:
    /// values 0..32 in column order), whose eight 4-byte words are the
    /// steps; an 8 x 8 transpose of those words gives the panel's eight
    /// vectors of the block.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn fill(&mut self, qs: &[u8], d: &[u16], m: &[u16], blocks: usize, rows: Range<usize>) {
        self.qs.resize(blocks * QK * ROWS);
        self.d.resize(blocks * ROWS, 0.0);
        self.m.resize(blocks * ROWS, 0.0);
        let panel = self.qs.as_mut_slice().as_mut_ptr();
        let low4 = _mm_set1_epi8(0x0F);
        for b in 0..blocks {
            let mut words = [_mm256_setzero_si256(); ROWS];
            // The rows' f16 scales and minimums (zeros past the matrix).
            let (mut dh, mut mh) = ([0u16; ROWS], [0u16; ROWS]);
            for (i, r) in rows.clone().enumerate() {
                let q = &qs[(r * blocks + b) * QK / 2..][..QK / 2];
                let raw = _mm_loadu_si128(q.as_ptr().cast());
                let lo = _mm_and_si128(raw, low4);
                let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
                words[i] = _mm256_set_m128i(hi, lo);
                (dh[i], mh[i]) = (d[r * blocks + b], m[r * blocks + b]);
            }
            let (dst_d, dst_m) = (self.d.as_mut_ptr(), self.m.as_mut_ptr());
            // SAFETY: `d` and `m` hold `ROWS` values per block.
            _mm256_storeu_ps(
                dst_d.add(b * ROWS),
                _mm256_cvtph_ps(_mm_loadu_si128(dh.as_ptr().cast())),
            );
            _mm256_storeu_ps(
                dst_m.add(b * ROWS),
                _mm256_cvtph_ps(_mm_loadu_si128(mh.as_ptr().cast())),
            );
            for (s, v) in transpose8(words).into_iter().enumerate() {
                // SAFETY: `qs` holds `blocks * STEPS` aligned 32-byte vectors.
                _mm256_store_si256(panel.add((b * STEPS + s) * ROWS * 4).cast(), v);
            }
        }
    }
}

/// The 8 x 8 transpose of 32-bit words: word `i` of result `s` is word `s`
/// of `a[i]`.
#[inline(always)]
unsafe fn transpose8(a: [__m256i; 8]) -> [__m256i; 8] {
    // Pairs of rows interleaved: words 0, 1 | 4, 5 (even entries) and
    // 2, 3 | 6, 7 (odd entries). Loops, not closures: a closure would be
    // compiled without the caller's target features.
    let mut t = [_mm256_setzero_si256(); 8];
    for p in 0..4 {
        t[2 * p] = _mm256_unpacklo_epi32(a[2 * p], a[2 * p + 1]);
        t[2 * p + 1] = _mm256_unpackhi_epi32(a[2 * p], a[2 * p + 1]);
    }
    // Four rows' word k in the low half, word k + 4 in the high half.
    let u = [
        _mm256_unpacklo_epi64(t[0], t[2]),
        _mm256_unpackhi_epi64(t[0], t[2]),
        _mm256_unpacklo_epi64(t[1], t[3]),
        _mm256_unpackhi_epi64(t[1], t[3]),
        _mm256_unpacklo_epi64(t[4], t[6]),
        _mm256_unpackhi_epi64(t[4], t[6]),
        _mm256_unpacklo_epi64(t[5], t[7]),
        _mm256_unpackhi_epi64(t[5], t[7]),
    ];
    let mut out = [_mm256_setzero_si256(); 8];
    for k in 0..4 {
        out[k] = _mm256_permute2x128_si256::<0x20>(u[k], u[k + 4]);
        out[k + 4] = _mm256_permute2x128_si256::<0x31>(u[k], u[k + 4]);
    }
    out
}

/// Computes `out[t * n_rows + r]` for `r` in `rows` and every token of
/// `acts`, for a 4-bit matrix given as its parts (see `Packed::Q4`) with
/// `blocks` blocks per row.
///
/// # Safety
/// The CPU must support AVX2 and F16C (the caller's check); `out` must be
/// valid for `n_tokens * n_rows` values, and no other thread may write
/// these rows.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn gemm_rows(
    (qs, d, m): (&[u8], &[u16], &[u16]),
    n_rows: usize,
    blocks: usize,
    acts: &Q8Acts,
    n_tokens: usize,
    rows: Range<usize>,
    out: OutPtr,
) {
    PANEL.with(|panel| {
        let mut panel = panel.borrow_mut();
        let mut r0 = rows.start;
        while r0 < rows.end {
            let group = r0..(r0 + ROWS).min(rows.end);
            // SAFETY: the caller checked AVX2 and F16C.
            unsafe { panel.fill(qs, d, m, blocks, group.clone()) };
            let at = Place {
                n_rows,
                row: group.start,
                len: group.len(),
            };
            let mut t0 = 0;
            while t0 < n_tokens {
                let nt = (n_tokens - t0).min(TOKENS);
                // SAFETY: the caller's contract; `panel` holds `blocks` blocks.
                unsafe {
                    match nt {
                        1 => tile::<1>(&panel, blocks, acts, t0, at, out),
                        2 => tile::<2>(&panel, blocks, acts, t0, at, out),
                        3 => tile::<3>(&panel, blocks, acts, t0, at, out),
                        _ => tile::<TOKENS>(&panel, blocks, acts, t0, at, out),
                    }
                }
                t0 += nt;
            }
            r0 = group.end;
        }
    });
}

/// Where a panel's results go: rows `row .. row + len` of an output with
/// `n_rows` values per token.
#[derive(Clone, Copy)]
struct Place {
    n_rows: usize,
    row: usize,
    len: usize,
}

/// The panel's rows times tokens `t0 .. t0 + NT`, stored into `out`.
///
/// # Safety
/// As [`gemm_rows`]; `panel` holds `blocks` blocks and `acts` the tokens.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn tile<const NT: usize>(
    panel: &Panel,
    blocks: usize,
    acts: &Q8Acts,
    t0: usize,
    at: Place,
    out: OutPtr,
) {
    let mut xq = [std::ptr::null::<i8>(); NT];
    let (mut dx, mut sx) = ([std::ptr::null::<f32>(); NT], [std::ptr::null::<f32>(); NT]);
    for t in 0..NT {
        xq[t] = acts.row_qs(t0 + t).as_ptr();
        let (d, s) = acts.row_scales(t0 + t);
        (dx[t], sx[t]) = (d.as_ptr(), s.as_ptr());
    }
    let (w, dw, mw) = (
        panel.qs.as_slice().as_ptr(),
        panel.d.as_ptr(),
        panel.m.as_ptr(),
    );
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); NT];
    for b in 0..blocks {
        let mut pairs = [_mm256_setzero_si256(); NT];
        for s in 0..STEPS {
            let wv = _mm256_load_si256(w.add((b * STEPS + s) * ROWS * 4).cast());
            for t in 0..NT {
                let four = xq[t].add(b * QK + s * 4).cast::<i32>().read_unaligned();
                let xv = _mm256_set1_epi32(four);
                pairs[t] = _mm256_add_epi16(pairs[t], _mm256_maddubs_epi16(wv, xv));
            }
        }
        let (dwv, mwv) = (
            _mm256_loadu_ps(dw.add(b * ROWS)),
            _mm256_loadu_ps(mw.add(b * ROWS)),
        );
        for t in 0..NT {
            let isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs[t], ones));
            let scale = _mm256_mul_ps(dwv, _mm256_set1_ps(*dx[t].add(b)));
            let min = _mm256_mul_ps(mwv, _mm256_set1_ps(*sx[t].add(b)));
            let term = _mm256_add_ps(_mm256_mul_ps(scale, isum), min);
            acc[t] = _mm256_add_ps(acc[t], term);
        }
    }
    for (t, acc) in acc.into_iter().enumerate() {
        let dst = out.ptr().add((t0 + t) * at.n_rows + at.row);
        if at.len == ROWS {
            _mm256_storeu_ps(dst, acc);
        } else {
            let mut lanes = [0f32; ROWS];
            _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
            std::ptr::copy_nonoverlapping(lanes.as_ptr(), dst, at.len);
        }
    }
}
