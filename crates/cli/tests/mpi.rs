//! Multi-process flashgrpo under `mpirun --oversubscribe` on loopback: the collectives over 2, 3
//! and 4 ranks, data-parallel GRPO (with its SFT warm start) over 2 ranks against one process on
//! the same global batch, and a rank killed mid-run. The first test to run installs Open MPI
//! (`scripts/setup-mpi.sh`: Debian packages) and builds the binary with `--features mpi` into
//! `target/mpi` (the default build needs no MPI), so the README's test command covers them on a
//! fresh machine. It builds with the `mpi-test` profile (Cargo.toml: no debug information,
//! `opt-level = 1`): from an empty `target/mpi` this test took ~271 s, against 407-443 s with
//! `--release`; the build is nearly all of it (from scratch ~260 s against ~407 s), the runs
//! themselves ~40 s.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Open MPI installed, and the path of flashgrpo built with `--features mpi`.
fn mpi_binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        let setup = Command::new("bash").arg(root().join("scripts/setup-mpi.sh")).output().expect("bash runs");
        assert!(setup.status.success(), "scripts/setup-mpi.sh failed:\n{}", text(&setup));
        let target = root().join("target/mpi");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let build = Command::new(cargo)
            .current_dir(root())
            .args(["build", "--profile", "mpi-test", "--features", "mpi", "-p", "flashgrpo-cli", "--target-dir"])
            .arg(&target)
            .output()
            .expect("cargo runs");
        assert!(build.status.success(), "building flashgrpo with --features mpi failed:\n{}", text(&build));
        target.join("mpi-test/flashgrpo")
    })
}

