"""A key/value cache over sequence slots that supports tree appends and compaction.

Layout (one tensor each for keys and values):

    keys[layer]: [num_slots, kv_heads, capacity, head_dim]

`lengths[s]` counts the tokens of slot `s` that attention sees. A forward `append`s a block of new tokens at
`lengths[s] .. lengths[s] + n` (each token carries its own rope position, so a draft tree can sit in that
block under any attention mask) and advances `lengths[s]`. `keep_appended([s], [idx])` then keeps only the
chosen positions of that last block, moved to its start, as if only they had ever been fed:

    before:  [p0 p1 p2 | t0 t1 t2 t3]     appended tree t0..t3, accepted path t0, t2
    after:   [p0 p1 p2 | t0 t2]
"""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer keys and values for `num_slots` sequences, grown on demand up to `max_tokens`."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        max_tokens: int,
        dtype: torch.dtype = torch.float32,
        initial_tokens: int = 256,
        device: torch.device | str = "cpu",
    ) -> None:
        """Keys and values live on `device`; the bookkeeping (`lengths`, `block_start`, free slots) stays on the
        CPU, so the scheduling decisions of a forward never wait for the device."""
        self.num_layers = num_layers
        self.max_tokens = max_tokens
        self.device = torch.device(device)
        # On a GPU the whole cache is taken up front (slots x max_tokens): memory is known at start-up, and
        # growing would briefly need the old and the new cache at once. On the CPU it grows on demand.
        self.capacity = max_tokens if self.device.type == "cuda" else min(initial_tokens, max_tokens)
        shape = (num_slots, num_kv_heads, self.capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.lengths = torch.zeros(num_slots, dtype=torch.long)  # [num_slots]
        self.block_start = torch.zeros(num_slots, dtype=torch.long)  # [num_slots] start of the last append
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_slots(self) -> int:
        return self.lengths.numel()

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Take a free slot (lowest id first, so a batch of new requests gets contiguous slots)."""
        if not self._free:
            raise RuntimeError(f"KV cache has no free slot (all {self.num_slots} in use)")
        slot = self._free.pop()
        self.lengths[slot] = 0
        self.block_start[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        assert slot not in self._free, f"slot {slot} released twice"
        self._free.append(slot)
        self._free.sort(reverse=True)

    def reserve(self, slots: torch.Tensor, num_new: torch.Tensor) -> None:
        """Make room for `num_new[i]` more tokens in `slots[i]`, growing the capacity if needed."""
        needed = int((self.lengths[slots] + num_new).max())
        if needed > self.max_tokens:
            raise ValueError(f"sequence of {needed} tokens exceeds the KV cache limit of {self.max_tokens}")
        if needed <= self.capacity:
            return
        new_capacity = min(self.max_tokens, max(needed, 2 * self.capacity))
        pad = new_capacity - self.capacity
        for cache in (self.keys, self.values):
            for layer in range(self.num_layers):
                cache[layer] = torch.nn.functional.pad(cache[layer], (0, 0, 0, pad))
        self.capacity = new_capacity

    def append(
        self,
        layer: int,
        write_slot: torch.Tensor,
        write_pos: torch.Tensor,
        read_slots: torch.Tensor | slice,
        k_nkd: torch.Tensor,
        v_nkd: torch.Tensor,
        span: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys/values of one layer and return the batch's keys/values to attend over.

        write_slot, write_pos: [N] slot and cache index of each new token (on the cache's device); read_slots:
        the batch's slots ([B] on the device, or a slice when they are contiguous: a view, no gather);
        k_nkd, v_nkd: [N, kv_heads, head_dim]. Returns keys, values: [B, kv_heads, span, head_dim].
        """
        keys, values = self.keys[layer], self.values[layer]
        keys[write_slot, :, write_pos] = k_nkd
        values[write_slot, :, write_pos] = v_nkd
        return keys[read_slots, :, :span], values[read_slots, :, :span]

    def advance(self, slots: torch.Tensor, num_new: torch.Tensor) -> None:
        """Record that `num_new[i]` tokens were appended to `slots[i]`."""
        self.block_start[slots] = self.lengths[slots]
        self.lengths[slots] += num_new

    def keep_appended(self, slots: list[int], keeps: list[torch.Tensor]) -> None:
        """Keep only positions `keeps[i]` (ascending indices into the last appended block) of `slots[i]`: every
        slot's moves in one gather / scatter per layer."""
        moves = []  # (slot, from, to) of every entry that changes place
        for slot, keep in zip(slots, keeps, strict=True):
            start, end = int(self.block_start[slot]), int(self.lengths[slot])
            if keep.numel() and (int(keep.max()) >= end - start or int(keep.min()) < 0):
                raise IndexError(f"keep indices {keep.tolist()} outside the last block of {end - start} tokens")
            src, dst = start + keep, start + torch.arange(keep.numel())
            moved = src != dst  # the whole block, or a prefix of it, stays where it is
            if bool(moved.any()):
                moves.append((torch.full((int(moved.sum()),), slot), src[moved], dst[moved]))
            self.lengths[slot] = start + keep.numel()
            self.block_start[slot] = self.lengths[slot]
        if moves:
            slot_m, src_m, dst_m = (torch.cat(parts).to(self.device) for parts in zip(*moves, strict=True))  # [M]
            for cache in (self.keys, self.values):
                for layer in range(self.num_layers):
                    cache[layer][slot_m, :, dst_m] = cache[layer][slot_m, :, src_m]  # the gather copies first

    def truncate(self, slot: int, length: int) -> None:
        """Forget everything of `slot` after its first `length` tokens."""
        assert 0 <= length <= int(self.lengths[slot])
        self.lengths[slot] = length
        self.block_start[slot] = length
