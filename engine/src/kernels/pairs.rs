//! Which tile a product of a few tokens (a batched decode step's) runs on where the CPU has
//! 512-bit VNNI vectors: the 256-bit tile, one group's stream of 8 rows at a time, or the pair
//! tile, two groups side by side in each 512-bit vector (`kernels/avx2.rs`). Both do every
//! lane's integer and float operations in the same order: the bits are the same, only the
//! speed differs, and which is faster depends on the host.
//!
//! A pair tile does half the instructions a token and reads two streams a thread. On the AMD
//! EPYC (Zen 5) guest two streams cost more than the instructions saved up to 4 tokens:
//! decoding contexts together at the 1.7B shape, a step (ms, two alternating rounds) on pairs
//! against the 256-bit tile took Q4_K_M 2 contexts 54-61 against 34-39, 4 contexts 69-91
//! against 37-55; Q4_0 2 contexts 32-38 against 28-30, 4 contexts 46-50 against 37-41; at 8
//! pairs were level (Q4_K_M) or faster (Q4_0: 56-57 against 65-66), and faster at 16 and 32;
//! the default model's 2-context step 0.875x and 4-context 1.00x, Gemma 3 270M's 0.97x and
//! 0.94x (`llms bench-batch`, hand runs, docs/notes/engine.md). On the Intel Xeon guest (5 Dec
//! 2026, `matvec_rate rows`, a product from DRAM as a multiple of one token's) pairs took
//! Q4_1's 2, 3 and 4 tokens to 1.08, 1.27-1.30 and 1.51-1.52x from 1.20, 1.53-1.57 and
//! 1.84-1.87x (one token took the same on both); as multiples of the 256-bit tile's one token,
//! Q4_K's 3 and 4 to 1.63 and 1.87x from 1.71 and 2.05x, where its 1 and 2 tokens lost (1.13
//! and 1.37x against 1 and 1.26x); Q6_K was level at 3 and 4 and lost at 1 and 2. So for 2 to 4 tokens the choice is made while decoding, as the prefetch distance is
//! ([`super::ahead`], the same tuner): for each family of types and count of tokens, rounds of
//! products dealt alternately to the two tiles, and the faster kept until the next round. From
//! [`FROM`] tokens the pairs always won; one token never gained on either host and stays on the
//! 256-bit tile.
//!
//! `LLMS_PAIRS_FROM=<tokens>` (1 to 5) fixes the choice (pairs from that many tokens) and
//! turns the tuner off, for A/B runs.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{LazyLock, Mutex, PoisonError};
use std::time::Instant;

use super::ahead::{Tuner, MIN_BYTES};
use crate::repack::{Packed, PackedWeight};

/// The fewest tokens a product always takes two groups at a time for.
pub const FROM: usize = 5;

/// Types whose pair tiles behave alike: the legacy 32-wide blocks (Q4_0, Q4_1, Q8_0) and the
/// K-quants' 256-wide super-blocks (Q4_K, Q6_K), whose tiles spend more on unpacking a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Legacy = 0,
    K = 1,
}

impl Family {
    /// The family of pair tiles `w`'s type has on 512-bit vectors, if any.
    pub fn of(w: &PackedWeight) -> Option<Self> {
        match w.data {
            Packed::Q4S(_) | Packed::Q4(_) | Packed::Q8(_) => Some(Self::Legacy),
            Packed::Q4K(_) | Packed::Q6K(_) => Some(Self::K),
            _ => None,
        }
    }
}

/// Token counts below [`FROM`] whose tile is chosen, per family: bit `family * 8 + tokens` set
/// means pairs. Read by every product of a few tokens; written when the choice changes.
static PAIRS: AtomicU32 = AtomicU32::new(0);

/// The two choices as the tuner's candidates: 0 the 256-bit tile, 1 the pairs.
const CHOICES: [usize; 2] = [0, 1];

/// Whether a product of `family`'s groups against `tokens` tokens takes them in pairs.
#[inline(always)]
pub(crate) fn pairs(family: Family, tokens: usize) -> bool {
    // A prompt's products (many tokens) look no further. The tuners set the bits as they are
    // made (`LLMS_PAIRS_FROM` pins them): made by the first product of a few tokens that asks,
    // tuned or not (an atomic load once made).
    tokens >= FROM || {
        LazyLock::force(&TUNERS);
        (PAIRS.load(Ordering::Relaxed) >> bit(family, tokens)) & 1 != 0
    }
}

