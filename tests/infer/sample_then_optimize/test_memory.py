"""The memory-lean paths of sample-then-optimise compute exactly what the plain ones do.

* the GGN products taken a group of rows at a time and per site equal the brute-force :math:`J^\\top\\Lambda J v`
  (and ``out=`` adds to what is there);
* a step hands the samples and their anchors to ``ggn_vp`` as one tensor, without a copy, and gives the same
  numbers as a step from a state whose anchors lie elsewhere (concatenated);
* conjugate gradients in place (``overwrite=True``) iterate in the start rows and give the same rows;
* a run without EM steps drops the perturbation sum once the last solve's centres are made;
* CG keeps its right-hand side in the centres' buffer, and the centres rebuilt after it are the same, bit for bit.
"""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.nn import PyroModule, PyroSample
from torch import nn

from pyro_scalable.infer import SampleThenOptimize
from pyro_scalable.infer.linearized import network
from pyro_scalable.infer.linearized.sampling import core
from pyro_scalable.infer.linearized.sampling.krylov import conjugate_gradient

F64 = torch.float64


class _Net(PyroModule):
    def __init__(self):
        super().__init__()
        self.hidden = PyroModule[nn.Linear](3, 6)
        self.hidden.weight = PyroSample(dist.Normal(0.0, 1.0).expand([6, 3]).to_event(2))
        self.hidden.bias = PyroSample(dist.Normal(0.0, 1.0).expand([6]).to_event(1))
        self.out = PyroModule[nn.Linear](6, 2)
        self.out.weight = PyroSample(dist.Normal(0.0, 1.0).expand([2, 6]).to_event(2))
        self.out.bias = PyroSample(dist.Normal(0.0, 1.0).expand([2]).to_event(1))

    def forward(self, x, y=None):
        data = pyro.plate("data", x.shape[0], subsample_size=10)
        f = self.out(torch.tanh(self.hidden(x[data.indices])))
        with data:
            return pyro.sample("y", dist.Normal(f, 0.3).to_event(1), obs=None if y is None else y[data.indices])


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    x = torch.randn(40, 3)
    y = torch.randn(40, 2)
    engine = SampleThenOptimize(_Net(), num_samples=3, num_epochs=1, refine_passes=0, seed=0, progress_bar=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="the samples have not converged")  # one epoch, on purpose
        warnings.filterwarnings("ignore", message="the linearisation point is not a MAP")  # a short MAP search
        engine.run(x, y)
    return engine


def test_grouped_per_site_products_equal_the_brute_force_ggn(engine, monkeypatch):
    net = engine.net
    theta = net.theta_star
    d = theta.numel()
    batch = next(net.batches())
    vectors = torch.randn(5, d, generator=torch.Generator().manual_seed(1))
    jacobian = torch.autograd.functional.jacobian(lambda t: net.f(t, batch), theta)  # (points, outputs, d)
    out = net.outputs(theta, batch)
    root = out.likelihood.hessian_sqrt(out.f.detach())  # (points, outputs, r)
    lam = root @ root.transpose(-1, -2)
    expected = torch.einsum("pmd,pmn,pne,ke->kd", jacobian, lam, jacobian, vectors)
    whole = net.batch_ggn_vp(theta, vectors, batch)
    monkeypatch.setattr(network, "ROWS_PER_PASS", 2 * d)  # two rows per group: 2 + 2 + 1
    grouped = net.batch_ggn_vp(theta, vectors, batch)
    torch.testing.assert_close(whole, expected, rtol=1e-4, atol=1e-4)
    # the same float32 products summed in another grouping over the batch's 40 rows: each sum's rounding is at most
    # about 40 float32 ulps of its largest term (40 * 1.2e-7 < 1e-5); 1e-6 read the rounding of one seed's point
    scale = float(whole.abs().max())
    torch.testing.assert_close(grouped, whole, rtol=1e-5, atol=1e-5 * scale)
    start = torch.ones_like(vectors)
    added = net.batch_ggn_vp(theta, vectors, batch, out=start)
    assert added is start
    # float32: the products are added into the ones site by site, whole + 1 rounds once (a few ulps apart at most)
    torch.testing.assert_close(added, whole + 1, rtol=1e-5, atol=1e-5)


