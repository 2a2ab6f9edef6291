"""Train a decoder LM on an exact dataset version; record per-document telemetry; resume exactly.

One run directory holds everything a run makes::

    tokenizer.json       byte-level BPE learnt on the training split
    checkpoints/         DCP checkpoints (training.checkpoint), every N steps and at the end
    telemetry/           per document per step: loss, gradient norm, flags (DESIGN.md contract)
    history.jsonl        per step: loss, gradient norm, learning rate, tokens, skipped, MoE load
    metrics.json         final loss, validation loss and next-token accuracy, data identity
    rows/                the token rows, memory-mapped: training never holds the corpus's tokens
    profile/             a torch.profiler trace, with --profile

The step loop, in order: batch of step s (a pure function of the seed and s) →
forward + backward with per-document losses and gradient norms (on the loss
times the loss scale under fp16, `training.precision`) → unscale → OLMo's spike
check on loss and gradient norm → optimizer step (or skip, flagging the
step's documents; an fp16 overflow skips without blaming them) → MoE bias update. Everything that decides the next step is
in the checkpoint, so "100 steps" and "50 steps, kill -9, resume, 50 more"
give the same numbers on CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import nn

from assay.config import TrainParams
from assay.devices import pick_device
from assay.errors import AssayError
from assay.installation import differences, installation
from assay.output_lock import exclusive_output
from assay.shards import MANIFEST, atomic_write_bytes, atomic_write_json, json_object
from assay.staging import overlaps, require_folder_or_absent, require_not_dangling
from assay.versions import DatasetVersion
from training.checkpoint import (CHECKPOINTS, LATEST, broken_latest, discard_partial_saves, latest_checkpoint,
                                 read_trainer_state)
from training.data import ROWS_FORMAT, TokenRows, batch_rows, cached_rows, is_holdout, make_batch
from training.grad_norms import per_document_loss_and_grad_norm, token_losses
from training.model import ModelArgs, Transformer
from training.parallel.distributed import Distributed, init_distributed
from training.parallel.setup import Parallel
from training.precision import precision_context, scales_loss, uses_fp8
from training.spikes import SpikeDetector
from training.telemetry import TelemetryLog
from training.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

__all__ = ["TrainResult", "train"]

HISTORY_FILE = "history.jsonl"
METRICS_FILE = "metrics.json"
ROWS_DIR = "rows"  # the token rows, memory-mapped (training.data.cached_rows)
#: Everything a run writes in its folder: `--overwrite` replaces a folder that holds nothing else.
RUN_ENTRIES = ("checkpoints", "telemetry", "profile", ROWS_DIR, "tokenizer.json", HISTORY_FILE, METRICS_FILE)


@dataclass
class TrainResult:
    run_dir: str
    steps: int
    resumed_from: int | None
    metrics: dict


# --------------------------------------------------------------------- setup
def config_fingerprint(params: TrainParams) -> str:
    """What must match for a checkpoint to be continued as the same run.

    The parallel layout is not part of it: DCP reshards, so a run saved on 4 ranks
    continues on 2 (or on 1) as the same run.
    """
    config = dataclasses.asdict(params)
    config.pop("parallel", None)
    blob = json.dumps(config, sort_keys=True).encode()
    return hashlib.blake2b(blob, digest_size=12).hexdigest()


def _split_docs(version: DatasetVersion, holdout: float, batch_rows_: int = 1024) -> Iterator[tuple[str, str, bool]]:
    for batch in version.iter_batches(columns=["id", "text"], batch_rows=batch_rows_):
        for doc_id, text in zip(batch.column("id").to_pylist(), batch.column("text").to_pylist()):
            if text:
                yield doc_id, text, is_holdout(doc_id, holdout)


def tokenizer_texts(version: DatasetVersion, params: TrainParams) -> Iterator[str]:
    """Training-split texts, up to params.tokenizer_chars characters in all, for the BPE to learn from."""
    budget = params.tokenizer_chars
    for _, text, held in _split_docs(version, params.holdout):
        if held:
            continue
        yield text[:budget]
        budget -= len(text)
        if budget <= 0:
            return


def _rows(version: DatasetVersion, tokenizer, params: TrainParams, out: Path) -> tuple[TokenRows, TokenRows]:
    """The training and held-out rows, memory-mapped from ``out/rows`` (made on first use).

    Two streaming passes rather than one held in memory: Parquet reads are cheap next to
    tokenizing. The cache key is everything the rows depend on, so a resumed run reuses
    them and a run on other data or another tokenizer makes new ones.
    """
    made_from = json.dumps({"data": version.data_hash, "tokenizer": tokenizer.to_str(), "seq_len": params.seq_len,
                            "holdout": params.holdout, "format": ROWS_FORMAT}, sort_keys=True)
    key = hashlib.blake2b(made_from.encode(), digest_size=8).hexdigest()
    train = cached_rows(out / ROWS_DIR / "train", key,
                        ((i, t) for i, t, held in _split_docs(version, params.holdout) if not held),
                        tokenizer, params.seq_len)
    held = cached_rows(out / ROWS_DIR / "held", key,
                       ((i, t) for i, t, held in _split_docs(version, params.holdout) if held),
                       tokenizer, params.seq_len)
    return train, held


def build_model(params: TrainParams, vocab_size: int, device: torch.device) -> Transformer:
    args = ModelArgs(vocab_size=vocab_size, max_seq_len=params.seq_len, **dataclasses.asdict(params.model))
    with torch.device("meta"):
        model = Transformer(args)
    if uses_fp8(params.precision):
        from training.fp8 import convert_to_float8

        convert_to_float8(model)
    model.to_empty(device=device)
    model.init_weights(seed=params.seed)
    return model


def optimizer_groups(model: nn.Module, params: TrainParams) -> list[dict]:
    # No weight decay on gains and embeddings, as in GPT-3 / Llama recipes.
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "tok_embeddings" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "tok_embeddings" not in n)]
    return [{"params": decay, "weight_decay": params.weight_decay}, {"params": rest, "weight_decay": 0.0}]


OPTIMIZER_DEFAULTS = {"betas": (0.9, 0.95), "eps": 1e-8}


def build_optimizer(model: nn.Module, params: TrainParams) -> torch.optim.Optimizer:
    return torch.optim.AdamW(optimizer_groups(model, params), lr=params.lr, **OPTIMIZER_DEFAULTS)


def learning_rate(step: int, params: TrainParams) -> float:
    """Linear warmup, then cosine decay to lr * min_lr_ratio at the last step (1-based step)."""
    if step <= params.warmup_steps:
        return params.lr * step / max(1, params.warmup_steps)
    span = max(1, params.steps - params.warmup_steps)
    progress = min(1.0, (step - params.warmup_steps) / span)
    floor = params.lr * params.min_lr_ratio
    return floor + (params.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


# ---------------------------------------------------------------- per-step math
def per_document_losses(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor,
                        doc_index: torch.Tensor, n_docs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch mean loss, per-document mean loss (n_docs,), per-document tokens (n_docs,))."""
    token_loss = token_losses(logits, targets, loss_mask)
    row_sum, row_tokens = token_loss.sum(1), loss_mask.sum(1)
    doc_sum = torch.zeros(n_docs, device=logits.device).index_add_(0, doc_index, row_sum)
    doc_tokens = torch.zeros(n_docs, device=logits.device, dtype=torch.long).index_add_(0, doc_index, row_tokens)
    batch_loss = token_loss.sum() / loss_mask.sum().clamp_min(1)
    return batch_loss, doc_sum / doc_tokens.clamp_min(1), doc_tokens


