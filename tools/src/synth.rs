//! `llms synth`: random-weight GGUF models of any supported architecture and shape, with the
//! default model's tokenizer. Two uses: checking each architecture against llama.cpp on the
//! same file (small shapes; `tools/tests/synth.rs`), and running the experiments at the shape
//! of the models the paper measured (`--like llama2-7b`): the outputs are noise, but the bytes
//! read, the compute and the KV size per token are those of the real model.
//!
//! Weights are drawn block by block straight in their format (a scale chosen for the wanted
//! spread and random codes), so no quantizer is involved and any type costs the same to make.
//! Every tensor has its own generator seeded from `--seed` and its name: the same arguments
//! give the same file, byte for byte, on any machine.
#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]

use std::io::BufWriter;
use std::path::Path;

use anyhow::{bail, Context, Result};
use engine::gguf::{GgufFile, TensorSpec, Value, Writer};
use engine::GgmlType;
use half::f16;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The architectures the engine runs (`engine::loader`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    Llama,
    Qwen2,
}

impl Arch {
    fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
        }
    }
}

/// Weight types for the large matrices. `q4_k_m` follows llama.cpp's recipe in kind: Q4_K,
/// with Q6_K for the output and for `attn_v` / `ffn_down` in the layers llama.cpp gives more
/// bits (the first and last eighth and every third between); rows not a multiple of 256 fall
/// back as llama.cpp's do (Q4_K -> Q5_0, Q6_K -> Q8_0). `q5_k_m` is the same recipe with Q5_K
/// (falling back to Q5_1). (llama.cpp's Q4_K_M recipe also uses Q5_K for `attn_v` of wide-GQA
/// models; here those stay Q4_K.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WType {
    F32,
    F16,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
    #[value(name = "q4_k_m")]
    Q4KM,
    #[value(name = "q5_k_m")]
    Q5KM,
}

/// A model's shape and what else decides its arithmetic.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Shape {
    pub arch: Arch,
    pub dim: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub ffn: usize,
    pub ctx: usize,
    pub rope_base: f32,
    /// Llama 3's RoPE frequency factors (`rope_freqs.weight`, llama 3.1's scaling: factor 8,
    /// low/high frequency factors 1 and 4, 8192 original positions).
    pub llama3_rope: bool,
    /// Linear RoPE scaling factor (`rope.scaling.factor`; 1: none).
    pub rope_scale: f32,
    /// The output projection is the token embedding (no `output.weight`).
    pub tied: bool,
}

/// The shapes of the models the experiments are compared at. Vocabularies are the default
/// model's (49152) whatever the original's: the tokenizer is the default model's.
pub const PRESETS: &[(&str, Shape)] = &[
    ("smollm2-135m", shape(Arch::Llama, 576, 30, 9, 3, 1536, 8192, 100_000.0, false, true)),
    ("smollm2-1.7b", shape(Arch::Llama, 2048, 24, 32, 32, 8192, 8192, 130_000.0, false, true)),
    ("qwen2-1.5b", shape(Arch::Qwen2, 1536, 28, 12, 2, 8960, 32768, 1_000_000.0, false, true)),
    ("llama2-7b", shape(Arch::Llama, 4096, 32, 32, 32, 11008, 4096, 10_000.0, false, false)),
    ("mistral-7b", shape(Arch::Llama, 4096, 32, 32, 8, 14336, 32768, 1_000_000.0, false, false)),
    ("llama3-8b", shape(Arch::Llama, 4096, 32, 32, 8, 14336, 131_072, 500_000.0, true, false)),
];

#[allow(clippy::too_many_arguments)]
const fn shape(
    arch: Arch,
    dim: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    ffn: usize,
    ctx: usize,
    rope_base: f32,
    llama3_rope: bool,
    tied: bool,
) -> Shape {
    Shape { arch, dim, layers, heads, kv_heads, ffn, ctx, rope_base, llama3_rope, rope_scale: 1.0, tied }
}

/// A preset by name.
pub fn preset(name: &str) -> Result<Shape> {
    PRESETS.iter().find(|(n, _)| *n == name).map(|(_, s)| s.clone()).ok_or_else(|| {
        let names: Vec<&str> = PRESETS.iter().map(|(n, _)| *n).collect();
        anyhow::anyhow!("no preset {name:?} (presets: {})", names.join(", "))
    })
}

