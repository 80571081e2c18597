//! GGUF reader (versions 2 and 3, little-endian).
//!
//! The file is hostile: every count and length is checked against the bytes that remain before
//! anything is allocated, every tensor is checked to lie inside the data section without
//! overlapping another, and every error names the byte offset and the field it was reading.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::quant::GgmlType;

const GGUF_MAGIC: &[u8; 4] = b"GGUF";
/// Longest string we accept (keys, metadata values, tensor names). The longest real ones are
/// chat templates of a few KiB.
const MAX_STRING_LEN: u64 = 1 << 24;
/// Nesting of arrays of arrays; real files use one level.
const MAX_ARRAY_DEPTH: u32 = 3;
const MAX_DIMS: u32 = 4;
const DEFAULT_ALIGNMENT: u64 = 32;

/// Errors from reading a GGUF file. Each names where in the file it happened.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot open {path}: {source}")]
    Open { path: PathBuf, source: std::io::Error },
    #[error("cannot map {path}: {source}")]
    Map { path: PathBuf, source: std::io::Error },
    #[error("not a GGUF file: bad magic {found:02x?} at offset 0")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported GGUF version {version} at offset 4 (supported: 2, 3; big-endian files are not supported)")]
    Version { version: u32 },
    #[error("truncated file: need {need} bytes for {field} at offset {offset}, file has {len}")]
    Truncated { field: String, offset: u64, need: u64, len: u64 },
    #[error("{field} at offset {offset}: {what}")]
    Invalid { field: String, offset: u64, what: String },
    #[error("metadata key {key:?}: {what}")]
    Metadata { key: String, what: String },
    #[error("tensor {name:?}: {what}")]
    Tensor { name: String, what: String },
}

type Result<T> = std::result::Result<T, GgufError>;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }
    #[allow(clippy::cast_possible_truncation)] // f64 metadata narrowed to the f32 the model uses
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            Value::F64(v) => Some(v as f32),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Where a tensor lies and what it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// `dims[0]` is the innermost (row) dimension, as in ggml.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset from the start of the data section.
    pub offset: u64,
    /// Size in bytes.
    pub size: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
    /// Row length (`dims[0]`) and number of rows (product of the rest).
    pub fn rows_cols(&self) -> (u64, u64) {
        let cols = self.dims.first().copied().unwrap_or(1);
        (self.dims.iter().skip(1).product(), cols)
    }
}