def forward_backward(model: Transformer, batch, grad_norms: str, loss_scale: float = 1.0, context=None):
    """Run one forward and backward of ``batch loss * loss_scale``; returns (batch loss,
    doc losses, doc grad norms or None, doc tokens), none of them scaled. ``context``: the
    context-parallel group, when ``batch`` holds this rank's positions of its rows."""
    n_docs = len(batch.doc_ids)
    if grad_norms == "ghost":
        stats = per_document_loss_and_grad_norm(model, batch.tokens, batch.targets, batch.loss_mask,
                                                batch.doc_index, n_docs, loss_scale=loss_scale, context=context)
        return stats.batch_loss.detach(), stats.loss.detach(), stats.grad_norm.detach(), stats.tokens
    logits = model(batch.tokens)
    loss, doc_loss, doc_tokens = per_document_losses(logits, batch.targets, batch.loss_mask, batch.doc_index, n_docs)
    (loss * loss_scale).backward()
    return loss.detach(), doc_loss.detach(), None, doc_tokens


@torch.no_grad()
def evaluate(model: Transformer, rows: TokenRows, params: TrainParams, device: torch.device) -> dict:
    """Mean token loss and next-token accuracy on held-out rows."""
    if len(rows) == 0:
        return {"val_loss": None, "val_accuracy": None, "val_tokens": 0}
    model.eval()
    limit = len(rows) if params.eval_rows == 0 else min(len(rows), params.eval_rows)
    loss_sum, correct, tokens = 0.0, 0, 0
    for start in range(0, limit, params.batch_size):
        batch = make_batch(rows, np.arange(start, min(limit, start + params.batch_size))).to(device)
        with precision_context(params.precision, device):
            logits = model(batch.tokens)
        mask = batch.loss_mask
        loss_sum += float(token_losses(logits, batch.targets, mask).sum())
        correct += int(((logits.argmax(-1) == batch.targets) & mask).sum())
        tokens += int(mask.sum())
    model.train()
    return {"val_loss": loss_sum / tokens, "val_accuracy": correct / tokens, "val_tokens": tokens}


