"""The first model of docs/getting_started.md, run by tests/test_docs.py (the page includes it section by section).

``python docs/snippets/first_model.py`` runs it in full; tests/test_docs.py runs it with fewer steps.
"""

import os

# --8<-- [start:data]
import arviz as az
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import Predictive

from pyro_scalable.infer import SGHMC, StochasticMCMC

torch.manual_seed(0)
torch.set_num_threads(1)  # tensors this small run fastest on one thread
num_data, num_features = 10_000, 3
true_weight = torch.tensor([1.5, -2.0, 0.5])
x = torch.randn(num_data, num_features)
y = torch.bernoulli(torch.sigmoid(x @ true_weight - 1.0))
# --8<-- [end:data]


# --8<-- [start:model]
def model(x, y=None):
    """Logistic regression with Normal priors on the weights and the bias."""
    weight = pyro.sample("weight", dist.Normal(x.new_zeros(x.shape[1]), 1.0).to_event(1))
    bias = pyro.sample("bias", dist.Normal(0.0, 5.0))
    # The plate knows N = len(x): each step sees 500 points, and Pyro scales their log-likelihood by N/500.
    with pyro.plate("data", len(x), subsample_size=500) as idx:
        pyro.sample("obs", dist.Bernoulli(logits=x[idx] @ weight + bias), obs=None if y is None else y[idx])


# --8<-- [end:model]


# --8<-- [start:steps]
WARMUP, STEPS = 1000, 3000  # warm-up steps, then draws kept per chain
# --8<-- [end:steps]
if "FIRST_MODEL_STEPS" in os.environ:  # fewer when the test suite runs this file
    WARMUP = STEPS = int(os.environ["FIRST_MODEL_STEPS"])

# --8<-- [start:run]
kernel = SGHMC(model)  # step size and friction are chosen in warm-up
mcmc = StochasticMCMC(kernel, num_samples=STEPS, num_warmup=WARMUP, num_chains=4, seed=0)
mcmc.run(x, y)
# --8<-- [end:run]

# --8<-- [start:diagnose]
idata = mcmc.to_inference_data()
summary = az.summary(idata, var_names=["weight", "bias"])
print(summary)  # mean, sd, hdi, r_hat and ESS per coordinate
print("divergent steps:", int(idata.sample_stats["diverging"].sum()))
print(az.loo(idata))  # PSIS-LOO from the full-data pointwise log-likelihood
# --8<-- [end:diagnose]

# --8<-- [start:predict]
x_new = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
y_new = mcmc.posterior_predictive(x_new, seed=0)["obs"]  # one draw of y per posterior draw: (4 * STEPS, 2)
print("P(y = 1):", y_new.mean(0))
y_rep = mcmc.posterior_predictive(seed=1)["obs"]  # replicated data on all 10,000 points: (4 * STEPS, 10000)
print("observed vs replicated share of ones:", float(y.mean()), float(y_rep.mean()))
# --8<-- [end:predict]

# --8<-- [start:predictive]
samples = mcmc.get_samples()  # {"weight": (4 * STEPS, 3), "bias": (4 * STEPS,)}
obs = Predictive(mcmc.kernel.model, posterior_samples=samples)(x_new)["obs"]  # (4 * STEPS, 2), as above
probs = torch.sigmoid(x_new @ samples["weight"].T + samples["bias"])  # P(y = 1 | draw): (2 points, draws)
print("P(y = 1):", probs.mean(1), "+/-", probs.std(1))
# --8<-- [end:predictive]

# The checks the test relies on: the chains found the weights the data were made with.
assert y_new.shape == obs.shape == (4 * STEPS, 2) and y_rep.shape == (4 * STEPS, num_data)
assert torch.allclose(y_new.mean(0), probs.mean(1), atol=0.05), (y_new.mean(0), probs.mean(1))
assert summary["r_hat"].max() < 1.1, summary
assert torch.allclose(samples["weight"].mean(0), true_weight, atol=0.3), samples["weight"].mean(0)
# The posterior sd is 0.03-0.05 here; minibatch noise must not inflate it.
assert summary["sd"].max() < 0.09, summary
