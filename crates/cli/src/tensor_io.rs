//! Reading named tensors from a safetensors file with dtype and shape checks that name the
//! tensor, and writing outputs atomically (a temporary file renamed into place, so an error
//! never leaves a partial output).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use half::{bf16, f16};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

/// A safetensors file held in memory.
pub struct TensorFile {
    path: PathBuf,
    bytes: Vec<u8>,
}

/// A float tensor (logits, hidden states, weights, gradients) in its stored dtype.
pub enum FloatData {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
}

/// An element type that can be wrapped back into [`FloatData`] or handed to candle.
pub trait FloatElement: flashgrpo_kernels::Element + candle_core::WithDType {
    fn wrap(values: Vec<Self>) -> FloatData;

    /// The values of `data` when it holds this type.
    fn slice_of(data: &FloatData) -> Option<&[Self]>;

    /// f32 values rounded to this type.
    fn wrap_f32(values: &[f32]) -> FloatData {
        Self::wrap(values.iter().map(|&x| Self::from_f32(x)).collect())
    }

    fn candle_tensor(values: &[Self], shape: (usize, usize)) -> candle_core::Result<candle_core::Tensor> {
        candle_core::Tensor::from_slice(values, shape, &candle_core::Device::Cpu)
    }
}

impl FloatElement for f32 {
    fn wrap(values: Vec<Self>) -> FloatData {
        FloatData::F32(values)
    }
    fn slice_of(data: &FloatData) -> Option<&[Self]> {
        match data {
            FloatData::F32(v) => Some(v),
            _ => None,
        }
    }
}

impl FloatElement for bf16 {
    fn wrap(values: Vec<Self>) -> FloatData {
        FloatData::BF16(values)
    }
    fn slice_of(data: &FloatData) -> Option<&[Self]> {
        match data {
            FloatData::BF16(v) => Some(v),
            _ => None,
        }
    }
}

impl FloatElement for f16 {
    fn wrap(values: Vec<Self>) -> FloatData {
        FloatData::F16(values)
    }
    fn slice_of(data: &FloatData) -> Option<&[Self]> {
        match data {
            FloatData::F16(v) => Some(v),
            _ => None,
        }
    }
}

/// Code generic over the logits dtype, run on whichever [`FloatData`] holds.
pub trait FloatVisitor {
    type Out;
    fn visit<T: FloatElement>(self, logits: &[T]) -> Self::Out;
}

/// As [`FloatVisitor`], taking the values (a backend keeps them as its buffer, no copy).
pub trait FloatVisitorOwned {
    type Out;
    fn visit<T: FloatElement>(self, values: Vec<T>) -> Self::Out;
}

impl FloatData {
    pub fn visit_owned<V: FloatVisitorOwned>(self, visitor: V) -> V::Out {
        match self {
            FloatData::F32(v) => visitor.visit(v),
            FloatData::BF16(v) => visitor.visit(v),
            FloatData::F16(v) => visitor.visit(v),
        }
    }

    pub fn visit<V: FloatVisitor>(&self, visitor: V) -> V::Out {
        match self {
            FloatData::F32(v) => visitor.visit(v),
            FloatData::BF16(v) => visitor.visit(v),
            FloatData::F16(v) => visitor.visit(v),
        }
    }

    /// The kernels' name for the element type.
    pub fn element_dtype(&self) -> flashgrpo_kernels::DType {
        use flashgrpo_kernels::DType;
        match self {
            FloatData::F32(_) => DType::F32,
            FloatData::BF16(_) => DType::BF16,
            FloatData::F16(_) => DType::F16,
        }
    }

    pub fn dtype(&self) -> Dtype {
        match self {
            FloatData::F32(_) => Dtype::F32,
            FloatData::BF16(_) => Dtype::BF16,
            FloatData::F16(_) => Dtype::F16,
        }
    }

    pub fn size_in_bytes(&self) -> usize {
        match self {
            FloatData::F32(v) => std::mem::size_of_val(v.as_slice()),
            FloatData::BF16(v) => std::mem::size_of_val(v.as_slice()),
            FloatData::F16(v) => std::mem::size_of_val(v.as_slice()),
        }
    }

    /// Widened to f64, for the reference.
    pub fn to_f64(&self) -> Vec<f64> {
        match self {
            FloatData::F32(v) => v.iter().map(|&x| x as f64).collect(),
            FloatData::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
            FloatData::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
        }
    }
}

fn chunks<const K: usize>(data: &[u8]) -> impl Iterator<Item = [u8; K]> + '_ {
    data.chunks_exact(K).map(|c| c.try_into().expect("chunks_exact yields K bytes"))
}

impl TensorFile {
    pub fn read(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        SafeTensors::deserialize(&bytes).with_context(|| format!("{} is not a safetensors file", path.display()))?;
        Ok(Self { path: path.to_path_buf(), bytes })
    }

