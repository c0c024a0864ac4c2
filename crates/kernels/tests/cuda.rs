//! The CUDA backend against the f64 reference, on a machine with a GPU: every op and the main
//! options, ragged vocabularies, masked and fully masked rows, f32 / bf16 / f16 logits out of
//! place and in place, fused-linear (f32 and bf16, with and without bias, one chunk and many,
//! row-local and sequence-level objectives), and bitwise repeatability.
//!
//! Where there is no GPU (CI), each test checks that opening one fails with an error naming the
//! missing piece, and says so on stderr: these tests prove the GPU path only where one exists
//! (the device tool's GPU runs: `cargo test --release -p flashgrpo-kernels --features cuda
//! --no-run`, carry the `cuda-*` binary, run it there).
#![cfg(feature = "cuda")]

mod common;

use common::{linear_for, relative_norm_error, Case, Data, Linear, MaskKind, Op};
use flashgrpo_kernels::cuda::{CudaDevice, CudaElement, CudaLinearGradients, CudaLinearInputs, RowBlocks};
use flashgrpo_kernels::linear::reference as linear_reference;
use flashgrpo_kernels::{reference, ChunkBudget, ImportanceSamplingLevel, LossOutput, LossType, Reduction};
use half::{bf16, f16};

/// The GPU, or `None` after checking that the error says why there is none.
fn gpu() -> Option<CudaDevice> {
    match CudaDevice::new(0) {
        Ok(d) => Some(d),
        Err(e) => {
            let text = e.to_string();
            assert!(text.contains("CUDA") || text.contains("NVRTC"), "{text}");
            eprintln!("no GPU here ({text}): the CUDA comparisons did not run");
            None
        }
    }
}

/// The outputs within `tol` of the reference's (relative, or absolute below 1).
fn assert_outputs(got: &LossOutput, want: &reference::ReferenceOutput, tol: f64, name: &str) {
    assert!(
        (got.loss - want.loss).abs() <= tol * want.loss.abs().max(1e-2),
        "loss {} vs reference {} in {name}",
        got.loss,
        want.loss
    );
    let check = |what: &str, got: &[f32], want: &[f64]| {
        assert_eq!(got.len(), want.len(), "{what} length in {name}");
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!((g as f64 - w).abs() <= tol * w.abs().max(1.0), "{what}[{i}] = {g} vs reference {w} in {name}");
        }
    };
    check("per_token_loss", &got.per_token_loss, &want.per_token_loss);
    check("entropy", &got.entropy, &want.entropy);
    if let (Some(g), Some(w)) = (&got.logp, &want.logp) {
        check("logp", g, w);
    }
    if let (Some(g), Some(w)) = (&got.kl, &want.kl) {
        check("kl", g, w);
    }
    if let (Some(g), Some(w)) = (&got.is_clipped, &want.is_clipped) {
        check("is_clipped", g, w);
    }
}

/// Logits-level: out of place and in place, against the reference on the rounded logits.
fn check_logits<T: CudaElement>(gpu: &CudaDevice, data: &Data, grad_tol: f64) {
    let logits: Vec<T> = data.logits_as();
    let exact: Vec<f64> = logits.iter().map(|x| x.to_f32() as f64).collect();
    let want = reference::evaluate(data.spec(), &exact).unwrap();
    let name = format!("{:?} {:?}", data.case, T::DTYPE);
    let mut device_logits = gpu.upload(&logits).unwrap();
    if !data.spec().has_gradient() {
        let got = gpu.forward(data.spec(), &device_logits).unwrap();
        assert_outputs(&got, &want, 2e-5, &name);
        return;
    }
    let wanted_grad = want.grad.as_ref().unwrap();
    // NaN-filled: every element must be written.
    let mut grad = gpu.upload(&vec![T::from_f32(f32::NAN); logits.len()]).unwrap();
    let got = gpu.forward_backward(data.spec(), &mut device_logits, Some(&mut grad)).unwrap();
    assert_outputs(&got, &want, 2e-5, &name);
    let g: Vec<T> = gpu.download(&grad).unwrap();
    let err = relative_norm_error(g.iter().map(|x| x.to_f32() as f64), wanted_grad);
    assert!(err <= grad_tol, "gradient relative error {err} > {grad_tol} in {name}");
    assert_eq!(gpu.download(&device_logits).unwrap(), logits, "out of place must leave the logits in {name}");

    let got_in_place = gpu.forward_backward(data.spec(), &mut device_logits, None).unwrap();
    assert_eq!(got_in_place, got, "in place and out of place outputs differ in {name}");
    let in_place: Vec<T> = gpu.download(&device_logits).unwrap();
    assert!(in_place == g, "in place and out of place gradients differ in {name}");
}

