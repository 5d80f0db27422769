"""Continuous batching of conversation turns over the engine's public API (``add_request`` / ``step``).

Up to ``max_num_seqs`` requests decode together; a slot freed by a finished request is refilled at once. Three kinds
of request share the batch:

- an assistant turn of a conversation, given its regenerated history (chat template with the generation prompt);
- a Magpie candidate: the target writes a new user request from the steered user-turn prefix
  (:class:`~train.regen.magpie.Steering`); kept candidates become conversations at once;
- a follow-up: the target writes the user's next turn after the history (multi-turn conversations).

A free slot goes to a started conversation first (its next turn or follow-up), then to a new conversation:
a Magpie candidate while fewer than ``magpie_share`` of the conversations started so far were Magpie ones, else the
next listed conversation. A turn is checked as it finishes: one that touches a held-out prompt
(:func:`train.heldout.check_text`) or is stuck in a loop (:func:`~train.regen.filters.is_repetitive`) is dropped
and ends its conversation; a turn that ends on ``length`` is kept and ends its conversation (nothing is asked after a
cut answer). The repetition check also runs on the text so far every ``REPETITION_CHECK_TOKENS`` tokens of a turn
being generated, and a turn found looping there is aborted and dropped at once instead of looping on to
``max_new_tokens`` (half of the dropped turns' tokens were spent so; of 1282 kept turns of the bf16 run, 8 (0.6%) had
a looping prefix at such a check and would have been dropped too). Every prompt, listed or written by the target, passes the held-out check before it is submitted.

Finished conversations are appended to the work folder at once (:class:`~train.regen.store.WorkDir`); a restart
skips their ids and rebuilds the Magpie prompts from the candidate log.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field
from tqdm.auto import tqdm

from ssd_eagle.engine.llm import render_chat
from ssd_eagle.sampling_params import SamplingParams
from train.data import special_token_ids
from train.heldout import check_text
from train.regen.filters import is_repetitive
from train.regen.magpie import CandidateFilter, Steering, user_turn_prefix
from train.regen.sources import Conversation, Plan, plan, single_turn
from train.regen.store import RunLog, WorkDir

REPETITION_CHECK_TOKENS = 32  # tokens of a turn between two repetition checks of its text so far


class RegenConfig(BaseModel):
    """What decides the generated content (recorded in the work folder; a resumed run must match), and when to
    stop (``time_limit_min``, ``target_tokens``, ``stop_file``: these may change between runs).

    Raises:
        ValueError: (pydantic's ``ValidationError``) a field out of range, naming it; an unknown field.
    """

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(512, ge=1, description="cap of an assistant turn; a turn that reaches it ends on "
                                "'length' and ends its conversation")
    temperature: float = Field(0.7, ge=0.0, description="temperature of the sampled conversations")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    greedy_fraction: float = Field(0.5, ge=0.0, le=1.0, description="share of the conversations decoded at T = 0 "
                                   "(the data T = 0 drafting learns from)")
    multi_turn_fraction: float = Field(0.3, ge=0.0, le=1.0, description="share of the conversations that get "
                                       "1..max_followups target-written follow-up turns")
    max_followups: int = Field(2, ge=0)
    followup_max_tokens: int = Field(96, ge=1)
    num_magpie: int = Field(0, ge=0, description="Magpie prompts to keep (steered across MT-Bench's kinds)")
    magpie_share: float = Field(0.5, ge=0.0, le=1.0, description="share of new conversations that start with a "
                                "Magpie candidate while num_magpie lasts")
    magpie_temperature: float = Field(1.0, ge=0.0)
    magpie_max_tokens: int = Field(128, ge=1)
    seed: int = Field(0, description="seeds every choice (conversation plans, Magpie candidates and steering)")
    time_limit_min: float | None = Field(None, gt=0.0, description="minutes; then drain (finish the requests in "
                                         "flight and the started conversations) and return")
    target_tokens: int | None = Field(None, ge=1, description="drain once this many assistant tokens are written "
                                      "(this run and the earlier ones)")
    stop_file: Path | None = Field(None, description="drain when this file exists")

    def content_settings(self) -> dict:
        """The fields that decide the content (``num_magpie``, ``magpie_share`` and the stop fields may change)."""
        return self.model_dump(exclude={"num_magpie", "magpie_share", "time_limit_min", "target_tokens",
                                        "stop_file"})


@dataclass
class _Job:
    conv: Conversation
    plan: Plan
    messages: list[dict] = field(default_factory=list)  # regenerated history so far
    position: int = 0  # index into conv.messages
    followups: int = 0  # follow-ups still to write
    turn: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    stop_reasons: list[int | None] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    dropped_turns: int = 0

    @property
    def started(self) -> bool:
        return self.turn > 0


class Regenerator:
    """Regenerates conversations into a work folder with an engine (:class:`~ssd_eagle.engine.llm_engine.LLMEngine`).

    Args:
        engine: the target's engine, AR mode; its ``max_num_seqs`` is the batch.
        work: the work folder (rows and candidates are appended to it).
        config: :class:`RegenConfig`.
        runlog: optional :class:`~train.regen.store.RunLog` kept up to date.
    """

    def __init__(self, engine, work: WorkDir, config: RegenConfig, runlog: RunLog | None = None,
                 progress: bool = True):
        self.engine, self.tok, self.work, self.cfg, self.runlog = engine, engine.tokenizer, work, config, runlog
        self.capacity = engine.max_num_seqs
        self.stop_ids = sorted(special_token_ids(self.tok))  # a special token (a new <|im_start|>) ends a turn
        rows = work.rows(repair=True)
        self.done = {r["id"] for r in rows}
        self.listed: collections.deque[Conversation] = collections.deque()
        self.ready: collections.deque[_Job] = collections.deque()  # started conversations waiting for a slot
        self.in_flight: dict[str, tuple] = {}
        self.counts = collections.Counter(assistant_tokens_before=sum(sum(r["gen"]["num_tokens"]) for r in rows))
        self.started_magpie = self.started_listed = 0
        self.draining = False
        self.start = time.time()
        self._rid = 0
        self._last_log = 0.0
        self._prefix_cache: dict[tuple, list[int]] = {}
        self.filter = CandidateFilter(self.tok)
        self.followup_filter = CandidateFilter(self.tok, dedup=False)
        self.next_candidate = 0
        self.magpie_kept = 0
        for line in work.candidates(repair=True):
            self.next_candidate = max(self.next_candidate, line["candidate"] + 1)
            self.counts[f"magpie_{line['outcome']}"] += 1
            if line["prompt"] is not None:
                self.filter.seen_add(line["prompt"])
                self.magpie_kept += 1
                self._list_magpie(line["candidate"], line["kind"], line["prompt"], front=False)
        self.bar = tqdm(total=config.target_tokens, initial=self.total_tokens(), desc="assistant tokens", unit="tok",
                        disable=not progress, dynamic_ncols=True, mininterval=30.0)

    # queue
    def add(self, convs: Iterable[Conversation]) -> None:
        """List conversations to regenerate (those already written are skipped); their prompts are checked."""
        for conv in convs:
            if conv.id in self.done:
                continue
            if any(check_text(t) is not None for t in conv.prompt_texts()):
                self.counts["dropped_heldout_prompt"] += 1
                continue
            self.filter.seen_add(conv.prompt_texts()[0])
            self.listed.append(conv)

    def exclude(self, rows: Iterable[dict]) -> None:
        """Skip the conversations of an earlier pack's ``rows`` (``{id, messages, ...}``): their ids count as
        written and their first user turns as seen prompts, so a Magpie candidate equal to one is a duplicate."""
        for row in rows:
            self.done.add(row["id"])
            first = next((m["content"] for m in row["messages"] if m["role"] == "user"), None)
            if first is not None:
                self.filter.seen_add(first)

    def magpie_id(self, kind: str, k: int) -> str:
        """Id of Magpie candidate ``k``: ``magpie/{kind}/{k}`` under seed 0 (the committed rows' ids; not
        ``magpie/{k}``, format 1's), ``magpie/{kind}/s{seed}-{k}`` under another seed, so runs never collide."""
        return f"magpie/{kind}/{k}" if self.cfg.seed == 0 else f"magpie/{kind}/s{self.cfg.seed}-{k}"

    def _list_magpie(self, k: int, kind: str, prompt: str, front: bool) -> None:
        conv = single_turn(self.magpie_id(kind, k), f"magpie-{kind}", prompt)
        if conv.id not in self.done:
            (self.listed.appendleft if front else self.listed.append)(conv)

    def _job(self, conv: Conversation) -> _Job:
        p = plan(self.cfg.seed, conv.id, greedy_fraction=self.cfg.greedy_fraction, temperature=self.cfg.temperature,
                 multi_turn_fraction=self.cfg.multi_turn_fraction, max_followups=self.cfg.max_followups)
        return _Job(conv, p, followups=p.followups)

    # scheduling
    def _submit(self, kind: str, prompt: list[int], params: SamplingParams, payload) -> None:
        self._rid += 1
        rid = f"{kind}-{self._rid}"
        self.engine.add_request(rid, prompt, params)
        self.in_flight[rid] = (kind, payload)

    def _prefix_ids(self, system_prompt: str | None, opener: str = "", history: list[dict] | None = None
                    ) -> list[int]:
        """Token ids of the user-turn prefix (after ``history``, if given) followed by ``opener``; the prefixes of
        new conversations (no history) are cached."""
        def encode() -> list[int]:
            text = user_turn_prefix(self.tok, system_prompt, history=history or ())[0] + opener
            return list(self.tok(text, add_special_tokens=False)["input_ids"])

        if history:
            return encode()
        if (system_prompt, opener) not in self._prefix_cache:
            self._prefix_cache[system_prompt, opener] = encode()
        return self._prefix_cache[system_prompt, opener]

    def _want_magpie(self) -> bool:
        if self.magpie_kept + self._magpie_in_flight() >= self.cfg.num_magpie or \
                self.next_candidate >= 4 * self.cfg.num_magpie + 16:  # a model that cannot write prompts
            return False
        started = self.started_magpie + self.started_listed
        return not self.listed or self.started_magpie < self.cfg.magpie_share * (started + 1)

    def _magpie_in_flight(self) -> int:
        return sum(kind == "magpie" for kind, _ in self.in_flight.values())

    def _top_up(self) -> None:
        while len(self.in_flight) < self.capacity:
            if self.ready:
                self._advance(self.ready.popleft())
            elif self.draining:
                return
            elif self._want_magpie():
                k = self.next_candidate
                self.next_candidate += 1
                self.started_magpie += 1
                steer = Steering.for_candidate(self.cfg.seed, k)
                params = SamplingParams(max_tokens=self.cfg.magpie_max_tokens, temperature=self.cfg.magpie_temperature,
                                        seed=self.cfg.seed * 1_000_003 + k, stop_token_ids=sorted(self.filter.stops),
                                        skip_special_tokens=False)
                self._submit("magpie", self._prefix_ids(steer.system_prompt, steer.opener), params, (k, steer))
            elif self.listed:
                conv = self.listed.popleft()
                if not conv.id.startswith("magpie/"):
                    self.started_listed += 1
                self._advance(self._job(conv))
            else:
                return

    def _params(self, job: _Job, max_tokens: int, **kw) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=job.plan.temperature, top_p=self.cfg.top_p,
                              seed=job.plan.seed + job.turn, **kw)

    def _advance(self, job: _Job) -> None:
        """Submit the next request of ``job`` (its next assistant turn or a follow-up), or finish it."""
        conv = job.conv
        while job.position < len(conv.messages) and conv.messages[job.position] is not None:
            job.messages.append(conv.messages[job.position])
            job.position += 1
        if job.position >= len(conv.messages):
            if job.followups <= 0 or job.messages[-1]["role"] != "assistant":
                self._finish(job)
                return
            job.followups -= 1
            prompt = self._prefix_ids(None, history=job.messages)
            if len(prompt) + self.cfg.followup_max_tokens + self.cfg.max_new_tokens > self.engine.max_model_len:
                self._finish(job)
                return
            params = self._params(job, self.cfg.followup_max_tokens, stop_token_ids=sorted(self.filter.stops),
                                  skip_special_tokens=False)
            self._submit("followup", prompt, params, job)
            return
        prompt = render_chat(self.tok, job.messages)
        if len(prompt) + self.cfg.max_new_tokens > self.engine.max_model_len:
            self._end(job, "too_long")
            return
        self._submit("turn", prompt, self._params(job, self.cfg.max_new_tokens, stop_token_ids=self.stop_ids,
                                                  skip_special_tokens=True), job)

    def _end(self, job: _Job, reason: str) -> None:
        """End ``job`` before its remaining turns (counted as dropped): cut after its last answer."""
        self.counts[f"ended_{reason}"] += 1
        while job.messages and job.messages[-1]["role"] != "assistant":
            job.messages.pop()
        job.dropped_turns += sum(m is None for m in job.conv.messages[job.position:]) + job.followups
        job.position, job.followups = len(job.conv.messages), 0
        self._finish(job)

    def _check_stop(self) -> None:
        if self.draining:
            return
        cfg = self.cfg
        reason = None
        if cfg.time_limit_min is not None and time.time() - self.start > 60 * cfg.time_limit_min:
            reason = "time limit reached"
        elif cfg.stop_file is not None and Path(cfg.stop_file).exists():
            reason = f"{cfg.stop_file} found"
        elif cfg.target_tokens is not None and self.total_tokens() >= cfg.target_tokens:
            reason = "target tokens reached"
        if reason:
            self.draining = True
            tqdm.write(f"[regenerate] {reason}: draining ({len(self.in_flight)} requests in flight)")

    def total_tokens(self) -> int:
        return self.counts["assistant_tokens_written"] + self.counts["assistant_tokens_before"]

    def step(self) -> None:
        self._check_stop()
        self._top_up()
        if not self.in_flight:
            return
        for out in self.engine.step():
            if not out.finished:
                if self.in_flight[out.request_id][0] == "turn" and self._looping(out):
                    self.engine.abort(out.request_id)
                    self.counts["tokens_generated"] += len(out.outputs[0].token_ids)
                    self.counts["aborted_repetitive"] += 1
                    self._end(self.in_flight.pop(out.request_id)[1], "repetitive")
                continue
            kind, payload = self.in_flight.pop(out.request_id)
            token_ids = list(out.outputs[0].token_ids)
            self.counts["tokens_generated"] += len(token_ids)
            if kind == "magpie":
                self._candidate_done(*payload, token_ids)
            elif kind == "followup":
                self._followup_done(payload, token_ids)
            else:
                self._turn_done(payload, out.outputs[0], token_ids)
        self._log()

    def run(self) -> None:
        """Generate until nothing is left (or a stop condition drained the run)."""
        while True:
            self.step()
            if not (self.in_flight or self.ready) and (self.draining or not (self.listed or self._want_magpie())):
                break
        self.bar.close()
        self._log(force=True)

    @staticmethod
    def _looping(out) -> bool:
        """Whether an unfinished turn's text so far is repetitive, checked when it passes a multiple of
        ``REPETITION_CHECK_TOKENS`` tokens."""
        n = len(out.outputs[0].token_ids)
        if n // REPETITION_CHECK_TOKENS == (n - len(out.delta_token_ids)) // REPETITION_CHECK_TOKENS:
            return False
        return is_repetitive(out.outputs[0].text)

    # finished requests
    def _candidate_done(self, k: int, steer: Steering, token_ids: list[int]) -> None:
        outcome, prompt = self.filter(token_ids, steer.opener)
        self.counts[f"magpie_{outcome}"] += 1
        self.work.append_candidate({"candidate": k, "kind": steer.kind, "outcome": outcome, "prompt": prompt})
        if prompt is not None:
            self.magpie_kept += 1
            self._list_magpie(k, steer.kind, prompt, front=True)

    def _followup_done(self, job: _Job, token_ids: list[int]) -> None:
        outcome, prompt = self.followup_filter(token_ids)
        self.counts[f"followup_{outcome}"] += 1
        if prompt is None:
            self._finish(job)
            return
        job.messages.append({"role": "user", "content": prompt})
        job.conv.messages = job.conv.messages + [{"role": "user", "content": prompt}, None]
        job.position += 1
        self.ready.appendleft(job)

    def _turn_done(self, job: _Job, out, token_ids: list[int]) -> None:
        text = out.text
        if check_text(text) is not None:
            self._end(job, "heldout_response")
            return
        if is_repetitive(text):
            self._end(job, "repetitive")
            return
        job.messages.append({"role": "assistant", "content": text})
        job.finish_reasons.append(out.finish_reason)
        job.stop_reasons.append(out.stop_reason if out.finish_reason == "stop" else None)
        job.num_tokens.append(len(token_ids))
        job.position += 1
        job.turn += 1
        if out.finish_reason == "length":
            self._end(job, "length")
            return
        self.ready.appendleft(job)  # finish started conversations first

    def _finish(self, job: _Job) -> None:
        if not job.num_tokens:
            self.counts["dropped_no_turn"] += 1
            return
        row = {"id": job.conv.id, "source": job.conv.source, "messages": job.messages,
               "gen": {"temperature": job.plan.temperature, "top_p": self.cfg.top_p, "seed": job.plan.seed,
                       "finish_reasons": job.finish_reasons, "stop_reasons": job.stop_reasons,
                       "num_tokens": job.num_tokens, "dropped_turns": job.dropped_turns}}
        self.work.append_row(row)
        self.done.add(job.conv.id)
        self.counts["conversations_written"] += 1
        self.counts["assistant_tokens_written"] += sum(job.num_tokens)
        self.bar.update(sum(job.num_tokens))

    def _log(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last_log < 60:
            return
        self._last_log = now
        elapsed = max(now - self.start, 1e-9)
        fields = {k: self.counts[k] for k in ("conversations_written", "assistant_tokens_written",
                                               "tokens_generated")}
        if self.runlog is not None:
            self.runlog.update(force=force, counts=dict(self.counts), **fields)
        tqdm.write(f"[regenerate] {time.strftime('%H:%M:%S')} {elapsed / 60:.1f} min: "
                   f"{fields['conversations_written']} conversations, {fields['assistant_tokens_written']} assistant "
                   f"tokens, {fields['tokens_generated'] / elapsed:.1f} tokens/s generated; in flight "
                   f"{len(self.in_flight)}, listed {len(self.listed)}, Magpie kept {self.magpie_kept}")
