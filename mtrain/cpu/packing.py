"""A padded batch's real positions as rows: the training step's linear layers, layer norms,
dropouts and residual sums run on the rows that hold tokens, and only attention, which needs the
sentences side by side, sees the padded (B, T) grid.

Everything but attention treats each position on its own, so dropping the pads changes no real
position's value. A length-bucketed batch is still 10-12 % source padding and ~5 % target padding
at Multi30k's lengths, and that share of every matmul was spent on positions nothing reads."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

# A training step's matmuls run on row counts rounded up to a multiple of this: here with padding
# cells (computed like any other, never read), in mtrain.loss's vocabulary projection with zero rows.
# oneDNN, which runs a CPU training step's linear layers and bfloat16 matmuls, compiles a kernel for
# every new shape (2-5 ms each) and keeps it, with a few hundred kB, in two caches of 1024 shapes.
# With a token count of its own in every batch, each step brought new shapes: the caches churned and
# held memory that the heap never gave back. Multiples of 64 give at most max_tokens / 64 shapes for
# at most 63 extra rows; with the projection's rows rounded, a bf16 training loop made 18 new kernels
# in its second epoch instead of 99, stayed at 1.4 GB instead of growing past 2.9 GB, and ran 7 %
# faster (benchmarks/results/intel-xeon-amx/NOTES.md, "Memory over a long run").
ROW_MULTIPLE = 64


class Packing(NamedTuple):
    """Where the rows of a packed (N, C) tensor sit in its padded (B, T, C) grid."""

    index: Tensor  # (N,) cells of the flattened (B * T) grid: the real ones in row-major order, then pads
    gaps: Tensor  # the grid's other cells (all padding)
    real: int  # the first `real` rows hold tokens; the rest are padding cells that round N up
    batch: int  # B
    length: int  # T
    cell_rows: Tensor  # (B * T,) the row each cell of the grid reads: its own, and row 0 for a gap (to_heads)

    @classmethod
    def of(cls, ids: Tensor, pad_id: int, multiple: int = ROW_MULTIPLE) -> Packing:
        """The packing of a (B, T) id tensor: its non-pad cells, then as many pad cells as round
        their count up to `multiple` (or all of them, when there are fewer)."""
        batch, length = ids.shape
        is_pad = ids.reshape(-1) == pad_id
        real, pads = (~is_pad).nonzero().squeeze(1), is_pad.nonzero().squeeze(1)
        extra = min(-real.numel() % multiple, pads.numel())
        index = torch.cat([real, pads[:extra]])
        cell_rows = torch.zeros(batch * length, dtype=torch.long, device=ids.device)
        cell_rows.index_copy_(0, index, torch.arange(index.numel(), device=ids.device))
        return cls(index, pads[extra:], real.numel(), batch, length, cell_rows)

    def positions(self) -> Tensor:
        """(N,) each row's position in its sentence (0 .. T - 1)."""
        return self.index.remainder(self.length)

    def take(self, ids: Tensor) -> Tensor:
        """(B, T) -> (N,): the ids at the rows' cells."""
        return ids.reshape(-1).index_select(0, self.index)

    def to_grid(self, rows: Tensor) -> Tensor:
        """(N, C) rows -> (B, T, C), zero at the cells no row fills (finite, so a masked key's
        value times its zero weight stays zero)."""
        return _ToGrid.apply(rows, self.index, self.gaps).view(self.batch, self.length, -1)

    def to_rows(self, grid: Tensor) -> Tensor:
        """(B, T, C) -> (N, C): the rows' cells."""
        return _ToRows.apply(grid.reshape(self.batch * self.length, -1), self.index, self.gaps)

    def to_heads(self, rows: Tensor, parts: int, n_heads: int) -> Tensor:
        """(N, parts * H * d_head) rows of a fused projection -> (parts, H * B, T, d_head): each
        part's heads, in the layout attention's batched matmuls read, heads before sentences. One
        gather, where the grid (to_grid) and the copy out of it into that layout took two passes
        and a fill. A gap cell holds row 0's values, finite, which the keys' mask hides and no row
        reads back: its gradient is exactly zero, so the backward skips it."""
        return _ToHeads.apply(rows, self, parts, n_heads)

    def from_heads(self, heads: Tensor) -> Tensor:
        """(H * B, T, d_head) heads, heads before sentences -> (N, H * d_head) rows, the heads side
        by side (concatenated) in each."""
        return _FromHeads.apply(heads, self)


