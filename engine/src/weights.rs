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

use crate::model::{ModelError, Parsed, Result, W};
use crate::repack::PackedWeight;

/// Memory holding a weight image laid out by [`WeightLayout::for_file`].
pub trait WeightMemory: Send + Sync + std::fmt::Debug {
    /// The whole image. It may be paged: reading any byte must return the image's byte.
    fn bytes(&self) -> &[u8];
    /// The forward pass is about to read group `group` (a layer, or `n_layers + i` for part
    /// `i` of the output head): a provider that pages may start loading it, and read ahead.
    /// Returns false if reading the group now would wait for it: the engine then lets its
    /// worker threads sleep and calls [`WeightMemory::wait`].
    fn advise(&self, _group: usize) -> bool {
        true
    }
    /// Blocks until `group` (announced by `advise`) is ready to read.
    fn wait(&self, _group: usize) {}
}

/// One matrix in the image.
#[derive(Debug, Clone)]
pub struct Piece {
    pub name: String,
    /// Offset in the image.
    pub offset: usize,
    pub len: usize,
    /// Stored repacked (else as the GGUF bytes).
    pub packed: bool,
    pub(crate) src: W,
}

/// What a group holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupKind {
    Layer(usize),
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
    pub groups: Vec<Group>,
    /// In load order: each layer's q, k, v, o, gate, up, down; the head; the embedding table.
    pub pieces: Vec<Piece>,
    /// Image length (the end of the last group, rounded up to `align`).
    pub total: usize,
}

/// Pieces inside a group start on cache-line boundaries.
const PIECE_ALIGN: usize = 64;

impl WeightLayout {
    pub(crate) fn of(p: &Parsed, align: usize) -> Self {
        let align = align.max(PIECE_ALIGN);
        let mut pieces = Vec::new();
        let mut groups = Vec::new();
        let mut at = 0usize;
        let mut group = |kind: GroupKind, mats: &[(String, W, bool)], at: &mut usize, pieces: &mut Vec<Piece>| {
            let start = *at;
            for (name, w, pack) in mats {
                let packed_len = if *pack { PackedWeight::packed_len(w.ty, w.rows, w.cols) } else { None };
                let len = packed_len.unwrap_or(w.len);
                pieces.push(Piece { name: name.clone(), offset: *at, len, packed: packed_len.is_some(), src: *w });
                *at = (*at + len).next_multiple_of(PIECE_ALIGN);
            }
            groups.push(Group { kind, offset: start, len: *at - start });
            *at = at.next_multiple_of(align);
        };
        for (i, l) in p.layers.iter().enumerate() {
            let mats: Vec<(String, W, bool)> =
                crate::model::MATRIX_NAMES.iter().zip(l.mats).map(|(n, w)| (format!("blk.{i}.{n}.weight"), w, true)).collect();
            group(GroupKind::Layer(i), &mats, &mut at, &mut pieces);
        }
        for (i, w) in head_parts(p.output).into_iter().enumerate() {
            group(GroupKind::Head(i), &[(format!("output.part{i}"), w, true)], &mut at, &mut pieces);
        }
        group(GroupKind::Embedding, &[("token_embd.weight".into(), p.tok_embd, false)], &mut at, &mut pieces);
        Self { align, groups, pieces, total: at }
    }

    /// The layout of the model in the GGUF file at `path`.
    pub fn for_file(path: &Path, align: usize) -> Result<Self> {
        Ok(Self::of(&Parsed::open(path)?, align))
    }
}

/// Rows per part of the output head in an image: about the bytes of one layer for the default
/// model (4096 rows of 576 Q8_0 columns, 2.5 MB), so the head streams in layer-sized groups.
const HEAD_PART_ROWS: usize = 4096;

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
pub fn build_image(path: &Path, align: usize, sink: &mut dyn FnMut(&Group, &[u8]) -> std::io::Result<()>) -> Result<WeightLayout> {
    let parsed = Parsed::open(path)?;
    let layout = WeightLayout::of(&parsed, align);
    let file = parsed.file.bytes();
    for g in &layout.groups {
        let mut buf = vec![0u8; g.len];
        for piece in layout.pieces.iter().filter(|p| p.offset >= g.offset && p.offset < g.offset + g.len) {
            let w = piece.src;
            let src = &file[w.offset..w.offset + w.len];
            let dst = &mut buf[piece.offset - g.offset..piece.offset - g.offset + piece.len];
            if piece.packed {
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