impl Shape {
    /// Refuses shapes the engine (or llama.cpp) cannot run, before anything is written.
    pub fn check(&self) -> Result<()> {
        let Shape { dim, layers, heads, kv_heads, ffn, ctx, .. } = *self;
        if [dim, layers, heads, kv_heads, ffn, ctx].contains(&0) {
            bail!("every dimension must be positive: {self:?}");
        }
        if dim % heads != 0 || heads % kv_heads != 0 {
            bail!("{dim} dims, {heads} heads and {kv_heads} KV heads do not divide");
        }
        let hd = dim / heads;
        if hd % 2 != 0 || hd > 512 {
            bail!("head size {hd} must be even and at most 512");
        }
        if !dim.is_multiple_of(32) || !ffn.is_multiple_of(32) {
            bail!("dim {dim} and ffn {ffn} must be multiples of 32 (the quantized blocks)");
        }
        if dim > 1 << 15 || ffn > 1 << 17 || layers > 256 || ctx >= 1 << 24 {
            bail!("{self:?} is beyond any model this tool is for");
        }
        if !(self.rope_base.is_finite() && self.rope_base > 1.0 && self.rope_scale.is_finite() && self.rope_scale >= 1.0) {
            bail!("rope base {} / scale {} out of range", self.rope_base, self.rope_scale);
        }
        if self.llama3_rope && self.arch != Arch::Llama {
            bail!("Llama 3's RoPE factors are read for the llama architecture only");
        }
        Ok(())
    }

    /// Weights in the file (matrices, embedding, norms), for the summary.
    pub fn params(&self, vocab: usize) -> u64 {
        let kv = self.dim / self.heads * self.kv_heads;
        let per_layer = 2 * self.dim * self.dim + 2 * self.dim * kv + 3 * self.dim * self.ffn + 2 * self.dim;
        let out = if self.tied { 0 } else { vocab * self.dim };
        (self.layers * per_layer + vocab * self.dim + out + self.dim) as u64
    }
}

/// What was written.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Written {
    pub bytes: u64,
    pub params: u64,
    pub vocab: usize,
}

/// Writes a random-weight model of `shape` with matrices of type `ty` to `out`, taking the
/// tokenizer (every `tokenizer.*` key) from the GGUF file `tokenizer_from`. Written to a
/// temporary name beside `out` and renamed, so a cut-off run leaves no half file under `out`.
pub fn write(shape: &Shape, ty: WType, seed: u64, tokenizer_from: &Path, out: &Path) -> Result<Written> {
    shape.check()?;
    let src = GgufFile::open(tokenizer_from).with_context(|| format!("tokenizer source {}", tokenizer_from.display()))?;
    let mut meta: Vec<(String, Value)> = Vec::new();
    let a = shape.arch.name();
    let hd = shape.dim / shape.heads;
    let u = |v: usize| Value::U32(v as u32);
    meta.push(("general.architecture".into(), Value::String(a.into())));
    meta.push(("general.name".into(), Value::String(format!("llms synth {a} {}x{} seed {seed}", shape.layers, shape.dim))));
    for (k, v) in [
        ("context_length", u(shape.ctx)),
        ("embedding_length", u(shape.dim)),
        ("block_count", u(shape.layers)),
        ("feed_forward_length", u(shape.ffn)),
        ("attention.head_count", u(shape.heads)),
        ("attention.head_count_kv", u(shape.kv_heads)),
        ("rope.dimension_count", u(hd)),
        ("rope.freq_base", Value::F32(shape.rope_base)),
        ("attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
    ] {
        meta.push((format!("{a}.{k}"), v));
    }
    if shape.rope_scale != 1.0 {
        meta.push((format!("{a}.rope.scaling.type"), Value::String("linear".into())));
        meta.push((format!("{a}.rope.scaling.factor"), Value::F32(shape.rope_scale)));
    }
    let mut vocab = 0;
    for (k, v) in &src.header.metadata {
        if k.starts_with("tokenizer.") {
            if k == "tokenizer.ggml.tokens" {
                vocab = v.as_array().map_or(0, <[Value]>::len);
            }
            meta.push((k.clone(), v.clone()));
        }
    }
    if vocab == 0 {
        bail!("{} has no tokenizer.ggml.tokens", tokenizer_from.display());
    }

    let tensors = tensor_list(shape, ty, vocab);
    let specs: Vec<TensorSpec> = tensors.iter().map(|t| t.spec.clone()).collect();
    let tmp = out.with_extension("synth-partial");
    let file = std::fs::File::create(&tmp).with_context(|| format!("create {}", tmp.display()))?;
    let result = (|| -> Result<u64> {
        let mut w = Writer::new(BufWriter::with_capacity(1 << 20, file), &meta, &specs)?;
        let mut buf = Vec::new();
        for t in &tensors {
            fill(t, seed, &mut buf);
            w.tensor(&buf).with_context(|| t.spec.name.clone())?;
        }
        let f = w.finish()?.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()?;
        Ok(f.metadata()?.len())
    })();
    let bytes = match result {
        Ok(b) => b,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e.context(format!("writing {}", out.display())));
        }
    };
    std::fs::rename(&tmp, out).with_context(|| format!("rename to {}", out.display()))?;
    Ok(Written { bytes, params: shape.params(vocab), vocab })
}