#[test]
fn logits_every_op_dtype_and_shape_matches_the_reference() {
    let Some(mut gpu) = gpu() else { return };
    // Row-local objectives a few rows at a time (the blocks' boundaries at every alignment; 21
    // rows in blocks of 5 and a last of 1).
    gpu.row_blocks = RowBlocks { blocks: 5, min_rows: 1 };
    let grpo = |lt, level, v| {
        Case::new(Op::Grpo, 3, 7, v).with(|o| {
            o.loss_type = lt;
            o.importance_sampling_level = level;
            o.beta = 0.04;
            o.epsilon_high = Some(0.28);
            o.entropy_coef = 0.01;
            o.temperature = 0.9;
        })
    };
    let mut cases = Vec::new();
    // Odd vocabularies put rows at every alignment (scalar heads and tails around the 16-byte
    // body); 4100 and 8192 put every row, or every other, on a 16-byte boundary.
    for v in [1, 255, 4099, 4100, 8192, 32_003] {
        cases.push(grpo(LossType::Dapo, ImportanceSamplingLevel::Token, v));
    }
    cases.extend([
        grpo(LossType::Grpo, ImportanceSamplingLevel::Sequence, 1000),
        grpo(LossType::Bnpo, ImportanceSamplingLevel::Token, 1000),
        grpo(LossType::Sapo, ImportanceSamplingLevel::Token, 1000),
        grpo(LossType::Cispo, ImportanceSamplingLevel::Token, 1000).with(|o| o.epsilon_high = Some(1.2)),
        grpo(LossType::DrGrpo, ImportanceSamplingLevel::Sequence, 1000).with(|o| o.use_bias_correction_kl = true),
        Case::new(Op::CrossEntropy, 2, 6, 5003).with(|o| {
            o.label_smoothing = 0.1;
            o.z_loss = 1e-3;
        }),
        Case::new(Op::CrossEntropy, 2, 6, 777).with(|o| o.reduction = Reduction::Sum),
        Case::new(Op::Logprob, 2, 4, 3001),
        Case::new(Op::Entropy, 2, 4, 3001),
    ]);
    let mut all_masked = Case::new(Op::Grpo, 2, 3, 500).with(|o| o.beta = 0.04);
    all_masked.mask = MaskKind::AllZero;
    cases.push(all_masked);
    for case in cases {
        let data = case.data();
        check_logits::<f32>(&gpu, &data, 1e-5);
        check_logits::<bf16>(&gpu, &data, 1e-2);
        check_logits::<f16>(&gpu, &data, 1e-2);
    }
}

