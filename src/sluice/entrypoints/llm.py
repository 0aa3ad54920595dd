"""Offline API: LLM(model=...).generate(prompts, params) and LLM.chat(messages, params)."""
from __future__ import annotations

import itertools

from tqdm.auto import tqdm

from sluice.config import DEFAULT_MODEL
from sluice.engine.llm_engine import LLMEngine
from sluice.outputs import RequestOutput
from sluice.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Generate for many prompts at once; they share the engine's continuous batch."""

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "auto", **engine_kwargs):
        self.engine = LLMEngine.from_kwargs(model=model, dtype=dtype, **engine_kwargs)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | None = None, session_id: str | None = None,
                 priority: int = 0, tenant: str | None = None,
                 lora: str | list[str | None] | None = None) -> list[RequestOutput]:
        """One output per prompt, in prompt order. A prompt is a string or a list of token ids.
        session_id, priority, tenant: the scheduling fields of every prompt of this call
        (LLMEngine.add_request); with a session_id, the next call of the same session finds
        this call's prompt and output still cached. lora: a loaded LoRA adapter's name for
        every prompt, or one per prompt (None: the base model), mixed in one batch."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("prompts must be a string, a list of token ids, or a non-empty list of those")
        return self._run(prompts, sampling_params, use_tqdm, lora, session_id=session_id, priority=priority,
                         tenant=tenant)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool | None = None, session_id: str | None = None,
             priority: int = 0, tenant: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None,
             lora: str | list[str | None] | None = None) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and generate the reply.
        continue_final_message: continue the last (assistant) message instead of starting a
        new turn (add_generation_prompt=False with it); chat_template_kwargs: extra template
        variables, e.g. {"enable_thinking": False} for Qwen3 (vLLM's arguments)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(conv, add_generation_prompt=add_generation_prompt,
                                              continue_final_message=continue_final_message,
                                              chat_template_kwargs=chat_template_kwargs)
                   for conv in conversations]
        return self._run(prompts, sampling_params, use_tqdm, lora, session_id=session_id, priority=priority,
                         tenant=tenant)

    def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT LoRA adapter in folder `path` as `name` (the engine must have been
        built with enable_lora or lora_modules). ValueError naming what does not fit."""
        self.engine.load_lora(self.engine.read_lora(name, path))

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

    def update_weights(self, weights, weight_version: str | None = None) -> int:
        """Replace some or all of the model's weights: a dict (or pairs) of Hugging Face
        names to tensors, e.g. a trainer model's state_dict(). Checked whole first (a
        ValueError names the first bad tensor and nothing changes); quantized layers are
        requantized as at load; the prefix cache is reset. Returns how many tensors changed."""
        return self.engine.update_weights(weights, weight_version)

    def load_weights(self, path: str, weight_version: str | None = None) -> int:
        """update_weights from a .safetensors file, a folder of them or a .gguf file."""
        return self.engine.load_weights(path, weight_version)

    @property
    def weight_version(self) -> str:
        """"0" as loaded; after each update its weight_version, or the count of updates."""
        return self.engine.weight_version

    def sleep(self) -> int:
        """Free the KV cache until wake_up() (weights stay); returns the bytes freed."""
        return self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def release_session(self, session_id: str, tenant: str | None = None) -> int | None:
        """Drop a session's pinned KV now; returns how many blocks it held (None: unknown)."""
        return self.engine.release_session(session_id, tenant)

    def session_tool_called(self, session_id: str, names: list[str], tenant: str | None = None) -> bool:
        """The session's last call ended by calling these tools: its KV stays pinned for as
        long as they have taken before. False if the session is unknown."""
        return self.engine.session_tool_called(session_id, names, tenant)

    def _run(self, prompts: list[Prompt], sampling_params, use_tqdm, lora=None, **scheduling) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = _per_prompt(sampling_params, prompts, "SamplingParams")
        loras = _per_prompt(lora, prompts, "lora names")
        order: dict[str, int] = {}
        try:
            for i, (prompt, p, name) in enumerate(zip(prompts, params, loras)):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, prompt, p, lora=name, **scheduling)
                order[rid] = i
        except ValueError:
            for rid in order:
                self.engine.abort(rid)
            self._drain()
            raise
        results: list[RequestOutput | None] = [None] * len(prompts)
        show = use_tqdm if use_tqdm is not None else len(prompts) > 8
        with tqdm(total=len(prompts), desc="generating", disable=not show) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        return results

    def _drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()


def _per_prompt(value, prompts: list, what: str) -> list:
    """One value for every prompt, or a list of one per prompt."""
    if not isinstance(value, list):
        return [value] * len(prompts)
    if len(value) != len(prompts):
        raise ValueError(f"got {len(value)} {what} for {len(prompts)} prompts")
    return value
