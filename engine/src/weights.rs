//! Weight images: the model's matrices laid out for reading in place from memory someone else
//! provides (for LLMS, a userfaultfd region paged from flash by `mm`).
//!
//! The image holds each matrix as the forward pass reads it — repacked 8-row groups where the
//! type has packed kernels, the GGUF bytes otherwise — so a model over an image computes
//! exactly what a model with heap-packed weights does. It is cut into **groups**, one per layer,
//! then the output head, then the token-embedding table, each starting on an `align` boundary:
//! the unit a pager preloads ahead of the forward pass. The engine only lays the image out and
//! reads it; where its bytes live and when they move is the provider's business.

use std::path::Path;

use crate::colmajor::{ColWeight, Placement};
use crate::loader::{ModelError, Parsed, Result, W};
use crate::quant::QK;
use crate::repack::PackedWeight;

/// Memory holding a weight image laid out by [`WeightLayout::for_file`].
pub trait WeightMemory: Send + Sync + std::fmt::Debug {
    /// The whole image. It may be paged: reading any byte must return the image's byte.
    fn bytes(&self) -> &[u8];
    /// The forward pass is about to read group `group` ([`packed_group`]: one site of a
    /// layer, or a part of the output head): a provider that pages may start loading it, and
    /// read ahead.
    /// Returns false if reading the group now would wait for it: the engine then lets its
    /// worker threads sleep and calls [`WeightMemory::wait`].
    fn advise(&self, _group: usize) -> bool {
        true
    }
    /// Blocks until `group` (announced by `advise`) is ready to read.
    fn wait(&self, _group: usize) {}
    /// (Channel-major images.) The forward pass is about to read these byte ranges of the
    /// image — the columns of the active input channels and their blocks' scales, sorted by
    /// offset — and nothing else of the layer: a provider that pages makes them resident
    /// before returning, calling `before_wait` first if it must wait for flash (the engine
    /// lets its worker threads sleep).
    fn need(&self, _ranges: &[(usize, usize)], _before_wait: &dyn Fn()) {}
    /// (Channel-major images.) The forward pass will probably read these ranges soon (the
    /// current active channels, in the layers ahead): a provider may start loading them.
    fn prefetch(&self, _ranges: &[(usize, usize)]) {}
}

/// How an image stores the layers' matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageFormat {
    /// Repacked 8-row blocks, one group per site of a layer ([`SITE_MATRICES`]: the matrices
    /// one multiplication reads together): a pass reads every byte. Groups this small keep
    /// a pager's streaming window small: it holds the group being read and the next one.
    Packed,
    /// Channel-major ([`crate::colmajor`]) in groups of `span` layers, ordered as ActiveFlow
    /// §3 lays weights out for cross-layer preloading: per projection input (attention in,
    /// attention out, feed-forward in, feed-forward hidden), first every block's scales, then
    /// one run per input channel holding that channel's column of each matrix reading the
    /// input, for every layer of the group. A token reading channel `c` at layer `l` finds the
    /// same channel of the group's later layers next to it: one read serves them all.
    ChannelMajor { span: usize },
}

/// The matrices of a layer that read one input, by index in load order (q, k, v, o, gate,
/// up, down): the four sites of [`crate::sparsity`].
pub const SITE_MATRICES: [&[usize]; 4] = [&[0, 1, 2], &[3], &[4, 5], &[6]];

/// The group of a packed image that site `site` of layer `layer` reads; part `i` of the output
/// head is `packed_group(n_layers, i)` (the groups are in reading order).
pub const fn packed_group(layer: usize, site: usize) -> usize {
    layer * SITE_MATRICES.len() + site
}

/// One matrix in the image.
#[derive(Debug, Clone)]
pub struct Piece {
    pub name: String,
    /// Offset in the image.
    pub offset: usize,
    pub len: usize,
    /// Stored repacked (else as the GGUF bytes, or channel-major when `col` is set).
    pub packed: bool,
    /// Channel-major, its parts placed so relative to `offset` (`offset..offset + len` is its
    /// layer group, shared with the group's other matrices).
    pub col: Option<Placement>,
    pub(crate) src: W,
}

