"""DeepSeek's Expert-Parallelism Load Balancer (EPLB), written from its published description.

Given per-expert loads of every layer and a fixed number of physical replicas, EPLB
1. packs expert groups onto nodes evenly (hierarchical: groups of one node share traffic),
2. within a node, gives the next redundant replica to the expert with the largest load per
   replica, until the node's replica budget is spent,
3. packs the replicas onto the node's GPUs, the same number on every GPU, heaviest first onto
   the lightest GPU that still has a free slot.
The global variant (used when groups do not divide over nodes) treats everything as one group
on one node. Output is EPLB's triple: phy2log [L, R], log2phy [L, E, max_cnt], logcnt [L, E];
replica p lives on GPU p // (R / G), and tokens split evenly over an expert's replicas.
"""

from __future__ import annotations

import numpy as np

from moeless.placement.kernels import compiled


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack n weighted items into num_packs packs of exactly n / num_packs items each.

    weight: [X, n] -> (pack_index [X, n], rank_in_pack [X, n]). Heaviest item first, onto the
    lightest pack that still has room (ties: lower pack index).
    """
    rows, n = weight.shape
    if n % num_packs:
        raise ValueError(f"{n} items do not split evenly into {num_packs} packs")
    per_pack = n // num_packs
    if per_pack == 1:
        return np.tile(np.arange(n), (rows, 1)), np.zeros((rows, n), dtype=np.int64)
    pack_index = np.empty((rows, n), dtype=np.int64)
    rank_in_pack = np.empty((rows, n), dtype=np.int64)
    order = np.argsort(-weight, axis=1, kind="stable")
    _pack_rows(np.ascontiguousarray(weight, dtype=np.float64), order, num_packs, per_pack, pack_index, rank_in_pack)
    return pack_index, rank_in_pack


@compiled
def _pack_rows(weight, order, num_packs, per_pack, pack_index, rank_in_pack):
    """balanced_packing's loop, compiled (a 64-GPU cell packs thousands of items per rebalance): each
    row's items in `order`, each onto the lightest pack with room (the first of equals)."""
    for x in range(weight.shape[0]):
        pack_weight = np.zeros(num_packs)
        pack_items = np.zeros(num_packs, dtype=np.int64)
        for i in range(order.shape[1]):
            item = order[x, i]
            pack, best = -1, np.inf
            for q in range(num_packs):
                if pack_items[q] < per_pack and pack_weight[q] < best:
                    pack, best = q, pack_weight[q]
            pack_index[x, item] = pack
            rank_in_pack[x, item] = pack_items[pack]
            pack_weight[pack] += weight[x, item]
            pack_items[pack] += 1


def replicate_experts(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replicate n logical experts to num_phy replicas, each extra one to the expert with the
    largest load per replica.

    weight: [X, n] -> (phy2log [X, num_phy], rank [X, num_phy] (replica index within its expert),
    logcnt [X, n]).
    """
    rows, n = weight.shape
    if num_phy < n:
        raise ValueError(f"{num_phy} replicas cannot cover {n} experts")
    phy2log = np.tile(np.arange(num_phy), (rows, 1))
    rank = np.zeros((rows, num_phy), dtype=np.int64)
    logcnt = np.ones((rows, n), dtype=np.int64)
    row = np.arange(rows)
    for i in range(n, num_phy):
        heaviest = np.argmax(weight / logcnt, axis=-1)
        phy2log[:, i] = heaviest
        rank[:, i] = logcnt[row, heaviest]
        logcnt[row, heaviest] += 1
    return phy2log, rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    """Row-wise inverse permutation: [X, n] -> [X, n]."""
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def rebalance_hierarchical(
    weight: np.ndarray, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """weight: [L, E] -> (phy2log [L, num_phy], phy_rank [L, num_phy], logcnt [L, E])."""
    num_layers, num_log = weight.shape
    group_size = num_log // num_groups
    groups_per_node = num_groups // num_nodes
    log_per_node = num_log // num_nodes
    phy_per_gpu = num_phy // num_gpus
    # 1. Expert groups onto nodes; "mlog" numbers experts node by node.
    group_tokens = weight.reshape(num_layers, num_groups, group_size).sum(-1)
    group_pack, group_rank = balanced_packing(group_tokens, num_nodes)
    group_start = (group_pack * groups_per_node + group_rank) * group_size
    log2mlog = (group_start[:, :, None] + np.arange(group_size)).reshape(num_layers, num_log)
    mlog2log = _inverse(log2mlog)
    # 2. Redundant replicas within each node: rows are (layer, node).
    mlog_tokens = np.take_along_axis(weight, mlog2log, axis=1).reshape(-1, log_per_node)
    phy2mlog, phy_rank, mlogcnt = replicate_experts(mlog_tokens, num_phy // num_nodes)
    # 3. Replicas onto the node's GPUs, the same count on each.
    phy_tokens = np.take_along_axis(mlog_tokens / mlogcnt, phy2mlog, axis=1)
    pack, rank = balanced_packing(phy_tokens, num_gpus // num_nodes)
    pphy2phy = _inverse(pack * phy_per_gpu + rank)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1)
    node_offset = np.arange(0, num_log, log_per_node)[None, :, None]
    pphy2mlog = (pphy2mlog.reshape(num_layers, num_nodes, -1) + node_offset).reshape(num_layers, -1)
    phy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)
    pphy_rank = np.take_along_axis(phy_rank, pphy2phy, axis=1).reshape(num_layers, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(num_layers, -1), log2mlog, axis=1)
    return phy2log, pphy_rank, logcnt


def rebalance_experts(
    weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EPLB's entry point. weight: [L, E] loads -> phy2log [L, R], log2phy [L, E, max_cnt], logcnt [L, E].

    Hierarchical when the groups divide over the nodes, else global (one group, one node).
    """
    weight = np.asarray(weight, dtype=np.float64)
    _check(weight, num_replicas, num_groups, num_nodes, num_gpus)
    if num_groups % num_nodes == 0:
        phy2log, rank, logcnt = rebalance_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, rank, logcnt = rebalance_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    num_layers, num_log = weight.shape
    log2phy = np.full((num_layers, num_log, num_replicas - num_log + 1), -1, dtype=np.int64)
    layer = np.arange(num_layers)[:, None]
    log2phy[layer, phy2log, rank] = np.arange(num_replicas)[None, :]
    return phy2log, log2phy, logcnt


def _check(weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> None:
    if weight.ndim != 2:
        raise ValueError(f"EPLB needs loads of shape [L, E], got {weight.shape}")
    if not np.isfinite(weight).all() or (weight < 0).any():
        raise ValueError("EPLB loads must be finite and non-negative")
    num_log = weight.shape[1]
    if num_gpus <= 0 or num_nodes <= 0 or num_groups <= 0:
        raise ValueError(f"EPLB needs positive GPUs, nodes and groups; got {num_gpus}, {num_nodes}, {num_groups}")
    if num_log % num_groups:
        raise ValueError(f"{num_log} experts do not split into {num_groups} groups; pick a divisor of E")
    if num_gpus % num_nodes:
        raise ValueError(f"{num_gpus} GPUs do not split over {num_nodes} nodes")
    if num_replicas < num_log or num_replicas % num_gpus:
        raise ValueError(
            f"EPLB needs a replica count >= E ({num_log}) and a multiple of the GPU count ({num_gpus}); got {num_replicas}"
        )
    if num_groups % num_nodes == 0 and (num_replicas // num_nodes) < num_log // num_nodes:
        raise ValueError("each node needs at least as many replicas as it has experts")
