import pytest
import torch

from affineq.tensor import fallback


@pytest.fixture(autouse=True)
def _fresh_state():
    """Each test starts seeded, with no fallback announced yet and strict mode off."""
    torch.manual_seed(0)
    fallback.reset_announcements()
    fallback.set_strict(False)
    yield
    fallback.set_strict(False)


def sqnr(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB."""
    ref, approx = ref.double(), approx.double()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - approx).pow(2).mean()))
