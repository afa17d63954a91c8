r"""The network output of a Pyro model: the observed site's distribution, and the linear layers that made it.

Linearised Laplace treats a model as :math:`y_i \sim p(y \mid f(x_i, \theta))`, where
:math:`f` is the parameter of the observed site's distribution (the loc of a Normal, the logits of a Bernoulli).
:func:`model_outputs` runs the model with the latents substituted and returns that distribution *without*
evaluating or sampling it, so it works on training inputs (``obs`` given) and on test inputs (``obs=None``).

With ``layers=True`` it also records every affine map whose weight is a latent site: ``F.linear(a, W, b)`` (what
``PyroModule[nn.Linear]`` calls) and ``a @ W`` optionally followed by ``+ b``. For such a layer
:math:`z_i = W a_i + b`, so the per-example Jacobian of anything downstream factorises as
:math:`\partial h_i/\partial W = (\partial h_i/\partial z_i)\, a_i^\top`; the Laplace engine builds K-FAC factors,
exact GGN diagonals and predictive variances from :math:`a_i` and :math:`\partial h_i / \partial z_i` alone,
without per-example Jacobians. The recording uses a ``TorchFunctionMode`` and identifies weights by identity
with the values this module substituted, so it sees exactly the latent sites and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample
from torch import Tensor
from torch.overrides import TorchFunctionMode

from pyro_scalable.bridge.checks import ModelError
from pyro_scalable.bridge.model import Batch, Latents, ModelBridge, _validation
from pyro_scalable.bridge.plates import plate_indices

__all__ = ["LayerCall", "ModelOutputs", "model_outputs"]


@dataclass
class LayerCall:
    """One affine map whose weight is a latent site: ``F.linear``, ``inputs @ W [+ b]``, or a convolution.

    ``layout`` is ``"out_in"`` (``inputs @ W.T + b``), ``"in_out"`` (``inputs @ W + b``) or ``"conv"``, whose
    ``inputs`` are the unfolded patches ``(rows, in * kernel, locations)``.
    """

    weight: str
    layout: Literal["out_in", "in_out", "conv"]
    inputs: Tensor  # (rows, in), or (rows, in * kernel, locations) for a convolution
    outputs: Tensor  # (rows, out) or (rows,) for a vector weight; (rows, out, *spatial) for a convolution
    bias: str | None = None


@dataclass
class ModelOutputs:
    """The observed site's distribution at the substituted latents, its observed value and mask, and the layers."""

    site: str
    fn: Any
    value: Tensor | None
    mask: Tensor | None
    layers: list[LayerCall] = field(default_factory=list)
    priors: dict[str, Any] = field(default_factory=dict)  # latent site -> its distribution, before the site
    plate_sizes: dict[str, int] = field(default_factory=dict)  # subsampling plate -> its full size N
    raw_logits: Tensor | None = None  # a Categorical's logits before Pyro normalises them
    scale: Tensor | float | None = None  # the site's poutine.scale weight, the plates' N/B taken out (None: 1)


class _Stop(Exception):
    pass


class _Outputs(Messenger):
    def __init__(self, bridge: ModelBridge, latents: Latents, site: str):
        super().__init__()
        self.bridge = bridge
        self.latents = latents
        self.site = site
        self.values: dict[int, str] = {}
        self.result: ModelOutputs | None = None
        self.priors: dict[str, Any] = {}
        self.plate_sizes: dict[str, int] = {}

    def _pyro_sample(self, msg) -> None:
        if site_is_subsample(msg):
            self.plate_sizes[msg["name"]] = msg["fn"].size
            return
        name = msg["name"]
        if name == self.site:
            value = msg["value"] if msg["is_observed"] else None
            self.result = ModelOutputs(name, msg["fn"], value, msg["mask"], scale=_user_scale(msg))
            raise _Stop
        if msg["is_observed"]:
            return
        site = self.bridge.sites.get(name)
        if site is None:
            raise ModelError(
                f"latent site '{name}' did not appear when the model was first traced; "
                "the set of latent sites must not depend on the data."
            )
        value = site.transform(self.latents[name])
        self.values[id(value)] = name
        self.priors[name] = msg["fn"]
        msg["value"] = value
        msg["done"] = True


def _user_scale(msg) -> Tensor | float | None:
    """The site's scale without the subsampling plates' N/B: what ``poutine.scale`` (a weight) put there."""
    scale = msg["scale"]
    for frame in msg["cond_indep_stack"]:
        if frame.full_size is not None and frame.size:
            scale = scale / (frame.full_size / frame.size)  # each plate multiplied by size / subsample_size
    if not isinstance(scale, Tensor) and scale == 1.0:
        return None
    return scale


