//! A streaming GGUF (version 3) writer: the header, the metadata and the tensor table first, then
//! each tensor's bytes as a caller fills them, one tensor in memory at a time. candle's writer
//! takes every tensor as a finished `QTensor`, which for a 4B-parameter model means holding
//! 2.5 GB at once; its reader (`gguf_file::Content`) and llama.cpp read what this writes.

use std::io::{self, Write};

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::GgmlDType;

/// The data section and every tensor in it start at multiples of this (GGUF's default).
pub const ALIGNMENT: u64 = 32;

/// One tensor of the file: its name, its dimensions in row-major order (`[rows, cols]`; GGUF
/// stores them innermost first) and its element type.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub dims: Vec<usize>,
    pub dtype: GgmlDType,
}

impl TensorSpec {
    pub fn elements(&self) -> usize {
        self.dims.iter().product()
    }

    /// Bytes of the tensor's data (whole blocks of its type).
    pub fn bytes(&self) -> usize {
        self.elements() / self.dtype.block_size() * self.dtype.type_size()
    }
}

/// GGML's number for a tensor type (candle keeps its own conversion private).
fn type_id(t: GgmlDType) -> u32 {
    match t {
        GgmlDType::F32 => 0,
        GgmlDType::F16 => 1,
        GgmlDType::Q4_0 => 2,
        GgmlDType::Q4_1 => 3,
        GgmlDType::Q5_0 => 6,
        GgmlDType::Q5_1 => 7,
        GgmlDType::Q8_0 => 8,
        GgmlDType::Q8_1 => 9,
        GgmlDType::Q2K => 10,
        GgmlDType::Q3K => 11,
        GgmlDType::Q4K => 12,
        GgmlDType::Q5K => 13,
        GgmlDType::Q6K => 14,
        GgmlDType::Q8K => 15,
        GgmlDType::BF16 => 30,
    }
}

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

fn string(w: &mut impl Write, s: &str) -> io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn value(w: &mut impl Write, v: &Value) -> io::Result<()> {
    match v {
        Value::U8(x) => w.write_all(&[*x]),
        Value::I8(x) => w.write_all(&x.to_le_bytes()),
        Value::U16(x) => w.write_all(&x.to_le_bytes()),
        Value::I16(x) => w.write_all(&x.to_le_bytes()),
        Value::U32(x) => w.write_all(&x.to_le_bytes()),
        Value::I32(x) => w.write_all(&x.to_le_bytes()),
        Value::U64(x) => w.write_all(&x.to_le_bytes()),
        Value::I64(x) => w.write_all(&x.to_le_bytes()),
        Value::F32(x) => w.write_all(&x.to_le_bytes()),
        Value::F64(x) => w.write_all(&x.to_le_bytes()),
        Value::Bool(x) => w.write_all(&[u8::from(*x)]),
        Value::String(s) => string(w, s),
        Value::Array(items) => {
            let t = items.first().map_or(4, value_type);
            if items.iter().any(|i| value_type(i) != t) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "a GGUF array holds values of one type",
                ));
            }
            w.write_all(&t.to_le_bytes())?;
            w.write_all(&(items.len() as u64).to_le_bytes())?;
            items.iter().try_for_each(|i| value(w, i))
        }
    }
}

fn pad(w: &mut impl Write, written: u64) -> io::Result<u64> {
    let n = (ALIGNMENT - written % ALIGNMENT) % ALIGNMENT;
    w.write_all(&vec![0u8; n as usize])?;
    Ok(n)
}

