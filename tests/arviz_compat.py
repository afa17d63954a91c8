"""The few places the tests read ArviZ differently on its two majors (0.x ``InferenceData``, 1.x ``DataTree``)."""

from __future__ import annotations

import pytest

from pyro_scalable.inference_data import ARVIZ_MAJOR

#: arviz.from_pyro exists on 0.x only; on 1.x pyro_scalable.to_inference_data is the converter.
needs_from_pyro = pytest.mark.skipif(ARVIZ_MAJOR >= 1, reason="arviz 1.x has no from_pyro (0.x only)")


def group_names(idata) -> set[str]:
    """The groups: ``InferenceData.groups()`` on 0.x, a ``DataTree``'s children on 1.x."""
    return set(idata.children) if ARVIZ_MAJOR >= 1 else set(idata.groups())


def elpd_loo(loo) -> float:
    """The PSIS-LOO estimate: ``elpd_loo`` on 0.x, ``elpd`` on 1.x."""
    return float(loo.elpd if ARVIZ_MAJOR >= 1 else loo.elpd_loo)


def loo_estimate(idata) -> float:
    """``az.loo``'s elpd, without its Pareto-k notice (about the model and the draws, not about the conversion)."""
    import warnings

    import arviz as az

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Estimated shape parameter of Pareto", category=UserWarning)
        return elpd_loo(az.loo(idata))
