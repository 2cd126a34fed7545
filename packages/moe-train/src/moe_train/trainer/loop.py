"""The training loop: micro-batches, accumulation, the optimizer step, eval, logging, checkpoints."""

from __future__ import annotations

import math
import time
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from moe_train.config import Config, ConfigError, validate
from moe_train.data import DataError, WindowSampler, eval_windows, open_data
from moe_train.data.token_file import split_identity
from moe_train.model import Transformer, count_params, flops_per_token
from moe_train.model.router import refuse_a_router_the_loss_cannot_train
from moe_ckpt import AsyncCheckpointer, capture_rng_state, fail_together, restore_rng_state, step_of
from moe_train.trainer import checkpoint as ckpt
from moe_train.trainer import resume_checks
from moe_train.trainer.aborted_backward import release_aborted_backward
from moe_train.trainer.ctrl_c import CtrlCWatch, stop_description
from moe_train.trainer.data_setup import check_embedded_corpus_settings, resolve_data_dir
from moe_train.trainer.metrics import MetricsLog, max_over_ranks, peak_memory_gib, router_health
from moe_train.trainer.mfu import run_peak_tflops
from moe_train.trainer.peer_failure import PeerFailures, explain
from moe_train.trainer.run_lock import RunFolderBusyError, RunFolderLock
from moe_train.trainer.runtime import LocalRuntime, Runtime, StepResult
from moe_train.trainer.launch import make_runtime, pick_device
from moe_train.trainer.schedule import schedule_change, train_lr_at
from moe_train.trainer.errors import TrainingError
from moe_train.trainer.evaluation import mean_eval_loss
from moe_train.trainer.init_from import (load_initial_weights, warn_if_another_attention_reach,
                                         warn_if_another_tokenizer)
from moe_train.trainer.rank0_checks import checked_on_rank0
from moe_train.trainer.resume_point import find_resume_point
from moe_train.trainer.start_warnings import warn_about_settings


