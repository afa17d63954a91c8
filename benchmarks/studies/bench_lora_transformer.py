"""The posteriors paper's LoRA experiments (its §5.2 and §5.3) at laptop scale, on a character-level transformer.

    python benchmarks/studies/bench_lora_transformer.py --seeds 0 1 2    # about 9 min a seed, one thread
    python benchmarks/studies/bench_lora_transformer.py --seeds 0 --fast # about a minute: a smoke run

A 2-layer GPT-2 (``transformers.GPT2LMHeadModel`` built from a config: no downloaded weights, width 48, 4 heads,
a context of 24 characters, 97 symbols: newline, printable ASCII and "other") is pretrained here for a few minutes
on the prose (with code examples) of the Python documentation that ships with Python (``pydoc_data.topics``). Its last
attention layer's query/key/value projection gets a ``peft`` LoRA adapter of rank 1 (192 parameters), and
``BayesianNetwork(..., random="lora")`` makes the adapter the random part: the likelihood is the next character
after each 24-character window (``Categorical`` on the last position's logits).

(a) **Continual learning** (the paper's §5.2, books as episodes): three episodes of text of three kinds, each
shipped with an installed package: the dataset descriptions of scikit-learn (English prose), Python standard
library source code, and scikit-learn's CSV data files (numbers). Each episode's last 15 % is held out. Every arm
finds each episode's MAP by ``SVI`` from the previous episode's adapter; "fine-tuning" keeps the original prior
(Normal centred at the pretrained adapter, sd 1: next to no constraint at this data size); "Laplace diag" (the
paper's method: EWC with the Laplace precision) and "Laplace full" hand ``laplace_approximation(...)``'s posterior
to the next episode through ``as_prior``. Reported: the next-character loss (nats) on every past episode's held-out
text after each episode, mean over seeds.

(b) **OOD detection** (the paper's §5.3): the adapter is fine-tuned on the dataset descriptions by SGD (SGHMC at
temperature 0, one chain) and by parallel SGHMC (K chains at temperature 1, started together at the pretrained
adapter; the last draws of each chain), the same step size for both. In-domain test items are held-out stretches of
the descriptions, out-of-domain items the same stretches in rot13 (every letter moved 13 places: the paper's
translated statements, in a "language" the network never saw). Each item scores the mean over its last 8
characters (each predicted from the 24 before it) of the predictive's total entropy and of its epistemic part (the
mutual information, ``pyro_scalable.infer.uncertainty``). AUROC of each score, mean and standard error over the
seeds; the pretrained network without fine-tuning as a third row.

Writes the markdown table to ``--out`` (default ``benchmarks/results/nn/lora_transformer.md``) with the command,
machine and thread count.
"""

from __future__ import annotations

import argparse
import codecs
import glob
import math
import os
import platform
import string
import sys
import time
import warnings

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide.initialization import init_to_value
from sklearn.metrics import roc_auc_score
from torch import nn
from torch.func import functional_call

from pyro_scalable.infer import SGHMC, AutoLinearizedLaplace, StochasticMCMC, sghmc
from pyro_scalable.infer.uncertainty import decompose_probabilities
from pyro_scalable.nn import BayesianNetwork

CONTEXT, VOCAB, KEEP = 24, 97, 8


# ---------------------------------------------------------------------------------------------------- the texts
def encode(text: str) -> torch.Tensor:
    """Characters to symbols: newline 0, printable ASCII 1..95 (a tab is a space), anything else 96."""
    codes = [0 if c == "\n" else 1 if c == "\t" else ord(c) - 31 if " " <= c <= "~" else VOCAB - 1 for c in text]
    return torch.tensor(codes, dtype=torch.long)


