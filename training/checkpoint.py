"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), safe to load and atomic to write.

Layout of a run directory::

    checkpoints/step-00000100/   DCP files: model, optimizer state, RNG, trainer tensors
    checkpoints/step-00000100/trainer.json   step, data identity, config, optimizer groups
    checkpoints/latest           the name of the newest complete checkpoint

Why DCP: it stores tensors by fully qualified name and reshards on load, so the
parallel trainer can resume on another world size from the same files.

Safety: only tensors go into DCP (non-tensor values would be pickled and loaded
with ``torch.load(weights_only=False)``); everything else is JSON. DCP's own
``.metadata`` file is a pickle of its index classes; it is read through an
unpickler that accepts those classes and nothing else.

Atomicity: a checkpoint is written to ``step-N.tmp-*`` and renamed, then
``latest`` is replaced atomically, so a run killed mid-save resumes from the
previous checkpoint.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from assay.errors import AssayError

__all__ = ["discard_partial_saves", "latest_checkpoint", "load_checkpoint", "safe_reader", "save_checkpoint"]

CHECKPOINTS = "checkpoints"
LATEST = "latest"
TRAINER_FILE = "trainer.json"

# Modules whose classes DCP's metadata pickle may name. Anything else (os.system…) is refused. Only classes
# defined there, by a plain name: a dotted name reaches through a module's imports (a module's `os.system`).
_SAFE_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.storage",
)
_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # that module also holds readers and writers
    ("torch", "Size"), ("torch", "device"), ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name to torch.strided…
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
}


@contextmanager
def _single_process_ok():
    # DCP warns that it assumes one process when no process group exists: that is the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in _SAFE_GLOBALS:
                return super().find_class(module, name)
            if module in _SAFE_MODULES:
                found = super().find_class(module, name)
                if isinstance(found, type) and found.__module__ == module:
                    return found
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}, which is not allowed")


