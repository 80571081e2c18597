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
