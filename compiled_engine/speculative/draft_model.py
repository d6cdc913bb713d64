"""Draft-model proposals: a second, smaller model with the target's vocabulary drafts k tokens
a sequence, one forward per token, and the target verifies them in its one forward.

The draft keeps its K/V under the target's page ids: its own page pool tensor, indexed by the
sequences' block tables, so one page in the BlockManager holds a token range of both models and
the pool is sized for both (Runner's SharedPool). The scheduler therefore knows nothing of
the draft; pages rolled back or freed are freed for both.

The draft runs only when a sequence speculates, and catches up then: each sequence's draft K/V
is valid up to `_valid`, the tokens it computed that still stand (rejected draft tokens' K/V is
past the target's computed count, so it is recomputed). The first forward of a step runs each
sequence's missing tokens and its last one; each of the k - 1 further forwards runs one token a
sequence (the decode shape, so CUDA graphs replay it). A prefix-cache hit or a forked prompt
gives the target K/V but the draft computes those tokens itself: it writes the same values into
the shared pages (the same tokens at the same positions), so sharers never see a change.

Greedy rows draft the argmax of the draft's filtered logits; sampled rows draw from the draft's
distribution with noise of their own stream, and that distribution is kept for the target's
rejection sampling (engine/verifier.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from compiled_engine.cache.kv_cache import KVCacheSpec
from compiled_engine.config import EngineConfig, SpeculativeConfig
from compiled_engine.engine.drafting import DraftProbs
from compiled_engine.engine.sampler import Sampler, SamplingBatch, gumbel_noise
from compiled_engine.engine.sequence import Sequence
from compiled_engine.errors import ModelConfigError
from compiled_engine.executor.runner import Runner, SharedPool
from compiled_engine.executor.step import Logits, StepInputs, Wants
from compiled_engine.model.config import ModelConfig
from compiled_engine.model.registry import config_from_model_dir
from compiled_engine.speculative.drafts import SpeculativeStats, propose_drafts, record_verify
from compiled_engine.tokenizer import Tokenizer
from compiled_engine.weights.source import resolve_model_dir

logger = logging.getLogger(__name__)

DRAFT_NOISE_STREAM = 0x2545F4914F6CDD1D  # xor-ed into a sequence's seed for the draft's own draws
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
PENDING = -1  # a draft place reserved before scheduling, filled by the draft model after it


@dataclass(frozen=True)
class DraftPlan:
    """What the target's runner must know of a draft model before it sizes its page pool."""

    model_dir: Path
    model_config: ModelConfig
    shared_pool: SharedPool


def plan_draft_model(
    draft_dir: Path, target_dir: Path, target: ModelConfig, config: EngineConfig, dtype: torch.dtype
) -> DraftPlan:
    """`dtype`: the pages' storage type (the target's). Check that the draft can draft for the target (same vocabulary, long enough context) and
    say what its pages and weights add to the pool; a ModelConfigError names the mismatch."""
    draft = config_from_model_dir(draft_dir)
    if draft.vocab_size != target.vocab_size:
        raise ModelConfigError(
            f"the draft model's vocabulary ({draft.vocab_size} tokens, {draft_dir}) differs from the target's "
            f"({target.vocab_size} tokens): a draft must share the target's tokenizer"
        )
    both_have_tokenizers = (draft_dir / "tokenizer.json").is_file() and (target_dir / "tokenizer.json").is_file()
    if both_have_tokenizers and Tokenizer(draft_dir).vocab() != Tokenizer(target_dir).vocab():
        raise ModelConfigError(
            f"the draft model's tokenizer ({draft_dir}) maps tokens to other ids than the target's: "
            "a draft must share the target's tokenizer"
        )
    limit = config.max_model_len or target.max_position_embeddings
    if draft.max_position_embeddings < limit:
        raise ModelConfigError(
            f"the draft model's context ({draft.max_position_embeddings} tokens) is shorter than the target's "
            f"max_model_len ({limit}): set --max-model-len to at most {draft.max_position_embeddings}"
        )
    spec = KVCacheSpec(draft.num_layers, draft.num_kv_heads, draft.head_dim, config.page_size, dtype)
    weights = sum(f.stat().st_size for f in draft_dir.iterdir() if f.suffix in WEIGHT_SUFFIXES)
    return DraftPlan(draft_dir, draft, SharedPool(spec.bytes_per_page, weights))