class _RecordLayers(TorchFunctionMode):
    """Record affine maps whose weight (and bias) are substituted latent values, and un-normalised logits."""

    def __init__(self, values: Mapping[int, str], layers: bool):
        super().__init__()
        self.values = values
        self.record = layers
        self.layers: list[LayerCall] = []
        self._by_output: dict[int, LayerCall] = {}
        self._normalizers: dict[int, Tensor] = {}
        self.unnormalized: dict[int, Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Categorical(logits=z) keeps only z - logsumexp(z); the linearised predictive wants z itself.
        name = getattr(func, "__name__", "")
        if name == "logsumexp":
            self._normalizers[id(out)] = args[0]
        elif name in ("sub", "__sub__") and len(args) == 2:
            source = self._normalizers.get(id(args[1]))
            if source is not None and source is args[0]:
                self.unnormalized[id(out)] = source
        elif name in ("expand", "reshape", "view") and args and id(args[0]) in self.unnormalized:
            # a plate expands the distribution, and with it the normalised logits
            self.unnormalized[id(out)] = func(self.unnormalized[id(args[0])], *args[1:], **kwargs)
        if not self.record:
            return out
        if func is F.linear:
            inputs, weight = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            name = self.values.get(id(weight))
            if name is not None and inputs.dim() == 2 and weight.dim() == 2:
                bias_name = self.values.get(id(bias)) if bias is not None else None
                if bias is None or bias_name is not None:
                    self._add(LayerCall(name, "out_in", inputs, out, bias_name))
        elif func in (F.conv1d, F.conv2d):
            self._conv(func, out, *args, **kwargs)
        elif func in (torch.matmul, Tensor.matmul, Tensor.__matmul__) and len(args) == 2:
            inputs, weight = args
            name = self.values.get(id(weight)) if isinstance(weight, Tensor) else None
            if name is not None and isinstance(inputs, Tensor) and inputs.dim() == 2 and weight.dim() in (1, 2):
                self._add(LayerCall(name, "in_out", inputs, out))
        elif func in (torch.add, Tensor.add, Tensor.__add__, Tensor.__radd__) and len(args) == 2:
            first, second = args
            layer = self._by_output.get(id(first)) or self._by_output.get(id(second))
            other = second if layer is not None and layer.outputs is first else first
            name = self.values.get(id(other)) if isinstance(other, Tensor) else None
            if layer is not None and layer.bias is None and name is not None and out.shape == layer.outputs.shape:
                width = layer.outputs.shape[-1] if layer.outputs.dim() == 2 else 1
                if other.numel() == width and other.dim() <= 1:
                    del self._by_output[id(layer.outputs)]
                    layer.bias, layer.outputs = name, out
                    self._by_output[id(out)] = layer
        return out

    def _conv(self, func, out, inputs, weight, bias=None, stride=1, padding=0, dilation=1, groups=1) -> None:
        name = self.values.get(id(weight))
        bias_name = self.values.get(id(bias)) if bias is not None else None
        spatial = weight.dim() - 2
        if name is None or groups != 1 or inputs.dim() != spatial + 2 or (bias is not None and bias_name is None):
            return
        kernel = weight.shape[2:]
        stride, dilation = _tuple(stride, spatial), _tuple(dilation, spatial)
        if isinstance(padding, str):
            if padding == "valid":
                padding = (0,) * spatial
            elif all(d * (k - 1) % 2 == 0 for d, k in zip(dilation, kernel)):
                padding = tuple(d * (k - 1) // 2 for d, k in zip(dilation, kernel))
            else:
                return  # asymmetric "same" padding: left to the generic path
        padding = _tuple(padding, spatial)
        # unfold works on 2-d images; a 1-d convolution is a 2-d one with a height of one
        image = inputs if spatial == 2 else inputs.unsqueeze(-2)
        lead = (1,) * (2 - spatial)  # the unit height of a 1-d convolution
        patches = F.unfold(
            image,
            lead + tuple(kernel),
            dilation=lead + dilation,
            padding=(0,) * (2 - spatial) + padding,
            stride=lead + stride,
        )
        self._add(LayerCall(name, "conv", patches, out, bias_name))

    def _add(self, layer: LayerCall) -> None:
        self.layers.append(layer)
        self._by_output[id(layer.outputs)] = layer


def _tuple(value, size: int) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * size


def model_outputs(
    bridge: ModelBridge, latents: Latents, batch: Batch, *, site: str, layers: bool = False
) -> ModelOutputs:
    """Run the model on ``batch`` (full data on every other plate) and return the observed ``site``'s distribution.

    ``latents`` are unconstrained values of every latent site. The model stops at ``site``: nothing after it runs.
    """
    capture = _Outputs(bridge, latents, site)
    recorder = _RecordLayers(capture.values, layers)
    try:
        # block: the model's sites are ours alone, never recorded by an enclosing trace (Predictive, SVI)
        with pyro.poutine.block(), _validation(False), plate_indices(batch.indices, full_data=True) as sizes:
            with capture, recorder:
                bridge.model(*batch.args, **batch.kwargs)
    except _Stop:
        pass
    capture.plate_sizes.update(sizes)
    if capture.result is None:
        raise ModelError(f"the model never reached its observed site '{site}' with these arguments.")
    if layers:
        capture.result.layers = recorder.layers
    base = capture.result.fn
    while hasattr(base, "base_dist"):
        base = base.base_dist
    if "logits" in base.__dict__ and isinstance(base, dist.Categorical):
        capture.result.raw_logits = recorder.unnormalized.get(id(base.__dict__["logits"]))
    capture.result.priors = capture.priors
    capture.result.plate_sizes = capture.plate_sizes
    return capture.result