# ------------------------------------------------------------------ run setup
def _require_one_version(version: DatasetVersion, every_rank: list[str]) -> None:
    """Each rank opens the dataset itself; a version published between two ranks' opens would have
    them train on different data under rank 0's name. Every rank sees the same list, so all stop."""
    if len(set(every_rank)) > 1:
        named = ", ".join(f"rank {r}: {h}" for r, h in enumerate(every_rank))
        raise AssayError(f"{version.path}: the ranks opened different versions of it ({named}); a new version "
                         "was published while the run started, or a rank sees another copy. Run again")


def _prepare_run(out: Path, version: DatasetVersion, params: TrainParams, resume: bool, overwrite: bool,
                 allow_data_change: bool) -> Path | None:
    """Decide between a fresh run and a resume; returns the checkpoint to resume from, if any."""
    require_not_dangling(out)
    require_folder_or_absent(out)
    overlap = overlaps(out, Path(version.path))
    if overlap:  # a run written into its dataset's folder would change the dataset it records
        raise AssayError(f"{out}: {overlap} the dataset {version.path}; choose an --out outside it")
    discard_partial_saves(out)
    checkpoint = latest_checkpoint(out)
    broken = broken_latest(out) if checkpoint is None and not overwrite else None
    if broken:  # "not empty; pass --overwrite" would advise throwing the run's checkpoints away
        raise AssayError(f"{broken}; to continue the run, write the newest's name into {out / CHECKPOINTS / LATEST}, "
                         "or pass --overwrite to start again")
    if checkpoint is None:
        if resume:
            raise AssayError(f"--resume: {out} holds no checkpoint to resume from")
        entries = sorted(p.name for p in out.iterdir()) if out.exists() else []
        if entries and not overwrite:
            if not _stopped_before_its_first_checkpoint(out, entries):
                raise AssayError(f"{out} is not empty; pass --overwrite to replace it")
            # What such a run wrote (its tokenizer, rows, the first steps' telemetry) the rerun writes again,
            # the same: there is nothing to resume, and "rerun the same command" (the CLI's line when a run
            # is stopped) must not end in "pass --overwrite".
            print(f"note: {out} holds a run stopped before its first checkpoint: nothing to resume; starting over")
        foreign = [name for name in entries if name not in RUN_ENTRIES and not _assay_output(out / name)]
        if foreign:  # `--out . --overwrite` must not write a run over a repository, nor wipe its telemetry/
            raise AssayError(f"{out}: holds {', '.join(foreign[:3])}{' …' if len(foreign) > 3 else ''}, which no "
                             "run writes; --overwrite replaces only an earlier run: choose another --out")
        _wipe(out)
        return None
    state = read_trainer_state(checkpoint)
    same_data = state["data"]["data_hash"] == version.data_hash
    same_config = state["config_fingerprint"] == config_fingerprint(params)
    if resume:
        if not same_data and not allow_data_change:
            raise AssayError(
                f"{out} was trained on data {state['data']['data_hash']} (rev {state['data']['rev']}), "
                f"but {version.path} is now {version.data_hash}; pass --allow-data-change to continue anyway")
        if state["model_args"] != dataclasses.asdict(params.model) or state["seq_len"] != params.seq_len:
            raise AssayError(f"--resume: the model in {out} differs from params.train.model; "
                             "restore the params or start again with --overwrite")
        if scales_loss(state.get("precision", "fp32")) != scales_loss(params.precision):
            # The loss scaler's state is in fp16 runs' checkpoints only.
            raise AssayError(f"--resume: {out} was trained in {state.get('precision', 'fp32')}, params.train.precision "
                             f"is {params.precision}; a run cannot move in or out of fp16's loss scaling")
        return checkpoint
    if same_data and same_config:
        # The same run, stopped or killed earlier: the same command continues it, as every stage's
        # rerun resumes (it refused without --resume, though the stop said "rerun to resume").
        return checkpoint
    if not overwrite:
        raise AssayError(f"{out} holds a run (step {state['step']}) of other data or settings; pass --resume to "
                         "continue it anyway or --overwrite to start again")
    _wipe(out)
    return None