class SafeReader(FileSystemReader):
    """DCP's file reader with a restricted unpickler for ``.metadata``."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as handle:
            metadata = _MetadataUnpickler(io.BytesIO(handle.read())).load()
        # DCP reads an entry declared as bytes with torch.load(weights_only=False), whatever the state
        # dict holds under that name; Assay saves tensors only, so such an entry is refused.
        pickled = [fqn for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)]
        if pickled:
            raise pickle.UnpicklingError(f"checkpoint metadata declares {pickled[0]} as pickled bytes, which is not "
                                         "allowed (Assay's checkpoints hold tensors only)")
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def safe_reader(checkpoint: str | Path) -> SafeReader:
    """A SafeReader for ``checkpoint`` whose metadata has been checked: a refused one is an AssayError
    here, in one line, where DCP would bury the reason in a per-rank exception dump."""
    reader = SafeReader(str(checkpoint))
    try:
        reader.read_metadata()
    except pickle.UnpicklingError as exc:
        raise AssayError(f"refusing to load {checkpoint}: {exc}") from None
    return reader


def load_state(state: dict[str, Any], checkpoint: str | Path) -> None:
    """DCP's load of ``checkpoint`` into ``state``'s tensors, in place, through the safe reader.

    A checkpoint whose files do not load (cut short, overwritten, half copied) is one AssayError naming
    it and each rank's cause: DCP raises a CheckpointException, a BaseException that every `except
    Exception` lets through, so the user got a raw traceback (resume) or torch's advice (export)."""
    reader = safe_reader(checkpoint)
    try:
        with _single_process_ok():
            dcp.load(state, storage_reader=reader)
    except dcp.CheckpointException as exc:
        raise AssayError(f"{checkpoint}: damaged, its files do not load ({_rank_causes(exc)}); restore it from a "
                         "copy, or use an earlier checkpoint of the run (its name in checkpoints/latest)") from None


def _rank_causes(exc: dcp.CheckpointException) -> str:
    """Each failed rank's exception in one line: its type and first sentence."""
    def said(error: BaseException) -> str:
        text = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return f"{type(error).__name__}: {text.split('. ')[0][:200]}" if text else type(error).__name__

    return "; ".join(f"rank {rank}: {said(error)}" for rank, (error, _) in sorted(exc.failures.items()))


def _tensor_state(model: nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]):
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # Optimizer hyperparameters (param_groups) are plain values: they go to JSON.
    return {"model": model_sd, "optim": optim_sd["state"], "extra": tensors}, optim_sd["param_groups"]


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(run_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    tensors: dict[str, torch.Tensor], trainer: dict) -> Path:
    """Write checkpoint ``step`` and point ``latest`` at it; returns its directory.

    In a process group every rank calls it: each writes its shards into the temporary
    directory, and rank 0 alone renames it and moves ``latest`` once all have finished.
    """
    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step-{step:08d}"
    tmp = root / f"{final.name}.tmp-save"
    if _is_main():
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    state, groups = _tensor_state(model, optimizer, tensors)
    try:
        with _single_process_ok():
            dcp.save(state, checkpoint_id=str(tmp))  # collective: returns when every rank has written
    except (Exception, dcp.CheckpointException) as exc:  # DCP's is a BaseException, past every `except Exception`
        # A full disk reaches here as torch's "unexpected pos N vs M" (a short write inside its zip
        # writer), which names no errno; the space left says what it was.
        if _space_left(root) < _FULL_BELOW:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp)) from exc
        if isinstance(exc, dcp.CheckpointException):
            raise RuntimeError(f"{tmp}: the checkpoint save failed ({_rank_causes(exc)})") from exc
        raise
    if _is_main():
        (tmp / TRAINER_FILE).write_text(json.dumps({**trainer, "step": step, "param_groups": groups},
                                                   indent=2, sort_keys=True, default=str))
        if final.exists():  # the same step saved again (a rerun): replace it whole
            shutil.rmtree(final)
        tmp.rename(final)
        pointer = root / f".{LATEST}.tmp"
        pointer.write_text(final.name + "\n")
        pointer.replace(root / LATEST)
    _barrier()
    return final


#: Bytes free under which a failed save is put down to a full disk.
_FULL_BELOW = 1 << 20


def _space_left(folder: Path) -> int:
    try:
        stats = os.statvfs(folder)
    except OSError:  # not there on this rank's machine: say nothing about its disk, keep the save's own error
        return _FULL_BELOW
    return stats.f_bavail * stats.f_frsize


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, or None. Only reads: a run may be saving right now
    (``score`` and ``export`` read checkpoints of runs that may still be training)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return None
    pointer = root / LATEST
    if not pointer.exists():
        # A first save stopped between renaming its folder and writing the pointer (save_checkpoint):
        # the folder is whole, since a save renames it only once written; it is the run's latest.
        complete = complete_checkpoints(run_dir)
        return complete[-1] if complete else None
    name = _pointer_name(pointer)
    path = root / name if name and _STEP_FOLDER.fullmatch(name) else None  # not a path out of the run
    return path if path is not None and (path / TRAINER_FILE).is_file() else None


_STEP_FOLDER = re.compile(r"step-\d{8,}")


def _pointer_name(pointer: Path) -> str | None:
    """What `latest` says, or None when it cannot be read (a folder, bytes that are not text)."""
    try:
        return pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's whole step folders, oldest first (a save's temporary folder is not one)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    whole = [p for p in root.glob("step-*") if _STEP_FOLDER.fullmatch(p.name) and (p / TRAINER_FILE).is_file()]
    return sorted(whole, key=lambda p: int(p.name.removeprefix("step-")))  # by number: step 10**8 has 9 digits


def broken_latest(run_dir: str | Path) -> str | None:
    """For a run whose :func:`latest_checkpoint` is None: what is wrong, when ``latest`` names no complete
    checkpoint while the run holds some (a step folder deleted or moved by hand, a pointer edited); said
    by every reader of ``latest``, rather than "no checkpoint" (train, score and export said that, and
    train's advice was --overwrite). None when the run holds no complete checkpoint."""
    complete = complete_checkpoints(run_dir)
    if not complete:
        return None
    named = _pointer_name(Path(run_dir) / CHECKPOINTS / LATEST)
    said = f"names {named!r}, which is not a complete checkpoint" if named is not None else "cannot be read"
    return f"{run_dir}: its {CHECKPOINTS}/{LATEST} {said}, though the run holds {', '.join(p.name for p in complete)}"


def discard_partial_saves(run_dir: str | Path) -> int:
    """Remove what a killed save left (``*.tmp-save``); only the run's own trainer, starting up
    before anything writes, may call it. Returns how many were removed."""
    root = Path(run_dir) / CHECKPOINTS
    leftovers = list(root.glob("*.tmp-save")) if root.is_dir() else []
    for leftover in leftovers:
        shutil.rmtree(leftover, ignore_errors=True)
    return len(leftovers)


def read_trainer_state(checkpoint: str | Path) -> dict:
    return json.loads((Path(checkpoint) / TRAINER_FILE).read_text())


def load_checkpoint(checkpoint: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    tensors: dict[str, torch.Tensor]) -> dict:
    """Restore model, optimizer and ``tensors`` (in place, same shapes) from ``checkpoint``;
    returns the trainer JSON."""
    trainer = read_trainer_state(checkpoint)
    # get_state_dict initialises empty optimizer state, so DCP has tensors to load into.
    state, own_groups = _tensor_state(model, optimizer, tensors)
    load_state(state, checkpoint)
    # The hyperparameters were written once, by rank 0, under rank 0's parameter names; a rank
    # holding other parameters (a pipeline stage, other experts) would find none of its own
    # among them. Every rank has the same groups in the same order, so they go by position.
    saved = trainer["param_groups"]
    if len(saved) != len(own_groups):
        raise AssayError(f"{checkpoint} has {len(saved)} optimizer parameter groups, this run {len(own_groups)}")
    groups = [{**{k: tuple(v) if k == "betas" else v for k, v in hyper.items()}, "params": own["params"]}
              for own, hyper in zip(own_groups, saved)]  # JSON turned the betas tuple into a list
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict={"state": state["optim"], "param_groups": groups})
    for name, tensor in tensors.items():
        tensor.copy_(state["extra"][name])
    return trainer