/// What a group holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupKind {
    /// The matrices of one site ([`SITE_MATRICES`]) of a layer, packed.
    Site { layer: usize, site: usize },
    /// Layers `first..first + count`, stored channel-major.
    Layers { first: usize, count: usize },
    /// A part of the output projection (the embedding table again, repacked, when they are
    /// tied), cut by rows so it streams in pieces the size of a layer.
    Head(usize),
    /// The token-embedding table, read one row per token.
    Embedding,
}

/// A group: a byte range of the image starting on an `align` boundary.
#[derive(Debug, Clone, Copy)]
pub struct Group {
    pub kind: GroupKind,
    pub offset: usize,
    pub len: usize,
}

/// Where every matrix of a model lives in its weight image.
#[derive(Debug, Clone)]
pub struct WeightLayout {
    pub align: usize,
    pub format: ImageFormat,
    pub groups: Vec<Group>,
    /// In load order: each layer's q, k, v, o, gate, up, down; the head; the embedding table.
    pub pieces: Vec<Piece>,
    /// Image length (the end of the last group, rounded up to `align`).
    pub total: usize,
}

/// Pieces inside a group start on cache-line boundaries.
const PIECE_ALIGN: usize = 64;

impl WeightLayout {
    pub(crate) fn of(p: &Parsed, align: usize, format: ImageFormat) -> Self {
        let align = align.max(PIECE_ALIGN);
        let mut pieces = Vec::new();
        let mut groups = Vec::new();
        let mut at = 0usize;
        let packed = |name: String, w: W, pack: bool, at: &mut usize| {
            let packed_len = if pack { PackedWeight::packed_len(w.ty, w.rows, w.cols) } else { None };
            let len = packed_len.unwrap_or(w.len);
            let piece = Piece { name, offset: *at, len, packed: packed_len.is_some(), col: None, src: w };
            *at = (*at + len).next_multiple_of(PIECE_ALIGN);
            piece
        };
        let group = |kind: GroupKind, mats: &[(String, W, bool)], at: &mut usize, pieces: &mut Vec<Piece>, groups: &mut Vec<Group>| {
            let start = *at;
            for (name, w, pack) in mats {
                pieces.push(packed(name.clone(), *w, *pack, at));
            }
            groups.push(Group { kind, offset: start, len: *at - start });
            *at = at.next_multiple_of(align);
        };
        let name = |i: usize, m: usize| format!("blk.{i}.{}.weight", crate::loader::MATRIX_NAMES[m]);
        match format {
            ImageFormat::Packed => {
                for (i, l) in p.layers.iter().enumerate() {
                    for (site, ms) in SITE_MATRICES.iter().enumerate() {
                        let mats: Vec<(String, W, bool)> = ms.iter().map(|&m| (name(i, m), l.mats[m], true)).collect();
                        group(GroupKind::Site { layer: i, site }, &mats, &mut at, &mut pieces, &mut groups);
                    }
                }
            }
            ImageFormat::ChannelMajor { span } => {
                let span = span.max(1);
                for first in (0..p.layers.len()).step_by(span) {
                    let layers = &p.layers[first..(first + span).min(p.layers.len())];
                    let start = at;
                    // Per layer, its seven pieces in load order.
                    let mut placed: Vec<[Option<Piece>; 7]> = layers.iter().map(|_| Default::default()).collect();
                    for site in SITE_MATRICES {
                        let col_ok = layers
                            .iter()
                            .all(|l| site.iter().all(|&m| ColWeight::len_for(l.mats[m].ty, l.mats[m].rows, l.mats[m].cols).is_some()));
                        if !col_ok {
                            for (k, l) in layers.iter().enumerate() {
                                for &m in site {
                                    placed[k][m] = Some(packed(name(first + k, m), l.mats[m], true, &mut at));
                                }
                            }
                            continue;
                        }
                        let cols = layers[0].mats[site[0]].cols;
                        let mut ats = Vec::new();
                        for l in layers {
                            for &m in site {
                                let rp = ColWeight::rows_padded(l.mats[m].rows);
                                ats.push((rp, at - start));
                                at += 4 * rp * (cols / QK);
                            }
                        }
                        at = at.next_multiple_of(PIECE_ALIGN);
                        let run: usize = ats.iter().map(|(rp, _)| rp / 2).sum();
                        let (codes, mut prefix) = (at - start, 0);
                        let mut it = ats.into_iter();
                        for (k, l) in layers.iter().enumerate() {
                            for &m in site {
                                let (rp, scales) = it.next().expect("one placement per matrix");
                                let col = Placement {
                                    scales,
                                    scale_stride: 4 * rp,
                                    codes: codes + prefix,
                                    block_stride: QK * run,
                                    col_stride: run,
                                };
                                prefix += rp / 2;
                                placed[k][m] = Some(Piece {
                                    name: name(first + k, m),
                                    offset: start,
                                    len: 0,
                                    packed: false,
                                    col: Some(col),
                                    src: l.mats[m],
                                });
                            }
                        }
                        at = (at + cols * run).next_multiple_of(PIECE_ALIGN);
                    }
                    groups.push(Group { kind: GroupKind::Layers { first, count: layers.len() }, offset: start, len: at - start });
                    for mut piece in placed.into_iter().flatten().flatten() {
                        if piece.col.is_some() {
                            piece.len = at - start;
                        }
                        pieces.push(piece);
                    }
                    at = at.next_multiple_of(align);
                }
            }
        }
        for (i, w) in head_parts(p.output).into_iter().enumerate() {
            group(GroupKind::Head(i), &[(format!("output.part{i}"), w, true)], &mut at, &mut pieces, &mut groups);
        }
        group(GroupKind::Embedding, &[("token_embd.weight".into(), p.tok_embd, false)], &mut at, &mut pieces, &mut groups);
        Self { align, format, groups, pieces, total: at }
    }