def _stopped_before_its_first_checkpoint(out: Path, entries: list[str]) -> bool:
    """Only a run's own entries, no checkpoint (its partial saves are discarded by now) and no metrics.json,
    which a run writes when it finishes."""
    checkpoints = out / CHECKPOINTS
    return (set(entries) <= set(RUN_ENTRIES) and METRICS_FILE not in entries
            and not (checkpoints.is_dir() and any(checkpoints.iterdir())))


def _assay_output(folder: Path) -> bool:
    """A folder another stage wrote beside a run, such as `assay score`'s default `RUN/scores`: it
    stays when the run is replaced (DVC removes the run's own outputs, not the next stage's)."""
    manifest = json_object(folder / MANIFEST)
    return manifest is not None and str(manifest.get("format", "")).startswith("assay-")


def _wipe(out: Path) -> None:
    for name in RUN_ENTRIES:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    out.mkdir(parents=True, exist_ok=True)


def _installations(out: Path, state: dict | None, start: int, is_main: bool) -> list[dict]:
    """The installations that trained the run (assay.installation), each with the step it began at:
    a new run's is this one; a resumed run continues its checkpoint's list, adding this one when it
    differs (a checkpoint written before installations were recorded names none for its steps)."""
    now = installation()
    if state is None:
        return [{"from_step": 0, "installation": now}]
    earlier = state.get("installations") or [{"from_step": 0, "installation": None}]
    if earlier[-1]["installation"] == now:
        return earlier
    if is_main:
        print(f"note: continuing {out} from step {start}, whose steps another installation ran "
              f"({'; '.join(differences(earlier[-1]['installation'], now))}); the run records both")
    return [*earlier, {"from_step": start, "installation": now}]


def _read_history(out: Path, upto: int) -> list[dict]:
    path = out / HISTORY_FILE
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["step"] <= upto]


def _write_history(out: Path, history: list[dict]) -> None:
    atomic_write_bytes(out / HISTORY_FILE, "".join(json.dumps(r) + "\n" for r in history).encode())


def _scaler_tensors(scaler: torch.amp.GradScaler) -> dict[str, torch.Tensor]:
    """The loss scaler's state as checkpoint tensors (none when it is disabled: other runs' checkpoints
    keep their layout)."""
    if not scaler.is_enabled():
        return {}
    state = scaler.state_dict()
    return {"loss_scale": torch.tensor(state["scale"], dtype=torch.float64),
            "loss_scale_growth_tracker": torch.tensor(state["_growth_tracker"], dtype=torch.int64)}


def _restore_scaler(scaler: torch.amp.GradScaler, tensors: dict[str, torch.Tensor]) -> None:
    if scaler.is_enabled():
        scaler.load_state_dict({**scaler.state_dict(), "scale": float(tensors["loss_scale"]),
                                "_growth_tracker": int(tensors["loss_scale_growth_tracker"])})


