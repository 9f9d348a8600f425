"""The `sim` backend: SGLang's HTTP contract with no model, for routing and fault experiments at fleet scale.

Requests go through the same parsing, expansion and output shapes as the `transformers` backend
(`request_expansion`, `GenerationJob`, `EngineMetrics`), but tokens come from a seeded generator and
time from a latency model, on the asyncio loop, without torch, so 8-16 engines fit on two cores.

What it models, per engine:
  * KV memory as in SGLang's pool (`PrefixCache`): one token budget holds the running requests'
    KV (prompt + room for max_new_tokens, shared prefix blocks counted once) and the prefix cache
    of finished ones, which is evicted LRU but never under a running request. A prompt's cached
    tokens (blocks an earlier iteration computed, or this one for another sample of the same prompt) are
    reported as `meta_info.cached_tokens` and (per prefill batch) in `sglang:cache_hit_rate`, and only
    uncached tokens cost prefill. A weight load that flushes the cache leaves no old KV cached; the requests
    it holds recompute theirs (prompt + output, charged as prefill) in their next iteration, as SGLang's
    retracted requests do;
  * admission first come, first served: a waiting request starts when there is a free batch slot
    (`max_running_requests`), its uncached tokens fit what is left of the prefill batch's budget
    (`max_prefill_tokens`, SGLang's; the first request of a batch always fits) and its KV fits in free +
    evictable memory; otherwise it and those
    behind it wait, as on an engine sent more than it can hold. A request larger than the whole
    budget is refused (400) rather than left waiting forever;
  * continuous batching: the running sequences advance together; each iteration takes
    `decode_step + per_sequence * batch + per_kv_token * (running sequences' tokens) + prefill_per_token
    * (uncached tokens admitted)`: decoding reads every sequence's whole KV (a shared prefix once per
    sequence), and a prefill stalls the whole batch, as it does in SGLang without chunked prefill.
    A pause, and a weight load, wait for the iteration under way to end: no token comes out of an
    iteration after the pause has answered, or is labelled with a version loaded during it.
Output token j of sample i of a prompt is a function of (random_seed, prompt ids, i, j, and the request's
sampling_seed if it has one) only: the same request gets the same tokens on every engine, whatever routed
it there. Every figure measured
on this backend is a simulation and must say so.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import math
import random
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from rlfleet.errors import DeadlineExceeded
from rlfleet_engine.config import EngineConfig
from rlfleet_engine.generation_job import GenerationJob
from rlfleet_engine.latest_outputs import LatestOutputs
from rlfleet_engine.metrics import EngineMetrics
from rlfleet_engine.request_expansion import expand
from rlfleet_engine.scheduled_generation import PAUSE_WAIT_S, ScheduledGeneration, check_disk_load
from rlfleet_engine.schemas import GenerateRequest, UpdateWeightsFromDiskRequest, UpdateWeightsFromDistributedRequest
from rlfleet_engine.sim_prefix_cache import Lease, PrefixCache
from rlfleet_engine.stop_conditions import FinishReason, token_finish

if TYPE_CHECKING:  # torch is imported only once a trainer opens a weight update group
    from rlfleet_engine.distributed_weights import WeightReceiver

# Tokens are Unicode code points below this (the Basic Multilingual Plane), so text round-trips.
SIM_VOCAB_SIZE = 65536
_OUTPUT_ALPHABET = tuple(range(ord("a"), ord("z") + 1)) + (ord(" "),)


class SimTokenizer:
    """One token per character (its code point); enough for prompts to share prefixes as their text does."""

    decodes_token_by_token = True
    """Each token's text is its own character whatever surrounds it: a stream's text is decoded incrementally."""

    def encode(self, text: str) -> list[int]:
        return [min(ord(c), 0xFFFD) for c in text]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # An id past Unicode (a real tokenizer's, with --sim-vocab-size) or a surrogate is no character.
        return "".join(chr(t) if t < 0x110000 and not 0xD800 <= t <= 0xDFFF else "\ufffd" for t in token_ids)


@dataclass(frozen=True)
class LatencyModel:
    prefill_secs_per_token: float
    decode_secs_per_step: float
    decode_secs_per_sequence: float
    decode_secs_per_kv_token: float

    def iteration_secs(self, batch: int, prefill_tokens: int, context_tokens: int) -> float:
        """One iteration of `batch` sequences holding `context_tokens` in all, after admitting `prefill_tokens`."""
        return (
            self.decode_secs_per_step
            + self.decode_secs_per_sequence * batch
            + self.decode_secs_per_kv_token * context_tokens
            + self.prefill_secs_per_token * prefill_tokens
        )


@dataclass(eq=False)
class SimJob(GenerationJob):
    sample_index: int = 0
    prefill_group: Hashable = None
    """The same for the n samples of one prompt of one request: SGLang prefills that prompt once for all."""
    cached_tokens: int = 0
    rng: random.Random = field(default_factory=random.Random)
    top_rng: random.Random | None = None
    """Draws the synthetic top logprobs (when asked for), apart from `rng`, so asking changes no token."""
    lease: Lease | None = None
    """The KV memory the job holds while it runs."""
    kv_stale: bool = False
    """Its KV was computed under weights a load has since replaced: recomputed in its next iteration."""

    @property
    def kv_tokens(self) -> int:
        """The KV it holds now: prompt + tokens generated so far."""
        return len(self.input_ids) + len(self.output_ids)

    def output(self, tokenizer: Any, weight_version: str) -> dict[str, Any]:
        out = super().output(tokenizer, weight_version)
        out["meta_info"]["cached_tokens"] = self.cached_tokens
        return out


def output_rng(
    seed: int, prompt: Sequence[int] | bytes, sample_index: int, sampling_seed: int | None = None, *, purpose: str = ""
) -> random.Random:
    """The draws of sample `sample_index` of `prompt`; a request's `sampling_seed` takes part when it has one, so
    the samples of a group sent as n requests of one sample, each with its own seed, differ as on a real engine.
    `prompt` may come as `prompt_key(prompt)`, made once for all samples; `purpose` names a stream of draws
    other than the tokens'."""
    salt = "" if sampling_seed is None else f"seed{sampling_seed}:"
    tag = f"{purpose}:" if purpose else ""
    digest = hashlib.blake2b(f"{seed}:{sample_index}:{salt}{tag}".encode(), digest_size=8)
    digest.update(prompt if isinstance(prompt, bytes) else prompt_key(prompt))
    return random.Random(int.from_bytes(digest.digest(), "little"))


