"""Per-request KV caches held as the rows of one preallocated batch (continuous batching's memory).

Each running request owns one row; its keys and values sit in consecutive columns that end at
the same column `end` for every row (right-aligned), so one decode forward serves all rows: a
row's next token is written at column `end` and attends to its own columns only (the attention
mask hides the rest). Positions come from each row's own length (position ids), never from
columns, so where a row sits does not change what it computes.

    slots = KVSlots(num_layers, max_rows)
    cache, mask = slots.decode_inputs()          # for model.forward(ids [rows, 1], mask, cache); or of range(a, b)
    slots.advance()                              # after the forward: every row is one longer
    slots.add(rid, cache, row, start, length)    # a prefilled request joins (its KV copied in once)
    slots.remove(rid)                            # a finished request leaves (the last row moves in)

Per step the cost is one column written per row and layer; a join copies the newcomer's KV
once; a leave copies one row. Storage grows (and old columns are dropped) only when the
columns run out. Storage per layer: keys and values [max_rows, kv_heads, capacity, head_dim].
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

GROWTH = 1.5  # capacity grows by this factor when the columns run out


class KVSlots:
    """Rows of per-request KV; row i belongs to `rids[i]`, its columns are [start[i], end)."""

    def __init__(self, num_layers: int, max_rows: int, min_capacity: int = 64):
        self.num_layers = num_layers
        self.max_rows = max_rows
        self.min_capacity = min_capacity  # columns allocated at first
        self.rids: list = []
        self.start: list[int] = []
        self.end = 0
        self.keys: list[torch.Tensor] = []  # per layer [max_rows, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self.rids)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def length(self, rid) -> int:
        """Tokens in rid's cache."""
        return self.end - self.start[self.rids.index(rid)]

    def add(self, rid, cache: Cache, row: int, start: int, length: int) -> None:
        """Copy columns start..start+length of row `row` of a prefill cache into a new row that
        ends at `end`. cache: per layer keys/values [B, kv_heads, S, head_dim]."""
        if len(self.rids) >= self.max_rows:
            raise RuntimeError(f"all {self.max_rows} rows are in use; remove a request first")
        keys = [cache.layers[l].keys[row, :, start:start + length] for l in range(self.num_layers)]
        values = [cache.layers[l].values[row, :, start:start + length] for l in range(self.num_layers)]
        if not self.keys:
            self._allocate(keys[0], values[0], length)
        self._make_room(left=length)
        r = len(self.rids)
        for l in range(self.num_layers):
            self.keys[l][r, :, self.end - length:self.end] = keys[l]
            self.values[l][r, :, self.end - length:self.end] = values[l]
        self.rids.append(rid)
        self.start.append(self.end - length)

    def remove(self, rid) -> None:
        """Drop rid's row; the last row moves into its place."""
        r, last = self.rids.index(rid), len(self.rids) - 1
        if r != last:
            for l in range(self.num_layers):
                self.keys[l][r] = self.keys[l][last]
                self.values[l][r] = self.values[l][last]
            self.rids[r], self.start[r] = self.rids[last], self.start[last]
        self.rids.pop()
        self.start.pop()
        if not self.rids:
            self.end = 0  # an empty batch starts over at column 0

    def decode_inputs(self, rows: range | None = None) -> tuple["SlotCache", torch.Tensor]:
        """The cache and attention mask [rows, width] for one decode step of `rows` (default every
        row; a micro-batch takes a range of them); the step's token goes to column `end` (columns
        before the oldest of these rows' first are left out)."""
        rows = range(len(self.rids)) if rows is None else rows
        self._make_room(left=0)
        starts = self.start[rows.start:rows.stop]
        first = min(starts)
        mask = torch.zeros((len(rows), self.end + 1 - first), dtype=torch.long)
        for r, start in enumerate(starts):
            mask[r, start - first:] = 1
        return SlotCache(self, rows, first), mask

    def advance(self) -> None:
        """Every row got its column `end` in the last decode forward."""
        self.end += 1

    # --- internals --------------------------------------------------------------------------

    def _allocate(self, key: torch.Tensor, value: torch.Tensor, length: int) -> None:
        """key, value: one row's [kv_heads, length, head_dim] (MLA's keys and values differ in width)."""
        capacity = max(self.min_capacity, int(length * GROWTH) + 1)
        for _ in range(self.num_layers):
            self.keys.append(key.new_zeros((self.max_rows, key.shape[0], capacity, key.shape[2])))
            self.values.append(value.new_zeros((self.max_rows, value.shape[0], capacity, value.shape[2])))

    def _make_room(self, left: int) -> None:
        """Make end >= left (room for a row of `left` columns) and column `end` exist: move the
        rows (dropping columns no row uses), growing the storage only when that is not enough."""
        if left <= self.end < self.capacity:
            return
        used = self.end - min(self.start) if self.start else 0
        new_end = max(used, left)
        capacity = self.capacity if new_end < self.capacity else int((new_end + 1) * GROWTH) + 1
        first, rows, grow = self.end - used, len(self.rids), capacity != self.capacity
        for store in (self.keys, self.values):
            for l, old in enumerate(store):
                new = old.new_zeros((self.max_rows, old.shape[1], capacity, old.shape[3])) if grow else old
                new[:rows, :, new_end - used:new_end] = old[:rows, :, first:self.end].clone()
                store[l] = new
        self.start = [s + new_end - self.end for s in self.start]
        self.end = new_end


class _SlotLayer(CacheLayerMixin):
    """One decoder layer's view of KVSlots for one decode forward of some rows."""

    def __init__(self, slots: KVSlots, layer: int, rows: range, first: int):
        super().__init__()
        self.slots, self.layer, self.first = slots, layer, first
        self.rows = slice(rows.start, rows.stop)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states, value_states: [rows, kv_heads, 1, head_dim] -> the rows' keys and values
        [rows, kv_heads, width, head_dim], the new column included."""
        s, end = self.slots, self.slots.end
        s.keys[self.layer][self.rows, :, end:end + 1] = key_states
        s.values[self.layer][self.rows, :, end:end + 1] = value_states
        return (s.keys[self.layer][self.rows, :, self.first:end + 1],
                s.values[self.layer][self.rows, :, self.first:end + 1])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.slots.end - self.first

    def get_max_length(self) -> int:
        return -1


class SlotCache(Cache):
    """A transformers Cache over some rows of KVSlots, columns first..end (one decode step)."""

    def __init__(self, slots: KVSlots, rows: range, first: int):
        super().__init__(layers=[_SlotLayer(slots, l, rows, first) for l in range(slots.num_layers)])