#: A step skipped because the fp16 loss scale overflowed (the scaler halves it), not for its documents.
OVERFLOW = "overflow:loss_scale"


def end_moe_step(model: Transformer, par: Parallel, stepped: bool) -> float | None:
    """After the optimizer step, an MoE model's balancing: the bias update from the step's routing
    counts, or on a skipped step the counts dropped with it. Returns the worst layer's max/mean
    tokens per expert (1.0: perfect balance; None without MoE or on a skipped step), over every
    layer of the model (under pp each rank holds its own stages' layers; every rank must call)."""
    if not model.moe_layers():
        return None
    load = None
    if stepped:
        load = max(s["max_over_mean"] for s in model.update_moe_bias())
    else:
        for moe in model.moe_layers():
            moe.tokens_per_expert.zero_()
    return par.stage_max(load)


# ------------------------------------------------------------------- the run
def train(version: DatasetVersion, out: str | Path, params: TrainParams, *, resume: bool = False,
          overwrite: bool = False, allow_data_change: bool = False, device: str | None = None,
          profile: bool = False, progress: bool = True, on_step: Callable[[dict], None] | None = None,
          tokenizer: Tokenizer | None = None) -> TrainResult:
    """Train (or continue) the run in ``out`` on ``version``; see the module docstring.

    ``tokenizer``: use this one for a fresh run instead of learning one (benchmarks compare
    configurations on one tokenizer); a resumed run always uses the run's own.

    The main rank, which alone writes the run's folder, holds its lock (`assay.output_lock`) for
    the whole run: a second run into ``out`` is refused at once on every rank, and a run that
    fails before writing leaves no folder it made.
    """
    out = Path(out)
    world = init_distributed()  # rank 0 of 1 unless torchrun launched us
    with contextlib.ExitStack() as held:
        world.on_main(lambda: held.enter_context(exclusive_output(out)))
        return _train(world, version, out, params, resume=resume, overwrite=overwrite,
                      allow_data_change=allow_data_change, device=device, profile=profile, progress=progress,
                      on_step=on_step, tokenizer=tokenizer)


