//! The f64 reference: every loss of LOSSES.md written the plain way, to be obviously right and
//! to check the streaming kernels against.
//!
//! - Each row's softmax is materialised whole (`u`, `log p`, `p` over the full vocabulary, in
//!   f64, max-subtracted), with no online rescaling, tiles or shards.
//! - Each loss is written once, generic over [`Real`], in the shape of TRL's code (`coef_1`,
//!   `coef_2`, `torch.min`, `clamp`, the reduction as LOSSES.md states it), and its derivatives
//!   with respect to each row's `logp`, `H`, `lse` and `mean u` come from forward-mode
//!   differentiation of that same code ([`dual`]), not from hand-derived formulas.
//! - Only the softmax's own Jacobian is written by hand (`dlogp_y/du_j = [j=y] - p_j`,
//!   `dH/du_j = -p_j (log p_j + H)`, `dlse/du_j = p_j`, `dmean/du_j = 1/V`), and a
//!   finite-difference test checks the whole gradient.
//!
//! It is slow (O(T^2) per sequence for the derivatives) and memory-hungry by design.

pub mod dual;
mod grpo;

use dual::{Dual, Real};

use crate::engine::LossSpec;
use crate::error::LossError;
use crate::inputs::{validate, Loss, Normalisers};
use crate::objective::OutputUpstreams;
use crate::options::{LossOptions, Reduction};

/// The reference's results, in f64. Per-token outputs are 0 on rows that take no part.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ReferenceOutput {
    pub loss: f64,
    pub per_token_loss: Vec<f64>,
    pub logp: Option<Vec<f64>>,
    pub entropy: Vec<f64>,
    pub kl: Option<Vec<f64>>,
    pub is_clipped: Option<Vec<f64>>,
    /// Each row's `lse` (of the capped `u` under a soft cap).
    pub lse: Vec<f64>,
    /// With `predicted_tokens`: the first column of each row's largest (capped) logit, -1 where
    /// the row takes no part.
    pub predicted: Option<Vec<i64>>,
    /// `dL/dlogits`, `[N*V]`; `None` for `entropy` without `entropy_gradient`.
    pub grad: Option<Vec<f64>>,
}

/// One row's softmax, materialised.
struct Softmax {
    /// `log p_j = u_j - lse`.
    log_p: Vec<f64>,
    lse: f64,
    entropy: f64,
    mean_u: f64,
    /// The first column of the largest capped logit.
    argmax: usize,
}

impl Softmax {
    /// `u = x / T`, or `c tanh(x / c) / T` with a soft cap `c`; `mean_u` weighted by the class
    /// weights `c` when given (`sum_j c_j u_j / V`).
    fn of(logits: &[f64], options: &LossOptions, class_weights: Option<&[f32]>) -> Self {
        let cap = |x: f64| options.softcap.map_or(x, |c| c * (x / c).tanh());
        let capped: Vec<f64> = logits.iter().map(|&x| cap(x)).collect();
        let argmax = (0..capped.len()).fold(0, |best, j| if capped[j] > capped[best] { j } else { best });
        let u: Vec<f64> = capped.iter().map(|&x| x / options.temperature).collect();
        let max = u.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = max + u.iter().map(|&x| (x - max).exp()).sum::<f64>().ln();
        let log_p: Vec<f64> = u.iter().map(|&x| x - lse).collect();
        let entropy = -log_p.iter().map(|&l| l.exp() * l).sum::<f64>();
        let weight = |j: usize| class_weights.map_or(1.0, |c| c[j] as f64);
        let mean_u = u.iter().enumerate().map(|(j, &x)| weight(j) * x).sum::<f64>() / u.len() as f64;
        Self { log_p, lse, entropy, mean_u, argmax }
    }
}

/// The row quantities every loss is a function of.
#[derive(Debug, Clone, Copy, Default)]
struct RowQ<S> {
    logp: S,
    entropy: S,
    lse: S,
    mean_u: S,
}

/// Derivatives of the loss with respect to a row's quantities.
type RowDerivatives = RowQ<f64>;

/// Computes `loss` on `logits` (`[N*V]`, f64) in the plainest way, with its gradient when the op has one.
pub fn evaluate(spec: LossSpec<'_>, logits: &[f64]) -> Result<ReferenceOutput, LossError> {
    evaluate_with(spec, logits, None)
}

