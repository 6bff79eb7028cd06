"""What a rendezvous heartbeat costs the rendezvous store, by node count: the trade-off behind
``lightning-spot run --keep-alive`` (a dead node is given up after 3 missed beats, so shorter beats recover
sooner, and every node writes the whole rendezvous state once per beat).

    python benchmarks/rendezvous_heartbeat.py            # nodes 4 .. 1024, 1 s and 5 s beats

For each node count it builds torch's rendezvous state with that many participants, times one heartbeat's
store traffic (read the state, write it back with compare-and-set: what torchrun's agent does per beat) against
a TCPStore on this machine, and prints the state's size and the share of the store's time that all nodes'
beats take at each interval (one client here; nodes on a network add their round trips, not store time).
"""

from __future__ import annotations

import argparse
import pickle
import time
from datetime import datetime, timezone


def heartbeat_seconds(nodes: int, repeats: int) -> tuple[int, float]:
    """(state bytes, seconds per heartbeat) with ``nodes`` participants."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    backend = C10dRendezvousBackend(store, "heartbeat-bench")
    state = _RendezvousState()
    now = datetime.now(timezone.utc)
    for i in range(nodes):
        node = _NodeDesc(f"node-{i:04d}.cluster.internal", 10_000 + i, 0)
        state.participants[node] = i
        state.last_heartbeats[node] = now
    state.complete = True
    payload = pickle.dumps(state)
    backend.set_state(payload)
    start = time.perf_counter()
    for _ in range(repeats):
        read = backend.get_state()
        assert read is not None
        result = backend.set_state(payload, read[1])
        assert result is not None and result[2], "compare-and-set lost"
    return len(payload), (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="4,16,64,256,1024")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    print("nodes  state KiB  heartbeat ms  store busy at 1 s beats  at 5 s beats  dead node given up after")
    for nodes in (int(n) for n in args.nodes.split(",")):
        size, seconds = heartbeat_seconds(nodes, args.repeats)
        print(
            f"{nodes:5d}  {size / 1024:9.1f}  {1000 * seconds:12.3f}  {100 * nodes * seconds:22.1f}%  "
            f"{100 * nodes * seconds / 5:11.1f}%  3 s (1 s beats) / 15 s (5 s beats)"
        )


if __name__ == "__main__":
    main()
