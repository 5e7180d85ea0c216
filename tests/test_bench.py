"""``rlt bench`` on the toy checkpoint with --quick: the result schema, ratios that are
recomputable from the per-run numbers, and the building blocks (percentiles, workloads,
metrics, the runner probe)."""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

from services.bench.metrics import (
    EngineCounters,
    RequestRecord,
    RunRecord,
    percentile,
    run_metrics,
)
from services.bench.probe import RunnerProbe
from services.bench.workloads import (
    EARLY_EXIT,
    QUICK,
    TokenRange,
    chat_closed,
    poisson_arrivals,
    shared_prefix,
)
from services.cli import build_parser, main
from services.common.config import SchedulerConfig
from services.engine.engine import LLMEngine

RUN_KEYS = {
    "output_tokens_per_s",
    "requests_per_s",
    "ttft_ms_p50",
    "ttft_ms_p90",
    "ttft_ms_p99",
    "itl_ms_p50",
    "itl_ms_p90",
    "itl_ms_p99",
    "mean_exit_depth",
    "core_passes",
    "core_rows_per_pass",
    "core_passes_per_output_token",
    "decode_passes_per_decode_token",
    "prefix_hit_rate",
    "host_us_per_batch",
}


@pytest.fixture
def keep_global_state() -> Iterator[None]:
    """main_bench quiets structlog; give the rest of the session its config back."""
    saved = structlog.get_config()
    threads = torch.get_num_threads()
    yield
    structlog.configure(**saved)
    assert torch.get_num_threads() == threads  # the bench restores what it changed


def _bench(checkpoint: Path, out: Path, *extra: str) -> dict[str, Any]:
    argv = ["bench", "--quick", "--checkpoint", str(checkpoint), "--concurrency", "4"]
    argv += ["--out", str(out), "--no-progress", *extra]
    assert main(argv) == 0
    return json.loads((out / "results.json").read_text())


def _recompute(results: dict[str, Any]) -> None:
    """Every ratio equals numerator/denominator of the runs stored next to it."""
    repeats = results["settings"]["repeats"]
    for comp in results["comparisons"]:
        runs = {(r["workload"], r["arm"], r["repeat"]): r["metrics"] for r in comp["runs"]}
        for ratio in comp["ratios"]:
            expected = []
            for rep in range(repeats):
                num = runs[(ratio["workload"], ratio["numerator"], rep)][ratio["metric"]]
                den_workload = ratio.get("denominator_workload") or ratio["workload"]
                den = runs[(den_workload, ratio["denominator"], rep)][ratio["metric"]]
                if ratio["kind"] == "value":
                    expected.append(num)
                elif ratio["kind"] == "difference":
                    expected.append(num - den)
                else:
                    expected.append(num / den)
            assert ratio["per_repeat"] == pytest.approx(expected), ratio["label"]
            assert ratio["min"] == pytest.approx(min(expected))
            assert ratio["median"] == pytest.approx(statistics.median(expected))
            assert ratio["max"] == pytest.approx(max(expected))
            if ratio["target"] is not None:
                t = ratio["target"]
                ok = (t["low"] is None or ratio["median"] >= t["low"]) and (
                    t["high"] is None or ratio["median"] <= t["high"]
                )
                assert ratio["reached"] is ok


