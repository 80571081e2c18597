//! llmsd's HTTP front (the OpenAI API) on arbitrary bytes from a local client: request line,
//! headers and body as hyper and the front see them, over the real socket of a real service.
//! Every answer is an HTTP response and never a 500 (a handler panicked); the service goes on.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let svc = llms_fuzz::service();
    let sock = svc.svc.config().http_socket_path().expect("the HTTP front's socket");
    let answer = llms_fuzz::exchange(&sock, data);
    assert!(!answer.starts_with(b"HTTP/1.1 500"), "the front answered 500: {}", String::from_utf8_lossy(&answer));
});
