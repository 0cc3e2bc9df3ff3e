"""OmniKV's context bank: the sparse layers' KV in host memory, and the copy of the rows one decode step
reads, made at each filter layer (the issue's design; docs/architecture.md §4c).

The KV pool holds the SPARSE layers of the OmniKV plan in host memory (`host_layers`; pinned on a GPU
host) and every other layer on the device. At a filter layer of a decode forward, once the selection
is made, `OmniKVBatch.bank_prefetch` hands the batch's [B, W] slot table (every row's selection, or a
full-attention row's whole context) to `ContextBank.prefetch`, which gathers, for every SPARSE layer
reading that filter's selection (up to the next filter layer), those rows into fixed-shape device
buffers [B, W, *row]. On a GPU the gathers run on a side stream, so the copy overlaps the FULL layer that
follows each filter layer; the first sparse layer to read them waits for that stream. Sparse layers
then attend over the buffers with a table 0..B·W-1 instead of the pool's slots.

What is not a decode forward (prefill, a chunk, a mixed batch) reads host layers directly: the Triton
kernels through the pinned memory's device mapping, the torch reference with `read_rows`.

On a CPU-only host nothing needs to move (host memory is the device's); the bank still runs there, with
host and device the same memory, which is how its gathers are tested.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

#: gather(src [S, *row], table [B, W] slots, lens [B] or None, out [B, W, *row]) fills out[b, t] = src[table[b, t]]
#: (for t < lens[b]; every t when lens is None)
Gather = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", torch.Tensor], object]


def read_rows(buf: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """buf[index] on the index's device: a host layer's rows are gathered on the host, then copied."""
    if buf.device == index.device:
        return buf[index]
    return buf[index.to(buf.device)].to(index.device)


def torch_gather(src: torch.Tensor, table: torch.Tensor, lens: torch.Tensor | None, out: torch.Tensor) -> None:
    """The reference `Gather`: every entry of the table (padding entries are slot 0, the zeroed dummy page)."""
    out.copy_(read_rows(src, table.to(torch.int64)))


class ContextBank:
    """The host layers' buffers and the gathers that bring their selected rows to the device.

    `groups` maps a filter index to the SPARSE layers that read its selection; `buffers(layer)` gives a
    layer's pool buffers (MLA: the latent rows; GQA: K and V), host-resident for those layers."""

    def __init__(self, groups: Mapping[int, Sequence[int]], buffers: Callable[[int], tuple[torch.Tensor, ...]],
                 device: torch.device | str) -> None:
        self.groups = {f: list(layers) for f, layers in groups.items() if layers}
        self.buffers = buffers
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.bytes_gathered = 0  # the gathered buffers' capacity, summed (metrics)

    def layers(self) -> list[int]:
        """Every layer whose KV the bank holds."""
        return sorted(layer for group in self.groups.values() for layer in group)

    def prefetch(self, f: int, table: torch.Tensor, lens: torch.Tensor | None, gather: Gather
                 ) -> tuple[dict[int, tuple[torch.Tensor, ...]], torch.cuda.Event | None]:
        """The device rows of filter `f`'s group for this step: {layer: buffers [B, W, *row]} and the event
        the reader waits for (None where the gathers ran on the current stream). The buffers are allocated
        on the current stream, before the fork, so they live in its pool (a captured graph's included) and
        are freed only after it has waited for the gathers."""
        layers = self.groups.get(f, [])
        bsz, width = table.shape
        out = {layer: tuple(torch.empty((bsz, width, *src.shape[1:]), dtype=src.dtype, device=table.device)
                            for src in self.buffers(layer)) for layer in layers}
        event = None
        if self.stream is not None and layers:
            main = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(main)  # the selection (table, lens) is made on the main stream
            with torch.cuda.stream(self.stream):
                self._gather(layers, table, lens, out, gather)
                event = torch.cuda.Event()
                event.record(self.stream)
        else:
            self._gather(layers, table, lens, out, gather)
        return out, event

    def _gather(self, layers: list[int], table: torch.Tensor, lens: torch.Tensor | None,
                out: dict[int, tuple[torch.Tensor, ...]], gather: Gather) -> None:
        for layer in layers:
            for src, dst in zip(self.buffers(layer), out[layer]):
                gather(src, table, lens, dst)
                self.bytes_gathered += dst.numel() * dst.element_size()  # known on the host
