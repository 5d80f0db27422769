"""A blocking front end over :class:`~ssd_eagle.engine.llm_engine.LLMEngine`, shaped like ``vllm.LLM``."""

from __future__ import annotations

import itertools
import weakref

from tqdm.auto import tqdm

from ssd_eagle.config import EngineConfig, SpeculativeConfig
from ssd_eagle.engine.factory import build
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.engine.sequence import RequestOutput
from ssd_eagle.sampling_params import SamplingParams


class LLM:
    """Load a target (and its drafter) and generate.

    Example::

        with LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 5}) as llm:
            out = llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(temperature=0, max_tokens=64))
        print(out[0].text, out[0].stats.tau)

    :meth:`close` (or leaving the ``with`` block) releases the engine's helpers: an SSD speculator process and its
    link. An engine the LLM built is also released when the LLM is garbage collected or the interpreter exits.

    Args:
        model, mode, speculative_config, dtype, device, max_model_len, max_num_seqs, seed, num_threads: see
            :class:`~ssd_eagle.config.EngineConfig`.
        engine: an already built engine (then the other arguments are ignored; it stays the caller's to close,
            or :meth:`close`'s).
    """

    def __init__(self, model: str | None = None, *, mode: str | None = None,
                 speculative_config: dict | SpeculativeConfig | None = None, dtype: str = "auto",
                 device: str = "cpu", max_model_len: int | None = None, max_num_seqs: int = 8, seed: int = 0,
                 num_threads: int | None = None, engine: LLMEngine | None = None, config: EngineConfig | None = None):
        if engine is None:
            if config is None:
                kwargs = {"model": model} if model else {}
                config = EngineConfig(**kwargs, mode=mode or ("sd" if speculative_config else "ar"),
                                      speculative_config=speculative_config, dtype=dtype, device=device,
                                      max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=seed,
                                      num_threads=num_threads)
            engine = build_engine(config)
            # at garbage collection or interpreter exit (weakref.finalize registers with atexit)
            self._release = weakref.finalize(self, engine.close)
        else:
            self._release = engine.close
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Release the engine's helpers (the SSD speculator process and its link). Idempotent."""
        self._release()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (text, or token ids) and return the finished outputs in prompt order.

        Raises:
            ValueError: a bad prompt or sampling parameters (nothing is left queued).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] \
            * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = f"gen-{next(self._ids)}"
                self.engine.add_request(rid, prompt, p)
                ids.append(rid)
        except ValueError:
            for rid in ids:
                self.engine.abort(rid)
            raise
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), disable=not use_tqdm, desc="generate")
        while len(finished) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [finished[rid] for rid in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Render each conversation with the tokenizer's chat template (generation prompt added) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [render_chat(self.tokenizer, conv) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)


def render_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation rendered by the tokenizer's chat template with the generation prompt.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; send a plain prompt instead")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return list(ids)


def build_engine(config: EngineConfig) -> LLMEngine:
    """The engine :class:`LLM`, ``inference.generate`` and ``inference.serve`` build:
    :func:`ssd_eagle.engine.factory.build` with the default placement (``inference.launch`` puts rank 0's
    :meth:`~ssd_eagle.parallel.engine.DriverSession.build_engine` in its place)."""
    return build(config)
