"""A deliberately broken model for the self-test to catch: Llama with attention sinks whose heads
read their sinks in reverse order. On one device that is only another labelling of the same
parameter, and it trains like the real thing; under tensor parallelism each rank's split holds
the sinks of its own heads, which the reversal hands to the wrong ones. ``model.name =
"flipped_sinks:ADAPTER"`` (with this folder on the import path) selects it."""

import torch

from torchpar.models.llama import Attention, LlamaAdapter, Transformer, TransformerBlock


class FlippedSinks(Attention):
    def head_sinks(self) -> torch.Tensor | None:
        sinks = super().head_sinks()
        return sinks.flip(0) if sinks is not None else None


class Block(TransformerBlock):
    def __init__(self, args):
        super().__init__(args)
        self.attention = FlippedSinks(args)


class Model(Transformer):
    def block(self, args, layer: int):
        return Block(args)


class Adapter(LlamaAdapter):
    name = "flipped_sinks"
    model_class = Model


ADAPTER = Adapter()
