"""A pipeline stage's runner (executor/pipeline.py): the engine's runner over this stage's layers
only, its step run in micro-batches that move stage to stage."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh

from compiled_engine.attention.metadata import AttentionMetadata
from compiled_engine.config import EngineConfig
from compiled_engine.executor.pipeline import ParallelLayout
from compiled_engine.executor.runner import Runner
from compiled_engine.executor.step import StepInputs
from compiled_engine.model.shard import TPShard


class StageRunner(Runner):
    is_stage = True

    def __init__(
        self,
        model_dir: Path,
        config: EngineConfig,
        shard: TPShard,
        mesh: DeviceMesh | None,
        layout: ParallelLayout,
    ) -> None:
        """No draft model, no adapters: the engine's config refuses them with pipeline stages."""
        super().__init__(model_dir, config, shard, mesh, layout=layout)
        self.micro_batches = config.pipeline_micro_batches or layout.pipeline_size

    def _step_hidden(self, inputs: StepInputs) -> tuple[torch.Tensor, AttentionMetadata] | None:
        """The step in micro-batches of whole sequences (one per stage unless
        --pipeline-micro-batches says otherwise), each run through this stage's layers
        (receiving from the stage before, sending to the one after) as soon as the last is sent
        on, so that the stages work on different micro-batches at once. On rank 0, the final
        hidden states of every token, as the last stage sent them back, with the whole step's
        metadata (for the rows to sample); None elsewhere."""
        assert self.links is not None
        sent = []
        for part in inputs.micro_batches(self.micro_batches):
            input_ids, positions, metadata = self._tensors(part)
            hidden = self._hidden(input_ids, positions, self.kv_cache, metadata, part.lora_slots)
            self.links.send_final(hidden)
            sent.append(hidden)
        final = None
        if self.layout.rank == 0:
            final = torch.cat([self.links.receive_final(hidden) for hidden in sent])
        self.links.finish()
        if final is None:
            return None
        metadata = AttentionMetadata.build(
            inputs.query_lens, inputs.seq_lens, inputs.block_tables, self.page_size, self.device
        )
        return final, metadata
