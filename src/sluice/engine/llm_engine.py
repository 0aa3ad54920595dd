"""LLMEngine: the engine the offline API and the server drive, one step per call.

    plan = scheduler.schedule()         who runs this step, how many tokens each
    result = runner.execute(plan)       one forward over a flat batch, then sampling
    update = scheduler.update(...)      append tokens, stop checks, free blocks
    outputs.process(update)             detokenize, stop strings, RequestOutputs

With asynchronous scheduling (SchedulerConfig.async_scheduling, on by default on a GPU)
a step overlaps the device's work with the host's (SGLang's overlap loop):

    plan N = schedule(); advance(plan N)    planned before step N - 1's tokens are known
    launch(plan N, step N - 1)              queued on the device; inputs from N - 1's output
    collect(step N - 1); update; outputs    the host reads N - 1's tokens while N runs
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from sluice import quantization
from sluice.backends.base import weight_bytes
from sluice.backends.select import select as select_backend
from sluice.config import EngineConfig
from sluice.core.kv_cache_manager import KVCacheManager
from sluice.core.kv_offload import OffloadIndex
from sluice.core.scheduler import Scheduler
from sluice.engine.output_processor import OutputProcessor
from sluice.engine.request_checks import RequestChecks
from sluice.distributed.parallel import check_tp_size, split
from sluice.distributed.tensor_parallel import TensorParallel
from sluice.models.loader import forget_gguf_files, gguf_tensor_bytes, iter_weights, load_hf_config, resolve_model
from sluice.models.registry import model_spec
from sluice.outputs import RequestOutput
from sluice.request import MAX_SESSION_ID_CHARS, Request, RequestStatus
from sluice.sampling_params import SamplingParams
from sluice.spec.speculator import Speculator
from sluice.reasoning import resolve as resolve_reasoning
from sluice.structured.grammar import GrammarCompiler
from sluice.tokenizer import Tokenizer
from sluice.worker.kv_offload_store import OffloadStore, offload_block_bytes, offload_compresses
from sluice.worker.model_runner import Launched, RunnerTimings
from sluice.worker.shard import build_shard

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


def read_weights(path: str | Path, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a checkpoint on disk, for update_weights: a .safetensors file, a
    Hugging Face folder of them, or a .gguf file (all of a model's tensors, or any subset)."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".safetensors":
        from safetensors.torch import load_file
        return list(load_file(str(p)).items())
    if p.is_dir() or (p.is_file() and p.suffix == ".gguf"):
        return list(iter_weights(resolve_model(str(p)), dtype))
    raise ValueError(f"weights are read from a .safetensors file, a folder of them or a .gguf file; got {str(p)!r}")


class EngineAsleepError(RuntimeError):
    """The engine's KV cache is freed (sleep()); wake_up() restores it."""


class EngineBusyError(RuntimeError):
    """An operation that needs an idle engine found requests in flight."""