/// The bit of `tokens` (below [`FROM`]) in [`PAIRS`].
fn bit(family: Family, tokens: usize) -> usize {
    family as usize * 8 + tokens.min(7)
}

fn set(family: Family, tokens: usize, on: bool) {
    let b = 1u32 << bit(family, tokens);
    if on {
        PAIRS.fetch_or(b, Ordering::Relaxed);
    } else {
        PAIRS.fetch_and(!b, Ordering::Relaxed);
    }
}

/// `LLMS_PAIRS_FROM`, if it names a count from 1 to [`FROM`]; another value is refused with a
/// message and the tuner runs.
fn fixed_from_env() -> Option<usize> {
    super::ahead::fixed_setting("LLMS_PAIRS_FROM", |n| (1..=FROM).contains(&n), "a count of tokens from 1 to 5", "the tile")
}

/// One tuner for each family and count of tokens from 2 to [`FROM`] - 1 (index
/// `family * FROM + tokens`; the others unused).
static TUNERS: LazyLock<Mutex<Vec<Tuner>>> = LazyLock::new(|| Mutex::new(tuners(fixed_from_env())));

/// Fresh tuners; `from` pins pairs from that many tokens (and sets the choice now).
fn tuners(from: Option<usize>) -> Vec<Tuner> {
    let mut v = Vec::with_capacity(2 * FROM);
    for family in [Family::Legacy, Family::K] {
        for tokens in 0..FROM {
            let fixed = from.map(|n| usize::from(tokens >= n));
            set(family, tokens, fixed == Some(1));
            v.push(Tuner::over(&CHOICES, 0, fixed));
        }
    }
    v
}

/// Runs `product`, reading `bytes` of `family`'s weights for `tokens` tokens, on the tile its
/// tuner gives it, and tells the tuner its rate when it was a sample. As with the distance,
/// another product running at the same time may meet the sample's choice: a round's accuracy,
/// never a result.
pub fn tuned<R>(family: Option<Family>, bytes: usize, tokens: usize, product: impl FnOnce() -> R) -> R {
    let Some(family) = family else { return product() };
    if !(2..FROM).contains(&tokens) || bytes < MIN_BYTES || !crate::simd::has_zmm() {
        return product();
    }
    let i = family as usize * FROM + tokens;
    let (choice, sample) = TUNERS.lock().unwrap_or_else(PoisonError::into_inner)[i].take(bytes as u64);
    if pairs(family, tokens) != (choice == 1) {
        set(family, tokens, choice == 1);
    }
    let Some(s) = sample else { return product() };
    let t = Instant::now();
    let r = product();
    let secs = t.elapsed().as_secs_f64();
    let mut all = TUNERS.lock().unwrap_or_else(PoisonError::into_inner);
    all[i].record(s, bytes, secs);
    if all[i].exploiting() {
        set(family, tokens, all[i].chosen().0 == 1);
    }
    r
}

/// Pins pairs from `from` tokens as `LLMS_PAIRS_FROM` does (`Some`), or hands the choice back
/// to the tuners (`None`): for tests that must meet both tiles, and benchmarks.
pub fn pin(from: Option<usize>) {
    // Locked (so made, with the bits of its first tuners) before the new tuners set theirs.
    let mut t = TUNERS.lock().unwrap_or_else(PoisonError::into_inner);
    *t = tuners(from);
}

