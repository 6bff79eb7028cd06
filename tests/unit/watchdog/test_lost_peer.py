"""A lost peer is recognised inside the errors that wrap it (``watchdog``)."""

from __future__ import annotations


def test_a_lost_peer_is_recognised_inside_the_error_that_wraps_it() -> None:
    """torch's pipeline stage wraps a DDP all-reduce's lost-peer error in "Failed to run stage backward": the
    peer's failure is still recognised, so that this rank shows one line, not a traceback."""
    from lightning_spot.watchdog.watch import _is_lost_peer

    try:
        try:
            raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")
        except RuntimeError as inner:
            raise RuntimeError("\n        Failed to run stage backward:\n        Stage output: ...") from inner
    except RuntimeError as wrapped:
        assert _is_lost_peer(wrapped)
    assert not _is_lost_peer(RuntimeError("Failed to run stage backward")), "an error of its own"
    assert not _is_lost_peer(ValueError("boom"))
    # a collective's timeout (gloo's words) is a silent peer; the user's own timeout is an error, not restarted as one
    gloo = "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation to complete"
    assert _is_lost_peer(RuntimeError(gloo))
    assert _is_lost_peer(RuntimeError("Application timeout caused pair closure"))
    assert not _is_lost_peer(RuntimeError("feature store: request timeout after 3 retries"))
    assert not _is_lost_peer(RuntimeError("the tokenizer service timed out"))


def test_a_lighthouse_that_stays_gone_exits_as_a_lost_peer_other_quorum_refusals_as_errors() -> None:
    """No quorum from the lighthouse within quorum_timeout (the coordinator gone): exit code 69, which schedulers
    relaunch (the pipelines resume from durable checkpoints); a quorum refused for a reason of the run's own (a
    restart that would train from step 1): an error, 1."""
    from lightning_spot.torchft.replica_group import LighthouseLostError, QuorumError
    from lightning_spot.watchdog.watch import _is_lost_peer

    try:
        try:
            raise TimeoutError("Timed out after 3s waiting for the lighthouse")
        except TimeoutError as inner:
            raise LighthouseLostError(
                "no quorum from the torchft lighthouse at http://head:29510 within 3 s"
            ) from inner
    except QuorumError as lost:
        assert _is_lost_peer(lost)
    assert not _is_lost_peer(QuorumError("no quorum with the pipelines that held step 8: it does not start the run"))
