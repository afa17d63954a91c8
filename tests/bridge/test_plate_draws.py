"""A plate Pyro subsamples inside the bridge's contexts: Pyro's indices and random state without randperm(N)."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.poutine.subsample_messenger import _Subsample

from pyro_scalable.bridge import plates
from pyro_scalable.bridge.plates import plate_indices


def _traced_indices(size: int, subsample_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plate's indices, the global random state after them and a draw after that."""

    def model():
        with pyro.plate("data", size, subsample_size=subsample_size) as idx:
            pyro.sample("obs", dist.Normal(0.0, 1.0), obs=torch.zeros(subsample_size))
        return idx

    torch.manual_seed(seed)
    indices = model()
    return indices, torch.get_rng_state(), torch.rand(3)


@pytest.mark.parametrize(("size", "subsample_size"), [(64, 1), (10_000, 100), (1_000_003, 1000), (2**20, 16_384)])
@pytest.mark.parametrize("seed", [0, 7])
def test_pyro_s_indices_and_random_state_bit_for_bit(size, subsample_size, seed):
    pyro_alone = _traced_indices(size, subsample_size, seed)
    calls = []
    original = plates._first_of_permutation

    def counted(self, sample_shape=()):
        calls.append(self.size)
        return original(self, sample_shape)

    plates._first_of_permutation = counted  # installed by the outermost context below
    try:
        with plate_indices({}):
            ours = _traced_indices(size, subsample_size, seed)
    finally:
        plates._first_of_permutation = original
    assert calls == [size]
    for a, b in zip(pyro_alone, ours, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert len(set(ours[0].tolist())) == subsample_size  # distinct, as a permutation's


def test_the_permutation_is_skipped_only_where_it_is_cheaper_and_pyro_s_draw_is_back_outside():
    assert _Subsample.sample is plates._PYRO_SAMPLE
    with plate_indices({}):
        assert _Subsample.sample is plates._first_of_permutation
        for size, subsample_size in [(100, 50), (10, 9)]:  # a large share of N: randperm itself
            torch.manual_seed(1)
            expected = torch.randperm(size)[:subsample_size]
            torch.manual_seed(1)
            assert torch.equal(_Subsample(size, subsample_size).sample(), expected)
    assert _Subsample.sample is plates._PYRO_SAMPLE