    /// The layout of the model in the GGUF file at `path`.
    pub fn for_file(path: &Path, align: usize, format: ImageFormat) -> Result<Self> {
        Ok(Self::of(&Parsed::open(path)?, align, format))
    }
}

/// Rows per part of the output head in an image: about the bytes of a layer's site (the
/// default model: 1024 rows of 576 Q8_0 columns, 0.6 MB; a 7B shape's: 3.4 MB at Q6_K), so the
/// head streams in groups no larger than the layers' and a pager's window stays small.
const HEAD_PART_ROWS: usize = 1024;

/// The output matrix cut by rows into parts of [`HEAD_PART_ROWS`] (a multiple of the packed
/// group height), each a matrix of its own in the file.
pub(crate) fn head_parts(w: W) -> Vec<W> {
    let rb = w.ty.row_bytes(w.cols);
    (0..w.rows)
        .step_by(HEAD_PART_ROWS)
        .map(|r0| {
            let rows = HEAD_PART_ROWS.min(w.rows - r0);
            W { rows, offset: w.offset + r0 * rb, len: rows * rb, ..w }
        })
        .collect()
}

/// Produces the weight image of the GGUF file at `path` group by group: `sink(group, bytes)`
/// gets each group's bytes (its pieces at their offsets relative to the group start, zero
/// padding between them), in image order. One group is in memory at a time.
pub fn build_image(
    path: &Path,
    align: usize,
    format: ImageFormat,
    sink: &mut dyn FnMut(&Group, &[u8]) -> std::io::Result<()>,
) -> Result<WeightLayout> {
    let parsed = Parsed::open(path)?;
    let layout = WeightLayout::of(&parsed, align, format);
    let file = parsed.file.bytes();
    for g in &layout.groups {
        let mut buf = vec![0u8; g.len];
        for piece in layout.pieces.iter().filter(|p| p.offset >= g.offset && p.offset < g.offset + g.len) {
            let w = piece.src;
            let src = &file[w.offset..w.offset + w.len];
            let dst = &mut buf[piece.offset - g.offset..piece.offset - g.offset + piece.len];
            if let Some(at) = piece.col {
                let bad = || ModelError::Tensor { name: piece.name.clone(), what: "cannot be stored channel-major".into() };
                let col = ColWeight::from_gguf(w.ty, w.rows, w.cols, src).ok_or_else(bad)?;
                col.place_into(dst, at).ok_or_else(bad)?;
            } else if piece.packed {
                let packed = PackedWeight::pack(w.ty, w.rows, w.cols, src).expect("packable: checked by the layout");
                dst.copy_from_slice(packed.as_bytes());
            } else {
                dst.copy_from_slice(src);
            }
            parsed.file.release_pages(w.offset, w.len);
        }
        sink(g, &buf).map_err(|e| ModelError::Tensor { name: "weight image".into(), what: e.to_string() })?;
    }
    Ok(layout)
}