class EngineFatalError(RuntimeError):
    """The engine cannot run any more step (a tensor-parallel rank is gone)."""


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.validate()  # idempotent; refuses modes this machine cannot run, before anything loads
        self.config = config
        mc = config.model
        self.device = torch.device(mc.device)
        t0 = time.perf_counter()
        size = config.parallel.tensor_parallel_size
        # Tensor parallelism: the other ranks are started first, so that they load their
        # shards while this process loads its own; every rank gets the same number of KV
        # blocks (sized here for rank 0's KV heads, the most any rank holds).
        self.tp: TensorParallel | None = None
        if size > 1:
            backend = select_backend(mc, config.cache, size, log=False)  # refuses what cannot run here
            spec = model_spec(load_hf_config(resolve_model(mc.model)))
            arch = spec[1]
            check_tp_size(size, arch.num_kv_heads)
            heads = split(arch.num_kv_heads, size, 0)[1]
            cache = dataclasses.replace(config.cache, num_blocks=backend.num_kv_blocks(config.cache, arch, heads))
            config = dataclasses.replace(config, cache=cache)
            self.config = config
            self.tp = TensorParallel(size)
        try:
            if self.tp is not None:
                self.tp.start(config, spec)
            shard = build_shard(config, self.tp.group if self.tp else None)
            if self.tp is not None:
                self.tp.wait_ready()
        except BaseException:
            if self.tp is not None:
                self.tp.close()
            raise
        self.shard = shard
        self.backend = shard.backend
        self.dtype = self.backend.dtype
        self.max_model_len = shard.max_model_len
        src, hf_config = shard.src, shard.hf_config
        self.tokenizer = Tokenizer.load(src, hf_config)
        self.model_path = src.path
        # structured_outputs: grammars compiled for this tokenizer (on first use).
        self.grammars = GrammarCompiler(self.tokenizer.hf, self.tokenizer.eos_token_ids, shard.model.arch.vocab_size,
                                        cache_size=config.structured.grammar_cache_size,
                                        compile_timeout_s=config.structured.grammar_compile_timeout_s)
        # A thinking model's format: its grammars wait for the end of the thinking.
        self.reasoning = (resolve_reasoning(config.structured.reasoning_parser, self.tokenizer)
                          if config.structured.reasoning_parser else None)
        self.runner = shard.runner
        self.runner.set_grammar_mask_width(self.grammars.mask_width)
        self.runner.tp = self.tp
        self.offload_store = self._offload_store()
        self.runner.offload = self.offload_store
        self.kv = self._kv_manager()
        # LoRA adapters (lora/): their slots on the model's layers, and those named at start.
        self.lora = None
        if config.lora.enabled:
            from sluice.lora.slots import LoRAManager
            self.lora = LoRAManager(shard.model, self.backend, config.lora.max_loras, config.lora.max_lora_rank)
            for name, path in config.lora.lora_modules.items():
                self.lora.add(self.lora.read(name, path))
            self.runner.lora = self.lora
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, speculator=self._speculator(),
                                   max_loras=config.lora.max_loras if self.lora is not None else None)
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler)
        self.timings = StepTimings(runner=self.runner.timings)
        # Weight updates (update_weights): the version responses report; sleep(): the KV
        # cache is freed.
        self.weight_version = "0"
        self.num_weight_updates = 0
        self.asleep = False
        # Asynchronous scheduling: the step launched and not yet collected, and outputs of a
        # step collected between two calls of step() (a drain), which the next one returns.
        self.overlap = bool(config.scheduler.async_scheduling) and self.tp is None
        self._inflight: Launched | None = None
        self._stashed: list[RequestOutput] = []
        self.weight_bytes = weight_bytes(self.shard.model)
        file_bytes = gguf_tensor_bytes(src.path) if src.is_gguf else None
        logger.info("loaded %s (%s) in %.1fs; weights %.0f MB in memory%s%s", src.path, self.dtype,
                    time.perf_counter() - t0, self.weight_bytes / 1e6,
                    f" (the file's tensors: {file_bytes / 1e6:.0f} MB)" if file_bytes else "",
                    "; asynchronous scheduling" if self.overlap else "")
        forget_gguf_files()

    def _offload_store(self) -> OffloadStore | None:
        """KV offloading's host (and disk) tiers, sized from the cache settings; None: off."""
        c = self.config.cache
        if not c.kv_offload_memory > 0:
            return None
        tensors = self.runner.kv_tensors
        compress = offload_compresses(c.kv_offload_dtype, tensors[0][0].dtype, self.config.model.deterministic)
        per_block = offload_block_bytes(tensors, compress)
        host = max(1, int(c.kv_offload_memory * 2**30) // per_block)
        disk = int(c.kv_offload_disk_size * 2**30) // per_block if c.kv_offload_dir else 0
        store = OffloadStore(tensors, host, compress, c.kv_offload_dir, disk)
        logger.info("KV offloading: %d blocks in host memory (%.2f GiB)%s, %s", host, host * per_block / 2**30,
                    f", {disk} on disk in {c.kv_offload_dir} ({disk * per_block / 2**30:.2f} GiB)"
                    if store.disk_ok else "", "int8-compressed" if compress else "exact")
        return store

    def _kv_manager(self) -> KVCacheManager:
        store = self.offload_store
        index = None
        if store is not None:
            index = OffloadIndex(store.host.shape[0], len(store.crc) if store.disk_ok else 0, store.block_bytes,
                                 self.config.cache.block_size)
        return KVCacheManager(self.runner.num_blocks, self.config.cache.block_size,
                              enable_caching=self.config.cache.enable_prefix_caching,
                              windows=self.runner.layout.windows, offload=index)

    def _observe_offload(self) -> None:
        """The store's measured copy times to the index's cost model; a failed disk tier off."""
        store, index = self.offload_store, self.kv.offload
        if store is None or index is None:
            return
        for kind, (seconds, blocks) in store.take_timings().items():
            if kind in ("load", "load_disk"):
                index.observe_loads("host" if kind == "load" else "disk", seconds, int(blocks))
        if index.disk is not None and not store.disk_ok:
            index.disable_disk()

    def _speculator(self) -> Speculator | None:
        sp = self.config.speculative
        return Speculator(sp, self.max_model_len) if sp.speculative_method is not None else None

    @classmethod
    def from_kwargs(cls, **kwargs) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(**kwargs))

    # -- requests -------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    session_id: str | None = None, tenant: str | None = None, priority: int = 0,
                    lora: str | None = None) -> list[int]:
        """Queue a request (n samples of it). Raises ValueError if it can never run.
        Returns the prompt's token ids. Requests share cached prefix blocks only with
        requests of the same cache_salt (one per tenant, say).

        session_id: the agent program this call belongs to; its KV stays pinned after the
        call for the session's next one (core/sessions.py). Sessions are namespaced by
        tenant: the same id under another tenant is another session. tenant: who the
        request is served for (the `fair` policy's unit; default one shared tenant).
        priority: lower first under the `priority` policy (an integer >= 0). lora: the name
        of a loaded LoRA adapter to run it with (None: the base model)."""
        params = params or SamplingParams()
        if self.asleep:
            raise EngineAsleepError("the engine is asleep (its KV cache is freed); wake_up() first")
        check_scheduling_fields(session_id, tenant, priority)
        if request_id in self.outputs.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, ids = prompt, (self.tokenizer.encode(prompt) if prompt else [])
        else:
            text, ids = None, list(prompt)
        max_tokens, adapter = self.check_request(ids, params, lora)
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
                                    session_id=session_id, tenant=tenant or "", priority=priority,
                                    lora=adapter))
            if params.n > 1:
                children[-1].siblings = children
            if grammar is not None:
                own = grammar if i == 0 else grammar.copy()
                if self.reasoning is not None and not self.reasoning.ended_in_prompt(ids):
                    # The grammar applies to the answer: held until the thinking's end tag is sampled.
                    children[-1].held_grammar, children[-1].grammar_after = own, self.reasoning.end_id
                else:
                    children[-1].grammar = own
        self.outputs.add(request_id, text, ids, children)
        for child in children:
            self.scheduler.add_request(child)
        return ids

    def check_request(self, ids: list[int], params: SamplingParams, lora: str | None = None):
        """Every check of a request that needs the model (its vocabulary, context length,
        KV capacity, adapters) but no engine state, so the server runs it before admission
        (a bad request is a 400 at any load) and add_request again. Returns the resolved
        max_tokens and the adapter; ValueError naming what is wrong."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        adapter = self.lora_adapter(lora)
        return self.request_checks().check(ids, params), adapter

    def request_checks(self) -> RequestChecks:
        """What check_request checks against, as a value (the API server of an engine-core
        process runs the same checks in its own process)."""
        return RequestChecks(self.runner.vocab_size, frozenset(self.tokenizer.eos_token_ids), self.max_model_len,
                             self.kv.capacity_tokens(self.config.scheduler.max_num_batched_tokens, self.max_model_len),
                             self.kv.num_blocks,
                             None if self.lora is None else frozenset(self.lora.adapters))

    # -- LoRA adapters ----------------------------------------------------------
    def lora_adapter(self, name: str | None):
        """The loaded adapter of that name (None: the base model); ValueError if unknown."""
        if name is None:
            return None
        if not isinstance(name, str):
            raise ValueError(f"lora must be an adapter's name, got {type(name).__name__}")
        if self.lora is None:
            raise ValueError(f"LoRA adapter {name!r} asked for, but this engine serves none "
                             "(start it with lora_modules or enable_lora)")
        return self.lora.get(name)

    def lora_names(self) -> dict[str, str]:
        """The loaded adapters: name -> the folder it was read from."""
        return {} if self.lora is None else {n: a.path for n, a in self.lora.adapters.items()}

    def load_lora(self, adapter) -> None:
        """Serve an adapter read by read_lora (ValueError if its name is taken)."""
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters (start it with enable_lora)")
        self.lora.add(adapter)

    def read_lora(self, name: str, path: str):
        """An adapter folder read and checked against this model (touches no engine state,
        so the server runs it off the engine thread)."""
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters (start it with enable_lora)")
        return self.lora.read(name, path)

    def unload_lora(self, name: str) -> None:
        """Stop serving an adapter: new requests cannot name it, those running finish with
        it. ValueError if no adapter has that name."""
        if self.lora is None or name not in self.lora.adapters:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        self.lora.remove(name)

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
        self._drain()  # (blocks a step in flight fills are named when its tokens arrive)
        return self.scheduler.reset_prefix_cache()

    # -- weights, sleep ------------------------------------------------------
    def check_weights(self, weights) -> list[tuple[str, torch.Tensor]]:
        """A weight update's tensors, checked whole before anything changes: each must be
        a checkpoint tensor this model takes (Hugging Face names), with the checkpoint's
        shape and a floating-point dtype, and named once. Returns them in the model's
        dtype, as loading converts them; ValueError naming the first bad one."""
        items = list(weights.items()) if isinstance(weights, dict) else list(weights)
        model = self.shard.model
        out, seen = [], set()
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise ValueError("weights must be (name, tensor) pairs or a dict of them")
            name, tensor = item
            if name in seen:
                raise ValueError(f"weight {name!r} is given twice")
            seen.add(name)
            try:
                slot = model.weight_slot(name)
            except ValueError:
                raise ValueError(f"weight {name!r} has no place in this model (checkpoint names, e.g. "
                                 f"{next(iter(model.weight_slots()))!r})") from None
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"weight {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
            if not tensor.dtype.is_floating_point:
                raise ValueError(f"weight {name!r} has dtype {str(tensor.dtype).removeprefix('torch.')}; a "
                                 f"floating-point dtype is needed (converted to the model's "
                                 f"{str(self.dtype).removeprefix('torch.')})")
            if slot is None:
                continue  # a tensor loading skips as well (a tied head's copy, rotary tables)
            if tuple(tensor.shape) != slot.shape:
                raise ValueError(f"weight {name!r} has shape {list(tensor.shape)}, this model's is {list(slot.shape)}")
            out.append((name, tensor.detach().to(device=self.device, dtype=self.dtype)))
        if not out:
            raise ValueError("a weight update needs at least one tensor")
        return out

    def update_weights(self, weights, weight_version: str | None = None) -> int:
        """Replace some or all of the model's weights (name -> tensor, Hugging Face names,
        as a trainer's state_dict has them; a dict or (name, tensor) pairs). Everything is
        checked before anything changes (check_weights); quantized layers are quantized by
        the same method as at load. Requests in flight are preempted and continue on the
        new weights: their prompt and the tokens they have are recomputed; the prefix cache
        and session pins, computed with the old weights, are dropped. Call it between
        steps. Returns how many tensors changed."""
        scheme = quantization.get(self.config.model.quantization)
        if scheme is not None and not scheme.takes_updates:
            raise ValueError(f"quantization={scheme.name!r} keeps no dequantized weights to update; serve with "
                             "--quantization w4a8, w8a8, int8 or none to take weight updates")
        named = self.check_weights(weights)
        if weight_version is not None and (not isinstance(weight_version, str) or not weight_version):
            raise ValueError("weight_version must be a non-empty string")
        t0 = time.perf_counter()
        self._drain()
        self.scheduler.preempt_all()
        if self.tp is not None:  # first: applying them meets the other ranks (quantization's scales)
            self.tp.send(("update",))
            self.tp.group.broadcast_tensors(named)
        self.shard.apply_weights(named)
        if self.lora is not None:  # the backend rebuilt its whole-step path: give it the adapters' slots again
            self.lora.attach_fast()
        self.reset_prefix_cache()
        self.num_weight_updates += 1
        self.weight_version = weight_version or str(self.num_weight_updates)
        logger.info("weights updated: %d tensor(s) in %.2f s, version %s", len(named), time.perf_counter() - t0,
                    self.weight_version)
        return len(named)

    def load_weights(self, path: str | Path, weight_version: str | None = None) -> int:
        """update_weights from a checkpoint on disk (read_weights)."""
        return self.update_weights(read_weights(path, self.dtype), weight_version)

    def sleep(self) -> int:
        """Free the KV cache (its memory goes back to the system) until wake_up(), e.g.
        between the rollout phases of a training loop; the weights stay. Only when no
        request is in flight (EngineBusyError); requests added while asleep are refused
        (EngineAsleepError). Returns the bytes freed."""
        self._drain()
        if self.scheduler.has_unfinished_requests():
            raise EngineBusyError(f"{len(self.scheduler.requests)} request(s) in flight; sleep when the engine is idle")
        if self.asleep:
            return 0
        self.reset_prefix_cache()
        freed = self.runner.free_kv()
        if self.tp is not None:
            self.tp.send(("sleep",))
        self.asleep = True
        logger.info("asleep: the KV cache (%.2f GiB) is freed", freed / 2**30)
        return freed

    def wake_up(self) -> None:
        """Allocate the KV cache again after sleep()."""
        if not self.asleep:
            return
        self.runner.allocate_kv()
        if self.tp is not None:
            self.tp.send(("wake",))
        self.asleep = False
        logger.info("awake: the KV cache is back")

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, and remove the KV offload file if any."""
        if self.offload_store is not None:
            self.offload_store.close()
        if self.tp is not None:
            self.tp.close()

    def release_session(self, session_id: str, tenant: str | None = None) -> int | None:
        """Drop a session's pinned KV blocks now; returns how many it held, None if this
        tenant has no such session."""
        check_scheduling_fields(session_id, tenant, 0)
        return self.scheduler.release_session(tenant or "", session_id)

    def session_tool_called(self, session_id: str, names: list[str], tenant: str | None = None) -> bool:
        """A session's call that just ended called these tools: the time its KV stays
        pinned follows how long they have taken before (per tool name and tenant).
        Returns False if the tenant has no such session."""
        check_scheduling_fields(session_id, tenant, 0)
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"names must be a list of tool names, got {names!r}")
        return self.scheduler.session_tool_called(tenant or "", session_id, names)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or self.outputs.has_pending()
                or self._inflight is not None or bool(self._stashed))

    def reset(self) -> None:
        """Forget every request and cached block, keeping the model and the KV tensors:
        the state a fresh engine starts from, in milliseconds. For recovery after a failure
        that may have left the queues inconsistent (the caller ends the dropped requests'
        streams)."""
        self.kv = self._kv_manager()
        self.scheduler = Scheduler(self.config.scheduler, self.kv, self.max_model_len, speculator=self._speculator(),
                                   max_loras=self.config.lora.max_loras if self.lora is not None else None)
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler)
        self._inflight, self._stashed = None, []

    # -- one step -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step: the outputs of the requests it advanced (with asynchronous
        scheduling: of the step before it, and of any step collected in between)."""
        if self.overlap:
            return self._step_overlapped()
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
            if plan.kv_transfers:
                self._observe_offload()
            update = self.scheduler.update(plan, result)
            outputs = self.outputs.process(update)
        except Exception as e:
            if self.tp is not None and self.tp.dead():
                # Without a rank no step can run: say so, rather than fail every step after.
                raise EngineFatalError(f"tensor-parallel rank(s) {', '.join(self.tp.dead())} exited; the engine "
                                       f"cannot run without them") from e
            # One failed step must not stop the engine: its requests end with an error and
            # the rest (waiting, or not in this step) go on. Nothing they computed this step
            # was counted, so none of its blocks stay named in the prefix cache.
            return self._fail_step(plan, e)
        for out in outputs:
            out.weight_version = self.weight_version
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

    # -- asynchronous scheduling ----------------------------------------------
    def _step_overlapped(self) -> list[RequestOutput]:
        t = self.timings
        outputs, self._stashed = self._stashed, []
        prev, self._inflight = self._inflight, None
        if prev is not None and self._needs_host(prev.plan):
            outputs += self._collect(prev)
            prev = None
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if self.scheduler.last_decisions:
            logger.debug("step %d: %s", t.steps, "; ".join(self.scheduler.last_decisions))
        t1 = time.perf_counter()
        launched = None
        # A plan with drafts is collected at once: how many tokens its verification keeps
        # is known only from its result, and the next plan depends on it.
        advance = not any(e.draft_token_ids for e in plan.scheduled)
        if not plan.is_empty:
            if advance:
                self.scheduler.advance(plan)
            try:
                launched = self.runner.launch(plan, prev)
                if plan.kv_transfers:
                    self._observe_offload()
            except Exception as e:
                if prev is not None:
                    outputs += self._collect(prev)  # computed before this step: its tokens stand
                    prev = None
                outputs += self._fail_step(plan, e, advanced=advance)
        t2 = time.perf_counter()
        if prev is not None:
            outputs += self._collect(prev, also=launched.plan if launched is not None and advance else None)
        if launched is not None:
            if advance:
                self._inflight = launched
            else:
                outputs += self._collect(launched, advanced=False)
        t3 = time.perf_counter()
        for out in outputs:
            out.weight_version = self.weight_version
        if launched is not None:
            self.scheduler.observe_step(plan, t3 - t0)
        t.steps += 1
        t.schedule += t1 - t0
        t.execute += t2 - t1
        t.update_and_output += t3 - t2
        return outputs

    def _needs_host(self, plan) -> bool:
        """Whether the step after this one needs this one's tokens on the host: a request
        it samples for has a grammar (the next mask follows from the token) or penalties
        (counts over the output), or the next step may draft (drafts are looked up in
        the tokens)."""
        if plan.reloads:
            return True  # a reload may fail, and its requests are recomputed before they go on
        sampled = [e for e in plan.scheduled if e.needs_logits]
        if any(e.grammar is not None or e.params.has_penalties for e in sampled):
            return True
        if self.reasoning is not None and any(getattr(self.scheduler.requests.get(e.request_id), "held_grammar", None)
                                              is not None for e in sampled):
            return True  # its grammar may start with this step's token
        spec = self.scheduler.spec
        return spec is not None and bool(sampled) and spec.may_draft(len(sampled))

    def _collect(self, launched: Launched, advanced: bool = True, also=None) -> list[RequestOutput]:
        """A launched step's tokens to the host, the scheduler and the outputs. also: the
        plan launched after it (advanced too), whose share of requests that fail here
        was never computed either (its inputs were this step's)."""
        plan = launched.plan
        try:
            result = self.runner.collect(launched)
            update = self.scheduler.update(plan, result, advanced=advanced)
            return self.outputs.process(update)
        except Exception as e:
            if also is not None:
                self.scheduler.unadvance(also, {c for p in self.outputs.parents_of(x.request_id for x in plan.scheduled)
                                                for c in self.outputs.children_of(p)})
            return self._fail_step(plan, e, advanced=advanced)

    def _drain(self) -> None:
        """Collect the step in flight, if any (before an operation that needs the requests'
        state whole); its outputs go out with the next step()."""
        if self._inflight is not None:
            launched, self._inflight = self._inflight, None
            outs = self._collect(launched)
            for out in outs:
                out.weight_version = self.weight_version
            self._stashed += outs

    def _fail_step(self, plan, error: Exception, advanced: bool = False) -> list[RequestOutput]:
        if advanced:
            # Its tokens were counted as computed when it was launched: they were not.
            self.scheduler.unadvance(plan)
        if plan.kv_transfers and self.kv.offload is not None:
            # Which of its copies ran is unknown: no reloaded block keeps its name, and the
            # tiers forget what they hold (a slot a save never reached holds other bytes).
            for kind, _, dst, _ in plan.kv_transfers:
                if kind in ("load", "load_disk"):
                    self.kv.failed_load(dst)
            self.kv.offload.clear()
        parents = self.outputs.parents_of(e.request_id for e in plan.scheduled)
        logger.exception("an engine step failed (%s); ending its %d request(s) with an error, the engine "
                         "goes on", type(error).__name__, len(parents))
        for pid in parents:
            for cid in self.outputs.children_of(pid):
                self.scheduler.finish_request(cid, RequestStatus.FINISHED_ERROR)
        message = (f"the engine step running this request failed ({type(error).__name__}); the request was "
                   f"ended and the server goes on serving others (details in the server log)")
        return self.outputs.fail(parents, message)
