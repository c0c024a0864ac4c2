//! A trainable Qwen2 (Qwen2 / Qwen2.5: grouped-query attention, RoPE, RMSNorm, SiLU-gated MLP,
//! biases on q/k/v, tied or untied embeddings) on candle, with every parameter a `Var` named as in
//! Hugging Face's checkpoints. `candle-transformers`' qwen2 is inference-only (last-position
//! logits, private weights) and its fast norm / rope / softmax drop gradients; this one runs a
//! training forward over full padded sequences through differentiable fused ops, and a KV-cache
//! forward for generation.

use std::sync::Arc;

use candle_core::{DType, Device, Module, Result, Tensor, Var};
use flashgrpo_candle::ops::{embedding, masked_softmax, rms_norm, rope, AttentionMask, RopeTable};
use flashgrpo_kernels::synthetic::normal_matrix;

use super::config::Qwen2Config;
use super::params::Params;

struct Layer {
    input_norm: Var,
    post_norm: Var,
    q: (Var, Var),
    k: (Var, Var),
    v: (Var, Var),
    o: Var,
    gate: Var,
    up: Var,
    down: Var,
}

/// The keys and values of past positions, per layer, and which of them are padding.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    layers: Vec<(Tensor, Tensor)>,
    /// `[B, cached]` 1 for a real key.
    keys: Vec<Vec<u8>>,
}

