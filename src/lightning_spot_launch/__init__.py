"""The elastic launcher behind ``lightning-spot run`` (``python -m lightning_spot_launch <torchrun flags>``).

torchrun's agent, with what a restart on spot capacity needs:

- workers forked from a server that has already imported torch, Lightning and lightning_spot (``forked``), so a
  restarted worker skips the imports (4-7 s of every restart on small machines);
- a node whose agent is stopped by a notice leaves the rendezvous at once (``rendezvous``), so the others do not
  wait out its keep-alive;
- a node whose pipeline cannot train on the nodes it has left joins another such pipeline's rendezvous when its
  workers say so (``moves``: Oobleck's merge of two broken pipelines' survivors).

A top-level package beside ``lightning_spot``, not inside it: importing ``lightning_spot`` imports Lightning (~3 s
on small machines), and the agent of a node that joins should reach the rendezvous in ~1 s, as torchrun's does.
The preemption and failure code read :data:`AGENT_PID_ENV` and the exit codes from here.
"""

#: the agent's process id, in every worker's environment (a forked worker's parent is the fork server)
AGENT_PID_ENV = "LIGHTNING_SPOT_AGENT_PID"

#: a rank stopped by a preemption notice (every rank of the job alike): restarted
PREEMPTED_EXIT_CODE = 75
#: a rank stopped because a peer was lost (killed, frozen, its node gone): restarted, not an error of the job's code
PEER_LOST_EXIT_CODE = 69
#: every rank of a pipeline that could not train alone, leaving to join another one (``moves``): its agent joins
#: that pipeline's rendezvous instead; neither restarted nor an error
MOVED_EXIT_CODE = 76
#: a rank stopped by an error (its own, or another rank's that every rank stops for): restarted at most
#: ``--max-failures`` times
FAILED_EXIT_CODE = 1
