"""Copies to and from host memory made ahead of need, in one process: saved activations prefetched for the
backward (``offload="activations"``), gradients copied out as soon as their stage's backward is over
(``offload="optimizer"``). Whatever was copied early, the values used must be the current ones."""

from __future__ import annotations

import torch
from torch import nn

from lightning_spot.runtime.offload import ActivationOffload, OptimizerOffload


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _grads_through(model: nn.Module, offload: ActivationOffload | None, backward_order: list[int]) -> list:
    """Two micro-batches' forwards (filed under keys (0, mb)), then their backwards in ``backward_order``."""
    torch.manual_seed(1)
    inputs = [torch.randn(4, 5) for _ in range(2)]
    losses = {}
    for mb, x in enumerate(inputs):
        if offload is None:
            losses[mb] = model(x).pow(2).sum()
            continue
        offload.key = (0, mb)
        with offload.saving():
            losses[mb] = model(x).pow(2).sum()
    for mb in backward_order:
        if offload is not None:
            offload.prefetch((0, mb))
        losses[mb].backward()
    return [p.grad.clone() for p in model.parameters()]


def test_saved_activations_come_back_ahead_of_the_backward_with_the_same_values() -> None:
    want = _grads_through(_model(), None, [1, 0])
    offload = ActivationOffload(None)
    for step in range(2):
        model = _model()
        offload.new_step()
        before = offload.prefetched
        got = _grads_through(model, offload, [1, 0])
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        assert offload.prefetched - before == offload.saved_tensors // (step + 1)  # every saved tensor came back
    assert offload.prefetch_hits == offload.saved_tensors
    # from the second step on the order is known: micro-batch 0's tensors start back with micro-batch 1's backward
    offload.new_step()
    model = _model()
    for mb in range(2):
        offload.key = (0, mb)
        with offload.saving():
            model(torch.randn(4, 5)).sum()
    offload.prefetch((0, 1))
    assert (0, 0) not in offload._by_key and (0, 1) not in offload._by_key


def test_early_gradient_copies_are_used_only_while_the_gradient_is_unchanged() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    offload = OptimizerOffload([optimizer])
    model(torch.randn(4, 5)).sum().backward()
    offload.copy_out(model.parameters())  # the stage's backward is over
    first, second = list(model.parameters())[:2]
    first.grad.mul_(3)  # changed after the copy (tied copies summed, a replica average ...)
    want = [p.grad.clone() for p in model.parameters()]
    offload.to_host(optimizer)
    assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))  # the current values, all of them
    assert offload.early_copies_used == len(want) - 1  # all but the changed one came from the early copies
    assert all(p.grad.data_ptr() == offload._buffers[id(p)].data_ptr() for p in list(model.parameters())[1:])
    offload.to_device(optimizer)
    assert first.grad is None and second.grad is None


def test_the_host_update_uses_the_fused_kernel_unless_the_user_chose() -> None:
    """Adam/AdamW at their defaults run torch's fused CPU kernel on the host masters; the same update."""
    plain, fused = _model(), _model()
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (plain, fused)]
    offload = OptimizerOffload([opts[1]])
    assert offload.fused == ["AdamW"] and opts[1].param_groups[0]["fused"] is True
    for _ in range(3):
        for model, opt in zip((plain, fused), opts):
            opt.zero_grad()
            model(torch.randn(4, 5, generator=torch.Generator().manual_seed(2))).pow(2).sum().backward()
        opts[0].step()
        offload.to_host(opts[1])
        opts[1].step()
        offload.to_device(opts[1])
    for p, q in zip(plain.parameters(), fused.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)
    chosen = torch.optim.Adam(_model().parameters(), foreach=False)
    assert OptimizerOffload([chosen]).fused == [] and chosen.param_groups[0]["fused"] is None
