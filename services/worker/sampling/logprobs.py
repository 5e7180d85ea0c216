"""Log-probabilities as the worker reports them (vLLM's conventions): over the raw logits,
before temperature and top-k/top-p, floored at ``LOGPROB_FLOOR``. A sampled token's come
back with the pass's other results (``logprob_columns``, ``sampled_logprobs``); a prompt's
are scored once the batch's passes are done (``score_prompts``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from messages.batch import PromptLogprobs, SampledLogprobs

if TYPE_CHECKING:  # annotations only: the simulated device imports this module, not the model
    from services.worker.model.ouro import OuroModel
    from services.worker.passes.pass_plan import RequestView
    from services.worker.passes.rows import LiveRow
    from services.worker.passes.transfer import Transfer

_PROMPT_SLICE = 256  # prompt positions scored at once (the table is positions x vocab)

# the least log-probability reported (vLLM's floor): -inf and NaN have no JSON form
LOGPROB_FLOOR = -9999.0

# per row: the chosen token's log-probability, the best ids and their log-probabilities
Scored = tuple[float, list[int], list[float]]


def logprob_columns(logits: torch.Tensor, chosen: torch.Tensor, top: int) -> torch.Tensor:
    """Per row of ``logits`` [N, V], on the device: float32 [N, 1 + 2 * top] holding the
    chosen token's log-probability, the ``top`` best log-probabilities, then their ids
    (exact in float32 below 2**24, far above any vocabulary). One batched log-softmax; a
    row with an infinite logit has no finite distribution, so values are floored."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    logprobs = torch.nan_to_num(logprobs, nan=LOGPROB_FLOOR, posinf=0.0).clamp_(min=LOGPROB_FLOOR)
    columns = [logprobs.gather(1, chosen.long()[:, None])]
    k = min(top, logprobs.shape[-1])
    if k:
        values, ids = logprobs.topk(k, dim=-1)
        columns += [values, ids]
    return torch.cat([c.float() for c in columns], dim=1)


def token_logprob(logits: torch.Tensor, token: int) -> float:
    """One row's ``logits`` [V]: ``token``'s log-probability as ``logprob_columns`` gives it."""
    return float(
        logprob_columns(logits[None], torch.tensor([token], device=logits.device), 0)[0, 0]
    )


def read_scored(host_rows: list[list[float]]) -> list[Scored]:
    """``logprob_columns`` rows, copied to the host, as (chosen, top ids, top values); a
    row's width says how many tops it holds."""
    return [_scored(r, (len(r) - 1) // 2) for r in host_rows]


def _scored(r: list[float], top: int) -> Scored:
    return r[0], [int(t) for t in r[1 + top :]], r[1 : 1 + top]


def sampled_logprobs(columns: list[float], n_top: int) -> SampledLogprobs:
    """One coda row's ``logprob_columns`` on the host, cut to the ``n_top`` it asked for."""
    ((chosen, ids, vals),) = read_scored([columns])
    return SampledLogprobs(logprob=chosen, top_ids=ids[:n_top], top_logprobs=vals[:n_top])


def score_prompts(
    model: OuroModel,
    transfer: Transfer,
    requests: Mapping[str, RequestView],
    prompt_rows: list[tuple[LiveRow, torch.Tensor]],
) -> None:
    """Prefill rows at their final depth (with their hidden rows), for requests that asked
    for prompt logprobs: position p's logits score prompt token p + 1. A coda, a
    log-softmax and a copy to the host per ``_PROMPT_SLICE`` of their positions; each
    row's ``result.prompt_logprobs`` is set."""
    hidden: list[torch.Tensor] = []
    targets: list[int] = []
    spans: list[tuple[LiveRow, int, int, int]] = []  # row, first scored, count, top
    for live, h in prompt_rows:
        req = requests[live.row.request_id]
        n_top = req.sampling.prompt_logprobs
        assert n_top is not None  # only such rows are collected
        start = live.row.token_start
        count = min(h.shape[0], len(req.prompt) - 1 - start)  # the last has no next
        if count <= 0:
            continue
        hidden.append(h[:count])
        targets += req.prompt[start + 1 : start + 1 + count]
        spans.append((live, start + 1, count, n_top))
    if not spans:
        return
    hidden_rows = torch.cat(hidden)
    words = transfer.host_words(len(targets))
    words[:] = targets
    ids = transfer.to_device(words)
    top = max(n for *_, n in spans)
    table = []
    # in slices: a [positions, vocab] float32 table of a whole batch could be large
    for lo in range(0, len(targets), _PROMPT_SLICE):
        logits = model.coda(hidden_rows[lo : lo + _PROMPT_SLICE])
        columns = logprob_columns(logits, ids[lo : lo + _PROMPT_SLICE], top)
        table += read_scored(transfer.to_host(columns).tolist())
    row = 0
    for live, start, count, n in spans:
        rows = table[row : row + count]
        row += count
        live.result.prompt_logprobs = PromptLogprobs(
            start=start,
            logprobs=[chosen for chosen, _, _ in rows],
            top_ids=[top_ids[:n] for _, top_ids, _ in rows],
            top_logprobs=[values[:n] for _, _, values in rows],
        )
