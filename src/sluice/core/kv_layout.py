"""KVLayout: how a model's layers share the paged KV cache when some layers only look at
a sliding window of keys (Gemma 3's local layers, Mistral's every layer).

A sliding-window layer never reads a key older than its window, so its blocks behind the
window can go back to the pool while the sequence grows, and a full-attention layer's
cannot. The layers are therefore split into groups of one kind each (one window, 0 for
full attention), every group with its own block table per request, all drawing from ONE
pool of blocks (vLLM's hybrid KV-cache manager is the anchor): a block is the K/V of
`group_size` layers for block_size tokens, and the runner keeps `group_size` K/V tensors,
tensor j holding the j-th layer of whichever group a block id is given to. So memory moves
between kinds as the work asks for it (long prompts want full-attention blocks, many short
ones want all kinds alike), with no split fixed at start.

group_size is the smallest kind's layer count: Gemma 3 270M (15 local layers, 3 global)
has 6 groups of 3 layers, Gemma 3 4B (29 local, 5 global) 7 groups of 5, the last group of
local layers one short (its unused tensor slot is the price of one pool). A model with
no sliding window, or a backend that keeps one table for every layer, has one group of
all its layers: the plain paged cache.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroup:
    window: int                 # keys a query sees, itself included; 0: every key before it
    layers: tuple[int, ...]     # model layer indices, layer j using K/V tensor j

    @property
    def kind(self) -> str:
        return f"sliding{self.window}" if self.window else "full"


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    group_size: int             # K/V tensors the runner allocates (layers per block)

    @classmethod
    def plain(cls, num_layers: int) -> "KVLayout":
        return cls((KVGroup(0, tuple(range(num_layers))),), num_layers)

    @classmethod
    def for_windows(cls, num_layers: int, layer_windows: tuple[int, ...]) -> "KVLayout":
        """Groups for a model whose layer i sees layer_windows[i] keys (0 or an empty tuple:
        full attention)."""
        windows = tuple(layer_windows) or (0,) * num_layers
        if len(windows) != num_layers:
            raise ValueError(f"{len(windows)} layer windows for {num_layers} layers")
        kinds: dict[int, list[int]] = {}
        for i, w in enumerate(windows):
            kinds.setdefault(w, []).append(i)
        if len(kinds) == 1 and 0 in kinds:
            return cls.plain(num_layers)
        size = min(len(layers) for layers in kinds.values())
        groups = []
        for w in sorted(kinds):  # full attention (0) first: group 0 is full where any layer is
            layers = kinds[w]
            groups += [KVGroup(w, tuple(layers[i:i + size])) for i in range(0, len(layers), size)]
        return cls(tuple(groups), size)

    @property
    def windows(self) -> tuple[int, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def layer_places(self, num_layers: int) -> list[tuple[int, int]]:
        """(group, tensor) of each layer."""
        places = [(0, 0)] * num_layers
        for g, group in enumerate(self.groups):
            for j, layer in enumerate(group.layers):
                places[layer] = (g, j)
        return places

    def kinds(self) -> dict[str, list[int]]:
        """Layer kind -> its groups' indices (for the plan line and the metrics)."""
        out: dict[str, list[int]] = {}
        for g, group in enumerate(self.groups):
            out.setdefault(group.kind, []).append(g)
        return out

    def describe(self) -> str:
        """E.g. 'full:1x3 sliding512:5x3' (groups x layers per block); 'plain' for one group."""
        if self.num_groups == 1 and not self.groups[0].window:
            return "plain"
        return " ".join(f"{kind}:{len(gs)}x{self.group_size}" for kind, gs in self.kinds().items())
