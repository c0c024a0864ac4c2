//! What the bf16 product examples (`bf16_products`, `vocab_outer_products`) share: their
//! arguments, the bf16 way they run, and one fused-linear chunk's synthetic bf16 inputs, so that
//! both time the same products on the same numbers.

use flashgrpo_kernels::matmul_bf16::{self, Bf16Products};
use flashgrpo_kernels::synthetic::normal_matrix;

/// Positional argument `i` (1-based) as a number, else `default`.
pub fn arg(i: usize, default: usize) -> usize {
    std::env::args().nth(i).map_or(default, |s| s.parse().expect("a number"))
}

/// The way `FLASHGRPO_BF16_PRODUCTS` picks on this machine, if it runs the packed kernels (else
/// says so and gives `None`: the widened products are the f32 ones, timed elsewhere).
pub fn packed_products() -> Option<Bf16Products> {
    let products = matmul_bf16::current();
    if !products.packed() {
        println!("{products:?}: the bf16 products are widened to f32 on this machine");
    }
    products.packed().then_some(products)
}

/// Hidden states (`n x h`, unit normal) and a weight (`v x h`, scale 0.05) as bf16 bits.
pub fn hidden_and_weight(n: usize, h: usize, v: usize) -> (Vec<u16>, Vec<u16>) {
    (bf16_bits(normal_matrix(n, h, 1.0, 1)), bf16_bits(normal_matrix(v, h, 0.05, 2)))
}

fn bf16_bits(x: Vec<f32>) -> Vec<u16> {
    x.into_iter().map(|x| half::bf16::from_f32(x).to_bits()).collect()
}
