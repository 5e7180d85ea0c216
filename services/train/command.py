"""``rlt train``: flags, the run, the export."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from .settings import TrainSettings


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="the checkpoint directory to write")
    p.add_argument(
        "--work-dir",
        default=None,
        help="data, resumable state and log "
        "(default: OUT.work); a second run with the same flags resumes",
    )
    p.add_argument(
        "--export-only",
        action="store_true",
        help="export the work dir's latest "
        "saved state without training (while a run goes on, or after it)",
    )
    for f in dataclasses.fields(TrainSettings):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            p.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, dest=f.name
            )
        else:
            p.add_argument(flag, type=type(f.default), default=f.default, dest=f.name)


def run_train(args: argparse.Namespace) -> int:
    from .export import export_checkpoint  # torch: only when training
    from .trainer import Trainer

    settings = TrainSettings(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainSettings)}
    )
    out = Path(args.out)
    work = Path(args.work_dir) if args.work_dir else out.with_name(out.name + ".work")
    trainer = Trainer(work, settings)
    model = trainer.model if args.export_only else trainer.run()
    export_checkpoint(model, trainer.data.tokenizer_json, out, trainer.record())
    print(f"wrote {out} after {trainer.step} steps ({trainer.elapsed / 60:.1f} min)")
    return 0