/// What a tensor holds, so its values can be drawn.
#[derive(Debug, Clone, Copy)]
enum Fill {
    /// Entries with this standard deviation.
    Spread(f32),
    /// Uniform in [lo, hi] (norm weights, biases), f32.
    Range(f32, f32),
    /// Llama 3.1's frequency factors for these rotated pairs (and this RoPE base).
    Llama3Freqs(f32),
}

#[derive(Debug)]
struct Tensor {
    spec: TensorSpec,
    fill: Fill,
}

fn tensor_list(s: &Shape, ty: WType, vocab: usize) -> Vec<Tensor> {
    let hd = s.dim / s.heads;
    let kv = hd * s.kv_heads;
    // llama.cpp's use_more_bits (the first test keeps the subtraction from wrapping).
    let more_bits = |i: usize| i < s.layers / 8 || i >= 7 * s.layers / 8 || (i - s.layers / 8) % 3 == 2;
    // `big` is true for the tensors Q4_K_M keeps at 6 bits.
    let mat_ty = |cols: usize, big: bool| -> GgmlType {
        let want = match ty {
            WType::F32 => GgmlType::F32,
            WType::F16 => GgmlType::F16,
            WType::Q8_0 => GgmlType::Q8_0,
            WType::Q4_0 => GgmlType::Q4_0,
            WType::Q4KM | WType::Q5KM if big => GgmlType::Q6K,
            WType::Q4KM => GgmlType::Q4K,
            WType::Q5KM => GgmlType::Q5K,
        };
        match want {
            GgmlType::Q6K if !cols.is_multiple_of(256) => GgmlType::Q8_0,
            GgmlType::Q4K if !cols.is_multiple_of(256) => GgmlType::Q5_0,
            GgmlType::Q5K if !cols.is_multiple_of(256) => GgmlType::Q5_1,
            t => t,
        }
    };
    let mat = |name: String, cols: usize, rows: usize, big: bool, spread: f32| Tensor {
        spec: TensorSpec { name, dims: vec![cols as u64, rows as u64], ty: mat_ty(cols, big) },
        fill: Fill::Spread(spread),
    };
    let vec = |name: String, n: usize, lo: f32, hi: f32| Tensor {
        spec: TensorSpec { name, dims: vec![n as u64], ty: GgmlType::F32 },
        fill: Fill::Range(lo, hi),
    };
    let fan_in = |cols: usize| 1.0 / (cols as f32).sqrt();
    let mut t = Vec::new();
    // Logits spread ~3 (an rms-normalised state times rows of spread 3/sqrt(dim)): the top
    // token stands clear of the next, so two engines' rounding does not flip it.
    t.push(mat("token_embd.weight".into(), s.dim, vocab, s.tied, 3.0 * fan_in(s.dim)));
    t.push(vec("output_norm.weight".into(), s.dim, 0.8, 1.2));
    if !s.tied {
        t.push(mat("output.weight".into(), s.dim, vocab, true, 3.0 * fan_in(s.dim)));
    }
    if s.llama3_rope {
        t.push(Tensor {
            spec: TensorSpec { name: "rope_freqs.weight".into(), dims: vec![hd as u64 / 2], ty: GgmlType::F32 },
            fill: Fill::Llama3Freqs(s.rope_base),
        });
    }
    for i in 0..s.layers {
        let p = |n: &str| format!("blk.{i}.{n}");
        t.push(vec(p("attn_norm.weight"), s.dim, 0.8, 1.2));
        // Q and K at twice the fan-in spread: scores spread ~4, so attention is peaked and
        // depends on positions (RoPE) and heads (GQA), which is what the checks are for.
        for (n, rows, spread) in [("attn_q", s.dim, 2.0), ("attn_k", kv, 2.0), ("attn_v", kv, 1.0)] {
            t.push(mat(p(&format!("{n}.weight")), s.dim, rows, n == "attn_v" && more_bits(i), spread * fan_in(s.dim)));
            if s.arch == Arch::Qwen2 {
                t.push(vec(p(&format!("{n}.bias")), rows, -0.5, 0.5));
            }
        }
        t.push(mat(p("attn_output.weight"), s.dim, s.dim, false, fan_in(s.dim)));
        t.push(vec(p("ffn_norm.weight"), s.dim, 0.8, 1.2));
        t.push(mat(p("ffn_gate.weight"), s.dim, s.ffn, false, fan_in(s.dim)));
        t.push(mat(p("ffn_up.weight"), s.dim, s.ffn, false, fan_in(s.dim)));
        t.push(mat(p("ffn_down.weight"), s.ffn, s.dim, more_bits(i), fan_in(s.ffn)));
    }
    t
}

