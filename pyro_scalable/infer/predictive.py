"""Posterior predictive draws for every engine: one draw of the observed sites per posterior draw.

:func:`sample_posterior_predictive` runs the model on full data (every ``subsample_size`` plate switched off),
conditioned on each posterior draw in turn (vectorised over draws where the model broadcasts, in chunks), and
samples its observed sites. ``StochasticMCMC`` and the SWAG and EKF posteriors offer it as
``posterior_predictive(*args)``; ``SampleThenOptimize`` and ``LaplacePosterior`` with ``linearized=False`` (by
default they draw ``y`` at the linearised network instead). ``pyro.infer.Predictive`` gives the same law when
handed the full-data model (``result.kernel.model`` or ``FullDataModel(model)``), never the subsampled model
itself, which would predict a random minibatch of the points.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor

from pyro_scalable.arguments import check_seed
from pyro_scalable.bridge.predictive import predictive_draws

__all__ = ["sample_posterior_predictive"]


def sample_posterior_predictive(
    model: Callable,
    samples: Mapping[str, Tensor],
    *args: Any,
    seed: int | None = None,
    return_sites: Sequence[str] | None = None,
    **kwargs: Any,
) -> dict[str, Tensor]:
    """Draw the model's observed sites once per posterior draw, on full data, at the inputs ``args``/``kwargs``.

    What ``pyro.infer.Predictive(FullDataModel(model), posterior_samples=samples)(*args, **kwargs)`` returns, but
    with each site ``(S, *site shape)`` (no singleton plate dims), observed sites always sampled (passing ``y``
    gives a draw of ``y``, not ``y``), reproducible with ``seed``, and vectorised over draws where the model
    broadcasts over a leading dim (checked against a run on the first draw alone; otherwise one draw at a time).

    Args:
        model: the Pyro model as written (its ``subsample_size`` plates run on all the points of ``args``), or a
            ``FullDataModel``. A plate written with ``subsample=idx`` (DataLoader style) needs the new points'
            indices in ``args``/``kwargs``, or ``idx=None`` where its size is the number of points.
        samples: constrained posterior draws ``{site: (S, *site shape)}``, e.g. ``mcmc.get_samples()`` (chains
            flattened into ``S``); a latent left out is drawn from its prior.
        args: the model's arguments at the inputs to predict at (no ``y`` needed); new inputs may have any length.
        seed: seeds the draws (``None``: torch's global generator, so ``pyro.set_rng_seed`` applies).
        return_sites: site names to return (default: every sample site not in ``samples``: the observed ones).

    Returns:
        ``{site: (S, *site shape)}``, on the inputs' device.

    Example:
        >>> import pyro, pyro.distributions as dist, torch
        >>> def model(x, y=None):
        ...     w = pyro.sample("w", dist.Normal(0.0, 1.0))
        ...     with pyro.plate("data", len(x), subsample_size=10) as idx:
        ...         pyro.sample("y", dist.Normal(w * x[idx], 0.1), obs=None if y is None else y[idx])
        >>> draws = {"w": torch.randn(200)}
        >>> sample_posterior_predictive(model, draws, torch.linspace(0, 1, 37), seed=0)["y"].shape
        torch.Size([200, 37])

    """
    check_seed("seed", seed)
    if not callable(model):
        raise TypeError(f"model must be a Pyro model (a callable), got {type(model).__name__}.")
    if not isinstance(samples, Mapping) or not all(isinstance(v, Tensor) for v in samples.values()):
        raise TypeError("samples must be a dict of tensors {site: (S, *site shape)}, e.g. mcmc.get_samples().")
    return predictive_draws(model, samples, args, kwargs, return_sites=return_sites, seed=seed)
