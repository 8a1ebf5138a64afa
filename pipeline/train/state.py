"""The training state DeepSpeed does not save itself: named Stateful parts, saved and restored as one list.

DeepSpeed writes and reads the engine (model, optimizer, schedule) in each tag. Everything else a resume
needs goes into the tag's client state, one entry per part, in this order:

    data       the train loader's position and bad-data counts: layout-free, so the same samples follow
               on any world size (`LoaderState`)
    objective  the objective's own state: a teacher, running centers ({} for supervised)
    ema        the model EMA's weights, full fp32 (`pipeline.train.ema.ModelEma`), only with train.ema_decay
    rng        every rank's RNG: torch, Python, NumPy, CUDA (`RngState`); restored on the same world size

`ClientState.state_dict()` is collective (each part may gather from every rank, and every rank calls the
parts in the same order); `load_state_dict()` restores the parts in the same order, the RNG last so that
nothing draws from it after it is set. A part is one object with `state_dict` and `load_state_dict`, as
in torchtitan: adding one to the training state is one entry where the trainer builds its ClientState.
"""

from __future__ import annotations

from typing import Any, Protocol

from pipeline.data import merge_counters
from pipeline.dist import DistEnv, say
from pipeline.train.checkpoint import CLIENT_PARTS, gather_to_all, rng_state, set_rng_state


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class LoaderState:
    """The train loader as a part: its position (the next step's samples), with every rank's bad-data
    counts merged into the one layout-free record (collective)."""

    def __init__(self, loader: Any):
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict(merge_counters(gather_to_all(self.loader.counters())))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


class RngState:
    """Every rank's RNG, gathered into one list (collective). Restored only on the same world size: on
    another, rank r's saved state belongs to no rank; the same samples still follow (the order does not
    depend on these RNGs), but dropout's draws differ, and that is said once."""

    def __init__(self, env: DistEnv):
        self.env = env

    def state_dict(self) -> list[dict[str, Any]]:
        return gather_to_all(rng_state())

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        if len(states) == self.env.world_size:
            set_rng_state(states[self.env.rank])
        else:
            say(f"note: checkpoint was written by {len(states)} ranks, this job has {self.env.world_size}: "
                f"the same samples follow, but dropout's random draws differ")


# Why a resumed run may not keep a part its checkpoint has, by part.
DROPPED_BECAUSE = {"ema": " (the model EMA: train.ema_decay is not set, so the run evaluates and exports its "
                          "raw weights)"}


class ClientState:
    """The parts, by name, in save and restore order. `optional`: parts a tag may lack (written before the
    part existed); they are given {} on restore."""

    def __init__(self, parts: dict[str, Stateful], optional: tuple[str, ...] = ()):
        self.parts, self.optional = parts, optional

    def state_dict(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, client: dict[str, Any], where: str) -> None:
        missing = [n for n in self.parts if n not in client and n not in self.optional]
        if missing:
            raise KeyError(f"{where}: its client state has no {', '.join(missing)} (has {', '.join(client)})")
        for name, part in self.parts.items():
            part.load_state_dict(client.get(name, {}))
        # A part this run turned off; DeepSpeed's own keys beside the parts (ds_config, ...) are not parts.
        for name in [n for n in client if n in CLIENT_PARTS and n not in self.parts]:
            say(f"note: {where} holds the part '{name}', which this run does not keep{DROPPED_BECAUSE.get(name, '')}: "
                "it is not restored, and the next checkpoint will not have it")


def training_client_state(loader: Any, objective: Stateful, env: DistEnv, ema: Stateful | None = None
                          ) -> ClientState:
    """The trainer's parts. Optional entries: the objective's (tags written before objectives had state) and
    the model EMA's (a run that turns train.ema_decay on: its EMA starts from the resumed weights)."""
    ema_part = {"ema": ema} if ema is not None else {}
    return ClientState({"data": LoaderState(loader), "objective": objective, **ema_part, "rng": RngState(env)},
                       optional=("objective", "ema"))