def texts() -> dict[str, str]:
    """The texts, all read from installed packages: no download (the same as tutorials/lora_transformer.py's)."""
    import argparse as argparse_module
    import json.decoder
    import json.encoder
    import pydoc_data.topics

    import sklearn

    def read(*paths):
        return "\n".join(open(p, encoding="utf-8").read() for p in paths)

    here = os.path.join(os.path.dirname(sklearn.__file__), "datasets")
    return {
        "pretraining": "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)),
        "descriptions": read(*sorted(glob.glob(f"{here}/descr/*.rst"))),
        "source": read(argparse_module.__file__, json.decoder.__file__, json.encoder.__file__),
        "tables": read(f"{here}/data/iris.csv", f"{here}/data/wine_data.csv")[:10_000],
    }


def windows(ids: torch.Tensor, count: int, generator: torch.Generator, span: int = CONTEXT + 1) -> torch.Tensor:
    """``count`` windows of ``span`` symbols at random places of ``ids`` (rows)."""
    starts = torch.randint(0, len(ids) - span, (count,), generator=generator)
    return torch.stack([ids[s : s + span] for s in starts.tolist()])


def split(ids: torch.Tensor, train: int, test: int, generator, span: int = CONTEXT + 1):
    """Training windows from the first 85 % of a text, test windows from its last 15 % (held out)."""
    cut = int(0.85 * len(ids))
    return windows(ids[:cut], train, generator), windows(ids[cut:], test, generator, span)


ALPHABET = {ord(c) - 31: ord(codecs.encode(c, "rot13")) - 31 for c in string.ascii_letters}


def rot13(rows: torch.Tensor) -> torch.Tensor:
    """The same symbols with every letter moved 13 places in the alphabet (Python's ``rot13`` codec)."""
    table = torch.arange(VOCAB)
    table[list(ALPHABET)] = torch.tensor(list(ALPHABET.values()))
    return table[rows]


# ---------------------------------------------------------------------------------------------------- the model
class NextCharacter(nn.Module):
    """A causal LM read at its last position: the logits ``(rows, vocab)`` of the character after each window."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, logits_to_keep=1).logits[:, -1]


def pretrain(text: torch.Tensor, steps: int, seed: int) -> nn.Module:
    """A 2-layer GPT-2 from a config, trained by Adam on next-character prediction at every position."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=CONTEXT, n_embd=48, n_layer=2, n_head=4, n_inner=192,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    lm = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.Adam(lm.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = windows(text, 64, generator)
        logits = lm(input_ids=batch[:, :-1]).logits
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    return lm.eval()


def with_adapter(lm: nn.Module, seed: int) -> nn.Module:
    """The pretrained LM with a rank-1 LoRA adapter on its last attention layer's query/key/value projection."""
    import copy

    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=1, lora_alpha=2, target_modules=["h.1.attn.c_attn"], lora_dropout=0.0, fan_in_fan_out=True
    )
    with warnings.catch_warnings():  # peft on a GPT-2 Conv1D layer: the fan_in_fan_out it asks for is set above
        warnings.simplefilter("ignore", UserWarning)
        return NextCharacter(peft.get_peft_model(copy.deepcopy(lm), config))


def bayesian(net: nn.Module, batch_size: int = 32) -> BayesianNetwork:
    return BayesianNetwork(
        net, "categorical", random="lora", prior_center="pretrained", prior_scale=1.0, batch_size=batch_size
    )