/// Draws tensor `t` into `buf` (its whole byte image).
fn fill(t: &Tensor, seed: u64, buf: &mut Vec<u8>) {
    let name_hash = t.spec.name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ name_hash);
    let n: u64 = t.spec.dims.iter().product();
    let ty = t.spec.ty;
    buf.clear();
    buf.resize((n / ty.block_size() as u64 * ty.type_size() as u64) as usize, 0);
    match t.fill {
        Fill::Range(lo, hi) => {
            for c in buf.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.gen_range(lo..=hi).to_le_bytes());
            }
        }
        Fill::Llama3Freqs(base) => {
            let dims = 2 * n as usize;
            for (i, c) in buf.chunks_exact_mut(4).enumerate() {
                c.copy_from_slice(&llama3_factor(base, i, dims).to_le_bytes());
            }
        }
        Fill::Spread(sd) => {
            rng.fill_bytes(buf);
            blocks(ty, sd, &mut rng, buf);
        }
    }
}

/// Llama 3.1's RoPE frequency factor for pair `i` of `dims` rotated channels (as the GGUF
/// converter computes `rope_freqs`: wavelengths past the low-frequency bound divided by the
/// factor 8, shorter than the high-frequency bound kept, smoothed between).
fn llama3_factor(base: f32, i: usize, dims: usize) -> f32 {
    let (factor, low, high, orig) = (8.0f64, 1.0f64, 4.0f64, 8192.0f64);
    let freq = 1.0 / f64::from(base).powf(2.0 * i as f64 / dims as f64);
    let wavelen = 2.0 * std::f64::consts::PI / freq;
    let (low_wl, high_wl) = (orig / low, orig / high);
    let f = if wavelen < high_wl {
        1.0
    } else if wavelen > low_wl {
        factor
    } else {
        let smooth = (orig / wavelen - low) / (high - low);
        1.0 / ((1.0 - smooth) / factor + smooth)
    };
    f as f32
}

/// Sets the scale fields of every block in `buf` (already random bytes) so the weights'
/// spread is `sd`; codes stay as drawn. Float types are redrawn uniform with that spread.
fn blocks(ty: GgmlType, sd: f32, rng: &mut ChaCha8Rng, buf: &mut [u8]) {
    let amp = sd * 3f32.sqrt();
    let put = |b: &mut [u8], at: usize, x: f32| b[at..at + 2].copy_from_slice(&f16::from_f32(x).to_le_bytes());
    match ty {
        GgmlType::F32 => buf.chunks_exact_mut(4).for_each(|c| c.copy_from_slice(&rng.gen_range(-amp..=amp).to_le_bytes())),
        GgmlType::F16 => buf.chunks_exact_mut(2).for_each(|c| put(c, 0, rng.gen_range(-amp..=amp))),
        // Code spreads: uniform 4-bit (q - 8) 4.61, 5-bit (q - 16) 9.23, signed 8-bit 73.9.
        GgmlType::Q4_0 => buf.chunks_exact_mut(18).for_each(|b| put(b, 0, sd / 4.61)),
        GgmlType::Q5_0 => buf.chunks_exact_mut(22).for_each(|b| put(b, 0, sd / 9.23)),
        // w = q d + m: m = -15.5 d centres the codes.
        GgmlType::Q5_1 => buf.chunks_exact_mut(24).for_each(|b| {
            put(b, 0, sd / 9.23);
            put(b, 2, -15.5 * sd / 9.23);
        }),
        GgmlType::Q8_0 => buf.chunks_exact_mut(34).for_each(|b| put(b, 0, sd / 73.9)),
        // w = d sc q - dmin m, 6-bit sc and m: dmin = 7.5 d centres the blocks on average; the
        // spread (codes and the per-sub-block offsets together) is ~245 d.
        GgmlType::Q4K => buf.chunks_exact_mut(144).for_each(|b| {
            put(b, 0, sd / 245.0);
            put(b, 2, 7.5 * sd / 245.0);
        }),
        // Q4_K's codes with twice the range.
        GgmlType::Q5K => buf.chunks_exact_mut(176).for_each(|b| {
            put(b, 0, sd / 490.0);
            put(b, 2, 15.5 * sd / 490.0);
        }),
        // w = d sc (q - 32), sc a signed byte: spread ~73.9 x 18.5.
        GgmlType::Q6K => buf.chunks_exact_mut(210).for_each(|b| put(b, 208, sd / 1367.0)),
        other => unreachable!("synth never picks {other:?}"),
    }
}

