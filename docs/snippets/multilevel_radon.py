# --8<-- [start:data]
import pyro
import pyro.distributions as dist
import torch

from pyro_scalable.infer import MultilevelMCMC

torch.set_num_threads(1)  # a small model: one thread is fastest, and a second only contends with other work


def radon_like(num_counties=85, seed=0):
    """Homes in counties whose sizes are as skewed as Minnesota's radon survey (1 to about 120 homes)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = (torch.exp(1.5 + 1.1 * torch.randn(num_counties, generator=gen))).ceil().clamp(1, 120).long()
    county = torch.repeat_interleave(torch.arange(num_counties), sizes)
    floor = (torch.rand(len(county), generator=gen) < 0.2).float()  # measured in the basement (0) or above (1)
    level = 1.3 + 0.35 * torch.randn(num_counties, generator=gen)
    log_radon = level[county] - 0.6 * floor + 0.75 * torch.randn(len(county), generator=gen)
    return county, floor, log_radon


# --8<-- [end:data]
# --8<-- [start:model]
def model(county, floor, log_radon, num_counties=85):
    """Log radon of each home: its county's level, lower by ``beta`` above the basement."""
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfNormal(1.0))
    beta = pyro.sample("beta", dist.Normal(0.0, 2.0))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    with pyro.plate("counties", num_counties):  # the group plate: a level per county
        level = pyro.sample("level", dist.Normal(mu, tau))
    with pyro.plate("homes", len(log_radon), subsample_size=100) as idx:  # the data plate: each home reads its county
        mean = level[county[idx]] + beta * floor[idx]
        pyro.sample("obs", dist.Normal(mean, sigma), obs=log_radon[idx])


# --8<-- [end:model]
# --8<-- [start:run]
county, floor, log_radon = radon_like()
mcmc = MultilevelMCMC(model, seed=0).run(county, floor, log_radon)
mcmc.summary()
# --8<-- [end:run]
