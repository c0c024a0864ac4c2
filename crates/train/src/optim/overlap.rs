//! Summing the gradients over the ranks while the backward still runs, as PyTorch's DDP does:
//! the backward completes the layers from the last to the first, and each layer's gradients are
//! final as soon as its backward is done (on an update's last micro-batch), so a second thread
//! all-reduces them while the layers below are computed. What is left to sum after the backward
//! (the embedding, the final norm) is summed by [`super::Updater::reduce`].
//!
//! Every rank must make the same all-reduces in the same order: the groups are summed in their
//! fixed order, each when the backward hands it over or, for a rank that runs no backward on
//! them (a vocabulary-parallel rank other than its group's first, a data-parallel rank with no
//! sequences this step), right after its update, in the same order.

use std::sync::mpsc;
use std::time::Instant;

use flashgrpo_collective::Collective;

use super::grads::sum_together;
use super::GradBuffers;
use crate::error::{Result, TrainError};

/// Hands group `g` (and every group before it not handed yet) to the summing thread.
pub type HandOver<'a> = dyn FnMut(usize, &mut GradBuffers) + Send + 'a;

/// Runs `body(grads, hand_over)` while a second thread sums each group of `groups` (parameter
/// indices) over `comm` once handed over; then sums the groups never handed over and puts every
/// summed buffer back. Returns `body`'s result, the indices summed, and the seconds spent after
/// `body` waiting for the sums (the communication the overlap did not hide).
pub fn overlapped<R>(
    grads: &mut GradBuffers,
    groups: &[Vec<usize>],
    comm: &dyn Collective,
    body: impl FnOnce(&mut GradBuffers, &mut HandOver<'_>) -> Result<R>,
) -> Result<(R, Vec<usize>, f64)> {
    std::thread::scope(|scope| {
        let (to_sum, inbox) = mpsc::channel::<(usize, Vec<Vec<f32>>)>();
        let (to_return, summed) = mpsc::channel::<Result<(usize, Vec<Vec<f32>>)>>();
        scope.spawn(move || {
            for (g, mut buffers) in inbox {
                let result = sum_together(comm, &mut buffers).map(|_| (g, buffers));
                let failed = result.is_err();
                if to_return.send(result).is_err() || failed {
                    break;
                }
            }
        });
        let mut next = 0;
        let mut hand_over = move |g: usize, grads: &mut GradBuffers| {
            while next <= g && next < groups.len() {
                let buffers = groups[next].iter().map(|&i| grads.take(i)).collect();
                // The thread only stops early on an error, which `summed` reports.
                let _ = to_sum.send((next, buffers));
                next += 1;
            }
        };
        let out = body(grads, &mut hand_over)?;
        hand_over(groups.len().saturating_sub(1), grads);
        drop(hand_over);
        let started = Instant::now();
        for _ in 0..groups.len() {
            let (g, buffers) =
                summed.recv().map_err(|_| TrainError::Other("the gradient-summing thread stopped".into()))??;
            for (&i, b) in groups[g].iter().zip(buffers) {
                grads.put(i, b);
            }
        }
        let waited = started.elapsed().as_secs_f64();
        Ok((out, groups.iter().flatten().copied().collect(), waited))
    })
}
