"""Study for plate-aware SG-MCMC (issue 55): group blocks by MALA on their exact conditional, against NUTS.

Not a benchmark of the library: hand-written loops that test a design before it is built. Three questions:

``baseline``  today's SGHMC defaults on a conjugate Normal hierarchy with the scale known (closed-form posterior);
``blocks``    each step draws M groups and moves their effects by Langevin (biased) or MALA (exact) on their own
              rows; data passes per effective draw against NumPyro's NUTS on the same model;
``funnel``    the scale latent, moved with the mean by MALA on their conditional given the effects (no data):
              informative groups and weak ones (a funnel), against long NumPyro NUTS references.

Run: ``OMP_NUM_THREADS=1 python benchmarks/studies/hierarchy_blocks.py {baseline,blocks,funnel}`` (NumPyro from the
``bench`` extra). Findings: the closing note of the session that added it.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro.ops.stats import split_gelman_rubin

SIGMA, TAU, PRIOR_SD = 1.0, 0.7, 3.0


def groups(num_groups: int, num_rows: int, seed: int = 0) -> torch.Tensor:
    """Each row's group: Zipf-like sizes (every group has a row), shuffled."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, num_groups + 1, dtype=torch.float64) ** 1.1
    rows = torch.cat([torch.arange(num_groups), torch.multinomial(weights, num_rows - num_groups, True, generator=g)])
    return rows[torch.randperm(num_rows, generator=g)]


def simulate(num_groups: int, num_rows: int, tau: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    grp = groups(num_groups, num_rows, seed)
    g = torch.Generator().manual_seed(seed + 1)
    effects = 1.0 + tau * torch.randn(num_groups, generator=g, dtype=torch.float64)
    return grp, effects[grp] + SIGMA * torch.randn(num_rows, generator=g, dtype=torch.float64)


def known_scale(grp, y, num_groups, batch_size=100):
    """The conjugate hierarchy as a Pyro model: mu ~ N(0, 3), b_k ~ N(mu, 0.7), y_i ~ N(b_g(i), 1)."""
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=y.dtype), PRIOR_SD))
    with pyro.plate("groups", num_groups):
        b = pyro.sample("b", dist.Normal(mu, TAU))
    with pyro.plate("data", len(y), subsample_size=batch_size) as idx:
        pyro.sample("obs", dist.Normal(b[grp[idx]], SIGMA), obs=y[idx])


def exact(grp, y, num_groups):
    """The closed-form posterior of (mu, b): its mean and sds."""
    n = torch.bincount(grp, minlength=num_groups).double()
    sums = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, grp, y)
    precision = torch.zeros(num_groups + 1, num_groups + 1, dtype=torch.float64)
    precision[0, 0] = 1 / PRIOR_SD**2 + num_groups / TAU**2
    precision[0, 1:] = precision[1:, 0] = -1 / TAU**2
    precision[1:, 1:] = torch.diag(n / SIGMA**2 + 1 / TAU**2)
    covariance = torch.linalg.inv(precision)
    return covariance @ torch.cat([torch.zeros(1, dtype=torch.float64), sums / SIGMA**2]), covariance.diagonal().sqrt()


def report(label, draws, mean, sd, passes=None):
    """Max mean error in sds, sd ratios, r_hat and (with ``passes``, all chains' kept ones) passes per ESS."""
    from numpyro.diagnostics import effective_sample_size

    d = draws.numpy() if isinstance(draws, torch.Tensor) else draws
    flat = d.reshape(-1, d.shape[-1])
    err = np.abs((flat.mean(0) - np.asarray(mean)) / np.asarray(sd))
    ratio = flat.std(0) / np.asarray(sd)
    ess = effective_sample_size(d)
    r_hat = float(split_gelman_rubin(torch.as_tensor(d)).max())
    cost = f", {passes / ess.min():.1f} passes per effective draw" if passes is not None else ""
    print(
        f"{label}: max |mean error| {err.max():.3f} sd ({(err > 0.2).sum()} over 0.2), sd ratio "
        f"[{ratio.min():.2f}, {ratio.max():.2f}] ({(np.abs(ratio - 1) > 0.1).sum()} off by > 10%), r_hat {r_hat:.3f}, "
        f"min ESS {ess.min():.0f}{cost}",
        flush=True,
    )


def baseline(seeds: int = 3) -> None:
    from pyro_scalable.infer import SGHMC, StochasticMCMC

    grp, y = simulate(100, 10_000, TAU)
    mean, sd = exact(grp, y, 100)
    for seed in range(seeds):
        mcmc = StochasticMCMC(
            SGHMC(known_scale), num_samples=1000, num_warmup=1000, num_chains=4, seed=seed, progress_bar=False
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mcmc.run(grp, y, 100)
        s = mcmc.get_samples(group_by_chain=True)
        report(
            f"SGHMC defaults, seed {seed} ({len(caught)} warnings)",
            torch.cat([s["mu"][..., None], s["b"]], -1),
            mean,
            sd,
        )


def _group_rows(grp, num_groups):
    sizes = torch.bincount(grp, minlength=num_groups)
    return torch.argsort(grp), torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(sizes, 0)]), sizes.double()