/// Fused-linear on the GPU against the f64 reference on the rounded inputs.
fn check_linear<T: CudaElement>(gpu: &CudaDevice, data: &Data, lin: &Linear, budget: ChunkBudget) {
    let round = |v: &[f32]| -> Vec<T> { v.iter().map(|&x| T::from_f32(x)).collect() };
    let wide = |v: &[T]| -> Vec<f64> { v.iter().map(|x| x.to_f32() as f64).collect() };
    let (hidden, weight, bias) = (round(&lin.hidden), round(&lin.weight), lin.bias.as_deref().map(round));
    let want = linear_reference::evaluate(
        data.spec(),
        &wide(&hidden),
        &wide(&weight),
        bias.as_deref().map(wide).as_deref(),
        lin.h,
    )
    .unwrap();
    let name = format!("{:?} {:?} H={} bias={} budget={budget:?}", data.case, T::DTYPE, lin.h, lin.bias.is_some());
    let hidden_d = gpu.upload(&hidden).unwrap();
    let weight_d = gpu.upload(&weight).unwrap();
    let bias_d = bias.as_ref().map(|b| gpu.upload(b).unwrap());
    let inputs = CudaLinearInputs { hidden: &hidden_d, weight: &weight_d, bias: bias_d.as_ref(), hidden_size: lin.h };
    if !data.spec().has_gradient() {
        let got = gpu.linear_forward(data.spec(), inputs, budget).unwrap();
        assert_outputs(&got, &want.output, 1e-4, &name);
        return;
    }
    let nan = |len: usize| gpu.upload(&vec![f32::NAN; len]).unwrap();
    let (mut gh, mut gw, mut gb) = (nan(hidden.len()), nan(weight.len()), nan(lin.bias.as_ref().map_or(1, Vec::len)));
    let grads = CudaLinearGradients {
        hidden: &mut gh,
        weight: Some(&mut gw),
        bias: if bias.is_some() { Some(&mut gb) } else { None },
    };
    let got = gpu.linear_forward_backward(data.spec(), inputs, grads, budget).unwrap();
    assert_outputs(&got, &want.output, 1e-4, &name);
    // f32: LOSSES.md's fused-linear 1e-4; bf16: dz is rounded to bf16 for the tensor-core products.
    let tol = if T::DTYPE == flashgrpo_kernels::DType::F32 { 1e-4 } else { 1e-2 };
    let err = |got: &flashgrpo_kernels::cuda::CudaSlice<f32>, want: &[f64]| {
        relative_norm_error(gpu.download(got).unwrap().iter().map(|&x| x as f64), want)
    };
    let e = err(&gh, want.grad_hidden.as_ref().unwrap());
    assert!(e <= tol, "grad_hidden {e} in {name}");
    let e = err(&gw, want.grad_weight.as_ref().unwrap());
    assert!(e <= tol, "grad_weight {e} in {name}");
    if let Some(wb) = &want.grad_bias {
        let e = err(&gb, wb);
        assert!(e <= tol, "grad_bias {e} in {name}");
    }
}

#[test]
fn linear_matches_the_reference_in_one_chunk_and_many() {
    let Some(gpu) = gpu() else { return };
    let grpo = |level| {
        Case::new(Op::Grpo, 2, 9, 3001).with(|o| {
            o.importance_sampling_level = level;
            o.beta = 0.04;
            o.epsilon_high = Some(0.28);
            o.temperature = 0.9;
        })
    };
    let mut ce = Case::new(Op::CrossEntropy, 2, 9, 2047).with(|o| o.label_smoothing = 0.1);
    ce.ignored = 0.2;
    // Masked rows skip the products (gathered chunks, `d hidden` scattered back, skipped rows
    // zeroed): with no row masked, with every row masked, at sequence level.
    let mask = |mut case: Case, mask| {
        case.mask = mask;
        case
    };
    let cases = [
        grpo(ImportanceSamplingLevel::Token),
        grpo(ImportanceSamplingLevel::Sequence),
        mask(grpo(ImportanceSamplingLevel::Token), MaskKind::None),
        mask(grpo(ImportanceSamplingLevel::Token), MaskKind::AllZero),
        mask(grpo(ImportanceSamplingLevel::Sequence), MaskKind::AllZero),
        ce,
        Case::new(Op::Logprob, 2, 5, 1000),
        Case::new(Op::Entropy, 2, 5, 1000),
    ];
    for case in cases {
        let data = case.data();
        for (h, with_bias) in [(64, false), (96, true), (1, true)] {
            let lin = linear_for(&case, h, with_bias);
            // One chunk, and chunks of two or three rows.
            for budget in [ChunkBudget::default(), ChunkBudget::from_bytes(2 * case.vocab * 8)] {
                check_linear::<f32>(&gpu, &data, &lin, budget);
                check_linear::<bf16>(&gpu, &data, &lin, budget);
            }
        }
    }
}

