//! llmsd's native protocol on arbitrary bytes from a local client, over the real socket of a
//! real service: frames, requests and calls as a hostile app would send them. A connection's
//! panic aborts the fuzzer (the service would have caught it); the service must go on.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let svc = llms_fuzz::service();
    let answer = llms_fuzz::exchange(&svc.socket, data);
    // Whatever came back is frames the client library reads.
    let mut r = answer.as_slice();
    while let Ok(body) = llms_client::proto::read_frame(&mut r) {
        llms_client::proto::decode_event(&body).expect("the service sends events the client decodes");
    }
});
