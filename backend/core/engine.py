"""LLMEngine: add requests, step the batch, stream each request's new tokens until it finishes."""
import itertools
import time
from dataclasses import fields
from typing import Callable, Hashable

import torch

from backend.config import EngineConfig, LoraCacheConfig, split_engine_kwargs
from backend.core.beams import BeamSearch
from backend.core.intake import SAMPLING_FIELDS, RequestIntake
from backend.core.kv_cache import BlockManager
from backend.core.logprobs import top_rows
from backend.core.outputs import StepOutput, StepOutputs, TokenRow, token_output
from backend.core.overlap_check import check_overlap
from backend.core.request import FatalEngineError, RequestError, RequestLimits, SamplingParams, Sequence, Status, stops
from backend.core.scheduler import Batch, Scheduler, StepSummary
from backend.core.sequences import RequestTable
from backend.device import is_device_fault
from backend.lora.cache import LoraCache
from backend.lora.dora import checkpoint_weights
from backend.lora.peft import load_lora_dir, prefetch_dirs
from backend.lora.request import LoraRequest
from backend.model.checkpoint import ModelConfig
from backend.model.results import LaunchedStep
from backend.model.runner import ModelRunner


class LLMEngine:
    def __init__(self, model_dir: str, **kwargs):
        engine_kwargs, lora_kwargs = split_engine_kwargs(kwargs)
        self.config = EngineConfig(model_dir=str(model_dir), lora=LoraCacheConfig(**lora_kwargs), **engine_kwargs)
        self.model_config = ModelConfig.from_dir(model_dir)
        self.runner = ModelRunner(self.config, self.model_config)
        try:
            self._start()
        except BaseException:
            self.runner.close()                                  # a failed start leaves no workers behind
            raise

    def _start(self) -> None:
        self.lora_cache = LoraCache(self.config.lora, self.model_config, self.runner.lora_dtype, self.runner.device,
                                    self.runner.ops.lora, tp=self.runner.tp)
        self.config.lora = self.lora_cache.cfg                # its auto sizes resolved
        num_blocks = self.runner.allocate_kv_cache()        # last: on CUDA it takes what the rest left free
        self.runner.capture_graphs(self.lora_cache)
        self.blocks = BlockManager(num_blocks, self.config.kv_block_size, self.config.kv_watermark,
                                   self.config.enable_kv_cache_reuse)
        self.scheduler = Scheduler(self.config, self.blocks, self.lora_cache)
        self.intake = RequestIntake(self.config, self.model_config, self.blocks, self.lora_cache)
        self.seqs = RequestTable()                          # a request's sequences, by sequence index
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.last_step_kind = "decode"                      # or "prefill": the last step held prompt tokens
        self.last_step = StepSummary()
        overlap = self.config.overlap_steps
        self.overlap = self.runner.tp is None and (overlap == "true" or (
            overlap == "auto" and self.runner.device.type == "cuda"))
        self.in_flight: LaunchedStep | None = None          # launched, its tokens not yet on the host (overlap)
        self._ids = itertools.count()
        if self.overlap and self.config.checks_at_start(self.runner.device.type):
            error = check_overlap(self)                     # a step ahead gives the tokens of steps in turn
            if error is not None:
                self.runner.kernel_fallbacks["overlap_steps"], self.overlap = error, False
        if self.config.lora.prefetch_dir:
            for task_id, path in prefetch_dirs(self.config.lora.prefetch_dir):
                self.add_lora_dir(task_id, path)

    def close(self) -> None:
        """Stop what the engine started beside itself (tensor-parallel workers, grammar compile workers)."""
        self.runner.close()
        self.intake.close()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0         # (a step in flight for finished ones lands with the next)

    def stats(self) -> dict:
        """Figures a server exports: sequences, KV blocks, generated tokens and adapter cache counters (cumulative),
        adapter bytes."""
        lora = self.lora_cache.stats
        return {"seqs_running": len(self.scheduler.running), "seqs_waiting": len(self.scheduler.waiting),
                "kv_used": self.blocks.num_used_blocks, "kv_free": self.blocks.num_free_blocks,
                "kv_reuse_lookups": self.blocks.num_lookups, "kv_reuse_hits": self.blocks.num_hits,
                "tokens_generated": self.num_generated_tokens,
                "lora": {f.name: getattr(lora, f.name) for f in fields(lora)}}

    def add_lora(self, task_id: int, weights, config) -> None:
        """Cache an adapter given as TensorRT-LLM tensors (numpy or torch): lora_weights [N, R],
        lora_config [N, 3|4]."""
        self.lora_cache.add(int(task_id), weights, config)

    def add_lora_dir(self, task_id: int, path) -> None:
        """Cache an adapter from an HF PEFT or TensorRT-LLM directory (a PEFT DoRA one's magnitudes normalized against
        the served base weights, on the engine's device)."""
        weights, config = load_lora_dir(path, checkpoint_weights(self.config.model_dir, self.runner.projection_dtype,
                                                                 self.runner.device, self.config.weight_dtype),
                                        self.model_config)
        self.add_lora(task_id, weights, config)

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    lora: LoraRequest | int | None = None, request_id: Hashable | None = None,
                    **sampling) -> Hashable:
        """Validate and queue one request; raises RequestError naming the field at fault. lora: its adapter, by
        task id (an int, or a LoraRequest): the first request for an adapter brings its weights
        (LoraRequest.of(task_id, lora_weights, lora_config)), later ones only the id."""
        unknown = set(sampling) - SAMPLING_FIELDS
        if unknown:
            raise TypeError(f"unknown sampling arguments: {sorted(unknown)}")
        if len(self.scheduler.waiting) >= self.config.max_queue_size:
            raise RequestError("max_queue_size", f"queue full ({self.config.max_queue_size} requests waiting): "
                                                 "retry later")
        params = params or SamplingParams(**sampling)
        prompt_ids = self.intake.check(prompt_ids, params)
        request_id = next(self._ids) if request_id is None else request_id
        if request_id in self.seqs:
            raise RequestError("request_id", f"{request_id!r} is already in flight")
        if lora is not None and not isinstance(lora, LoraRequest):
            lora = LoraRequest(int(lora))                       # a task id (a numpy integer too)
        members = self.intake.sequences(request_id, prompt_ids, params, lora)
        self.seqs.add(request_id, members)
        self.scheduler.add(members[0])
        return request_id

    @property
    def limits(self) -> RequestLimits:
        return self.intake.limits

    def compile_guide(self, params: SamplingParams, cancelled: Callable[[], bool] = lambda: False):
        """The request's grammar, compiled in a bounded worker process (thread-safe: servers call it off the engine
        loop; `cancelled` stops it)."""
        return self.intake.compile_guide(params, cancelled)

    def abort(self, request_id: Hashable) -> bool:
        """Stop a request (every sequence of it) and free what it holds. False if it is not in flight."""
        if request_id not in self.seqs:
            return False
        self._finish_request(request_id, "abort")
        return True

    def step(self) -> StepOutputs:
        """One forward over the scheduled batch; the new token (if any) and finished flag of each request. With
        overlap_steps on, the step is launched before the one in flight lands, and the outputs are that one's: the
        host's work for a step runs while the device computes the next. (Under torch.inference_mode, which it
        enters where its caller has not: a server's loop enters it once.)"""
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return self.step()
        previous, self.in_flight = self.in_flight, None
        outputs = StepOutputs()
        if previous is not None:
            self.lora_cache.slots.copies.after(previous.download)      # its adapters' slots are read until it ends
            if not self._can_run_ahead(previous):
                self._collect(previous, outputs.entries)
                previous = None
        batch, launched, failure = self.scheduler.schedule(), None, None
        if batch.items:
            try:
                launched = self._launch(batch, previous)
            except Exception as exc:               # its requests fail, once the step in flight has landed
                failure = exc
        if previous is not None:
            self._collect(previous, outputs.entries)
        if failure is not None:
            outputs.entries += self._fail_batch(batch, failure)
        if launched is not None and self.overlap:
            self.in_flight = launched
        elif launched is not None:
            self._collect(launched, outputs.entries)
        return outputs

    def _can_run_ahead(self, previous: LaunchedStep) -> bool:
        """The next step can be prepared before `previous` lands: no sequence of it needs its last token on the
        host first (penalties, bad words, top-p decay, a grammar, samples of the prompt waiting to fork)."""
        forks = self.seqs.waiting_forks
        return not previous.rows.needs_last_tokens and not (forks and any(seq in forks for seq in previous.rows_of))

    def _launch(self, batch: Batch, previous: LaunchedStep | None) -> LaunchedStep:
        """Start a scheduled step; its sequences count the tokens it computes, and the one it samples."""
        self.num_steps += 1
        self.last_step = batch.summary(time.time())
        self.last_step_kind = "decode" if self.last_step.is_decode else "prefill"
        if self.num_steps in self.config.inject_fault_steps:
            raise RuntimeError(f"injected fault at step {self.num_steps}")
        waiting = itertools.islice(self.scheduler.waiting, self.config.lora.max_loras)
        launched = self.runner.launch(batch, self.lora_cache, [seq.lora_task_id for seq in waiting], previous)
        launched.ahead = self.overlap                       # (else collected before step() returns: none pending)
        if batch.all_decode:                                # (each scheduled before: its first time is set)
            for item in batch.items:
                item.seq.num_computed_tokens += 1
        else:
            now = time.time_ns()
            for item in batch.items:
                seq = item.seq
                if not seq.metrics.first_scheduled_time_ns:
                    seq.metrics.first_scheduled_time_ns = now
                seq.num_computed_tokens += item.num_new_tokens
        if launched.ahead:
            for item in batch.items:
                item.seq.num_pending_tokens += item.samples
        return launched

    def _collect(self, launched: LaunchedStep, entries: list) -> None:
        """A launched step's tokens, once on the host: appended, checked for stops, their outputs added to `entries`.
        A sequence that finished since it was launched (stopped a step before, or aborted) drops its token."""
        try:
            r = self.runner.collect(launched)
        except Exception as exc:
            entries += self._fail_batch(launched.batch, exc)
            return
        for item in launched.batch.items if self.blocks.enable_reuse else ():
            if item.seq.status is not Status.FINISHED:
                self.blocks.commit(item.seq)
        now, finished, num_dropped, ahead = time.time_ns(), Status.FINISHED, 0, launched.ahead
        every_row = bool(self.seqs.waiting_forks or r.logits)          # each token through _append
        for seq, token, log_prob, end in zip(launched.rows_of, r.tokens, r.log_probs, launched.rows.ends):
            if ahead:
                seq.num_pending_tokens -= 1
            if seq.status is finished:
                num_dropped += 1
                continue
            if seq.beams is not None:
                ids, log_probs = top_rows(r.top, launched.rows_of[seq], seq.params.num_candidates)
                if seq.beams.offer(seq, ids, log_probs):
                    entries.append(self._select(seq.beams))
                continue
            out = seq.output_ids
            if every_row or end is None or token == end or len(out) + 1 >= seq.params.max_new_tokens:
                row, k = launched.rows_of[seq], seq.params.top_log_probs
                entries.append(self._append(seq, token, log_prob, now, r.logits.get(row) if r.logits else None,
                                            top_rows(r.top, row, k) if k else None))
                continue
            out.append(token)                                  # (_append's steps for a plain token that ends nothing)
            m = seq.metrics
            m.last_token_time_ns = now
            if not m.first_token_time_ns:
                m.first_token_time_ns = now
            entries.append((seq, token, log_prob, m, now))
        self.num_generated_tokens += len(r.tokens) - num_dropped

    def _select(self, search: BeamSearch) -> StepOutput:
        """Every live beam of a search has offered its next tokens: one round of the search (backend/core/beams.py), its
        beams moved on and their KV blocks shared or copied; the request's output (its beams so far, or its best
        hypotheses when the search is done)."""
        first, now = search.seqs[0], time.time_ns()
        kept = search.select(lambda output_ids: stops(first.params, output_ids))
        if search.done:
            return self._finish_search(search)
        copies, started, moved = search.advance(kept, self.blocks)
        if copies:
            self.runner.copy_kv_blocks(copies)
        for seq in started:
            self.scheduler.join(seq)
        if moved:                                            # tables replaced: the rows added anew
            self.scheduler.decoding = None
            self.runner.persistent.drop()
        for seq in search.live:
            seq.metrics.token_at(now)
        return StepOutput(first.request_id, [], metrics=first.metrics.copy(), beams=search.running())

    def _finish_search(self, search: BeamSearch) -> StepOutput:
        """A search done: every beam ends, the request's output its best num_return_sequences hypotheses."""
        first = search.seqs[0]
        best = search.best(first.params.num_return_sequences)
        reason = "length" if len(best[0].output_ids) >= first.params.max_new_tokens else "stop"
        for seq in search.seqs:
            out = self._finish(seq, reason)
        out.metrics, out.beams = first.metrics.copy(), best
        return out

    def _fail_batch(self, batch: Batch, exc: Exception) -> list[StepOutput]:
        """A failed step fails its requests, never the engine; unless the engine itself cannot go on."""
        if isinstance(exc, FatalEngineError):
            raise exc
        if is_device_fault(exc):
            raise FatalEngineError(f"device fault (every later step would fail too): {exc}") from exc
        failed = dict.fromkeys(item.seq.request_id for item in batch.items if item.seq.status is not Status.FINISHED)
        return [self._finish_request(request_id, "error", error=f"engine failure: {exc}")
                for request_id in failed if request_id in self.seqs]

    def _append(self, seq: Sequence, token: int, log_prob: float, now: int, logits: torch.Tensor | None,
                top: tuple[list[int], list[float]] | None = None) -> TokenRow | StepOutput:
        """A sequence's new token: its output, a token row unless it ends the sequence or brings logits or log probs
        beyond its own (top: its top alternatives' ids and log probs)."""
        seq.accept(token, log_prob, now)
        p = seq.params
        if self.seqs.waiting_forks:
            copies = self.scheduler.add_forks(seq, self.seqs.take_forks(seq))
            if copies:
                self.runner.copy_kv_blocks(copies)
        reason = seq.stop_reason()
        scored = p.return_prompt_log_probs and seq.sequence_index == 0 and len(seq.output_ids) == 1
        if reason is None and logits is None and top is None and not seq.context_logits and not scored:
            return seq, token, log_prob, seq.metrics, now
        out = token_output(seq, token, log_prob, logits, top, scored)
        if reason is not None:
            out = self._finish(seq, reason, out)
        return out

    def _finish(self, seq: Sequence, reason: str, out: StepOutput | None = None) -> StepOutput:
        """Take one sequence out; the request ends with its last sequence."""
        if seq.status is not Status.FINISHED:
            if seq in self.scheduler.waiting or seq.status is Status.RUNNING:
                self.scheduler.finish(seq, reason)
            else:                              # a fork not started yet
                self.blocks.free(seq)
                seq.status, seq.finish_reason = Status.FINISHED, reason
            self.lora_cache.unref(seq.lora_task_id)
        out = out or StepOutput(seq.request_id, [], sequence_index=seq.sequence_index, metrics=seq.metrics.copy())
        out.finished, out.finish_reason = True, reason
        out.request_finished = self.seqs.done(seq.request_id)
        return out

    def _finish_request(self, request_id: Hashable, reason: str, error: str | None = None) -> StepOutput:
        """End every sequence of a request at once (abort, failure): one final output."""
        self.seqs.drop_forks(request_id)
        for seq in self.seqs.get(request_id, []):
            out = self._finish(seq, reason)
        out.error = error
        return out

    def generate(self, prompts: list[list[int]], max_new_tokens: int = 16,
                 lora_task_ids: list[int | None] | None = None, **sampling) -> list[list[int]]:
        """Run prompts to completion (greedy unless sampling says otherwise); output tokens per prompt."""
        lora_task_ids = lora_task_ids or [None] * len(prompts)
        ids = [self.add_request(prompt, lora=task, max_new_tokens=max_new_tokens, **sampling)
               for prompt, task in zip(prompts, lora_task_ids)]
        outputs = {request_id: [] for request_id in ids}
        while any(request_id in self.seqs for request_id in ids):
            for out in self.step():
                if out.error:
                    raise RuntimeError(out.error)
                if out.request_id in outputs and out.beams is not None and out.request_finished:
                    outputs[out.request_id] = out.beams[0].output_ids          # beam search: the best beam
                elif out.request_id in outputs:
                    outputs[out.request_id] += out.new_token_ids
        return [outputs[request_id] for request_id in ids]
