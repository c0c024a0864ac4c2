"""Fits `math::EXP2_POLY_DEG5`: 2^f on [0, 1) as 1 + f (c1 + c2 f + ... + c5 f^4), for the least
maximum relative error (Lawson's iteratively reweighted least squares on a grid), then checks the
f32 coefficients evaluated in f32 Horner form with fused multiply-adds.

Run with any Python that has numpy, e.g. `.venv-peers/bin/python bench/tools/fit_exp2_poly.py`.
"""

import numpy as np

f = np.linspace(0, 1, 20001)
y = 2.0**f
basis = np.stack([f**k for k in range(1, 6)], axis=1) / y[:, None]
rhs = (y - 1) / y
w = np.ones_like(f) / len(f)
for _ in range(2000):
    sw = np.sqrt(w)
    c, *_ = np.linalg.lstsq(basis * sw[:, None], rhs * sw, rcond=None)
    w = w * np.abs(basis @ c - rhs)
    w /= w.sum()
print("max relative error, exact arithmetic:", np.abs(basis @ c - rhs).max())

c32 = np.float32(c)


def fma32(a, b, c):
    # The product of two f32 is exact in f64; one rounding of the sum to f32 models the FMA.
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


x = np.float32(np.linspace(0, 1, 200001, endpoint=False))
p = np.full_like(x, c32[4])
for k in [3, 2, 1, 0]:
    p = fma32(p, x, c32[k])
p = fma32(p, x, np.float32(1.0))
print("max relative error, f32 Horner with FMA:", np.abs(p.astype(np.float64) / 2.0 ** x.astype(np.float64) - 1).max())
print("EXP2_POLY_DEG5 (highest degree first):", [float(v) for v in c32[::-1]] + [1.0])
