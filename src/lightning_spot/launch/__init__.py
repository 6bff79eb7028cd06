"""The elastic launcher behind ``lightning-spot run`` (``python -m lightning_spot.launch <torchrun flags>``).

torchrun's agent, with what a restart on spot capacity needs:

- workers forked from a server that has already imported torch, Lightning and lightning_spot (``forked``), so a
  restarted worker skips the imports (4-7 s of every restart on small machines);
- a node whose agent is stopped by a notice leaves the rendezvous at once (``rendezvous``), so the others do not
  wait out its keep-alive.

Kept light: the preemption code reads :data:`AGENT_PID_ENV` from here.
"""

#: the agent's process id, in every worker's environment (a forked worker's parent is the fork server)
AGENT_PID_ENV = "LIGHTNING_SPOT_AGENT_PID"
