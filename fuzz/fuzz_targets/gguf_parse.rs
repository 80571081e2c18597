//! The GGUF reader on arbitrary bytes: it must return Ok or Err, never panic, hang or
//! allocate without bound. Run: `cargo +nightly fuzz run gguf_parse` in fuzz/.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = engine::gguf::parse(data) {
        // Whatever parsed must describe tensors that lie inside the buffer.
        for t in &h.tensors {
            assert!(h.data_offset + t.offset + t.size <= data.len() as u64);
        }
    }
});
