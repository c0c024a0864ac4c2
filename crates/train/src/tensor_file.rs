//! Safetensors files written straight from the buffers the trainer holds: the parameters under
//! their storage's read lock, the optimiser's moments and master weights as they are. candle's
//! `safetensors::save` takes owned tensors and copies each once more into a fresh `Vec<u8>` while
//! writing (`View::data` is `to_vec1`), so a checkpoint of Qwen2.5-0.5B's shape with 4 layers
//! (2.4 GB of optimiser state) copied its state twice into fresh memory, page faults and all:
//! 13.9-15.3 s for the checkpoint in bf16 on cpu-2c-zen5, 3.0-4.1 s written in place
//! (docs/BENCHMARKS.md, "Checkpoints written in place"). The file is the same byte for byte: the same names, dtypes,
//! shapes and order (safetensors sorts the tensors itself).

use std::borrow::Cow;
use std::path::Path;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Device, Layout, Storage, Tensor, Var};
use safetensors::{Dtype, View};

use crate::error::{Result, TrainError};

/// One tensor's little-endian bytes, borrowed where they already are.
pub(crate) struct Entry<'a> {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Cow<'a, [u8]>,
}

impl View for &Entry<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }

    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// The bytes of plain numbers, as the machine (little-endian, as safetensors stores them) holds
/// them.
fn bytes_of<T: Copy>(values: &[T]) -> &[u8] {
    // SAFETY: `T` is one of f32, f64, bf16 and f16 (every caller's, all in this file), plain
    // numbers with no padding; the byte slice covers exactly the values' memory and lives as long
    // as they do.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values)) }
}

#[cfg(not(target_endian = "little"))]
compile_error!("tensor files are written from memory as it is: a little-endian machine is assumed");

impl<'a> Entry<'a> {
    /// f32 values of `shape`, borrowed.
    pub fn f32(values: &'a [f32], shape: &[usize]) -> Self {
        debug_assert_eq!(values.len(), shape.iter().product::<usize>());
        Self { dtype: Dtype::F32, shape: shape.to_vec(), bytes: Cow::Borrowed(bytes_of(values)) }
    }

    /// f64 values of `shape`, owned (a counter's few numbers).
    pub fn f64_owned(values: &[f64], shape: &[usize]) -> Self {
        Self { dtype: Dtype::F64, shape: shape.to_vec(), bytes: Cow::Owned(bytes_of(values).to_vec()) }
    }
}

/// A parameter's tensor for the file: the parameter itself where it is on the CPU and contiguous
/// (every parameter the trainer makes; candle's `contiguous` then shares its storage), else a
/// contiguous CPU copy made now, before [`Entry::held`] takes any read lock.
pub(crate) fn readable(var: &Var) -> Result<Tensor> {
    Ok(var.as_tensor().to_device(&Device::Cpu)?.contiguous()?)
}

impl<'a> Entry<'a> {
    /// The values of a [`readable`] tensor, borrowed from its storage held under its read lock
    /// (`storage`) while the file is written; nothing may write the parameter meanwhile.
    pub fn held(storage: &'a Storage, layout: &Layout) -> Result<Self> {
        let range = layout.contiguous_offsets().map(|(start, end)| start..end);
        let (Storage::Cpu(cpu), Some(range)) = (storage, range) else {
            return Err(TrainError::Other("a tensor file is written from contiguous CPU storage".into()));
        };
        let (dtype, bytes) = match cpu {
            CpuStorage::F32(v) => (Dtype::F32, bytes_of(&v[range])),
            CpuStorage::BF16(v) => (Dtype::BF16, bytes_of(&v[range])),
            CpuStorage::F16(v) => (Dtype::F16, bytes_of(&v[range])),
            CpuStorage::F64(v) => (Dtype::F64, bytes_of(&v[range])),
            other => return Err(TrainError::Other(format!("cannot write a {:?} parameter", other.dtype()))),
        };
        Ok(Self { dtype, shape: layout.dims().to_vec(), bytes: Cow::Borrowed(bytes) })
    }
}

/// Writes `entries` to `path` as one safetensors file (through a temporary file renamed into
/// place, as the safetensors crate does).
pub(crate) fn write(path: &Path, entries: &[(String, Entry<'_>)]) -> Result<()> {
    let mut names: Vec<&str> = entries.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(TrainError::Other(format!("{}: the tensor `{}` is named twice", path.display(), w[0])));
    }
    safetensors::serialize_to_file(entries.iter().map(|(name, entry)| (name.as_str(), entry)), None, path)
        .map_err(|e| TrainError::Other(format!("{}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use candle_core::DType;

    use super::*;
    use crate::model::Params;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("flashgrpo-tensor-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(name)
    }

    /// Parameters of every dtype the trainer holds, and the optimiser's kinds of entries, give
    /// the file candle's own `save` writes, byte for byte.
    #[test]
    fn files_are_those_candle_writes() {
        let dev = Device::Cpu;
        let values: Vec<f32> = (0..35).map(|i| (i as f32 - 17.0) / 7.0).collect();
        let tensors = [
            ("a.weight", Tensor::from_slice(&values, (5, 7), &dev).unwrap()),
            ("b.bias", Tensor::from_slice(&values[..6], 6, &dev).unwrap().to_dtype(DType::BF16).unwrap()),
            ("c.weight", Tensor::from_slice(&values[..12], (3, 4), &dev).unwrap().to_dtype(DType::F16).unwrap()),
            ("d.weight", Tensor::from_slice(&values[..10], (2, 5), &dev).unwrap().to_dtype(DType::F64).unwrap()),
        ];
        let params = Params::new(tensors.iter().map(|(n, t)| (n.to_string(), Var::from_tensor(t).unwrap())).collect());
        let (ours, candles) = (scratch("ours.safetensors"), scratch("candle.safetensors"));
        params.save(&ours).unwrap();
        let map: HashMap<String, Tensor> = tensors.iter().map(|(n, t)| (n.to_string(), t.clone())).collect();
        candle_core::safetensors::save(&map, &candles).unwrap();
        assert_eq!(std::fs::read(&ours).unwrap(), std::fs::read(&candles).unwrap());

        let entries = vec![
            ("exp_avg.a".to_string(), Entry::f32(&values, &[5, 7])),
            ("steps".to_string(), Entry::f64_owned(&[3.0], &[1])),
        ];
        write(&ours, &entries).unwrap();
        let map = HashMap::from([
            ("exp_avg.a".to_string(), Tensor::from_slice(&values, (5, 7), &dev).unwrap()),
            ("steps".to_string(), Tensor::new(&[3.0f64], &dev).unwrap()),
        ]);
        candle_core::safetensors::save(&map, &candles).unwrap();
        assert_eq!(std::fs::read(&ours).unwrap(), std::fs::read(&candles).unwrap());
        let twice = [("x".to_string(), Entry::f32(&values, &[35])), ("x".to_string(), Entry::f32(&values, &[35]))];
        let e = write(&ours, &twice).unwrap_err().to_string();
        assert!(e.contains("the tensor `x` is named twice"), "{e}");
        std::fs::remove_dir_all(ours.parent().unwrap()).unwrap();
    }
}