@pytest.mark.services
def test_quick_bench_schema_and_ratios(
    toy_checkpoint: Path, tmp_path: Path, keep_global_state: None
) -> None:
    only = "depth_batching,wcpb,prefix_cache"
    results = _bench(toy_checkpoint, tmp_path, "--repeats", "2", "--only", only)

    assert results["schema"] == "rlt-bench/1"
    assert results["command"].startswith("rlt bench --quick --checkpoint")
    assert {"date", "machine", "model", "settings", "elapsed_s", "targets"} <= set(results)
    names = [c["name"] for c in results["comparisons"]]
    assert names == only.split(",")
    for comp in results["comparisons"]:
        cases = {(w["name"], a["name"]) for w in comp["workloads"] for a in comp["arms"]}
        cases -= {tuple(p) for p in comp["skipped"]}
        # every case ran once per repeat, interleaved: repeat 0 of all cases before repeat 1
        assert len(comp["runs"]) == 2 * len(cases)
        assert [r["repeat"] for r in comp["runs"]] == sorted(r["repeat"] for r in comp["runs"])
        for run in comp["runs"]:
            m = run["metrics"]
            assert set(m) >= RUN_KEYS
            assert m["output_tokens_per_s"] > 0 and m["ttft_ms_p50"] > 0
            assert m["core_passes"] == m["runner_core_passes"]  # probe agrees with the runner
            assert 1 <= m["mean_exit_depth"] <= 4
    _recompute(results)

    by_name = {c["name"]: c for c in results["comparisons"]}
    # forced depth: every token runs all 4 loops, so refill cannot save a pass
    forced = [r for r in by_name["depth_batching"]["runs"] if r["workload"] == "chat_forced"]
    assert {r["metrics"]["mean_exit_depth"] for r in forced} == {4.0}
    # identical greedy work: the same number of tokens in every arm
    tokens = {r["metrics"]["output_tokens"] for r in by_name["depth_batching"]["runs"]}
    assert len(tokens) == 1  # early / forced share prompts and lengths
    prefix_runs = by_name["prefix_cache"]["runs"]
    assert all(r["metrics"]["prefix_hit_rate"] == 0 for r in prefix_runs if r["arm"] == "off")
    assert any(r["metrics"]["prefix_hit_rate"] > 0 for r in prefix_runs if r["arm"] == "on")
    # a burst: only requests that wait for a prefix still in flight can hit
    burst = {
        (r["arm"], r["repeat"]): r["metrics"]["prefix_hit_rate"]
        for r in prefix_runs
        if r["workload"] == "shared_prefix_burst"
    }
    for repeat in range(2):
        assert burst[("on", repeat)] > burst[("on_no_share", repeat)]
    # WCPB: capacity measured per arm, then one open-loop workload per offered load
    wcpb = by_name["wcpb"]
    assert [w["name"] for w in wcpb["workloads"]] == ["mixed_load35", "mixed_load60"]
    assert {w["mode"] for w in wcpb["workloads"]} == {"open"}
    cal = wcpb["calibration"]["mixed"]
    lowest = min(cal["closed_loop_requests_per_s"].values())
    assert [x["rate"] for x in cal["loads"]] == pytest.approx([0.35 * lowest, 0.6 * lowest])
    assert {r["workload"] for r in wcpb["ratios"]} == {"mixed_load35", "mixed_load60"}

    report = (tmp_path / "report.md").read_text()
    for comp in results["comparisons"]:
        assert comp["title"] in report
    assert results["command"] in report
    pytest.importorskip("matplotlib")
    assert all((tmp_path / f"{n}.png").stat().st_size > 0 for n in names)


