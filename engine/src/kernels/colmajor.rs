//! The channel-major 4-bit matrices' products ([`crate::colmajor`]: the layout, the active
//! set and the reference), each tile with the CPU's vector kernel (`avx2::colmajor`,
//! `neon::colmajor`) or the reference: all give the same bits.

use crate::colmajor::{tile_ref, ActiveSet, ColWeight, TILE};
use crate::pool::OutPtr;
use crate::quant::QK;

/// Computes `out[t * ldo + r] = W[r] · x_t` for the rows of tiles `t0..t1` and every token of
/// `a`, reading only the active channels' columns. Threads may run disjoint tile ranges at once.
/// For batches: each tile's codes are reused by every token. One token is better served by
/// [`matvec_tiles`], which reads memory in order.
pub fn matmul_col(w: &ColWeight, a: &ActiveSet, out: OutPtr, ldo: usize, t0: usize, t1: usize) {
    assert_eq!(a.nb * QK, w.cols, "activation width does not match the weight");
    assert!(t1 <= w.tiles());
    // Tokens inside: a tile's column codes, read once from memory, serve every token.
    for tile in t0..t1 {
        for t in 0..a.n {
            let mut y = [0.0f32; TILE];
            tile_any(w, a, t, tile, &mut y);
            let r0 = tile * TILE;
            for (i, &v) in y.iter().enumerate().take(w.rows.saturating_sub(r0)) {
                out.write(t * ldo + r0 + i, v);
            }
        }
    }
}

/// Computes token `t`'s rows of tiles `t0..t1`, `out[r] = W[r] · x_t` (rows past the matrix
/// are not written): the columns are read front to back over those rows, a few at a time, so
/// memory is read in order — one token reuses nothing, so the order is what counts. Each row
/// sums its blocks in the order the row-major kernels do: the same result, bit for bit.
/// Threads may run disjoint tile ranges at once.
pub fn matvec_tiles(w: &ColWeight, a: &ActiveSet, t: usize, t0: usize, t1: usize, out: OutPtr) {
    assert_eq!(a.nb * QK, w.cols, "activation width does not match the weight");
    assert!(t1 <= w.tiles() && t0 <= t1 && t < a.n);
    thread_local! {
        static BUF: std::cell::RefCell<(Vec<f32>, Vec<i32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    }
    BUF.with(|buf| {
        let (y, acc) = &mut *buf.borrow_mut();
        y.clear();
        y.resize((t1 - t0) * TILE, 0.0);
        #[cfg(target_arch = "x86_64")]
        let done = if crate::simd::has_avx2() {
            acc.resize((t1 - t0) * TILE, 0);
            // SAFETY: the CPU has AVX2, FMA and F16C (checked at run time).
            unsafe { super::avx2::colmajor::tiles(w, a, t, t0, t1, y, acc) };
            true
        } else {
            false
        };
        #[cfg(not(target_arch = "x86_64"))]
        let done = {
            let _ = acc; // the AVX2 kernel's accumulators
            false
        };
        if !done {
            // Tile by tile (the same bits as the column-ordered AVX2 pass).
            for tile in t0..t1 {
                let mut part = [0.0; TILE];
                tile_any(w, a, t, tile, &mut part);
                y[(tile - t0) * TILE..(tile - t0 + 1) * TILE].copy_from_slice(&part);
            }
        }
        for (i, &v) in y.iter().enumerate().take(w.rows.saturating_sub(t0 * TILE)) {
            out.write(t0 * TILE + i, v);
        }
    });
}

/// One tile with the CPU's vector kernel, or the reference.
fn tile_any(w: &ColWeight, a: &ActiveSet, t: usize, tile: usize, y: &mut [f32; TILE]) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked at run time).
        unsafe { super::avx2::colmajor::tile(w, a, t, tile, y) };
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if crate::simd::has_neon() {
        // SAFETY: NEON in use (checked at run time).
        unsafe { super::neon::colmajor::tile(w, a, t, tile, y) };
        return;
    }
    tile_ref(w, a, t, tile, y);
}
