//! Forward-mode automatic differentiation on one tangent: the reference writes each loss once,
//! generically, and gets its exact derivative from the same code instead of from a second,
//! hand-derived formula (which is what the fused objective has, and what this checks).
//!
//! `min` and `clamp` follow PyTorch's autograd: `torch.min(a, b)` gives each side half the
//! gradient on a tie; `clamp` passes the gradient on the closed interval.

use std::ops::{Add, Div, Mul, Neg, Sub};

/// A number the reference losses are written over: `f64` for values, [`Dual`] for derivatives.
pub trait Real:
    Copy + Add<Output = Self> + Sub<Output = Self> + Mul<Output = Self> + Div<Output = Self> + Neg<Output = Self>
{
    fn constant(value: f64) -> Self;
    fn value(self) -> f64;
    fn exp(self) -> Self;
    /// The same value with no derivative (`tensor.detach()`).
    fn detach(self) -> Self {
        Self::constant(self.value())
    }
    fn sigmoid(self) -> Self {
        Self::constant(1.0) / (Self::constant(1.0) + (-self).exp())
    }
}

impl Real for f64 {
    fn constant(value: f64) -> Self {
        value
    }
    fn value(self) -> f64 {
        self
    }
    fn exp(self) -> Self {
        f64::exp(self)
    }
}

/// `value + tangent * epsilon`, with `epsilon^2 = 0`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dual {
    pub value: f64,
    pub tangent: f64,
}

impl Dual {
    pub fn variable(value: f64) -> Self {
        Self { value, tangent: 1.0 }
    }
}

impl Real for Dual {
    fn constant(value: f64) -> Self {
        Self { value, tangent: 0.0 }
    }
    fn value(self) -> f64 {
        self.value
    }
    fn exp(self) -> Self {
        let e = self.value.exp();
        Self { value: e, tangent: e * self.tangent }
    }
}

impl Add for Dual {
    type Output = Self;
    fn add(self, o: Self) -> Self {
        Self { value: self.value + o.value, tangent: self.tangent + o.tangent }
    }
}

impl Sub for Dual {
    type Output = Self;
    fn sub(self, o: Self) -> Self {
        Self { value: self.value - o.value, tangent: self.tangent - o.tangent }
    }
}

impl Mul for Dual {
    type Output = Self;
    fn mul(self, o: Self) -> Self {
        Self { value: self.value * o.value, tangent: self.tangent * o.value + self.value * o.tangent }
    }
}

impl Div for Dual {
    type Output = Self;
    fn div(self, o: Self) -> Self {
        Self {
            value: self.value / o.value,
            tangent: (self.tangent * o.value - self.value * o.tangent) / (o.value * o.value),
        }
    }
}

impl Neg for Dual {
    type Output = Self;
    fn neg(self) -> Self {
        Self { value: -self.value, tangent: -self.tangent }
    }
}

/// `torch.min(a, b)` (elementwise): on a tie each side gets half the gradient.
pub fn torch_min<S: Real>(a: S, b: S) -> S {
    let half = S::constant(0.5);
    if a.value() < b.value() {
        a
    } else if b.value() < a.value() {
        b
    } else {
        half * a + half * b
    }
}

/// `torch.abs(x)`: gradient `sign(x)`, 0 at 0.
pub fn torch_abs<S: Real>(x: S) -> S {
    if x.value() > 0.0 {
        x
    } else if x.value() < 0.0 {
        -x
    } else {
        S::constant(0.0)
    }
}

/// `torch.clamp(x, lo, hi)`: the gradient passes where `lo <= x <= hi`.
pub fn clamp<S: Real>(x: S, lo: Option<f64>, hi: Option<f64>) -> S {
    match (lo, hi) {
        (Some(l), _) if x.value() < l => S::constant(l),
        (_, Some(h)) if x.value() > h => S::constant(h),
        _ => x,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derivatives_of_elementary_functions() {
        let x = Dual::variable(0.3);
        let y = (x * x).exp() / (Dual::constant(1.0) + x) - x.sigmoid();
        let f = |x: f64| (x * x).exp() / (1.0 + x) - 1.0 / (1.0 + (-x).exp());
        let h = 1e-6;
        let fd = (f(0.3 + h) - f(0.3 - h)) / (2.0 * h);
        assert!((y.value - f(0.3)).abs() < 1e-15);
        assert!((y.tangent - fd).abs() < 1e-8, "{} vs {fd}", y.tangent);
        assert_eq!(torch_min(x, Dual::constant(0.3)).tangent, 0.5);
        assert_eq!(clamp(x, Some(0.0), Some(0.3)).tangent, 1.0);
        assert_eq!(clamp(x, Some(0.0), Some(0.2)).tangent, 0.0);
        assert_eq!(x.detach().tangent, 0.0);
    }
}
