//! Resident weights live in one arena on huge pages (engine::arena) and compute what the same
//! matrices read from a weight image compute: placement changes where the bytes are, never
//! which bytes.

use std::sync::Arc;

use engine::weights::{build_image, ImageFormat, WeightMemory};
use engine::{Logits, Model, Session, ThreadPool};
use llms_tests::model_path;

/// A weight image held in a plain heap buffer.
#[derive(Debug)]
struct HeapImage(Vec<u8>);

impl WeightMemory for HeapImage {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// Whether an arena of a few huge pages gets them in this process (THP on, not emulated: the
/// arena's own unit test checks that against another road to huge pages).
fn granted() -> bool {
    let mut b = engine::arena::ArenaBuilder::with_huge_pages(8 << 20, true).unwrap();
    b.space_mut().fill(1);
    b.finish().unwrap().huge_bytes().is_some_and(|h| h > 0)
}

fn logits(m: Model, toks: &[u32]) -> Vec<f32> {
    let mut s = Session::new(Arc::new(m), Arc::new(ThreadPool::new(2)), 64);
    let mut all = s.eval(&toks[..20], Logits::All).unwrap().to_vec();
    for &t in &toks[20..24] {
        all.extend_from_slice(s.eval(&[t], Logits::Last).unwrap());
    }
    all
}

#[test]
fn resident_weights_sit_in_the_arena_and_compute_the_images_bits() {
    let path = model_path();
    let resident = Model::load(&path).unwrap();
    let (bytes, share) = resident.huge_page_share().expect("a resident model's packed matrices are in its arena");
    // Every matrix, not only the output head (~30 MB of the default model's ~100 MB).
    assert!(bytes > 90 << 20, "the default model's packed matrices take {bytes} bytes");
    // Stored channel-major (sparse decoding), the layers' matrices go there too.
    let col = Model::load_as(&path, engine::WeightFormat::ChannelMajor).unwrap();
    assert!(col.is_channel_major());
    let (col_bytes, _) = col.huge_page_share().expect("a channel-major model's matrices are in its arena");
    assert!(col_bytes > 90 << 20, "the channel-major matrices take {col_bytes} bytes");
    drop(col);
    if granted() {
        // Huge pages can run short on a fragmented machine; most of an arena this size gets them.
        assert!(share > 0.5, "an arena gets huge pages here, but only {:.0}% of the model's", 100.0 * share);
    }
    let align = 1 << 16;
    let layout = engine::WeightLayout::for_file(&path, align, ImageFormat::Packed).unwrap();
    let mut img = vec![0u8; layout.total];
    build_image(&path, align, ImageFormat::Packed, &mut |g, b| {
        img[g.offset..g.offset + b.len()].copy_from_slice(b);
        Ok(())
    })
    .unwrap();
    let imaged = Model::load_with_image(&path, Arc::new(HeapImage(img)), align, ImageFormat::Packed).unwrap();
    assert!(imaged.huge_page_share().is_none(), "a model over an image has no arena");
    let toks: Vec<u32> = resident.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then it runs far away into the woods, where the old trees stand tall and quiet in the evening light.", true, false).unwrap();
    assert!(toks.len() >= 24, "{} tokens", toks.len());
    let (a, b) = (logits(resident, &toks), logits(imaged, &toks));
    assert_eq!(a.len(), b.len());
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "the arena's matrices give other logits than the image's");
}