/// The parsed header of a GGUF file: metadata, tensor infos, and where the data starts.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Offset of the data section from the start of the file.
    pub data_offset: u64,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn offset(&self) -> u64 {
        self.pos as u64
    }
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }
    fn take(&mut self, n: u64, field: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(GgufError::Truncated { field: field.to_string(), offset: self.offset(), need: n, len: self.buf.len() as u64 });
        }
        // n <= remaining, which fits in usize.
        let n = usize::try_from(n).expect("bounded by buffer length");
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn array<const N: usize>(&mut self, field: &str) -> Result<[u8; N]> {
        let s = self.take(N as u64, field)?;
        Ok(s.try_into().expect("take returned N bytes"))
    }
    fn u8(&mut self, f: &str) -> Result<u8> {
        Ok(self.array::<1>(f)?[0])
    }
    fn u16(&mut self, f: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(f)?))
    }
    fn u32(&mut self, f: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(f)?))
    }
    fn u64(&mut self, f: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(f)?))
    }
    fn string(&mut self, field: &str) -> Result<String> {
        let at = self.offset();
        let len = self.u64(field)?;
        if len > MAX_STRING_LEN {
            return Err(GgufError::Invalid {
                field: field.to_string(),
                offset: at,
                what: format!("string length {len} exceeds the limit of {MAX_STRING_LEN}"),
            });
        }
        let bytes = self.take(len, field)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| GgufError::Invalid {
            field: field.to_string(),
            offset: at + 8,
            what: format!("string is not UTF-8: {e}"),
        })
    }
    fn invalid(&self, field: &str, at: u64, what: impl Into<String>) -> GgufError {
        GgufError::Invalid { field: field.to_string(), offset: at, what: what.into() }
    }

    /// Smallest encoded size of a value of `ty`, used to bound array counts before allocating.
    fn min_size(ty: u32) -> u64 {
        match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            8 | 10..=12 => 8,
            9 => 12,
            _ => 1,
        }
    }

    fn value(&mut self, ty: u32, field: &str, depth: u32) -> Result<Value> {
        let at = self.offset();
        Ok(match ty {
            0 => Value::U8(self.u8(field)?),
            1 => Value::I8(i8::from_le_bytes(self.array(field)?)),
            2 => Value::U16(self.u16(field)?),
            3 => Value::I16(i16::from_le_bytes(self.array(field)?)),
            4 => Value::U32(self.u32(field)?),
            5 => Value::I32(i32::from_le_bytes(self.array(field)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(field)?)),
            7 => match self.u8(field)? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.invalid(field, at, format!("bool byte {b} is neither 0 nor 1"))),
            },
            8 => Value::String(self.string(field)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.invalid(field, at, "arrays nested too deeply"));
                }
                let ety = self.u32(field)?;
                if ety > 12 {
                    return Err(self.invalid(field, at, format!("unknown array element type {ety}")));
                }
                let count_at = self.offset();
                let n = self.u64(field)?;
                // Every element takes at least min_size bytes: a count that cannot fit in what
                // remains is rejected before the Vec is allocated.
                if n.saturating_mul(Self::min_size(ety)) > self.remaining() {
                    return Err(self.invalid(
                        field,
                        count_at,
                        format!("array of {n} elements cannot fit in the {} bytes left", self.remaining()),
                    ));
                }
                let mut v = Vec::with_capacity(usize::try_from(n).unwrap_or(0));
                for _ in 0..n {
                    v.push(self.value(ety, field, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64(field)?),
            11 => Value::I64(i64::from_le_bytes(self.array(field)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(field)?)),
            t => return Err(self.invalid(field, at, format!("unknown value type {t}"))),
        })
    }
}

