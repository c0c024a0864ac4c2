"""Per-token NLL and entropy from hidden states and lm_head in JAX, both back-propagated (an RL
actor's log-probabilities and entropy bonus), one `jax.jit`-compiled `value_and_grad` per step,
the arms alternated in every round (A B, then B A):

- `flashgrpo`: `flashgrpo.jax.fused_linear_token_stats`, one stream of the vocabulary forward and
  one backward (the logits never materialised);
- `jax`: the same in plain JAX (`hidden @ weight.T`, `jax.nn.log_softmax`), XLA fusing what it
  can, the `[N, V]` logits materialised.

Prints one JSON line per arm: step times per round and their median (s). With `--only ARM`, that
arm alone, and its peak memory above the inputs and their gradients (`VmHWM` after the steps
minus the resident size once the inputs exist, the peak reset there, less the gradients, MiB):
run each arm in a process of its own for that.
Usage: python bench/peers/jax_token_stats.py [--n 1024] [--hidden 896] [--vocab 151936]
[--dtype f32|bf16] [--rounds 3] [--only flashgrpo|jax]"""


import jax

jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402

import flashgrpo.jax as fj  # noqa: E402
from arms import alternated, parser, print_arms, reset_peak, resident_mib  # noqa: E402

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def objective(arm, hidden, weight, target, d_nll, d_ent):
    """`sum(d_nll * nll) + sum(d_ent * entropy)` under `arm`."""
    if arm == "flashgrpo":
        stats = fj.fused_linear_token_stats(hidden, weight, target)
        logp, entropy = stats.logp, stats.entropy
    else:
        logsm = jax.nn.log_softmax((hidden @ weight.T).astype(jnp.float32), axis=-1)
        logp = jnp.take_along_axis(logsm, target[:, None], axis=-1)[:, 0]
        entropy = -(jnp.exp(logsm) * logsm).sum(-1)
    return (-logp * d_nll).sum() + (entropy * d_ent).sum()


def main():
    p = parser(["flashgrpo", "jax"])
    a = p.parse_args()
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    dtype = DTYPES[a.dtype]
    hidden = jax.random.normal(k[0], (a.n, a.hidden)).astype(dtype)
    weight = (jax.random.normal(k[1], (a.vocab, a.hidden)) * (2.0 / a.hidden**0.5)).astype(dtype)
    target = jax.random.randint(k[2], (a.n,), 0, a.vocab)
    d_nll, d_ent = jax.random.normal(k[3], (a.n,)), jax.random.normal(k[4], (a.n,))
    jax.block_until_ready((hidden, weight, target, d_nll, d_ent))
    reset_peak()
    base = resident_mib("VmRSS")
    arms = [a.only] if a.only else ["flashgrpo", "jax"]
    steps = {arm: jax.jit(jax.value_and_grad(lambda h, w, arm=arm: objective(arm, h, w, target, d_nll, d_ent),
                                             argnums=(0, 1))) for arm in arms}
    for arm in arms:  # compilation, pages, thread pools
        jax.block_until_ready(steps[arm](hidden, weight))
    times = alternated(arms, a.rounds, lambda arm: jax.block_until_ready(steps[arm](hidden, weight)))
    grads = (hidden.nbytes + weight.nbytes) / 2**20
    peak = resident_mib("VmHWM") - base - grads if a.only else None
    print_arms(times, dict(n=a.n, hidden=a.hidden, vocab=a.vocab, dtype=a.dtype), peak)


if __name__ == "__main__":
    main()