def logits_at(model: BayesianNetwork, draws: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Log-probabilities ``(draws, rows, vocab)`` of the character after each window of ``ids``, per draw."""
    count = next(iter(draws.values())).shape[0]
    out = []
    with torch.no_grad():
        for k in range(count):
            params = {**model.fixed, **{name: value[k] for name, value in draws.items()}}
            logits = functional_call(model.module, params, (), {"input_ids": ids})
            out.append(logits.log_softmax(-1))
    return torch.stack(out)


def test_loss(model: BayesianNetwork, point: dict[str, torch.Tensor], rows: torch.Tensor) -> float:
    """Mean next-character loss (nats) of a point estimate on test windows."""
    logp = logits_at(model, {k: v[None] for k, v in point.items()}, rows[:, :-1])[0]
    return -logp.gather(-1, rows[:, -1:]).mean().item()


# ---------------------------------------------------------------------------------------------------- (a)
def fit_map(model, rows: torch.Tensor, start: dict[str, torch.Tensor], steps: int):
    """The MAP of ``model`` on ``rows`` by minibatch SVI from ``start``; returns the guide and the point."""
    pyro.clear_param_store()
    guide = AutoLinearizedLaplace(model, init_loc_fn=init_to_value(values=start))
    svi = SVI(model, guide, pyro.optim.ClippedAdam({"lr": 1e-2, "lrd": 0.1 ** (1 / steps)}), Trace_ELBO())
    data = {"input_ids": rows[:, :-1]}
    for _ in range(steps):
        svi.step(data, rows[:, -1])
    return guide, {name: value.detach() for name, value in guide.median(data, rows[:, -1]).items()}


def continual(lm, corpora, arms, train: int, test: int, steps: int, seed: int) -> dict[str, list[list[float]]]:
    """Loss on each past episode's held-out text after each episode, per arm; and each arm's seconds."""
    generator = torch.Generator().manual_seed(seed)
    episodes = [split(ids, train, test, generator) for ids in corpora]
    history, seconds = {}, {}
    for arm in arms:
        began = time.perf_counter()
        net = with_adapter(lm, seed)
        base = bayesian(net)
        model, point, rows = base, dict(base.pretrained), []
        for number, (train_rows, _) in enumerate(episodes):
            guide, point = fit_map(model, train_rows, point, steps)
            if arm != "fine-tuning" and number + 1 < len(episodes):
                structure = "full" if arm == "Laplace full" else "diag"
                data = {"input_ids": train_rows[:, :-1]}
                posterior = guide.laplace_approximation(
                    data, train_rows[:, -1], structure=structure, check_map=False, chunk_size=64
                )
                model = posterior.as_prior(base)
            rows.append([test_loss(base, point, episodes[k][1]) for k in range(number + 1)])
        history[arm], seconds[arm] = rows, time.perf_counter() - began
    return history, seconds


# ---------------------------------------------------------------------------------------------------- (b)
def auroc(scores_in: torch.Tensor, scores_out: torch.Tensor) -> float:
    labels = torch.cat([torch.zeros(len(scores_in)), torch.ones(len(scores_out))])
    return float(roc_auc_score(labels.numpy(), torch.cat([scores_in, scores_out]).double().numpy()))


def item_uncertainty(logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per item: the predictive's total entropy and its epistemic part, averaged over the item's last places."""
    parts = decompose_probabilities(logp.double().exp())  # (draws, rows, keep, vocab) -> (rows, keep)
    return parts.total.mean(-1), parts.epistemic.mean(-1)


def ood(lm, corpora, train: int, test: int, chains: int, steps: int, keep_draws: int, seed: int):
    """AUROCs of SGD's and parallel SGHMC's total and epistemic uncertainty, and the in/out-of-domain losses."""
    generator = torch.Generator().manual_seed(seed + 1000)
    train_rows, test_in = split(corpora["descriptions"], train, test, generator, span=CONTEXT + KEEP)
    test_out = rot13(test_in)  # the same held-out items, "translated": each letter moved 13 places
    train_rows = train_rows[:, -(CONTEXT + 1) :]
    data, labels = {"input_ids": train_rows[:, :-1]}, train_rows[:, -1]
    results = {}

    def score(model, draws, name):
        scores = {}
        for label, items in (("in", test_in), ("out", test_out)):
            # the last KEEP characters of each item, each predicted from the CONTEXT characters before it
            slides = items.unfold(1, CONTEXT + 1, 1)  # (items, KEEP, CONTEXT + 1)
            logp = logits_at(model, draws, slides[..., :-1].reshape(-1, CONTEXT))
            logp = logp.reshape(logp.shape[0], len(items), KEEP, VOCAB)
            targets = items[:, -KEEP:]
            mixture = torch.logsumexp(logp, 0) - math.log(logp.shape[0])
            scores[label] = (*item_uncertainty(logp), -mixture.gather(-1, targets[..., None]).mean().item())
        results[name] = {
            "auroc_total": auroc(scores["in"][0], scores["out"][0]),
            "auroc_epistemic": auroc(scores["in"][1], scores["out"][1]),
            "loss_in": scores["in"][2],
            "loss_out": scores["out"][2],
        }

    net = with_adapter(lm, seed)
    model = bayesian(net)
    score(model, {k: v[None] for k, v in model.pretrained.items()}, "pretrained")
    n = len(train_rows)
    for name, temperature, k, kept in (("SGD", 0.0, 1, 1), ("parallel SGHMC", 1.0, chains, keep_draws)):
        began = time.perf_counter()
        kernel = SGHMC(
            model,
            **sghmc.sgd_hyperparameters(lr=0.02 / n, momentum=0.9),
            temperature=temperature,
            control_variate=None,
            init_strategy=model.init_to_pretrained,
        )
        mcmc = StochasticMCMC(
            kernel, num_samples=kept, num_warmup=steps - kept * 10, thin=10, num_chains=k, seed=seed, progress_bar=False
        )
        with warnings.catch_warnings():  # r_hat across chains at T = 0 / from one start: not the point here
            warnings.filterwarnings("ignore", message="the chains are not healthy")
            warnings.filterwarnings("ignore", message=".*r_hat.*")
            mcmc.run(data, labels)
        score(model, mcmc.get_samples(), name)
        results[name]["seconds"] = time.perf_counter() - began
    return results


# ---------------------------------------------------------------------------------------------------- report
def mean_se(values: list[float]) -> str:
    m = sum(values) / len(values)
    if len(values) < 2:
        return f"{m:.3f}"
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))
    return f"{m:.3f} ± {sd / math.sqrt(len(values)):.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--fast", action="store_true", help="a smoke run: few steps and rows")
    parser.add_argument("--pretrain-steps", type=int, default=1500)
    parser.add_argument("--arms", nargs="+", default=["fine-tuning", "Laplace diag", "Laplace full"])
    parser.add_argument("--parts", nargs="+", default=["continual", "ood"], choices=["continual", "ood"])
    parser.add_argument("--chains", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results/nn/lora_transformer.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sizes = {"train": 256, "test": 300, "map_steps": 300, "sghmc_steps": 400, "keep_draws": 2}
    if args.fast:
        args.pretrain_steps = min(args.pretrain_steps, 100)
        sizes = {"train": 64, "test": 60, "map_steps": 50, "sghmc_steps": 40, "keep_draws": 1}
    raw = texts()
    corpora = {name: encode(text) for name, text in raw.items()}
    lines = [
        "# LoRA over a small transformer: continual learning and OOD detection (the posteriors paper's §5.2, §5.3)",
        "",
        f"Command: `python benchmarks/studies/bench_lora_transformer.py {' '.join(argv or sys.argv[1:])}`  ",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared), torch "
        f"{torch.__version__}, 1 thread; sizes {sizes}, pretraining {args.pretrain_steps} Adam steps of 64 windows.",
        "",
        "Texts (characters): " + ", ".join(f"{k} {len(v):,}" for k, v in raw.items()) + ".",
        "",
    ]
    continual_runs, ood_runs, pretrain_loss = [], [], []
    header = lines

    def report(done: list[int]) -> None:
        """Write the table over the seeds done so far (after each seed: a stopped run keeps what it finished)."""
        lines = list(header)
        lines += [f"Pretraining loss on its own text (nats/char, 500 windows): {mean_se(pretrain_loss)}.", ""]
        if continual_runs:
            names = ["descriptions", "source", "tables"]
            lines += [
                "## (a) Continual learning: held-out loss (nats/char) on every episode after the last one",
                "",
                f"Mean ± standard error over seeds {done}; {sizes['test']} held-out windows per episode.",
                "",
                "| arm | " + " | ".join(f"episode {i + 1} ({n})" for i, n in enumerate(names)) + " | mean | seconds |",
                "|---|" + "---:|" * (len(names) + 2),
            ]
            for arm in args.arms:
                last = [[run[0][arm][-1][i] for run in continual_runs] for i in range(len(names))]
                mean = [sum(run[0][arm][-1]) / len(names) for run in continual_runs]
                secs = [run[1][arm] for run in continual_runs]
                lines.append(
                    f"| {arm} | " + " | ".join(mean_se(v) for v in last) + f" | {mean_se(mean)} | {mean_se(secs)} |"
                )
            lines += ["", "Loss on episode 1 (descriptions) after each episode:", ""]
            lines += ["| arm | after 1 | after 2 | after 3 |", "|---|---:|---:|---:|"]
            for arm in args.arms:
                cells = [mean_se([run[0][arm][k][0] for run in continual_runs]) for k in range(len(names))]
                lines.append(f"| {arm} | " + " | ".join(cells) + " |")
            lines.append("")
        if ood_runs:
            lines += [
                "## (b) OOD detection: held-out descriptions (in domain) against the same items in rot13",
                "",
                f"AUROC, mean ± standard error over seeds {done}; {sizes['test']} items of each kind, each scored "
                f"by its last {KEEP} characters; parallel SGHMC: {args.chains} chains × {sizes['keep_draws']} draws.",
                "",
                "| method | AUROC total | AUROC epistemic | loss in domain | loss out of domain | seconds |",
                "|---|---:|---:|---:|---:|---:|",
            ]
            for name in ood_runs[0]:

                def cell(key, name=name):
                    return mean_se([run[name][key] for run in ood_runs])

                epistemic = cell("auroc_epistemic") if name == "parallel SGHMC" else "—"
                seconds = cell("seconds") if "seconds" in ood_runs[0][name] else "—"
                losses = f"{cell('loss_in')} | {cell('loss_out')}"
                lines.append(f"| {name} | {cell('auroc_total')} | {epistemic} | {losses} | {seconds} |")
            lines.append("")
        text = "\n".join(lines)
        print(text)
        if args.out:
            os.makedirs(os.path.dirname(args.out), exist_ok=True)
            with open(args.out, "w", encoding="utf-8") as handle:
                handle.write(text)

    for seed in args.seeds:
        began = time.perf_counter()
        lm = pretrain(corpora["pretraining"], args.pretrain_steps, seed)
        held = windows(corpora["pretraining"], 500, torch.Generator().manual_seed(seed + 7))
        with torch.no_grad():
            logits = lm(input_ids=held[:, :-1]).logits
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), held[:, 1:].reshape(-1)).item()
        pretrain_loss.append(loss)
        print(f"seed {seed}: pretrained in {time.perf_counter() - began:.0f} s, loss {loss:.3f} nats/char", flush=True)
        if "continual" in args.parts:
            episodes = [corpora["descriptions"], corpora["source"], corpora["tables"]]
            history, seconds = continual(
                lm, episodes, args.arms, sizes["train"], sizes["test"], sizes["map_steps"], seed
            )
            continual_runs.append((history, seconds))
            for arm, rows in history.items():
                print(
                    f"  {arm:14s} {seconds[arm]:5.0f} s  " + " | ".join(" ".join(f"{v:.2f}" for v in r) for r in rows)
                )
        if "ood" in args.parts:
            result = ood(
                lm, corpora, sizes["train"], sizes["test"], args.chains, sizes["sghmc_steps"], sizes["keep_draws"], seed
            )
            ood_runs.append(result)
            for name, r in result.items():
                print(f"  {name:14s} " + " ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
        report(args.seeds[: args.seeds.index(seed) + 1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
