"""Ping-pong: two micro-batches in flight, so one's expert call hides behind the other's attention.

The engine runs it too (serving/pingpong.py), and `moeless bench serve` measures it: on 2 CPU
cores, where the replica, the hosts and the transfer share the cores and a forward's CPU cost is
mostly per forward rather than per row, a 512-token prefill over TCP hid 40-45% of its transfer,
not the 100% this model gives (docs/serving.md). The model is what a replica and hosts with cores
(or GPUs) of their own would see. Per layer of a step:

- the serving replica does `attention_s` of work (attention, norms, the gate, scatter and gather),
  split evenly over the micro-batches;
- the expert call, `remote_s` as the replica waits for it (transfer, host compute, call overhead),
  runs on the other side: each micro-batch's call pays the fixed `call_s` again and its share of
  the rest;
- one resource each: the replica runs one micro-batch's attention at a time, the hosts and the
  network one micro-batch's call at a time; micro-batch m's attention of layer l waits for its own
  call of layer l - 1.

Both schedules start from zero; `pingpong_s` is the makespan of the list schedule (micro-batches
in order on each side). The fraction of transfer hidden is the time saved over the step's
transfer time (transfer_s per layer, the part of remote_s that is not expert compute), clipped to
[0, 1]; a split whose extra call overheads cost more than the overlap saves gives 0.

Tiny example (the golden test): 2 layers, attention 2 s, an expert call of 2 s (all transfer, no
fixed cost) per layer: serial 8 s; ping-pong 5 s (3 s of the 4 s of transfer hidden: 0.75).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerCosts:
    """Seconds per layer of one step, the whole batch: attention_s on the serving replica; remote_s
    the expert call as the replica waits for it, of which transfer_s is not host compute and
    call_s is fixed per call."""

    attention_s: float
    remote_s: float
    transfer_s: float
    call_s: float = 0.0


def serial_s(costs: LayerCosts, layers: int) -> float:
    """One micro-batch: each layer's attention, then its expert call."""
    return layers * (costs.attention_s + costs.remote_s)


def pingpong_s(costs: LayerCosts, layers: int, micro: int = 2) -> float:
    """`micro` micro-batches in flight (see the module docstring)."""
    attention = costs.attention_s / micro
    remote = costs.call_s + (costs.remote_s - costs.call_s) / micro
    serving_free = remote_free = 0.0
    done = [0.0] * micro  # when each micro-batch's last expert call ended
    for _ in range(layers):
        for m in range(micro):
            serving_free = max(serving_free, done[m]) + attention
            remote_free = max(serving_free, remote_free) + remote
            done[m] = remote_free
    return max(done)


def hidden_fraction(costs: LayerCosts, layers: int, micro: int = 2) -> float:
    """The share of the step's transfer time that ping-pong hides, in [0, 1]."""
    transfer = layers * costs.transfer_s
    if transfer <= 0:
        return 0.0
    return min(max((serial_s(costs, layers) - pingpong_s(costs, layers, micro)) / transfer, 0.0), 1.0)
