r"""At temperature 0 the momentum samplers are SGD with momentum: the hyperparameters that make them so.

**SGHMC** (momentum :math:`m`, mass :math:`\sigma^2`, friction :math:`\alpha`; :mod:`.sghmc`). Writing
:math:`b_t = -m_t / \epsilon`, the update is
:math:`b_{t+1} = \mu b_t + \nabla(-\log p)`, :math:`\theta_{t+1} = \theta_t - \eta\, b_{t+1}` — exactly
``torch.optim.SGD(lr=η, momentum=μ)`` from a zero momentum buffer — with

.. math::

    \eta = \epsilon^2 / \sigma^2, \qquad \mu = 1 - \epsilon\,\alpha / \sigma^2
    \qquad\Longleftrightarrow\qquad
    \epsilon = \sigma\sqrt{\eta}, \qquad \alpha = \sigma (1 - \mu) / \sqrt{\eta} .

(for a constant step size; :func:`sghmc_hyperparameters` does the conversion).

**BAOAB** (momentum :math:`p`, mass :math:`m`, :math:`c = e^{-\gamma\epsilon}`; :mod:`.baoab`). O becomes
:math:`p \leftarrow c\,p`. Writing :math:`b_t = -p'_t/\epsilon` (:math:`p'_t` the momentum after step :math:`t`'s
kick), a constant step gives
:math:`b_t = c\,b_{t-1} + \nabla(-\log p)(\theta_t)` and :math:`\theta_{t+1} = \theta_t - \tfrac{\epsilon^2(1 + c)}
{2m} b_t` — exactly ``torch.optim.SGD(lr=η, momentum=μ)`` from a zero momentum buffer, with

.. math::

    \eta = \frac{\epsilon^2 (1 + c)}{2m}, \quad \mu = c = e^{-\gamma\epsilon}
    \qquad\Longleftrightarrow\qquad
    \epsilon = \sqrt{\frac{2 m \eta}{1 + \mu}}, \quad \gamma = -\frac{\ln\mu}{\epsilon}

(:func:`baoab_hyperparameters`; :math:`0 < \mu < 1`).
"""

from __future__ import annotations

import math

__all__ = ["baoab_hyperparameters", "sghmc_hyperparameters"]


def sghmc_hyperparameters(lr: float, momentum: float, mass: float = 1.0) -> dict[str, float]:
    """SGHMC's ``step_size`` and ``friction`` whose T = 0 trajectory is ``torch.optim.SGD(lr=lr, momentum=momentum)``.

    Example:
        >>> sghmc_hyperparameters(lr=0.01, momentum=0.9)
        {'step_size': 0.1, 'friction': 1.0}

    """
    if not (lr > 0 and 0 <= momentum < 1 and mass > 0):
        raise ValueError(f"need lr > 0, 0 <= momentum < 1 and mass > 0; got {lr=}, {momentum=}, {mass=}.")
    step_size = math.sqrt(lr * mass)
    return {"step_size": step_size, "friction": round(mass * (1.0 - momentum) / step_size, 15)}


def baoab_hyperparameters(lr: float, momentum: float, mass: float = 1.0) -> dict[str, float]:
    """BAOAB's ``step_size`` and ``friction`` whose T = 0 trajectory is ``torch.optim.SGD(lr=lr, momentum=momentum)``.

    Example:
        >>> {k: round(v, 6) for k, v in baoab_hyperparameters(lr=0.01, momentum=0.9).items()}
        {'step_size': 0.102598, 'friction': 1.026927}

    """
    if not (lr > 0 and 0 < momentum < 1 and mass > 0):
        raise ValueError(f"need lr > 0, 0 < momentum < 1 and mass > 0; got {lr=}, {momentum=}, {mass=}.")
    step_size = math.sqrt(2.0 * mass * lr / (1.0 + momentum))
    return {"step_size": step_size, "friction": -math.log(momentum) / step_size}
