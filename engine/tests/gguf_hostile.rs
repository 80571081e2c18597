//! Malformed GGUF files get clear errors naming what and where, never a panic or a huge
//! allocation.
#![allow(clippy::cast_possible_truncation)]

use engine::gguf::{parse, GgufError, Value};
use engine::GgmlType;
use proptest::prelude::*;

/// A tiny GGUF writer for building valid and broken files.
struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    fn new(version: u32, n_tensors: u64, n_kv: u64) -> Self {
        let mut buf = b"GGUF".to_vec();
        buf.extend_from_slice(&version.to_le_bytes());
        buf.extend_from_slice(&n_tensors.to_le_bytes());
        buf.extend_from_slice(&n_kv.to_le_bytes());
        Self { buf }
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
        self.buf.extend_from_slice(s.as_bytes());
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn kv_u32(&mut self, k: &str, v: u32) -> &mut Self {
        self.str(k).u32(4).u32(v)
    }
    fn kv_str(&mut self, k: &str, v: &str) -> &mut Self {
        self.str(k).u32(8).str(v)
    }
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    /// Pads to the default alignment and appends `n` data bytes.
    fn data(&mut self, n: usize) -> Vec<u8> {
        let mut b = self.buf.clone();
        while !b.len().is_multiple_of(32) {
            b.push(0);
        }
        b.extend((0..n).map(|i| i as u8));
        b
    }
}

/// A valid file: 3 metadata entries (one an array), two tensors (F32 [8], Q8_0 [32, 2]).
fn valid() -> Vec<u8> {
    let mut w = Writer::new(3, 2, 3);
    w.kv_str("general.architecture", "llama").kv_u32("llama.block_count", 1);
    w.str("tokenizer.ggml.tokens").u32(9).u32(8).u64(2).str("a").str("b");
    w.tensor("norm", &[8], 0, 0).tensor("w", &[32, 2], 8, 32);
    w.data(32 + 68)
}

#[test]
fn a_valid_file_parses_completely() {
    let h = parse(&valid()).unwrap();
    assert_eq!(h.version, 3);
    assert_eq!(h.metadata["general.architecture"], Value::String("llama".into()));
    assert_eq!(h.metadata["tokenizer.ggml.tokens"].as_array().unwrap().len(), 2);
    assert_eq!(h.tensors.len(), 2);
    assert_eq!(h.tensors[1].ty, GgmlType::Q8_0);
    assert_eq!(h.tensors[1].size, 68);
    assert_eq!(h.data_offset % 32, 0);
}