/// [`evaluate`], with the gradient of the loss whose reduction weighs each row's term (its
/// per-token loss, its entropy bonus) times `upstream[i]` as well: for a token-sum loss, the
/// gradient of `sum_i upstream[i] * per_token_loss[i]` (a per-token loss back-propagated with a
/// per-token upstream gradient). The loss and outputs are [`evaluate`]'s.
pub fn evaluate_with_upstream(
    spec: LossSpec<'_>,
    logits: &[f64],
    upstream: &[f32],
) -> Result<ReferenceOutput, LossError> {
    crate::objective::check_upstream(&spec.loss, &spec.rows, spec.options, upstream)?;
    evaluate_with(spec, logits, Some(upstream))
}

/// [`evaluate`], with the gradient of `sum_i (up.loss[i] * term_i + up.entropy[i] * H_i +
/// up.lse[i] * lse_i)` (an absent upstream is zero; the loss's terms weighted as
/// [`evaluate_with_upstream`] weighs them): what the engine's `output_gradients` computes, here
/// by adding the upstreams to the derivatives of each row's `entropy` and `lse`.
pub fn evaluate_with_outputs(
    spec: LossSpec<'_>,
    logits: &[f64],
    upstreams: &OutputUpstreams,
) -> Result<ReferenceOutput, LossError> {
    upstreams.check(&spec.loss, &spec.rows, spec.options)?;
    let (mut out, active, derivatives) = derive(spec, logits, upstreams.loss)?;
    let mut d = match (upstreams.loss, derivatives) {
        (Some(_), Some(d)) => d,
        _ => vec![RowDerivatives::default(); active.len()],
    };
    for i in (0..d.len()).filter(|&i| active[i]) {
        let (entropy, lse) = upstreams.outputs_at(i);
        d[i].entropy += entropy;
        d[i].lse += lse;
    }
    out.grad = Some(gradient_of(spec, logits, &active, &d));
    Ok(out)
}

fn evaluate_with(spec: LossSpec<'_>, logits: &[f64], upstream: Option<&[f32]>) -> Result<ReferenceOutput, LossError> {
    let (mut out, active, derivatives) = derive(spec, logits, upstream)?;
    out.grad = derivatives.map(|d| gradient_of(spec, logits, &active, &d));
    Ok(out)
}

/// The outputs (no gradient), which rows take part, and the derivatives of the loss (each row's
/// term times `upstream[i]`, 1 without) with respect to each row's quantities; `None` for an op
/// without a gradient.
type Derived = (ReferenceOutput, Vec<bool>, Option<Vec<RowDerivatives>>);