/// Fused-linear leaves masked rows out of the products, in chunks with and without a masked row
/// between their rows: the results match the reference, a NaN in a masked row's hidden state
/// (padding) changes no bit, and a NaN in an active row after masked ones names its batch row.
#[test]
fn linear_skips_masked_rows_and_names_bad_active_rows() {
    let Some(gpu) = gpu() else { return };
    let case = Case::new(Op::Grpo, 2, 6, 1000).with(|o| o.beta = 0.04);
    let mut data = case.data();
    // A masked prefix (rows 0, 1) and row 6: with f32 chunks of 3 computed rows (a row counts its
    // f32 logits, gathered hidden state and d hidden), [2, 3, 4], [5, 7, 8] (gathered) and
    // [9, 10, 11].
    data.mask = Some(vec![0., 0., 1., 1., 1., 1., 0., 1., 1., 1., 1., 1.]);
    let lin = linear_for(&case, 64, false);
    let budget = ChunkBudget::from_bytes(3 * (case.vocab * 4 + lin.h * 8));
    check_linear::<f32>(&gpu, &data, &lin, budget);
    check_linear::<bf16>(&gpu, &data, &lin, budget);
    let run = |hidden: &[f32]| {
        let (hidden_d, weight_d) = (gpu.upload(hidden).unwrap(), gpu.upload(&lin.weight).unwrap());
        let inputs = CudaLinearInputs { hidden: &hidden_d, weight: &weight_d, bias: None, hidden_size: lin.h };
        let mut gh = gpu.upload(&vec![f32::NAN; hidden.len()]).unwrap();
        let mut gw = gpu.upload(&vec![f32::NAN; lin.weight.len()]).unwrap();
        let grads = CudaLinearGradients { hidden: &mut gh, weight: Some(&mut gw), bias: None };
        let out = gpu.linear_forward_backward(data.spec(), inputs, grads, budget)?;
        Ok::<_, flashgrpo_kernels::LossError>((out, gpu.download(&gh).unwrap(), gpu.download(&gw).unwrap()))
    };
    let clean = run(&lin.hidden).unwrap();
    assert!(clean.1[..2 * lin.h].iter().all(|&g| g == 0.0), "the skipped rows' d hidden is zero");
    let mut padded = lin.hidden.clone();
    for row in [0, 6] {
        padded[row * lin.h + 5] = f32::NAN;
    }
    assert!(run(&padded).unwrap() == clean, "a masked row's NaN hidden state changed the results");
    let mut bad = lin.hidden.clone();
    bad[8 * lin.h + 3] = f32::NAN;
    let e = run(&bad).unwrap_err().to_string();
    assert!(e.contains("row 8"), "{e}");
}

#[test]
fn repeated_runs_give_the_same_bits() {
    let Some(gpu) = gpu() else { return };
    let data = Case::new(Op::Grpo, 4, 16, 50_000).with(|o| o.beta = 0.04).data();
    let logits: Vec<bf16> = data.logits_as();
    let run = || {
        let mut l = gpu.upload(&logits).unwrap();
        let out = gpu.forward_backward(data.spec(), &mut l, None).unwrap();
        (out, gpu.download(&l).unwrap())
    };
    let first = run();
    for _ in 0..3 {
        assert!(run() == first, "a repeated run differs");
    }
}