class DraftModel:
    def __init__(self, plan: DraftPlan, target_config: EngineConfig, num_pages: int, max_model_len: int) -> None:
        """Load and compile the draft with the target's options, its pool `num_pages` pages
        under the target's page ids (one rank: a tensor-parallel target drafts on rank 0)."""
        config = msgspec.structs.replace(
            target_config,
            model=str(plan.model_dir),
            num_pages=num_pages,
            max_model_len=max_model_len,
            enable_lora=False,
            speculative_config=None,
            tensor_parallel_size=1,
        )
        self.runner = Runner(plan.model_dir, config)
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.sampler = Sampler()  # the torch sampler: every draw follows the sequence's seed
        self._written: dict[int, tuple[int, int]] = {}  # seq id -> (its preemptions, draft K/V written)
        self._advanced: dict[int, int] = {}  # seq id -> draft tokens its grammar took during `propose`
        logger.info("draft model: %s (%s)", plan.model_dir, self.runner.weights_description)

    def _valid(self, seq: Sequence) -> int:
        """How many of the sequence's leading tokens have standing draft K/V in its pages."""
        written = self._written.get(seq.seq_id)
        if written is None or written[0] != seq.num_preemptions:  # preempted: its pages were freed
            return 0
        return min(written[1], seq.num_computed_tokens)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], running: list[Sequence]) -> dict[int, torch.Tensor]:
        """Fill each sequence's reserved draft places (`draft_token_ids`, its pages allocated by
        the scheduler) with the draft model's tokens. Returns the draft's distribution [k, vocab]
        of every sampled (non-greedy) sequence, by seq id, for the rejection sampling."""
        self._advanced = {}
        live = {seq.seq_id for seq in running}
        self._written = {key: value for key, value in self._written.items() if key in live}
        if not seqs:
            return {}
        starts = self._catch_up(seqs)
        # The first draft token: each sequence's missing tokens and its last one.
        tokens = [seq.token_ids[start:] for seq, start in zip(seqs, starts, strict=True)]
        logits = self._forward(seqs, starts, tokens, want_logits=True)
        drafts: dict[int, list[int]] = {seq.seq_id: [] for seq in seqs}
        probs: dict[int, list[torch.Tensor]] = {seq.seq_id: [] for seq in seqs if not seq.params.greedy}
        self._draw(seqs, logits, drafts, probs)
        for ahead in range(1, max(len(seq.draft_token_ids) for seq in seqs)):
            active = [seq for seq in seqs if len(seq.draft_token_ids) > ahead]
            positions = [seq.num_computed_tokens + ahead for seq in active]
            logits = self._forward(active, positions, [[drafts[seq.seq_id][-1]] for seq in active], want_logits=True)
            self._draw(active, logits, drafts, probs)
        for seq in seqs:
            seq.draft_token_ids = drafts[seq.seq_id]
            self._written[seq.seq_id] = (seq.num_preemptions, seq.num_computed_tokens + len(seq.draft_token_ids))
            if seq.grammar is not None:  # `_draw` advanced it through the draft's valid tokens
                seq.grammar.rollback(self._advanced.pop(seq.seq_id, 0))
        return {seq_id: torch.stack(rows) for seq_id, rows in probs.items()}

    def _catch_up(self, seqs: list[Sequence]) -> list[int]:
        """Run the sequences' missing tokens before their last one in forwards of at most
        max_num_batched_tokens (beyond what the first draft forward takes); the new starts."""
        starts = [self._valid(seq) for seq in seqs]
        while sum(seq.num_computed_tokens + 1 - start for seq, start in zip(seqs, starts, strict=True)) > (
            self.max_num_batched_tokens
        ):
            budget = self.max_num_batched_tokens
            chunk: list[Sequence] = []
            chunk_starts: list[int] = []
            chunk_tokens: list[list[int]] = []
            for i, seq in enumerate(seqs):
                take = min(seq.num_computed_tokens - starts[i], budget)
                if take <= 0:
                    continue
                chunk.append(seq)
                chunk_starts.append(starts[i])
                chunk_tokens.append(seq.token_ids[starts[i] : starts[i] + take])
                starts[i] += take
                budget -= take
                if budget == 0:
                    break
            if not chunk:
                break  # only last tokens are left: more sequences than the budget has tokens
            self._forward(chunk, chunk_starts, chunk_tokens, want_logits=False)
        return starts

    def _allowed(self, seq: Sequence, drafted: int) -> torch.Tensor | None:
        """The grammar's mask after the `drafted` tokens so far, while the grammar took them all."""
        grammar = seq.grammar
        if grammar is None or grammar.finished:
            return None
        return grammar.allowed() if self._advanced.get(seq.seq_id, 0) == drafted else None

    def _forward(
        self, seqs: list[Sequence], starts: list[int], tokens: list[list[int]], want_logits: bool
    ) -> torch.Tensor | None:
        """Run `tokens` of each sequence from position `start` on; the logits after each
        sequence's last one (`want_logits`)."""
        ends = [start + len(ids) for start, ids in zip(starts, tokens, strict=True)]
        inputs = StepInputs(
            [token for ids in tokens for token in ids],
            [position for start, end in zip(starts, ends, strict=True) for position in range(start, end)],
            [len(ids) for ids in tokens],
            ends,
            [list(seq.block_table) for seq in seqs],
            wants=Wants.LOGITS if want_logits else Wants.NOTHING,
        )
        output = self.runner.execute(inputs)
        return output.rows if isinstance(output, Logits) else None

    def _draw(
        self,
        seqs: list[Sequence],
        logits: torch.Tensor | None,
        drafts: dict[int, list[int]],
        probs: dict[int, list[torch.Tensor]],
    ) -> None:
        """Each sequence's next draft token from its row of `logits`, filtered by its own
        sampling parameters as if its draft tokens so far had been generated."""
        assert logits is not None
        batch = SamplingBatch(
            params=[seq.params for seq in seqs],
            seeds=[seq.seed ^ DRAFT_NOISE_STREAM for seq in seqs],
            positions=[len(seq.output_token_ids) + len(drafts[seq.seq_id]) for seq in seqs],
            prompt_token_ids=[seq.prompt_token_ids for seq in seqs],
            output_token_ids=[seq.output_token_ids + drafts[seq.seq_id] for seq in seqs],
            banned_token_ids=[seq.banned_token_ids(len(drafts[seq.seq_id])) for seq in seqs],
        )
        if any(seq.grammar is not None for seq in seqs):  # draft inside the grammar, as far as it goes
            batch.allowed_tokens = [self._allowed(seq, len(drafts[seq.seq_id])) for seq in seqs]
        filtered = self.sampler.filtered_logits(logits, batch)
        chosen = filtered
        sampled = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        if sampled:
            seeds = torch.tensor([batch.seeds[i] for i in sampled], dtype=torch.int64, device=logits.device)
            where = torch.tensor([batch.positions[i] for i in sampled], dtype=torch.int64, device=logits.device)
            chosen = filtered.clone()
            chosen[sampled] += gumbel_noise(seeds, where, filtered.shape[-1])
        tokens = chosen.argmax(dim=-1).tolist()
        for i, seq in enumerate(seqs):
            drafts[seq.seq_id].append(tokens[i])
            grammar = seq.grammar
            took_all = self._advanced.get(seq.seq_id, 0) == len(drafts[seq.seq_id]) - 1
            if grammar is not None and took_all and grammar.try_advance(tokens[i]):
                self._advanced[seq.seq_id] = len(drafts[seq.seq_id])
            if seq.seq_id in probs:
                probs[seq.seq_id].append(torch.softmax(filtered[i], dim=-1))


