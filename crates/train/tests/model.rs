//! The Qwen2 model: parity with candle-transformers' qwen2 on the same weights (someone else's
//! code), every parameter receives a gradient, finite differences on a tiny f64 model, KV-cache
//! and padding consistency, save / load round trip, and clear errors for bad directories.

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use flashgrpo_candle::{loss_from_hidden, LossInputs, LossKind};
use flashgrpo_kernels::synthetic::{normal_matrix, Rng};
use flashgrpo_kernels::{ChunkBudget, LossOptions};
use flashgrpo_train::model::{generate, load_model, save_model, Qwen2, Qwen2Config, Sampling};

struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("flashgrpo-model-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tiny(tied: bool) -> Qwen2Config {
    let mut c = Qwen2Config::tiny(97, 32, 2, 4, 2);
    c.tie_word_embeddings = tied;
    c.intermediate_size = 48;
    c.max_position_embeddings = 64;
    c
}

/// A random model whose parameters are all non-trivial (norm weights and biases too).
fn model(tied: bool, dtype: DType, seed: u64) -> Qwen2 {
    let m = Qwen2::random(tiny(tied), dtype, seed).unwrap();
    for (i, (name, var)) in m.params.iter().enumerate() {
        if name.ends_with("norm.weight") || name.ends_with(".bias") {
            let n = var.elem_count();
            let base = if name.ends_with("norm.weight") { 1.0 } else { 0.0 };
            let v: Vec<f32> = normal_matrix(1, n, 0.1, 1000 + i as u64).into_iter().map(|x| x + base).collect();
            var.set(&Tensor::from_vec(v, var.dims(), &Device::Cpu).unwrap().to_dtype(dtype).unwrap()).unwrap();
        }
    }
    m
}

fn ids(b: usize, t: usize, seed: u64) -> Tensor {
    let mut rng = Rng::new(seed);
    let v: Vec<u32> = (0..b * t).map(|_| rng.below(97) as u32).collect();
    Tensor::from_vec(v, (b, t), &Device::Cpu).unwrap()
}

fn max_rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    let a: Vec<f64> = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let b: Vec<f64> = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let scale = b.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-12);
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max) / scale
}

#[test]
fn matches_candle_transformers_qwen2() {
    for tied in [true, false] {
        let dir = Dir::new(&format!("parity-{tied}"));
        let ours = model(tied, DType::F32, 1);
        save_model(&ours, &dir.0, None).unwrap();
        let cfg: candle_transformers::models::qwen2::Config =
            serde_json::from_str(&std::fs::read_to_string(dir.0.join("config.json")).unwrap()).unwrap();
        // SAFETY: the file was just written by this test and is not modified while mapped.
        let vb = unsafe {
            candle_nn::VarBuilder::from_mmaped_safetensors(&[dir.0.join("model.safetensors")], DType::F32, &Device::Cpu)
                .unwrap()
        };
        let mut theirs = candle_transformers::models::qwen2::Model::new(&cfg, vb).unwrap();
        let x = ids(2, 9, 2);
        let want = theirs.forward(&x, 0, None).unwrap();
        let got = ours.hidden_states(&x, None, false).unwrap();
        let d = max_rel_diff(&got, &want);
        assert!(d < 1e-5, "hidden states differ by {d} (tied = {tied})");
        let lm = ours.lm_head().as_tensor().clone();
        let want_logits = want.broadcast_matmul(&lm.t().unwrap()).unwrap();
        let d = max_rel_diff(&ours.logits(&got).unwrap(), &want_logits);
        assert!(d < 1e-5, "logits differ by {d}");
    }
}

#[test]
fn every_parameter_receives_a_gradient() {
    for tied in [true, false] {
        let m = model(tied, DType::F32, 3);
        let (b, t) = (2, 7);
        let x = ids(b, t, 4);
        let mask: Vec<u8> = (0..b * t).map(|i| u8::from(i % t < 5 || i < t)).collect();
        let hidden = m.hidden_states(&x, Some(&mask), true).unwrap();
        let inputs = Arc::new(LossInputs {
            kind: LossKind::CrossEntropy { class_weights: None },
            batch: b,
            seq_len: t,
            targets: Some(x.flatten_all().unwrap().to_vec1::<u32>().unwrap().into_iter().map(i64::from).collect()),
            mask: Some(mask.iter().map(|&m| m as f32).collect()),
            options: LossOptions::default(),
            budget: ChunkBudget::default(),
            batch_shard: None,
        });
        let out = loss_from_hidden(&hidden, m.lm_head().as_tensor(), None, &inputs).unwrap();
        let grads = out.loss.backward().unwrap();
        for (name, var) in m.params.iter() {
            let g = grads.get(var).unwrap_or_else(|| panic!("{name} received no gradient"));
            let norm = g.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(norm > 0.0 && norm.is_finite(), "{name}: gradient norm {norm}");
        }
    }
}