/// [`Derived`] of `spec` on `logits`.
fn derive(spec: LossSpec<'_>, logits: &[f64], upstream: Option<&[f32]>) -> Result<Derived, LossError> {
    let up = |i: usize| upstream.map_or(1.0, |u| u[i] as f64);
    let rows = &spec.rows;
    let options = spec.options;
    let active = validate(&spec.loss, rows, options)?;
    let (n, v) = (rows.len(), rows.vocab);
    if logits.len() != n * v {
        return Err(LossError::Shape {
            tensor: "logits",
            got: vec![logits.len()],
            expected: format!("it must hold B*T*V = {}*{}*{v} elements", rows.batch, rows.seq_len),
        });
    }
    let row = |i: usize| &logits[i * v..(i + 1) * v];
    let mut q = vec![RowQ::<f64>::default(); n];
    let mut predicted = vec![-1i64; n];
    for i in (0..n).filter(|&i| active[i]) {
        if row(i).iter().any(|x| !x.is_finite()) {
            let (b, t) = rows.position(i);
            return Err(LossError::NonFiniteLogits { row: i, b, t });
        }
        let sm = Softmax::of(row(i), options, spec.loss.class_weights());
        let logp = rows.targets.map_or(0.0, |y| sm.log_p[y[i] as usize]);
        q[i] = RowQ { logp, entropy: sm.entropy, lse: sm.lse, mean_u: sm.mean_u };
        predicted[i] = sm.argmax as i64;
    }
    let norm = Normalisers::resolve(&spec.loss, rows, &active, options, spec.batch_shard);
    let masked =
        |f: &dyn Fn(usize) -> f64| -> Vec<f64> { (0..n).map(|i| if active[i] { f(i) } else { 0.0 }).collect() };

    let mut out = ReferenceOutput {
        logp: rows.targets.map(|_| masked(&|i| q[i].logp)),
        entropy: masked(&|i| q[i].entropy),
        lse: masked(&|i| q[i].lse),
        predicted: options.predicted_tokens.then_some(predicted),
        ..Default::default()
    };
    let derivatives: Option<Vec<RowDerivatives>> = match &spec.loss {
        Loss::Grpo(inputs) => Some(grpo::derive(spec, inputs, &active, &q, norm, upstream, &mut out)),
        Loss::CrossEntropy(inputs) => {
            let ce = CrossEntropy::new(options, inputs.class_weights, rows, &norm);
            out.per_token_loss = masked(&|i| ce.loss(i, q[i]).total().value());
            out.loss = (0..n).filter(|&i| active[i]).map(|i| ce.loss(i, q[i]).reduced(&ce).value()).sum();
            Some(masked_derivatives(&active, &q, |i, x| ce.loss(i, x[0]).reduced(&ce) * Dual::constant(up(i))))
        }
        Loss::Logprob => {
            out.per_token_loss = masked(&|i| q[i].logp);
            out.loss = out.per_token_loss.iter().sum();
            Some(masked_derivatives(&active, &q, |i, x| x[0].logp * Dual::constant(up(i))))
        }
        Loss::Entropy => {
            // The mean over the rows that take part, or with the gradient and `sum` / `none`
            // their sum.
            let weight = match (options.entropy_gradient, options.reduction) {
                (true, Reduction::Sum | Reduction::None) => 1.0,
                _ => 1.0 / norm.valid_rows.max(1.0),
            };
            out.per_token_loss = out.entropy.clone();
            out.loss = out.entropy.iter().sum::<f64>() * weight;
            options
                .entropy_gradient
                .then(|| masked_derivatives(&active, &q, |i, x| x[0].entropy * Dual::constant(weight * up(i))))
        }
    };

    Ok((out, active, derivatives))
}

/// `dL/dlogits` from the derivatives of the loss with respect to each row's quantities, through
/// the softmax's Jacobian (written by hand), the temperature and the soft cap.
fn gradient_of(spec: LossSpec<'_>, logits: &[f64], active: &[bool], d: &[RowDerivatives]) -> Vec<f64> {
    let (rows, options) = (&spec.rows, spec.options);
    let (n, v) = (rows.len(), rows.vocab);
    let row = |i: usize| &logits[i * v..(i + 1) * v];
    let mut grad = vec![0.0; n * v];
    for i in (0..n).filter(|&i| active[i]) {
        let sm = Softmax::of(row(i), options, spec.loss.class_weights());
        let y = rows.targets.map(|y| y[i] as usize);
        for (j, g) in grad[i * v..(i + 1) * v].iter_mut().enumerate() {
            let (log_p, p) = (sm.log_p[j], sm.log_p[j].exp());
            let indicator = if Some(j) == y { 1.0 } else { 0.0 };
            let du = d[i].logp * (indicator - p)
                + d[i].entropy * (-p * (log_p + sm.entropy))
                + d[i].lse * p
                + d[i].mean_u * spec.loss.class_weights().map_or(1.0, |c| c[j] as f64) / v as f64;
            // d u_j / d x_j: 1 / T, times 1 - tanh^2(x_j / c) under a soft cap.
            let slope = options.softcap.map_or(1.0, |c| 1.0 - (row(i)[j] / c).tanh().powi(2));
            *g = du * slope / options.temperature;
        }
    }
    grad
}

