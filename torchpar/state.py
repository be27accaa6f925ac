"""The trainer's stateful parts that are not stateful by themselves: each has ``state_dict`` /
``load_state_dict`` (DCP's ``Stateful`` protocol), so the checkpointer can save and restore it
without knowing what it is."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchpar import device as dev
from torchpar.parallel.zero import ZeroState


@dataclass
class TrainState:
    """Where the run is: optimizer steps taken and tokens trained on."""

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.tokens_seen = int(sd["step"]), int(sd["tokens_seen"])


class ModelState:
    """The weights of a rank's model parts (pipeline stages), by the unsplit model's names: the
    ZeRO engine's fp32 master of the trained ones, whatever the compute dtype (a frozen base, kept,
    is in the compute dtype). ``left_out``: names a checkpoint does not
    hold (LoRA's frozen base, rebuilt at a resume from where it came from)."""

    def __init__(self, state: ZeroState, left_out: frozenset[str] = frozenset()):
        self.state, self.left_out = state, left_out

    def _kept(self, sd: dict) -> dict:
        return {k: v for k, v in sd.items() if k not in self.left_out} if self.left_out else sd

    def state_dict(self) -> dict:
        return self._kept(self.state.model_state_dict())

    def load_template(self) -> dict:
        """What a resume loads into (a save may write only part of what this rank holds)."""
        return self._kept(self.state.model_load_template())

    def load_state_dict(self, sd: dict) -> None:
        self.state.load_model_state_dict(sd)


class OptimizerState:
    """The ZeRO engine's optimizer state, per parameter name (the same format for every stage)."""

    def __init__(self, state: ZeroState):
        self.state = state

    def state_dict(self) -> dict:
        return self.state.optimizer_state_dict()

    def load_template(self) -> dict:
        return self.state.optimizer_load_template()

    def load_state_dict(self, sd: dict) -> None:
        self.state.load_optimizer_state_dict(sd)


class RNGState:
    """This rank's CPU RNG, and its GPU's, under keys of its own. ``keys_optional``: a rank that
    the saving layout did not have finds no key and keeps its seeded RNG (so does a GPU's resuming a
    CPU run). ``device``: restore the GPU's (a checkpoint of this layout: a rank's draws depend on
    its place — under another layout, tensor-parallel peers would get different states, and
    DTensor's random ops need them alike; the seeded one is alike everywhere)."""

    keys_optional = True

    def __init__(self, rank: int, device: bool = True):
        self.key, self.device_key, self.device = f"rank{rank}", f"rank{rank}_device", device

    def state_dict(self) -> dict:
        device = dev.device_rng_state()
        return {self.key: torch.get_rng_state(), **({self.device_key: device} if device is not None else {})}

    def load_state_dict(self, sd: dict) -> None:
        if self.key in sd:
            torch.set_rng_state(sd[self.key])
        if self.device and self.device_key in sd:
            dev.set_device_rng_state(sd[self.device_key])