def _train(world: Distributed, version: DatasetVersion, out: Path, params: TrainParams, *, resume: bool,
           overwrite: bool, allow_data_change: bool, device: str | None, profile: bool, progress: bool,
           on_step: Callable[[dict], None] | None, tokenizer: Tokenizer | None) -> TrainResult:
    par = Parallel.setup(params, world)
    dev = pick_device(device or params.device)
    if dev.type == "cuda" and world.distributed:
        dev = torch.device("cuda", world.local_rank % torch.cuda.device_count())
    _require_one_version(version, world.gather(version.data_hash))
    checkpoint = world.on_main(lambda: _prepare_run(out, version, params, resume, overwrite, allow_data_change))
    torch.manual_seed(params.seed)

    if checkpoint is None:
        given = tokenizer
        world.on_main(lambda: save_tokenizer(
            given or train_tokenizer(tokenizer_texts(version, params), params.vocab_size), out))
    tokenizer = load_tokenizer(out)
    train_rows, held_rows = _rows(version, tokenizer, params, out)
    if len(train_rows) == 0:
        raise AssayError(f"{version.path} has no training text (after holding out {params.holdout:.0%})")

    model = build_model(params, tokenizer.get_vocab_size(), dev)
    par.apply(model, dev)
    optimizer = par.optimizer(optimizer_groups(model, params), params.lr, OPTIMIZER_DEFAULTS)

    def plain_optimizer() -> torch.optim.Optimizer:  # ZeRO-1's checkpoints go through a whole AdamW
        return build_optimizer(model, params)

    spikes = SpikeDetector(params.telemetry.spike_window, params.telemetry.spike_sigma,
                           params.telemetry.spike_min_history)
    scaler = par.loss_scaler(params.precision, dev, params.loss_scale_init)
    if scaler.is_enabled():
        # The backward multiplies by get_scale() inside forward_backward (the ghost norms must divide the
        # same factor out); scale() once creates the scaler's tensors, which unscale_ requires.
        scaler.scale(torch.ones((), device=dev))
    rng = {"torch_rng": torch.get_rng_state()}
    tensors = {**spikes.state_tensors(), **rng, **_scaler_tensors(scaler)}

    start, history = 0, []
    telemetry = TelemetryLog(out, rank=world.rank if world.distributed else None)
    if checkpoint is not None:
        state = par.load_checkpoint(checkpoint, model, optimizer, tensors, plain_optimizer)
        torch.set_rng_state(tensors["torch_rng"])
        _restore_scaler(scaler, tensors)
        start = state["step"]
        history = _read_history(out, start)
        world.on_main(lambda: telemetry.truncate_after(start))
    if start >= params.steps and (out / METRICS_FILE).exists():
        metrics = json.loads((out / METRICS_FILE).read_text())
        return TrainResult(str(out), start, start, metrics)

    installations = _installations(out, state if checkpoint is not None else None, start, world.is_main)
    identity = {"data": version.identity(), "config_fingerprint": config_fingerprint(params),
                "model_args": dataclasses.asdict(params.model), "seq_len": params.seq_len,
                "precision": params.precision, "device": str(dev), "parallel": par.describe(),
                "installations": installations}

    def checkpoint_now(step: int) -> None:
        telemetry.flush()
        world.on_main(lambda: _write_history(out, history))
        tensors["torch_rng"] = torch.get_rng_state()
        tensors.update(_scaler_tensors(scaler))
        par.save_checkpoint(out, step, model, optimizer, tensors, identity, plain_optimizer)

    profiler = _profiler(out) if profile else None
    model.train()
    tokens_seen, t0, memory = 0, time.perf_counter(), None
    with _progress(progress and world.is_main, params.steps, start) as advance, \
            (profiler or contextlib.nullcontext()):
        for step in range(start + 1, params.steps + 1):
            whole = make_batch(train_rows, batch_rows(len(train_rows), params.batch_size, step - 1, params.seed))
            local = par.local_batch(whole)  # this rank's documents; the whole batch on one process
            batch = local.batch.to(dev)
            lr = learning_rate(step, params)
            for group in optimizer.param_groups:
                group["lr"] = lr
            with precision_context(params.precision, dev):
                # A rank without documents runs a masked placeholder row (nothing to attribute).
                norms = par.telemetry_grad_norms(params.telemetry.grad_norms, local.has_documents)
                if par.pipelined:  # pp: the schedule runs forward and backward over the stages
                    loss, doc_loss, doc_norm, doc_tokens = par.pipeline.step(batch, local.global_tokens,
                                                                             scaler.get_scale(), norms)
                else:
                    # fp16: the backward runs on the loss times the scaler's scale (get_scale() is 1 when disabled).
                    scale = local.loss_scale * scaler.get_scale()
                    loss, doc_loss, doc_norm, doc_tokens = forward_backward(model, batch, norms, scale,
                                                                            par.context_group)
            doc_loss, doc_tokens = par.document_losses(doc_loss, doc_tokens)
            loss = par.global_loss(loss, batch.n_tokens, local.global_tokens)
            par.sum_moe_loads(model, local.has_documents)
            scaler.unscale_(optimizer)  # gradients as without scaling, before clipping and the step
            grad_norm = par.clip_grad_norm(model, params.grad_clip)
            loss_value = float(loss)
            spike = spikes.check([loss_value, grad_norm])
            reason = None
            if scaler.is_enabled() and math.isfinite(loss_value) and not math.isfinite(grad_norm):
                # The scale was too large for fp16, not the documents wrong: the scaler halves it. Not a
                # `skipped_step:` reason, which tier 2 reads as evidence against the step's documents.
                reason = OVERFLOW
                doc_norm = None if doc_norm is None else torch.full_like(doc_norm, float("nan"))
            elif not math.isfinite(loss_value) or not math.isfinite(grad_norm):
                reason = "skipped_step:non_finite"
            elif spike[0]:
                reason = "skipped_step:loss_spike"
            elif spike[1]:
                reason = "skipped_step:grad_norm_spike"
            if reason is None:
                scaler.step(optimizer)  # optimizer.step(); the scaler only skips it on an overflow
                if memory is None:  # after the first step, when the optimizer state exists
                    memory = par.memory_per_rank(model, optimizer)
                spikes.accept([loss_value, grad_norm])
            moe_load = end_moe_step(model, par, stepped=reason is None)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)

            if local.has_documents and par.writes_telemetry:
                telemetry.add_step(step, batch.doc_ids, doc_loss.float().tolist(),
                                   None if doc_norm is None else doc_norm.float().tolist(),
                                   doc_tokens.tolist(), reason)
            tokens_seen += local.global_tokens
            record = {"step": step, "loss": loss_value, "grad_norm": grad_norm, "lr": lr,
                      "tokens": local.global_tokens, "skipped": reason}
            if moe_load is not None:
                record["moe_max_over_mean"] = moe_load
            if scaler.is_enabled():
                record["loss_scale"] = scaler.get_scale()
            history.append(record)
            elapsed = time.perf_counter() - t0
            advance(step, loss_value, lr, tokens_seen / max(elapsed, 1e-9))
            if on_step is not None:
                on_step(record)
            if profiler is not None:
                profiler.step()
            if step % params.checkpoint_every == 0 or step == params.steps:
                checkpoint_now(step)

    loop_seconds = time.perf_counter() - t0
    metrics = {
        "steps": params.steps,
        # This process's step loop (a resume: only the steps it ran), for throughput figures.
        "loop_seconds": loop_seconds, "loop_tokens": tokens_seen,
        "final_loss": history[-1]["loss"] if history else None,
        # The mean of the last 10 steps: one batch's loss is a noisy summary.
        "final_loss_mean10": float(np.mean([h["loss"] for h in history[-10:]])) if history else None,
        "skipped_steps": sum(1 for h in history if h["skipped"]),
        **(par.pipeline.evaluate(held_rows, params, dev) if par.pipelined else evaluate(model, held_rows, params, dev)),
        "train_rows": len(train_rows), "train_tokens": train_rows.n_tokens,
        "val_rows": len(held_rows), "vocab_size": tokenizer.get_vocab_size(),
        # A DTensor's numel is global; pp stages hold disjoint parts, added over them.
        "parameters": par.pipeline.parameter_count() if par.pipelined else par.parameter_count(model),
        "precision": params.precision, "attention": params.model.attention, "ffn": params.model.ffn,
        "device": str(dev), "data": version.identity(),
        "resumed_from": start or None,
        # The code and packages that ran this process's steps, and every one that trained the run
        # with the step it began at (a resume under another installation adds one).
        "installation": installation(), "installations": installations,
    }
    if model.moe_layers():  # every rank's (pruned) model holds some under pp: each stage has a layer
        metrics["moe_bias_abs_max"] = par.stage_max(max(float(m.expert_bias.abs().max()) for m in model.moe_layers()))
    metrics["parallel"] = par.describe()
    metrics["memory_per_rank"] = memory  # bytes of parameters, gradients and optimizer state
    world.on_main(lambda: atomic_write_json(out / METRICS_FILE, metrics))
    return TrainResult(str(out), params.steps, start or None, metrics)


def _profiler(out: Path) -> torch.profiler.profile:
    """A trace of steps 3-5 (after the first steps' allocations settle), for chrome://tracing / Perfetto."""
    trace_dir = out / "profile"
    trace_dir.mkdir(parents=True, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(trace_dir / "trace.json")),
        record_shapes=True,
    )


@contextlib.contextmanager
def _progress(enabled: bool, total: int, start: int):
    """A rich bar with tokens/s, loss and the learning rate; a no-op when disabled."""
    if not enabled:
        yield lambda *args: None
        return
    import sys

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  TextColumn("{task.fields[info]}"), console=Console(file=sys.stderr)) as bar:
        task = bar.add_task("train", total=total, completed=start, info="")

        def advance(step: int, loss: float, lr: float, tokens_per_s: float) -> None:
            bar.update(task, completed=step,
                       info=f"loss {loss:.3f}  lr {lr:.2e}  {tokens_per_s:,.0f} tok/s")

        yield advance
