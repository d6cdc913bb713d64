"""Pipeline parallelism: the decoder layers in contiguous slices, one a stage; activations go
stage to stage.

The ranks of an engine form a `pp x tp` grid: global rank `r` is stage `r // tp`, tensor-parallel
rank `r % tp` within it (`ParallelLayout`). Rank 0 (stage 0) owns the scheduler. Every rank gets
the step from rank 0 (executor/distributed.py) and runs the family's own forward over its stage:
the model holds only the stage's layers (the loader reads no others; `first_layer` says where
they start), and two wrappers put in place of the boundary layers move the activations, so the model
file knows nothing of stages:
- `ReceivingLayer` (first layer of every stage but the first) runs its layer on the hidden states
  the previous stage sent, in place of what the stage's own embedding produced;
- `SendingLayer` (last layer of every stage but the last) sends its output to the next stage.
The last stage's final hidden states (after the final norm) go back to rank 0 (`send_final`,
`receive_final`), which computes the logits and samples. Each TP rank of a stage talks to the
same TP rank of the next; the last stage's TP rank 0 answers rank 0.

Sends are asynchronous (`isend`) and finished at the end of the step (`StageLinks.finish`), so a
stage goes on to the next micro-batch while the next stage works on the one it sent: that is what
keeps the stages busy in a batched step (the stage's runner splits it, executor/stage_runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from compiled_engine.model.layers import DecoderModel


@dataclass(frozen=True)
class ParallelLayout:
    """Where one rank sits in the `pp x tp` grid."""

    rank: int = 0
    pipeline_size: int = 1
    tensor_size: int = 1

    @property
    def world_size(self) -> int:
        return self.pipeline_size * self.tensor_size

    @property
    def stage(self) -> int:
        return self.rank // self.tensor_size

    @property
    def tensor_rank(self) -> int:
        return self.rank % self.tensor_size

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pipeline_size - 1


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """The layers of `stage`: contiguous, as even as they go (earlier stages take the extra ones)."""
    if stages > num_layers:
        raise ValueError(f"--pipeline-parallel-size {stages} exceeds the model's {num_layers} layers")
    share, extra = divmod(num_layers, stages)
    start = stage * share + min(stage, extra)
    return range(start, start + share + (1 if stage < extra else 0))


@dataclass
class StageLinks:
    """One rank's sends and receives to its neighbouring stages and to rank 0. Made on every rank
    at once (the group of the final hidden states is made collectively).

    The final hidden states go back to rank 0 in a process group of their own. With two stages
    rank 0 and the last stage also exchange the micro-batches' activations, the other way; on
    NCCL one pair of ranks in one group shares one stream, in which rank 0's send of the second
    micro-batch would queue behind its receive of the first one's result, and the last stage's
    send of that result behind its receive of the second micro-batch. A group of their own gives
    the final hidden states a stream of their own. (Reasoned from NCCL's ordering, not run: the
    GPU paths of pipeline parallelism have not run yet.)"""

    layout: ParallelLayout
    timeout_s: float  # the engine's collective timeout, the final hidden states' group's too
    pending: list[tuple[Any, torch.Tensor]] = field(default_factory=list)  # isends in flight, their tensors
    final_group: Any = field(init=False)  # made in __post_init__

    def __post_init__(self) -> None:
        self.final_group = dist.new_group([0, self.last_stage_rank], timeout=timedelta(seconds=self.timeout_s))

    @property
    def previous(self) -> int:
        return self.layout.rank - self.layout.tensor_size

    @property
    def next(self) -> int:
        return self.layout.rank + self.layout.tensor_size

    @property
    def last_stage_rank(self) -> int:
        """The rank that sends the final hidden states back: the last stage's TP rank 0."""
        return (self.layout.pipeline_size - 1) * self.layout.tensor_size

    def send(self, tensor: torch.Tensor, to: int, group: Any = None) -> None:
        tensor = tensor.contiguous()
        self.pending.append((dist.isend(tensor, to, group=group), tensor))

    def receive(self, like: torch.Tensor, source: int, group: Any = None) -> torch.Tensor:
        buffer = torch.empty_like(like)
        dist.recv(buffer, source, group=group)
        return buffer

    def finish(self) -> None:
        """Wait for this step's sends (their tensors may be reused after)."""
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()

    def send_final(self, hidden: torch.Tensor) -> None:
        if self.layout.rank == self.last_stage_rank:
            self.send(hidden, 0, self.final_group)

    def receive_final(self, like: torch.Tensor) -> torch.Tensor:
        """On rank 0: the last stage's final hidden states for a micro-batch of `like`'s shape."""
        return self.receive(like, self.last_stage_rank, self.final_group)


class ReceivingLayer(nn.Module):
    """A stage's first layer, run on what the previous stage sent (its input `x`, the stage's own
    embedding, only gives the shape)."""

    def __init__(self, layer: nn.Module, links: StageLinks) -> None:
        super().__init__()
        self.layer = layer
        self.links = links

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layer(self.links.receive(x, self.links.previous), cos, sin, kv_cache)
        return out


class SendingLayer(nn.Module):
    """A stage's last layer, its output sent on to the next stage."""

    def __init__(self, layer: nn.Module, links: StageLinks) -> None:
        super().__init__()
        self.layer = layer
        self.links = links

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layer(x, cos, sin, kv_cache)
        self.links.send(out, self.links.next)
        return out


def link_stage(model: DecoderModel, links: StageLinks) -> None:
    """Put the boundary wrappers in place of the stage's first and last layers (after the layers
    were compiled and warmed up, which each stage does alone)."""
    layout = links.layout
    if not layout.is_first_stage:
        model.layers[0] = ReceivingLayer(model.layers[0], links)
    if not layout.is_last_stage:
        model.layers[-1] = SendingLayer(model.layers[-1], links)
