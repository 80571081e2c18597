//! Training-free Top-K activation sparsity (TEAL; ActiveFlow §3): the inputs of a layer's linear
//! projections keep only their largest-magnitude entries, so the weight columns of the other
//! input channels are not needed for this token.
//!
//! Per layer there are four sites — the attention input (Q, K, V), the attention output (O),
//! the feed-forward input (gate, up) and the gated hidden state (down). Each gets a magnitude
//! threshold calibrated on a text so that a target share of its entries falls below it:
//! entries under the threshold are treated as zero. The thresholds are data here; choosing them
//! runs the model, so it lives above it ([`crate::eval::calibrate_sparsity`]).

/// The sites of a layer whose inputs are sparsified.
pub const SITES: usize = 4;
pub const SITE_NAMES: [&str; SITES] = ["attn_in", "attn_out", "ffn_in", "ffn_hidden"];

/// Calibrated thresholds: `thresholds[layer][site]`; inputs with `|x| < t` are zeroed.
#[derive(Debug, Clone, PartialEq)]
pub struct Sparsity {
    /// Share of the weight bytes whose input is zeroed, on average over the sites.
    pub target: f32,
    /// The share of each site's entries zeroed (the same in every layer).
    pub levels: [f32; SITES],
    pub thresholds: Vec<[f32; SITES]>,
}

impl Sparsity {
    /// `attn_in 0.50, attn_out 0.70, ...`
    pub fn describe(&self) -> String {
        SITE_NAMES.iter().zip(self.levels).map(|(n, l)| format!("{n} {l:.2}")).collect::<Vec<_>>().join(", ")
    }

    /// Zeroes the entries of `x` below the threshold of `(layer, site)`; returns how many
    /// stayed non-zero.
    pub fn apply(&self, layer: usize, site: usize, x: &mut [f32]) -> usize {
        let t = self.thresholds[layer][site];
        let mut kept = 0;
        for v in x.iter_mut() {
            if v.abs() < t {
                *v = 0.0;
            } else {
                kept += 1;
            }
        }
        kept
    }
}

/// How often each input channel of each site is active (non-zero after sparsity) per token:
/// what a per-channel hot cache (ActiveFlow §4.2) ranks by.
#[derive(Debug, Clone)]
pub struct ChannelUse {
    /// `counts[layer][site][channel]`: tokens for which the channel was active.
    pub counts: Vec<[Vec<u32>; SITES]>,
    /// Weight rows each channel's column spans at a site (Q, K and V together; gate and up):
    /// the column's bytes, up to the quantization's constant.
    pub rows: [usize; SITES],
    /// Tokens counted.
    pub tokens: u64,
    /// `carried[site][d - 1]`: (token, channel) pairs active at some layer `l >= d` that were
    /// also active at layer `l - d` (same site and token); `reached[site][d - 1]`: all the
    /// pairs active at layers `l >= d`. Their ratio is how well a layer's active channels
    /// predict those `d` layers on (ActiveFlow's cross-layer similarity).
    pub carried: [[u64; MAX_AHEAD]; SITES],
    pub reached: [[u64; MAX_AHEAD]; SITES],
    /// Active masks (bitsets over the batch's rows x channels) of the last `MAX_AHEAD` layers.
    history: Vec<[Vec<u64>; SITES]>,
}

/// Layers ahead over which [`ChannelUse`] measures cross-layer similarity.
pub const MAX_AHEAD: usize = 8;

impl ChannelUse {
    pub fn new(c: &crate::loader::Config) -> Self {
        let widths = [c.dim, c.dim, c.dim, c.ffn_dim];
        Self {
            counts: (0..c.n_layers).map(|_| std::array::from_fn(|s| vec![0; widths[s]])).collect(),
            rows: [c.dim + 2 * c.kv_dim(), c.dim, 2 * c.ffn_dim, c.dim],
            tokens: 0,
            carried: [[0; MAX_AHEAD]; SITES],
            reached: [[0; MAX_AHEAD]; SITES],
            history: (0..MAX_AHEAD).map(|_| Default::default()).collect(),
        }
    }

    /// Counts the active entries of `x` (the batch's inputs of `site` at `layer`, row after
    /// row). Layers of one batch arrive in order, so the masks kept from the layers before
    /// belong to the same tokens.
    pub(crate) fn add(&mut self, layer: usize, site: usize, x: &[f32]) {
        let counts = &mut self.counts[layer][site];
        let width = counts.len();
        if layer == 0 && site == 0 {
            self.tokens += (x.len() / width) as u64;
        }
        let mut mask = std::mem::take(&mut self.history[layer % MAX_AHEAD][site]);
        mask.clear();
        mask.resize(x.len().div_ceil(64), 0);
        for (t, row) in x.chunks_exact(width).enumerate() {
            for (c, (n, &v)) in counts.iter_mut().zip(row).enumerate() {
                let (on, bit) = (v != 0.0, t * width + c);
                *n += u32::from(on);
                mask[bit / 64] |= u64::from(on) << (bit % 64);
            }
        }
        let active: u64 = mask.iter().map(|w| u64::from(w.count_ones())).sum();
        for d in 1..=MAX_AHEAD.min(layer) {
            let before = &self.history[(layer - d) % MAX_AHEAD][site];
            if before.len() != mask.len() {
                continue;
            }
            self.carried[site][d - 1] += mask.iter().zip(before).map(|(a, b)| u64::from((a & b).count_ones())).sum::<u64>();
            self.reached[site][d - 1] += active;
        }
        self.history[layer % MAX_AHEAD][site] = mask;
    }