class Trainer:
    def __init__(self, cfg: Config, runtime: Runtime | None = None):
        """runtime: the one to train with (default: make_runtime from cfg); the Trainer closes it when
        train() ends, or here when construction fails after it exists (process groups, hooks)."""
        self.cfg = validate(cfg)
        t = cfg.train
        if Path(t.run_dir).exists() and not Path(t.run_dir).is_dir():
            raise ConfigError(f"train.run_dir={t.run_dir!r} is a file: expected a folder (or a path to create one)")
        if (Path(t.run_dir) / "metrics.jsonl").is_dir():  # the run log is written there, line by line
            raise ConfigError(f"train.run_dir={t.run_dir!r} holds a folder named metrics.jsonl: expected the run's "
                              "log file there (move the folder, or use another train.run_dir)")
        check_embedded_corpus_settings(cfg)
        refuse_a_router_the_loss_cannot_train(cfg.model)
        self.runtime = runtime or make_runtime(cfg, pick_device(t.device))
        self.run_lock: RunFolderLock | None = None
        self.closed = False  # close(): the runtime closed, the run folder's lock and train.threads given back
        # train.threads holds for this run only: the process's count comes back when the run ends (the next run
        # of a notebook or sweep with threads=0 gets torch's default, not this run's)
        self.threads_before = torch.get_num_threads()
        try:
            if t.threads > 0:
                torch.set_num_threads(t.threads)
            rt = self.runtime
            # a rank whose run ends by an exception records it, so that the ranks its failure stops name it (made
            # first, on every rank alike: each run numbers its records in the store)
            self.peer_failures = PeerFailures(rt.rank, rt.world_size)
            self.device = rt.device
            self.is_main = rt.rank == 0
            data_dir = resolve_data_dir(cfg.data, is_main=False)
            # rank 0 prepares the embedded corpus on first use; the others wait here, and stop with it if it fails
            checked_on_rank0(self.runtime, lambda: resolve_data_dir(cfg.data, is_main=True), DataError(
                f"rank 0 could not prepare the embedded corpus in {data_dir} (its error says why)"))
            # each rank reads the data folder as its host sees it (a local copy per host, say): one rank's refusal
            # stops every rank, not that rank alone while the others wait in the next collective
            fail_together(lambda: self._open_data(data_dir), rt.rank, rt.world_size,
                          lambda flags: rt.all_reduce_sum(flags.to(self.device)).cpu(), f"opening data.path={data_dir}")
            if self.is_main:
                warn_about_settings(cfg, self.device, one_process=isinstance(rt, LocalRuntime),
                                    train_windows=self.sampler.num_windows)
            torch.manual_seed(t.seed)
            self.model = rt.setup(Transformer(cfg.model, device="meta"))  # each rank allocates only its slice
            # the data's end-of-document id, which the config does not know; the kernel serves the windowed layers
            # (model.sliding_window_pattern) too, with or without document masking
            self.model.set_document_masking(self.meta["eos_id"] if t.document_masking else None,
                                            t.document_masking_kernel)
            self.run_dir = Path(t.run_dir)
            self.init_source: Path | None = None  # train.init_from's checkpoint, on a run that starts at step 0
            self.step = 0
            self.skipped_steps = 0
            self.consecutive_skips = 0
            # the train.seed step 0 was seeded with: carried in every checkpoint, so a resume compares a changed
            # train.seed with it, not with the last resumed command's (which each save stores in its config)
            self.initial_seed = t.seed
            # set by the step whose skip reaches train.max_skipped_steps: raised once that step's record is written
            self.streak_stop: TrainingError | None = None
            # the eval losses of the whole run, across restarts (saved in each checkpoint's metadata)
            self.first_eval_loss: float | None = None
            self.last_eval_loss: float | None = None
            self.last_loss: float | None = None  # the last step's training loss, across restarts too
            self.autocast = self.device.type == "cuda" and t.autocast_bf16
            if t.document_masking or cfg.model.sliding_window_pattern:  # a masked-attention kernel that cannot run
                # here is refused now, not at the first forward
                attention_dtype = torch.bfloat16 if self.autocast else next(self.model.parameters()).dtype
                self.model.document_masking_path(self.device, attention_dtype)
            self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
            self.peak = run_peak_tflops(cfg, self.device)  # None (no MFU) when the GEMMs run in fp32
            self.ctrl_c = CtrlCWatch()  # a Ctrl-C the garbage collector drops still stops the run
            self.async_saver = AsyncCheckpointer() if t.async_save else None
            # the background writer's barrier must not interleave with training collectives
            self.save_barrier = rt.background_barrier() if t.async_save else None
            # last: a run refused for its data or model leaves no run folder behind
            self._lock_run_dir()
            self.log = MetricsLog(self.run_dir / "metrics.jsonl", enabled=self.is_main)
        except BaseException as e:
            self._close_runtime(e)
            raise

    def _open_data(self, data_dir: Path) -> None:
        """The training sampler and the eval windows from `data_dir`, every token id checked against the bound
        open_data gives each split: the data's own vocabulary (meta.json's, at most the model's)."""
        cfg, t = self.cfg, self.cfg.train
        self.meta, splits = open_data(data_dir, cfg.model.vocab_size)
        self.data_dir = data_dir
        train, held_out = splits["train"], splits["eval"]
        self.sampler = WindowSampler(train.tokens, cfg.data.seq_len, cfg.data.seed, vocab_size=train.id_bound)
        self.eval_data = eval_windows(held_out.tokens, cfg.data.seq_len, t.eval_windows,
                                      t.micro_batch_size, vocab_size=held_out.id_bound)
        # eval_windows' upper bound
        self.eval_split_windows = (splits["eval"].tokens.size - 1) // cfg.data.seq_len
        if t.eval_interval > 0 and not self.eval_data:
            n = splits["eval"].tokens.size
            raise DataError(f"{data_dir}: the eval split has {n} token{'' if n == 1 else 's'}, fewer than "
                            f"one window of data.seq_len+1={cfg.data.seq_len + 1}; prepare more data, shorten "
                            "data.seq_len, or set train.eval_interval=0")

    def _lock_run_dir(self) -> None:
        """Rank 0 takes the run folder's lock (one job per run folder) and checks that the folder, and its
        checkpoints/ when the run saves, take new files: every rank raises if it cannot, before the first step
        (the first save would fail with the steps since the start lost)."""
        def lock_and_probe() -> None:
            self.run_lock = RunFolderLock(self.cfg.train.run_dir)
            ckpt.check_run_dir_writable(self.cfg.train.run_dir, saves=self.cfg.train.save_interval > 0)

        checked_on_rank0(self.runtime, lock_and_probe, RunFolderBusyError(
            f"train.run_dir={self.cfg.train.run_dir!r} is in use by another job or cannot be written (rank 0 could "
            "not lock it or write in it; its error says which)"))

    def _log(self, record: dict[str, Any]) -> None:
        """Every rank calls this: rank 0 appends `record` to metrics.jsonl; if that fails (a full disk), every
        rank stops, the others with a TrainingError naming rank 0's write."""
        checked_on_rank0(self.runtime, lambda: self.log.write(record), TrainingError(
            f"rank 0 could not write {self.log.path} (its error says why); stopped with it"))

    def close(self) -> None:
        """Close the runtime (its process groups), drop the run folder's lock and give train.threads back. train()
        does it when it ends; a Trainer built and not trained (to evaluate, or restore and inspect a checkpoint)
        holds all three until this is called (or the `with Trainer(cfg) as trainer:` block ends). A save() still in
        flight (train.async_save) is settled first; its error is raised once all three are given back. Idempotent."""
        if not self.closed:
            self.closed = True
            try:
                # a save() in flight (train.async_save) commits first, and its error is raised here: closing the
                # groups under it failed its barrier, and the lock went back while it still wrote in the folder
                if self.async_saver is not None:
                    self.async_saver.wait()
            finally:
                try:
                    self.runtime.close()
                finally:
                    self._release_run_dir()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as err:  # noqa: BLE001 - exc is the error leaving the with block
            exc.add_note(f"closing the Trainer failed too: {type(err).__name__}: {err}")

    def _close_runtime(self, e: BaseException) -> None:
        """Close the runtime after `e` (the error to report): a failure to close becomes a note on e."""
        self.closed = True
        try:
            self.runtime.close()
        except Exception as err:  # noqa: BLE001 - e is the error to report
            e.add_note(f"closing the runtime failed too: {type(err).__name__}: {err}")
        self._release_run_dir()

    def _release_run_dir(self) -> None:
        """The run folder's lock dropped and the process's thread count (train.threads) given back."""
        if self.run_lock is not None:
            self.run_lock.release()
        torch.set_num_threads(self.threads_before)

    # -- pieces -----------------------------------------------------------------------------
    def _amp(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.autocast else nullcontext()

    def evaluate(self) -> float:
        """The mean loss over the eval set, the same on every rank (evaluation.mean_eval_loss)."""
        return mean_eval_loss(self.model, self.eval_data, self.runtime, self._amp)

    def _train_step(self) -> dict[str, float]:
        t, rt = self.cfg.train, self.runtime
        # the cross-entropy, the router aux losses and the LM head's z-loss, summed over the micro-batches
        sums = torch.zeros(3, device=self.device)
        for micro in range(t.grad_accum):
            x, y = self.sampler.next_batch(t.micro_batch_size, rt.dp_rank, rt.dp_size)
            with self._amp():
                terms = self.model.loss_terms(x.to(self.device, non_blocking=True),
                                              y.to(self.device, non_blocking=True))
            rt.backward(sum(terms) / t.grad_accum, last_micro_batch=micro == t.grad_accum - 1)
            sums += torch.stack([term.detach().float() for term in terms])
        lr = train_lr_at(self.step, t)
        # The losses are summed over the ranks before the update: a non-finite loss (every rank sees the same sum)
        # applies no update, even where its gradients came out finite.
        stats = rt.all_reduce_sum(sums / (t.grad_accum * rt.dp_size)).tolist()
        loss_finite = all(math.isfinite(v) for v in stats)
        if loss_finite:
            result = rt.step(lr)
        else:
            rt.discard_gradients()
            result = StepResult(grad_norm=float("nan"), skipped=True)
        self._update_expert_bias(apply=not result.skipped)
        if result.skipped:
            self.skipped_steps += 1
            self.consecutive_skips += 1
            if self.consecutive_skips >= t.max_skipped_steps:
                last = (f"grad_norm={result.grad_norm}" if loss_finite else
                        f"aux_loss={stats[1]}{self._lm_z_text(stats)} (no update, no grad norm)")
                self.streak_stop = TrainingError(
                    f"loss={stats[0]} / {last} non-finite for {self.consecutive_skips} "
                    f"consecutive steps ({self._streak()}); train.max_skipped_steps={t.max_skipped_steps}"
                )
        else:
            self.consecutive_skips = 0
        record = {"loss": stats[0], "aux_loss": stats[1], "lr": lr, "grad_norm": result.grad_norm,
                  "skipped": float(result.skipped)}
        if t.lm_z_loss_weight:
            record["lm_z_loss"] = stats[2]
        return record

    def _lm_z_text(self, stats: list[float]) -> str:
        """The LM head's z-loss term for a message, where train.lm_z_loss_weight adds one."""
        return f" / lm_z_loss={stats[2]}" if self.cfg.train.lm_z_loss_weight else ""

    def _streak(self) -> str:
        """The steps of the current streak of skipped ones, as metrics.jsonl numbers them (the step being taken
        is self.step + 1: self.step counts the steps done)."""
        last = self.step + 1
        return f"step {last}" if self.consecutive_skips == 1 else f"steps {last - self.consecutive_skips + 1} to {last}"

    def _update_expert_bias(self, apply: bool = True) -> None:
        """One all-reduce of every router's step load, and only when some router uses the bias.
        apply=False (a skipped step: non-finite gradients, the same on every rank) leaves the bias as it is, as
        the weights are: that step's load was routed on non-finite activations. The load is cleared either way."""
        routers = [router for _, router in self.model.routers()]
        if not apply or not any(r.cfg.expert_bias for r in routers):
            for r in routers:
                r.step_load.zero_()  # nothing to move (or not this step); the next step counts afresh
            return
        loads = self.runtime.all_reduce_sum(torch.stack([r.step_load for r in routers]))
        for r, load in zip(routers, loads):
            r.update_expert_bias(load)

    def _window_metrics(self, tokens: int, seconds: float) -> dict[str, Any]:
        """The numbers of a metrics record that cover the steps since the previous record, over every rank:
        throughput of `tokens` (all ranks') trained in `seconds`, peak memory, router health. Every rank calls it."""
        rt = self.runtime
        tps = tokens / max(seconds, 1e-9)
        out: dict[str, Any] = {"step": self.step, "tokens_per_s": tps, "skipped_steps": self.skipped_steps,
                               "model_tflops_per_gpu": self.flops_per_token * tps / rt.world_size / 1e12}
        if self.peak:
            out["mfu"] = out["model_tflops_per_gpu"] / self.peak
        mem = peak_memory_gib(self.device)
        if mem is not None:
            out["peak_mem_gib"] = max_over_ranks([mem], rt.rank, rt.world_size, rt.all_reduce_sum, self.device)[0]
        health = router_health(self.model, rt.all_reduce_sum)
        out["dropped_rows"] = sum(h["dropped_rows"] for h in health.values())
        out["router"] = health
        return out

    # -- checkpoints ------------------------------------------------------------------------
    def _metadata(self) -> dict[str, Any]:
        p = self.cfg.parallel
        return {
            "step": self.step, "skipped_steps": self.skipped_steps, "consecutive_skips": self.consecutive_skips,
            "initial_seed": self.initial_seed,
            "first_eval_loss": self.first_eval_loss, "last_eval_loss": self.last_eval_loss, "last_loss": self.last_loss,
            "sampler": self.sampler.state_dict(), "train_data": split_identity(self.meta, "train"),
            "config": self.cfg.to_dict(), "rng": capture_rng_state(),
            "layout": {"world_size": self.runtime.world_size, "dp": p.dp, "ep": p.ep, "pp": p.pp,
                       "strategy": p.strategy, "runtime": type(self.runtime).__name__},
        }

    def save(self) -> Path:
        # In a streak of skipped steps nothing older is pruned: the update that broke the run may predate the
        # streak, and the checkpoints before it are the way back. The next save outside a streak prunes.
        keep_last = self.cfg.train.keep_last if self.consecutive_skips == 0 else None
        return ckpt.save(self.run_dir, self.step, self.runtime, self.model, self._metadata(),
                         keep_last, self.async_saver, self.save_barrier)

    def resume_point(self) -> Path | None:
        """The checkpoint this run resumes from (None: it starts at step 0, from train.init_from's weights when
        set), after the checks that refuse to start (resume_point.find_resume_point)."""
        path, self.init_source = find_resume_point(self.cfg, self.runtime)
        return path

    def restore(self, path: Path) -> None:
        """Load weights, optimizer, step, sampler and RNG state from checkpoint `path`."""
        meta = ckpt.load(path, self.runtime, self.model)
        self.step = int(meta["step"])
        self.skipped_steps = int(meta["skipped_steps"])
        # a streak of skipped steps goes on across a restart (checkpoints before 0.9.8 do not record it: 0)
        self.consecutive_skips = int(meta.get("consecutive_skips", 0))
        data_change = resume_checks.train_data_change(meta, self.sampler.num_windows,
                                                      split_identity(self.meta, "train"), self.data_dir,
                                                      self.cfg.data.seed)
        self.sampler.load_state_dict(meta["sampler"])
        if data_change and self.is_main:
            warnings.warn(data_change, stacklevel=2)
        batch_change = resume_checks.global_batch_change(meta.get("config", {}), meta.get("layout", {}), self.cfg,
                                                         self.step)
        if batch_change and self.is_main:
            warnings.warn(batch_change, stacklevel=2)
        # checkpoints before moe-train 0.27.24 do not record it: the stored config's seed (the last resumed command's)
        stored_seed = meta.get("config", {}).get("train", {}).get("seed", self.cfg.train.seed)
        self.initial_seed = meta.get("initial_seed", stored_seed)
        seed_change = resume_checks.train_seed_change(self.initial_seed, self.cfg)
        if seed_change and self.is_main:
            warnings.warn(seed_change, stacklevel=2)
        # rank 0's generators, on every rank and every layout: all ranks seed with train.seed and draw alike, so
        # their states agree at a save; another layout goes on from the saved state instead of train.seed's
        restore_rng_state(meta["rng"])
        # checkpoints before moe-train 0.15.5 do not record them: None
        self.first_eval_loss, self.last_eval_loss = meta.get("first_eval_loss"), meta.get("last_eval_loss")
        self.last_loss = meta.get("last_loss")  # before moe-train 0.27.27: not recorded, None
        if self.cfg.train.eval_interval > 0:
            change = resume_checks.eval_set_change(meta.get("config", {}), self.cfg, self.eval_split_windows, self.step)
            if change:  # losses over another eval set: none of them compares with this run's evals
                self.first_eval_loss = self.last_eval_loss = None
                if self.is_main:
                    warnings.warn(change, stacklevel=2)
        if self.is_main and self.step < self.cfg.train.steps:
            change = schedule_change(meta.get("config", {}).get("train", {}), self.cfg.train, self.step)
            if change:
                warnings.warn(change, stacklevel=2)

    # -- the loop ---------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Resume if there is something to resume, train to train.steps, return a summary.

        However the run ends after its start event, metrics.jsonl gets an end event (why it stopped,
        for an error or Ctrl-C) and an async save in flight is settled first: it commits, or fails
        and leaves no tmp folder (a second Ctrl-C stops the wait; the next save removes what is left).
        The runtime is closed (process groups destroyed) however train() ends, so a Trainer trains once: train()
        again (or after close()) is refused; a new Trainer(cfg) resumes the run folder."""
        if self.closed:
            raise TrainingError(f"this Trainer is closed (its train() ended, or close() was called): its process "
                                f"groups and the lock on train.run_dir={self.cfg.train.run_dir!r} are given back; build "
                                "a new Trainer(cfg) to go on (it resumes from the run folder's latest checkpoint)")
        try:
            with self.ctrl_c:
                summary = self._train()
        except BaseException as e:
            # before the process group closes: its closing is what stops the ranks waiting for this one
            self.peer_failures.publish(e, consequence=getattr(e, "peer_failure", False))
            self._close_runtime(e)
            raise
        self.close()
        return summary

    def _train(self) -> dict[str, Any]:
        t, rt = self.cfg.train, self.runtime
        resume_from = self.resume_point()  # a refusal comes before anything is logged
        resumed = resume_from is not None
        counts = count_params(self.cfg.model)
        init_from = None if resumed else self.init_source
        self._log({"event": "start", "resumed_from_step": step_of(resume_from) if resumed else None,
                        "init_from": str(init_from) if init_from is not None else None,
                        "params_total": counts.total, "params_active": counts.active,
                        "flops_per_token": self.flops_per_token, "world_size": rt.world_size,
                        "device": str(self.device)})
        try:
            if resumed:
                self.restore(resume_from)
            elif init_from is not None:
                load_initial_weights(init_from, rt, self.model)
                if self.is_main:
                    warn_if_another_tokenizer(init_from, self.data_dir, self.meta.get("tokenizer", "tokenizer.json"))
                    warn_if_another_attention_reach(init_from, self.cfg)
                if self.is_main and t.progress:
                    print(f"initialised from {init_from}", flush=True)
            # step records this run writes again: past the checkpoint (from a run that died after
            # it), or all of them on a fresh start (a run that died before its first checkpoint)
            checked_on_rank0(self.runtime, lambda: self.log.rewind(self.step if resumed else -1), TrainingError(
                f"rank 0 could not rewrite {self.log.path} (its error says why); stopped with it"))
            if self.is_main:
                if resumed and t.progress:
                    print(f"resumed from {resume_from} at step {self.step} of {t.steps}", flush=True)
                if self.step >= t.steps:  # the summary then has no loss: say why, with or without a progress bar
                    warnings.warn(f"train.steps={t.steps}: the run is already at step {self.step} ({resume_from}), "
                                  "so there is nothing to train; raise train.steps to go on", stacklevel=2)
            with self.async_saver or nullcontext():
                summary = self._run(resumed)
            self.ctrl_c.check()  # one dropped while the last save was settling
        except BaseException as e:
            release_aborted_backward()  # a backward cut short by e: its queued nodes freed now, not in a crash at exit
            # a collective failed because another rank failed: that rank and its error, in the log and the error
            stop = explain(e, self.peer_failures)
            try:
                self._log_stop(stop)
                if stop is not e:
                    raise stop from e
                raise
            finally:
                # the error's traceback holds this frame: `stop` kept in it would be a cycle holding the failed step's
                # frames, whose gradient reductions keep the process group's connections open after close(), so a
                # failure inside backward left the other ranks waiting for parallel.collective_timeout_s
                del stop
        stats = self.async_saver.last_stats if self.async_saver is not None else None
        if stats is not None:
            self.log.write({"event": "async_save", "stall_s": stats.stall_s, "write_s": stats.write_s})
        self.log.write({"event": "end", "status": "completed", **summary})
        return summary

    def _log_stop(self, e: BaseException) -> None:
        """The end event of a run stopped by `e` (a TrainingError, Ctrl-C, a failed save...); never raised over e.
        A Ctrl-C or SIGTERM says which and where (its KeyboardInterrupt has no text of its own), and carries the
        where as `stopped_at` for the CLI's line."""
        interrupted = isinstance(e, KeyboardInterrupt)
        if interrupted:
            e.stopped_at = self._progress()
            e.on_main_rank = self.is_main  # the CLI's resume hint: rank 0's alone
        error = f"{type(e).__name__}: {stop_description(e) + ', ' + e.stopped_at if interrupted else e}"
        try:
            self.log.write({"event": "end", "status": "interrupted" if interrupted else "failed",
                            "step": self.step, "skipped_steps": self.skipped_steps, "error": error})
        except Exception as err:  # noqa: BLE001 - e is the error to report
            e.add_note(f"could not write the end event to {self.log.path}: {err}")

    def _progress(self) -> str:
        """Where the run is, as metrics.jsonl numbers the steps (self.step counts the steps done)."""
        steps = self.cfg.train.steps
        return f"after step {self.step} of {steps}" if self.step else f"before step 1 of {steps}"

    def _run(self, resumed: bool) -> dict[str, Any]:
        t, rt = self.cfg.train, self.runtime
        if not resumed and t.eval_interval > 0:
            self.first_eval_loss = self.last_eval_loss = self.evaluate()
            self._log({"step": 0, "eval_loss": self.first_eval_loss})
        tokens_per_step = t.micro_batch_size * t.grad_accum * rt.dp_size * self.cfg.data.seq_len
        bar = tqdm(total=t.steps, initial=self.step, disable=not (self.is_main and t.progress), unit="step",
                   dynamic_ncols=True, mininterval=1.0)
        def clock() -> float:  # after the queued GPU work: a step's last kernels count as training, not as eval or save
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter()

        # tokens/s: training steps only; the seconds spent on eval and saves (`paused`) leave the window
        window_start, window_tokens, paused = time.perf_counter(), 0, 0.0
        record: dict[str, Any] = {}
        while self.step < t.steps:
            self.ctrl_c.check()
            record = self._train_step()
            self.last_loss = record.get("loss")
            self.step += 1
            window_tokens += tokens_per_step
            bar.update(1)
            # the step that ends a streak of non-finite ones is logged too, whatever train.log_interval: the
            # error names it, and metrics.jsonl (the end event's step as well) then shows the whole streak
            stop, self.streak_stop = self.streak_stop, None
            if self.step % t.log_interval == 0 or self.step == t.steps or stop is not None:
                elapsed = clock() - window_start - paused
                record.update(self._window_metrics(window_tokens, elapsed))
                self._log(record)
                post = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
                if "mfu" in record:
                    post["mfu"] = f"{record['mfu']:.1%}"
                bar.set_postfix(post)
                window_start, window_tokens, paused = time.perf_counter(), 0, 0.0
            if stop is not None:
                raise stop
            if t.eval_interval > 0 and (self.step % t.eval_interval == 0 or self.step == t.steps):
                started = clock()
                self.last_eval_loss = self.evaluate()
                self._log({"step": self.step, "eval_loss": self.last_eval_loss})
                if self.is_main and t.progress:
                    bar.write(f"step {self.step}: eval loss {self.last_eval_loss:.4f}")
                paused += time.perf_counter() - started
            if t.save_interval > 0 and (self.step % t.save_interval == 0 or self.step == t.steps):
                started = clock()
                self.save()
                paused += time.perf_counter() - started
        bar.close()
        return {"step": self.step, "first_eval_loss": self.first_eval_loss, "last_eval_loss": self.last_eval_loss,
                "last_loss": self.last_loss, "skipped_steps": self.skipped_steps}
