//! AVX-512 VNNI integer block sums for the [`gemv`](super::gemv) kernels;
//! the driver and the float part are shared with AVX2 in
//! [`gemv_simd`](super::gemv_simd), so results are bit-identical to it and to
//! the scalar path.
//!
//! `vpdpbusd` multiplies 64 unsigned bytes by 64 signed bytes and adds each
//! group of four products into one of 16 i32 lanes, with no intermediate
//! saturation: one instruction per two blocks and token, where AVX2 needs
//! `maddubs` + `madd` per block. Q4 nibbles (0..15) are unsigned already.
//! Q8_0 weights are signed, so we feed `w + 128` (an XOR with 0x80) and
//! subtract `128 * sum(x)` per block afterwards from the activation block
//! sums [`Q8Acts`] keeps: exact, and the correction costs one shift and one
//! subtraction per eight blocks instead of sign tricks per block. The 4-bit
//! kernel reads the activations in a reordered copy (`Q8Acts::halves`) that
//! saves it the weight shuffles (see [`q4_sums`]).
//! The last group of a row (fewer than eight blocks) uses masked loads,
//! which never touch the masked-out bytes.

use std::arch::x86_64::*;
use std::ops::Range;

use super::gemv_simd::{BlockSums, Tokens};
use super::quant::Q8Acts;
use super::weights::{WeightMatrix, QK};
use super::OutPtr;

/// AVX-512 VNNI [`gemv_rows`](super::gemv::gemv_rows).
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI; `out` must
/// be valid for `n_tokens * w.rows()` values, and no other thread may write
/// these rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn gemv_rows(
    w: &WeightMatrix,
    acts: &Q8Acts,
    n_tokens: usize,
    rows: Range<usize>,
    out: OutPtr,
) {
    super::gemv_simd::gemv_rows::<Avx512Vnni>(w, acts, n_tokens, rows, out);
}

/// The AVX-512 VNNI [`BlockSums`].
struct Avx512Vnni;

/// Byte mask of the part of a `len`-byte span that lies in the 64 bytes
/// starting at `at`.
#[inline(always)]
fn mask64(len: usize, at: usize) -> __mmask64 {
    match len.saturating_sub(at) {
        0 => 0,
        n if n >= 64 => u64::MAX,
        n => (1u64 << n) - 1,
    }
}

impl BlockSums for Avx512Vnni {
    #[inline(always)]
    unsafe fn sums8<const Q4: bool, const NT: usize>(
        qs: *const u8,
        g: usize,
        n: usize,
        x: &Tokens<NT>,
    ) -> [__m256i; NT] {
        if Q4 {
            q4_sums(qs, g, n, x)
        } else {
            q8_sums(qs, g, n, x)
        }
    }
}

/// [`BlockSums::sums8`] for 4-bit weights. 64 bytes of weights are four
/// blocks; their low nibbles (quants 0..16 of each) and high nibbles
/// (16..32) meet the activations in `Q8Acts::halves` order, so two
/// `vpdpbusd` into one register give each block's products in its own
/// 128-bit lane, with no shuffle of weights or activations.
#[inline(always)]
unsafe fn q4_sums<const NT: usize>(
    qs: *const u8,
    g: usize,
    n: usize,
    x: &Tokens<NT>,
) -> [__m256i; NT] {
    let (src, len, low4) = (qs.add(g * QK / 2), n * QK / 2, _mm512_set1_epi8(0x0F));
    let mut lo = [_mm512_setzero_si512(); 2];
    let mut hi = [_mm512_setzero_si512(); 2];
    for h in 0..2 {
        let raw = _mm512_maskz_loadu_epi8(mask64(len, 64 * h), src.add(64 * h).cast());
        lo[h] = _mm512_and_si512(raw, low4);
        hi[h] = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), low4);
    }
    let mut sums = [_mm256_setzero_si256(); NT];
    for (t, sums) in sums.iter_mut().enumerate() {
        // `halves` rows are padded to whole groups of four blocks, so only
        // a group that does not exist at all must be skipped.
        let xs = x.halves[t].add(g * QK);
        let mut p = [_mm512_setzero_si512(); 2];
        for (h, p) in p.iter_mut().enumerate() {
            let k = if 4 * h < n { u64::MAX } else { 0 };
            let xl = _mm512_maskz_loadu_epi8(k, xs.add(128 * h));
            let xh = _mm512_maskz_loadu_epi8(k, xs.add(128 * h + 64));
            *p = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(*p, lo[h], xl), hi[h], xh);
        }
        // 128-bit lane k: [a0+a2, b0+b2, a1+a3, b1+b3] for block g + k (a)
        // and g + 4 + k (b), then [A, B, A, B] with A, B their sums.
        let s = _mm512_add_epi32(
            _mm512_unpacklo_epi32(p[0], p[1]),
            _mm512_unpackhi_epi32(p[0], p[1]),
        );
        let s = _mm512_add_epi32(s, _mm512_shuffle_epi32::<0x4E>(s));
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
        *sums = _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, s));
    }
    sums
}

/// [`BlockSums::sums8`] for signed 8-bit weights, biased to unsigned.
#[inline(always)]
unsafe fn q8_sums<const NT: usize>(
    qs: *const u8,
    g: usize,
    n: usize,
    x: &Tokens<NT>,
) -> [__m256i; NT] {
    // Four registers of `w + 128`, each two blocks in activation order.
    let (src, len) = (qs.add(g * QK), n * QK);
    let mut w = [_mm512_setzero_si512(); 4];
    for (i, w) in w.iter_mut().enumerate() {
        let raw = _mm512_maskz_loadu_epi8(mask64(len, 64 * i), src.add(64 * i).cast());
        *w = _mm512_xor_si512(raw, _mm512_set1_epi8(-128));
    }
    let mut sums = [_mm256_setzero_si256(); NT];
    for (t, sums) in sums.iter_mut().enumerate() {
        let xs = x.qs[t].add(g * QK);
        let mut p = [_mm512_setzero_si512(); 4];
        for (i, p) in p.iter_mut().enumerate() {
            let xv = _mm512_maskz_loadu_epi8(mask64(len, 64 * i), xs.add(64 * i));
            *p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[i], xv);
        }
        // Remove the bias: sum((w + 128) x) - 128 sum(x). `Q8Acts` pads its
        // sum rows to a multiple of 8, so this load is in bounds.
        let xsum = _mm256_loadu_si256(x.sums[t].add(g).cast());
        *sums = _mm256_sub_epi32(reduce8(p), _mm256_slli_epi32::<7>(xsum));
    }
    sums
}

/// Lane `j` = the exact sum of block `j`'s eight partial sums, where `p[i]`
/// holds block `2i` in its low 256 bits and block `2i + 1` in its high ones.
#[inline(always)]
unsafe fn reduce8(p: [__m512i; 4]) -> __m256i {
    let a = _mm512_add_epi32(
        _mm512_unpacklo_epi32(p[0], p[1]),
        _mm512_unpackhi_epi32(p[0], p[1]),
    );
    let b = _mm512_add_epi32(
        _mm512_unpacklo_epi32(p[2], p[3]),
        _mm512_unpackhi_epi32(p[2], p[3]),
    );
    // 128-bit lane k: the sums of lane k of p[0], p[1], p[2], p[3].
    let c = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
    // Add the two 128-bit lanes of each block: lane 0 holds blocks 0, 2, 4,
    // 6 and lane 2 blocks 1, 3, 5, 7.
    let d = _mm512_add_epi32(c, _mm512_shuffle_i64x2::<0xB1>(c, c));
    let order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, d))
}