/// `mpirun -np ranks flashgrpo args...` on this machine (more ranks than cores allowed).
fn mpirun(ranks: usize, args: &[&str]) -> Command {
    let mut c = Command::new("mpirun");
    c.current_dir(root())
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .args(["--oversubscribe", "--bind-to", "none", "-np", &ranks.to_string()])
        .arg(mpi_binary())
        .args(args);
    c
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("flashgrpo-mpi-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn collectives_over_2_3_and_4_ranks() {
    for ranks in [2, 3, 4] {
        let o = mpirun(ranks, &["mpi-check", "--mib", "1", "--repeats", "2"]).output().unwrap();
        assert!(o.status.success(), "{ranks} ranks: {}", text(&o));
        assert!(text(&o).contains(&format!("rank 0 of {ranks}")), "{}", text(&o));
        assert!(text(&o).contains("split: ok"), "{}", text(&o));
    }
}

/// A GRPO run of the built-in task in seconds, whose warm start learns enough of the format for
/// the rewards to differ within groups (a signal to train on). AdamW's `eps` is raised from 1e-8
/// so that a gradient element at rounding level (~1e-9, whose sign the sums' association decides)
/// takes a step of ~1e-3 lr rather than up to lr: the comparisons below are of associations of
/// the same sums, and at 1e-8 one such element of a `k_proj` decided them (1.4e-4 of its tensor's
/// scale after 3 steps, when the row kernels' rounding changed).
const TINY: [&str; 27] = [
    "model.vocab_size=null",
    "model.hidden_size=64",
    "model.num_layers=1",
    "tokenizer.vocab_size=300",
    "data.limit=200",
    "data.eval_limit=8",
    "sft.steps=300",
    "sft.batch_size=8",
    "sft.eval_every=0",
    "grpo.prompts_per_step=4",
    "grpo.num_generations=4",
    "grpo.max_new_tokens=16",
    "grpo.micro_batch_size=3",
    "grpo.ppo_epochs=2",
    "grpo.optim.lr=1e-3",
    "grpo.optim.eps=1e-6",
    "grpo.eval_every_steps=0",
    "grpo.eval_samples=2",
    "grpo.eval_batch_size=3",
    "grpo.dynamic_sampling=true",
    "grpo.max_rollout_rounds=2",
    "grpo.checkpoint_every=1",
    "loss.loss_type=dapo",
    "loss.beta=0.04",
    "parallel.check_weights_every=1",
    "progress=false",
    "seed=3",
];

fn tiny_args(out: &Path, extra: &[String]) -> Vec<String> {
    let mut args = vec!["train".to_string(), "--out".into(), out.display().to_string()];
    for s in TINY.iter().map(|s| s.to_string()).chain(extra.iter().cloned()) {
        args.extend(["--set".to_string(), s]);
    }
    args
}

fn records(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn weights(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
            (name, t.data().chunks(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Every tensor of the two models within 1e-5 relative in norm (`|a - b| / |a|`), and each
/// element within `elementwise` of the tensor's largest magnitude.
fn assert_same_weights(a: &Path, b: &Path, elementwise: f64) {
    let (wa, wb) = (weights(a), weights(b));
    assert_eq!(wa.len(), wb.len());
    for ((name, p), (_, q)) in wa.iter().zip(&wb) {
        let norm = p.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
        let diff = p.iter().zip(q).map(|(&x, &y)| (x as f64 - y as f64).powi(2)).sum::<f64>().sqrt();
        assert!(diff <= 1e-5 * norm + 1e-7, "{}/{name}: |a - b| / |a| = {}", a.display(), diff / norm);
        let scale = p.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
        let worst = p.iter().zip(q).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max) as f64;
        assert!(worst <= elementwise * scale + 1e-7, "{}/{name}: max difference {worst} (scale {scale})", a.display());
    }
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs()) + 1e-7
}

fn run_one(args: &[String]) {
    let o = Command::new(mpi_binary()).current_dir(root()).args(args).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
}

fn run_many(ranks: usize, args: &[String]) {
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = mpirun(ranks, &refs).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains(&format!("MPI, {ranks} ranks")), "{}", text(&o));
}

fn run_two(args: &[String]) {
    run_many(2, args)
}

/// Two GRPO runs give the same completions (rewards, lengths, accuracies bit for bit), losses
/// within 1e-5 and weights within 1e-5 (in norm; each element within `elementwise`).
fn assert_same_grpo_run(one: &Path, other: &Path, elementwise: f64) {
    let (a, b) = (records(one), records(other));
    assert_eq!(a.len(), b.len(), "records: {} vs {}", a.len(), b.len());
    let signal = a.iter().filter_map(|r| r.get("train/reward_std")?.as_f64()).any(|s| s > 0.0);
    assert!(signal, "no reward signal: the test would compare noise");
    for (x, y) in a.iter().zip(&b) {
        for key in
            ["train/reward_mean", "train/reward_std", "train/completion_len_mean", "train/accuracy", "eval/accuracy"]
        {
            assert_eq!(x.get(key), y.get(key), "{key} at step {} of {}", x["step"], other.display());
        }
        for key in ["train/loss", "train/grad_norm", "train/entropy", "train/advantage_std"] {
            if let (Some(p), Some(q)) = (x.get(key).and_then(|v| v.as_f64()), y.get(key).and_then(|v| v.as_f64())) {
                assert!(close(p, q, 1e-5), "{key} at step {} of {}: {p} vs {q}", x["step"], other.display());
            }
        }
    }
    assert_same_weights(&one.join("model"), &other.join("model"), elementwise);
}

#[test]
fn data_parallel_sft_and_grpo_over_2_ranks_equal_one_process() {
    let dir = scratch("dp");
    // SFT: 5 steps of 8 examples, split 4 + 4.
    let sft = ["--algo".to_string(), "sft".into()];
    let short = ["sft.steps=5".to_string()];
    let (one, two) = (dir.join("sft-one"), dir.join("sft-two"));
    run_one(&[tiny_args(&one, &short), sft.to_vec()].concat());
    run_two(&[tiny_args(&two, &short), sft.to_vec()].concat());
    assert_same_weights(&one.join("model"), &two.join("model"), 1e-5);

    // GRPO: 3 steps from the same warm start (made by one process), 2 prompts of 4 per rank.
    let warm = dir.join("warm");
    run_one(&tiny_args(&warm, &["grpo.steps=1".into()]));
    let from_warm =
        [format!("model.path={}", warm.join("warm_start").display()), "sft.steps=0".into(), "grpo.steps=3".into()];
    let (one, two) = (dir.join("grpo-one"), dir.join("grpo-two"));
    run_one(&tiny_args(&one, &from_warm));
    run_two(&tiny_args(&two, &from_warm));
    assert_same_grpo_run(&one, &two, 1e-5);
    // The same with the gradients summed after the backward instead of during it.
    let after = dir.join("grpo-two-after");
    run_two(&tiny_args(&after, &[from_warm.to_vec(), vec!["parallel.overlap_grad_sum=false".into()]].concat()));
    assert_same_grpo_run(&one, &after, 1e-5);
    // Batch-scaled advantages need the whole batch's rewards.
    let batch_scaled = [from_warm.to_vec(), vec!["grpo.scale_rewards=batch".into()]].concat();
    let (one_b, two_b) = (dir.join("grpo-one-batch"), dir.join("grpo-two-batch"));
    run_one(&tiny_args(&one_b, &batch_scaled));
    run_two(&tiny_args(&two_b, &batch_scaled));
    assert_same_grpo_run(&one_b, &two_b, 1e-5);
    // LOSSES.md's whole-batch additions: the entropy threshold, the masked-mean bonus's count and
    // verl's count of sequences with tokens are the whole batch's on every rank; the sampler's
    // log-probabilities with a sequence-level correction; truncated completions masked; TRL's
    // normalize_then_sum (the batch's standardisation over every rank's groups), sampling with
    // min-p and a repetition penalty, and the reference synchronised every two steps.
    let additions = [
        from_warm.to_vec(),
        [
            "loss.top_entropy_quantile=0.5",
            "loss.entropy_coef=0.01",
            "loss.entropy_bonus=masked_mean",
            "loss.loss_agg_mode=seq-mean-token-mean",
            "loss.vllm_importance_sampling_mode=sequence_mask",
            "grpo.sampling_logp=true",
            "grpo.mask_truncated_completions=true",
            "grpo.multi_objective_aggregation=normalize_then_sum",
            "grpo.min_p=0.05",
            "grpo.repetition_penalty=1.1",
            "loss.beta=0.04",
            "grpo.sync_ref_model=true",
            "grpo.ref_model_sync_steps=2",
        ]
        .map(String::from)
        .to_vec(),
    ]
    .concat();
    let (one_a, two_a) = (dir.join("grpo-one-additions"), dir.join("grpo-two-additions"));
    run_one(&tiny_args(&one_a, &additions));
    run_two(&tiny_args(&two_a, &additions));
    assert_same_grpo_run(&one_a, &two_a, 1e-5);
    // The head's vocabulary split inside data-parallel training: data x vocab = 1 x 2 and 2 x 2.
    // `grad_hidden` is then a sum over the vocabulary halves, another f32 association than one
    // product over the whole vocabulary (~1e-7 relative), and the vocabulary shards' gradient
    // recomputes `exp(u - lse)` where one process keeps `2^t` from its statistics pass. AdamW
    // divides each gradient element by its own running scale, so on an element whose gradient is
    // at rounding level the steps differ by up to the learning rate times `g / (|g| + eps)`
    // (`eps` raised in `TINY` for that reason).
    for (ranks, data) in [(2, 1), (4, 2)] {
        let mesh = dir.join(format!("grpo-{data}x2"));
        let sets = [from_warm.to_vec(), vec!["parallel.vocab=2".into(), format!("parallel.data={data}")]].concat();
        run_many(ranks, &tiny_args(&mesh, &sets));
        assert_same_grpo_run(&one, &mesh, 1e-4);
    }
    // Only rank 0 wrote; a resume must use as many ranks as wrote the checkpoint.
    assert!(two.join("plots/reward.png").exists() && two.join("checkpoint/trainer_state.json").exists());
    let o = Command::new(mpi_binary()).current_dir(root()).args(["train", "--resume"]).arg(&two).output().unwrap();
    assert!(!o.status.success() && text(&o).contains("mpirun -np 2"), "{}", text(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_error_on_one_rank_ends_the_job() {
    // Only rank 0 writes: an output path under a regular file fails there alone, while the other
    // rank goes on to its first collective. The error must end the job, not leave it waiting.
    let dir = scratch("error");
    std::fs::create_dir_all(&dir).unwrap();
    let blocker = dir.join("a-file");
    std::fs::write(&blocker, "not a directory").unwrap();
    let args = tiny_args(&blocker.join("run"), &["grpo.steps=2".into()]);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let job = mpirun(2, &refs).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let o = finish_within(job, Duration::from_secs(60), "rank 0 failed");
    assert!(!o.status.success());
    assert!(text(&o).contains("error:") && text(&o).contains("a-file"), "{}", text(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `job`'s output once it ends, at most `limit` from now (past it, the job is killed and the test
/// fails: a hang is the failure these tests look for).
fn finish_within(mut job: Child, limit: Duration, after: &str) -> Output {
    let started = Instant::now();
    while job.try_wait().unwrap().is_none() {
        if started.elapsed() >= limit {
            let _ = job.kill();
            panic!("the job still runs {} s after {after}", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    job.wait_with_output().unwrap()
}

/// The PIDs of `parent`'s children (the ranks that `mpirun` started on this machine).
fn children(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        // `pid (comm) state ppid ...`: the fields after the last ')'.
        let ppid = stat.rsplit(')').next().and_then(|s| s.split_whitespace().nth(1)).and_then(|p| p.parse().ok());
        if ppid == Some(parent) {
            out.push(pid);
        }
    }
    out.sort();
    out
}

#[test]
fn a_killed_rank_ends_the_job_and_the_checkpoint_resumes() {
    let dir = scratch("kill");
    let run = dir.join("run");
    let args = tiny_args(&run, &["sft.steps=20".into(), "grpo.steps=100000".into()]);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut job = mpirun(2, &refs).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let started = Instant::now();
    while records(&run).iter().filter(|r| r.get("train/loss").is_some()).count() < 3 {
        assert!(job.try_wait().unwrap().is_none(), "the job ended before the kill");
        assert!(started.elapsed() < Duration::from_secs(300), "no GRPO step logged in 300 s");
        std::thread::sleep(Duration::from_millis(100));
    }
    let ranks = children(job.id());
    assert_eq!(ranks.len(), 2, "mpirun's children: {ranks:?}");
    unsafe { libc::kill(ranks[1] as i32, libc::SIGKILL) };
    let o = finish_within(job, Duration::from_secs(60), "a rank was killed");
    assert!(!o.status.success(), "exit status {:?}", o.status);
    assert!(text(&o).contains("signal 9") || text(&o).contains("Killed"), "{}", text(&o));

    // The last checkpoint loads and the run resumes from it with the same number of ranks.
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("checkpoint/trainer_state.json")).unwrap()).unwrap();
    let done = state["step"].as_u64().unwrap() as usize;
    assert!(done >= 2, "checkpoint at step {done}");
    let target = format!("grpo.steps={}", done + 2);
    let o = mpirun(2, &["train", "--resume", run.to_str().unwrap(), "--set", &target]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let last = records(&run).last().and_then(|r| r["step"].as_u64()).unwrap() as usize;
    assert_eq!(last, done + 2);
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- Vocabulary-parallel losses -------------------------------------------------------------

const VB: usize = 3;
const VT: usize = 5;
/// Divides by none of 2, 3, 4.
const VV: usize = 1001;
const VH: usize = 24;

struct Tensor {
    name: &'static str,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

fn floats(name: &'static str, shape: Vec<usize>, v: &[f32], bf16: bool) -> Tensor {
    let (dtype, bytes) = if bf16 {
        (safetensors::Dtype::BF16, v.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect())
    } else {
        (safetensors::Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect())
    };
    Tensor { name, dtype, shape, bytes }
}

fn write_tensors(path: &Path, tensors: &[Tensor]) {
    let views: Vec<_> = tensors
        .iter()
        .map(|t| (t.name, safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.bytes).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// Every output tensor of a `flashgrpo loss` file, as f32.
fn outputs(path: &Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            let v = match t.dtype() {
                safetensors::Dtype::F32 => {
                    t.data().chunks(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
                }
                safetensors::Dtype::BF16 => {
                    t.data().chunks(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
                }
                // Predicted tokens: columns, exact in f32 at these vocabularies.
                safetensors::Dtype::I64 => {
                    t.data().chunks(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as f32).collect()
                }
                other => panic!("{name}: {other:?}"),
            };
            (name, v)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Inputs of every op: logits (or hidden, weight, bias), targets, a mask with holes, advantages,
/// old and reference log-probabilities; or, with `class_weights`, cross-entropy's inputs with
/// per-class weights.
fn loss_inputs(path: &Path, linear: bool, bf16: bool, class_weights: bool) {
    use flashgrpo_kernels::synthetic::{normal_matrix, SyntheticSpec};
    let data = SyntheticSpec {
        batch: VB,
        seq_len: VT,
        vocab: VV,
        seed: 11,
        logit_std: 2.0,
        logp_noise: 0.3,
        mask_fraction: 0.3,
    }
    .generate();
    let mut tensors = vec![
        Tensor {
            name: "targets",
            dtype: safetensors::Dtype::I64,
            shape: vec![VB, VT],
            bytes: data.targets.iter().flat_map(|&x| x.to_le_bytes()).collect(),
        },
        floats("mask", vec![VB, VT], &data.mask, false),
    ];
    if class_weights {
        let c: Vec<f32> = (0..VV).map(|j| 0.25 + (j * 7919 % 13) as f32 * 0.1).collect();
        tensors.push(floats("class_weights", vec![VV], &c, false));
    } else {
        tensors.extend([
            floats("advantages", vec![VB], &data.advantages, false),
            floats("old_logp", vec![VB, VT], &data.old_logp, false),
            floats("ref_logp", vec![VB, VT], &data.ref_logp, false),
        ]);
    }
    if linear {
        tensors.push(floats("hidden", vec![VB, VT, VH], &normal_matrix(VB * VT, VH, 1.0, 5), bf16));
        tensors.push(floats("weight", vec![VV, VH], &normal_matrix(VV, VH, 0.5, 6), bf16));
        tensors.push(floats("bias", vec![VV], &normal_matrix(1, VV, 0.3, 7), bf16));
    } else {
        tensors.push(floats("logits", vec![VB, VT, VV], &data.logits, bf16));
    }
    write_tensors(path, &tensors);
}

#[test]
fn vocabulary_parallel_losses_over_2_3_and_4_ranks_equal_one_process() {
    let dir = scratch("vocab");
    std::fs::create_dir_all(&dir).unwrap();
    let cases: [(&str, &[&str]); 12] = [
        ("grpo", &["beta=0.04", "epsilon_high=0.28"]),
        ("grpo", &["importance_sampling_level=sequence", "loss_type=grpo", "beta=0.04"]),
        ("grpo", &["loss_type=dr_grpo", "temperature=0.7", "entropy_coef=0.01", "delta=2.0"]),
        ("cross_entropy", &["label_smoothing=0.1", "z_loss=0.001"]),
        ("cross_entropy", &["reduction=sum"]),
        ("entropy", &[]),
        ("logprob", &[]),
        // Predicted tokens: each shard's argmax travels in the exchange.
        ("grpo", &["predicted_tokens=true", "temperature=0.7"]),
        ("cross_entropy", &["predicted_tokens=true", "label_smoothing=0.1"]),
        // The entropy's gradient, of the sum (the rows' statistics exchanged as for any op).
        ("entropy", &["entropy_gradient=true", "reduction=sum", "temperature=0.8"]),
        // With class weights (the input file's `class_weights`): each shard sums its columns'
        // weighted `u` and weights its columns' gradient term.
        ("cross_entropy", &["label_smoothing=0.1", "z_loss=0.001"]),
        ("cross_entropy", &["reduction=sum"]),
    ];
    let mut checked = 0;
    for linear in [false, true] {
        for bf16 in [false, true] {
            let (input, weighted) =
                (dir.join(format!("in-{linear}-{bf16}.safetensors")), dir.join("weighted.safetensors"));
            loss_inputs(&input, linear, bf16, false);
            loss_inputs(&weighted, linear, bf16, true);
            for (case, (op, sets)) in cases.iter().enumerate() {
                let input = if case >= 10 { &weighted } else { &input };
                let mut args = vec!["loss".to_string(), "--op".into(), op.to_string(), "--inputs".into()];
                args.push(input.display().to_string());
                for s in sets.iter() {
                    args.extend(["--set".to_string(), s.to_string()]);
                }
                let one = dir.join(format!("one-{case}.safetensors"));
                let o = Command::new(mpi_binary())
                    .current_dir(root())
                    .args(&args)
                    .args(["--out", one.to_str().unwrap()])
                    .output()
                    .unwrap();
                assert!(o.status.success(), "{}", text(&o));
                let want = outputs(&one);
                for ranks in [2, 3, 4] {
                    let many = dir.join(format!("many-{case}-{ranks}.safetensors"));
                    let mut refs: Vec<&str> = args.iter().map(String::as_str).collect();
                    refs.extend(["--vocab-parallel", "--out", many.to_str().unwrap()]);
                    let o = mpirun(ranks, &refs).output().unwrap();
                    assert!(o.status.success(), "{ranks} ranks, {op} {sets:?}: {}", text(&o));
                    let split = format!("vocabulary of {VV} over {ranks} ranks");
                    assert!(text(&o).contains(&split), "{}", text(&o));
                    let got = outputs(&many);
                    assert_eq!(
                        want.iter().map(|w| &w.0).collect::<Vec<_>>(),
                        got.iter().map(|g| &g.0).collect::<Vec<_>>()
                    );
                    // f32: within LOSSES.md's f32 tolerance; bf16 outputs: a bf16 rounding step
                    // (sums in another order can round the other way).
                    let rel = if bf16 { 2e-2 } else { 2e-5 };
                    for ((name, w), (_, g)) in want.iter().zip(&got) {
                        if name == "predicted_tokens" {
                            assert_eq!(w, g, "{ranks} ranks, {op} {sets:?}, linear {linear}, bf16 {bf16}");
                            checked += 1;
                            continue;
                        }
                        let scale = w.iter().fold(0.0f32, |m, x| m.max(x.abs())) as f64;
                        let worst = w.iter().zip(g).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max) as f64;
                        assert!(
                            worst <= rel * scale + 1e-6,
                            "{ranks} ranks, {op} {sets:?}, linear {linear}, bf16 {bf16}: `{name}` differs by {worst} (scale {scale})"
                        );
                        checked += 1;
                    }
                }
            }
        }
    }
    assert!(checked > 300, "{checked} tensors compared");
    let _ = std::fs::remove_dir_all(&dir);
}
