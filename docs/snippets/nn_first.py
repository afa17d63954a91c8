"""The example of docs/nn.md: a network trained in plain PyTorch, then Bayesian in its last layer.

``python docs/snippets/nn_first.py`` runs it in full; tests/nn/test_docs_example.py runs it with fewer steps.
"""

import os

# --8<-- [start:train]
import pyro
import torch
from pyro.infer import SVI, Trace_ELBO
from torch import nn

from pyro_scalable.infer import SGHMC, AutoLinearizedLaplace, StochasticMCMC
from pyro_scalable.nn import BayesianNetwork

torch.manual_seed(0)
torch.set_num_threads(1)
x = torch.randn(2_000, 2)
quadrant = (x[:, 0] * x[:, 1] > 0).long()  # two classes in a checkerboard's four quadrants,
y = torch.where(torch.rand(2_000) < 0.1, 1 - quadrant, quadrant)  # one label in ten flipped

net = nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
for _ in range(300):  # ordinary PyTorch training, full batch
    optimizer.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    optimizer.step()
# --8<-- [end:train]

WARMUP, SAMPLES, MAP_STEPS = 1000, 1000, 500
if "NN_EXAMPLE_STEPS" in os.environ:  # fewer when the test suite runs this file
    WARMUP = SAMPLES = MAP_STEPS = int(os.environ["NN_EXAMPLE_STEPS"])

# --8<-- [start:model]
model = BayesianNetwork(
    net,
    likelihood="categorical",  # logits -> Categorical; "normal" and "bernoulli" also built in
    random="last_layer",  # the other layers stay fixed at their trained values
    prior_center="pretrained",  # Normal(trained value, prior_scale²) on each random weight
    prior_scale=1.0,
    batch_size=128,  # the data plate's minibatch
)
print(model)  # BayesianNetwork(Sequential, ..., 2 random parameters (130 scalars), 4 fixed)
# --8<-- [end:model]

# --8<-- [start:sghmc]
kernel = SGHMC(model, init_strategy=model.init_to_pretrained)  # chains start at the trained weights
# a last layer's weights are strongly correlated (its features are): a dense metric, learnt in warm-up
mcmc = StochasticMCMC(kernel, num_samples=SAMPLES, num_warmup=WARMUP, num_chains=4, seed=0, metric="dense")
mcmc.run(x, y)
x_new = torch.tensor([[1.0, 1.0], [0.05, 1.0], [3.0, -3.0]])  # inside a quadrant, at a boundary, further out
print(mcmc.uncertainty(x_new))  # total = aleatoric + epistemic entropy, per point
print(mcmc.get_samples()["4.weight"].shape)  # (4 chains * 1000 draws, 2, 64)
# --8<-- [end:sghmc]

# --8<-- [start:laplace]
guide = AutoLinearizedLaplace(model, init_loc_fn=model.init_to_pretrained)
svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
for _ in range(MAP_STEPS):  # the MAP of the last layer, the rest held fixed
    svi.step(x, y, batch_size=None)
posterior = guide.laplace_approximation(x, y, structure="full")
# Monte Carlo over the linearised logits: the probit approximation reads each logit's variance alone, and a
# softmax layer's logits share a direction the data never identify (one number added to all of them)
print(posterior.predict(x_new, link_approx="mc", num_samples=1_000, seed=0).distribution.probs)
# --8<-- [end:laplace]