/// Row-local objectives run a block of rows at a time, overlapped with the GPU's passes: the
/// outputs must be the bits of the one whole objective (`forward`), at every block size.
#[test]
fn blocks_of_rows_give_the_whole_objectives_bits() {
    let Some(mut gpu) = gpu() else { return };
    // Blocks of any size (the default keeps at least a wave of rows a block: one block here).
    gpu.row_blocks = RowBlocks { blocks: 8, min_rows: 1 };
    // 21 rows (blocks of 3), 1200 (blocks of 150), 9 (blocks of 2, the last of 1).
    for (b, t, v) in [(3, 7, 4099), (4, 300, 1000), (1, 9, 255)] {
        let data = Case::new(Op::Grpo, b, t, v)
            .with(|o| {
                o.beta = 0.04;
                o.epsilon_high = Some(0.28);
                o.entropy_coef = 0.01;
            })
            .data();
        let logits: Vec<bf16> = data.logits_as();
        let run = |gpu: &CudaDevice, in_place: bool| {
            let mut l = gpu.upload(&logits).unwrap();
            let mut g = gpu.upload(&vec![bf16::NAN; logits.len()]).unwrap();
            let out = gpu.forward_backward(data.spec(), &mut l, (!in_place).then_some(&mut g)).unwrap();
            (out, gpu.download(if in_place { &l } else { &g }).unwrap())
        };
        let whole = gpu.forward(data.spec(), &gpu.upload(&logits).unwrap()).unwrap();
        let blocks = run(&gpu, false);
        assert!(blocks.0 == whole, "blocks of rows differ from the whole objective at B={b} T={t} V={v}");
        assert!(run(&gpu, true) == blocks, "in place differs from out of place at B={b} T={t} V={v}");
        gpu.row_blocks = RowBlocks { blocks: 1, min_rows: 1 };
        assert!(run(&gpu, false) == blocks, "one block differs from many at B={b} T={t} V={v}");
        gpu.row_blocks = RowBlocks { blocks: 8, min_rows: 1 };
    }
}

#[test]
fn bad_inputs_are_errors_not_crashes() {
    let Some(mut gpu) = gpu() else { return };
    gpu.row_blocks = RowBlocks { blocks: 8, min_rows: 1 };
    let mut case = Case::new(Op::Grpo, 2, 3, 100).with(|o| o.beta = 0.04);
    case.mask = MaskKind::None;
    let data = case.data();
    let short = gpu.upload(&[0.0f32; 10]).unwrap();
    let e = gpu.forward(data.spec(), &short).unwrap_err().to_string();
    assert!(e.contains("logits"), "{e}");
    let mut logits: Vec<f32> = data.logits_as();
    logits[2 * 100 + 7] = f32::NAN;
    let mut l = gpu.upload(&logits).unwrap();
    let e = gpu.forward_backward(data.spec(), &mut l, None).unwrap_err().to_string();
    assert!(e.contains("row 2"), "{e}");
    // Two bad rows in different blocks of rows: the lower is named.
    logits[5 * 100 + 3] = f32::INFINITY;
    let mut l = gpu.upload(&logits).unwrap();
    let e = gpu.forward_backward(data.spec(), &mut l, None).unwrap_err().to_string();
    assert!(e.contains("row 2"), "{e}");
    logits[2 * 100 + 7] = 0.0;
    let mut l = gpu.upload(&logits).unwrap();
    let e = gpu.forward_backward(data.spec(), &mut l, None).unwrap_err().to_string();
    assert!(e.contains("row 5"), "{e}");
    // After those errors, the same device gives a clean call's results; a NaN in a masked row of
    // a later block is never read.
    let mut masked = Case::new(Op::Grpo, 2, 3, 100).with(|o| o.beta = 0.04);
    masked.mask = MaskKind::Random(0.5);
    let mut data = masked.data();
    data.mask = Some(vec![1.0, 0.0, 1.0, 1.0, 0.0, 1.0]);
    let mut logits: Vec<f32> = data.logits_as();
    let off = 4;
    logits[off * 100 + 11] = f32::NAN;
    let mut clean: Vec<f32> = logits.clone();
    clean[off * 100 + 11] = 0.0;
    let want = gpu.forward(data.spec(), &gpu.upload(&clean).unwrap()).unwrap();
    let mut l = gpu.upload(&logits).unwrap();
    let got = gpu.forward_backward(data.spec(), &mut l, None).unwrap();
    assert!(got == want, "a masked row's NaN, or an earlier error, changed the results");
}
