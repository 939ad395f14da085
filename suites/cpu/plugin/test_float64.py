"""float64_reference: original module untouched, gradients right, grad_output reusable."""

import pytest
import torch
from torch import nn

from pytest_linattn.float64 import Float64Result, float64_reference


class Gated(nn.Module):
    """Two inputs, an integer argument, a tuple output, a frozen and an unused parameter."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)
        self.unused = nn.Parameter(torch.randn(2))

    def forward(self, x, gate, idx):
        y = self.lin(x) * torch.sigmoid(gate) + self.frozen
        return y[:, idx], "ignored extra"


def _module():
    torch.manual_seed(0)
    return Gated().to(torch.float32)


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g), torch.tensor([2, 0, 1])


def _manual(m, x, gate, idx, go):
    """The same computation by hand, in float64."""
    w, b, fr = (t.detach().double().requires_grad_() for t in (m.lin.weight, m.lin.bias, m.frozen))
    x, gate = x.double().requires_grad_(), gate.double().requires_grad_()
    y = ((x @ w.T + b) * torch.sigmoid(gate) + fr)[:, idx]
    y.backward(go)
    return y.detach(), x.grad, gate.grad, w.grad, b.grad


def test_matches_manual_float64_and_leaves_original_alone():
    m = _module()
    m.lin.weight.grad = torch.full_like(m.lin.weight, 7.0)  # must survive
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x, gate, idx = _inputs()
    ref = float64_reference(m, x, gate, idx)

    assert isinstance(ref, Float64Result)
    assert ref.output.dtype == torch.float64 and not ref.output.requires_grad
    y, dx, dgate, dw, db = _manual(m, x, gate, idx, ref.grad_output)
    torch.testing.assert_close(ref.output, y, rtol=1e-14, atol=0)
    assert ref.input_grads[2] is None  # integer input
    torch.testing.assert_close(ref.input_grads[0], dx, rtol=1e-14, atol=0)
    torch.testing.assert_close(ref.input_grads[1], dgate, rtol=1e-14, atol=0)
    assert set(ref.param_grads) == {"lin.weight", "lin.bias", "unused"}  # frozen: no grad
    torch.testing.assert_close(ref.param_grads["lin.weight"], dw, rtol=1e-14, atol=0)
    torch.testing.assert_close(ref.param_grads["lin.bias"], db, rtol=1e-14, atol=0)
    assert torch.equal(ref.param_grads["unused"], torch.zeros(2, dtype=torch.float64))

    # The original: same dtype, same values, its .grad unchanged, no new grads, inputs untouched.
    assert m.lin.weight.dtype == torch.float32
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
    assert torch.equal(m.lin.weight.grad, torch.full_like(m.lin.weight, 7.0))
    assert m.lin.bias.grad is None and m.unused.grad is None
    assert not x.requires_grad and x.grad is None


def test_default_grad_output_is_seeded_random_and_rng_untouched():
    m, (x, gate, idx) = _module(), _inputs()
    state = torch.random.get_rng_state()
    a = float64_reference(m, x, gate, idx)
    assert torch.equal(state, torch.random.get_rng_state())
    b = float64_reference(m, x, gate, idx)
    assert torch.equal(a.grad_output, b.grad_output)
    go = a.grad_output
    assert go.dtype == torch.float64 and go.shape == a.output.shape
    assert go.abs().min() > 0 and go.std() > 0.3  # neither zeros nor a constant like ones
    assert not torch.equal(go, float64_reference(m, x, gate, idx, seed=5).grad_output)


def test_grad_output_reuse_for_the_actual_run():
    m, (x, gate, idx) = _module(), _inputs()
    ref = float64_reference(m, x, gate, idx)
    # The run being checked: float32, the reference's upstream gradient cast to it.
    xa = x.clone().requires_grad_()
    y, _ = m(xa, gate, idx)
    y.backward(ref.grad_output.to(y))
    torch.testing.assert_close(xa.grad.double(), ref.input_grads[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m.lin.weight.grad.double(), ref.param_grads["lin.weight"], rtol=1e-5, atol=1e-6)
    # Passing it back in gives the same reference.
    again = float64_reference(m, x, gate, idx, grad_output=ref.grad_output.float())
    torch.testing.assert_close(again.input_grads[0], ref.input_grads[0], rtol=1e-6, atol=0)


def test_forward_kwargs_and_no_grad_context():
    class Scale(nn.Module):
        def forward(self, x, *, factor):
            return x * factor

    x = torch.randn(3, dtype=torch.float16)
    with torch.no_grad():
        ref = float64_reference(Scale(), x, forward_kwargs={"factor": torch.tensor(2.0)})
    torch.testing.assert_close(ref.input_grads[0], 2 * ref.grad_output)
    assert ref.param_grads == {}


def test_bad_input_raises_value_error():
    with pytest.raises(ValueError, match="^module"):
        float64_reference(lambda x: x, torch.randn(2))
    with pytest.raises(ValueError, match="^grad_output"):
        float64_reference(nn.Linear(2, 2), torch.randn(3, 2), grad_output=torch.randn(2, 2))
    with pytest.raises(ValueError, match="^module forward"):
        float64_reference(nn.Flatten(0), torch.tensor([1, 2]))