def _grid(rows: Tensor, index: Tensor, gaps: Tensor) -> Tensor:
    """rows (N, C) at the cells `index` of a new (N + gaps, C) grid, zero at `gaps`: each cell
    written once (zeroing the whole grid first took a third of the time)."""
    return _fill_cells(rows.new_empty(index.numel() + gaps.numel(), rows.size(1)), index, gaps, rows)


def _fill_cells(cells: Tensor, index: Tensor, gaps: Tensor, rows: Tensor) -> Tensor:
    """cells (cells, ...) with rows (N, ...) written at `index` and zero at `gaps`, in place."""
    return cells.index_fill_(0, gaps, 0).index_copy_(0, index, rows)


class _ToGrid(torch.autograd.Function):
    """rows (N, C) into a grid (_grid); the backward reads them back."""

    @staticmethod
    def forward(ctx, rows: Tensor, index: Tensor, gaps: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        return _grid(rows, index, gaps)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


class _ToRows(torch.autograd.Function):
    """grid (cells, C) read at `index`; the backward puts the gradient back in a grid (_grid: the
    cells are distinct, so a copy, where index_select's own backward zeroes a grid and adds)."""

    @staticmethod
    def forward(ctx, grid: Tensor, index: Tensor, gaps: Tensor) -> Tensor:
        ctx.save_for_backward(index, gaps)
        return grid.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        index, gaps = ctx.saved_tensors
        return _grid(grad, index, gaps), None, None


class _ToHeads(torch.autograd.Function):
    """Packing.to_heads; the backward gathers each row's gradient from its cell."""

    @staticmethod
    def forward(ctx, rows: Tensor, packing: Packing, parts: int, n_heads: int) -> Tensor:
        n, width = rows.shape
        d_head = width // (parts * n_heads)
        ctx.packing, ctx.shape = packing, (n, parts, n_heads, d_head)
        heads = rows.view(n, parts, n_heads, d_head).permute(1, 2, 0, 3).index_select(2, packing.cell_rows)
        return heads.view(parts, n_heads * packing.batch, packing.length, d_head)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        n, parts, n_heads, d_head = ctx.shape
        packing = ctx.packing
        cells = grad.reshape(parts, n_heads, packing.batch * packing.length, d_head).permute(2, 0, 1, 3)
        return cells.index_select(0, packing.index).view(n, parts * n_heads * d_head), None, None, None


class _FromHeads(torch.autograd.Function):
    """Packing.from_heads; the backward writes each row's gradient to its cell, zero at the gaps."""

    @staticmethod
    def forward(ctx, heads: Tensor, packing: Packing) -> Tensor:
        n_heads = heads.size(0) // packing.batch
        ctx.packing, ctx.n_heads = packing, n_heads
        cells = heads.reshape(n_heads, packing.batch * packing.length, heads.size(-1)).permute(1, 0, 2)
        return cells.index_select(0, packing.index).view(-1, n_heads * heads.size(-1))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        packing, n_heads = ctx.packing, ctx.n_heads
        d_head = grad.size(1) // n_heads
        heads = grad.new_empty(n_heads, packing.batch * packing.length, d_head)
        _fill_cells(heads.permute(1, 0, 2), packing.index, packing.gaps, grad.reshape(-1, n_heads, d_head))
        return heads.view(n_heads * packing.batch, packing.length, d_head), None
