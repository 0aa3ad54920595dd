"""Request: one sequence being generated. Plain Python state, no tensors."""
from __future__ import annotations

import enum
import gc
import time
from dataclasses import dataclass
from itertools import islice

from sluice.sampling_params import SamplingParams

# The longest session_id accepted (offline and on the server).
MAX_SESSION_ID_CHARS = 256


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"      # its engine step failed (RequestOutput.error says how)

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


# slots: a request for all of the vocabulary's logprobs makes one per token id per position
# (49,152 on SmolLM2): 14 -> 9 ms a position to build them.
@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int                       # 1 = the most likely token
    decoded_token: str | None = None


# A scored token's logprobs as the runner reads them (a sampled token, or a prompt
# token's next): (token ids, logprobs, rank of that token), the token first, then the top
# k in rank order (ranks 1..k).
LogprobRow = tuple[list[int], list[float], int]

# A position's dict for a request that asks for thousands of logprobs makes that many
# objects at once, and the cyclic collector, counting allocations, ran passes over the
# whole heap during each build: half of its time at 49,152. None of these objects can be
# in a cycle, so the collector waits while they are made.
PAUSE_GC_FROM = 1024


def logprob_dict(row: LogprobRow, texts: list[str]) -> dict[int, Logprob]:
    """One position's {token id: Logprob}, texts[j] naming row's token j. The scored
    token's key comes first; where it is in the top k too, that entry (the same values)
    is what it keeps."""
    ids, lps, rank = row
    out = {ids[0]: Logprob(lps[0], rank, texts[0])}
    if len(ids) > 1:
        pause = len(ids) > PAUSE_GC_FROM and gc.isenabled()
        if pause:
            gc.disable()
        try:
            out.update(zip(islice(ids, 1, None),
                           map(Logprob, islice(lps, 1, None), range(1, len(ids)), islice(texts, 1, None))))
        finally:
            if pause:
                gc.enable()
    return out


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: set[int], max_tokens: int, arrival_time: float | None = None,
                 cache_salt: str | None = None, share_key: str | None = None,
                 session_id: str | None = None, tenant: str = "", priority: int = 0, lora=None):
        self.request_id = request_id
        # Scheduling (core/sessions.py): the agent program this call belongs to, the
        # tenant it is served for (fair shares; also the namespace of its session id), and
        # its priority (lower first, under the `priority` policy).
        self.session_id = session_id
        self.tenant = tenant
        self.priority = priority
        self.session = None          # its core.sessions.Session, while queued or running
        self.served_tokens = 0       # tokens computed for it (its program's service, sessionless)
        # Prefix caching: blocks are only shared between requests with the same salt;
        # share_key (the parent id of n > 1 samples) lets siblings share with caching off.
        self.cache_salt = cache_salt
        # The LoRA adapter it runs with (lora/adapters.py LoRAAdapter), None: the base model.
        # Its prefix-cache blocks are the adapter's own.
        self.lora = lora
        self.share_key = share_key
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        # Resolved limit: params.max_tokens, or what the context length leaves.
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Asynchronous scheduling: tokens a step still in flight samples for it (0 or 1).
        # That step's tokens already count as computed, and the pending token is the next
        # step's input, which the runner takes from the in-flight step's output on the device.
        self.num_pending = 0
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # It ended on an EOS or stop token id, which is in its tokens but not its text.
        self.ended_by_token = False
        # Per output token: {token_id: Logprob} with the chosen token and the top-N, made
        # with their texts by the output processor from the runner's LogprobRow in the step
        # that sampled it.
        self.logprobs: list[dict[int, Logprob] | LogprobRow] | None = [] if params.logprobs is not None else None
        # Per prompt position: {token_id: Logprob} with the prompt token and the top-N, stored
        # by position (the first has none), so a recomputed chunk cannot add entries twice;
        # the runner's LogprobRow until the output processor makes it a dict.
        self.prompt_logprobs: list[dict[int, Logprob] | LogprobRow | None] | None = (
            [None] * len(self.prompt_token_ids) if params.prompt_logprobs is not None else None)
        # Logits positions 0 .. num_prompt_logprobs - 1 have been scored (always a prefix).
        self.num_prompt_logprobs = 0
        # structured_outputs: its structured.grammar.Grammar (parser state), else None.
        self.grammar = None
        # A thinking model's grammar waits here until token grammar_after (the end of its
        # reasoning) is sampled; then it becomes `grammar` (sluice/reasoning.py).
        self.held_grammar = None
        self.grammar_after: int | None = None
        # Speculative decoding: its recent drafted and accepted counts (decaying; spec/gate.py).
        self.spec_drafted = 0.0
        self.spec_accepted = 0.0
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        # The scheduler's clock at its last sampled token (None: none yet), and its output
        # count when it was last admitted: a request resumed after a preemption that has not
        # sampled since is not preempted again while others can give way (its stall would
        # only grow), and a stalled stream is resumed by how old its last token is.
        self.last_token_time: float | None = None
        self.outputs_at_admission = 0
        # The n > 1 children of one request, which its client reads as one stream: a token
        # of any of them is that stream's last token (None: it is alone).
        self.siblings: list[Request] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet: every prompt token must be
        run through the model, so no cached prefix may be read."""
        return self.prompt_logprobs is not None and self.num_prompt_logprobs < len(self.prompt_token_ids) - 1

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def is_finished(self) -> bool:
        return self.status.finished

    def check_stop(self, max_model_len: int) -> bool:
        """Token-level stop checks after appending one token. Stop strings are checked
        by the output processor, which sees the text."""
        last = self.output_token_ids[-1]
        n_out = len(self.output_token_ids)
        if n_out >= self.params.min_tokens:
            if not self.params.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.ended_by_token = True
                return True
            if last in self.params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                self.ended_by_token = True
                return True
        if self.grammar is not None and self.grammar.finished:
            # The output is complete (or its grammar broke): nothing but EOS could follow.
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if n_out >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
