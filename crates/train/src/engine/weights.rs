//! The model's parameters as f32 slices for the engine: f32 parameters are read where candle keeps
//! them (a read lock on each `Var`'s storage, held while the engine runs, so nothing is copied);
//! bf16 parameters are read in place too, and their linear layers run on the machine's bf16
//! products where it has them ([`Param::weight`]); a bf16 parameter read as f32 (norms, biases,
//! every parameter on a machine without bf16 products) is widened once, on first use; f16
//! parameters are widened once per use. Every parameter also carries its index in
//! [`Params`](crate::model::Params), where its gradient buffer is.

use std::ops::{Deref, Range};
use std::sync::OnceLock;

use candle_core::{CpuStorage, DType, Storage, StorageRef, Var};
use flashgrpo_kernels::matmul_bf16::{self, Bf16Products};
use half::bf16;

use super::ops::Weight;

use crate::error::{Result, TrainError};
use crate::model::{Qwen2, Qwen2Config};

/// The sizes the engine computes with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dims {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub layers: usize,
    pub eps: f32,
}

impl Dims {
    pub fn of(c: &Qwen2Config) -> Self {
        Self {
            hidden: c.hidden_size,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim(),
            intermediate: c.intermediate_size,
            vocab: c.vocab_size,
            layers: c.num_hidden_layers,
            eps: c.rms_norm_eps as f32,
        }
    }

    /// Width of the queries (and of the attention output), `heads * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Width of the keys and of the values, `kv_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
}

/// One parameter's values as f32, and its index in the model's parameters.
pub struct Param<'m> {
    values: Values<'m>,
    pub index: usize,
}

enum Values<'m> {
    /// An f32 parameter, read in place under its storage's read lock.
    Borrowed(StorageRef<'m>, Range<usize>),
    /// A bf16 parameter, read in place under its storage's read lock; widened on first use as
    /// f32. `products`: the bf16 products its linear layers run on (AMX or AVX512-BF16), if any.
    Bf16 { guard: StorageRef<'m>, range: Range<usize>, widened: OnceLock<Vec<f32>>, products: Option<Bf16Products> },
    /// A widened copy of an f16 (or non-contiguous) parameter.
    Owned(Vec<f32>),
}

impl Deref for Param<'_> {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match &self.values {
            Values::Borrowed(guard, range) => match &**guard {
                Storage::Cpu(CpuStorage::F32(v)) => &v[range.clone()],
                _ => unreachable!("only contiguous f32 CPU storage is borrowed"),
            },
            Values::Bf16 { widened, .. } => widened.get_or_init(|| {
                let bits = self.bf16().expect("a bf16 parameter");
                bits.iter().map(|b| b.to_f32()).collect()
            }),
            Values::Owned(v) => v,
        }
    }
}

impl<'m> Param<'m> {
    fn of(name: &str, var: &'m Var, index: usize) -> Result<Self> {
        let tensor = var.as_tensor();
        {
            let (guard, layout) = tensor.storage_and_layout();
            match (&*guard, layout.contiguous_offsets()) {
                (Storage::Cpu(CpuStorage::F32(_)), Some((start, end))) => {
                    return Ok(Self { values: Values::Borrowed(guard, start..end), index });
                }
                (Storage::Cpu(CpuStorage::BF16(_)), Some((start, end))) => {
                    let products = Some(matmul_bf16::current()).filter(|p| p.packed());
                    let widened = OnceLock::new();
                    return Ok(Self { values: Values::Bf16 { guard, range: start..end, widened, products }, index });
                }
                _ => {}
            }
        }
        let widen =
            || -> candle_core::Result<Vec<f32>> { tensor.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>() };
        let values = widen().map_err(|e| TrainError::Other(format!("parameter {name}: {e}")))?;
        Ok(Self { values: Values::Owned(values), index })
    }

    /// A bf16 parameter's values as candle holds them.
    pub fn bf16(&self) -> Option<&[bf16]> {
        match &self.values {
            Values::Bf16 { guard, range, .. } => match &**guard {
                Storage::Cpu(CpuStorage::BF16(v)) => Some(&v[range.clone()]),
                _ => unreachable!("only contiguous bf16 CPU storage is borrowed as bf16"),
            },
            _ => None,
        }
    }

