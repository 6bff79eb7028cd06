"""Calls of a model split into stages made outside a step: every rank of the pipeline runs the call together.

    self.model.generate(prompt, max_new_tokens=20)   # in on_validation_epoch_end, or after fit: on every rank

A step's code runs under the engine's schedule; code in a hook or after ``fit`` calls the model directly. There,
each rank runs the call with its own layers: at the first layer of each stage it holds, the hidden state comes from
the rank of the stage before (one message); after each stage's last layer it goes to the rank of the next; a
module of the last stage called after the layers (the final norm, the head) gives its real output on every rank,
broadcast from the last stage's rank. Modules of other stages before the layers stand in with zeros of their
shapes, as in a step. So every rank gets the output one process would, and ``generate`` (key-value cache
included) picks the same tokens everywhere: each call starts from the first stage's random state on every rank, and
goes on from the last stage's after the last stage's modules, so sampling draws alike too. Inference only: no gradient crosses stages.

A call that some ranks of the pipeline make and others do not (``if self.global_rank == 0:``) cannot run: the
ranks meet at each call's first layer and the call is refused by name after ``timeout`` seconds.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_spot.partition.cuts import StagePlan
from lightning_spot.partition.discovery import ModelContractError
from lightning_spot.partition.stage_run import _fed, hidden_argument, outside_call

#: engines made in this process (each one's calls meet under keys of its own in the store; every rank makes one
#: per fit, so the count is the same on every rank, also where a pipeline of one stage has no calls to run)
_ENGINES = itertools.count()


def next_engine() -> int:
    """Count an engine made on this rank (every engine, whether its pipeline has several stages or not)."""
    return next(_ENGINES)


class OutsideCalls:
    """Runs calls of the placed model outside steps across the ranks of this rank's pipeline."""

    def __init__(
        self,
        plan: StagePlan,
        pp_rank: int,
        dp_rank: int,
        group: dist.ProcessGroup | None,
        device: torch.device,
        timeout: float = 60.0,
        engine: int = 0,
    ) -> None:
        self.plan, self.pp_rank, self.group, self.device = plan, pp_rank, group, device
        self.local = [s for s in range(plan.num_stages) if plan.rank_of_stage(s) == pp_rank]
        self.last_rank = plan.rank_of_stage(plan.num_stages - 1)
        self.timeout = timeout
        self.prefix = f"lightning_spot/outside/{engine}/{dp_rank}"
        self.calls = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> OutsideCalls:
        return self  # (one per pipeline and process: a copy of the module, such as an average's, calls through it)

    def layer_call(
        self,
        layer: nn.Module,
        original: Any,
        position: tuple[str, int, bool, bool],
        args: tuple,
        kwargs: dict[str, Any],
        activation: str | None,
    ) -> Any:
        """Run one of this rank's layers in a call outside a step: meet the other ranks at the first layer of the
        rank's first stage, take the hidden state from the rank before at a stage's first layer, send it on after
        its last."""
        fqn, stage, first, last = position
        if first and stage == self.local[0]:
            self._meet(fqn)
        if first and stage > 0 and self.plan.rank_of_stage(stage - 1) != self.pp_rank:
            given = hidden_argument(args, kwargs, activation)
            received = self._receive(self.plan.rank_of_stage(stage - 1))
            if isinstance(given, torch.Tensor) and given.shape != received.shape:
                raise ModelContractError(
                    f"Layer `{fqn}` was called with a hidden state of shape {tuple(given.shape)} outside a step, but "
                    f"the stage before sent {tuple(received.shape)}: every rank must make the same calls of the model."
                )
            args, kwargs = _fed(fqn, args, kwargs, activation, received)
        out = original(layer, *args, **kwargs)
        if last and stage < self.plan.num_stages - 1 and self.plan.rank_of_stage(stage + 1) != self.pp_rank:
            hidden = out if isinstance(out, torch.Tensor) else tree_flatten(out)[0][0]
            self._send(hidden, self.plan.rank_of_stage(stage + 1))
        return out

    def last_output(self, out: Any) -> Any:
        """A module of the last stage, called outside a step: its output, broadcast from the last stage's rank (the
        real output there, the meta one computed for its shape elsewhere)."""
        leaves, spec = tree_flatten(out)
        shapes = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None for t in leaves]
        header = [shapes if self.pp_rank == self.last_rank else None]
        dist.broadcast_object_list(header, group=self.group, group_src=self.last_rank, device=self._object_device())
        sent: list[Any] = header[0] or []
        if len(sent) != len(leaves):
            raise ModelContractError(
                f"A module of the last stage returned {len(sent)} values there but {len(leaves)} here, outside a step."
            )
        result = []
        for leaf, spec_of in zip(leaves, sent):
            if spec_of is None:
                result.append(leaf)
                continue
            tensor = leaf.detach().contiguous() if self.pp_rank == self.last_rank else None
            if tensor is None:
                tensor = torch.empty(spec_of[0], dtype=spec_of[1], device=self.device)
            dist.broadcast(tensor, group=self.group, group_src=self.last_rank)
            result.append(leaf if self.pp_rank == self.last_rank else tensor)
        self._same_draws(self.last_rank)  # (the modules that ran on some ranks only may have drawn: dropout)
        return tree_unflatten(result, spec)

    def watch_last(self, module: nn.Module) -> None:
        """On the last stage's rank: a module of the last stage broadcasts its output when called outside a step."""

        def hook(_module: nn.Module, _args: Any, out: Any) -> Any:
            return self.last_output(out) if outside_call() else None

        module.register_forward_hook(hook)

    # ------------------------------------------------------------------ messages between the ranks

    def _object_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None

    def _send(self, tensor: torch.Tensor, to: int) -> None:
        tensor = tensor.detach().contiguous()
        header = torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape], dtype=torch.int64)
        header = torch.cat([header, header.new_zeros(_HEADER - len(header))]).to(self.device)
        dist.send(header, group=self.group, group_dst=to)
        dist.send(tensor, group=self.group, group_dst=to)

    def _receive(self, source: int) -> torch.Tensor:
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, group=self.group, group_src=source)
        dtype, ndim, *rest = header.tolist()
        tensor = torch.empty(rest[:ndim], dtype=_DTYPES[dtype], device=self.device)
        dist.recv(tensor, group=self.group, group_src=source)
        return tensor

    def _meet(self, fqn: str) -> None:
        """Wait (up to ``timeout``) until every rank of the pipeline has begun this call."""
        store = dist.distributed_c10d._get_default_store()
        call, self.calls = self.calls, self.calls + 1
        key = f"{self.prefix}/{call}"
        store.set(f"{key}/{self.pp_rank}", "1")
        ranks = sorted({self.plan.rank_of_stage(s) for s in range(self.plan.num_stages)})
        try:
            store.wait([f"{key}/{r}" for r in ranks], timedelta(seconds=self.timeout))
        except RuntimeError as err:
            missing = [r for r in ranks if not store.check([f"{key}/{r}"])]
            raise ModelContractError(
                f"This rank (pipeline rank {self.pp_rank}) called the model outside a step (layer `{fqn}`), and "
                f"pipeline rank(s) {missing} did not within {self.timeout:g} s. The model is split into pipeline "
                f"stages, so such a call (generate in a hook, an evaluation after fit) runs on every rank of the "
                f"pipeline together, each its own layers: make it on every rank, not under `if self.global_rank == "
                f"0:` (log or print its result on one rank instead)."
            ) from err
        if call >= 2:  # (everyone has passed call-2's meeting once this rank is at call's: its keys can go)
            store.delete_key(f"{self.prefix}/{call - 2}/{self.pp_rank}")
        self._same_draws(self.plan.rank_of_stage(0))

    def _same_draws(self, first: int) -> None:
        """Give every rank of the pipeline the random state of pipeline rank ``first``: what the call draws where
        every rank runs the same code (``generate``'s sampling) is then the same everywhere, and so are the tokens
        each rank goes on with."""
        shared = torch.get_rng_state().to(self.device)
        dist.broadcast(shared, group=self.group, group_src=first)
        if self.pp_rank != first:
            torch.set_rng_state(shared.cpu())
        if self.device.type == "cuda":
            shared = torch.cuda.get_rng_state(self.device).to(self.device)
            dist.broadcast(shared, group=self.group, group_src=first)
            if self.pp_rank != first:
                torch.cuda.set_rng_state(shared.cpu(), self.device)


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]
_HEADER = 10
