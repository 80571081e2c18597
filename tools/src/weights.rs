//! Paged weights, wired: the engine's weight image (engine::weights) built next to the model
//! once, served by mm's weight pager (mm::weights) under a budget, and handed to the engine as
//! plain memory.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use engine::weights::{build_image, GroupKind, WeightLayout, WeightMemory};
use engine::Model;
use mm::weights::{Fingerprint, ImageWriter, WeightError, WeightOptions, WeightPager, WeightStats};

/// Slot (and group alignment) of weight images: 64 KiB reads are large enough for flash to
/// stream and small enough that a touched embedding row costs little.
pub const SLOT: usize = 64 << 10;

/// A weight budget: bytes, or a share of the model's streamed weight bytes (layers + head).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Budget {
    Bytes(usize),
    Percent(f64),
}

impl std::str::FromStr for Budget {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        if let Some(p) = s.trim().strip_suffix('%') {
            let v: f64 = p.trim().parse().with_context(|| format!("{s:?} is not a percentage"))?;
            if !(v > 0.0 && v <= 100.0) {
                bail!("{s:?}: a weight budget percentage is in (0, 100]");
            }
            return Ok(Self::Percent(v));
        }
        Ok(Self::Bytes(crate::config::parse_bytes(s)?))
    }
}

/// How to page weights.
#[derive(Debug, Clone)]
pub struct PagedOptions {
    pub budget: Budget,
    /// Image path (default: next to the model, `<model>.llms-weights`).
    pub image: Option<PathBuf>,
    pub preload: bool,
}

/// The engine's view of a paged weight image.
#[derive(Debug)]
pub struct PagedWeights {
    pub pager: WeightPager,
    /// Bytes of the groups read every pass (layers and head): what "100%" means.
    pub weight_bytes: usize,
    pub image: PathBuf,
}

impl WeightMemory for PagedWeights {
    fn bytes(&self) -> &[u8] {
        self.pager.bytes()
    }
    fn advise(&self, group: usize) {
        self.pager.advise(group);
    }
}

impl PagedWeights {
    pub fn stats(&self) -> WeightStats {
        self.pager.stats()
    }
}

pub fn default_image_path(model: &Path) -> PathBuf {
    let mut s = model.as_os_str().to_owned();
    s.push(".llms-weights");
    PathBuf::from(s)
}

/// Writes the weight image of `model` (fingerprint `fp`) to `image`.
pub fn build(model: &Path, image: &Path, fp: Fingerprint) -> Result<WeightLayout> {
    let mut w = ImageWriter::create(image, SLOT, fp)?;
    let layout = build_image(model, SLOT, &mut |g, bytes| w.group(g.offset, bytes).map_err(std::io::Error::other))
        .with_context(|| format!("building the weight image {}", image.display()))?;
    w.finish()?;
    Ok(layout)
}

/// Loads `model` with its weights paged from its image under `opts.budget`, building the image
/// first when it is missing, stale (the model file changed) or damaged.
pub fn load_paged(model: &Path, opts: &PagedOptions) -> Result<(Arc<Model>, Arc<PagedWeights>)> {
    let fp = Fingerprint::of(model)?;
    let layout = WeightLayout::for_file(model, SLOT).with_context(|| format!("loading {}", model.display()))?;
    let cycle: Vec<usize> = layout.groups.iter().enumerate().filter(|(_, g)| g.kind != GroupKind::Embedding).map(|(i, _)| i).collect();
    let weight_bytes: usize = cycle.iter().map(|&i| layout.groups[i].len.next_multiple_of(SLOT)).sum();
    let budget = match opts.budget {
        Budget::Bytes(b) => b,
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
        Budget::Percent(p) => (weight_bytes as f64 * p / 100.0) as usize,
    };
    let image = opts.image.clone().unwrap_or_else(|| default_image_path(model));
    let wopts = WeightOptions { budget, cycle, preload: opts.preload };
    let same_layout = |p: &WeightPager| {
        let g = &p.info().groups;
        g.len() == layout.groups.len() && g.iter().zip(&layout.groups).all(|(a, b)| a.offset == b.offset as u64 && a.len == b.len as u64)
    };
    let pager = match WeightPager::open(&image, fp, wopts.clone()) {
        Ok(p) if same_layout(&p) => p,
        Ok(_) | Err(WeightError::Stale { .. } | WeightError::Format { .. } | WeightError::Io { .. }) => {
            tracing::info!(image = %image.display(), "building the weight image (missing, stale or damaged)");
            build(model, &image, fp)?;
            let p = WeightPager::open(&image, fp, wopts)?;
            if !same_layout(&p) {
                bail!("weight image {}: layout differs from the model's right after building it", image.display());
            }
            p
        }
        Err(e) => return Err(e.into()),
    };
    let paged = Arc::new(PagedWeights { pager, weight_bytes, image });
    let model = Model::load_with_image(model, Arc::clone(&paged) as Arc<dyn WeightMemory>, SLOT)
        .with_context(|| format!("loading {}", model.display()))?;
    Ok((Arc::new(model), paged))
}