/// Counts what passes through, for the alignment of what follows.
struct Counting<W> {
    inner: W,
    written: u64,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Writes the header, `metadata` and the table of `tensors`, then each tensor's data, which
/// `fill` writes into a zeroed buffer of [`TensorSpec::bytes`]; returns the bytes written.
pub fn write(
    w: impl Write,
    metadata: &[(String, Value)],
    tensors: &[TensorSpec],
    mut fill: impl FnMut(&TensorSpec, &mut [u8]) -> io::Result<()>,
) -> io::Result<u64> {
    let mut w = Counting {
        inner: w,
        written: 0,
    };
    w.write_all(b"GGUF")?;
    w.write_all(&3u32.to_le_bytes())?;
    w.write_all(&(tensors.len() as u64).to_le_bytes())?;
    w.write_all(&(metadata.len() as u64).to_le_bytes())?;
    for (k, v) in metadata {
        string(&mut w, k)?;
        w.write_all(&value_type(v).to_le_bytes())?;
        value(&mut w, v)?;
    }
    let mut offset = 0u64;
    for t in tensors {
        if !t.elements().is_multiple_of(t.dtype.block_size()) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{}: {} values are not whole {:?} blocks",
                    t.name,
                    t.elements(),
                    t.dtype
                ),
            ));
        }
        string(&mut w, &t.name)?;
        w.write_all(&(t.dims.len() as u32).to_le_bytes())?;
        for &d in t.dims.iter().rev() {
            w.write_all(&(d as u64).to_le_bytes())?;
        }
        w.write_all(&type_id(t.dtype).to_le_bytes())?;
        w.write_all(&offset.to_le_bytes())?;
        offset += (t.bytes() as u64).div_ceil(ALIGNMENT) * ALIGNMENT;
    }
    let at = w.written;
    pad(&mut w, at)?;
    let mut buf = Vec::new();
    for t in tensors {
        buf.clear();
        buf.resize(t.bytes(), 0);
        fill(t, &mut buf)?;
        w.write_all(&buf)?;
        pad(&mut w, buf.len() as u64)?;
    }
    w.flush()?;
    Ok(w.written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::Content;
    use candle_core::Device;

    #[test]
    fn candles_reader_reads_the_metadata_table_and_data_back() {
        let metadata = vec![
            (
                "general.architecture".to_string(),
                Value::String("x".into()),
            ),
            ("a.u32".to_string(), Value::U32(7)),
            ("a.f32".to_string(), Value::F32(0.5)),
            ("a.flag".to_string(), Value::Bool(true)),
            (
                "a.list".to_string(),
                Value::Array(vec![Value::String("p".into()), Value::String("q".into())]),
            ),
        ];
        let tensors = vec![
            TensorSpec {
                name: "norm".into(),
                dims: vec![5],
                dtype: GgmlDType::F32,
            },
            TensorSpec {
                name: "m".into(),
                dims: vec![3, 32],
                dtype: GgmlDType::Q8_0,
            },
        ];
        let mut bytes = Vec::new();
        let n = write(&mut bytes, &metadata, &tensors, |t, buf| {
            match t.dtype {
                GgmlDType::F32 => {
                    for (i, c) in buf.chunks_exact_mut(4).enumerate() {
                        c.copy_from_slice(&(i as f32).to_le_bytes());
                    }
                }
                // Each row's block: scale 1.0 (f16 0x3C00), values 0..32 plus the row.
                _ => {
                    for (r, b) in buf.chunks_exact_mut(34).enumerate() {
                        b[..2].copy_from_slice(&0x3C00u16.to_le_bytes());
                        for (i, q) in b[2..].iter_mut().enumerate() {
                            *q = (i + r) as u8;
                        }
                    }
                }
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(n, bytes.len() as u64);
        let mut cursor = std::io::Cursor::new(&bytes);
        let c = Content::read(&mut cursor).unwrap();
        assert_eq!(c.metadata["a.u32"].to_u32().unwrap(), 7);
        assert_eq!(c.metadata["a.f32"].to_f32().unwrap(), 0.5);
        assert!(c.metadata["a.flag"].to_bool().unwrap());
        assert_eq!(c.metadata["a.list"].to_vec().unwrap().len(), 2);
        let norm = c.tensor(&mut cursor, "norm", &Device::Cpu).unwrap();
        let v = norm
            .dequantize(&Device::Cpu)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(v, [0.0, 1.0, 2.0, 3.0, 4.0]);
        let m = c.tensor(&mut cursor, "m", &Device::Cpu).unwrap();
        let v = m
            .dequantize(&Device::Cpu)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert_eq!(v[2][5], 7.0);
        assert_eq!(v[0][31], 31.0);

        // A tensor that is not whole blocks is refused, naming it.
        let bad = [TensorSpec {
            name: "odd".into(),
            dims: vec![3, 30],
            dtype: GgmlDType::Q8_0,
        }];
        let err = write(Vec::new(), &[], &bad, |_, _| Ok(())).unwrap_err();
        assert!(err.to_string().contains("odd"), "{err}");
    }
}