def prompt_key(prompt: Sequence[int]) -> bytes:
    return ",".join(map(str, prompt)).encode()


def synthetic_top_logprobs(rng: random.Random, token: int, logprob: float, k: int) -> list[tuple[float, int]]:
    """`k` (logprob, token id) pairs, most likely first, holding the sampled `token` at its `logprob`: the others
    (output-alphabet tokens first, as the sampled ones are) share a random part of the probability it leaves,
    so the k probabilities sum to at most 1, as a distribution's top k do."""
    k = min(k, SIM_VOCAB_SIZE)
    others = [t for t in _OUTPUT_ALPHABET if t != token]
    rng.shuffle(others)
    del others[k - 1 :]
    if len(others) < k - 1:
        taken = {token, *others}
        # Enough draws that k - 1 of them are not taken already (at most len(_OUTPUT_ALPHABET) are).
        pool = rng.sample(range(SIM_VOCAB_SIZE), min(SIM_VOCAB_SIZE, k + len(_OUTPUT_ALPHABET)))
        others += itertools.islice((t for t in pool if t not in taken), k - 1 - len(others))
    rest = max(0.0, 1.0 - math.exp(logprob)) * rng.random()
    weights = [rng.random() + 1e-3 for _ in others]
    total = sum(weights)
    pairs = [(logprob, token)] + [
        (math.log(max(rest * w / total, 1e-30)), t) for w, t in zip(weights, others, strict=True)
    ]
    pairs.sort(key=lambda pair: (-pair[0], pair[1]))
    return pairs


