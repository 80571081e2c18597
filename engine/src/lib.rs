//! Llama-family CPU inference over GGUF models.
//!
//! What it is for: reading GGUF files (hostile input is an error, never a panic), byte-level
//! BPE tokenization that matches llama.cpp, and a fast forward pass (quantized AVX2 kernels, a
//! batched prefill GEMM, a spinning thread pool) whose results track llama.cpp's.
//!
//! What it is not for: the engine knows nothing about paging, swapping or memory pressure. It
//! reads its KV cache and weights as plain memory; where that memory lives is `mm`'s business.
//!
//! Where this crate sits among the others, and its modules' layers: docs/ARCHITECTURE.md.

pub mod arena;
pub mod attention;
pub mod chat;
pub mod colmajor;
pub mod eval;
pub mod gguf;
pub mod kernels;
pub mod kv;
pub mod kvcache;
pub mod loader;
pub mod model;
pub mod pool;
mod pretok;
pub mod quant;
pub mod repack;
pub mod sampler;
pub mod simd;
pub mod sparsity;
pub mod tokenizer;
pub mod weights;

pub use gguf::{GgufError, GgufFile, GgufHeader, TensorInfo, Value};
pub use model::{Config, Logits, Model, ModelError, Session, WeightFormat};
pub use pool::ThreadPool;
pub use quant::GgmlType;
pub use sampler::{Sampler, SamplerConfig};
pub use tokenizer::{Tokenizer, Utf8Stream};
pub use weights::{WeightLayout, WeightMemory};