    /// The share of the column bytes a token reads at a layer that were also active `d`
    /// layers before (1 <= d <= [`MAX_AHEAD`]): the precision of predicting a layer's reads
    /// from the activations `d` layers earlier; 1 when nothing was counted.
    pub fn similarity(&self, d: usize) -> f64 {
        let d = d.clamp(1, MAX_AHEAD) - 1;
        let (mut hit, mut all) = (0.0, 0.0);
        for s in 0..SITES {
            hit += self.rows[s] as f64 * self.carried[s][d] as f64;
            all += self.rows[s] as f64 * self.reached[s][d] as f64;
        }
        if all > 0.0 {
            hit / all
        } else {
            1.0
        }
    }

    /// (column bytes, reads) of every (layer, site, channel), bytes in weight rows.
    fn items(&self) -> impl Iterator<Item = (f64, f64)> + '_ {
        self.counts
            .iter()
            .flat_map(move |l| l.iter().zip(self.rows).flat_map(|(cs, rows)| cs.iter().map(move |&n| (rows as f64, f64::from(n)))))
    }

    /// The share of the layers' weight bytes a token reads (its active columns).
    pub fn read_share(&self) -> f64 {
        let (all, read) = self.items().fold((0.0, 0.0), |(a, r), (w, n)| (a + w, r + w * n));
        read / (all * self.tokens.max(1) as f64)
    }

    /// The share of the column bytes read that a cache would serve if it kept the most used
    /// channels' columns, `share` of the layers' weight bytes, for the whole run (ranked on the
    /// same run: what an online frequency cache converges to at best).
    pub fn hit_rate(&self, share: f64) -> f64 {
        let mut items: Vec<(f64, f64)> = self.items().collect();
        items.sort_by(|a, b| b.1.total_cmp(&a.1));
        let all: f64 = items.iter().map(|i| i.0).sum();
        let read: f64 = items.iter().map(|i| i.0 * i.1).sum();
        let (mut kept, mut hit) = (0.0, 0.0);
        for (w, n) in items {
            if kept + w > share * all {
                break;
            }
            kept += w;
            hit += w * n;
        }
        if read > 0.0 {
            hit / read
        } else {
            1.0
        }
    }
}

/// Log-spaced histogram of magnitudes: bounded memory however long the calibration text.
#[derive(Debug, Clone)]
pub(crate) struct Hist {
    bins: Vec<u64>,
    total: u64,
}

const BINS: usize = 4096;
const LO: f32 = -24.0; // log2 of the smallest magnitude binned apart from zero
const HI: f32 = 16.0;

impl Hist {
    fn new() -> Self {
        Self { bins: vec![0; BINS + 1], total: 0 }
    }
    fn bin_of(v: f32) -> usize {
        let a = v.abs();
        if a == 0.0 || !a.is_finite() {
            return 0;
        }
        let l = a.log2().clamp(LO, HI);
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
        let b = ((l - LO) / (HI - LO) * (BINS - 1) as f32) as usize;
        1 + b.min(BINS - 1)
    }
    fn add(&mut self, x: &[f32]) {
        for &v in x {
            self.bins[Self::bin_of(v)] += 1;
        }
        self.total += x.len() as u64;
    }
    /// The magnitude below which a share `q` of the entries lies (the upper edge of its bin).
    #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    fn quantile(&self, q: f32) -> f32 {
        if q <= 0.0 || self.total == 0 {
            return 0.0;
        }
        let want = (f64::from(q) * self.total as f64).ceil() as u64;
        let mut seen = 0;
        for (b, &n) in self.bins.iter().enumerate() {
            seen += n;
            if seen >= want {
                if b == 0 {
                    return f32::MIN_POSITIVE;
                }
                return (LO + b as f32 * (HI - LO) / (BINS - 1) as f32).exp2();
            }
        }
        f32::INFINITY
    }
}

/// Magnitude statistics of every site, filled by a session's forward passes.
#[derive(Debug, Clone)]
pub struct Calibrator {
    pub(crate) hists: Vec<[Hist; SITES]>,
}

impl Calibrator {
    pub fn new(n_layers: usize) -> Self {
        Self { hists: (0..n_layers).map(|_| std::array::from_fn(|_| Hist::new())).collect() }
    }
    pub(crate) fn add(&mut self, layer: usize, site: usize, x: &[f32]) {
        self.hists[layer][site].add(x);
    }