@dataclass(frozen=True)
class SimModel:
    """What the HTTP layer reads from a backend (`core.backend.context_length`)."""

    context_length: int
    vocab_size: int = SIM_VOCAB_SIZE

    def describe(self) -> dict[str, Any]:
        return {"model_type": "sim", "architectures": ["SimulatedCausalLM"]}


class SimScheduler:
    """The batching loop as an asyncio task, started on the first request (the loop must be running)."""

    def __init__(self, config: EngineConfig, cache: PrefixCache, latency: LatencyModel, metrics: EngineMetrics) -> None:
        self.max_running_requests = config.max_running_requests
        self.max_prefill_tokens = config.max_prefill_tokens
        self.weight_version = config.weight_version
        self.cache = cache
        self.latency = latency
        self.metrics = metrics
        self.tokenizer = SimTokenizer()
        self.peak_batch_size = 0
        self.paused = False
        self.last_step_at = time.monotonic()
        self._waiting: list[SimJob] = []
        self._running: list[SimJob] = []
        self._wake = asyncio.Event()
        self._iterating = asyncio.Lock()
        """Held for the whole of each iteration (admit, its time, advance), never across any other await."""
        self._task: asyncio.Task[None] | None = None

    def alive(self) -> bool:
        return self._task is None or not self._task.done()

    def counts(self) -> tuple[int, int]:
        return len(self._running), len(self._waiting)

    def submit(self, jobs: Sequence[SimJob]) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="sim-scheduler")
        self._waiting.extend(jobs)
        self._update_gauges()
        self._wake.set()

    def abort(self, rid: str, abort_all: bool = False) -> None:
        self._abort(lambda job: abort_all or job.rid == rid or job.rid.startswith(f"{rid}_"))

    def abort_jobs(self, jobs: Sequence[GenerationJob]) -> None:
        own = set(jobs)
        self._abort(lambda job: job in own)

    def _abort(self, matches: Callable[[SimJob], bool]) -> None:
        for queue, where in ((self._waiting, "waiting queue"), (self._running, "running batch")):
            for job in [j for j in queue if matches(j)]:
                job.finish_with(FinishReason("abort", message=f"Abort in {where}"))
                self._publish(job)
                queue.remove(job)
                self._release(job)
        self._update_gauges()

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        self._wake.set()

    def between_steps(self) -> Awaitable[object]:
        return self._between_iterations()

    async def _between_iterations(self) -> None:
        """Returns once the iteration under way (if any) has ended. The caller runs before the next one starts
        if it does not await first, so a weight load can follow it; a pause set before it stops the next."""
        async with self._iterating:
            pass

    def load_weights(self, weight_version: str | None, flush_cache: bool) -> int:
        """Between two iterations (after `between_steps`): sets the version and, with `flush_cache`, empties
        the cache as SGLang does after a load. Running requests go on: their KV, of the old weights, is stale
        (never cached for another request) and recomputed, charged as prefill, in their next iteration, as
        SGLang's retracted requests re-prefill theirs. Returns how many requests were running."""
        if flush_cache:
            self.cache.invalidate()
            for job in self._running:
                job.kv_stale = True
        if weight_version is not None:
            self.weight_version = weight_version
        return len(self._running)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _has_work(self) -> bool:
        return not self.paused and bool(self._waiting or self._running)

    async def _loop(self) -> None:
        next_at = time.monotonic()
        while True:
            if not self._has_work():
                self._wake.clear()
                await self._wake.wait()
                next_at = time.monotonic()
                continue
            async with self._iterating:
                # A pause may have come while a barrier or a weight load held the lock.
                if self._has_work():
                    next_at = await self._iterate(next_at)

    async def _iterate(self, next_at: float) -> float:
        """One iteration: recompute stale KV or admit, take the iteration's time, advance the running sequences."""
        self.cache.begin_iteration()
        # Held requests whose KV a load made stale are prefilled again first, as SGLang's retracted ones (back at
        # the head of its queue), and new ones share what is left of the iteration's prefill budget.
        prefill = self._recompute_stale()
        if not any(job.kv_stale and job.lease is not None for job in self._running):
            prefill += self._admit(prefill)
        self._update_gauges()
        assert self._running, "an idle engine admits any request small enough for its KV budget"
        batch = len(self._running)
        context = sum(job.kv_tokens for job in self._running)
        self.peak_batch_size = max(self.peak_batch_size, batch)
        self.metrics.decode_batch_size.observe(batch)
        # Absolute deadlines keep sleep overshoot from adding up over a long generation.
        next_at = max(next_at, time.monotonic() - 0.05) + self.latency.iteration_secs(batch, prefill, context)
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        self._advance()
        self._update_gauges()
        return next_at

    def _recompute_stale(self) -> int:
        """Prefill to pay for the running requests whose KV a weight load made stale: all of it (prompt + output,
        as SGLang re-prefills a retracted request) under the current weights, within the iteration's prefill
        budget (the first one always): the rest wait for the next iterations, generating nothing meanwhile."""
        prefill = 0
        for job in self._running:
            if not job.kv_stale or job.lease is None:
                continue
            if prefill and prefill + job.kv_tokens > self.max_prefill_tokens:
                break
            prefill += job.kv_tokens
            self.cache.recompute(job.lease.blocks, job.prefill_group)
            job.kv_stale = False
        return prefill

    def _admit(self, recomputed: int = 0) -> int:
        """Moves waiting jobs into the batch while slots, KV memory and the prefill budget (less the `recomputed`
        tokens this iteration prefills again) last; returns the prefill to pay for them.

        First come, first served: the first job that does not fit stops admission, so a large
        request is not starved by smaller ones behind it. The budget (`max_prefill_tokens`, SGLang's) counts
        uncached tokens: a burst of requests sharing a prefix is split over iterations, and those admitted after
        the first find the prefix computed, as on SGLang, where one prefill batch does not share what it computes.
        """
        prefill = 0
        admitted = 0
        batch_prompt_tokens = 0
        room = self.max_running_requests - len(self._running)
        for job in self._waiting[:room]:
            uncached = len(job.input_ids) - self.cache.cached_for(job.input_ids, job.prefill_group)
            if (admitted or recomputed) and recomputed + prefill + uncached > self.max_prefill_tokens:
                break
            job.lease = self.cache.lease(job.input_ids, job.params.max_new_tokens, job.prefill_group)
            if job.lease is None:
                break
            admitted += 1
            job.cached_tokens = job.lease.cached_tokens
            prefill += len(job.input_ids) - job.cached_tokens
            batch_prompt_tokens += len(job.input_ids)
            if job.log_metrics:
                self.metrics.prompt_tokens.inc(len(job.input_ids))
                self.metrics.cached_tokens.inc(job.cached_tokens)
        if batch_prompt_tokens:
            # As in SGLang, the hit rate of this prefill batch, not since start: a dashboard sees a flush or a
            # change of workload at once. An iteration that admits nothing leaves it as it was.
            self.metrics.cache_hit_rate.set((batch_prompt_tokens - prefill) / batch_prompt_tokens)
        self._running.extend(self._waiting[:admitted])
        del self._waiting[:admitted]
        return prefill

    def _advance(self) -> None:
        # Only the requests this step gives a token: one still waiting for its KV would count a gap without one.
        self.metrics.observe_token_gaps(job for job in self._running if not (job.kv_stale and job.lease is not None))
        counted = 0
        for job in self._running:
            if job.kv_stale and job.lease is not None:  # waits for its KV to be computed again
                continue
            if job.params.max_new_tokens == 0:  # a prefill alone (SGLang's warm-up of a prompt's cache): no token
                job.finish_with(FinishReason("length", length=0))
                self._publish(job)
                continue
            counted += job.log_metrics
            token = job.rng.choice(_OUTPUT_ALPHABET)
            logprob = -2.0 * job.rng.random()
            top = []
            if job.top_logprobs_num and job.top_rng is not None:
                top = synthetic_top_logprobs(job.top_rng, token, logprob, job.top_logprobs_num)
            job.append(token, logprob, top, self.weight_version)
            # The simulated model has no eos token.
            reason = token_finish(job.output_ids, job.params, ()) or job.check_stop_strings(self.tokenizer)
            if reason is not None:
                job.finish_with(reason)
            if job.finish is not None or job.stream:
                self._publish(job)
        if counted:
            self.metrics.observe_generated(counted)
        self.last_step_at = time.monotonic()
        for job in self._running:
            if job.finish is not None:
                self._release(job)
        self._running = [job for job in self._running if job.finish is None]

    def _release(self, job: SimJob) -> None:
        """Returns a finished job's KV memory and keeps what it computed (prompt + output) cached, unless that was
        computed under weights since replaced."""
        if job.lease is not None:
            self.cache.release(job.lease, () if job.kv_stale else (*job.input_ids, *job.output_ids))
            job.lease = None

    def _publish(self, job: SimJob) -> None:
        job.deliver(job.output(self.tokenizer, self.weight_version))
        if job.finish is not None and job.log_metrics:
            self.metrics.observe_finished(job)

    def _update_gauges(self) -> None:
        """Called after every change to the queues or the KV memory they hold (all on the event loop), so a scrape
        between two iterations, or during a pause, reads what the engine holds."""
        self.metrics.num_running_reqs.set(len(self._running))
        self.metrics.num_queue_reqs.set(len(self._waiting))
        # The KV in use (SGLang's count of allocated KV): pinned prompt blocks once, then each running request's
        # partial last prompt block and the tokens it has generated; not the room reserved for max_new_tokens.
        size = self.cache.block_size
        private = sum(job.kv_tokens - len(job.lease.blocks) * size for job in self._running if job.lease is not None)
        self.metrics.num_used_tokens.set(self.cache.pinned_tokens + private)


