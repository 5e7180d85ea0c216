"""Reading a batch's results back on the host: survival and exits, then tokens, log-
probabilities, grammar acceptance and speculative cycles, applied to each row in pass order.

``ModelRunner`` inherits it; it reads the runner's requests, model and grammars.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.worker.passes.pass_plan import PassPlan
from services.worker.passes.rows import LiveRow, end_loop, row_failed, token_sampled
from services.worker.passes.speculative import Speculation
from services.worker.sampling.logprobs import sampled_logprobs

if TYPE_CHECKING:
    from messages.batch import SampledLogprobs
    from services.worker.model.ouro import OuroModel
    from services.worker.passes.rows import RowCursor
    from services.worker.sampling.grammar import RequestGrammar

NAN_LOGITS = "the model produced NaN logits"


class ResultReader:
    requests: dict[str, RowCursor]
    model: OuroModel
    constrained: dict[str, RequestGrammar]

    # ------------------------------------------------------------------ results
    def _spec_coda(
        self,
        live: LiveRow,
        plan: PassPlan,
        j: int,
        token: float,
        bad: float,
        logprobs: SampledLogprobs | None,
    ) -> None:
        """A speculative row's coda: a draft token or the target's (the cycle decides)."""
        kept = live.keep_logits and plan.logits is not None
        logits = plan.logits[j] if kept else None
        raw = plan.raw_logits[j] if kept and plan.raw_logits is not None else None
        error = NAN_LOGITS if bad else None
        Speculation.coda(live, int(token), logits, error, logprobs, raw)

    def _read_results(self, plans: list[PassPlan], values: list[float]) -> None:
        """Applies every pass's results in order: survival and exits, then tokens."""
        at = 0
        for plan in plans:
            n, c = plan.shape.num_decode, plan.shape.num_coda
            exited: set[int] = set()
            for j, (live, loops) in enumerate(zip(plan.decode, plan.decode_loops, strict=True)):
                did_exit = values[at + n + j] != 0.0
                if live.spec is not None:
                    Speculation.loop_ended(
                        live, loops_run=loops, exited=did_exit, remaining=values[at + j]
                    )
                else:
                    cursor = self.requests[live.row.request_id]
                    end_loop(
                        live, cursor, loops_run=loops, exited=did_exit, remaining=values[at + j]
                    )
                if did_exit:
                    exited.add(id(live))
            at += 2 * n
            tokens, bad = values[at : at + c], values[at + c : at + 2 * c]
            at += 2 * c
            top = plan.logprobs_top
            width = 1 + 2 * min(top, self.model.vocab_size) if top >= 0 else 0
            scored = values[at : at + c * width]
            at += c * width
            for j, (live, wanted) in enumerate(zip(plan.coda, plan.coda_wanted, strict=True)):
                if not wanted:
                    continue
                n_top = self.requests[live.row.request_id].sampling.logprobs
                if live.spec is not None:
                    # (read after the pass: the row's depth is the loops it has run)
                    if id(live) in exited or live.coda_at == live.depth:
                        lp = None  # plain decoding reports the exit coda's
                        if n_top is not None and width and id(live) in exited:
                            lp = sampled_logprobs(scored[j * width : (j + 1) * width], n_top)
                        self._spec_coda(live, plan, j, tokens[j], bad[j], lp)
                    continue
                if live.is_decode and id(live) not in exited:
                    continue
                cursor = self.requests[live.row.request_id]
                if bad[j]:
                    sampling = cursor.sampling
                    row_failed(
                        live,
                        cursor,
                        NAN_LOGITS
                        if sampling.temperature == 0.0
                        else "sampling failed: the row's logits or probabilities are not finite",
                    )
                    continue
                token = int(tokens[j])
                grammar = self.constrained.get(live.row.request_id) if self.constrained else None
                if grammar is not None:
                    problem = grammar.accept(token, live.row.output_index)
                    if problem is not None:
                        row_failed(live, cursor, problem)
                        continue
                token_sampled(live, cursor, token)
                if n_top is not None and width:
                    columns = scored[j * width : (j + 1) * width]
                    live.result.logprobs = sampled_logprobs(columns, n_top)