impl KvCache {
    pub fn len(&self) -> usize {
        self.keys.first().map_or(0, Vec::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A Qwen2 model: parameters, and the rotary table.
pub struct Qwen2 {
    pub config: Qwen2Config,
    pub params: Params,
    embed: Var,
    layers: Vec<Layer>,
    norm: Var,
    lm_head: Option<Var>,
    rope: Arc<RopeTable>,
}

/// Hugging Face's parameter names and shapes for a config.
pub fn parameter_shapes(c: &Qwen2Config) -> Vec<(String, Vec<usize>)> {
    let (h, i, hd) = (c.hidden_size, c.intermediate_size, c.head_dim());
    let (q, kv) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
    let mut shapes = vec![("model.embed_tokens.weight".to_string(), vec![c.vocab_size, h])];
    for l in 0..c.num_hidden_layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        shapes.extend([
            (p("input_layernorm.weight"), vec![h]),
            (p("self_attn.q_proj.weight"), vec![q, h]),
            (p("self_attn.q_proj.bias"), vec![q]),
            (p("self_attn.k_proj.weight"), vec![kv, h]),
            (p("self_attn.k_proj.bias"), vec![kv]),
            (p("self_attn.v_proj.weight"), vec![kv, h]),
            (p("self_attn.v_proj.bias"), vec![kv]),
            (p("self_attn.o_proj.weight"), vec![h, q]),
            (p("post_attention_layernorm.weight"), vec![h]),
            (p("mlp.gate_proj.weight"), vec![i, h]),
            (p("mlp.up_proj.weight"), vec![i, h]),
            (p("mlp.down_proj.weight"), vec![h, i]),
        ]);
    }
    shapes.push(("model.norm.weight".to_string(), vec![h]));
    if !c.tie_word_embeddings {
        shapes.push(("lm_head.weight".to_string(), vec![c.vocab_size, h]));
    }
    shapes
}

/// `x [.., in] @ w[out, in]^T (+ b)`.
fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let (inner, outer) = (dims[dims.len() - 1], w.dim(0)?);
    let rows: usize = dims[..dims.len() - 1].iter().product();
    let y = x.reshape((rows, inner))?.matmul(&w.t()?)?;
    let y = match b {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    let mut out = dims;
    *out.last_mut().expect("rank >= 1") = outer;
    y.reshape(out)
}

/// Repeats each key/value head `n` times (grouped-query attention), as `repeat_kv` does.
fn repeat_kv(x: Tensor, n: usize) -> Result<Tensor> {
    if n == 1 {
        return Ok(x);
    }
    let (b, heads, t, d) = x.dims4()?;
    Tensor::cat(&vec![&x; n], 2)?.reshape((b, heads * n, t, d))
}

impl Qwen2 {
    /// Builds the model around named parameters (shapes are checked by the caller, `Params`).
    pub fn from_params(config: Qwen2Config, params: Params) -> Result<Self> {
        let get = |name: &str| params.var(name).cloned();
        let layers = (0..config.num_hidden_layers)
            .map(|l| {
                let p = |s: &str| get(&format!("model.layers.{l}.{s}"));
                Ok(Layer {
                    input_norm: p("input_layernorm.weight")?,
                    post_norm: p("post_attention_layernorm.weight")?,
                    q: (p("self_attn.q_proj.weight")?, p("self_attn.q_proj.bias")?),
                    k: (p("self_attn.k_proj.weight")?, p("self_attn.k_proj.bias")?),
                    v: (p("self_attn.v_proj.weight")?, p("self_attn.v_proj.bias")?),
                    o: p("self_attn.o_proj.weight")?,
                    gate: p("mlp.gate_proj.weight")?,
                    up: p("mlp.up_proj.weight")?,
                    down: p("mlp.down_proj.weight")?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let rope = RopeTable::new(config.head_dim(), config.rope_theta, config.max_position_embeddings);
        Ok(Self {
            embed: get("model.embed_tokens.weight")?,
            norm: get("model.norm.weight")?,
            lm_head: if config.tie_word_embeddings { None } else { Some(get("lm_head.weight")?) },
            layers,
            rope,
            params,
            config,
        })
    }

    /// A randomly initialised model (Hugging Face's `_init_weights`: normal(0, initializer_range)
    /// for matrices, zeros for biases, ones for norms), seeded.
    pub fn random(config: Qwen2Config, dtype: DType, seed: u64) -> Result<Self> {
        let std = config.initializer_range;
        let params = parameter_shapes(&config)
            .into_iter()
            .enumerate()
            .map(|(i, (name, shape))| {
                let n: usize = shape.iter().product();
                let values = if name.ends_with("norm.weight") {
                    vec![1.0f32; n]
                } else if name.ends_with(".bias") {
                    vec![0.0f32; n]
                } else {
                    normal_matrix(1, n, std, seed.wrapping_mul(0x9E37).wrapping_add(i as u64))
                };
                let t = Tensor::from_vec(values, shape, &Device::Cpu)?.to_dtype(dtype)?;
                Ok((name, Var::from_tensor(&t)?))
            })
            .collect::<Result<Vec<_>>>()?;
        Self::from_params(config, Params::new(params))
    }

    /// A copy with its own storage (the GRPO reference policy: the weights at the start of
    /// training, untouched by later updates).
    pub fn frozen_copy(&self) -> Result<Self> {
        let params = self
            .params
            .iter()
            .map(|(name, var)| Ok((name.to_string(), Var::from_tensor(&var.as_tensor().copy()?)?)))
            .collect::<Result<Vec<_>>>()?;
        Self::from_params(self.config.clone(), Params::new(params))
    }

    pub fn dtype(&self) -> DType {
        self.embed.dtype()
    }

    /// The lm_head weight `[V, H]` (the embeddings when tied).
    pub fn lm_head(&self) -> &Var {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    fn p(v: &Var, track: bool) -> Tensor {
        if track {
            v.as_tensor().clone()
        } else {
            v.as_tensor().detach()
        }
    }

    /// Final hidden states `[B, T, H]` (after the last norm) of `ids [B, T]` (u32).
    /// `attention_mask [B, T]` marks real tokens (1) and padding (0); positions are `0..T` as in
    /// Hugging Face's forward. `track` records the graph for `backward`.
    pub fn hidden_states(&self, ids: &Tensor, attention_mask: Option<&[u8]>, track: bool) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let positions: Vec<u32> = (0..b).flat_map(|_| 0..t as u32).collect();
        self.forward(ids, attention_mask.map(<[u8]>::to_vec), positions, None, track)
    }

    /// The forward over `ids [B, T]` at `positions [B*T]`; with a cache, the keys of earlier
    /// positions come first and the new ones are appended. `key_mask [B, T]` marks the new
    /// tokens' padding.
    pub fn forward(
        &self,
        ids: &Tensor,
        key_mask: Option<Vec<u8>>,
        positions: Vec<u32>,
        mut cache: Option<&mut KvCache>,
        track: bool,
    ) -> Result<Tensor> {
        let c = &self.config;
        let (b, t) = ids.dims2()?;
        let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim());
        let new_keys = key_mask.unwrap_or_else(|| vec![1u8; b * t]);
        // The key mask over cached + new keys, per batch row.
        let past = cache.as_ref().map_or(0, |c| c.len());
        let keys: Vec<u8> = (0..b)
            .flat_map(|r| {
                let old = cache.as_ref().and_then(|c| c.keys.get(r).cloned()).unwrap_or_default();
                old.into_iter().chain(new_keys[r * t..(r + 1) * t].iter().copied()).collect::<Vec<_>>()
            })
            .collect();
        let mask = AttentionMask { offset: past, keys: keys.contains(&0).then(|| Arc::new(keys.clone())) };
        let positions = Arc::new(positions);
        let scale = 1.0 / (hd as f64).sqrt();

        let mut x = embedding(&Self::p(&self.embed, track), &ids.flatten_all()?)?.reshape((b, t, c.hidden_size))?;
        for (l, layer) in self.layers.iter().enumerate() {
            let pw = |v: &Var| Self::p(v, track);
            let h = rms_norm(&x, &pw(&layer.input_norm), c.rms_norm_eps)?;
            let heads = |w: &(Var, Var), n: usize| -> Result<Tensor> {
                linear(&h, &pw(&w.0), Some(&pw(&w.1)))?.reshape((b, t, n, hd))?.transpose(1, 2)?.contiguous()
            };
            let q = rope(&heads(&layer.q, nh)?, &self.rope, &positions)?;
            let mut k = rope(&heads(&layer.k, nkv)?, &self.rope, &positions)?;
            let mut v = heads(&layer.v, nkv)?;
            if let Some(cache) = cache.as_deref_mut() {
                if let Some((pk, pv)) = cache.layers.get(l) {
                    k = Tensor::cat(&[pk, &k], 2)?;
                    v = Tensor::cat(&[pv, &v], 2)?;
                }
                let entry = (k.detach(), v.detach());
                if l < cache.layers.len() {
                    cache.layers[l] = entry;
                } else {
                    cache.layers.push(entry);
                }
            }
            let k = repeat_kv(k, nh / nkv)?.contiguous()?;
            let v = repeat_kv(v, nh / nkv)?.contiguous()?;
            let scores = (q.matmul(&k.t()?.contiguous()?)? * scale)?;
            let attn = masked_softmax(&scores, &mask)?.matmul(&v)?;
            let attn = attn.transpose(1, 2)?.reshape((b, t, nh * hd))?;
            x = (x + linear(&attn, &pw(&layer.o), None)?)?;
            let h = rms_norm(&x, &pw(&layer.post_norm), c.rms_norm_eps)?;
            let gated = (linear(&h, &pw(&layer.gate), None)?.silu()? * linear(&h, &pw(&layer.up), None)?)?;
            x = (x + linear(&gated, &pw(&layer.down), None)?)?;
        }
        if let Some(cache) = cache {
            if cache.keys.is_empty() {
                cache.keys = vec![Vec::new(); b];
            }
            for (r, k) in cache.keys.iter_mut().enumerate() {
                k.extend_from_slice(&new_keys[r * t..(r + 1) * t]);
            }
        }
        rms_norm(&x, &Self::p(&self.norm, track), c.rms_norm_eps)
    }

    /// Materialised logits `[.., V]` of hidden states (f32); for inspection and sampling, not for
    /// training (the fused-linear losses never build them).
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        linear(hidden, &self.lm_head().as_tensor().detach(), None)?.to_dtype(DType::F32)
    }

    /// The rotary table (cos / sin per position).
    pub fn rope_table(&self) -> &RopeTable {
        &self.rope
    }

    /// The rotary table's reach.
    pub fn max_positions(&self) -> usize {
        self.rope.max_positions()
    }
}

/// `Module` for convenience: the hidden states of unpadded ids, without tracking.
impl Module for Qwen2 {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.hidden_states(ids, None, false)
    }
}