def _mala(x, log_density, step, generator):
    """One MALA move of independent blocks (a log density and gradient per block): an accept per block."""
    lp, g = log_density(x)
    proposal = x + step * g + (2 * step).sqrt() * torch.randn(x.shape, generator=generator, dtype=x.dtype)
    lq, gq = log_density(proposal)
    log_ratio = lq - lp - (x - proposal - step * gq) ** 2 / (4 * step) + (proposal - x - step * g) ** 2 / (4 * step)
    accept = torch.log(torch.rand(x.shape, generator=generator, dtype=x.dtype)) < log_ratio
    return torch.where(accept, proposal, x), accept


def block_sampler(grp, y, num_groups, *, per_step, steps, chains, seed, h, metropolis, tau=None):
    """M groups a step: their effects by Langevin/MALA on their rows; (mu[, log tau]) on the effects alone."""
    gen = torch.Generator().manual_seed(seed)
    order, starts, n = _group_rows(grp, num_groups)
    mu = torch.zeros(chains, dtype=torch.float64)
    log_tau = torch.full((chains,), math.log(TAU) if tau is None else 0.0, dtype=torch.float64)
    b = 0.1 * torch.randn(chains, num_groups, generator=gen, dtype=torch.float64)
    kept, rows, accepted = [], 0, []  # rows read in the kept half, all chains
    for t in range(steps):
        for c in range(chains):
            chosen = torch.randperm(num_groups, generator=gen)[:per_step]
            idx = torch.cat([order[starts[k] : starts[k + 1]] for k in chosen.tolist()])
            rows += len(idx)
            slot = torch.zeros(num_groups, dtype=torch.long)
            slot[chosen] = torch.arange(per_step)
            at, yi, scale = slot[grp[idx]], y[idx], float(log_tau[c].exp())

            def effects(bs, at=at, yi=yi, c=c, scale=scale):
                resid = yi - bs[at]
                sq = torch.zeros(per_step, dtype=torch.float64).index_add_(0, at, resid**2)
                total = torch.zeros(per_step, dtype=torch.float64).index_add_(0, at, resid)
                lp = -0.5 * (bs - mu[c]) ** 2 / scale**2 - 0.5 * sq / SIGMA**2
                return lp, -(bs - mu[c]) / scale**2 + total / SIGMA**2

            step = h / (n[chosen] / SIGMA**2 + 1 / scale**2)
            if metropolis:
                b[c, chosen], accept = _mala(b[c, chosen], effects, step, gen)
                accepted.append(float(accept.double().mean()))
            else:
                _, grad = effects(b[c, chosen])
                noise = torch.randn(per_step, generator=gen, dtype=torch.float64)
                b[c, chosen] = b[c, chosen] + step * grad + (2 * step).sqrt() * noise
            mu[c], log_tau[c] = _hyper_move(b[c], mu[c], log_tau[c], num_groups, gen, free_scale=tau is not None)
        if t >= steps // 2:
            kept.append(torch.cat([mu[:, None], log_tau.exp()[:, None], b], 1).clone())
    draws = torch.stack(kept, 1)  # passes over the data in the kept half, all chains together
    return draws, rows * (len(kept) / steps) / len(y), (sum(accepted) / len(accepted) if accepted else None)


def _hyper_move(b, mu, log_tau, num_groups, gen, free_scale):
    """(mu, log tau) given the effects: MALA on their exact conditional (G terms, no data); tau fixed unless free."""
    v = torch.stack([mu, log_tau])

    def conditional(v):
        m, lt = v[0], v[1]
        tau = lt.exp()
        sq = ((b - m) ** 2).sum()
        lp = -0.5 * m**2 / PRIOR_SD**2 - num_groups * lt - 0.5 * sq / tau**2
        grad_lt = -num_groups + sq / tau**2
        if free_scale:  # HalfNormal(1) on tau, with the log's Jacobian
            lp, grad_lt = lp - 0.5 * tau**2 + lt, grad_lt - tau**2 + 1
        else:
            grad_lt = torch.zeros_like(grad_lt)
        return lp, torch.stack([-m / PRIOR_SD**2 + (b - m).sum() / tau**2, grad_lt])

    tau = float(log_tau.exp())
    step = 0.5 / torch.tensor([1 / PRIOR_SD**2 + num_groups / tau**2, 2.0 * num_groups], dtype=torch.float64)
    lp, g = conditional(v)
    proposal = v + step * g + (2 * step).sqrt() * torch.randn(2, generator=gen, dtype=torch.float64)
    if not free_scale:
        proposal[1] = v[1]
    lq, gq = conditional(proposal)
    log_ratio = lq - lp - ((v - proposal - step * gq) ** 2 / (4 * step)).sum()
    log_ratio = log_ratio + ((proposal - v - step * g) ** 2 / (4 * step)).sum()
    if math.log(float(torch.rand((), generator=gen, dtype=torch.float64))) < float(log_ratio):
        return proposal[0], proposal[1]
    return mu, log_tau


