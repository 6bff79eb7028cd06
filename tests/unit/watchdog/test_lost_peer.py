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