    /// Share of the entries seen at `site` (over all layers) that `sp` would zero.
    #[allow(clippy::cast_precision_loss)]
    pub fn share_below(&self, site: usize, sp: &Sparsity) -> f64 {
        let (mut below, mut total) = (0u64, 0u64);
        for (h, t) in self.hists.iter().zip(&sp.thresholds) {
            let h = &h[site];
            let edge = Hist::bin_of(t[site]);
            below += h.bins[..edge.min(h.bins.len())].iter().sum::<u64>();
            total += h.total;
        }
        if total == 0 {
            0.0
        } else {
            below as f64 / total as f64
        }
    }
    /// Thresholds that zero a share `levels[site]` of each site's entries.
    pub fn thresholds(&self, target: f32, levels: [f32; SITES]) -> Sparsity {
        Sparsity { target, levels, thresholds: self.hists.iter().map(|h| std::array::from_fn(|s| h[s].quantile(levels[s]))).collect() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two layers; in layer 0 the attention input's channel 0 is always active and the rest
    /// never; everything else is active half the time.
    #[test]
    fn channel_use_counts_reads_and_ranks_the_hot_columns() {
        let c = crate::loader::Config {
            arch: "llama".into(),
            n_layers: 2,
            dim: 4,
            ffn_dim: 8,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 2,
            vocab: 10,
            ctx_len: 16,
            rope_base: 1e4,
            rope_dims: 2,
            rope_neox: false,
            rope_freq_scale: 1.0,
            rope_factors: None,
            norm_eps: 1e-5,
            embd_scale: None,
            ffn_gelu: false,
            swa: None,
        };
        let mut u = ChannelUse::new(&c);
        assert_eq!(u.rows, [4 + 2 * 2, 4, 16, 4]);
        for t in 0..4 {
            for layer in 0..2 {
                for site in 0..SITES {
                    let w = u.counts[layer][site].len();
                    let x: Vec<f32> = (0..2 * w)
                        .map(|i| {
                            let ch = i % w;
                            let on = if layer == 0 && site == 0 { ch == 0 } else { (ch + t).is_multiple_of(2) };
                            f32::from(u8::from(on))
                        })
                        .collect();
                    u.add(layer, site, &x);
                }
            }
        }
        assert_eq!(u.tokens, 8);
        assert_eq!(u.counts[0][0], vec![8, 0, 0, 0]);
        assert!(u.counts[1][3].iter().all(|&n| n == 4));
        // Column bytes (rows): site 0 is 4 channels x 8 rows per layer; layer 0 reads 8 of its
        // 32, the rest half of theirs.
        let all = 2.0 * (4.0 * 8.0 + 4.0 * 4.0 + 4.0 * 16.0 + 8.0 * 4.0);
        let read = 8.0 + (all - 32.0) / 2.0;
        assert!((u.read_share() - read / all).abs() < 1e-12);
        // Layer 0's channel 0 is the hottest column: a cache of just its bytes serves its reads.
        assert!((u.hit_rate(8.0 / all) - 8.0 * 8.0 / (read * 8.0)).abs() < 1e-12);
        assert!((u.hit_rate(1.0) - 1.0).abs() < 1e-12);
        // Cross-layer: layer 1 repeats layer 0 except at the attention input, where layer 0
        // had only channel 0 (active at layer 1 for even t): 4 of its 16 active entries carried.
        assert_eq!((u.carried[0][0], u.reached[0][0]), (4, 16));
        let (hit, all) = (8.0 * 4.0 + 4.0 * 16.0 + 16.0 * 16.0 + 4.0 * 32.0, 8.0 * 16.0 + 4.0 * 16.0 + 16.0 * 16.0 + 4.0 * 32.0);
        assert!((u.similarity(1) - hit / all).abs() < 1e-12, "{}", u.similarity(1));
        assert!((u.similarity(2) - 1.0).abs() < 1e-12, "two layers: nothing two apart");
        let rates: Vec<f64> = [0.0, 0.1, 0.3, 0.6, 0.9].iter().map(|&c| u.hit_rate(c)).collect();
        assert!(rates.windows(2).all(|w| w[0] <= w[1]), "{rates:?}");
        assert_eq!(rates[0], 0.0);
    }

    #[test]
    fn quantiles_split_the_entries_as_asked() {
        let mut h = Hist::new();
        let xs: Vec<f32> = (1..=10_000).map(|i| i as f32 / 1000.0).collect();
        h.add(&xs);
        for q in [0.1f32, 0.5, 0.7, 0.9] {
            let t = h.quantile(q);
            let below = xs.iter().filter(|&&x| x < t).count() as f32 / xs.len() as f32;
            assert!((below - q).abs() < 0.01, "q {q}: threshold {t} puts {below} below");
        }
        assert_eq!(h.quantile(0.0), 0.0);
    }

    #[test]
    fn apply_zeroes_below_the_threshold_only() {
        let sp = Sparsity { target: 0.5, levels: [0.5; SITES], thresholds: vec![[0.5; SITES]] };
        let mut x = vec![0.1, -0.6, 0.49, -0.2, 2.0];
        assert_eq!(sp.apply(0, 1, &mut x), 2);
        assert_eq!(x, vec![0.0, -0.6, 0.0, 0.0, 2.0]);
    }
}
