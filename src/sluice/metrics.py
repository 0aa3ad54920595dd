"""Prometheus metrics of the engine and the server, on a registry of their own."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
            3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


# Per-tenant series: the first MAX_TENANT_LABELS tenants seen get a label of their own,
# later ones share "other", so a client inventing `user` values cannot grow /metrics
# without bound. The shared tenant ("") is "default".
MAX_TENANT_LABELS = 32


def _delta(count: int, seen: int) -> int:
    """New events of a count last seen at `seen` (all of it if the count restarted)."""
    return count - seen if count >= seen else count


@dataclass
class Recent:
    """The last steps and requests, for the dashboard: a few appends per step and per
    finished request, read by the page's event stream a few times a second."""
    steps: deque = field(default_factory=lambda: deque(maxlen=240))  # (prompt, decode, drafted, accepted, ms)
    ttft: deque = field(default_factory=lambda: deque(maxlen=512))
    tpot: deque = field(default_factory=lambda: deque(maxlen=512))
    tenant_tokens: dict = field(default_factory=dict)                # tenant -> prompt + output tokens
    finished: int = 0
    accepted_seen: int = 0


class Metrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name
        self.running = Gauge("sluice_num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge("sluice_num_requests_waiting", "Requests waiting to be admitted", labels, registry=r)
        self.kv_usage = Gauge("sluice_kv_cache_usage_ratio", "Fraction of KV blocks in use", labels, registry=r)
        self.kv_blocks_used = Gauge("sluice_kv_cache_blocks_used", "KV blocks in use", labels, registry=r)
        self.kv_blocks_total = Gauge("sluice_kv_cache_blocks_total", "KV blocks in the pool", labels, registry=r)
        self.kv_blocks_by_kind = Gauge("sluice_kv_cache_blocks_used_by_layer_kind",
                                       "KV blocks in use by layer kind (full attention, or sliding<window>: "
                                       "those give back blocks behind their window)", labels + ["layer_kind"],
                                       registry=r)
        self.preemptions = Counter("sluice_num_preemptions", "Requests preempted (recomputed later)", labels, registry=r)
        self.stall_resumptions = Counter("sluice_num_stall_resumptions",
                                         "Preempted streams brought back by --max-stream-stall", labels, registry=r)
        self.prompt_tokens = Counter("sluice_prompt_tokens", "Prompt tokens of admitted requests", labels, registry=r)
        self.generation_tokens = Counter("sluice_generation_tokens", "Generated tokens", labels, registry=r)
        self.requests = Counter("sluice_requests_finished", "Finished requests by reason", labels + ["finished_reason"], registry=r)
        self.steps = Counter("sluice_engine_steps", "Engine steps", labels, registry=r)
        self.step_seconds = Histogram("sluice_engine_step_seconds", "Wall time of one engine step", labels,
                                      buckets=_LATENCY, registry=r)
        self.ttft = Histogram("sluice_time_to_first_token_seconds", "Arrival to first token", labels,
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram("sluice_time_per_output_token_seconds", "Mean time between output tokens", labels,
                              buckets=_LATENCY, registry=r)
        self.e2e = Histogram("sluice_e2e_request_latency_seconds", "Arrival to finish", labels,
                             buckets=_LATENCY, registry=r)
        self.queue_time = Histogram("sluice_request_queue_time_seconds", "Arrival to first scheduled", labels,
                                    buckets=_LATENCY, registry=r)
        self.prefix_queries = Counter("sluice_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels, registry=r)
        self.prefix_hits = Counter("sluice_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   labels, registry=r)
        self.prefix_hit_rate = Gauge("sluice_prefix_cache_hit_rate", "Hits / queries since start, in tokens",
                                     labels, registry=r)
        self.cached_blocks = Gauge("sluice_prefix_cache_blocks", "KV blocks holding a cached prefix",
                                   labels, registry=r)
        kl = labels + ["tier"]
        self.offload_blocks = Gauge("sluice_kv_offload_blocks", "KV blocks held by an offload tier (host, disk)",
                                    kl, registry=r)
        self.offload_bytes = Gauge("sluice_kv_offload_bytes", "Bytes of the KV blocks an offload tier holds", kl,
                                   registry=r)
        self.offload_events = Counter("sluice_kv_offload_blocks_moved", "KV blocks per offload tier: saved (written "
                                      "to it), hit (copied back instead of recomputed), dropped (lost past its "
                                      "bound or to a failed reload), failed (a reload whose bytes were corrupt "
                                      "or unreadable)", kl + ["event"], registry=r)
        self.offload_reload_seconds = Counter("sluice_kv_offload_reload_seconds", "Seconds spent copying "
                                              "offloaded KV blocks back", labels, registry=r)
        self.offload_recompute_saved = Counter("sluice_kv_offload_recompute_seconds_saved", "Estimated seconds "
                                               "the reloaded blocks would have taken to recompute (measured "
                                               "prefill cost per token)", labels, registry=r)
        self._offload_seen: dict = {}
        tl = labels + ["tenant"]
        self.tenant_requests = Counter("sluice_tenant_requests_finished", "Finished requests per tenant", tl,
                                       registry=r)
        self.tenant_prompt_tokens = Counter("sluice_tenant_prompt_tokens", "Prompt tokens per tenant", tl, registry=r)
        self.tenant_generation_tokens = Counter("sluice_tenant_generation_tokens", "Generated tokens per tenant", tl,
                                                registry=r)
        self.tenant_ttft = Histogram("sluice_tenant_time_to_first_token_seconds", "Arrival to first token, per tenant",
                                     tl, buckets=_LATENCY, registry=r)
        self.tenant_e2e = Histogram("sluice_tenant_e2e_request_latency_seconds", "Arrival to finish, per tenant", tl,
                                    buckets=_LATENCY, registry=r)
        self.tenant_queue = Histogram("sluice_tenant_request_queue_time_seconds", "Arrival to first scheduled, "
                                      "per tenant", tl, buckets=_LATENCY, registry=r)
        self.tenant_rate_limited = Counter("sluice_tenant_rate_limited", "Requests refused by a tenant's rate "
                                           "limits (429), by limit: requests, tokens, concurrency",
                                           tl + ["limit"], registry=r)
        # The tenants' rate limiter (entrypoints/openai/quotas.py), whose refusals are
        # counted at each scrape; None: no limits.
        self.quotas = None
        self._refused_seen: dict = {}
        self.pinned_blocks = Gauge("sluice_session_pinned_blocks", "KV blocks pinned for sessions between calls",
                                   labels, registry=r)
        self.sessions = Gauge("sluice_sessions", "Sessions remembered", labels, registry=r)
        self.session_events = Counter("sluice_session_events", "Session pins and their ends: pinned (a call ended "
                                      "and pinned its KV), hit (a call found its pin), expired (TTL), released "
                                      "(DELETE), evicted_for_cap, evicted_for_room (a running request needed the "
                                      "blocks), held_at_door (a new program waited at the program policy's door)",
                                      labels + ["event"], registry=r)
        self.tpot_target = Gauge("sluice_tpot_target_seconds", "The step-time target (--target-tpot-ms), 0: none",
                                 labels, registry=r)
        self.tpot_target_misses = Counter("sluice_tpot_target_misses", "Steps with decodes that took longer than "
                                          "the target", labels, registry=r)
        self.tpot_target_steps = Counter("sluice_tpot_target_decode_steps", "Steps with decodes, under a target",
                                         labels, registry=r)
        self.step_budget = Gauge("sluice_step_token_budget", "Token budget of the last step", labels, registry=r)
        self.grammar_rows = Counter("sluice_grammar_rows", "Rows sampled under a grammar (structured outputs)",
                                    labels, registry=r)
        self.grammar_fill = Counter("sluice_grammar_mask_fill_seconds", "Seconds spent filling token masks, on the "
                                    "mask thread beside the forward pass", labels, registry=r)
        self.grammar_wait = Counter("sluice_grammar_mask_wait_seconds", "Seconds steps waited for their token masks "
                                    "after the forward pass", labels, registry=r)
        self.grammar_compiles = Counter("sluice_grammar_compiles", "Grammars compiled (cache misses)", labels,
                                        registry=r)
        self.grammar_compile_seconds = Counter("sluice_grammar_compile_seconds", "Seconds spent compiling grammars",
                                               labels, registry=r)
        self.spec_tokens = Counter("sluice_spec_decode_tokens", "Speculative decoding: draft tokens verified "
                                   "(drafted), of them accepted, and tokens emitted by verifying requests "
                                   "(accepted + 1 per verification)", labels + ["kind"], registry=r)
        self.spec_steps = Counter("sluice_spec_decode_steps", "Engine steps that verified drafts", labels, registry=r)
        self.spec_at = Counter("sluice_spec_decode_position_tokens", "Speculative decoding by draft position "
                               "(0 = the first): drafted and accepted there", labels + ["position", "kind"],
                               registry=r)
        self.spec_rate = Gauge("sluice_spec_decode_acceptance_rate", "Accepted / drafted since start", labels,
                               registry=r)
        self.weight_updates = Counter("sluice_weight_updates", "Weight updates applied (POST /v1/weights/update)",
                                      labels, registry=r)
        self.weight_version = Gauge("sluice_weight_version_info", "The weights the engine runs: 1 for the current "
                                    "weight_version", labels + ["version"], registry=r)
        self.asleep = Gauge("sluice_engine_asleep", "1 while the KV cache is freed (POST /sleep)", labels, registry=r)
        self.weight_bytes = Gauge("sluice_weight_bytes", "Bytes of the weights in memory (packed and quantized "
                                  "forms included, each once; the KV cache apart)", labels, registry=r)
        self.lora_loaded = Gauge("sluice_lora_adapters_loaded", "LoRA adapters served (in host memory)", labels,
                                 registry=r)
        self.lora_resident = Gauge("sluice_lora_adapters_resident", "LoRA adapters in a slot of the layers "
                                   "(--max-loras at most)", labels, registry=r)
        self.lora_running = Gauge("sluice_lora_requests_running", "Running requests with a LoRA adapter", labels,
                                  registry=r)
        self.lora_slot_loads = Counter("sluice_lora_slot_loads", "LoRA adapters copied into a slot (a step needed "
                                       "one that was not resident)", labels, registry=r)
        self._lora_loads_seen = 0
        # What the dashboard shows (entrypoints/openai/dashboard.py), kept as plain values.
        self.recent = Recent()
        self._weights_seen: tuple = ()
        self._weight_bytes_seen = None
        self.set_weights("0", 0, False)
        self._spec_seen: dict = {}
        self._grammar_seen = (0, 0.0, 0.0, 0, 0.0)
        for c in (self.grammar_rows, self.grammar_fill, self.grammar_wait, self.grammar_compiles,
                  self.grammar_compile_seconds):
            c.labels(self.model_name)  # listed at 0 from the start, though updated only when they move
        self._misses_seen = 0
        self._decode_steps_seen = 0
        self._tenant_labels: set[str] = set()
        self._session_seen: dict[str, int] = {}
        self._preemptions_seen = 0
        self._stall_resumptions_seen = 0
        self._queries_seen = 0
        self._hits_seen = 0

    def tenant_label(self, tenant: str) -> str:
        if tenant in self._tenant_labels:
            return tenant or "default"
        if len(self._tenant_labels) < MAX_TENANT_LABELS:
            self._tenant_labels.add(tenant)
            return tenant or "default"
        return "other"

    def observe_step(self, engine, outputs, seconds: float) -> None:
        """Called by the engine thread after every step."""
        m = self.model_name
        sched, kv = engine.scheduler, engine.kv
        prompt, decode, drafted, _ = sched.last_mix
        accepted = sched.spec.stats.accepted if sched.spec is not None else 0
        self.recent.steps.append((prompt, decode, drafted, accepted - self.recent.accepted_seen, 1e3 * seconds))
        self.recent.accepted_seen = accepted
        self.running.labels(m).set(sched.num_running)
        self.waiting.labels(m).set(sched.num_waiting)
        self.kv_usage.labels(m).set(kv.usage())
        self.kv_blocks_used.labels(m).set(kv.num_blocks - kv.num_free_blocks)
        self.kv_blocks_total.labels(m).set(kv.num_blocks)
        used = kv.blocks_by_group()
        for kind, groups in engine.runner.layout.kinds().items():
            self.kv_blocks_by_kind.labels(m, kind).set(sum(used[g] for g in groups))
        # The engine's own counts restart from 0 if it is reset after a failure.
        self.preemptions.labels(m).inc(_delta(sched.num_preemptions, self._preemptions_seen))
        self.stall_resumptions.labels(m).inc(_delta(sched.num_stall_resumptions, self._stall_resumptions_seen))
        self.prefix_queries.labels(m).inc(_delta(kv.query_tokens, self._queries_seen))
        self.prefix_hits.labels(m).inc(_delta(kv.hit_tokens, self._hits_seen))
        self._preemptions_seen, self._stall_resumptions_seen, self._queries_seen, self._hits_seen = (
            sched.num_preemptions, sched.num_stall_resumptions, kv.query_tokens, kv.hit_tokens)
        self.prefix_hit_rate.labels(m).set(kv.hit_tokens / kv.query_tokens if kv.query_tokens else 0.0)
        self.cached_blocks.labels(m).set(kv.num_cached_blocks)
        if kv.offload is not None:
            self._observe_offload(kv.offload)
        self.step_budget.labels(m).set(sched.last_budget)
        sm = sched.step_model
        self.tpot_target.labels(m).set(sm.target_s if sm is not None else 0.0)
        if sm is not None:
            self.tpot_target_misses.labels(m).inc(_delta(sm.misses, self._misses_seen))
            self.tpot_target_steps.labels(m).inc(_delta(sm.decode_steps, self._decode_steps_seen))
            self._misses_seen, self._decode_steps_seen = sm.misses, sm.decode_steps
        st = sched.sessions.stats
        self.pinned_blocks.labels(m).set(sched.sessions.num_pinned)
        self.sessions.labels(m).set(len(sched.sessions.sessions))
        for event, count in (("pinned", st.pinned_calls), ("hit", st.hits), ("expired", st.expired),
                             ("released", st.released), ("evicted_for_cap", st.evicted_for_cap),
                             ("evicted_for_room", st.evicted_for_room), ("held_at_door", st.held_at_door)):
            self.session_events.labels(m, event).inc(_delta(count, self._session_seen.get(event, 0)))
            self._session_seen[event] = count
        masks, grammars = engine.runner.masks, engine.grammars
        now = (masks.rows, masks.fill_seconds, masks.wait_seconds, grammars.compiles, grammars.compile_seconds)
        if now != self._grammar_seen:  # most steps of most servers: no grammar, nothing to add
            for metric, value, seen in zip((self.grammar_rows, self.grammar_fill, self.grammar_wait,
                                            self.grammar_compiles, self.grammar_compile_seconds), now,
                                           self._grammar_seen):
                metric.labels(m).inc(_delta(value, seen))
            self._grammar_seen = now
        if sched.spec is not None:
            self._observe_spec(sched.spec.stats)
        lora = getattr(engine, "lora", None)
        if lora is not None:
            self.set_lora_loaded(len(lora.adapters))
            self.lora_resident.labels(m).set(lora.num_resident)
            self.lora_running.labels(m).set(sum(r.lora is not None for r in sched.running))
            self.lora_slot_loads.labels(m).inc(_delta(lora.loads, self._lora_loads_seen))
            self._lora_loads_seen = lora.loads
        self.set_weights(engine.weight_version, engine.num_weight_updates, engine.asleep)
        if engine.weight_bytes != self._weight_bytes_seen:  # set at load, changed by nothing since
            self.weight_bytes.labels(m).set(engine.weight_bytes)
            self._weight_bytes_seen = engine.weight_bytes
        self.steps.labels(m).inc()
        self.step_seconds.labels(m).observe(seconds)

    def _observe_offload(self, index) -> None:
        m, seen = self.model_name, self._offload_seen
        for tier in ("host", "disk"):
            t = index.host if tier == "host" else index.disk
            n = len(t.lru) if t is not None else 0
            self.offload_blocks.labels(m, tier).set(n)
            self.offload_bytes.labels(m, tier).set(n * index.block_bytes)
            if t is None:
                continue
            for event in ("saved", "hits", "dropped", "failed"):
                count = getattr(t.stats, event)
                name = "hit" if event == "hits" else event
                self.offload_events.labels(m, tier, name).inc(_delta(count, seen.get((tier, event), 0)))
                seen[(tier, event)] = count
        for metric, name, value in ((self.offload_reload_seconds, "reload", index.reload_seconds),
                                    (self.offload_recompute_saved, "saved_s", index.recompute_seconds_saved)):
            metric.labels(m).inc(max(0.0, _delta(value, seen.get(name, 0.0))))
            seen[name] = value

    def set_lora_loaded(self, n: int) -> None:
        """Adapters served (after each step, and from the load / unload routes, which may
        run while the engine is idle)."""
        self.lora_loaded.labels(self.model_name).set(n)

    def set_weights(self, version: str, updates: int, asleep: bool) -> None:
        """The engine's weight version, update count and sleep state (after each step, and
        from the weight routes, which run between steps)."""
        now = (version, updates, asleep)
        if now == self._weights_seen:
            return
        m = self.model_name
        seen_updates = self._weights_seen[1] if self._weights_seen else 0
        self.weight_updates.labels(m).inc(_delta(updates, seen_updates))
        self.weight_version.clear()  # one series: the current version's
        self.weight_version.labels(m, version).set(1)
        self.asleep.labels(m).set(1 if asleep else 0)
        self._weights_seen = now

    def _observe_spec(self, st) -> None:
        m, seen = self.model_name, self._spec_seen
        if seen.get("stats") is not st:  # a new engine (reset after a failure): counts restart
            seen.clear()
            seen["stats"] = st
        for kind, count in (("drafted", st.drafted), ("accepted", st.accepted), ("emitted", st.emitted)):
            self.spec_tokens.labels(m, kind).inc(count - seen.get(kind, 0))
            seen[kind] = count
        self.spec_steps.labels(m).inc(st.steps - seen.get("steps", 0))
        seen["steps"] = st.steps
        for pos, (d, a) in enumerate(zip(st.drafted_at, st.accepted_at)):
            for kind, count in (("drafted", d), ("accepted", a)):
                key = (pos, kind)
                if count != seen.get(key, 0):
                    self.spec_at.labels(m, str(pos), kind).inc(count - seen.get(key, 0))
                    seen[key] = count
        self.spec_rate.labels(m).set(st.accepted / st.drafted if st.drafted else 0.0)

    def observe_request(self, arrival: float, first_scheduled: float | None, first_token: float | None,
                        num_prompt: int, num_output: int, reason: str | None, tenant: str = "") -> None:
        """Called once per finished request (per sample for n > 1)."""
        m, now = self.model_name, time.monotonic()
        t = self.tenant_label(tenant)
        r = self.recent
        r.finished += 1
        r.tenant_tokens[t] = r.tenant_tokens.get(t, 0) + num_prompt + num_output
        if first_token is not None:
            r.ttft.append(first_token - arrival)
            if num_output > 1:
                r.tpot.append((now - first_token) / (num_output - 1))
        self.tenant_requests.labels(m, t).inc()
        self.tenant_prompt_tokens.labels(m, t).inc(num_prompt)
        self.tenant_generation_tokens.labels(m, t).inc(num_output)
        self.tenant_e2e.labels(m, t).observe(now - arrival)
        if first_token is not None:
            self.tenant_ttft.labels(m, t).observe(first_token - arrival)
        if first_scheduled is not None:
            self.tenant_queue.labels(m, t).observe(first_scheduled - arrival)
        self.prompt_tokens.labels(m).inc(num_prompt)
        self.generation_tokens.labels(m).inc(num_output)
        self.requests.labels(m, reason or "unknown").inc()
        self.e2e.labels(m).observe(now - arrival)
        if first_scheduled is not None:
            self.queue_time.labels(m).observe(first_scheduled - arrival)
        if first_token is not None:
            self.ttft.labels(m).observe(first_token - arrival)
            if num_output > 1:
                self.tpot.labels(m).observe((now - first_token) / (num_output - 1))

    def render(self) -> bytes:
        if self.quotas is not None:
            for (tenant, limit), n in self.quotas.refused().items():
                seen = self._refused_seen.get((tenant, limit), 0)
                if n > seen:
                    self.tenant_rate_limited.labels(self.model_name, self.tenant_label(tenant), limit).inc(n - seen)
                    self._refused_seen[(tenant, limit)] = n
        return generate_latest(self.registry)


def step_hook(metrics: Metrics):
    """The engine thread's per-step hook: engine gauges, and per-request latencies at finish."""
    def on_step(engine, outputs, seconds):
        metrics.observe_step(engine, outputs, seconds)
        for out in outputs:
            if out.finished and out.times is not None:
                for c in out.outputs:
                    metrics.observe_request(out.times.arrival, out.times.first_scheduled, out.times.first_token,
                                            len(out.prompt_token_ids), len(c.token_ids), c.finish_reason,
                                            out.tenant)
    return on_step
