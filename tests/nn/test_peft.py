"""A ``transformers`` model with ``peft`` LoRA adapters, built from a tiny config (no download): the adapters random.

Needs the ``nn`` extra (``pip install -e ".[nn]"``); without ``peft`` or ``transformers`` the test is skipped, and
tests/nn/test_engines.py covers the same path with a hand-made adapter. The attention mask is given in its 4-D
form: ``transformers`` checks whether a 2-D mask is all ones with a Python ``if``, which ``torch.func.vmap`` over
chains or over a minibatch's groups cannot run (docs/nn.md, Limits).
"""

from __future__ import annotations

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_scalable.infer import SGHMC, AutoLinearizedLaplace, StochasticMCMC
from pyro_scalable.nn import BayesianNetwork

peft = pytest.importorskip("peft", reason="the nn extra is not installed: pip install -e '.[nn]'")
transformers = pytest.importorskip("transformers", reason="the nn extra is not installed: pip install -e '.[nn]'")


# peft reads a transformers attribute that transformers 5 deprecates: their warning, not about this code
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_sghmc_and_laplace_over_the_lora_adapters_of_a_tiny_bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=2, attn_implementation="eager",
    )  # fmt: skip
    base = transformers.BertForSequenceClassification(config)
    net = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["query", "value"], lora_dropout=0.0))
    before = {name: value.clone() for name, value in net.state_dict().items()}
    ids = torch.randint(0, 50, (48, 6))
    mask = torch.ones(48, 6, dtype=torch.bool)
    mask[::2, 4:] = False
    batch = {"input_ids": ids, "attention_mask": mask[:, None, None, :].expand(48, 1, 6, 6)}
    labels = (ids[:, 0] > 25).long()
    model = BayesianNetwork(
        net, "categorical", random="lora", prior_center="pretrained", prior_scale=0.1, batch_size=16
    )
    assert len(model.random_names) == 4 and all("lora_" in name for name in model.random_names)
    assert model.num_random() == 4 * 2 * 16
    mcmc = StochasticMCMC(SGHMC(model), num_samples=5, num_warmup=5, num_chains=2, seed=0, progress_bar=False)
    mcmc.run(batch, labels)  # vectorised over chains: a fallback would warn, and warnings are errors here
    head = {key: value[:3] for key, value in batch.items()}
    assert mcmc.uncertainty(head).total.shape == (3,)
    pyro.clear_param_store()
    guide = AutoLinearizedLaplace(model, init_loc_fn=model.init_to_pretrained)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
    for _ in range(5):
        svi.step(batch, labels)
    posterior = guide.laplace_approximation(batch, labels, structure="kron", check_map=False)
    assert posterior.predict(head, link_approx="mc", num_samples=20, seed=0).distribution.probs.shape == (3, 2)
    assert all(torch.equal(value, net.state_dict()[name]) for name, value in before.items())