def nuts(grp, y, num_groups, *, free_scale, warmup, samples, seed=0):
    """NumPyro's NUTS on the same model: draws of (mu, tau, b) and the leapfrog steps of each kept draw."""
    import jax
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as nd
    from numpyro.infer import MCMC, NUTS

    jax.config.update("jax_enable_x64", True)
    g, obs = jnp.asarray(grp.numpy()), jnp.asarray(y.numpy())

    def model():  # the scale known: centred (the better one for NUTS on informative groups); free: non-centred
        mu = numpyro.sample("mu", nd.Normal(0.0, PRIOR_SD))
        tau = numpyro.sample("tau", nd.HalfNormal(1.0)) if free_scale else TAU
        with numpyro.plate("groups", num_groups):
            z = numpyro.sample("z", nd.Normal(0.0, 1.0)) if free_scale else numpyro.sample("b", nd.Normal(mu, tau))
        numpyro.sample("obs", nd.Normal((mu + tau * z if free_scale else z)[g], SIGMA), obs=obs)

    mcmc = MCMC(NUTS(model), num_warmup=warmup, num_samples=samples, num_chains=1, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed), extra_fields=("num_steps",))
    s = mcmc.get_samples()
    tau = np.asarray(s["tau"]) if free_scale else np.full(samples, TAU)
    b = np.asarray(s["mu"])[:, None] + tau[:, None] * np.asarray(s["z"]) if free_scale else np.asarray(s["b"])
    return np.concatenate([np.asarray(s["mu"])[:, None], tau[:, None], b], 1), np.asarray(
        mcmc.get_extra_fields()["num_steps"]
    )


def blocks() -> None:
    grp, y = simulate(100, 10_000, TAU)
    mean, sd = exact(grp, y, 100)
    mean = torch.cat([mean[:1], torch.tensor([TAU], dtype=torch.float64), mean[1:]])
    sd = torch.cat([sd[:1], torch.ones(1, dtype=torch.float64), sd[1:]])  # tau is known: its column is constant
    keep = np.r_[0, 2:102]
    draws, steps = nuts(grp, y, 100, free_scale=False, warmup=1000, samples=1000)
    report("NUTS", draws[None][..., keep], mean[keep], sd[keep], passes=float(steps.sum()))
    for label, metropolis, h in (("Langevin blocks, h = 0.3", False, 0.3), ("MALA blocks, h = 1", True, 1.0)):
        for per_step in (10, 100):
            t = time.perf_counter()
            draws, passes, accepted = block_sampler(
                grp,
                y,
                100,
                per_step=per_step,
                steps=4000 if per_step == 10 else 600,
                chains=4,
                seed=0,
                h=h,
                metropolis=metropolis,
            )
            extra = f", accepted {accepted:.2f}" if accepted is not None else ""
            report(
                f"{label}, M = {per_step}{extra}, {time.perf_counter() - t:.0f} s",
                draws[..., keep],
                mean[keep],
                sd[keep],
                passes,
            )


def funnel() -> None:
    for label, rows, tau in (("informative groups", 10_000, 0.7), ("weak groups (a funnel)", 600, 0.15)):
        grp, y = simulate(100, rows, tau)
        sizes = torch.bincount(grp)
        reference, steps = nuts(grp, y, 100, free_scale=True, warmup=2000, samples=8000)
        mean, sd = reference.mean(0), reference.std(0)
        print(f"[{label}: {int(sizes.min())}-{int(sizes.max())} rows a group, tau {tau}]")
        report("  NUTS (the reference, non-centred)", reference[None], mean, sd, passes=float(steps.sum()))
        draws, passes, accepted = block_sampler(
            grp, y, 100, per_step=10, steps=4000, chains=4, seed=1, h=1.0, metropolis=True, tau="free"
        )
        report(f"  centred MALA blocks, M = 10, accepted {accepted:.2f}", draws, mean, sd, passes)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", choices=("baseline", "blocks", "funnel"))
    torch.set_default_dtype(torch.float64)
    {"baseline": baseline, "blocks": blocks, "funnel": funnel}[parser.parse_args().study]()
