"""A request resumed on another shard keeps the token-sparse prefill setting the shard that
first ran it resolved, whatever the new shard's defaults: the scheduler says it in its
``accepted`` notice, admission keeps it with the request, and a move carries it to the
scheduler there, which runs the prompt under it (or refuses it by name if it cannot)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from messages.errors import RequestError
from messages.internal import AdmittedRequest
from messages.sampling import PrefillSetting, SamplingParams, SparsePrefill
from services.admission.tables import OpenRequests
from services.common.checkpoint import load_model_limits
from services.common.config import SchedulerConfig
from services.common.sparse_prefill import FLASHLOOP_RETENTION, SparseSchedule
from services.runtime import subjects
from services.scheduler.driver.driver import SchedulerDriver

pytestmark = pytest.mark.unit

TRACK = "rlt.v1.adm.a1.1"
SPARSE_SHARD = SchedulerConfig(
    block_size=4, num_blocks=64, token_sparse_prefill=True, sparse_window=8
)
DENSE_SHARD = SchedulerConfig(block_size=4, num_blocks=64, sparse_window=32)


def _admitted(**fields: object) -> AdmittedRequest:
    return AdmittedRequest(
        request_id="r", prompt_token_ids=list(range(1, 20)), reply_subject="_INBOX.r",
        params=SamplingParams(max_tokens=4, temperature=0.0), admission_id="a1",
        admission_seq=1, relay_subject=subjects.admission_relay("a1"), **fields,  # type: ignore[arg-type]
    )  # fmt: skip


def test_a_moved_request_keeps_the_setting_its_first_shard_resolved(toy_checkpoint: Path) -> None:
    limits = load_model_limits(toy_checkpoint)
    first = SchedulerDriver(SPARSE_SHARD, limits)
    out = first.add(_admitted(), track=TRACK)
    ((_, notice),) = out.notices
    want = PrefillSetting(sparse_prefill=SparsePrefill(window=8, retention=FLASHLOOP_RETENTION))
    assert notice.state == "accepted" and notice.prefill_setting == want
    # admission keeps it with the request, so a move carries it
    table = OpenRequests(scheduler_lost_s=5.0)
    table.opened(1, "r", "_INBOX.r", "", 0.0, shard="0", admitted=_admitted())
    table.notice(1, notice, 0.1)
    entry = table.find("r")
    assert entry is not None and entry.admitted is not None
    other = SchedulerDriver(DENSE_SHARD, limits)
    moved = entry.resumed(entry.admitted, 2, other.shard_id)
    assert moved.prefill_setting == want
    # a shard whose own default is dense (another window, too) runs it as the first did
    other.add(moved, track="rlt.v1.adm.a1.2")
    assert other.scheduler.requests["r"].sparse == SparseSchedule.of(8, FLASHLOOP_RETENTION)
    # and a dense request stays dense on a shard whose default is sparse
    dense = msgspec.structs.replace(moved, prefill_setting=PrefillSetting())
    again = SchedulerDriver(SPARSE_SHARD, limits)
    again.add(dense, track="rlt.v1.adm.a1.3")
    assert again.scheduler.requests["r"].sparse is None


def test_a_carried_setting_a_shard_cannot_run_is_refused_by_name(toy_checkpoint: Path) -> None:
    limits = load_model_limits(toy_checkpoint)
    atomic = SchedulerDriver(
        SchedulerConfig(block_size=4, num_blocks=64, split_prefill=False), limits
    )
    setting = PrefillSetting(sparse_prefill=SparsePrefill(window=8, retention=(1.0, 1.0, 0.5)))
    scheduler = SchedulerDriver(DENSE_SHARD, limits).scheduler
    params = SamplingParams(max_tokens=4)
    with pytest.raises(RequestError, match="3 entries; this model runs 4 loops"):
        scheduler.add_request("a", [1, 2, 3], params, prefill_setting=setting)
    good = PrefillSetting(sparse_prefill=SparsePrefill(window=8, retention=FLASHLOOP_RETENTION))
    with pytest.raises(RequestError, match="atomic prefill"):
        atomic.scheduler.add_request("b", [1, 2, 3], params, prefill_setting=good)
    zero = PrefillSetting(sparse_prefill=SparsePrefill(window=0, retention=FLASHLOOP_RETENTION))
    with pytest.raises(RequestError, match="window must be >= 1"):
        scheduler.add_request("c", [1, 2, 3], params, prefill_setting=zero)