#[test]
fn gradients_match_finite_differences_on_a_tiny_f64_model() {
    let m = model(false, DType::F64, 5);
    let x = ids(2, 5, 6);
    let mask: Vec<u8> = vec![1, 1, 1, 1, 1, 1, 1, 1, 0, 0];
    let r: Vec<f64> = normal_matrix(1, 2 * 5 * 32, 1.0, 7).into_iter().map(f64::from).collect();
    let r = Tensor::from_vec(r, (2, 5, 32), &Device::Cpu).unwrap();
    let objective = |track: bool| -> Tensor {
        let h = m.hidden_states(&x, Some(&mask), track).unwrap();
        (h * &r).unwrap().sum_all().unwrap()
    };
    let grads = objective(true).backward().unwrap();
    let eps = 1e-6;
    // The hidden states do not use the (untied) lm_head.
    for (name, var) in m.params.iter().filter(|(n, _)| *n != "lm_head.weight") {
        let g: Vec<f64> = grads.get(var).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let base: Vec<f64> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        // A few elements of every parameter.
        for k in [0, base.len() / 3, base.len() - 1] {
            let at = |d: f64| {
                let mut v = base.clone();
                v[k] += d;
                var.set(&Tensor::from_vec(v, var.dims(), &Device::Cpu).unwrap()).unwrap();
                let f = objective(false).to_scalar::<f64>().unwrap();
                var.set(&Tensor::from_vec(base.clone(), var.dims(), &Device::Cpu).unwrap()).unwrap();
                f
            };
            let numeric = (at(eps) - at(-eps)) / (2.0 * eps);
            assert!((numeric - g[k]).abs() < 1e-6 * g[k].abs().max(1.0), "{name}[{k}]: {numeric} vs {}", g[k]);
        }
    }
}

#[test]
fn kv_cache_and_padding_agree_with_the_full_forward() {
    let m = model(true, DType::F32, 8);
    // Greedy generation with a cache, then one full forward over prompt + completion: the full
    // forward's argmax at each position must reproduce the generated tokens.
    let prompts = vec![vec![5u32, 17, 3, 44], vec![9u32, 2]];
    let s = Sampling { temperature: 0.0, max_new_tokens: 6, ..Default::default() };
    let out = generate(&m, &prompts, &s, &[], 0, &mut Rng::new(1)).unwrap();
    for (p, c) in prompts.iter().zip(&out.completions) {
        assert_eq!(c.len(), 6);
        let full: Vec<u32> = p.iter().chain(c).copied().collect();
        let x = Tensor::from_vec(full.clone(), (1, full.len()), &Device::Cpu).unwrap();
        let logits: Vec<Vec<f32>> =
            m.logits(&m.hidden_states(&x, None, false).unwrap()).unwrap().squeeze(0).unwrap().to_vec2().unwrap();
        for (i, &token) in c.iter().enumerate() {
            let row = &logits[p.len() - 1 + i];
            let best = row.iter().enumerate().fold((0, f32::MIN), |b, (j, &v)| if v > b.1 { (j, v) } else { b }).0;
            assert_eq!(best as u32, token, "position {i}");
        }
    }
    // Right padding leaves the real tokens' hidden states unchanged.
    let x = Tensor::from_vec(vec![5u32, 17, 3, 44, 0, 0], (1, 6), &Device::Cpu).unwrap();
    let padded = m.hidden_states(&x, Some(&[1, 1, 1, 1, 0, 0]), false).unwrap().narrow(1, 0, 4).unwrap();
    let plain = m.hidden_states(&x.narrow(1, 0, 4).unwrap(), None, false).unwrap();
    assert!(max_rel_diff(&padded, &plain) < 1e-6);
    // Generation stops at end-of-sequence.
    let c = &out.completions[0];
    let k = (0..c.len())
        .find(|&k| !c[..k].contains(&c[k]))
        .map_or(0, |_| (1..c.len()).find(|&k| !c[..k].contains(&c[k])).unwrap_or(0));
    let stopped = generate(&m, &prompts[..1], &s, &[c[k]], 0, &mut Rng::new(1)).unwrap();
    assert_eq!(stopped.completions[0], c[..=k].to_vec());
    assert!(stopped.finished[0]);
}

