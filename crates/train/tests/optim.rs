//! AdamW against an f64 transcription of PyTorch's documented algorithm, master weights for bf16
//! parameters, state save / load, clipping, and the skip of non-finite windows.

use candle_core::{DType, Device, Tensor, Var};
use flashgrpo_kernels::synthetic::{normal_matrix, Rng};
use flashgrpo_train::model::Params;
use flashgrpo_train::optim::{AdamW, AdamWConfig, GradBuffers, OptimConfig, Updater};

fn params(dtype: DType) -> Params {
    let w = Tensor::from_vec(normal_matrix(6, 5, 0.5, 1), (6, 5), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
    let b = Tensor::from_vec(normal_matrix(1, 6, 0.5, 2), 6, &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
    Params::new(vec![("w".into(), Var::from_tensor(&w).unwrap()), ("b".into(), Var::from_tensor(&b).unwrap())])
}

fn values(v: &Var) -> Vec<f64> {
    v.as_tensor().to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

/// PyTorch's AdamW (torch.optim.AdamW documentation), in f64.
struct Reference {
    theta: Vec<f64>,
    m: Vec<f64>,
    v: Vec<f64>,
    t: i32,
}

impl Reference {
    #[allow(clippy::needless_range_loop)] // the documented algorithm, index by index
    fn step(&mut self, g: &[f64], lr: f64, c: &AdamWConfig, decay: bool) {
        self.t += 1;
        for i in 0..self.theta.len() {
            if decay {
                self.theta[i] -= lr * c.weight_decay * self.theta[i];
            }
            self.m[i] = c.beta1 * self.m[i] + (1.0 - c.beta1) * g[i];
            self.v[i] = c.beta2 * self.v[i] + (1.0 - c.beta2) * g[i] * g[i];
            let m_hat = self.m[i] / (1.0 - c.beta1.powi(self.t));
            let v_hat = self.v[i] / (1.0 - c.beta2.powi(self.t));
            self.theta[i] -= lr * m_hat / (v_hat.sqrt() + c.eps);
        }
    }
}

/// Gradients as a backward would give them: a loss `sum(w * gw) + sum(b * gb)`.
fn grads_of(p: &Params, rng: &mut Rng, scale: f64) -> (GradBuffers, Vec<Vec<f64>>) {
    let mut buffers = GradBuffers::new(p);
    let mut loss = Tensor::new(0f32, &Device::Cpu).unwrap();
    let mut expected = Vec::new();
    for (_, var) in p.iter() {
        let g: Vec<f32> = (0..var.elem_count()).map(|_| (rng.normal() * scale) as f32).collect();
        expected.push(g.iter().map(|&x| x as f64).collect());
        let gt = Tensor::from_vec(g, var.shape(), &Device::Cpu).unwrap();
        let term = (var.as_tensor().to_dtype(DType::F32).unwrap() * gt).unwrap().sum_all().unwrap();
        loss = (loss + term).unwrap();
    }
    buffers.add(p, &loss.backward().unwrap()).unwrap();
    (buffers, expected)
}

#[test]
fn adamw_matches_pytorch_algorithm_with_decay_on_matrices_only() {
    let p = params(DType::F32);
    let c = AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
    let mut opt = AdamW::new(&p, c).unwrap();
    let mut refs: Vec<Reference> = p
        .iter()
        .map(|(_, v)| {
            let theta = values(v);
            let n = theta.len();
            Reference { theta, m: vec![0.0; n], v: vec![0.0; n], t: 0 }
        })
        .collect();
    let mut rng = Rng::new(7);
    for step in 0..5 {
        let lr = 1e-2 * (step + 1) as f64;
        let (g, expected) = grads_of(&p, &mut rng, 1.0 + step as f64);
        opt.step(&p, &g, lr).unwrap();
        for (((_, var), r), e) in p.iter().zip(&mut refs).zip(&expected) {
            r.step(e, lr, &c, var.rank() >= 2);
            for (a, b) in values(var).iter().zip(&r.theta) {
                assert!((a - b).abs() <= 1e-5 * b.abs().max(1e-2), "step {step}: {a} vs {b}");
            }
        }
    }
}

#[test]
fn bf16_parameters_keep_f32_masters_and_state_round_trips() {
    let p = params(DType::BF16);
    let c = AdamWConfig::default();
    let mut opt = AdamW::new(&p, c).unwrap();
    let before = values(p.var("w").unwrap());
    // The same gradient every step: Adam moves each weight by about lr = 1e-4 a step, below half
    // of bf16's spacing (2^-9 = 2e-3 near 0.5): a bf16-only update would round every step away;
    // the masters accumulate them.
    for _ in 0..40 {
        let (g, _) = grads_of(&p, &mut Rng::new(3), 1.0);
        opt.step(&p, &g, 1e-4).unwrap();
    }
    let after = values(p.var("w").unwrap());
    let moved = before.iter().zip(&after).filter(|(a, b)| a != b).count();
    assert!(moved > 0, "40 steps of 1e-4 must move some bf16 weights through the f32 masters");
    assert!(after.iter().all(|x| (*x as f32) == half::bf16::from_f32(*x as f32).to_f32()));

    // Saving and loading the state continues bit for bit.
    let dir = std::env::temp_dir().join(format!("flashgrpo-adamw-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("optimizer.safetensors");
    opt.save(&p, &path).unwrap();
    let twin = params(DType::BF16);
    for ((_, a), (_, b)) in twin.iter().zip(p.iter()) {
        a.set(b.as_tensor()).unwrap();
    }
    let mut resumed = AdamW::load(&twin, c, &path).unwrap();
    assert_eq!(resumed.steps, 40);
    let (g, _) = grads_of(&p, &mut Rng::new(99), 1.0);
    let (g2, _) = grads_of(&twin, &mut Rng::new(99), 1.0);
    opt.step(&p, &g, 1e-3).unwrap();
    resumed.step(&twin, &g2, 1e-3).unwrap();
    for ((_, a), (_, b)) in twin.iter().zip(p.iter()) {
        assert_eq!(values(a), values(b));
    }
    let missing = dir.join("none.safetensors");
    assert!(AdamW::load(&twin, c, &missing).err().unwrap().to_string().contains("none.safetensors"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn clipping_matches_torch_and_non_finite_windows_are_skipped() {
    let p = params(DType::F32);
    let mut rng = Rng::new(5);
    let (mut g, expected) = grads_of(&p, &mut rng, 10.0);
    let norm: f64 = expected.iter().flatten().map(|x| x * x).sum::<f64>().sqrt();
    assert!((g.global_norm() - norm).abs() < 1e-9 * norm);
    let before = g.clip(1.0);
    assert!((before - norm).abs() < 1e-9 * norm);
    assert!((g.global_norm() - norm / (norm + 1e-6)).abs() < 1e-6);

    let config = OptimConfig { lr: 0.1, ..OptimConfig::default() };
    let mut updater = Updater::new(&p, config, 10).unwrap();
    let w0 = values(p.var("w").unwrap());
    let nan = (p.var("w").unwrap().as_tensor().sum_all().unwrap() * f64::NAN).unwrap();
    updater.accumulate(&p, &nan).unwrap();
    let report = updater.step(&p).unwrap();
    assert!(report.skipped && updater.skipped == 1);
    assert_eq!(values(p.var("w").unwrap()), w0, "a skipped window must not touch the weights");
    // The next finite window is applied.
    let fine = p.var("w").unwrap().as_tensor().sum_all().unwrap();
    updater.accumulate(&p, &fine).unwrap();
    assert!(!updater.step(&p).unwrap().skipped);
    assert_ne!(values(p.var("w").unwrap()), w0);
}