@pytest.mark.services
def test_quick_bench_pipeline(
    toy_checkpoint: Path, tmp_path: Path, keep_global_state: None
) -> None:
    results = _bench(toy_checkpoint, tmp_path, "--repeats", "1", "--only", "pipeline", "--no-plots")
    (comp,) = results["comparisons"]
    _recompute(results)
    runs = {r["arm"]: r["metrics"] for r in comp["runs"]}
    assert set(runs) == {
        "in_process",
        "pipeline",
        "in_process_async",
        "pipeline_async",
        "pipeline_1proc",
        "pipeline_1proc_async",
        "in_process_sim",
        "pipeline_sim",
        "in_process_sim_async",
        "pipeline_sim_async",
    }
    arms = {a["name"]: a for a in comp["arms"]}
    assert {n for n, a in arms.items() if a["simulated"]} == {n for n in runs if "_sim" in n}
    # every pipeline serves exactly the same greedy work; a process per service reports its
    # worker's counters from the worker's health reply, the in-process services from a probe
    for arm in ("pipeline", "pipeline_1proc"):
        assert runs[arm]["output_tokens"] == runs["in_process"]["output_tokens"]
        assert runs[arm]["mean_exit_depth"] == runs["in_process"]["mean_exit_depth"]
        # (how arrivals fall between steps, and so the batches, depends on timing)
        assert runs[arm]["core_passes"] > 0 and runs[arm]["batches"] > 0
    targets = [r for r in comp["ratios"] if r["target"] is not None]
    assert len(targets) == 4 and all("per_repeat" in r and "reached" in r for r in targets)
    # where the gap is: time executing and TTFT split at the opening burst, for both modes
    for mode in ("sync", "async"):
        labels = {r["label"] for r in comp["ratios"] if r["label"].endswith(f"({mode})")}
        assert f"time executing a batch, pipeline / in-process ({mode})" in labels
        assert f"TTFT p50 of the opening burst, pipeline / in-process ({mode})" in labels
    for arm in ("in_process_async", "pipeline_async"):
        assert runs[arm]["execute_us_per_batch"] > 0
        assert runs[arm]["ttft_ms_opening_p50"] > 0 and runs[arm]["ttft_ms_later_p50"] > 0
    # on the simulated device the same requests give as many (simulated) tokens, and every
    # sim arm counts its batches and their (simulated) device time
    for arm in ("in_process_sim", "pipeline_sim", "in_process_sim_async", "pipeline_sim_async"):
        assert runs[arm]["output_tokens"] == runs["in_process"]["output_tokens"]
        assert runs[arm]["batches"] > 0 and runs[arm]["execute_us_per_batch"] > 0
    # where the CPU went: the engine's process in-process, every process of the pipeline
    assert runs["in_process"]["cpu_us_per_batch_engine"] > 0
    assert 0 < runs["in_process"]["cpu_cores_busy"] <= torch.get_num_threads() + 0.5
    for key in ("worker", "scheduler", "admission", "nats_server", "client"):
        assert runs["pipeline_async"][f"cpu_us_per_batch_{key}"] > 0
    assert runs["pipeline_async"]["cpu_cores_busy"] > 0
    sim_labels = [r["label"] for r in comp["ratios"] if "SIMULATED" in r["label"]]
    assert len(sim_labels) == 6 and all(
        r["target"] is None for r in comp["ratios"] if "SIMULATED" in r["label"]
    )
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.services
def test_quick_bench_kv_pressure(
    toy_checkpoint: Path, tmp_path: Path, keep_global_state: None
) -> None:
    argv = ("--repeats", "1", "--only", "kv_pressure", "--no-plots")
    results = _bench(toy_checkpoint, tmp_path, *argv)
    (comp,) = results["comparisons"]
    _recompute(results)
    runs = {r["arm"]: r["metrics"] for r in comp["runs"]}
    assert {"reserve", "incremental"} <= set(runs) and any(a.startswith("watermark") for a in runs)
    # the same greedy tokens everywhere: short answers stop at the same stop id in every arm
    assert len({m["output_tokens"] for m in runs.values()}) == 1
    assert runs["reserve"]["output_tokens"] < comp["workloads"][0]["output_tokens"]["total"]
    # the pool is tight: seats-only admission thrashes, reservation never preempts but
    # holds KV the early stops never write
    assert runs["incremental"]["preemptions"] > 0
    assert runs["incremental"]["recomputed_prompt_tokens_per_output_token"] > 0
    assert runs["reserve"]["preemptions"] == 0
    assert 0 < runs["reserve"]["reserved_unused_share"] < 1
    assert runs["incremental"]["reserved_unused_share"] is None  # it reserves nothing
    value = next(r for r in comp["ratios"] if r["kind"] == "value")
    default = value["numerator"]
    assert value["per_repeat"] == [runs[default]["recomputed_prompt_core_share"]]
    assert "core share recomputing prompts" in (tmp_path / "report.md").read_text()


@pytest.mark.unit
def test_cli_rejects_unknown_comparison() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--only", "depth_batching,nope"])
    args = build_parser().parse_args(["bench", "--only", "wcpb, pipeline"])
    assert args.only == ["wcpb", "pipeline"]
    assert args.repeats == 3 and args.concurrency == 32 and args.size == "small"


@pytest.mark.services
def test_quick_bench_runs_only_the_arms_named(
    toy_checkpoint: Path, tmp_path: Path, keep_global_state: None
) -> None:
    """--arms (a time-boxed GPU lease): only those arms run, a ratio only with both of its
    arms, a comparison left without arms is dropped, and the report's command says so."""
    argv = ("--repeats", "1", "--no-plots", "--only", "depth_batching,wcpb")
    results = _bench(toy_checkpoint, tmp_path, *argv, "--arms", "refill, cohort,serial")
    (comp,) = results["comparisons"]
    assert comp["name"] == "depth_batching"
    assert [a["name"] for a in comp["arms"]] == ["refill", "cohort", "serial"]
    assert {r["arm"] for r in comp["runs"]} == {"refill", "cohort", "serial"}
    pairs = {(r["numerator"], r["denominator"]) for r in comp["ratios"]}
    assert ("refill", "cohort") in pairs and ("refill", "serial") in pairs
    assert not any("atomic" in arm for pair in pairs for arm in pair)
    targets = [t for t in results["targets"] if t["comparison"] == "depth_batching"]
    assert targets and all(t["numerator"] == "refill" for t in targets)
    _recompute(results)
    assert "--arms refill,cohort,serial" in results["command"]


