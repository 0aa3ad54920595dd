"""ModelRunner: owns the model and the paged KV tensors; turns a StepPlan into one flat
forward pass, computes logits only where a token is due, and samples. Which implementation
runs any of it is the backend's (backends/): the runner asks it for the KV tensors, each
step's attention record, the greedy fast path and the sampler's device ops."""
from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from sluice.backends.base import FlatBatch
from sluice.config import CacheConfig
from sluice.core.scheduler import PromptLogprobs, SampledToken, ScheduledRequest, StepPlan, StepResult
from sluice.request import LogprobRow
from sluice.structured.grammar import MaskFiller
from sluice.worker.sampler import Sampler, SamplerOutput, SamplingMetadata, seeded_generator, token_logprobs

logger = logging.getLogger(__name__)


@dataclass
class RunnerTimings:
    prepare: float = 0.0   # plan -> flat tensors
    forward: float = 0.0   # the model over the flat batch
    sample: float = 0.0    # LM head, sampling, the host sync


def logprob_row(ids: list[int], lps: list[float], rank: int, k: int) -> LogprobRow:
    """A scored token's logprobs: ids[0] is that token (sampled, or the prompt's next),
    then the top k in order. Slices, not a tuple an entry: a request may ask for the
    whole vocabulary at every position."""
    return ids[:k + 1], lps[:k + 1], rank


@dataclass
class Launched:
    """A step whose work is queued on the device (ModelRunner.launch) and whose tokens
    the host has not read yet (ModelRunner.collect)."""
    plan: StepPlan
    entries: list[ScheduledRequest] = field(default_factory=list)  # those sampled for
    out: SamplerOutput | None = None
    failed_loads: list = field(default_factory=list)  # KV reloads that failed (OffloadStore.execute)
    prompt_logprobs: dict = field(default_factory=dict)
    t0: float = 0.0
    t1: float = 0.0
    t2: float = 0.0

    @property
    def token_ids(self) -> torch.Tensor:
        return self.out.token_ids

    @functools.cached_property
    def rows(self) -> dict[str, int]:
        """Request id -> its (first) row of out.token_ids: the next step's pending input
        (asked for only by a step launched while this one is in flight)."""
        rows, i = {}, 0
        for e in self.entries:
            rows[e.request_id] = i
            i += len(e.draft_token_ids) + 1
        return rows


def _last_rows(plan: StepPlan) -> list[int]:
    """Each entry's row of its last non-draft token in the flat batch."""
    rows, end = [], 0
    for e in plan.scheduled:
        end += len(e.token_ids)
        rows.append(end - 1 - len(e.draft_token_ids))
    return rows


# Prompt rows scored per LM-head call: 256 x 49152 float32 logits are 48 MiB.
PROMPT_LOGPROB_ROWS = 256