    fn tensors(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes).expect("checked in read")
    }

    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.tensors().names().into_iter().map(str::to_string).collect();
        names.sort();
        names
    }

    fn view(&self, name: &str) -> Option<TensorView<'_>> {
        self.tensors().tensor(name).ok()
    }

    /// The shape of `name`, if present.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.view(name).map(|v| v.shape().to_vec())
    }

    fn mistyped(&self, name: &str, dtype: Dtype, accepted: &str) -> anyhow::Error {
        anyhow::anyhow!("tensor `{name}` in {} has dtype {dtype:?}; expected {accepted}", self.path.display())
    }

    /// A required tensor's view, with a clear error when it is missing.
    fn required(&self, name: &str, why: &str) -> Result<TensorView<'_>> {
        self.view(name).with_context(|| {
            format!("missing tensor `{name}` in {} ({why}); it holds: {}", self.path.display(), self.names().join(", "))
        })
    }

    pub fn float_tensor(&self, name: &str) -> Result<(FloatData, Vec<usize>)> {
        let v = self.required(name, "a float tensor")?;
        let data = match v.dtype() {
            Dtype::F32 => FloatData::F32(chunks::<4>(v.data()).map(f32::from_le_bytes).collect()),
            Dtype::BF16 => FloatData::BF16(chunks::<2>(v.data()).map(bf16::from_le_bytes).collect()),
            Dtype::F16 => FloatData::F16(chunks::<2>(v.data()).map(f16::from_le_bytes).collect()),
            other => return Err(self.mistyped(name, other, "F32, BF16 or F16")),
        };
        Ok((data, v.shape().to_vec()))
    }

    /// Token ids, i64 or i32.
    pub fn ids(&self, name: &str, why: &str) -> Result<(Vec<i64>, Vec<usize>)> {
        let v = self.required(name, why)?;
        let data = match v.dtype() {
            Dtype::I64 => chunks::<8>(v.data()).map(i64::from_le_bytes).collect(),
            Dtype::I32 => chunks::<4>(v.data()).map(|b| i32::from_le_bytes(b) as i64).collect(),
            other => return Err(self.mistyped(name, other, "I64 or I32")),
        };
        Ok((data, v.shape().to_vec()))
    }

    /// An optional f32 tensor.
    pub fn floats(&self, name: &str) -> Result<Option<(Vec<f32>, Vec<usize>)>> {
        let Some(v) = self.view(name) else { return Ok(None) };
        match v.dtype() {
            Dtype::F32 => Ok(Some((chunks::<4>(v.data()).map(f32::from_le_bytes).collect(), v.shape().to_vec()))),
            other => Err(self.mistyped(name, other, "F32")),
        }
    }

    /// An optional 0/1 mask: f32, u8, bool, i64 or i32 (Hugging Face's `attention_mask` is
    /// int64), returned as f32.
    pub fn mask(&self, name: &str) -> Result<Option<(Vec<f32>, Vec<usize>)>> {
        let Some(v) = self.view(name) else { return Ok(None) };
        let data = match v.dtype() {
            Dtype::F32 => chunks::<4>(v.data()).map(f32::from_le_bytes).collect(),
            Dtype::U8 | Dtype::BOOL => v.data().iter().map(|&b| b as f32).collect(),
            Dtype::I64 => chunks::<8>(v.data()).map(|b| i64::from_le_bytes(b) as f32).collect(),
            Dtype::I32 => chunks::<4>(v.data()).map(|b| i32::from_le_bytes(b) as f32).collect(),
            other => return Err(self.mistyped(name, other, "F32, U8, BOOL, I64 or I32")),
        };
        Ok(Some((data, v.shape().to_vec())))
    }
}

/// One output tensor, little-endian bytes.
pub struct Output {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl Output {
    pub fn f32(name: &str, shape: Vec<usize>, values: &[f32]) -> Self {
        Self {
            name: name.into(),
            dtype: Dtype::F32,
            shape,
            bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    pub fn i64(name: &str, shape: Vec<usize>, values: &[i64]) -> Self {
        Self {
            name: name.into(),
            dtype: Dtype::I64,
            shape,
            bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    pub fn float(name: &str, shape: Vec<usize>, data: &FloatData) -> Self {
        let bytes = match data {
            FloatData::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            FloatData::BF16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            FloatData::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        };
        Self { name: name.into(), dtype: data.dtype(), shape, bytes }
    }
}

/// Writes `outputs` to `path` through a temporary file in the same directory.
pub fn write_atomically(path: &Path, outputs: &[Output]) -> Result<()> {
    let views = outputs
        .iter()
        .map(|o| Ok((o.name.clone(), TensorView::new(o.dtype, o.shape.clone(), &o.bytes)?)))
        .collect::<Result<Vec<_>>>()?;
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let file_name = path.file_name().with_context(|| format!("{} is not a file path", path.display()))?;
    let tmp = dir.join(format!(".{}.tmp-{}", file_name.to_string_lossy(), std::process::id()));
    let result = safetensors::serialize_to_file(views, None, &tmp)
        .with_context(|| format!("cannot write {}", tmp.display()))
        .and_then(|()| {
            std::fs::rename(&tmp, path).with_context(|| format!("cannot move the output into {}", path.display()))
        });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Fails unless `shape` equals `want`, naming both tensors.
pub fn expect_shape(tensor: &str, shape: &[usize], want: &[usize], because: &str) -> Result<()> {
    if shape != want {
        bail!("shape mismatch: `{tensor}` has shape {shape:?}, but {because}, so it must be {want:?}");
    }
    Ok(())
}