@pytest.mark.unit
def test_bench_refuses_an_arm_no_comparison_has(
    toy_checkpoint: Path,
    tmp_path: Path,
    keep_global_state: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "--quick", "--checkpoint", str(toy_checkpoint), "--no-progress"]
    argv += ["--out", str(tmp_path), "--only", "wcpb", "--arms", "wcpb,wcbp"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "unknown arm(s) wcbp" in err and "atomic, wcpb" in err
    assert not (tmp_path / "results.json").exists()  # nothing ran


@pytest.mark.unit
def test_percentile_matches_linear_interpolation() -> None:
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile([], 50) is None


@pytest.mark.unit
def test_run_metrics_from_timestamps() -> None:
    a = RequestRecord(arrival=0.0, num_prompt_tokens=10, num_cached_tokens=4)
    a.token_times, a.finish_time, a.exit_depths = [0.1, 0.3, 0.6], 0.6, [4, 2, 1]
    b = RequestRecord(arrival=0.5, num_prompt_tokens=10)
    b.token_times, b.finish_time, b.exit_depths = [0.7, 0.8], 0.8, [4, 3]
    m = run_metrics(RunRecord(start=0.0, end=1.0, requests=[a, b]))
    assert m["output_tokens"] == 5 and m["output_tokens_per_s"] == pytest.approx(5.0)
    assert m["ttft_ms_mean"] == pytest.approx(150.0)  # (0.1 + 0.2) / 2
    assert m["itl_ms_p50"] == pytest.approx(200.0)  # gaps 0.2, 0.3, 0.1
    assert m["mean_exit_depth"] == pytest.approx(14 / 5)
    assert m["prefix_hit_rate"] == pytest.approx(4 / 20)
    assert m["core_passes"] is None  # no counters: reported as n/a, never as 0
    assert m["execute_us_per_batch"] is None
    # a sent with the opening burst (at the run's start), b later
    assert m["ttft_ms_opening_p50"] == pytest.approx(100.0)
    assert m["ttft_ms_later_p50"] == pytest.approx(200.0)


@pytest.mark.unit
def test_run_metrics_time_executing_per_batch() -> None:
    counters = EngineCounters(batches=4, execute_s=0.01)
    m = run_metrics(RunRecord(start=0.0, end=0.02, requests=[], counters=counters))
    assert m["execute_us_per_batch"] == pytest.approx(2500.0)
    assert m["host_us_per_batch"] == pytest.approx(2500.0)  # the other half of the wall time
    assert m["ttft_ms_opening_p50"] is None  # no requests: n/a


@pytest.mark.unit
def test_workloads_are_seeded() -> None:
    vocab = TokenRange(1, 512, (0,))
    w1 = chat_closed(QUICK, vocab, 4, EARLY_EXIT, seed=7)
    w2 = chat_closed(QUICK, vocab, 4, EARLY_EXIT, seed=7)
    w3 = chat_closed(QUICK, vocab, 4, EARLY_EXIT, seed=8)
    assert w1.requests == w2.requests != w3.requests
    assert w1.num_requests == 4 * QUICK.chat_requests_per_client
    opened = w1.with_rate(10.0)
    assert opened.requests == w1.with_rate(10.0).requests
    prompts = [r.prompt_token_ids for r in w1.requests]
    assert [r.prompt_token_ids for r in opened.requests] == prompts
    sp = shared_prefix(QUICK, vocab, 2, seed=0)
    heads = {tuple(r.prompt_token_ids[: QUICK.prefix_tokens]) for r in sp.requests}
    assert len(heads) <= QUICK.prefix_groups
    gaps = poisson_arrivals(4000, 20.0, random.Random(1))
    assert gaps[0] == 0.0 and gaps[-1] / 3999 == pytest.approx(1 / 20.0, rel=0.1)


@pytest.mark.unit
def test_probe_counts_passes_and_rows(toy_checkpoint: Path) -> None:
    from messages.sampling import SamplingParams

    engine = LLMEngine.from_checkpoint(
        toy_checkpoint, SchedulerConfig(num_blocks=256, split_prefill=False, async_scheduling=False)
    )
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with RunnerProbe(engine.runner) as probe:
        engine.generate([[5, 6, 7], [8, 9]], params)
    c = probe.counters
    assert c.core_passes == c.runner_core_passes == engine.runner.num_core_passes > 0
    # one atomic prefill batch (5 prompt rows x 4 loops) gives each request its first token;
    # then 2 more tokens, each 4 single-loop decode batches (fixed depth) of 2 rows
    assert c.core_rows == 5 * 4 + 2 * 4 * 2
    assert c.decode_batches == 8 and c.batches == 9
    assert "execute" not in engine.runner.__dict__  # the probe removed its shadows

    # async: decode rows sent before the previous result (follow-ons) are decode rows too,
    # and they keep the same passes: prefill, then 4 decode batches per token
    config = SchedulerConfig(num_blocks=256, split_prefill=False, async_scheduling=True)
    engine = LLMEngine.from_checkpoint(toy_checkpoint, config)
    with RunnerProbe(engine.runner) as probe:
        engine.generate([[5, 6, 7], [8, 9]], params)
    assert (probe.counters.decode_batches, probe.counters.batches) == (8, 9)


@pytest.mark.unit
def test_simulated_engine_runs_the_passes_of_the_real_one(toy_checkpoint: Path) -> None:
    """The in-process engine on the simulated device (the bench's GPU-like arms) accounts
    exactly the batches and passes the real model runs, and its counters come from the
    runner's own stats."""
    from messages.sampling import SamplingParams
    from services.bench.probe import StatsProbe
    from services.worker.sim import SimRunner

    real = LLMEngine.from_checkpoint(
        toy_checkpoint, SchedulerConfig(num_blocks=256, split_prefill=False, async_scheduling=False)
    )
    sim_runner = SimRunner.h200(real.model.cfg)
    sim_runner.sleep = False
    sim = LLMEngine(real.model, real.config, simulated=sim_runner)
    assert sim.runner is sim_runner
    # full depth: the simulated device draws its exits, the toy model computes them
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, exit_threshold=1.0)
    with RunnerProbe(real.runner) as real_probe:
        real.generate([[5, 6, 7], [8, 9]], params)
    with StatsProbe(sim.runner) as sim_probe:
        out = sim.generate([[5, 6, 7], [8, 9]], params)
    a, b = real_probe.counters, sim_probe.counters
    assert (b.batches, b.decode_batches, b.core_passes, b.core_rows) == (
        a.batches,
        a.decode_batches,
        a.core_passes,
        a.core_rows,
    )
    assert [len(f.token_ids) for f in out] == [3, 3]
    assert sim_runner.simulated_s > 0  # device time charged, though nothing slept