def _quadratic(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(30, 4, generator=g, dtype=F64)
    targets = torch.randn(3, 4, generator=g, dtype=F64)
    return x, targets, g


def test_a_step_sees_samples_and_anchors_as_one_tensor_and_computes_the_same():
    x, targets, _ = _quadratic()
    seen = []

    def ggn_vp(z, idx):
        seen.append(z.data_ptr())
        return (z @ x[idx].T) @ x[idx]

    precision = torch.full((4,), 2.0, dtype=F64)
    state = core.init(targets)
    joined = core.with_anchor(state, state.samples[-1:], torch.ones(1, 4, dtype=F64))
    # the same state with its own tensors, the anchors apart from the samples
    apart = joined._replace(samples=state.samples, anchor=joined.anchor.clone(), velocity=state.velocity.clone())
    assert core.joined_rows(joined) is not None and core.joined_rows(apart) is None
    kwargs = dict(prior_precision=precision, data_scale=3.0, step_size=0.01)
    idx = torch.arange(10)
    for _ in range(3):
        joined, info_joined = core.step(joined, idx, ggn_vp, inplace=True, **kwargs)
        assert seen[-1] == joined.samples.data_ptr()  # the rows themselves, no concatenated copy
        apart, info_apart = core.step(apart, idx, ggn_vp, **kwargs)
        assert torch.equal(joined.samples, apart.samples) and torch.equal(joined.velocity, apart.velocity)
        assert torch.equal(info_joined.objective, info_apart.objective)
    again = core.with_anchor(joined, joined.samples[-1:], torch.zeros(1, 4, dtype=F64))
    assert again.samples.data_ptr() == joined.samples.data_ptr()  # re-anchoring reuses the buffer
    assert torch.equal(again.anchor, joined.samples[-1:])


def test_conjugate_gradients_in_place_give_the_same_rows():
    x, targets, g = _quadratic()
    h = x.T @ x + torch.eye(4, dtype=F64)
    rhs = targets.clone()
    start = torch.randn(3, 4, generator=g, dtype=F64)
    inverse = 1 / h.diagonal()
    plain = conjugate_gradient(lambda v: v @ h, rhs, start, inverse, max_passes=6, tolerance=1e-12)
    rows = start.clone()
    lean = conjugate_gradient(
        lambda v: v @ h, rhs.clone(), rows, inverse, max_passes=6, tolerance=1e-12, overwrite=True
    )
    assert lean.rows is rows and lean.passes == plain.passes
    torch.testing.assert_close(lean.rows, plain.rows, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lean.error, plain.error, rtol=1e-9, atol=1e-12)
    assert torch.equal(rhs, targets)  # without overwrite the right-hand side is left as it was


@pytest.mark.filterwarnings("ignore:the samples have not converged")  # one epoch, on purpose
@pytest.mark.filterwarnings("ignore:the linearisation point is not a MAP")  # the default short MAP search
def test_without_em_the_perturbation_sum_is_dropped_after_the_last_centres(monkeypatch):
    from pyro_scalable.infer.linearized.sampling import problem as problem_module

    seen = {}
    targets = problem_module.Problem.targets

    def spy(self):
        out = targets(self)
        seen.setdefault(self.settings.em_steps, []).append(self._perturbation is None)
        return out

    monkeypatch.setattr(problem_module.Problem, "targets", spy)
    torch.manual_seed(0)
    x, y = torch.randn(40, 3), torch.randn(40, 2)
    for em_steps in (0, 1):
        SampleThenOptimize(
            _Net(),
            num_samples=2,
            num_epochs=1,
            em_steps=em_steps,
            em_epochs=1,
            refine_passes=0,
            seed=0,
            progress_bar=False,
        ).run(x, y)
    assert seen == {0: [True], 1: [False, True]}  # with EM: kept after the first solve's, dropped at the last's


@pytest.mark.filterwarnings("ignore:the samples have not converged")  # a few passes, on purpose
@pytest.mark.filterwarnings("ignore:the linearisation point is not a MAP")  # the default short MAP search
@pytest.mark.parametrize("em", [dict(em_steps=0), dict(em_steps=1, em_epochs=1), dict(em_steps=1, em_noise=True)])
def test_cg_keeps_its_right_hand_side_in_the_centres_buffer_and_rebuilds_the_same_centres(monkeypatch, em):
    from pyro_scalable.infer.linearized.sampling import krylov
    from pyro_scalable.infer.linearized.sampling import problem as problem_module

    made, handed = [], []
    targets, solve = problem_module.Problem.targets, krylov.conjugate_gradient

    def spy_targets(self, out=None):
        centres = targets(self, out)
        made.append((centres.data_ptr(), centres.clone(), out is not None, self._perturbation is None))
        return centres

    def spy_solve(product, rhs, start, *args, **kwargs):
        handed.append(rhs.data_ptr())
        return solve(product, rhs, start, *args, **kwargs)

    monkeypatch.setattr(problem_module.Problem, "targets", spy_targets)
    monkeypatch.setattr(krylov, "conjugate_gradient", spy_solve)
    torch.manual_seed(0)
    x, y = torch.randn(40, 3), torch.randn(40, 2)
    engine = SampleThenOptimize(_Net(), num_samples=3, num_epochs=1, refine_passes=4, seed=0, progress_bar=False, **em)
    engine.run(x, y)
    solves = 1 + engine.em_steps
    assert len(handed) == solves and len(made) == 2 * solves  # each solve's centres, then their rebuild after CG
    for number in range(solves):
        (ptr, before, _, _), (again, after, rebuilt, dropped) = made[2 * number : 2 * number + 2]
        assert handed[number] == ptr == again and rebuilt  # no fresh K x d for the right-hand side or the rebuild
        assert torch.equal(after, before)  # the same numbers, bit for bit (after the last solve: a replayed pass)
        assert dropped == (number == solves - 1)  # the sums are gone again once the last centres are rebuilt
    assert torch.equal(engine.state.targets, made[-1][1])
