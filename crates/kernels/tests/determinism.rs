//! Same inputs, same bits: for 1, 2 and 7 threads, run to run, and in place vs out of place.

mod common;

use common::{Case, Op};
use flashgrpo_kernels::{forward_backward, forward_backward_in_place, Element, ImportanceSamplingLevel, LossOutput};
use half::bf16;

fn run<T: Element>(threads: usize, case: &Case) -> (LossOutput, Vec<T>, LossOutput, Vec<T>) {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    pool.install(|| {
        let data = case.data();
        let logits: Vec<T> = data.logits_as();
        let mut grad = vec![T::default(); logits.len()];
        let out = forward_backward(data.spec(), &logits, &mut grad).unwrap();
        let mut in_place = logits.clone();
        let out_in_place = forward_backward_in_place(data.spec(), &mut in_place).unwrap();
        (out, grad, out_in_place, in_place)
    })
}

fn check<T: Element>(case: &Case) {
    let (out1, grad1, ip_out1, ip_grad1) = run::<T>(1, case);
    assert_eq!(out1, ip_out1, "in place vs out of place outputs {case:?}");
    assert_eq!(grad1, ip_grad1, "in place vs out of place gradient {case:?}");
    for threads in [2, 7, 2] {
        let (out, grad, _, _) = run::<T>(threads, case);
        assert_eq!(out.loss.to_bits(), out1.loss.to_bits(), "{threads} threads {case:?}");
        assert_eq!(out, out1, "{threads} threads {case:?}");
        assert_eq!(grad, grad1, "{threads} threads {case:?}");
    }
}

#[test]
fn bitwise_identical_for_any_thread_count_and_in_place() {
    let cases = [
        Case::new(Op::Grpo, 4, 33, 3001).with(|o| {
            o.beta = 0.04;
            o.entropy_coef = 0.01;
            o.importance_sampling_level = ImportanceSamplingLevel::Sequence;
        }),
        Case::new(Op::CrossEntropy, 3, 50, 777).with(|o| o.label_smoothing = 0.1),
        Case::new(Op::Logprob, 1, 200, 64),
        Case::new(Op::Grpo, 1, 3, 40_000),
    ];
    for case in &cases {
        check::<f32>(case);
        check::<bf16>(case);
    }
}
