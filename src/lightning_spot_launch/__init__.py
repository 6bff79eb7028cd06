"""The elastic launcher behind ``lightning-spot run`` (``python -m lightning_spot_launch <torchrun flags>``).

torchrun's agent, with what a restart on spot capacity needs:

- workers forked from a server that has already imported torch, Lightning and lightning_spot (``forked``), so a
  restarted worker skips the imports (4-7 s of every restart on small machines);
- a node whose agent is stopped by a notice leaves the rendezvous at once (``rendezvous``), so the others do not
  wait out its keep-alive.

A top-level package beside ``lightning_spot``, not inside it: importing ``lightning_spot`` imports Lightning (~3 s
on small machines), and the agent of a node that joins should reach the rendezvous in ~1 s, as torchrun's does.
The preemption code reads :data:`AGENT_PID_ENV` from here.
"""

#: the agent's process id, in every worker's environment (a forked worker's parent is the fork server)
AGENT_PID_ENV = "LIGHTNING_SPOT_AGENT_PID"
