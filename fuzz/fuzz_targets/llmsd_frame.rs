//! llmsd's frame reader and request decoder on arbitrary bytes (what a hostile client sends):
//! Ok or Err, never a panic or an allocation past the frame limit. Run:
//! `cargo +nightly fuzz run llmsd_frame` in fuzz/.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut r = data;
    while let Ok(body) = llms_client::proto::read_frame(&mut r) {
        assert!(body.len() <= llms_client::proto::MAX_FRAME);
        if let Ok(req) = llms_client::proto::decode_request(&body) {
            // Whatever decodes re-encodes to the same request.
            let again = llms_client::proto::decode_request(&llms_client::proto::encode(&req)).expect("re-decodes");
            assert_eq!(again, req);
        }
    }
});
