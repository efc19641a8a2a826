//! Quantized weights in the 16-row layout ([`interleaved`](super::interleaved))
//! times batches of tokens, with AMX int8 tiles: the AMX family's prefill
//! kernel (batches too small to fill a tile run the AVX-512 VNNI kernel).
//!
//! One `tdpbssd` (`tdpbsud` for 4-bit weights, which are unsigned)
//! multiplies a 16-token × 32-byte activation tile (one block of each
//! token, read straight from [`Q8Acts`] with the row length as stride) by
//! an 8 × 64-byte weight tile (one block of the group's sixteen rows) and
//! leaves sixteen tokens × sixteen rows of exact block sums, 8192
//! multiply-adds in one instruction where VNNI needs 128. The 16-row
//! layout is already what AMX wants for its right operand: vector `s` of
//! a record holds bytes `4s .. 4s + 4` of each row, row `i` at byte `4i`.
//! 8-bit records are tiles as they are; 4-bit ones are unpacked, once per
//! group, into a scratch of one byte per value (low nibbles of vector `s`
//! are tile row `s`, high nibbles tile row `4 + s`).
//!
//! Scales differ per block, so the sums leave the tile after every block:
//! stored to a 1 KiB buffer, converted to float and scaled in AVX-512
//! registers exactly as [`gemv_x16_avx512`](super::gemv_x16_avx512) does
//! (`acc += (d_w * d_x) * isum (+ m_w * s_x)`, block after block), so the
//! result is bit for bit [`gemv_rows_scalar`](super::gemv::gemv_rows_scalar)'s.
//! Two tile sets alternate between blocks, and a block is scaled two
//! blocks after its product, so the tile unit computes while the vector
//! units scale (a vector load right after the tile store it reads would
//! stall both).
//!
//! Linux hands out AMX state only to processes that ask
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`): [`request_permission`] does, once
//! per process, before the family counts as supported. Without it the first
//! tile instruction raises SIGILL (how llama.cpp's AMX build dies on the
//! worker threads of a process that did not ask).

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;

use super::aligned::AlignedBytes;
use super::group_tiles::{groups, Interleaved, Job, Place};
use super::interleaved::{q4_record, AVX512_GROUP};
use super::quant::{Q8Acts, TOKEN_PAD};
use super::weights::QK;

/// Tokens per tile: the activation tile's rows. [`Q8Acts`] pads its tokens
/// to a multiple of this, so the last tile may be loaded whole.
const TILE_TOKENS: usize = TOKEN_PAD;

/// Batches smaller than this run the AVX-512 VNNI kernel: a tile of 16
/// tokens costs the same however few of them are real.
pub(crate) const MIN_TOKENS: usize = 16;

/// Tokens per pass over the matrix: 64 tokens' activations of a 576-wide
/// matrix (36 KiB) fit in L1 beside a group's weight tiles (9 KiB); 512
/// tokens at once ran 20% slower (the activation tiles came from L2).
const CHUNK_TOKENS: usize = 4 * TILE_TOKENS;

/// How many blocks the scaling of sums trails their tile products by.
const LAG: usize = 2;

/// Sums buffers in flight: a buffer is stored again only after the
/// scaling `LAG` blocks later has read it.
const RING: usize = LAG + 2;

/// Bytes of one block's weight tile: 8 rows of 64 bytes (16 rows × 4 values).
const B_TILE: usize = QK * AVX512_GROUP;

thread_local! {
    /// A 4-bit group unpacked to one byte per value, reused across calls.
    static UNPACKED: RefCell<AlignedBytes> = RefCell::new(AlignedBytes::default());
}

/// The tile configuration: palette 1; tiles 0 and 3 hold sums (16 tokens
/// × 16 rows of i32), 1 and 4 activations (16 tokens × 32 bytes), 2 and 5
/// weights (8 rows × 64 bytes).
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    /// `(tile, rows, bytes per row)` of every tile in use.
    const TILES: [(usize, u8, u16); 6] = [
        (0, 16, 64),
        (1, 16, 32),
        (2, 8, 64),
        (3, 16, 64),
        (4, 16, 32),
        (5, 8, 64),
    ];

    /// The configuration `ldtilecfg` loads.
    const fn new() -> TileConfig {
        let mut c = [0u8; 64];
        c[0] = 1;
        let mut i = 0;
        while i < Self::TILES.len() {
            let (t, rows, colsb) = Self::TILES[i];
            let colsb = colsb.to_le_bytes();
            c[16 + 2 * t] = colsb[0];
            c[17 + 2 * t] = colsb[1];
            c[48 + t] = rows;
            i += 1;
        }
        TileConfig(c)
    }
}

/// Asks Linux for this process's permission to use AMX tile data; true
/// once granted. Idempotent; the caller caches it.
#[cfg(target_os = "linux")]
pub(crate) fn request_permission() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these arguments only changes which state
    // components the kernel lets this process use.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

/// Other systems: no way to ask, so no AMX.
#[cfg(not(target_os = "linux"))]
pub(crate) fn request_permission() -> bool {
    false
}

/// A block's sums, as a tile stores them: 16 tokens × 16 rows.
#[repr(C, align(64))]
struct Sums([i32; TILE_TOKENS * AVX512_GROUP]);

/// Runs `job` on a matrix in groups of [`AVX512_GROUP`] rows.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VNNI, F16C, AMX-TILE and AMX-INT8, and
/// this process must hold the tile permission ([`request_permission`]); the
/// data must be 64-byte aligned; `out` must be valid for
/// `n_tokens * n_rows` values, and no other thread may write these rows.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn gemv_rows(job: Job) {
    if job.n_tokens < MIN_TOKENS {
        return super::gemv_x16_avx512::gemv_rows(job);
    }
    let (w, acts, n_tokens, blocks) = (job.w, job.acts, job.n_tokens, job.blocks);
    assert!(acts.qs.as_slice().len() >= n_tokens.next_multiple_of(TILE_TOKENS) * acts.cols);
    w.assert_holds(AVX512_GROUP, job.n_rows, blocks);
    let config = TileConfig::new();
    asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack, readonly));
    UNPACKED.with(|unpacked| {
        let mut unpacked = unpacked.borrow_mut();
        // Chunks of tokens whose activations stay in L1 while every group
        // of rows passes by (4-bit groups are unpacked once per chunk).
        for c0 in (0..n_tokens).step_by(CHUNK_TOKENS) {
            let chunk = c0..(c0 + CHUNK_TOKENS).min(n_tokens);
            for (g, at) in groups(AVX512_GROUP, job.n_rows, job.rows.clone(), job.out) {
                let group = match w {
                    Interleaved::Q8(qs, d) => Group {
                        tiles: qs.as_ptr().add(g * blocks * B_TILE),
                        scales: d.as_ptr().add(g * blocks * AVX512_GROUP).cast(),
                        scale_stride: AVX512_GROUP * 2,
                        mins: false,
                    },
                    Interleaved::Q4(data) => {
                        let records = data.as_ptr().add(g * blocks * q4_record(AVX512_GROUP));
                        unpacked.resize(blocks * B_TILE);
                        unpack_q4(records, blocks, unpacked.as_mut_slice().as_mut_ptr());
                        Group {
                            tiles: unpacked.as_slice().as_ptr(),
                            scales: records.add(QK / 2 * AVX512_GROUP),
                            scale_stride: q4_record(AVX512_GROUP),
                            mins: true,
                        }
                    }
                };
                for t0 in chunk.clone().step_by(TILE_TOKENS) {
                    if group.mins {
                        tile::<true>(&group, blocks, acts, t0, n_tokens, at);
                    } else {
                        tile::<false>(&group, blocks, acts, t0, n_tokens, at);
                    }
                }
            }
        }
    });
    asm!("tilerelease", options(nostack, nomem));
}

/// One group's weights as tiles.
struct Group {
    /// Block `b`'s weight tile at `tiles + b * B_TILE`.
    tiles: *const u8,
    /// Block `b`'s sixteen f16 scales at `scales + b * scale_stride`, and
    /// (4-bit) their sixteen minimums right after them.
    scales: *const u8,
    /// Bytes from one block's scales to the next's.
    scale_stride: usize,
    /// 4-bit weights: unsigned values with minimums.
    mins: bool,
}

/// Unpacks a 4-bit group's `blocks` records at `records` into weight
/// tiles at `dst` (`blocks * B_TILE` bytes, 64-byte aligned).
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn unpack_q4(records: *const u8, blocks: usize, dst: *mut u8) {
    let low4 = _mm512_set1_epi8(0x0F);
    for b in 0..blocks {
        let (rec, tile) = (
            records.add(b * q4_record(AVX512_GROUP)),
            dst.add(b * B_TILE),
        );
        for s in 0..4 {
            let raw = _mm512_load_si512(rec.add(64 * s).cast());
            let lo = _mm512_and_si512(raw, low4);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), low4);
            _mm512_store_si512(tile.add(64 * s).cast(), lo);
            _mm512_store_si512(tile.add(64 * (4 + s)).cast(), hi);
        }
    }
}

/// Block sums into one tile set: zero the sums tile `$c`, load the
/// activation tile `$a` (from `$x`, rows `$stride` bytes apart) and the
/// weight tile `$b` (from `$w`), multiply with `$op`, store the sums to `$out`.
macro_rules! block_sums {
    ($op:literal, [$c:literal, $a:literal, $b:literal], $x:expr, $stride:expr, $w:expr, $out:expr) => {
        asm!(
            concat!("tilezero tmm", $c),
            concat!("tileloadd tmm", $a, ", [{x} + {sx}*1]"),
            concat!("tileloadd tmm", $b, ", [{w} + {sw}*1]"),
            concat!($op, " tmm", $c, ", tmm", $a, ", tmm", $b),
            concat!("tilestored [{out} + {sw}*1], tmm", $c),
            x = in(reg) $x,
            sx = in(reg) $stride,
            w = in(reg) $w,
            sw = in(reg) 64usize,
            out = in(reg) $out,
            options(nostack),
        )
    };
}

/// Tokens `t0 .. t0 + 16` times one group: sums per block in the tile
/// unit, scaled and accumulated per block in registers, stored for the
/// tokens below `n_tokens`. `MINS`: 4-bit weights (`tdpbsud`, minimums).
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn tile<const MINS: bool>(
    w: &Group,
    blocks: usize,
    acts: &Q8Acts,
    t0: usize,
    n_tokens: usize,
    at: Place,
) {
    let cols = acts.cols;
    let a = acts.qs.as_slice().as_ptr().add(t0 * cols);
    let mut sums = [const { Sums([0; TILE_TOKENS * AVX512_GROUP]) }; RING];
    let mut acc = [_mm512_setzero_ps(); TILE_TOKENS];
    // Block `b`'s sums are scaled LAG blocks later: a vector load right
    // after the tile store it reads waits for that store to leave the core,
    // and the tile unit would idle meanwhile.
    for b in 0..blocks + LAG {
        if b < blocks {
            let (a, wt) = (a.add(b * QK), w.tiles.add(b * B_TILE));
            let c = sums[b % RING].0.as_mut_ptr();
            match (MINS, b % 2) {
                (false, 0) => block_sums!("tdpbssd", ["0", "1", "2"], a, cols, wt, c),
                (false, _) => block_sums!("tdpbssd", ["3", "4", "5"], a, cols, wt, c),
                (true, 0) => block_sums!("tdpbsud", ["0", "1", "2"], a, cols, wt, c),
                (true, _) => block_sums!("tdpbsud", ["3", "4", "5"], a, cols, wt, c),
            }
        }
        if b >= LAG {
            let b = b - LAG;
            scale_block::<MINS>(w, acts, t0, b, &sums[b % RING], &mut acc);
        }
    }
    for (t, acc) in acc.iter().enumerate().take(n_tokens - t0) {
        let mut lanes = [0f32; AVX512_GROUP];
        _mm512_storeu_ps(lanes.as_mut_ptr(), *acc);
        at.store(&lanes, t0 + t);
    }
}

/// `acc[t] += (d_w * d_x) * isum (+ m_w * s_x)` for block `b` of the
/// sixteen tokens from `t0`, in the scalar path's order.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn scale_block<const MINS: bool>(
    w: &Group,
    acts: &Q8Acts,
    t0: usize,
    b: usize,
    sums: &Sums,
    acc: &mut [__m512; TILE_TOKENS],
) {
    let scales = w.scales.add(b * w.scale_stride);
    let dw = _mm512_cvtph_ps(_mm256_loadu_si256(scales.cast()));
    let mw = if MINS {
        _mm512_cvtph_ps(_mm256_loadu_si256(scales.add(2 * AVX512_GROUP).cast()))
    } else {
        _mm512_setzero_ps()
    };
    let stride = acts.stride;
    let (dx, sx) = (
        acts.d.as_ptr().add(t0 * stride + b),
        acts.s.as_ptr().add(t0 * stride + b),
    );
    for (t, acc) in acc.iter_mut().enumerate() {
        let isum = _mm512_cvtepi32_ps(_mm512_load_si512(sums.0.as_ptr().add(16 * t).cast()));
        let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*dx.add(t * stride)));
        let mut term = _mm512_mul_ps(scale, isum);
        if MINS {
            term = _mm512_add_ps(term, _mm512_mul_ps(mw, _mm512_set1_ps(*sx.add(t * stride))));
        }
        *acc = _mm512_add_ps(*acc, term);
    }
}