/// Parses the header of a GGUF file held in `buf` (the whole file) and checks every tensor
/// against the data section.
pub fn parse(buf: &[u8]) -> Result<GgufHeader> {
    let mut c = Cursor { buf, pos: 0 };
    let magic = c.array::<4>("magic")?;
    if &magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = c.u32("version")?;
    if version != 2 && version != 3 {
        return Err(GgufError::Version { version });
    }
    let n_tensors_at = c.offset();
    let n_tensors = c.u64("tensor_count")?;
    let n_kv_at = c.offset();
    let n_kv = c.u64("metadata_kv_count")?;
    // A metadata entry is at least a key length, a type and a 1-byte value; a tensor info at
    // least a name length, n_dims, one dim, a type and an offset.
    if n_kv.saturating_mul(13) > c.remaining() {
        return Err(c.invalid("metadata_kv_count", n_kv_at, format!("{n_kv} entries cannot fit in the file")));
    }
    if n_tensors.saturating_mul(32) > c.remaining() {
        return Err(c.invalid("tensor_count", n_tensors_at, format!("{n_tensors} tensors cannot fit in the file")));
    }

    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key = c.string(&format!("metadata key #{i}"))?;
        let ty_at = c.offset();
        let ty = c.u32(&format!("type of {key}"))?;
        if ty > 12 {
            return Err(c.invalid(&format!("type of {key}"), ty_at, format!("unknown value type {ty}")));
        }
        let value = c.value(ty, &key, 0)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(GgufError::Metadata { key, what: "appears twice".into() });
        }
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a.is_power_of_two() && a <= 1 << 16 => a,
            _ => {
                return Err(GgufError::Metadata {
                    key: "general.alignment".into(),
                    what: format!("{v:?} is not a power of two up to 65536"),
                })
            }
        },
    };

    let mut tensors = Vec::with_capacity(usize::try_from(n_tensors).unwrap_or(0));
    for i in 0..n_tensors {
        let name = c.string(&format!("tensor #{i} name"))?;
        let nd_at = c.offset();
        let n_dims = c.u32(&format!("n_dims of {name}"))?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(c.invalid(&format!("n_dims of {name}"), nd_at, format!("{n_dims} dimensions (1..={MAX_DIMS} allowed)")));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&format!("dims of {name}"))?);
        }
        let ty_at = c.offset();
        let ty_raw = c.u32(&format!("type of {name}"))?;
        let ty = GgmlType::from_u32(ty_raw).ok_or_else(|| {
            c.invalid(&format!("type of {name}"), ty_at, format!("unsupported tensor type {ty_raw}{}", ggml_type_name(ty_raw)))
        })?;
        let offset = c.u64(&format!("offset of {name}"))?;
        let size = tensor_size(&name, &dims, ty)?;
        if offset % alignment != 0 {
            return Err(GgufError::Tensor { name, what: format!("offset {offset} is not a multiple of the alignment {alignment}") });
        }
        tensors.push(TensorInfo { name, dims, ty, offset, size });
    }

    let data_offset = c.offset().div_ceil(alignment) * alignment;
    let data_len = (buf.len() as u64).saturating_sub(data_offset);
    let mut by_offset: Vec<&TensorInfo> = tensors.iter().collect();
    by_offset.sort_by_key(|t| t.offset);
    let mut seen = std::collections::HashSet::new();
    for (i, t) in by_offset.iter().enumerate() {
        if !seen.insert(t.name.as_str()) {
            return Err(GgufError::Tensor { name: t.name.clone(), what: "appears twice".into() });
        }
        let end = t.offset.checked_add(t.size).filter(|&e| e <= data_len).ok_or_else(|| GgufError::Tensor {
            name: t.name.clone(),
            what: format!(
                "data [{}, +{}) runs past the end of the data section ({data_len} bytes at file offset {data_offset})",
                t.offset, t.size
            ),
        })?;
        if let Some(next) = by_offset.get(i + 1) {
            if next.offset < end {
                return Err(GgufError::Tensor {
                    name: t.name.clone(),
                    what: format!("overlaps tensor {:?} (ends at {end}, next starts at {})", next.name, next.offset),
                });
            }
        }
    }

    Ok(GgufHeader { version, metadata, tensors, alignment, data_offset })
}

/// ggml's name for a type number the engine does not run, for the error message.
fn ggml_type_name(ty: u32) -> &'static str {
    match ty {
        10 => " (Q2_K)",
        11 => " (Q3_K)",
        15 => " (Q8_K)",
        16..=23 => " (an IQ type)",
        24 => " (I8)",
        25 => " (I16)",
        26 => " (I32)",
        27 => " (I64)",
        28 => " (F64)",
        29 => " (IQ1_M)",
        34 | 35 => " (a TQ type)",
        39 => " (MXFP4)",
        _ => "",
    }
}

fn tensor_size(name: &str, dims: &[u64], ty: GgmlType) -> Result<u64> {
    let err = |what: String| GgufError::Tensor { name: name.to_string(), what };
    if dims.contains(&0) {
        return Err(err(format!("zero dimension in {dims:?}")));
    }
    let n = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n < 1 << 48)
        .ok_or_else(|| err(format!("dimensions {dims:?} are absurd")))?;
    let blk = ty.block_size() as u64;
    if !dims[0].is_multiple_of(blk) {
        return Err(err(format!("row length {} is not a multiple of the {ty:?} block size {blk}", dims[0])));
    }
    Ok(n / blk * ty.type_size() as u64)
}

