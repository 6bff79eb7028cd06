"""offload="parameters" in one process: stages' weights streamed to the "device" as a pipeline schedule uses them.

The stages are driven as ``torch.distributed.pipelining`` drives them (each stage's forward on a detached input,
its backward from the gradient of its output); the gradients must equal those of the same stages never
released, bit for bit, and only the active and the prefetched stage may hold device storage.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_spot.partition.discovery import ModelContractError
from lightning_spot.runtime.weight_streaming import WeightStreaming


def _stages(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.GELU()) for _ in range(4)]


def _run(stages: list[nn.Module], order: list[tuple[str, int, int]], weights: WeightStreaming | None) -> list:
    """Run ``order``'s (kind, stage, micro-batch) actions; return what the stages saw as residency."""
    torch.manual_seed(1)
    inputs = [torch.randn(3, 6) for _ in range(2)]
    acts: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    grads: dict[tuple[int, int], torch.Tensor] = {}
    seen = []
    backwards = dict.fromkeys(range(len(stages)), 0)
    for kind, s, mb in order:
        if weights is not None:
            weights.use(s)
            seen.append((weights.resident_stages(), weights.active, weights.prefetched))
        if kind == "F":
            x = (inputs[mb] if s == 0 else acts[(s - 1, mb)][1]).detach().requires_grad_()
            acts[(s, mb)] = (x, stages[s](x))
        else:
            x, y = acts.pop((s, mb))
            y.backward(grads.pop((s, mb)) if s < len(stages) - 1 else torch.ones_like(y) * (mb + 1))
            grads[(s - 1, mb)] = x.grad
            backwards[s] += 1
            if weights is not None and backwards[s] == len(inputs):
                weights.backward_done(s)
    if weights is not None:
        weights.finish()
    return seen


BFS = [("F", s, mb) for s in range(4) for mb in range(2)] + [
    ("B", s, mb) for s in reversed(range(4)) for mb in range(2)
]
# 1F1B-like on one rank holding all stages: stages come back several times, gradients go to the host between
ALTERNATING = [("F", s, 0) for s in range(4)] + [("B", s, 0) for s in reversed(range(4))]
ALTERNATING += [("F", s, 1) for s in range(4)] + [("B", s, 1) for s in reversed(range(4))]


@pytest.mark.parametrize("order", [BFS, ALTERNATING], ids=["breadth-first", "alternating"])
def test_streamed_weights_give_the_same_gradients_and_stay_two_stages_at_most(order: list) -> None:
    plain, streamed = _stages(), _stages()
    _run(plain, order, None)
    weights = WeightStreaming({s: [m] for s, m in enumerate(streamed)}, torch.device("cpu"))
    for step in range(2):  # the second step prefetches in the order the first one recorded
        for m in streamed:
            m.zero_grad(set_to_none=True)
        weights.begin("train")
        seen = _run(streamed, order, weights)
        for resident, active, prefetched in seen:
            assert resident <= {active, prefetched} and active in resident, (resident, active, prefetched)
        assert any(len(r) == 2 for r, _, _ in seen) == (step == 1)  # prefetching starts once the order is known
    for a, b in zip(plain, streamed):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p.grad, q.grad), name  # the grads of the second step; the first's were cleared
            assert q.grad.device == weights.masters[id(q)].device
    # at rest every weight is its host master and no device storage is left
    for p in (p for m in streamed for p in m.parameters()):
        assert p.data_ptr() == weights.masters[id(p)].data_ptr()
        assert weights.device_tensor(p).untyped_storage().nbytes() == 0
    assert weights.resident_bytes == 0 and weights.peak_bytes <= 2 * weights.stage_bytes(0)
    if order is BFS:  # once for the forward, once for the backward; the last stage stays for its backward
        assert weights.loads == 2 * (2 * 4 - 1)


def test_a_parameter_viewing_a_larger_tensor_is_refused() -> None:
    flat = torch.zeros(12)
    layer = nn.Linear(2, 2)
    layer.weight = nn.Parameter(flat[:4].view(2, 2))
    with pytest.raises(ModelContractError, match="storage of its own"):
        WeightStreaming({0: [layer]}, torch.device("cpu"))