/// The token counts below [`FROM`] that take pairs now, per family, and whether the choice is
/// fixed (`LLMS_PAIRS_FROM`): for reports.
pub fn report() -> (Vec<usize>, Vec<usize>, bool) {
    let t = TUNERS.lock().unwrap_or_else(PoisonError::into_inner);
    let on = |f: Family| (1..FROM).filter(|&n| pairs(f, n)).collect::<Vec<_>>();
    (on(Family::Legacy), on(Family::K), t[0].is_fixed())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{matmul_packed, Acts, OutPtr};
    use crate::quant::GgmlType;
    use crate::ThreadPool;

    /// The tests here change the process's choice: one at a time.
    static ONE: Mutex<()> = Mutex::new(());

    /// The choice reaches the kernels: pinned, the bits say pairs exactly from the count named
    /// (and always from [`FROM`]); handed back to the tuners, nothing below [`FROM`] until a
    /// round chooses. Whichever tile runs, a product of 1 to 5 tokens has the same bits (the
    /// tiles' own agreement with the references is `kernels::tests`'). One test, so no other
    /// changes the pin while it runs.
    #[test]
    fn the_pin_sets_the_tile_and_the_bits_do_not_change() {
        let _one = ONE.lock().unwrap_or_else(PoisonError::into_inner);
        let (rows, cols) = (40, 512);
        let pool = ThreadPool::new(2);
        let mut runs: Vec<Vec<Vec<u32>>> = Vec::new();
        for from in [Some(1), Some(3), Some(FROM), None] {
            pin(from);
            for family in [Family::Legacy, Family::K] {
                for tokens in 1..=FROM + 3 {
                    let want = tokens >= from.unwrap_or(FROM);
                    assert_eq!(pairs(family, tokens), want, "{family:?} {tokens} tokens, pinned from {from:?}");
                }
            }
            let mut outs = Vec::new();
            for ty in [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K] {
                let data: Vec<u8> = (0..ty.row_bytes(cols) * rows).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
                let mut data = data;
                // Small finite f16 scales (0x2000 ~ 0.0078) where each block keeps them.
                for blk in data.chunks_exact_mut(ty.type_size()) {
                    let at = if ty == GgmlType::Q6K { ty.type_size() - 2 } else { 0 };
                    blk[at..at + 2].copy_from_slice(&[0, 0x20]);
                    if ty == GgmlType::Q4K {
                        blk[2..4].copy_from_slice(&[0, 0x20]);
                    }
                }
                let w = PackedWeight::pack(ty, rows, cols, &data).expect("a packed type");
                for tokens in 1..=FROM {
                    let x: Vec<f32> = (0..tokens * cols).map(|i| ((i as f32) * 0.37).sin()).collect();
                    let mut a = Acts::default();
                    a.prepare(&x, tokens, cols, &[crate::kernels::act_kind(ty)], &pool);
                    let mut out = vec![f32::NAN; rows * tokens];
                    matmul_packed(&w, &a, OutPtr::new(&mut out), rows, 0, w.groups());
                    assert!(out.iter().all(|v| v.is_finite()), "{ty:?} {tokens} tokens");
                    outs.push(out.iter().map(|v| v.to_bits()).collect());
                }
            }
            runs.push(outs);
        }
        pin(None);
        assert!(runs.windows(2).all(|w| w[0] == w[1]), "a product's bits changed with the tile");
    }

    /// Where the CPU has the pair tiles, the tuner keeps the faster tile for a count of tokens:
    /// products that take longer on one tile (a sleep stands in for the slower stream) make a
    /// round choose the other, and the choice reaches the kernels' bits.
    #[test]
    fn a_round_keeps_the_faster_tile() {
        if !crate::simd::has_zmm() {
            eprintln!("skipped: no 512-bit VNNI vectors here, so there is no pair tile to choose");
            return;
        }
        let _one = ONE.lock().unwrap_or_else(PoisonError::into_inner);
        pin(None);
        for slow_pairs in [true, false] {
            let (mut rounds, mut products) = (0, 0);
            while rounds < 3 {
                products += 1;
                assert!(products < 20_000, "the rounds never ended");
                let before = TUNERS.lock().unwrap()[Family::K as usize * FROM + 3].chosen().1;
                tuned(Some(Family::K), 4 << 20, 3, || {
                    let slow = pairs(Family::K, 3) == slow_pairs;
                    std::thread::sleep(std::time::Duration::from_micros(if slow { 400 } else { 100 }));
                });
                if TUNERS.lock().unwrap()[Family::K as usize * FROM + 3].chosen().1 > before {
                    rounds += 1;
                    if rounds == 3 {
                        assert_eq!(pairs(Family::K, 3), !slow_pairs, "pairs slow: {slow_pairs}");
                    }
                }
            }
        }
    }
}