fn err(buf: &[u8]) -> String {
    match parse(buf) {
        Ok(_) => panic!("malformed file parsed"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_magic_and_version() {
    let mut b = valid();
    b[0] = b'X';
    assert!(matches!(parse(&b), Err(GgufError::BadMagic { .. })));
    let mut b = valid();
    b[4] = 1;
    assert!(err(&b).contains("unsupported GGUF version 1"));
    let mut b = valid();
    b[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert!(err(&b).contains("big-endian"));
}

#[test]
fn every_truncation_is_an_error_naming_the_offset() {
    let full = valid();
    let header_end = parse(&full).unwrap().data_offset as usize;
    for len in 0..header_end {
        let e = err(&full[..len]);
        assert!(e.contains("offset") || e.contains("runs past"), "truncated at {len}: {e}");
    }
    // Truncating the data section is caught by the tensor bounds check.
    assert!(err(&full[..full.len() - 1]).contains("runs past the end"));
}

#[test]
fn absurd_counts_and_lengths_are_refused_before_allocating() {
    let mut w = Writer::new(3, 0, u64::MAX);
    assert!(err(&w.data(0)).contains("metadata_kv_count"));
    let mut w = Writer::new(3, u64::MAX / 2, 0);
    assert!(err(&w.data(0)).contains("tensor_count"));
    let mut w = Writer::new(3, 0, 1);
    w.u64(u64::MAX);
    assert!(err(&w.data(64)).contains("string length"));
    let mut w = Writer::new(3, 0, 1);
    w.str("k").u32(9).u32(4).u64(1 << 60);
    assert!(err(&w.data(0)).contains("cannot fit"));
    let mut w = Writer::new(3, 0, 1);
    w.str("k").u32(9).u32(9).u64(1);
    w.u32(9).u64(1).u32(9).u64(1).u32(4).u64(0);
    assert!(err(&w.data(0)).contains("nested too deeply"));
}

#[test]
fn unknown_types_and_bad_values() {
    let mut w = Writer::new(3, 0, 1);
    w.str("k").u32(99).u32(0);
    assert!(err(&w.data(0)).contains("unknown value type 99"));
    let mut w = Writer::new(3, 0, 1);
    w.str("k").u32(7);
    w.buf.push(2);
    assert!(err(&w.data(0)).contains("bool byte 2"));
    let mut w = Writer::new(3, 0, 1);
    w.str("k").u32(8).u64(2);
    w.buf.extend_from_slice(&[0xff, 0xfe]);
    assert!(err(&w.data(0)).contains("not UTF-8"));
    let mut w = Writer::new(3, 1, 0);
    w.tensor("t", &[32], 77, 0);
    assert!(err(&w.data(64)).contains("unsupported tensor type 77"));
    let mut w = Writer::new(3, 0, 2);
    w.kv_u32("a", 1).kv_u32("a", 2);
    assert!(err(&w.data(0)).contains("appears twice"));
    let mut w = Writer::new(3, 0, 1);
    w.kv_u32("general.alignment", 24);
    assert!(err(&w.data(0)).contains("power of two"));
}

#[test]
fn bad_tensor_geometry() {
    let cases: Vec<(Writer, &str)> = vec![
        (
            {
                let mut w = Writer::new(3, 1, 0);
                w.tensor("t", &[0, 4], 0, 0);
                w
            },
            "zero dimension",
        ),
        (
            {
                let mut w = Writer::new(3, 1, 0);
                w.tensor("t", &[1, 1, 1, 1, 1], 0, 0);
                w
            },
            "dimensions",
        ),
        (
            {
                let mut w = Writer::new(3, 1, 0);
                w.tensor("t", &[u64::MAX, 2], 0, 0);
                w
            },
            "absurd",
        ),
        (
            {
                let mut w = Writer::new(3, 1, 0);
                w.tensor("t", &[33], 8, 0);
                w
            },
            "block size",
        ),
        (
            {
                let mut w = Writer::new(3, 1, 0);
                w.tensor("t", &[8], 0, 7);
                w
            },
            "alignment",
        ),
        (
            {
                let mut w = Writer::new(3, 1, 0);
                w.tensor("t", &[8], 0, u64::MAX - 31);
                w
            },
            "runs past",
        ),
        (
            {
                let mut w = Writer::new(3, 1, 0);
                w.tensor("t", &[64], 0, 0);
                w
            },
            "runs past",
        ),
        (
            {
                let mut w = Writer::new(3, 2, 0);
                w.tensor("a", &[16], 0, 0).tensor("b", &[8], 0, 32);
                w
            },
            "overlaps",
        ),
        (
            {
                let mut w = Writer::new(3, 2, 0);
                w.tensor("a", &[8], 0, 0).tensor("a", &[8], 0, 32);
                w
            },
            "appears twice",
        ),
    ];
    for (mut w, want) in cases {
        let e = err(&w.data(64));
        assert!(e.contains(want), "expected {want:?} in {e:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    /// Random corruption of a valid file never panics.
    #[test]
    fn corrupted_files_never_panic(flips in proptest::collection::vec((0usize..400, any::<u8>()), 1..8), cut in 0usize..400) {
        let mut b = valid();
        for (at, v) in flips {
            let n = b.len();
            b[at % n] = v;
        }
        let n = b.len();
        b.truncate(n - cut % n);
        let _ = parse(&b);
    }
}
