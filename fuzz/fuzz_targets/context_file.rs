//! A context file as a start reads it (a file in the state directory may be edited or
//! damaged): decoded or refused, never a panic; what decodes survives a rewrite unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = llmsd::service::check_context_file(data);
});