def _deliverer(queue: LatestOutputs, index: int) -> Callable[[dict[str, Any]], None]:
    def deliver(out: dict[str, Any]) -> None:
        queue.put_nowait((index, out))

    return deliver


class SimEngineCore(ScheduledGeneration):
    """The engine core of the `sim` backend: the same surface as `EngineCore`, served by the same HTTP app."""

    backend: SimModel
    scheduler: SimScheduler

    def __init__(self, config: EngineConfig, registry: CollectorRegistry) -> None:
        self.config = config
        self.model_path = config.model_path
        # No request can hold more KV than the whole budget: SGLang's max_req_len is bounded by it too, so a default
        # or null max_new_tokens is clamped to what the budget leaves, and a longer explicit one is refused.
        self.backend = SimModel(
            context_length=min(config.context_length or 32768, config.sim_cache_tokens),
            vocab_size=config.sim_vocab_size,
        )
        self.tokenizer = SimTokenizer()
        self.metrics = EngineMetrics(registry, config.served_model_name or config.model_path)
        self.in_flight = {}
        latency = LatencyModel(
            prefill_secs_per_token=config.sim_prefill_us_per_token / 1e6,
            decode_secs_per_step=config.sim_decode_ms_per_step / 1e3,
            decode_secs_per_sequence=config.sim_decode_us_per_sequence / 1e6,
            decode_secs_per_kv_token=config.sim_decode_us_per_kv_token / 1e6,
        )
        self.cache = PrefixCache(config.sim_cache_tokens)
        self.scheduler = SimScheduler(config, self.cache, latency, self.metrics)
        self._requests = itertools.count()

    def _submit(self, req: GenerateRequest) -> tuple[list[SimJob], LatestOutputs]:
        specs = expand(req, self.tokenizer, self.backend.vocab_size, self.backend.context_length)
        queue = LatestOutputs()
        request = next(self._requests)
        keys = {spec.prompt_index: prompt_key(spec.input_ids) for spec in specs if spec.sample_index == 0}
        seed = self.config.random_seed
        jobs = [
            SimJob(
                rid=spec.rid,
                input_ids=spec.input_ids,
                params=spec.params,
                deliver=_deliverer(queue, k),
                return_logprob=spec.return_logprob,
                top_logprobs_num=spec.top_logprobs_num,
                return_text_in_logprobs=req.return_text_in_logprobs,
                stream=req.stream,
                log_metrics=req.log_metrics,
                sample_index=spec.sample_index,
                prefill_group=(request, spec.prompt_index),
                rng=output_rng(seed, keys[spec.prompt_index], spec.sample_index, spec.params.sampling_seed),
                top_rng=output_rng(
                    seed, keys[spec.prompt_index], spec.sample_index, spec.params.sampling_seed, purpose="top"
                )
                if spec.top_logprobs_num
                else None,
            )
            for k, spec in enumerate(specs)
        ]
        self._claim_rids(jobs)
        # max_new_tokens 0 too: such a request is prefilled, charged and cached like any other, as on SGLang.
        self.scheduler.submit(jobs)
        return jobs, queue

    def _empty_cache(self) -> None:
        self.cache.clear()

    async def update_weights_from_disk(self, req: UpdateWeightsFromDiskRequest) -> dict[str, Any]:
        """No weights to read: records the version and, as SGLang does after a load (unless told not to), empties
        the prefix cache."""
        check_disk_load(req)
        if req.abort_all_requests:
            self.scheduler.abort("", abort_all=True)
        await self._between_iterations(f"loading weights from {req.model_path}")
        running = self.scheduler.load_weights(req.weight_version, req.flush_cache)
        self.model_path = req.model_path
        if "weight_receiver" in vars(self):  # made once a group opens: before that, no part of a version came
            self.weight_receiver.whole_version_loaded()
        message = "Succeeded to update model weights."
        if req.weight_version is not None:
            message += f" Weight version updated to {req.weight_version}."
        return {"success": True, "message": message, "num_paused_requests": running}

    @property
    def weights_partial(self) -> bool:
        """As `EngineCore.weights_partial`, without making the receiver (and importing torch) to answer it."""
        return "weight_receiver" in vars(self) and self.weight_receiver.partial

    @functools.cached_property
    def weight_receiver(self) -> WeightReceiver:
        """Joins a trainer's group and receives its tensors like a real engine would, then drops them."""
        from rlfleet_engine.distributed_weights import WeightReceiver

        return WeightReceiver(
            check=lambda shapes, source: None,
            apply=self._discard_received,
            abort_all=lambda: self.scheduler.abort("", abort_all=True),
            timeout_s=self.config.weight_group_timeout_s,
        )

    async def _discard_received(self, tensors: dict[str, Any], req: UpdateWeightsFromDistributedRequest) -> int:
        await self._between_iterations(f"loading weights from weight update group {req.group_name!r}")
        return self.scheduler.load_weights(req.weight_version, req.flush_cache)

    async def _between_iterations(self, what: str) -> None:
        """Waits for the iteration under way, so a load lands between two, as on a model engine (bounded)."""
        try:
            async with asyncio.timeout(PAUSE_WAIT_S):
                await self.scheduler.between_steps()
        except TimeoutError as exc:
            raise DeadlineExceeded(
                f"{what}: the iteration under way did not end within {PAUSE_WAIT_S:.0f}s; nothing was loaded"
            ) from exc

    async def health_generate(self) -> bool:
        return self.scheduler.alive() and not self.paused_too_long()

    def server_info(self) -> dict[str, Any]:
        info = super().server_info()
        info["max_total_num_tokens"] = self.cache.max_tokens
        info["internal_states"][0].update(cache_hit_rate=self.cache.hit_rate, cached_tokens=self.cache.cached_tokens)
        info["backend"] = "sim"
        return info


def serve_sim(config: EngineConfig) -> None:
    """Serves SGLang's HTTP API over a `SimEngineCore` until the process is stopped."""
    from rlfleet_engine.http_app import create_app
    from rlfleet_engine.serving import serve_http

    registry = CollectorRegistry()
    core = SimEngineCore(config, registry)
    # SimEngineCore has every member of EngineCore the HTTP layer uses.
    app = create_app(core, registry)  # type: ignore[arg-type]
    serve_http(app, config, lambda: core.abort("", abort_all=True))