class ModelRunner:
    def __init__(self, model, backend, cache: CacheConfig, seed: int, grammar_mask_width: int | None = None,
                 max_num_seqs: int = 256, max_model_len: int | None = None):
        self.model = model
        self.backend = backend
        # The most requests a step decodes, and the longest context: the shapes a backend
        # records (CUDA graphs) must cover.
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len or model.arch.max_position_embeddings
        self.arch = model.arch
        self.dtype = backend.dtype
        self.device = backend.device
        self.block_size = cache.block_size
        # KV heads this process holds: all of the model's, or a tensor-parallel rank's.
        self.num_kv_heads = getattr(model, "num_kv_heads", self.arch.num_kv_heads)
        self.kv_cache_dtype = cache.kv_cache_dtype
        # How the layers share the block pool (groups by sliding window, core/kv_layout.py):
        # layer i reads and writes K/V tensor layer_places[i][1] through group
        # layer_places[i][0]'s block tables.
        self.layout = backend.kv_layout(self.arch)
        self.layer_places = self.layout.layer_places(self.arch.num_layers)
        self.num_blocks = backend.num_kv_blocks(cache, self.arch, self.num_kv_heads)
        # One extra block past the pool: padding rows of a padded batch (backend.padded_rows)
        # write their K/V there.
        self.scratch_slot = self.num_blocks * cache.block_size
        self.kv_tensors: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # one pair per tensor slot
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None   # each layer's pair
        self.allocate_kv()
        per_block = backend.kv_bytes_per_block(self.arch, cache.block_size, self.num_kv_heads)
        groups = "" if self.layout.num_groups == 1 else (
            f"; {self.layout.num_groups} layer groups of {self.layout.group_size} ({self.layout.describe()}), "
            "sliding-window groups giving back the blocks behind their window")
        logger.info("KV cache: %d blocks of %d tokens, %s (%.2f GiB)%s", self.num_blocks, cache.block_size,
                    "int8" if cache.kv_cache_dtype == "int8" else str(self.dtype).removeprefix("torch."),
                    self.num_blocks * per_block / 2**30, groups)
        # Tensor parallelism: rank 0's handle on the other ranks (distributed/tensor_parallel.py),
        # which each step's inputs are sent to; None in one process and on the other ranks.
        self.tp = None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        self.sampler = Sampler(generator, *backend.sampler_ops())
        self.vocab_size = self.arch.vocab_size
        self.timings = RunnerTimings()
        # LoRA adapters (lora/slots.py LoRAManager), set by the engine where they are served.
        self.lora = None
        # KV offloading (worker/kv_offload_store.py OffloadStore), set by the engine where on:
        # each plan's copies between the pool and the tiers run before its forward pass.
        self.offload = None
        # structured_outputs rows: their token masks, filled while the forward pass runs.
        self.set_grammar_mask_width(grammar_mask_width)

    def set_grammar_mask_width(self, width: int | None) -> None:
        """32-bit words per row of a grammar's token mask (the tokenizer's vocabulary)."""
        self.masks = MaskFiller(width or (self.vocab_size + 31) // 32)

    # -- the KV cache ---------------------------------------------------------
    def allocate_kv(self) -> None:
        """K and V tensors for every layer (zeros); a no-op if they exist. The backend then
        records what reads them (CUDA graphs)."""
        if self.kv_caches is None:
            self.kv_tensors = self.backend.allocate_kv_cache(self.layout.group_size, self.num_kv_heads,
                                                             self.num_blocks, self.block_size, self.arch.head_dim)
            self.kv_caches = [self.kv_tensors[j] for _, j in self.layer_places]
            self.backend.capture(self)

    def free_kv(self) -> int:
        """Drop the KV tensors (their memory goes back to the system); returns their bytes."""
        if self.kv_caches is None:
            return 0
        self.backend.release()
        freed = sum(t.numel() * t.element_size() for pair in self.kv_tensors for t in pair)
        self.kv_caches = self.kv_tensors = None
        return freed

    # -- inputs ---------------------------------------------------------------
    def _prepare(self, plan: StepPlan):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        for e in plan.scheduled:
            q = len(e.token_ids)
            end = query_start[-1] + q
            input_ids.extend(e.token_ids)
            positions.extend(range(e.start_pos, e.start_pos + q))
            query_start.append(end)
            seq_lens.append(e.start_pos + q)
            if e.needs_logits:  # the last row; with drafts, also the rows that verify them
                logits_rows.extend(range(end - 1 - len(e.draft_token_ids), end))
        num_tokens = len(input_ids)
        pad = self.backend.padded_rows(num_tokens) - num_tokens
        if pad:
            input_ids.extend([0] * pad)
            positions.extend([0] * pad)
        logits_rows.extend([logits_rows[0] if logits_rows else 0]
                           * (self.backend.padded_rows(len(logits_rows)) - len(logits_rows)))

        def batch(tables: list[list[int]]) -> FlatBatch:
            slots: list[int] = []
            for e, blocks in zip(plan.scheduled, tables):
                slots.extend(blocks[p // bs] * bs + p % bs for p in range(e.start_pos, e.start_pos + len(e.token_ids)))
            slots.extend([self.scratch_slot] * pad)
            return FlatBatch(query_start, seq_lens, tables, slots, bs)

        meta = self.backend.attention_metadata(batch([e.block_ids for e in plan.scheduled]))
        if self.layout.num_groups > 1:
            # Each group's own tables and slots (group 0's are the ones above).
            metas = [meta] + [self.backend.group_metadata(meta, batch([e.group_block_ids[g] for e in plan.scheduled]))
                              for g in range(1, self.layout.num_groups)]
            meta.layer_meta = [metas[g] for g, _ in self.layer_places]
        to_device = self.backend.to_device
        return to_device(input_ids), to_device(positions), meta, to_device(logits_rows)

    def _sampling_metadata(self, entries: list[ScheduledRequest], grammar=None,
                           offsets: list[int] | None = None) -> SamplingMetadata:
        """One row per entry; offsets[i] > 0 marks a row verifying the entry's draft
        offsets[i] - 1, a token that many positions further on (its seeded draw is the one
        that position gets without speculation)."""
        dev, V = self.device, self.vocab_size
        params = [e.params for e in entries]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        any_top_p = any(p.top_p < 1.0 for p in params)
        any_top_k = any(p.top_k != -1 for p in params)
        any_min_p = any(p.min_p > 0 for p in params)
        any_pen = any(p.has_penalties for p in params)
        seen = rep = pres = freq = None
        if any_pen:
            seen_rows, seen_ids, seen_counts = [], [], []
            for i, (e, p) in enumerate(zip(entries, params)):
                if not p.has_penalties:
                    continue  # its penalties are neutral: nothing to change
                counts = Counter(e.output_token_ids)
                for t in counts.keys() | set(e.prompt_token_ids):
                    if t < V:
                        seen_rows.append(i)
                        seen_ids.append(t)
                        seen_counts.append(counts.get(t, 0))
            seen = (torch.tensor(seen_rows, dtype=torch.long, device=dev),
                    torch.tensor(seen_ids, dtype=torch.long, device=dev),
                    torch.tensor(seen_counts, dtype=torch.float32, device=dev))
            rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=dev)
            pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=dev)
            freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=dev)
        banned_rows, banned_ids = [], []
        for i, e in enumerate(entries):
            for t in e.banned_token_ids:
                if t < V:
                    banned_rows.append(i)
                    banned_ids.append(t)
        banned = None
        if banned_rows:
            banned = (torch.tensor(banned_rows, device=dev), torch.tensor(banned_ids, device=dev))
        bias = allowed = None
        allowed_rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
        if allowed_rows:
            mask = torch.zeros((len(allowed_rows), V), dtype=torch.bool, device=dev)
            for r, i in enumerate(allowed_rows):
                mask[r, torch.tensor(params[i].allowed_token_ids, dtype=torch.long, device=dev)] = True
            allowed = (torch.tensor(allowed_rows, dtype=torch.long, device=dev), mask)
        if any(p.logit_bias for p in params):
            bias_rows = [i for i, p in enumerate(params) if p.logit_bias for _ in p.logit_bias]
            bias = (torch.tensor(bias_rows, dtype=torch.long, device=dev),
                    torch.tensor([t for p in params if p.logit_bias for t in p.logit_bias], dtype=torch.long,
                                 device=dev),
                    torch.tensor([b for p in params if p.logit_bias for b in p.logit_bias.values()],
                                 dtype=torch.float32, device=dev))
        offsets = offsets or [0] * len(entries)
        generators = [
            seeded_generator(p.seed, len(e.prompt_token_ids) + len(e.output_token_ids) + e.pending_input + j, dev)
            if p.seed is not None and p.temperature > 0 else None
            for p, e, j in zip(params, entries, offsets)
        ]
        return SamplingMetadata(
            temperature=temperature,
            all_greedy=all(p.temperature == 0 for p in params),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev) if any_top_p else None,
            top_k=torch.tensor([p.top_k if p.top_k > 0 else V for p in params], dtype=torch.long,
                               device=dev) if any_top_k else None,
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev) if any_min_p else None,
            repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq,
            seen_tokens=seen, banned=banned,
            generators=generators, grammar=grammar, logit_bias=bias, allowed=allowed,
            max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
        )

    # -- one step -------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        """One step, its tokens on the host when it returns."""
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan, prev: "Launched | None" = None) -> "Launched":
        """Queue one step's work on the device up to its sampled tokens, without waiting
        for them (on a CPU everything has run when this returns). prev: the step still in
        flight, whose sampled tokens are the inputs of this step's pending rows
        (ScheduledRequest.pending_input), copied on the device."""
        if plan.is_empty:
            return Launched(plan)
        t0 = time.perf_counter()
        failed_loads = self.offload.execute(plan.kv_transfers, self.kv_tensors) if plan.kv_transfers else []
        input_ids, positions, meta, logits_rows = self._prepare(plan)
        pending = [] if prev is None else [
            (i, e.request_id) for i, e in zip(_last_rows(plan), plan.scheduled) if e.pending_input]
        if pending:
            # Asynchronous scheduling: the previous step's tokens, never seen by the host.
            src = torch.tensor([prev.rows[rid] for _, rid in pending], dtype=torch.long, device=self.device)
            dst = torch.tensor([i for i, _ in pending], dtype=torch.long, device=self.device)
            input_ids.index_copy_(0, dst, prev.token_ids.index_select(0, src).to(input_ids.dtype))
        entries = [e for e in plan.scheduled if e.needs_logits]
        # One sampling row per token due; an entry verifying d drafts has d + 1 of them.
        row_entries = [e for e in entries for _ in range(len(e.draft_token_ids) + 1)]
        offsets = [j for e in entries for j in range(len(e.draft_token_ids) + 1)]
        if self.lora is not None:  # each adapter's rows, its weights resident
            self.lora.prepare(plan.scheduled, input_ids.shape[0])
        grammar_rows = [i for i, e in enumerate(row_entries) if e.grammar is not None]
        # The constrained rows' masks are computed on a thread while the model runs.
        masks = self.masks.start([row_entries[i].grammar for i in grammar_rows]) if grammar_rows else None
        t1 = time.perf_counter()
        if self.tp is not None:  # the other ranks build the same batch and run their shards beside this one
            self.tp.forward(plan)
        try:
            hidden = self.backend.forward(self.model, input_ids, positions, meta, self.kv_caches)
        finally:
            grammar = None
            if masks is not None:  # even when the forward failed: the thread must be done with them
                grammar = (torch.tensor(grammar_rows, dtype=torch.long, device=self.device),
                           self.masks.finish(masks).to(self.device))
        t2 = time.perf_counter()
        launched = Launched(plan, entries, failed_loads=failed_loads, t0=t0, t1=t1, t2=t2)
        if entries:
            # logits_rows is padded as the batch is (backend.padded_rows); extra rows repeat the first.
            rows = hidden.index_select(0, logits_rows)
            n_rows = len(row_entries)
            greedy = None
            if all(e.params.only_argmax and not e.banned_token_ids for e in row_entries):
                # Only the argmax is wanted: the backend's fast path for it, where it has one
                # (no sampling metadata to build: ~0.1 ms of a one-row CPU step).
                greedy = self.backend.greedy_tokens(self.model, rows, grammar)
            if greedy is not None:
                launched.out = SamplerOutput(greedy[:n_rows], None, None, None)
            else:
                meta = self._sampling_metadata(row_entries, grammar, offsets)
                launched.out = self.sampler(self.model.compute_logits(rows)[:n_rows], meta)
        launched.prompt_logprobs = self._prompt_logprobs(plan, hidden)
        return launched

    def collect(self, launched: "Launched") -> StepResult:
        """A launched step's sampled tokens on the host: the one host sync of a step."""
        plan, entries, out = launched.plan, launched.entries, launched.out
        if plan.is_empty:
            return StepResult({})
        sampled: dict[str, SampledToken] = {}
        accepted: dict[str, list[SampledToken]] = {}
        if entries:
            token_ids = out.token_ids.tolist()
            if out.logprobs is not None:
                lp_ids, lps, ranks = out.logprob_ids.tolist(), out.logprobs.tolist(), out.ranks.tolist()

            def token(e: ScheduledRequest, i: int) -> SampledToken:
                lp = None
                if e.params.logprobs is not None:
                    lp = logprob_row(lp_ids[i], lps[i], ranks[i], e.params.logprobs)
                return SampledToken(token_ids[i], lp)

            i = 0
            for e in entries:
                sampled[e.request_id] = token(e, i)
                draft = e.draft_token_ids
                if draft:
                    # Verification: row j sampled the token after draft j - 1 exactly as a
                    # step without speculation would have (same logits, same seeded draw);
                    # drafts are kept while each equals the token sampled before it, and
                    # the token sampled after the last kept one comes with them.
                    a = 0
                    while a < len(draft) and token_ids[i + a] == draft[a]:
                        a += 1
                    if a:
                        accepted[e.request_id] = [token(e, i + j) for j in range(1, a + 1)]
                i += len(draft) + 1
        t3 = time.perf_counter()
        self.timings.prepare += launched.t1 - launched.t0
        self.timings.forward += launched.t2 - launched.t1
        self.timings.sample += t3 - launched.t2
        return StepResult(sampled, launched.prompt_logprobs, accepted, launched.failed_loads)

    @torch.inference_mode()
    def forward_only(self, plan: StepPlan) -> None:
        """A tensor-parallel rank other than 0: this step's forward pass over its shard (its
        all-reduces meet rank 0's); logits and sampling are rank 0's."""
        input_ids, positions, meta, _ = self._prepare(plan)
        self.model(input_ids, positions, meta, self.kv_caches)

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor) -> dict:
        """Logprobs of prompt tokens for the entries that ask for them: the LM head over
        their prompt rows, PROMPT_LOGPROB_ROWS rows at a time (a [rows, vocab] float32 block
        each), through the sampler's own token_logprobs. Rows are found in the flat batch
        as the model saw it: the plan's entries one after another."""
        rows: list[int] = []
        targets: list[int] = []
        wanted: list[tuple[str, int, int, int]] = []  # (request id, first position, rows, k)
        offset = 0
        for e in plan.scheduled:
            if e.prompt_logprob_positions is not None:
                lo, hi = e.prompt_logprob_positions
                first = offset + lo - e.start_pos
                rows.extend(range(first, first + hi - lo))
                targets.extend(e.prompt_token_ids[lo + 1:hi + 1])
                wanted.append((e.request_id, lo, hi - lo, e.params.prompt_logprobs))
            offset += len(e.token_ids)
        if not rows:
            return {}
        k = max(w[3] for w in wanted)
        rows_t = torch.tensor(rows, dtype=torch.long, device=self.device)
        targets_t = torch.tensor(targets, dtype=torch.long, device=self.device)
        parts = []
        for s in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            r = rows_t[s:s + PROMPT_LOGPROB_ROWS]
            n = len(r)
            # Padded like the sampling rows (one LM-head kernel per shape); pads repeat row 0.
            r = torch.cat([r, r[:1].expand(self.backend.padded_rows(n) - n)])
            logits = self.model.compute_logits(hidden.index_select(0, r))[:n]
            parts.append(token_logprobs(logits, targets_t[s:s + n], k))
        ids = torch.cat([p[0] for p in parts]).tolist()
        lps = torch.cat([p[1] for p in parts]).tolist()
        ranks = torch.cat([p[2] for p in parts]).tolist()
        out: dict[str, PromptLogprobs] = {}
        i = 0
        for rid, lo, count, kr in wanted:
            entries = []
            for row in range(i, i + count):
                entries.append(logprob_row(ids[row], lps[row], ranks[row], kr))
            out[rid] = PromptLogprobs(lo, entries)
            i += count
        return out
