//! `flashgrpo loss` end to end: tensors written by another writer, outputs read back and
//! checked against the f64 reference, and every kind of bad input.

use std::path::{Path, PathBuf};
use std::process::Command;

use flashgrpo_kernels::reference::ReferenceOutput;
use flashgrpo_kernels::synthetic::SyntheticSpec;
use flashgrpo_kernels::{reference, Loss, LossOptions, LossSpec, PolicyInputs, Reduction, Rows};
use half::bf16;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_flashgrpo"))
}

struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("flashgrpo-cli-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
    fn path(&self, f: &str) -> PathBuf {
        self.0.join(f)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct T {
    name: &'static str,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

fn f32s(name: &'static str, shape: Vec<usize>, v: &[f32]) -> T {
    T { name, dtype: Dtype::F32, shape, bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect() }
}

fn write(path: &Path, tensors: &[T]) {
    let views: Vec<_> =
        tensors.iter().map(|t| (t.name, TensorView::new(t.dtype, t.shape.clone(), &t.bytes).unwrap())).collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn read_f32(bytes: &[u8], name: &str) -> (Vec<f32>, Vec<usize>) {
    let st = SafeTensors::deserialize(bytes).unwrap();
    let v = st.tensor(name).unwrap_or_else(|_| panic!("output has no `{name}`"));
    let vals = match v.dtype() {
        Dtype::F32 => v.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
        Dtype::BF16 => v.data().chunks_exact(2).map(|c| bf16::from_le_bytes(c.try_into().unwrap()).to_f32()).collect(),
        other => panic!("unexpected dtype {other:?}"),
    };
    (vals, v.shape().to_vec())
}

const B: usize = 2;
const L: usize = 3;
const V: usize = 50;

fn grpo_inputs(dir: &Dir, logits_dtype: Dtype) -> (PathBuf, flashgrpo_kernels::synthetic::SyntheticBatch) {
    let data =
        SyntheticSpec { batch: B, seq_len: L, vocab: V, seed: 7, logit_std: 2.5, logp_noise: 0.3, mask_fraction: 0.3 }
            .generate();
    let logits = match logits_dtype {
        Dtype::BF16 => T {
            name: "logits",
            dtype: Dtype::BF16,
            shape: vec![B, L, V],
            bytes: data.logits.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect(),
        },
        _ => f32s("logits", vec![B, L, V], &data.logits),
    };
    let path = dir.path("in.safetensors");
    write(
        &path,
        &[
            logits,
            T {
                name: "targets",
                dtype: Dtype::I32,
                shape: vec![B, L],
                bytes: data.targets.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect(),
            },
            T {
                name: "mask",
                dtype: Dtype::U8,
                shape: vec![B, L],
                bytes: data.mask.iter().map(|&m| m as u8).collect(),
            },
            f32s("advantages", vec![B], &data.advantages),
            f32s("old_logp", vec![B, L], &data.old_logp),
            f32s("ref_logp", vec![B, L], &data.ref_logp),
        ],
    );
    (path, data)
}

#[test]
fn grpo_outputs_match_the_reference_in_every_impl_and_dtype() {
    let dir = Dir::new("grpo");
    for dtype in [Dtype::F32, Dtype::BF16] {
        let (input, data) = grpo_inputs(&dir, dtype);
        let logits64: Vec<f64> = data
            .logits
            .iter()
            .map(|&x| if dtype == Dtype::BF16 { bf16::from_f32(x).to_f64() } else { x as f64 })
            .collect();
        let options = LossOptions {
            beta: 0.04,
            epsilon_high: Some(0.28),
            loss_type: flashgrpo_kernels::LossType::Grpo,
            ..Default::default()
        };
        let spec = LossSpec {
            loss: Loss::Grpo(PolicyInputs {
                advantages: &data.advantages,
                old_logp: Some(&data.old_logp),
                ref_logp: Some(&data.ref_logp),
                is_ratio: None,
                sampling_logp: None,
            }),
            rows: Rows { batch: B, seq_len: L, vocab: V, targets: Some(&data.targets), mask: Some(&data.mask) },
            options: &options,
            batch_shard: None,
        };
        let want = reference::evaluate(spec, &logits64).unwrap();
        for imp in ["reference", "fused", "fused-inplace"] {
            let out = dir.path("out.safetensors");
            let status = bin()
                .args(["loss", "--op", "grpo", "--impl", imp, "--set", "beta=0.04", "--set", "epsilon_high=0.28"])
                .args(["--set", "loss_type=grpo", "--inputs"])
                .arg(&input)
                .arg("--out")
                .arg(&out)
                .status()
                .unwrap();
            assert!(status.success(), "{imp}");
            let bytes = std::fs::read(&out).unwrap();
            let (loss, shape) = read_f32(&bytes, "loss");
            assert!(shape.is_empty());
            assert!((loss[0] as f64 - want.loss).abs() < 1e-6 * want.loss.abs().max(1.0), "{imp} {dtype:?}");
            for (name, w) in [
                ("per_token_loss", &want.per_token_loss),
                ("logp", want.logp.as_ref().unwrap()),
                ("entropy", &want.entropy),
                ("kl", want.kl.as_ref().unwrap()),
                ("is_clipped", want.is_clipped.as_ref().unwrap()),
            ] {
                let (v, shape) = read_f32(&bytes, name);
                assert_eq!(shape, vec![B, L], "{name}");
                for (a, b) in v.iter().zip(w.iter()) {
                    assert!((*a as f64 - b).abs() <= 1e-5 * b.abs().max(1.0), "{name} {imp} {dtype:?}: {a} vs {b}");
                }
            }
            let st = SafeTensors::deserialize(&bytes).unwrap();
            assert_eq!(st.tensor("grad_logits").unwrap().dtype(), dtype, "gradient in the logits dtype");
            let (g, shape) = read_f32(&bytes, "grad_logits");
            assert_eq!(shape, vec![B, L, V]);
            let g_ref = want.grad.as_ref().unwrap();
            let err: f64 = g.iter().zip(g_ref).map(|(a, b)| (*a as f64 - b).powi(2)).sum::<f64>().sqrt()
                / g_ref.iter().map(|b| b * b).sum::<f64>().sqrt();
            assert!(err < if dtype == Dtype::F32 { 1e-5 } else { 1e-2 }, "{imp} {dtype:?} grad err {err}");
        }
    }
}

#[test]
fn every_op_writes_its_outputs() {
    let dir = Dir::new("ops");
    let (input, _) = grpo_inputs(&dir, Dtype::F32);
    for (op, present, absent) in [
        ("cross_entropy", vec!["loss", "per_token_loss", "logp", "entropy", "grad_logits"], vec!["kl", "is_clipped"]),
        ("logprob", vec!["loss", "per_token_loss", "logp", "entropy", "grad_logits"], vec!["kl"]),
        ("entropy", vec!["loss", "per_token_loss", "entropy", "logp"], vec!["grad_logits"]),
        ("grpo", vec!["loss", "kl", "is_clipped", "grad_logits"], vec![]),
    ] {
        let out = dir.path(&format!("{op}.safetensors"));
        let o = bin().args(["loss", "--op", op, "--inputs"]).arg(&input).arg("--out").arg(&out).output().unwrap();
        assert!(o.status.success(), "{op}: {}", String::from_utf8_lossy(&o.stderr));
        let bytes = std::fs::read(&out).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for name in present {
            assert!(st.tensor(name).is_ok(), "{op} lacks {name}");
        }
        for name in absent {
            assert!(st.tensor(name).is_err(), "{op} has {name}");
        }
    }
}

/// `--set predicted_tokens=true`: an i64 `predicted_tokens [B, T]`, each row's first argmax, -1 on
/// masked rows, in every impl (the reference's own argmax included); absent without it.
#[test]
fn predicted_tokens_are_written_as_i64() {
    let dir = Dir::new("predicted");
    let (input, data) = grpo_inputs(&dir, Dtype::BF16);
    let want: Vec<i64> = (0..B * L)
        .map(|i| {
            if data.mask[i] == 0.0 {
                return -1;
            }
            let row: Vec<f32> = data.logits[i * V..(i + 1) * V].iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
            (0..V).fold(0, |best, j| if row[j] > row[best] { j } else { best }) as i64
        })
        .collect();
    for imp in ["reference", "fused", "fused-inplace"] {
        let out = dir.path("out.safetensors");
        let run = |sets: &[&str]| {
            let mut cmd = bin();
            cmd.args(["loss", "--op", "grpo", "--impl", imp]);
            for set in sets {
                cmd.args(["--set", set]);
            }
            let o = cmd.arg("--inputs").arg(&input).arg("--out").arg(&out).output().unwrap();
            assert!(o.status.success(), "{imp}: {}", String::from_utf8_lossy(&o.stderr));
            std::fs::read(&out).unwrap()
        };
        let bytes = run(&["predicted_tokens=true"]);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let t = st.tensor("predicted_tokens").unwrap();
        assert_eq!((t.dtype(), t.shape()), (Dtype::I64, &[B, L][..]), "{imp}");
        let got: Vec<i64> = t.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(got, want, "{imp}");
        let bytes = run(&[]);
        assert!(SafeTensors::deserialize(&bytes).unwrap().tensor("predicted_tokens").is_err(), "{imp}");
    }
}

/// `flashgrpo loss --op OP --impl IMP --set SETS...` on `input`: its loss (to 1e-6) and
/// `grad_logits` (to 1e-5 in relative norm) are the f64 reference's `want`.
fn assert_cli_matches_reference(dir: &Dir, input: &Path, op: &str, imp: &str, sets: &[&str], want: &ReferenceOutput) {
    let out = dir.path("out.safetensors");
    let mut cmd = bin();
    cmd.args(["loss", "--op", op, "--impl", imp]);
    for set in sets {
        cmd.args(["--set", set]);
    }
    let o = cmd.arg("--inputs").arg(input).arg("--out").arg(&out).output().unwrap();
    let what = format!("{op} {imp} {sets:?}");
    assert!(o.status.success(), "{what}: {}", String::from_utf8_lossy(&o.stderr));
    let bytes = std::fs::read(&out).unwrap();
    let (loss, _) = read_f32(&bytes, "loss");
    assert!(
        (loss[0] as f64 - want.loss).abs() < 1e-6 * want.loss.abs().max(1.0),
        "{what}: {} vs {}",
        loss[0],
        want.loss
    );
    let (g, _) = read_f32(&bytes, "grad_logits");
    let g_ref = want.grad.as_ref().unwrap();
    let err: f64 = g.iter().zip(g_ref).map(|(a, b)| (*a as f64 - b).powi(2)).sum::<f64>().sqrt()
        / g_ref.iter().map(|b| b * b).sum::<f64>().sqrt();
    assert!(err < 1e-5, "{what}: gradient error {err}");
}

/// `--set entropy_gradient=true`: the entropy op writes its gradient (of the mean entropy, or
/// with `reduction=sum` of the sum), as the f64 reference's; without it, no gradient.
#[test]
fn the_entropy_gradient_is_written_when_asked_for() {
    let dir = Dir::new("entropy-gradient");
    let (input, data) = grpo_inputs(&dir, Dtype::F32);
    for reduction in [Reduction::Mean, Reduction::Sum] {
        let options = LossOptions { entropy_gradient: true, temperature: 0.8, reduction, ..Default::default() };
        let rows = Rows { batch: B, seq_len: L, vocab: V, targets: Some(&data.targets), mask: Some(&data.mask) };
        let spec = LossSpec { loss: Loss::Entropy, rows, options: &options, batch_shard: None };
        let logits64: Vec<f64> = data.logits.iter().map(|&x| x as f64).collect();
        let want = reference::evaluate(spec, &logits64).unwrap();
        let reduction = if reduction == Reduction::Sum { "reduction=sum" } else { "reduction=mean" };
        let sets = ["entropy_gradient=true", "temperature=0.8", reduction];
        for imp in ["reference", "fused", "fused-inplace"] {
            assert_cli_matches_reference(&dir, &input, "entropy", imp, &sets, &want);
        }
    }
    let out = dir.path("none.safetensors");
    let o = bin().args(["loss", "--op", "entropy", "--inputs"]).arg(&input).arg("--out").arg(&out).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let bytes = std::fs::read(&out).unwrap();
    assert!(SafeTensors::deserialize(&bytes).unwrap().tensor("grad_logits").is_err(), "no gradient without it");
}

/// `class_weights [V]` (cross-entropy): the reference's loss and gradient with the weights, in
/// every impl, with label smoothing; on another op, or of the wrong length, a named error.
#[test]
fn class_weights_are_read_for_cross_entropy() {
    let dir = Dir::new("class-weights");
    let (plain, data) = grpo_inputs(&dir, Dtype::F32);
    let weights: Vec<f32> = (0..V).map(|j| 0.25 + (j % 5) as f32 * 0.4).collect();
    let input = dir.path("weighted.safetensors");
    let bytes = std::fs::read(&plain).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let copy = |name: &'static str| {
        let t = st.tensor(name).unwrap();
        T { name, dtype: t.dtype(), shape: t.shape().to_vec(), bytes: t.data().to_vec() }
    };
    write(&input, &[copy("logits"), copy("targets"), copy("mask"), f32s("class_weights", vec![V], &weights)]);
    let options = LossOptions { label_smoothing: 0.1, z_loss: 1e-3, ..Default::default() };
    let spec = LossSpec {
        loss: Loss::CrossEntropy(flashgrpo_kernels::CrossEntropyInputs { class_weights: Some(&weights) }),
        rows: Rows { batch: B, seq_len: L, vocab: V, targets: Some(&data.targets), mask: Some(&data.mask) },
        options: &options,
        batch_shard: None,
    };
    let logits64: Vec<f64> = data.logits.iter().map(|&x| x as f64).collect();
    let want = reference::evaluate(spec, &logits64).unwrap();
    for imp in ["reference", "fused", "fused-inplace"] {
        assert_cli_matches_reference(
            &dir,
            &input,
            "cross_entropy",
            imp,
            &["label_smoothing=0.1", "z_loss=1e-3"],
            &want,
        );
    }
    let e = fails(
        &dir,
        "grpo",
        &[
            copy("logits"),
            copy("targets"),
            f32s("advantages", vec![B], &[1.0, -1.0]),
            f32s("class_weights", vec![V], &weights),
        ],
        &[],
    );
    assert!(e.contains("class_weights") && e.contains("grpo"), "{e}");
    let e = fails(
        &dir,
        "cross_entropy",
        &[copy("logits"), copy("targets"), f32s("class_weights", vec![V - 1], &weights[1..])],
        &[],
    );
    assert!(e.contains("`class_weights` has shape [49]") && e.contains("[50]"), "{e}");
}

/// Runs `flashgrpo loss` expecting failure; returns stderr and checks no output was written.
fn fails(dir: &Dir, op: &str, tensors: &[T], sets: &[&str]) -> String {
    let input = dir.path("bad.safetensors");
    write(&input, tensors);
    let out = dir.path("never.safetensors");
    let mut cmd = bin();
    cmd.args(["loss", "--op", op, "--inputs"]).arg(&input).arg("--out").arg(&out);
    for s in sets {
        cmd.args(["--set", s]);
    }
    let o = cmd.output().unwrap();
    assert!(!o.status.success());
    assert!(!out.exists(), "an output file was written despite the error");
    assert!(std::fs::read_dir(&dir.0).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().contains(".tmp-")));
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn bad_input_is_a_clear_error_and_writes_nothing() {
    let dir = Dir::new("bad");
    let logits = vec![0.5f32; 2 * 3 * 4];
    let lg = || f32s("logits", vec![2, 3, 4], &logits);
    let ids = |v: &[i64], shape: Vec<usize>| T {
        name: "targets",
        dtype: Dtype::I64,
        shape,
        bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    };
    let good_ids = || ids(&[0, 1, 2, 3, 0, 1], vec![2, 3]);

    let e = fails(&dir, "cross_entropy", &[lg(), ids(&[0, 1, 2, 3, 0], vec![5])], &[]);
    assert!(e.contains("`targets` has shape [5]") && e.contains("`logits` has shape [2, 3, 4]"), "{e}");

    let e = fails(&dir, "cross_entropy", &[lg(), ids(&[0, 1, 2, 3, 9, 1], vec![2, 3])], &[]);
    assert!(e.contains("targets[1, 1] (row 4) = 9"), "{e}");

    let mut nan = logits.clone();
    nan[5 * 4 + 2] = f32::NAN;
    let e = fails(&dir, "logprob", &[f32s("logits", vec![2, 3, 4], &nan), good_ids()], &[]);
    assert!(e.contains("logits row 5 (b = 1, t = 2) contains NaN or Inf"), "{e}");

    let adv = f32s("advantages", vec![2], &[1.0, -1.0]);
    let e = fails(&dir, "grpo", &[lg(), good_ids(), adv], &["beta=0.04"]);
    assert!(e.contains("ref_logp"), "{e}");

    let e = fails(&dir, "grpo", &[lg(), good_ids()], &[]);
    assert!(e.contains("missing tensor `advantages`"), "{e}");

    let e = fails(&dir, "cross_entropy", &[lg()], &[]);
    assert!(e.contains("missing tensor `targets`"), "{e}");

    let e = fails(&dir, "cross_entropy", &[lg(), f32s("targets", vec![2, 3], &[0.0; 6])], &[]);
    assert!(e.contains("`targets`") && e.contains("dtype F32") && e.contains("I64 or I32"), "{e}");

    let e = fails(&dir, "cross_entropy", &[lg(), good_ids()], &["label_smothing=0.1"]);
    assert!(e.contains("unknown key `label_smothing`"), "{e}");

    let e = fails(&dir, "cross_entropy", &[lg(), good_ids()], &["reduction=average"]);
    assert!(e.contains("average"), "{e}");

    let e = fails(&dir, "grpo", &[lg(), good_ids(), f32s("advantages", vec![3], &[1.0; 3])], &[]);
    assert!(e.contains("`advantages` has shape [3]") && e.contains("[2]"), "{e}");

    let e = fails(&dir, "logprob", &[f32s("logits", vec![6, 4], &logits), good_ids()], &[]);
    assert!(e.contains("[B, T, V]"), "{e}");
}

#[test]
fn fused_linear_inputs_give_the_linear_gradients() {
    use flashgrpo_kernels::linear::reference as linear_reference;
    use flashgrpo_kernels::synthetic::normal_matrix;
    let dir = Dir::new("linear");
    let (h, v) = (16, 40);
    let hidden = normal_matrix(B * L, h, 1.0, 3);
    let weight = normal_matrix(v, h, 0.5, 4);
    let bias = normal_matrix(1, v, 0.5, 5);
    let data =
        SyntheticSpec { batch: B, seq_len: L, vocab: v, seed: 7, logit_std: 2.0, logp_noise: 0.3, mask_fraction: 0.3 }
            .generate();
    let input = dir.path("linear.safetensors");
    let ids = |v: &[i64]| T {
        name: "targets",
        dtype: Dtype::I64,
        shape: vec![B, L],
        bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    };
    write(
        &input,
        &[
            f32s("hidden", vec![B, L, h], &hidden),
            f32s("weight", vec![v, h], &weight),
            f32s("bias", vec![v], &bias),
            ids(&data.targets),
            f32s("mask", vec![B, L], &data.mask),
            f32s("advantages", vec![B], &data.advantages),
        ],
    );
    let to64 = |x: &[f32]| -> Vec<f64> { x.iter().map(|&v| v as f64).collect() };
    let options = LossOptions { loss_type: flashgrpo_kernels::LossType::Grpo, ..Default::default() };
    let spec = LossSpec {
        loss: Loss::Grpo(PolicyInputs::new(&data.advantages)),
        rows: Rows { batch: B, seq_len: L, vocab: v, targets: Some(&data.targets), mask: Some(&data.mask) },
        options: &options,
        batch_shard: None,
    };
    let want = linear_reference::evaluate(spec, &to64(&hidden), &to64(&weight), Some(&to64(&bias)), h).unwrap();
    for imp in ["fused", "reference"] {
        let out = dir.path("out.safetensors");
        let o = bin()
            .args([
                "loss",
                "--op",
                "grpo",
                "--impl",
                imp,
                "--set",
                "loss_type=grpo",
                "--set",
                "chunk_memory_mb=1",
                "--inputs",
            ])
            .arg(&input)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{imp}: {}", String::from_utf8_lossy(&o.stderr));
        let bytes = std::fs::read(&out).unwrap();
        assert!(SafeTensors::deserialize(&bytes).unwrap().tensor("grad_logits").is_err());
        let (loss, _) = read_f32(&bytes, "loss");
        assert!((loss[0] as f64 - want.output.loss).abs() < 1e-4 * want.output.loss.abs().max(1.0), "{imp}");
        for (name, shape, w) in [
            ("grad_hidden", vec![B, L, h], want.grad_hidden.as_ref().unwrap()),
            ("grad_weight", vec![v, h], want.grad_weight.as_ref().unwrap()),
            ("grad_bias", vec![v], want.grad_bias.as_ref().unwrap()),
        ] {
            let (g, s) = read_f32(&bytes, name);
            assert_eq!(s, shape, "{name}");
            let err: f64 = g.iter().zip(w.iter()).map(|(a, b)| (*a as f64 - b).powi(2)).sum::<f64>().sqrt()
                / w.iter().map(|b| b * b).sum::<f64>().sqrt();
            assert!(err < 1e-4, "{imp} {name}: {err}");
        }
    }
    // Bad combinations are named.
    let e = fails(
        &dir,
        "grpo",
        &[f32s("hidden", vec![B, L, h], &hidden), f32s("weight", vec![v, h + 1], &vec![0.0; v * (h + 1)])],
        &[],
    );
    assert!(e.contains("`weight` has shape [40, 17] but `hidden` has shape [2, 3, 16]"), "{e}");
    let logits = vec![0.0f32; B * L * v];
    let e = fails(
        &dir,
        "logprob",
        &[f32s("logits", vec![B, L, v], &logits), f32s("hidden", vec![B, L, h], &hidden), ids(&data.targets)],
        &[],
    );
    assert!(e.contains("either `logits` or `hidden` and `weight`"), "{e}");
    let bf = |name: &'static str, shape: Vec<usize>, x: &[f32]| T {
        name,
        dtype: Dtype::BF16,
        shape,
        bytes: x.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect(),
    };
    let e = fails(
        &dir,
        "logprob",
        &[f32s("hidden", vec![B, L, h], &hidden), bf("weight", vec![v, h], &weight), ids(&data.targets)],
        &[],
    );
    assert!(e.contains("give them one dtype"), "{e}");
    let input2 = dir.path("lin2.safetensors");
    write(&input2, &[f32s("hidden", vec![B, L, h], &hidden), f32s("weight", vec![v, h], &weight), ids(&data.targets)]);
    let o = bin()
        .args(["loss", "--op", "logprob", "--impl", "fused-inplace", "--inputs"])
        .arg(&input2)
        .arg("--out")
        .arg(dir.path("x.safetensors"))
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("with `hidden` and `weight` use `fused`"));
}

/// Unset, `bf16_products` follows every front end's rule: this command writes the gradients in
/// the inputs' dtype, so bf16 inputs run the `rounded` way (on a machine with one, the environment
/// naming none) and f32 inputs `auto`: the same bytes as naming that way.
#[test]
fn bf16_fused_linear_runs_rounded_unless_a_way_is_named() {
    use flashgrpo_kernels::matmul_bf16::{Bf16Choice, Bf16Products};
    use flashgrpo_kernels::synthetic::normal_matrix;
    let dir = Dir::new("linear-default-way");
    let (h, v) = (64, 300);
    let data =
        SyntheticSpec { batch: B, seq_len: L, vocab: v, seed: 9, logit_std: 2.0, logp_noise: 0.3, mask_fraction: 0.0 }
            .generate();
    let as_dtype = |name: &'static str, shape: Vec<usize>, x: &[f32], dtype: Dtype| match dtype {
        Dtype::BF16 => {
            T { name, dtype, shape, bytes: x.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect() }
        }
        _ => f32s(name, shape, x),
    };
    let rounded_here = Bf16Choice::parse("rounded").is_ok() && Bf16Products::named_by_environment().is_none();
    for (dtype, expected) in [(Dtype::BF16, if rounded_here { "rounded" } else { "auto" }), (Dtype::F32, "auto")] {
        let input = dir.path("in.safetensors");
        let targets = T {
            name: "targets",
            dtype: Dtype::I64,
            shape: vec![B, L],
            bytes: data.targets.iter().flat_map(|x| x.to_le_bytes()).collect(),
        };
        write(
            &input,
            &[
                as_dtype("hidden", vec![B, L, h], &normal_matrix(B * L, h, 1.0, 3), dtype),
                as_dtype("weight", vec![v, h], &normal_matrix(v, h, 0.3, 4), dtype),
                targets,
                f32s("advantages", vec![B], &data.advantages),
            ],
        );
        let run = |sets: &[&str]| {
            let out = dir.path("out.safetensors");
            let mut cmd = bin();
            cmd.args(["loss", "--op", "grpo", "--inputs"]).arg(&input).arg("--out").arg(&out);
            for s in sets {
                cmd.args(["--set", s]);
            }
            let o = cmd.output().unwrap();
            assert!(o.status.success(), "{sets:?}: {}", String::from_utf8_lossy(&o.stderr));
            let bytes = std::fs::read(&out).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            ["grad_hidden", "grad_weight"].map(|n| st.tensor(n).unwrap().data().to_vec())
        };
        let way = format!("bf16_products={expected}");
        assert_eq!(run(&[]), run(&[&way]), "{dtype:?}: unset should run {expected}");
    }
}