    /// The parameter as a linear layer's weight: its bf16 bits where it is bf16 and the machine
    /// has bf16 products (chosen when the weights were read), else its f32 values.
    pub fn weight(&self) -> Weight<'_> {
        match (&self.values, self.bf16()) {
            (Values::Bf16 { products: Some(products), .. }, Some(values)) => {
                use half::slice::HalfFloatSliceExt;
                Weight::Bf16(values.reinterpret_cast(), *products)
            }
            _ => Weight::F32(self),
        }
    }
}

/// One decoder layer's parameters.
pub struct LayerWeights<'m> {
    pub input_norm: Param<'m>,
    pub q: Param<'m>,
    pub q_bias: Param<'m>,
    pub k: Param<'m>,
    pub k_bias: Param<'m>,
    pub v: Param<'m>,
    pub v_bias: Param<'m>,
    pub o: Param<'m>,
    pub post_norm: Param<'m>,
    pub gate: Param<'m>,
    pub up: Param<'m>,
    pub down: Param<'m>,
}

impl LayerWeights<'_> {
    /// The indices of the layer's parameters (in [`crate::model::Params`] and `GradBuffers`).
    pub fn indices(&self) -> Vec<usize> {
        [
            &self.input_norm,
            &self.q,
            &self.q_bias,
            &self.k,
            &self.k_bias,
            &self.v,
            &self.v_bias,
            &self.o,
            &self.post_norm,
            &self.gate,
            &self.up,
            &self.down,
        ]
        .iter()
        .map(|p| p.index)
        .collect()
    }
}

/// Every parameter of a Qwen2 model, as the engine reads them.
pub struct Weights<'m> {
    pub dims: Dims,
    pub embed: Param<'m>,
    pub layers: Vec<LayerWeights<'m>>,
    pub norm: Param<'m>,
    /// `None` when the lm_head is tied to the embeddings.
    lm_head: Option<Param<'m>>,
    /// The rotary table, `[max_positions, head_dim / 2]` each.
    pub rope: &'m flashgrpo_candle::ops::RopeTable,
}

impl<'m> Weights<'m> {
    /// Reads `model`'s parameters. Drop the result before the optimiser writes them: the f32 and
    /// bf16 parameters stay read-locked while it lives.
    pub fn of(model: &'m Qwen2) -> Result<Self> {
        let get = |name: &str| -> Result<Param<'m>> {
            let index = model.params.position(name).map_err(|e| TrainError::Other(e.to_string()))?;
            let var = model.params.var(name).map_err(|e| TrainError::Other(e.to_string()))?;
            Param::of(name, var, index)
        };
        let c = &model.config;
        let dims = Dims::of(c);
        if dims.kv_heads == 0 || !dims.heads.is_multiple_of(dims.kv_heads) || dims.group() > super::attention::MAX_GROUP
        {
            return Err(TrainError::Other(format!(
                "the engine needs num_attention_heads ({}) to be a multiple of num_key_value_heads ({}), at most {} per key/value head",
                dims.heads,
                dims.kv_heads,
                super::attention::MAX_GROUP
            )));
        }
        let layers = (0..c.num_hidden_layers)
            .map(|l| {
                let p = |s: &str| get(&format!("model.layers.{l}.{s}"));
                Ok(LayerWeights {
                    input_norm: p("input_layernorm.weight")?,
                    q: p("self_attn.q_proj.weight")?,
                    q_bias: p("self_attn.q_proj.bias")?,
                    k: p("self_attn.k_proj.weight")?,
                    k_bias: p("self_attn.k_proj.bias")?,
                    v: p("self_attn.v_proj.weight")?,
                    v_bias: p("self_attn.v_proj.bias")?,
                    o: p("self_attn.o_proj.weight")?,
                    post_norm: p("post_attention_layernorm.weight")?,
                    gate: p("mlp.gate_proj.weight")?,
                    up: p("mlp.up_proj.weight")?,
                    down: p("mlp.down_proj.weight")?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            dims,
            embed: get("model.embed_tokens.weight")?,
            layers,
            norm: get("model.norm.weight")?,
            lm_head: if c.tie_word_embeddings { None } else { Some(get("lm_head.weight")?) },
            rope: model.rope_table(),
        })
    }

    /// The lm_head `[V, H]` (the embeddings when tied).
    pub fn lm_head(&self) -> &Param<'m> {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}
