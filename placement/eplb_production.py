"""EPLB as production runs it (SGLang's and vLLM's expert-parallel load balancer): the baseline a
planner for fine-grained MoEs must beat at equal memory.

What they do, and so what this planner does:
1. A fixed number N of redundant experts per layer (SGLang's default for DeepSeek-V3: 32 of 256),
   so a layer holds E + N replicas, rounded up to a multiple of the GPUs (every GPU holds the same
   number: DeepSeek's EPLB packs them so).
2. Statistics: each iteration's loads (what the gates did: never a forecast) summed since the last
   rebalance.
3. A rebalance every `period` iterations (default 1000): DeepSeek's EPLB (eplb.py) on the summed
   loads picks which experts get the N copies and packs all replicas onto the GPUs. Before the
   first window is full it serves SGLang's default start (`--init-expert-location trivial`):
   physical slot i holds expert i mod E, slots in contiguous blocks per GPU, so static EP's
   blocks with copies of experts 0..N-1 after them (`trivial_layout`); the first rebalance comes
   after `first` iterations, once there are statistics. (Until 2026-11-28 the start was EPLB's
   packing of an even load: expert e on GPU e mod G, a layout no production system starts from,
   which on FLAME's numbering happened to be better than static EP's blocks.)
4. Tokens split evenly over an expert's replicas (shares 1 / count): production dispatches by
   token index, not by each batch's loads.
5. Weight moves behind serving: a rebalance's new replicas load while the old layout serves; the
   new layout takes over once they are resident (the twin counts the loads, their link time and
   the memory both layouts hold meanwhile: twin.py), and the old layout's replicas it dropped are
   let go then (`Placement.release`, as moeless's moved homes: evicted, not held for keep-alive).

A planning loop that restarts while a rebalanced layout is resident takes that layout up again
(`adopt`: the hosts' resident replicas, where every expert is held and no GPU holds more than its
share of the layer's replicas) instead of going back to the trivial start; its statistics
begin anew, the next rebalance `first` iterations on.

The twin replays it with the "previous" forecast kind, whose entry at iteration i is iteration
i - 1's actual loads (what the gates reported).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np

from moeless.placement.cluster import Cluster
from moeless.placement.eplb import rebalance_experts
from moeless.placement.moeless_planners import PlannerState
from moeless.placement.types import LayerPlacement, Placement, PlacementError

def production_replicas(num_experts: int, redundant: int, num_gpus: int) -> int:
    """Replicas per layer: E + N rounded up to a multiple of the GPUs."""
    if redundant < 0:
        raise ValueError(f"redundant experts must be >= 0, got {redundant}")
    return -(-(num_experts + redundant) // num_gpus) * num_gpus


def production_eplb() -> Callable:
    """A fresh stateful plan function (forecast, cluster, previous, config) -> Placement: EPLB with
    config.eplb_redundant copies per layer (None: E / 8), rebalanced after eplb_first_rebalance
    iterations and then every eplb_rebalance_every on the loads summed since the last rebalance
    (module docstring)."""
    return production_eplb_with_state()[0]


def production_eplb_with_state() -> tuple[Callable, PlannerState]:
    """production_eplb's plan function and its state (adopt: what the hosts hold [L, E, G] at a
    restarted loop's start, taken up as the layout where it is one of this planner's)."""
    state: dict = {"calls": 0, "window": None, "plan": None, "next": None, "left": set(), "out": None,
                   "held": None, "adopted": False}

    def adopt(held: np.ndarray) -> None:
        state["held"] = np.asarray(held, dtype=bool)

    def describe() -> list[str]:
        return ["production EPLB took up the layout resident at its start"] if state["adopted"] else []

    def plan(forecast: np.ndarray, cluster: Cluster, previous: Placement | None, config) -> Placement:
        num_layers, num_experts = forecast.shape
        redundant = num_experts // 8 if config.eplb_redundant is None else config.eplb_redundant
        replicas = production_replicas(num_experts, redundant, cluster.num_gpus)
        if config.eplb_rebalance_every < 1 or config.eplb_first_rebalance < 1:
            raise ValueError(f"EPLB rebalances every >= 1 iteration, after >= 1; got {config.eplb_rebalance_every}, "
                             f"{config.eplb_first_rebalance}")
        state["window"] = forecast.copy() if state["window"] is None else state["window"] + forecast
        if state["plan"] is None:
            held, state["held"] = state["held"], None  # used once, at the first plan
            resident = held_layout(held, replicas, cluster.num_gpus) if held is not None and held.shape == (
                num_layers, num_experts, cluster.num_gpus) else None
            state["adopted"] = resident is not None
            start = resident if resident is not None else trivial_layout(num_layers, num_experts, replicas, cluster.num_gpus)
            state["plan"] = _fits(start, replicas, cluster)
            state["next"] = config.eplb_first_rebalance
        if state["calls"] == state["next"]:
            old, state["plan"] = state["plan"], _eplb(state["window"], replicas, cluster)
            state["left"] |= old.replicas() - state["plan"].replicas()
            state["window"] = np.zeros_like(forecast)
            state["next"] += config.eplb_rebalance_every
            state["out"] = None
        state["calls"] += 1
        # 5. What the last rebalances dropped and is still resident: released (forgotten once evicted).
        left = state["left"]
        if left and previous is not None:  # (nothing to walk while nothing is left)
            left = (left & previous.replicas()) - state["plan"].replicas()
        if state["out"] is None or left != state["left"]:  # the same object while nothing changes
            state["left"] = left
            state["out"] = replace(state["plan"], release=np.array(sorted(left), np.int64).reshape(-1, 3))
        return state["out"]

    return plan, PlannerState(learn=lambda actual: None, adopt=adopt, describe=describe)


def held_layout(held: np.ndarray, replicas: int, num_gpus: int) -> Placement | None:
    """The layout of held [L, E, G] bool (a restarted loop's resident replicas) where it can be one
    this planner made: every expert held and no GPU holding more than replicas / G of a layer's, once
    a GPU over that has dropped its copies of the experts held most elsewhere (replicas an earlier
    rebalance left that the hosts had not released yet), or where that order leaves a GPU over, one
    copy of each expert on GPUs within their slots (`_matched`: a restart in the middle of a
    rebalance, the old and the new layout of a layer both held); else None. EPLB may give one GPU two
    of an expert's slots, which its host holds as one replica, so the layout is the replicas held,
    tokens split evenly over each expert's."""
    if replicas % num_gpus or not held.any(axis=2).all():
        return None
    slots, layers = replicas // num_gpus, []
    for held_layer in held:
        layer = held_layer.copy()
        for gpu in np.flatnonzero(layer.sum(axis=0) > slots):
            for expert in sorted(np.flatnonzero(layer[:, gpu]), key=lambda e: -layer[e].sum()):
                if layer[:, gpu].sum() > slots and layer[expert].sum() > 1:
                    layer[expert, gpu] = False
        if (layer.sum(axis=0) > slots).any() and (layer := _matched(held_layer, slots)) is None:
            return None
        expert, gpu = np.nonzero(layer)
        layers.append(LayerPlacement.even(expert, gpu, held.shape[1]))
    return Placement(tuple(layers), held.shape[1], num_gpus)


def _matched(held: np.ndarray, slots: int) -> np.ndarray | None:
    """[E, G] bool: one copy of each expert on a GPU holding it, no GPU over `slots` (augmenting paths,
    experts held on fewest GPUs first); None where no such choice exists."""
    owner = [-1] * held.shape[0]  # expert -> its GPU

    def place(expert: int, seen: set[int]) -> bool:
        for gpu in np.flatnonzero(held[expert]).tolist():
            if gpu in seen:
                continue
            seen.add(gpu)
            taken = [e for e, g in enumerate(owner) if g == gpu]
            if len(taken) < slots or any(place(e, seen) for e in taken):
                owner[expert] = gpu
                return True
        return False

    for expert in sorted(range(held.shape[0]), key=lambda e: held[e].sum()):
        if not place(expert, set()):
            return None
    out = np.zeros_like(held)
    out[np.arange(held.shape[0]), owner] = True
    return out


def trivial_layout(num_layers: int, num_experts: int, replicas: int, num_gpus: int) -> Placement:
    """SGLang's default start: slot i of `replicas` holds expert i mod E on GPU i // (replicas / G).
    Example: E = 4, 6 replicas, 2 GPUs -> GPU 0 holds experts 0, 1, 2 and GPU 1 experts 3, 0, 1."""
    return Placement.from_eplb(np.tile(np.arange(replicas) % num_experts, (num_layers, 1)), num_experts, num_gpus)


def _eplb(loads: np.ndarray, replicas: int, cluster: Cluster) -> Placement:
    """DeepSeek's EPLB with `replicas` per layer on one node and one group (loads [L, E])."""
    phy2log, _, _ = rebalance_experts(np.asarray(loads, dtype=np.float64), replicas, 1, 1, cluster.num_gpus)
    return _fits(Placement.from_eplb(phy2log, loads.shape[1], cluster.num_gpus), replicas, cluster)


def _fits(placement: Placement, replicas: int, cluster: Cluster) -> Placement:
    """The placement, or PlacementError where a GPU holds more replicas than it has slots."""
    num_gpus = cluster.num_gpus
    held = sum(np.bincount(layer.gpu, minlength=num_gpus) for layer in placement.layers)
    if (held > cluster.slots()).any():
        raise PlacementError(f"EPLB with {replicas} replicas per layer needs {held.max()} slots on a GPU; the GPUs have "
                             f"{int(cluster.slots().min())}: lower the redundant experts")
    return placement