/// `--device cuda`: on a machine with a GPU, the same outputs as the CPU kernels (f32 and bf16,
/// out of place and in place); without one, a clear error and no output file.
#[test]
fn device_cuda_matches_the_cpu_or_says_why_not() {
    let dir = Dir::new("cuda");
    for dtype in [Dtype::F32, Dtype::BF16] {
        let (input, _) = grpo_inputs(&dir, dtype);
        let cpu_out = dir.path("cpu.safetensors");
        let o = bin()
            .args(["loss", "--op", "grpo", "--set", "beta=0.04", "--inputs"])
            .arg(&input)
            .arg("--out")
            .arg(&cpu_out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        for implementation in ["fused", "fused-inplace"] {
            let gpu_out = dir.path("gpu.safetensors");
            let _ = std::fs::remove_file(&gpu_out);
            let o = bin()
                .args(["loss", "--op", "grpo", "--set", "beta=0.04", "--device", "cuda", "--impl", implementation])
                .arg("--inputs")
                .arg(&input)
                .arg("--out")
                .arg(&gpu_out)
                .output()
                .unwrap();
            if !o.status.success() {
                let err = String::from_utf8_lossy(&o.stderr);
                assert!(err.contains("CUDA") || err.contains("NVRTC") || err.contains("cuda"), "{err}");
                assert!(!gpu_out.exists());
                continue;
            }
            let (cpu, gpu) = (std::fs::read(&cpu_out).unwrap(), std::fs::read(&gpu_out).unwrap());
            for name in ["loss", "per_token_loss", "logp", "entropy", "kl", "grad_logits"] {
                let (a, _) = read_f32(&cpu, name);
                let (b, _) = read_f32(&gpu, name);
                let tol = if dtype == Dtype::BF16 && name == "grad_logits" { 1e-2 } else { 1e-4 };
                for (x, y) in a.iter().zip(&b) {
                    assert!((x - y).abs() <= tol * (1.0 + x.abs()), "{name} {implementation} {dtype:?}: {x} vs {y}");
                }
            }
        }
    }
}
