"""torchft's pieces in one process: each pipeline's share of the batch, the weighted gradient buckets, errors that name the fix."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_spot.layout import LayoutError
from lightning_spot.torchft import TorchFT
from lightning_spot.torchft.batch_split import participant_rows, take_rows
from lightning_spot.torchft.config import check_reachable
from tests.distributed import free_port


def test_shares_are_whole_microbatches_and_cover_the_batch() -> None:
    for count in (1, 2, 3):
        rows = [participant_rows(12, 2, r, count) for r in range(count)]
        assert rows[0].start == 0 and rows[-1].stop == 12
        assert all(a.stop == b.start for a, b in zip(rows, rows[1:]))
        assert all((s.stop - s.start) % 2 == 0 for s in rows)
    assert [participant_rows(10, 2, r, 3) for r in range(3)] == [slice(0, 4), slice(4, 8), slice(8, 10)]
    with pytest.raises(LayoutError, match="batch_size of at least 8"):
        participant_rows(6, 2, 0, 4)
    batch = {"x": torch.arange(12), "meta": "kept", "pair": (torch.zeros(12, 3), torch.ones(()))}
    part = take_rows(batch, slice(4, 8), 12)
    assert part["x"].tolist() == [4, 5, 6, 7] and part["meta"] == "kept" and part["pair"][0].shape == (4, 3)


class _TwoPipelines:
    """An all-reduce (sum) between two threads, each standing in for one pipeline's stage."""

    def __init__(self) -> None:
        import threading

        self.barrier, self.slots = threading.Barrier(2, timeout=30), {}

    def allreduce(self, me: str) -> Any:
        def reduce(t: torch.Tensor) -> Any:
            self.slots[me] = t
            self.barrier.wait()
            total = sum(self.slots.values())
            self.barrier.wait()
            t.copy_(total)
            return type("Done", (), {"wait": lambda self: None})()

        return reduce


def test_early_buckets_carry_the_weighted_mean_whether_sent_during_the_backward_or_after() -> None:
    """Two pipelines (threads) train 8 and 4 rows of a batch of 12 in 2 micro-batches each: one sends its buckets
    during its backward, scaled from the sum of its micro-batch gradients (of losses divided by m); the other sends them after its step,
    from its mean gradient (as on its first step, when the scale is not known yet). Both end with the gradient
    of the whole batch, and the buckets went out in the same order on both."""
    import threading

    from torch import nn

    from lightning_spot.torchft.early_buckets import EarlyBuckets

    torch.manual_seed(0)
    x, y = torch.randn(12, 4), torch.randn(12, 2)
    reference = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    torch.nn.functional.mse_loss(reference(x), y).backward()
    pair = _TwoPipelines()
    models, buckets, errors = {}, {}, []

    def pipeline(me: str, rows: slice, scale: float | None) -> None:
        try:
            model = models[me] = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
            model.load_state_dict(reference.state_dict())
            early = buckets[me] = EarlyBuckets(list(model.parameters()), allreduce=pair.allreduce(me), bucket_bytes=32)
            early.arm(2, scale)
            for half in torch.chunk(torch.arange(rows.start, rows.stop), 2):
                # each micro-batch's loss divided by m (as the step runner does): grads end as their mean
                torch.nn.functional.mse_loss(model(x[half]), y[half]).div(2).backward()
            assert early.reduce(float(rows.stop - rows.start)) == 12.0
        except Exception as err:  # (reported below, from the test's thread)
            errors.append(err)

    threads = [
        threading.Thread(target=pipeline, args=("early", slice(0, 8), 8.0)),  # rows
        threading.Thread(target=pipeline, args=("after", slice(8, 12), None)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert len(buckets["early"].buckets) >= 3
    # (all but the last, which carries the weight, on the pipeline that sends early)
    assert buckets["early"].launched_early == len(buckets["early"].buckets) - 1 and buckets["after"].launched_early == 0
    for model in models.values():
        for p, want in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(p.grad, want.grad, atol=1e-6)


def test_buckets_sent_after_the_step_carry_the_weight_and_the_logged_sums_in_the_last_one() -> None:
    """TorchFT(overlap=False), the default: every bucket goes after the step and the last one carries the
    pipeline's weight and its logged sums (riders) after the gradients — one all-reduce per bucket, none for the
    weights or the logs — and the gradients are the whole batch's, as with the weight reduced on its own. A stage
    without parameters sends its weight and riders alone."""
    import threading

    from torch import nn

    from lightning_spot.torchft.early_buckets import EarlyBuckets

    torch.manual_seed(1)
    x, y = torch.randn(10, 4), torch.randn(10, 2)
    reference = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    torch.nn.functional.mse_loss(reference(x), y).backward()
    pair, models, calls, errors = _TwoPipelines(), {}, {"a": 0, "b": 0}, []

    def pipeline(me: str, rows: slice) -> None:
        try:
            model = models[me] = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
            model.load_state_dict(reference.state_dict())
            reduce = pair.allreduce(me)

            def counted(t: torch.Tensor) -> Any:
                calls[me] += 1
                return reduce(t)

            buckets = EarlyBuckets(list(model.parameters()), allreduce=counted, bucket_bytes=32, during_backward=False)
            buckets.arm(1, None)
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            riders = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]) * (rows.stop - rows.start)
            assert buckets.reduce(float(rows.stop - rows.start), riders) == 10.0
            assert calls[me] == len(buckets.buckets) >= 3
            assert riders.tolist() == [[10.0, 20.0, 30.0], [40.0, 50.0, 60.0]]
            bare = EarlyBuckets([], allreduce=reduce)  # (a stage without trainable parameters)
            riders = torch.tensor([float(rows.start)])
            assert bare.reduce(2.0, riders) == 4.0 and riders.tolist() == [7.0]
        except Exception as err:  # (reported below, from the test's thread)
            errors.append(err)

    threads = [
        threading.Thread(target=pipeline, args=(me, rows)) for me, rows in (("a", slice(0, 7)), ("b", slice(7, 10)))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for model in models.values():
        for p, want in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(p.grad, want.grad, atol=1e-6)


def test_missing_settings_and_an_unreachable_lighthouse_name_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    with pytest.raises(LayoutError, match="TORCHFT_LIGHTHOUSE=http://HOST:PORT"):
        TorchFT().resolved()
    with pytest.raises(LayoutError, match="REPLICA_GROUP_ID=0"):
        TorchFT(lighthouse="http://127.0.0.1:1").resolved()
    port = free_port()  # nothing listens there
    with pytest.raises(
        LayoutError, match=f"cannot reach the torchft lighthouse at http://127.0.0.1:{port}.*torchft_lighthouse"
    ):
        check_reachable(f"http://127.0.0.1:{port}", timeout=2)


def test_what_torchft_does_not_run_yet_is_refused_with_the_alternative() -> None:
    """Several data-parallel replicas in one process group and streamed weights are refused at setup; accumulation
    and offload="optimizer" are not (test_fault_tolerance runs each against one process)."""
    from types import SimpleNamespace

    from lightning_spot.layout import Layout
    from lightning_spot.torchft.attach import check_fits

    plain = SimpleNamespace(accumulate_grad_batches=1)
    check_fits(Layout(2, 1), plain, ("optimizer",))  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="one torchrun per pipeline"):
        check_fits(Layout(2, 2), plain)  # type: ignore[arg-type]
    check_fits(Layout(2, 1), SimpleNamespace(accumulate_grad_batches=2), ("optimizer",))  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="offload='parameters'.*offload='optimizer'"):
        check_fits(Layout(2, 1), plain, ("optimizer", "parameters"))  # type: ignore[arg-type]
