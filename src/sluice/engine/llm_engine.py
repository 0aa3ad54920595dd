"""LLMEngine: the synchronous engine the offline API and the server drive.

    plan = scheduler.schedule()         who runs this step, how many tokens each
    result = runner.execute(plan)       one forward over a flat batch, then sampling
    update = scheduler.update(...)      append tokens, stop checks, free blocks
    outputs.process(update)             detokenize, stop strings, RequestOutputs
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from sluice.backends.prepare import prepare as prepare_model
from sluice.backends.select import select as select_backend
from sluice.config import EngineConfig
from sluice.core.kv_cache_manager import KVCacheManager
from sluice.core.scheduler import Scheduler
from sluice.engine.output_processor import OutputProcessor
from sluice.models.loader import iter_weights, load_hf_config, resolve_model
from sluice.models.registry import build_model
from sluice.outputs import RequestOutput
from sluice.request import MAX_SESSION_ID_CHARS, Request, RequestStatus
from sluice.sampling_params import SamplingParams
from sluice.spec.speculator import Speculator
from sluice.structured.grammar import GrammarCompiler
from sluice.tokenizer import Tokenizer
from sluice.worker.model_runner import ModelRunner, RunnerTimings

logger = logging.getLogger(__name__)


@dataclass
class StepTimings:
    """Cumulative wall seconds per phase of step(), for profiling (always on: a handful
    of clock reads per step)."""
    runner: "RunnerTimings"
    steps: int = 0
    schedule: float = 0.0
    execute: float = 0.0
    update_and_output: float = 0.0   # token bookkeeping, detokenization, stop strings

    def breakdown_ms(self) -> dict[str, float]:
        """Mean milliseconds per step of each phase."""
        n = max(self.steps, 1)
        r = self.runner
        return {"schedule": 1e3 * self.schedule / n, "prepare_inputs": 1e3 * r.prepare / n,
                "forward": 1e3 * r.forward / n, "logits_and_sampling": 1e3 * r.sample / n,
                "update_and_detokenize": 1e3 * self.update_and_output / n,
                "total": 1e3 * (self.schedule + self.execute + self.update_and_output) / n}

    def reset(self) -> None:
        self.steps, self.schedule, self.execute, self.update_and_output = 0, 0.0, 0.0, 0.0
        self.runner.prepare = self.runner.forward = self.runner.sample = 0.0


def check_scheduling_fields(session_id, tenant, priority) -> None:
    """A request's scheduling fields, each refused with a ValueError that names it."""
    if session_id is not None and (not isinstance(session_id, str) or not session_id):
        raise ValueError("session_id must be a non-empty string")
    if session_id is not None and len(session_id) > MAX_SESSION_ID_CHARS:
        raise ValueError(f"session_id must be at most {MAX_SESSION_ID_CHARS} characters, got {len(session_id)}")
    if tenant is not None and not isinstance(tenant, str):
        raise ValueError("tenant must be a string")
    if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
        raise ValueError(f"priority must be an integer >= 0 (lower runs first), got {priority!r}")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.validate()  # idempotent; refuses modes this machine cannot run, before anything loads
        self.config = config
        mc = config.model
        self.device = torch.device(mc.device)
        t0 = time.perf_counter()
        # Which implementation runs each op, decided once and logged in one line; kernels
        # are built (first start) and any mode that cannot run refused before weights load.
        self.backend = select_backend(mc, config.cache)
        self.dtype = self.backend.dtype
        model_kernels = self.backend.model_kernels
        src = resolve_model(mc.model)
        hf_config = load_hf_config(src)
        with torch.device(self.device):
            model = build_model(hf_config).to(self.dtype)
        arch = model.arch
        if config.cache.kv_cache_dtype == "int8" and arch.head_dim % 4:
            raise ValueError(f"kv_cache_dtype='int8' takes head_dim a multiple of 4, this model has {arch.head_dim}")
        model.load_weights(iter_weights(src, self.dtype))
        model.eval()
        self.max_model_len = min(mc.max_model_len or arch.max_position_embeddings,
                                 arch.max_position_embeddings)
        prepare_model(model, self.backend, mc.quantization, self.max_model_len)
        self.tokenizer = Tokenizer.load(src, hf_config)
        self.model_path = src.path
        # structured_outputs: grammars compiled for this tokenizer (on first use).
        self.grammars = GrammarCompiler(self.tokenizer.hf, self.tokenizer.eos_token_ids, arch.vocab_size,
                                        cache_size=config.structured.grammar_cache_size,
                                        compile_timeout_s=config.structured.grammar_compile_timeout_s)
        self.runner = ModelRunner(model, config.cache, self.dtype, self.device, mc.seed,
                                  kernels=self.backend.kernels,
                                  batch_invariant_kernels=model_kernels if mc.deterministic else None,
                                  flat_prefill=model_kernels is not None,
                                  grammar_mask_width=self.grammars.mask_width)
        self.kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                 enable_caching=config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, speculator=self._speculator())
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler)
        self.timings = StepTimings(runner=self.runner.timings)
        logger.info("loaded %s (%s) in %.1fs", src.path, self.dtype, time.perf_counter() - t0)

    def _speculator(self) -> Speculator | None:
        sp = self.config.speculative
        return Speculator(sp, self.max_model_len) if sp.speculative_method is not None else None

    @classmethod
    def from_kwargs(cls, **kwargs) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(**kwargs))

    # -- requests -------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    session_id: str | None = None, tenant: str | None = None, priority: int = 0) -> list[int]:
        """Queue a request (n samples of it). Raises ValueError if it can never run.
        Returns the prompt's token ids. Requests share cached prefix blocks only with
        requests of the same cache_salt (one per tenant, say).

        session_id: the agent program this call belongs to; its KV stays pinned after the
        call for the session's next one (core/sessions.py). Sessions are namespaced by
        tenant: the same id under another tenant is another session. tenant: who the
        request is served for (the `fair` policy's unit; default one shared tenant).
        priority: lower first under the `priority` policy (an integer >= 0)."""
        params = params or SamplingParams()
        check_scheduling_fields(session_id, tenant, priority)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.outputs.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, ids = prompt, (self.tokenizer.encode(prompt) if prompt else [])
        else:
            text, ids = None, list(prompt)
            if any(not isinstance(t, int) or not 0 <= t < self.runner.vocab_size for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {self.runner.vocab_size})")
        if not ids:
            raise ValueError("prompt must not be empty")
        self._check_vocab(params)
        max_tokens = self._check_fits(len(ids), params)
        # Compiled here unless the server already did (off this thread: then a cache hit).
        grammar = self.grammars.compile(params.structured_outputs) if params.structured_outputs else None
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                # Independent samples: each child gets its own seed derived from the request's
                # (wrapped into int64, where every seed draws as its value modulo 2^64 would).
                seed = None if params.seed is None else (params.seed + i + 2**63) % 2**64 - 2**63
                child_params = params.clone(n=1, seed=seed)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(Request(child_id, ids, child_params, self.tokenizer.eos_token_ids,
                                    max_tokens, arrival_time, cache_salt=cache_salt,
                                    share_key=request_id if params.n > 1 else None,
                                    session_id=session_id, tenant=tenant or "", priority=priority))
            if grammar is not None:
                children[-1].grammar = grammar if i == 0 else grammar.copy()
        self.outputs.add(request_id, text, ids, children)
        for child in children:
            self.scheduler.add_request(child)
        return ids

    def _check_vocab(self, params: SamplingParams) -> None:
        """The fields whose bound is this model's vocabulary (a token id past it would
        fail inside the step, for every request in the batch)."""
        vocab = self.runner.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}) for this model")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > vocab:
                raise ValueError(f"{name} must be at most the vocabulary size {vocab}, got {k}")

    def _check_fits(self, prompt_len: int, params: SamplingParams) -> int:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise ValueError(f"prompt is {prompt_len} tokens, but max_model_len is {limit}: "
                             f"{prompt_len - limit + 1} tokens too long (at least one must be generated)")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = limit - prompt_len
        elif prompt_len + max_tokens > limit:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = "
                             f"{prompt_len + max_tokens} exceeds max_model_len {limit} by "
                             f"{prompt_len + max_tokens - limit}")
        capacity = self.kv.num_blocks * self.kv.block_size
        if prompt_len + max_tokens > capacity:
            if params.max_tokens is None and prompt_len < capacity:
                return capacity - prompt_len
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = "
                             f"{prompt_len + max_tokens} can never fit the KV cache of {capacity} "
                             f"tokens ({self.kv.num_blocks} blocks): over by {prompt_len + max_tokens - capacity}")
        return max_tokens

    def abort(self, request_id: str) -> None:
        """Stop a request at any point; its blocks are free when this returns."""
        aborted = []
        for cid in self.outputs.children_of(request_id):
            req = self.scheduler.finish_request(cid, RequestStatus.FINISHED_ABORTED)
            if req is not None:
                aborted.append(req)
        self.outputs.mark_aborted(aborted)

    def reset_prefix_cache(self) -> int:
        """Forget all cached prefix blocks (needed after a weight update); returns how many."""
        return self.scheduler.reset_prefix_cache()

    def release_session(self, session_id: str, tenant: str | None = None) -> int | None:
        """Drop a session's pinned KV blocks now; returns how many it held, None if this
        tenant has no such session."""
        check_scheduling_fields(session_id, tenant, 0)
        return self.scheduler.release_session(tenant or "", session_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.outputs.has_pending()

    def reset(self) -> None:
        """Forget every request and cached block, keeping the model and the KV tensors:
        the state a fresh engine starts from, in milliseconds. For recovery after a failure
        that may have left the queues inconsistent (the caller ends the dropped requests'
        streams)."""
        self.kv = KVCacheManager(self.runner.num_blocks, self.config.cache.block_size,
                                 enable_caching=self.config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.config.scheduler, self.kv, self.max_model_len, speculator=self._speculator())
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler)

    # -- one step -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t = self.timings
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if self.scheduler.last_decisions:
            logger.debug("step %d: %s", t.steps, "; ".join(self.scheduler.last_decisions))
        spec = self.scheduler.spec
        t1 = time.perf_counter()
        try:
            result = self.runner.execute(plan)
            t2 = time.perf_counter()
            update = self.scheduler.update(plan, result)
            outputs = self.outputs.process(update)
        except Exception as e:
            # One failed step must not stop the engine: its requests end with an error and
            # the rest (waiting, or not in this step) go on. Nothing they computed this step
            # was counted, so none of its blocks stay named in the prefix cache.
            return self._fail_step(plan, e)
        t3 = time.perf_counter()
        self.scheduler.observe_step(plan, t3 - t0)
        if spec is not None and spec.last_step:
            logger.debug("step %d: %s (%d tokens, %.1f ms)", t.steps, spec.last_step, plan.num_batched_tokens,
                         1e3 * (t3 - t0))
        t.steps += 1
        t.schedule += t1 - t0
        t.execute += t2 - t1
        t.update_and_output += t3 - t2
        return outputs

    def _fail_step(self, plan, error: Exception) -> list[RequestOutput]:
        parents = self.outputs.parents_of(e.request_id for e in plan.scheduled)
        logger.exception("an engine step failed (%s); ending its %d request(s) with an error, the engine "
                         "goes on", type(error).__name__, len(parents))
        for pid in parents:
            for cid in self.outputs.children_of(pid):
                self.scheduler.finish_request(cid, RequestStatus.FINISHED_ERROR)
        message = (f"the engine step running this request failed ({type(error).__name__}); the request was "
                   f"ended and the server goes on serving others (details in the server log)")
        return self.outputs.fail(parents, message)