class DraftModelDrafter:
    """The engine's drafter (engine/drafting.py) for the "draft_model" method: places reserved
    before scheduling, filled by the draft model after it, verified by rejection sampling where
    the sequence samples."""

    def __init__(self, config: SpeculativeConfig, model: DraftModel) -> None:
        self.config = config
        self.model = model
        self.stats = SpeculativeStats()

    @staticmethod
    def plan(config: SpeculativeConfig, engine_config: EngineConfig, model_dir: Path) -> DraftModelPlan:
        """Checks the draft against the target before any weight is read."""
        assert config.model is not None  # SpeculativeConfig requires it for this method
        target = config_from_model_dir(model_dir)
        plan = plan_draft_model(
            resolve_model_dir(config.model), model_dir, target, engine_config, engine_config.resolved_kv_cache_dtype()
        )
        return DraftModelPlan(config, engine_config, plan)

    @property
    def runners(self) -> list[Runner]:
        return [self.model.runner]

    def propose(self, running: list[Sequence], max_model_len: int) -> None:
        propose_drafts(self.config, running, max_model_len, lambda config, seq, k: [PENDING] * k)

    def fill(self, scheduled: list[Sequence], running: list[Sequence]) -> DraftProbs:
        return self.model.propose([seq for seq in scheduled if seq.draft_token_ids], running)

    def record(self, seq: Sequence, num_draft: int, num_accepted: int) -> None:
        record_verify(self.config, self.stats, seq, num_draft, num_accepted)

    def snapshot(self) -> SpeculativeStats | None:
        return self.stats.copy()


@dataclass(frozen=True)
class DraftModelPlan:
    config: SpeculativeConfig
    engine_config: EngineConfig
    draft: DraftPlan

    @property
    def shared_pool(self) -> SharedPool:
        return self.draft.shared_pool

    def start(self, runner: Runner) -> DraftModelDrafter:
        """The draft model, on this rank alone, keeps its K/V under the runner's page ids."""
        model = DraftModel(self.draft, self.engine_config, runner.num_pages, runner.max_model_len)
        return DraftModelDrafter(self.config, model)