/// `d f / d x[t].{logp, entropy, lse, mean_u}` by forward mode, one tangent at a time.
fn derivatives_of(x: &[RowQ<f64>], t: usize, f: impl Fn(&[RowQ<Dual>]) -> Dual) -> RowDerivatives {
    let constant: Vec<RowQ<Dual>> = x
        .iter()
        .map(|r| RowQ {
            logp: Dual::constant(r.logp),
            entropy: Dual::constant(r.entropy),
            lse: Dual::constant(r.lse),
            mean_u: Dual::constant(r.mean_u),
        })
        .collect();
    let seed = |pick: fn(&mut RowQ<Dual>) -> &mut Dual| {
        let mut v = constant.clone();
        let slot = pick(&mut v[t]);
        *slot = Dual::variable(slot.value);
        f(&v).tangent
    };
    RowQ {
        logp: seed(|r| &mut r.logp),
        entropy: seed(|r| &mut r.entropy),
        lse: seed(|r| &mut r.lse),
        mean_u: seed(|r| &mut r.mean_u),
    }
}

/// Derivatives of a row-local loss `f(i, &[row i])` for every active row.
fn masked_derivatives(
    active: &[bool],
    q: &[RowQ<f64>],
    f: impl Fn(usize, &[RowQ<Dual>]) -> Dual,
) -> Vec<RowDerivatives> {
    let row = |i: usize| derivatives_of(&q[i..=i], 0, |x| f(i, x));
    (0..q.len()).map(|i| if active[i] { row(i) } else { RowDerivatives::default() }).collect()
}

/// `(1-s) * (lse - u_y) + s * (lse - mean_j u_j) + z * lse^2`, with `u_y = logp + lse`.
/// Cross-entropy as PyTorch's `F.cross_entropy(weight=c, label_smoothing=s)` writes it, with
/// Liger's z-loss: a row's `(1-s) c_y (-log p_y) + (s/V) sum_j c_j (-log p_j)` (`c = 1` without
/// class weights) plus `z lse^2`; `mean` divides the first by the counted rows' summed `c_y`
/// (0 when they sum to 0) and the z-loss by their number.
struct CrossEntropy<'a> {
    options: &'a LossOptions,
    class_weights: Option<&'a [f32]>,
    targets: &'a [i64],
    vocab: f64,
    /// The reduction's weights of the cross-entropy and the z-loss terms.
    weight: f64,
    z_weight: f64,
}

/// One row's two terms, each already times the detached token scale.
struct CrossEntropyTerms<S> {
    cross_entropy: S,
    z_loss: S,
}

impl<S: Real> CrossEntropyTerms<S> {
    fn total(&self) -> S {
        self.cross_entropy + self.z_loss
    }

    fn reduced(&self, ce: &CrossEntropy) -> S {
        self.cross_entropy * S::constant(ce.weight) + self.z_loss * S::constant(ce.z_weight)
    }
}

impl<'a> CrossEntropy<'a> {
    fn new(
        options: &'a LossOptions,
        class_weights: Option<&'a [f32]>,
        rows: &crate::inputs::Rows<'a>,
        norm: &Normalisers,
    ) -> Self {
        let targets = rows.targets.unwrap_or_default();
        let (weight, z_weight) = match options.reduction {
            Reduction::Mean => {
                (if norm.target_weight == 0.0 { 0.0 } else { 1.0 / norm.target_weight }, 1.0 / norm.valid_rows.max(1.0))
            }
            Reduction::Sum | Reduction::None => (1.0, 1.0),
        };
        Self { options, class_weights, targets, vocab: rows.vocab as f64, weight, z_weight }
    }

    fn loss<S: Real>(&self, row: usize, q: RowQ<S>) -> CrossEntropyTerms<S> {
        let c = S::constant;
        let s = self.options.label_smoothing;
        let class = |j: usize| self.class_weights.map_or(1.0, |w| w[j] as f64);
        let c_y = if self.targets.is_empty() { 1.0 } else { class(self.targets[row] as usize) };
        let total_weight = self.class_weights.map_or(self.vocab, |w| w.iter().map(|&x| x as f64).sum());
        // `sum_j c_j (-log p_j) = (sum_j c_j) lse - sum_j c_j u_j`, with `q.mean_u = sum_j c_j u_j / V`.
        let smoothing = c(total_weight / self.vocab) * q.lse - q.mean_u;
        let scale = if self.options.token_scaling { q.logp.exp().detach() } else { c(1.0) };
        CrossEntropyTerms {
            cross_entropy: (c((1.0 - s) * c_y) * -q.logp + c(s) * smoothing) * scale,
            z_loss: c(self.options.z_loss) * q.lse * q.lse * scale,
        }
    }
}
