//! Times the three fused-linear bf16 products of one chunk (n rows) over the whole vocabulary.
use flashgrpo_kernels::matmul::{Mat, MatMut};
use flashgrpo_kernels::matmul_bf16::{self, PackedHidden};
use std::time::Instant;

fn main() {
    let arg = |i: usize, d: usize| std::env::args().nth(i).map(|s| s.parse().unwrap()).unwrap_or(d);
    let (n, h, v, reps, tile) = (arg(1, 256), arg(2, 896), arg(3, 151936), arg(4, 3), arg(5, 1024));
    let products = matmul_bf16::current();
    let bits = |x: Vec<f32>| -> Vec<u16> { x.into_iter().map(|x| half::bf16::from_f32(x).to_bits()).collect() };
    let hc = bits(flashgrpo_kernels::synthetic::normal_matrix(n, h, 1.0, 1));
    let wt_owned = bits(flashgrpo_kernels::synthetic::normal_matrix(v, h, 0.05, 2));
    let mut wt_store = vec![0u16; v * h + 32];
    let off = if std::env::var("ALIGN").is_ok() {
        (64 - (wt_store.as_ptr() as usize % 64)) % 64 / 2
    } else {
        (64 - (wt_store.as_ptr() as usize % 64)) % 64 / 2 + 8
    };
    wt_store[off..off + v * h].copy_from_slice(&wt_owned);
    let wt = &wt_store[off..off + v * h];
    eprintln!("weight at {} mod 64", wt.as_ptr() as usize % 64);
    let mut z = vec![1.0f32; n * v];
    let mut dh = vec![0.0f32; n * h];
    let mut dw = vec![1.0f32; v * h];
    let mut partials = vec![];
    let mut packed = PackedHidden::default();
    packed.pack(&hc, n, h, products);
    let flops = 2.0 * (n * h * v) as f64 / 1e9;
    let (mut tl, mut tg, mut th) = (vec![], vec![], vec![]);
    for _ in 0..reps {
        let t = Instant::now();
        matmul_bf16::logits(&mut MatMut::new(&mut z, n, v), false, &packed, wt, tile);
        tl.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        matmul_bf16::gradients(
            &mut MatMut::new(&mut dh, n, h),
            Some(&mut dw),
            true,
            Mat::new(&z, n, v),
            wt,
            &packed,
            tile,
            &mut partials,
        );
        tg.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        matmul_bf16::gradients(
            &mut MatMut::new(&mut dh, n, h),
            None,
            true,
            Mat::new(&z, n, v),
            wt,
            &packed,
            tile,
            &mut partials,
        );
        th.push(t.elapsed().as_secs_f64());
    }
    let med = |t: &mut Vec<f64>| {
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };
    let (l, g, dho) = (med(&mut tl), med(&mut tg), med(&mut th));
    println!("dh alone {:.3} s, dw {:.3} s", dho, g - dho);
    let gf = if products.rounded() { 2.0 } else { 10.0 / 3.0 };
    println!(
        "{:?} n {n}: logits {:.3} s {:.0} GFLOP/s; gradients {:.3} s {:.0} counted GFLOP/s ({:.0} executed)",
        products,
        l,
        flops / l,
        g,
        2.0 * flops / g,
        gf * flops / g
    );
    std::hint::black_box((&z, &dh, &dw));
}
