r"""Two laws the HMM ports need that Pyro lacks in the form Stan writes them.

:class:`StanHMM` scores a hidden Markov chain's observations by Stan's forward algorithm: the first state's weights
all 1, :math:`\gamma_1(k) = \log p(y_1 \mid k)`, then :math:`\gamma_t(k) = \log\sum_j \exp(\gamma_{t-1}(j) +
\log\theta_{jk} + \log p(y_t \mid k))`, and :math:`\log p = \log\sum_k \exp\gamma_T(k)`. With :math:`M_t(j, k) =
\log\theta_{jk} + \log p(y_t \mid k)` that is :math:`\gamma_1 \otimes M_2 \otimes \cdots \otimes M_T` in the
(log-sum-exp, +) semiring, which the class contracts pairwise (depth log T, as Pyro's ``DiscreteHMM`` does) in plain
torch operations: Pyro's ``DiscreteHMM`` computes the same product through a custom autograd function that
``torch.func.vmap`` refuses, so engines that vmap over chains could not run it.

:class:`OrderedNormal` is Stan's ``ordered`` / ``positive_ordered`` vector with a ``normal`` prior on each element.
"""

from __future__ import annotations

import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from torch import Tensor

__all__ = ["OrderedNormal", "StanHMM"]

_MAX_REJECTIONS = 1000


class OrderedNormal(dist.TorchDistribution):
    """Independent ``Normal(loc[k], scale[k])`` restricted to increasing (and, if ``positive``, positive) vectors.

    As in a Stan model's target, ``log_prob`` leaves out the log-probability of the restriction (a constant).
    ``sample`` draws by rejection (for initial values and prior draws).
    """

    arg_constraints = {"loc": constraints.real_vector, "scale": constraints.independent(constraints.positive, 1)}

    def __init__(self, loc: Tensor, scale: Tensor, positive: bool = False, validate_args: bool | None = None):
        self.loc, self.scale = torch.broadcast_tensors(loc, scale)
        self.positive = positive
        super().__init__(self.loc.shape[:-1], self.loc.shape[-1:], validate_args=validate_args)

    @constraints.dependent_property(is_discrete=False, event_dim=1)
    def support(self):
        return constraints.positive_ordered_vector if self.positive else constraints.ordered_vector

    def log_prob(self, value: Tensor) -> Tensor:
        return dist.Normal(self.loc, self.scale).log_prob(value).sum(-1)

    def sample(self, sample_shape: tuple[int, ...] = ()) -> Tensor:
        with torch.no_grad():
            draws = dist.Normal(self.loc, self.scale).sample(torch.Size(sample_shape))
            for _ in range(_MAX_REJECTIONS):
                rejected = ~self.support.check(draws)
                if not rejected.any():
                    return draws
                fresh = dist.Normal(self.loc, self.scale).sample(torch.Size(sample_shape))
                draws = torch.where(rejected[..., None], fresh, draws)
        raise RuntimeError(f"OrderedNormal: no ordered draw in {_MAX_REJECTIONS} tries")


def _log_matmul_chain(factors: Tensor) -> Tensor:
    """``factors[0] ⊗ factors[1] ⊗ ...`` over dimension -3, ``(A ⊗ B)[i, k] = logsumexp_j (A[i, j] + B[j, k])``."""
    while factors.shape[-3] > 1:
        even = factors.shape[-3] // 2 * 2
        earlier, later = factors[..., 0:even:2, :, :], factors[..., 1:even:2, :, :]
        contracted = torch.logsumexp(earlier[..., :, :, None] + later[..., None, :, :], dim=-2)
        factors = torch.cat([contracted, factors[..., even:, :, :]], dim=-3)
    return factors[..., 0, :, :]


class StanHMM(dist.TorchDistribution):
    """A sequence of ``length`` observations of a hidden Markov chain, scored as Stan's forward algorithm scores it.

    ``transition[j, k]`` is ``p(state k | state j)``; ``emission`` has batch shape ``(K,)``, one law per state. The
    first state's weights are all 1, as in the Stan models (a uniform start plus log K); ``sample`` draws the first
    state uniformly.
    """

    arg_constraints = {"transition": constraints.independent(constraints.simplex, 1)}

    def __init__(self, transition: Tensor, emission: dist.Distribution, length: int, validate_args=None):
        self.transition, self.emission, self.length = transition, emission, length
        super().__init__(torch.Size(), (length, *emission.event_shape), validate_args=validate_args)

    @constraints.dependent_property(is_discrete=False)
    def support(self):
        return constraints.independent(self.emission.support, 1)

    def log_prob(self, value: Tensor) -> Tensor:
        emissions = self.emission.log_prob(value.unsqueeze(-1 - len(self.emission.event_shape)))  # (..., T, K)
        if self.length == 1:
            return emissions[..., 0, :].logsumexp(-1)
        factors = self.transition.log()[..., None, :, :] + emissions[..., 1:, None, :]  # M_t(j, k), t = 2..T
        return torch.logsumexp(emissions[..., 0, :, None] + _log_matmul_chain(factors), dim=(-2, -1))

    def sample(self, sample_shape: tuple[int, ...] = ()) -> Tensor:
        shape = torch.Size(sample_shape)
        num_states = self.transition.shape[-1]
        state = torch.randint(num_states, shape)
        event = self.emission.event_shape
        draws = []
        with torch.no_grad():
            for t in range(self.length):
                if t:
                    state = torch.multinomial(self.transition[state].reshape(-1, num_states), 1).reshape(shape)
                every = self.emission.sample(shape)  # (*shape, K, *event)
                index = state.reshape(*shape, 1, *(1 for _ in event)).expand(*shape, 1, *event)
                draws.append(every.gather(len(shape), index).squeeze(len(shape)))
        return torch.stack(draws, dim=len(shape))
