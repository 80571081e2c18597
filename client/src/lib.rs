//! The llmsd client: the native protocol ([`proto`]: framed JSON on a Unix socket), a Rust
//! client ([`Client`]), and the C library apps link ([`ffi`], declared in `include/llms.h`).
//! One implementation serves all three: `llms`, `llmsd`'s tests and C/JNI callers speak
//! through the same code.
//!
//! What it is not for: it knows nothing of models, memory or the service's insides; it only
//! speaks the protocol (docs/llmsd.md, "Protocol"). Where this crate sits among the others:
//! docs/ARCHITECTURE.md.

pub mod client;
pub mod ffi;
pub mod proto;

pub use client::{default_socket, Client, ClientError, ServiceError};

/// An error and its causes on one line, each said once: a message that already quotes its cause
/// (`cannot open x: No such file or directory` over that same `io::Error`) is not followed by
/// the cause again, as printing the whole chain would.
pub fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = String::new();
    let mut next = Some(e);
    while let Some(cause) = next {
        let t = cause.to_string();
        if !t.is_empty() && !out.contains(&t) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&t);
        }
        next = cause.source();
    }
    out
}