/// An open GGUF file: its header and a read-only map of the whole file.
#[derive(Debug)]
pub struct GgufFile {
    pub header: GgufHeader,
    pub path: PathBuf,
    map: Mmap,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|source| GgufError::Open { path: path.to_path_buf(), source })?;
        // SAFETY: the map is read-only and private to this process. A model file truncated or
        // rewritten by someone else while it is mapped would fault (SIGBUS) or change under us;
        // like llama.cpp we accept that risk for read-only model files.
        let map = unsafe { Mmap::map(&file) }.map_err(|source| GgufError::Map { path: path.to_path_buf(), source })?;
        let header = parse(&map)?;
        Ok(Self { header, path: path.to_path_buf(), map })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.header.metadata.get(key)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.header.tensors.iter().find(|t| t.name == name)
    }

    /// The bytes of a tensor (checked to be inside the file by `parse`).
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let start = usize::try_from(self.header.data_offset + t.offset).expect("checked by parse");
        let len = usize::try_from(t.size).expect("checked by parse");
        &self.map[start..start + len]
    }

    /// Tells the kernel we will not need the mapped pages soon: they leave this process's
    /// resident set (the page cache keeps them) and fault back in when read again.
    pub fn release_pages(&self, offset: usize, len: usize) {
        // Only whole pages inside the range: a page shared with a neighbour would merely fault
        // back in, but there is no point dropping it.
        let page = 4096;
        let start = offset.div_ceil(page) * page;
        let end = (offset + len) / page * page;
        if end > start {
            // SAFETY: DONTNEED on a private read-only file mapping only drops our page-table
            // entries; the next read faults the unchanged file contents back in.
            let _ = unsafe { self.map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start) };
        }
    }

    /// Whole file, for fingerprinting.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }
}

/// A tensor to be written: its name, GGUF dimensions (row length first) and type.
#[derive(Debug, Clone)]
pub struct TensorSpec {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
}

/// Writes a GGUF v3 file that [`parse`] (and llama.cpp) read: the metadata and tensor infos
/// up front ([`Writer::new`]), then each tensor's bytes in the order given
/// ([`Writer::tensor`]), each padded to the alignment. Streams: one tensor's bytes in memory
/// at a time, so a 7B-shaped file needs no 4 GiB buffer.
#[derive(Debug)]
pub struct Writer<W: std::io::Write> {
    out: W,
    sizes: Vec<(String, u64)>,
    next: usize,
}

impl<W: std::io::Write> Writer<W> {
    /// Writes the header. Metadata keys are written in the order given; an array's elements
    /// must all be of its first element's type (GGUF arrays are typed), an empty array is
    /// written as an array of u8. `general.alignment` is left to the default (32).
    pub fn new(mut out: W, metadata: &[(String, Value)], tensors: &[TensorSpec]) -> std::io::Result<Self> {
        let bad = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, what);
        let mut head = Vec::new();
        head.extend_from_slice(GGUF_MAGIC);
        head.extend_from_slice(&3u32.to_le_bytes());
        head.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        head.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (k, v) in metadata {
            if k == "general.alignment" {
                return Err(bad("general.alignment is the writer's (32)".into()));
            }
            put_str(&mut head, k);
            head.extend_from_slice(&value_type(v).to_le_bytes());
            put_value(&mut head, v).map_err(|e| bad(format!("metadata {k}: {e}")))?;
        }
        let mut offset = 0u64;
        let mut sizes = Vec::with_capacity(tensors.len());
        for t in tensors {
            let size = tensor_size(&t.name, &t.dims, t.ty).map_err(|e| bad(e.to_string()))?;
            let n_dims = u32::try_from(t.dims.len()).ok().filter(|n| (1..=MAX_DIMS).contains(n));
            let n_dims = n_dims.ok_or_else(|| bad(format!("tensor {}: {} dimensions", t.name, t.dims.len())))?;
            put_str(&mut head, &t.name);
            head.extend_from_slice(&n_dims.to_le_bytes());
            t.dims.iter().for_each(|d| head.extend_from_slice(&d.to_le_bytes()));
            head.extend_from_slice(&t.ty.as_u32().to_le_bytes());
            head.extend_from_slice(&offset.to_le_bytes());
            offset += size.div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT;
            sizes.push((t.name.clone(), size));
        }
        head.resize(head.len().next_multiple_of(ALIGN), 0);
        out.write_all(&head)?;
        Ok(Self { out, sizes, next: 0 })
    }

    /// Writes the next tensor's bytes (exactly its size, checked).
    pub fn tensor(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        let Some((name, size)) = self.sizes.get(self.next) else {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "more tensors than declared"));
        };
        if bytes.len() as u64 != *size {
            let what = format!("tensor {name}: {} bytes given, {size} declared", bytes.len());
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, what));
        }
        self.out.write_all(bytes)?;
        self.out.write_all(&[0u8; ALIGN][..bytes.len().next_multiple_of(ALIGN) - bytes.len()])?;
        self.next += 1;
        Ok(())
    }

    /// Checks every declared tensor was written and returns the output.
    pub fn finish(mut self) -> std::io::Result<W> {
        if self.next != self.sizes.len() {
            let what = format!("{} of {} tensors written", self.next, self.sizes.len());
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, what));
        }
        self.out.flush()?;
        Ok(self.out)
    }
}

