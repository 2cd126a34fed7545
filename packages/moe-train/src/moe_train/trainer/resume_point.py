"""Where a run starts: the checkpoint it resumes from, or train.init_from's weights, or step 0; and the checks that
refuse to start (a checkpoint of another model, checkpoints past the start it would write over)."""

from __future__ import annotations

from pathlib import Path

from moe_ckpt import fail_together, step_of
from moe_train.config import Config, ConfigError
from moe_train.trainer import checkpoint as ckpt
from moe_train.trainer import resume_checks
from moe_train.trainer.init_from import check_init_source, ranks_agree_on
from moe_train.trainer.rank0_checks import checked_on_rank0
from moe_train.trainer.run_history import check_fresh_start_loses_no_history
from moe_train.trainer.runtime import Runtime


def find_resume_point(cfg: Config, runtime: Runtime) -> tuple[Path | None, Path | None]:
    """(the checkpoint this run resumes from, train.init_from's checkpoint for a run that starts at step 0); None,
    None: a start from step 0 with the model's own initialisation. Reads metadata only. Every rank calls it."""
    rt, run_dir = runtime, cfg.train.run_dir
    # Each rank checks the run folder as its host sees it: a check that fails on one rank (a file read it alone
    # failed) stops every rank, and ranks that found different checkpoints (a file system that shows another
    # host's newest folder late) are refused, instead of some resuming from one step and some from another.
    path, init_source = fail_together(lambda: _local_resume_point(cfg), rt.rank, rt.world_size,
                                      lambda flags: rt.all_reduce_sum(flags.to(rt.device)).cpu(),
                                      f"the resume checks of train.run_dir={run_dir!r}")
    if not ranks_agree_on(float(step_of(path)) if path is not None else -1.0, rt):
        raise ConfigError(f"train.run_dir={run_dir!r}: the ranks found different checkpoints to resume from (this "
                          f"rank: {path.name if path is not None else 'none, a start from step 0'}); a file system "
                          "that shows the hosts different folders? Resume when every host sees the same checkpoints/")
    if path is None:  # its log's step records go: refused when they are an earlier run's history
        checked_on_rank0(rt, lambda: check_fresh_start_loses_no_history(Path(run_dir), cfg.train.resume),
                         ConfigError(f"train.run_dir={run_dir!r}: rank 0 refused to start over its metrics.jsonl "
                                     "(its error says why)"))
    return path, init_source


def _local_resume_point(cfg: Config) -> tuple[Path | None, Path | None]:
    """find_resume_point's checks as this rank sees the run folder."""
    run_dir, strategy = Path(cfg.train.run_dir), cfg.parallel.strategy
    path = ckpt.latest(run_dir) if cfg.train.resume else None
    init_source = None
    if path is None:
        resume_checks.check_not_an_import(run_dir)
        if cfg.train.init_from is not None:
            if strategy == "fsdp":
                raise ConfigError("parallel.strategy='fsdp': expected 'ddp' with train.init_from (the FSDP2 "
                                  "baseline loads no checkpoints)")
            init_source = check_init_source(cfg)
    else:
        if strategy == "fsdp":  # its runtime cannot load one: refused before the start event
            raise ConfigError(f"parallel.strategy='fsdp': expected 'ddp' to resume train.run_dir={cfg.train.run_dir} "
                              f"from {path.name} (the FSDP2 baseline loads no checkpoints); or use another "
                              "train.run_dir")
        ckpt.check_trainer_metadata(path)
        resume_checks.check_same_model(path, cfg)
        resume_checks.check_not_past_the_end(path, cfg.train.steps)
    if cfg.train.save_interval > 0:  # a run that saves nothing writes over nothing
        resume_checks.check_no_checkpoints_after(run_dir, step_of(path) if path else 0, cfg.train.resume)
    return path, init_source
