//! Helpers for the end-to-end tests: where the model, the fixtures and the binaries are.
