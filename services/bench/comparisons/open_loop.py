"""Requests played against one in-process engine on a ``VirtualClock``, closed loop
(``concurrency`` clients) or open loop (``arrivals``), and the numbers one run yields: the
driver the overload and sparse-prefill comparisons share."""

from __future__ import annotations

import hashlib
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from messages.api import ErrorEvent, FinishedEvent, TokenEvent
from messages.sampling import SamplingParams
from services.bench.metrics import percentile
from services.bench.workloads import RequestSpec
from services.engine.engine import LLMEngine
from services.worker.sim import SimRunner


@dataclass
class Outcome:
    """What one request saw."""

    arrival: float
    refused: bool = False
    token_times: list[float] = field(default_factory=list)
    finished: FinishedEvent | None = None
    finish_time: float | None = None


@dataclass
class Slo:
    ttft_s: float
    itl_s: float

    def met(self, o: Outcome) -> bool:
        if o.finished is None or not o.token_times:
            return False
        if o.token_times[0] - o.arrival > self.ttft_s:
            return False
        gaps = [b - a for a, b in zip(o.token_times, o.token_times[1:], strict=False)]
        return not gaps or (percentile(gaps, 99) or 0.0) <= self.itl_s


def _params(spec: RequestSpec) -> SamplingParams:
    # greedy, ignore_eos, the API's exit defaults (fixed depth, min_loops 2): every arm asks
    # for the same tokens at full depth, so only shedding can change them
    return SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)


class VirtualClock:
    """Seconds as if this process had a core of its own: its CPU time, the simulated
    device's sleep it stands for (``sim``), and the idle time skipped by ``skip_to``."""

    def __init__(self, sim: SimRunner | None = None) -> None:
        self._sim = sim
        self._skipped = 0.0
        self._cpu0 = time.process_time()
        self._device0 = self._device_s()

    def _device_s(self) -> float:
        return 0.0 if self._sim is None else self._sim.simulated_s * self._sim.cost.dilation

    def now(self) -> float:
        cpu = time.process_time() - self._cpu0
        return cpu + self._device_s() - self._device0 + self._skipped

    def skip_to(self, t: float) -> None:
        """Nothing runs until ``t``: the engine waits idle for an arrival."""
        self._skipped += max(0.0, t - self.now())


def drive(
    engine: LLMEngine,
    clock: VirtualClock,
    specs: list[RequestSpec],
    *,
    concurrency: int | None = None,
    arrivals: list[float] | None = None,
    max_waiting: int | None = None,
) -> tuple[list[Outcome], float]:
    """Plays ``specs`` closed-loop (``concurrency`` clients) or open-loop (``arrivals``,
    seconds from the start); returns each request's outcome and the run's wall seconds."""
    ids = [f"o-{i}" for i in range(len(specs))]
    index = {rid: i for i, rid in enumerate(ids)}
    outcomes: list[Outcome | None] = [None] * len(specs)
    unsent = deque(range(len(specs)))
    done = 0

    def send(i: int, due: float) -> None:
        nonlocal done
        if max_waiting is not None and engine.scheduler.num_waiting() >= max_waiting:
            outcomes[i] = Outcome(due, refused=True)
            done += 1
            return
        engine.add_request(ids[i], list(specs[i].prompt_token_ids), _params(specs[i]))
        outcomes[i] = Outcome(due)

    start = clock.now()
    if arrivals is None:
        for _ in range(min(concurrency or 1, len(unsent))):
            send(unsent.popleft(), start)
    while done < len(specs):
        if arrivals is not None:
            now = clock.now()
            while unsent and start + arrivals[unsent[0]] <= now:
                i = unsent.popleft()
                send(i, start + arrivals[i])  # TTFT counts from when it was due
        if not engine.has_unfinished_requests():
            if unsent and arrivals is not None:
                clock.skip_to(start + arrivals[unsent[0]])
                continue
            if done < len(specs):
                raise RuntimeError("the engine went idle with requests outstanding")
        events = engine.step()
        t = clock.now()
        for event in events:
            o = outcomes[index[event.request_id]]
            assert o is not None
            if isinstance(event, TokenEvent):
                o.token_times.append(t)
            elif isinstance(event, FinishedEvent):
                o.finished, o.finish_time = event, t
                done += 1
                if arrivals is None and unsent:
                    send(unsent.popleft(), t)
            elif isinstance(event, ErrorEvent):
                raise RuntimeError(f"{event.request_id}: [{event.code}] {event.message}")
    wall = clock.now() - start
    return [o for o in outcomes if o is not None], wall


def run_metrics(outcomes: list[Outcome], wall: float, slo: Slo | None) -> dict[str, Any]:
    """One run's numbers. Goodput divides by the span of the arrivals, the same for both arms
    at one load, so its ratio is the ratio of requests served within the SLO (a faster drain
    after the last arrival earns nothing)."""
    finished = [o.finished for o in outcomes if o.finished is not None]
    decode = [d for f in finished for d in f.exit_depths[1:]]
    shed = sum(f.shed_tokens for f in finished)
    ttft = [o.token_times[0] - o.arrival for o in outcomes if o.token_times]
    itl = [b - a for o in outcomes for a, b in zip(o.token_times, o.token_times[1:], strict=False)]
    digest = hashlib.blake2b(digest_size=8)
    for o in outcomes:
        f = o.finished
        digest.update(repr(None if f is None else (f.token_ids, f.exit_depths)).encode())
    good = sum(slo.met(o) for o in outcomes) if slo is not None else None
    span = max(o.arrival for o in outcomes) - min(o.arrival for o in outcomes)
    return {
        "wall_s": wall,
        "offered": len(outcomes),
        "finished": len(finished),
        "refused_fraction": sum(o.refused for o in outcomes) / len(outcomes),
        "requests_per_s": len(finished) / wall if wall else None,
        "goodput_rps": good / span if good is not None and span else None,
        "good_share": good / len(outcomes) if good is not None else None,
        "mean_loops_per_token": statistics.fmean(decode) if decode else None,
        "shed_token_share": shed / len(decode) if decode else 0.0,
        "ttft_ms_p99": _ms(percentile(ttft, 99)),
        "ttft_ms_p50": _ms(percentile(ttft, 50)),
        "itl_ms_p99": _ms(percentile(itl, 99)),
        "digest": digest.hexdigest(),
    }


def steady_throughput(outcomes: list[Outcome]) -> float:
    """A closed loop's requests/s while every client had a request in flight: finishes from
    the first one to the last send (the ramp before and the drain after leave seats idle)."""
    first = min(o.finish_time for o in outcomes if o.finish_time is not None)
    last_send = max(o.arrival for o in outcomes)
    done = sum(
        1 for o in outcomes if o.finish_time is not None and first < o.finish_time <= last_send
    )
    if last_send <= first or not done:
        raise RuntimeError("too few requests per client to measure a steady closed loop")
    return done / (last_send - first)


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3