/// The writer's alignment: GGUF's default, so no `general.alignment` key is needed.
const ALIGN: usize = 32;
const _: () = assert!(ALIGN as u64 == DEFAULT_ALIGNMENT);

fn put_str(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

/// GGUF's value type codes.
fn value_type(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn put_value(buf: &mut Vec<u8>, v: &Value) -> std::result::Result<(), String> {
    match v {
        Value::U8(x) => buf.push(*x),
        Value::I8(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => buf.push(u8::from(*x)),
        Value::String(s) => put_str(buf, s),
        Value::Array(a) => {
            let ty = a.first().map_or(0, value_type);
            buf.extend_from_slice(&ty.to_le_bytes());
            buf.extend_from_slice(&(a.len() as u64).to_le_bytes());
            for e in a {
                if value_type(e) != ty {
                    return Err("an array of mixed types".into());
                }
                put_value(buf, e)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)]
mod writer_tests {
    use super::*;

    #[test]
    fn written_files_parse_back_to_what_was_written() {
        let meta = vec![
            ("general.architecture".to_string(), Value::String("llama".into())),
            ("a.u32".to_string(), Value::U32(7)),
            ("a.f32".to_string(), Value::F32(1.5)),
            ("a.arr".to_string(), Value::Array(vec![Value::String("x".into()), Value::String("yz".into())])),
            ("a.nested".to_string(), Value::Array(vec![Value::Array(vec![Value::I32(-1)])])),
            ("a.empty".to_string(), Value::Array(vec![])),
        ];
        let tensors = vec![
            TensorSpec { name: "t0".into(), dims: vec![32, 3], ty: GgmlType::Q8_0 },
            TensorSpec { name: "t1".into(), dims: vec![5], ty: GgmlType::F32 },
        ];
        let mut w = Writer::new(Vec::new(), &meta, &tensors).unwrap();
        let t0: Vec<u8> = (0..3 * 34u8).collect();
        let t1: Vec<u8> = (0..20u8).map(|i| 200 - i).collect();
        assert!(w.tensor(&t1).is_err(), "a tensor of the wrong size is refused");
        w.tensor(&t0).unwrap();
        w.tensor(&t1).unwrap();
        assert!(w.tensor(&t1).is_err(), "more tensors than declared");
        let buf = w.finish().unwrap();
        let h = parse(&buf).unwrap();
        assert_eq!(h.version, 3);
        for (k, v) in &meta {
            assert_eq!(h.metadata.get(k), Some(v), "{k}");
        }
        assert_eq!(h.tensors.len(), 2);
        let at = |i: usize| (h.data_offset + h.tensors[i].offset) as usize;
        assert_eq!(&buf[at(0)..at(0) + t0.len()], &t0[..]);
        assert_eq!(&buf[at(1)..at(1) + t1.len()], &t1[..]);
        assert_eq!(h.tensors[0].ty, GgmlType::Q8_0);
        assert_eq!(h.tensors[1].dims, vec![5]);
        let mixed = vec![("m".to_string(), Value::Array(vec![Value::U8(1), Value::I8(1)]))];
        assert!(Writer::new(Vec::new(), &mixed, &[]).is_err());
        let unfinished = Writer::new(Vec::new(), &[], &tensors).unwrap();
        assert!(unfinished.finish().is_err());
    }
}