#[test]
fn save_and_load_round_trip_in_the_hugging_face_layout() {
    for tied in [true, false] {
        let dir = Dir::new(&format!("roundtrip-{tied}"));
        let m = model(tied, DType::F32, 9);
        save_model(&m, &dir.0, None).unwrap();
        let names: Vec<String> = candle_core::safetensors::load(dir.0.join("model.safetensors"), &Device::Cpu)
            .unwrap()
            .into_keys()
            .collect();
        assert_eq!(names.contains(&"lm_head.weight".to_string()), !tied);
        assert!(names.contains(&"model.layers.1.self_attn.k_proj.bias".to_string()));
        let back = load_model(&dir.0, None).unwrap();
        let x = ids(1, 5, 10);
        assert_eq!(
            max_rel_diff(&back.hidden_states(&x, None, false).unwrap(), &m.hidden_states(&x, None, false).unwrap()),
            0.0
        );
        let bf = load_model(&dir.0, Some(DType::BF16)).unwrap();
        assert_eq!(bf.dtype(), DType::BF16);
        assert!(
            max_rel_diff(&bf.hidden_states(&x, None, false).unwrap(), &m.hidden_states(&x, None, false).unwrap())
                < 0.05
        );
    }
}

#[test]
fn bad_model_directories_are_named() {
    let dir = Dir::new("bad");
    let err = |d: &std::path::Path| load_model(d, None).err().expect("an error").to_string();
    assert!(err(&dir.0).contains("has no config.json"));
    let m = model(true, DType::F32, 11);
    save_model(&m, &dir.0, None).unwrap();
    std::fs::remove_file(dir.0.join("model.safetensors")).unwrap();
    assert!(err(&dir.0).contains("has no model.safetensors"));
    save_model(&m, &dir.0, None).unwrap();
    let config = std::fs::read_to_string(dir.0.join("config.json")).unwrap();
    std::fs::write(dir.0.join("config.json"), config.replace("\"qwen2\"", "\"llama\"")).unwrap();
    assert!(err(&dir.0).contains("unsupported architecture"));
    std::fs::write(dir.0.join("config.json"), config.replace("\"intermediate_size\": 48", "\"intermediate_size\": 40"))
        .unwrap();
    let e = err(&dir.0);
    assert!(
        e.contains("model.layers.0.mlp.gate_proj.weight") && e.contains("model.safetensors") && e.contains("[48, 32]"),
        "{e}"
    );
    std::fs::write(dir.0.join("config.json"), config.replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 3"))
        .unwrap();
    let e = err(&dir.0);
    assert!(e.contains("model.layers.2") && e.contains("missing"), "{e}");
    let _ = Var::from_tensor(&Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap());
}

/// `config.json` as real checkpoints write it: another architecture named as such before any of
/// its fields is read (a VL model's RoPE, a non-Qwen config's missing fields), a quantized one
/// refused, `num_key_value_heads` defaulting to the heads (transformers' default), and a
/// transformers >= 4.56 `dtype` key rewritten to the saved model's dtype.
#[test]
fn config_json_as_real_checkpoints_write_it() {
    let dir = Dir::new("configs");
    let m = model(true, DType::F32, 12);
    save_model(&m, &dir.0, None).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.0.join("config.json")).unwrap()).unwrap();
    let write = |c: &serde_json::Value| std::fs::write(dir.0.join("config.json"), c.to_string()).unwrap();
    let err = || load_model(&dir.0, None).err().expect("an error").to_string();
    let mut vl = config.clone();
    vl["model_type"] = "qwen2_5_vl".into();
    vl["rope_scaling"] = serde_json::json!({"type": "mrope", "mrope_section": [16, 24, 24]});
    assert!(err_of(&write, &vl, &err).contains("unsupported architecture"));
    let llama = serde_json::json!({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 97});
    assert!(err_of(&write, &llama, &err).contains("unsupported architecture"));
    let mut quantized = config.clone();
    quantized["quantization_config"] = serde_json::json!({"quant_method": "gptq", "bits": 4});
    assert!(err_of(&write, &quantized, &err).contains("quantization_config"));
    let mut mha = config.clone();
    mha.as_object_mut().unwrap().remove("num_key_value_heads");
    mha["num_attention_heads"] = 2.into();
    write(&mha);
    let loaded = flashgrpo_train::model::load_config(&dir.0).unwrap();
    assert_eq!((loaded.num_attention_heads, loaded.num_key_value_heads), (2, 2));
    let mut newer = config.clone();
    newer["dtype"] = "bfloat16".into();
    write(&newer);
    let bf = load_model(&dir.0, Some(DType::F32)).unwrap();
    let out = Dir::new("configs-out");
    save_model(&bf, &out.0, None).unwrap();
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.0.join("config.json")).unwrap()).unwrap();
    assert_eq!((saved["dtype"].as_str(), saved["torch_dtype"].as_str()), (Some("float32"), Some("float32")));
}

fn err_of(write: &dyn Fn(&serde_json::Value), config: &serde_json::Value, err: &dyn Fn() -> String) -> String {
    write(config);
    err()
}