@pytest.mark.unit
def test_in_process_arms_detokenize_like_the_pipeline(toy_checkpoint: Path) -> None:
    """The pipeline's scheduler turns every token into text; the in-process baseline does
    the same work (as `rlt generate --offline` does), or the bus is charged for it."""
    from messages.api import TokenEvent
    from messages.sampling import SamplingParams
    from services.bench.backends import InProcessBackend
    from services.bench.comparison import BackendKind
    from services.bench.runner import Bench

    bench = Bench(toy_checkpoint, "cpu", torch.float32)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for kind in (BackendKind.IN_PROCESS, BackendKind.IN_PROCESS_SIM):
        backend = bench.backend(kind)
        assert isinstance(backend, InProcessBackend)
        engine = backend.engine(SchedulerConfig(num_blocks=64))
        engine.add_request("r", [5, 6, 7], params)
        tokens = [e for e in engine.run_until_done() if isinstance(e, TokenEvent)]
        assert len(tokens) == 4 and "".join(t.text for t in tokens)  # text, not just ids
    bench.close()


@pytest.mark.unit
def test_cpu_per_batch_splits_a_runs_cpu_by_process() -> None:
    from services.bench.metrics import cpu_per_batch

    before = {"worker": 1.0, "nats-server": 0.5}
    after = {"worker": 1.2, "nats-server": 0.6}
    m = cpu_per_batch(before, after, batches=100, wall_s=0.5)
    assert m["cpu_us_per_batch_worker"] == pytest.approx(2000.0)
    assert m["cpu_us_per_batch_nats_server"] == pytest.approx(1000.0)
    assert m["cpu_cores_busy"] == pytest.approx(0.6)  # 0.3 CPU s in 0.5 s
    assert cpu_per_batch(before, after, batches=0, wall_s=0.0)["cpu_cores_busy"] is None
    # a process seen only at one end is unknown, and so is the total; never a silent 0
    m = cpu_per_batch(before, {**after, "client": 0.05}, batches=100, wall_s=0.5)
    assert m["cpu_us_per_batch_client"] is None and m["cpu_cores_busy"] is None
    assert m["cpu_us_per_batch_worker"] == pytest.approx(2000.0)


