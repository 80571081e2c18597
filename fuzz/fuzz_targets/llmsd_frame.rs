//! llmsd's frame reader and request decoder on arbitrary bytes (what a hostile client sends):
//! Ok or Err, never a panic or an allocation past the frame limit. Run:
//! `cargo +nightly fuzz run llmsd_frame` in fuzz/.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut r = data;
    while let Ok(body) = tools::proto::read_frame(&mut r) {
        assert!(body.len() <= tools::proto::MAX_FRAME);
        if let Ok(req) = tools::proto::decode_request(&body) {
            // Whatever decodes re-encodes to the same request.
            let again = tools::proto::decode_request(&tools::proto::encode(&req)).expect("re-decodes");
            assert_eq!(again, req);
        }
    }
});