/// One line for the user: what the file is.
pub fn describe(shape: &Shape, ty: WType, w: &Written) -> String {
    let hd = shape.dim / shape.heads;
    let kv_bytes = 2 * shape.layers * shape.kv_heads * hd * 2;
    format!(
        "{} {}: {} layers, dim {}, {} heads ({} KV, head {hd}), ffn {}, vocab {}; {:.2} G weights, {:.2} GiB file; \
         f16 KV {} KiB per token",
        shape.arch.name(),
        format!("{ty:?}").to_lowercase(),
        shape.layers,
        shape.dim,
        shape.heads,
        shape.kv_heads,
        shape.ffn,
        w.vocab,
        w.params as f64 / 1e9,
        w.bytes as f64 / f64::from(1u32 << 30),
        kv_bytes / 1024,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_factors_match_the_converter_at_the_bounds() {
        // Highest frequency pair: wavelength 2 pi < 2048 -> kept (1); lowest: divided by 8.
        assert_eq!(llama3_factor(500_000.0, 0, 128), 1.0);
        assert_eq!(llama3_factor(500_000.0, 63, 128), 8.0);
        let mid: Vec<f32> = (0..64).map(|i| llama3_factor(500_000.0, i, 128)).collect();
        assert!(mid.windows(2).all(|w| w[0] <= w[1]), "factors grow with the wavelength: {mid:?}");
    }

    #[test]
    fn bad_shapes_are_refused() {
        let ok = preset("smollm2-135m").unwrap();
        ok.check().unwrap();
        for bad in [
            Shape { heads: 7, ..ok.clone() },
            Shape { kv_heads: 2, ..ok.clone() },
            Shape { dim: 0, ..ok.clone() },
            Shape { ffn: 1000, ..ok.clone() },
            Shape { rope_base: f32::NAN, ..ok.clone() },
            Shape { arch: Arch::Qwen2, llama3_rope: true, ..ok.clone() },
            Shape { dim: 1 << 20, heads: 1 << 12, kv_heads: 1 << 12, ..ok.clone() },
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
        assert!(preset("gpt-5").is_err());
    }

    #[test]
    fn q4_k_m_recipe_and_fallbacks() {
        let s = Shape { dim: 512, layers: 8, heads: 8, kv_heads: 2, ffn: 800, ..preset("smollm2-135m").unwrap() };
        let t = tensor_list(&s, WType::Q4KM, 1000);
        let ty = |n: &str| t.iter().find(|x| x.spec.name == n).unwrap().spec.ty;
        assert_eq!(ty("token_embd.weight"), GgmlType::Q6K, "tied: the embedding is the output");
        assert_eq!(ty("blk.0.attn_v.weight"), GgmlType::Q6K);
        assert_eq!(ty("blk.1.attn_v.weight"), GgmlType::Q4K);
        assert_eq!(ty("blk.3.attn_v.weight"), GgmlType::Q6K, "every third after the first eighth");
        assert_eq!(ty("blk.7.ffn_down.weight"), GgmlType::Q8_0, "Q6_K over 800-wide rows falls back");
        assert_eq!(ty("blk.2.ffn_down.weight"), GgmlType::Q5_0, "Q4_K over 800-wide rows falls back");
        assert_eq!(ty("blk.2.ffn_up.weight"), GgmlType::Q4K);
    }
}