@pytest.mark.unit
def test_process_cpu_counts_a_child_and_its_ended_threads() -> None:
    import os
    import subprocess
    import sys

    from services.bench.processes import process_cpu_s

    busy = (
        "import threading, time\n"
        "def spin():\n"
        "    t = time.process_time() + 0.3\n"
        "    while time.process_time() < t: pass\n"
        "th = threading.Thread(target=spin); th.start(); th.join()\n"  # ends before we look
        "print('ready', flush=True); time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", busy], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        assert process_cpu_s(child.pid) >= 0.3  # the thread's CPU stays counted
    finally:
        child.kill()
        child.wait()
    assert process_cpu_s(child.pid) == 0.0  # gone: nothing, not an error
    assert process_cpu_s(os.getpid()) > 0


@pytest.mark.services
def test_a_failed_comparison_is_reported_not_fatal(
    toy_checkpoint: Path,
    tmp_path: Path,
    keep_global_state: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.bench.pipeline import PipelineBackend

    def broken(*_args: object) -> None:
        raise RuntimeError("bus down")

    monkeypatch.setattr(PipelineBackend, "run", broken)
    argv = ["bench", "--quick", "--checkpoint", str(toy_checkpoint), "--concurrency", "4"]
    argv += ["--out", str(tmp_path), "--no-progress", "--no-plots", "--repeats", "1"]
    assert main([*argv, "--only", "pipeline,prefix_cache"]) == 1
    results = json.loads((tmp_path / "results.json").read_text())
    failed, ok = results["comparisons"]
    assert failed["error"] == "RuntimeError: bus down" and not failed["runs"]
    assert "error" not in ok and ok["runs"]
    assert "bus down" in (tmp_path / "report.md").read_text()


@pytest.mark.services
def test_quick_bench_scheduler_step(
    toy_checkpoint: Path, tmp_path: Path, keep_global_state: None
) -> None:
    results = _bench(toy_checkpoint, tmp_path, "--repeats", "1", "--only", "scheduler")
    (comp,) = results["comparisons"]
    assert {r["concurrency"] for r in comp["runs"]} == {256, 1024}
    assert all(r["steps"] == 200 and r["mean_us"] > 0 for r in comp["runs"])
    targets = [t for t in results["targets"] if t["comparison"] == "scheduler"]
    assert [t["metric"] for t in targets] == ["mean_us", "p99_us", "p99_over_mean"]
    assert all(len(t["per_repeat"]) == 1 and t["reached"] in (True, False) for t in targets)
    assert "## Scheduler step" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_quick_bench_shards(toy_checkpoint: Path, tmp_path: Path, keep_global_state: None) -> None:
    """routing and scaling: shards as OS processes; every request of every arm completes, the
    ratios are recomputable (scaling's across workloads), simulated arms are marked."""
    argv = ("--repeats", "1", "--only", "routing,scaling", "--no-plots")
    results = _bench(toy_checkpoint, tmp_path, *argv)
    _recompute(results)
    for comp in results["comparisons"]:
        assert not comp.get("error"), comp.get("error")
        sizes = {w["name"]: w["num_requests"] for w in comp["workloads"]}
        simulated = {a["name"]: a["simulated"] for a in comp["arms"]}
        for run in comp["runs"]:
            m = run["metrics"]
            assert m["num_requests"] == sizes[run["workload"]]
            assert m["shard_imbalance"] >= 1.0 and m["control_cpu_us_per_token"] is not None
            assert m["simulated"] == int(simulated[run["arm"]])
            if simulated[run["arm"]]:
                assert m["sim_device_ms_per_step"] > 0 and m["sim_dilation"] == 100.0
    text = (tmp_path / "report.md").read_text()
    assert "SIMULATED" in text
