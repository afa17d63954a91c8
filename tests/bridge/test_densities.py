"""The bridge's summed site log density equals ``scale_and_mask(fn.log_prob(v), scale, mask).sum()`` (fast or not)."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.distributions.util import scale_and_mask
from pyro.nn import PyroModule, PyroSample
from torch.func import grad, vmap

from pyro_scalable.bridge.densities import summed_log_prob
from pyro_scalable.bridge.model import ModelBridge
from pyro_scalable.bridge.records import Batch


def reference(fn, value, scale, mask):
    return scale_and_mask(fn.log_prob(value), scale, mask).sum()


CASES = {
    "expanded scalar prior": lambda p: dist.Normal(0.0, p["s"]).expand([3, 4]).to_event(2),
    "vector loc, number scale": lambda p: dist.Normal(p["loc"], 1.7).to_event(2),
    "expanded, no to_event": lambda p: dist.Normal(p["m"], p["s"]).expand([3, 4]),
    "full scale (no fast path)": lambda p: dist.Normal(p["loc"], p["full"]).to_event(2),
    "Laplace (no fast path)": lambda p: dist.Laplace(0.0, p["s"]).expand([3, 4]).to_event(2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("scale", "mask"), [(1.0, None), (250.0, None), (torch.tensor(3.0), None), (2.0, "tensor")])
def test_value_and_gradients_match_log_prob(case, dtype, scale, mask):
    gen = torch.Generator().manual_seed(0)
    params = {
        "s": torch.tensor(0.7, dtype=dtype),
        "m": torch.tensor(-0.3, dtype=dtype),
        "loc": torch.randn(3, 4, generator=gen, dtype=dtype),
        "full": torch.rand(3, 4, generator=gen, dtype=dtype) + 0.5,
    }
    params = {k: v.requires_grad_() for k, v in params.items()}
    value = torch.randn(3, 4, generator=gen, dtype=dtype, requires_grad=True)
    if isinstance(scale, torch.Tensor):
        scale = scale.to(dtype)
    if mask == "tensor":
        mask = torch.rand(3, 4, generator=gen) < 0.5  # masks go through log_prob
    fn = CASES[case](params)
    ours = summed_log_prob(fn, value, scale, mask)
    expected = reference(fn, value, scale, mask)
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-10}
    torch.testing.assert_close(ours, expected, **tol)
    inputs = [value, *params.values()]
    g_ours = torch.autograd.grad(ours, inputs, allow_unused=True, materialize_grads=True)
    g_ref = torch.autograd.grad(expected, inputs, allow_unused=True, materialize_grads=True)
    for a, b in zip(g_ours, g_ref, strict=True):
        torch.testing.assert_close(a, b, **tol)


BERNOULLI = {
    "logits": lambda f: dist.Bernoulli(logits=f).to_event(2),
    "logits, no to_event": lambda f: dist.Bernoulli(logits=f),
    "one logit expanded": lambda f: dist.Bernoulli(logits=f[0, 0]).expand([3, 4]).to_event(2),
    "a row of logits broadcast": lambda f: dist.Bernoulli(logits=f[0]),
    "probs (no fast path)": lambda f: dist.Bernoulli(probs=torch.sigmoid(f)).to_event(2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", list(BERNOULLI))
@pytest.mark.parametrize(("scale", "mask"), [(1.0, None), (250.0, None), (torch.tensor(3.0), None), (2.0, "tensor")])
def test_bernoulli_value_and_gradients_match_log_prob(case, dtype, scale, mask):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 4, generator=gen, dtype=dtype)).requires_grad_()
    value = torch.bernoulli(torch.full((3, 4), 0.4, dtype=dtype), generator=gen)
    scale = scale.to(dtype) if isinstance(scale, torch.Tensor) else scale
    mask = torch.rand(3, 4, generator=gen) < 0.5 if mask == "tensor" else mask
    fn = BERNOULLI[case](logits)
    ours, expected = summed_log_prob(fn, value, scale, mask), reference(fn, value, scale, mask)
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-10}
    torch.testing.assert_close(ours, expected, **tol)
    g_ours = torch.autograd.grad(ours, logits, retain_graph=True)[0]  # the probs case shares sigmoid(logits)
    torch.testing.assert_close(g_ours, torch.autograd.grad(expected, logits)[0], **tol)


def test_bernoulli_fast_path_is_taken_for_logits_only(monkeypatch):
    calls = []
    original = torch.distributions.Bernoulli.log_prob
    monkeypatch.setattr(torch.distributions.Bernoulli, "log_prob", lambda *a, **k: calls.append(1) or original(*a, **k))
    value = torch.tensor([0.0, 1.0, 1.0])
    summed_log_prob(dist.Bernoulli(logits=torch.randn(3)), value, 10.0, None)
    assert calls == []
    summed_log_prob(dist.Bernoulli(probs=torch.rand(3)), value, 10.0, None)
    summed_log_prob(dist.Bernoulli(logits=torch.randn(3)), value, 10.0, torch.tensor([True, False, True]))
    summed_log_prob(dist.Bernoulli(logits=torch.randn(3, dtype=torch.float64)), value, 10.0, None)  # other dtype
    assert calls == [1, 1, 1]


def test_per_chain_scale_under_vmap():
    """A hierarchical scale, one per chain, expanded over the site: vmap and grad through the fast path."""
    taus = torch.tensor([0.5, 1.0, 2.5], dtype=torch.float64)
    values = torch.randn(3, 7, dtype=torch.float64)

    def ours(tau, v):
        return summed_log_prob(dist.Normal(0.0, tau).expand([7]).to_event(1), v, 1.0, None)

    def ref(tau, v):
        return dist.Normal(0.0, tau).expand([7]).to_event(1).log_prob(v)

    torch.testing.assert_close(vmap(ours)(taus, values), vmap(ref)(taus, values))
    torch.testing.assert_close(vmap(grad(ours))(taus, values), vmap(grad(ref))(taus, values))


def test_fast_path_is_taken_for_expanded_priors(monkeypatch):
    """The point of the module: Normal.log_prob is not called for an expanded scalar prior."""
    calls = []
    original = torch.distributions.Normal.log_prob
    monkeypatch.setattr(torch.distributions.Normal, "log_prob", lambda *a, **k: calls.append(1) or original(*a, **k))
    fn = dist.Normal(0.0, 2.0).expand([50]).to_event(1)
    summed_log_prob(fn, torch.randn(50), 1.0, None)
    assert calls == []
    summed_log_prob(dist.Normal(torch.zeros(50), torch.ones(50)).to_event(1), torch.randn(50), 1.0, None)
    assert calls == [1]


class MLP(PyroModule):
    def __init__(self):
        super().__init__()
        self.fc = PyroModule[torch.nn.Linear](4, 3)
        self.fc.weight = PyroSample(dist.Normal(0.0, 0.5).expand([3, 4]).to_event(2))
        self.fc.bias = PyroSample(dist.Normal(0.0, 1.0).expand([3]).to_event(1))

    def forward(self, x, y):
        sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
        data = pyro.plate("data", x.shape[0], subsample_size=5)
        mean = self.fc(x[data.indices]).sum(-1)
        with data:
            pyro.sample("obs", dist.Normal(mean, sigma), obs=y[data.indices])


def test_bridge_log_posterior_float32_pyromodule():
    """A float32 PyroModule with a latent noise scale: the bridge's log joint written out by hand."""
    pyro.clear_param_store()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(20, 4, generator=gen), torch.randn(20, generator=gen)
    bridge = ModelBridge(MLP(), (x, y))
    latents = {name: torch.randn(site.unconstrained_shape, generator=gen) for name, site in bridge.sites.items()}
    idx = torch.tensor([3, 0, 17, 8, 11])
    ours = bridge.log_posterior(latents, Batch({"data": idx}, (x, y), {}))
    w, b, u = latents["fc.weight"], latents["fc.bias"], latents["sigma"]
    normal = torch.distributions.Normal
    expected = (
        normal(0.0, 0.5).log_prob(w).sum()
        + normal(0.0, 1.0).log_prob(b).sum()
        + torch.distributions.HalfNormal(1.0).log_prob(u.exp())
        + u  # log|d exp(u)/du|
        + 20 / 5 * normal((x[idx] @ w.T + b).sum(-1), u.exp()).log_prob(y[idx]).sum()
    )
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-4)
