"""Hugging Face datasets through the real `datasets` loading path.

`hf:PATH[:split]` accepts a `save_to_disk` folder (loaded with
`load_from_disk`) or anything `load_dataset` resolves: a local folder of data
files, a packaged builder, or a hub name where a hub is reachable. Nothing
here downloads on its own; offline, a hub name fails with datasets' error.
"""

from __future__ import annotations

from pathlib import Path

from assay.errors import AssayError

_SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def _is_saved_to_disk(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in _SAVED_MARKERS)


def load_hf_dataset(path: str, split: str | None, text_field: str):
    """A `datasets.Dataset` for one split; clear errors for the usual mistakes."""
    import datasets

    local = Path(path)
    try:
        if _is_saved_to_disk(local):
            loaded = datasets.load_from_disk(str(local))
        else:
            loaded = datasets.load_dataset(path, split=split)
    except Exception as exc:  # datasets raises many types; all mean "cannot load"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AssayError(f"hf:{path}: cannot load dataset ({first})") from None
    if isinstance(loaded, (datasets.DatasetDict, dict)):
        splits = list(loaded.keys())
        chosen = split or ("train" if "train" in splits else (splits[0] if len(splits) == 1 else None))
        if chosen not in splits:
            raise AssayError(f"hf:{path}: choose a split with hf:{path}:SPLIT (splits: {', '.join(splits)})")
        loaded = loaded[chosen]
    if text_field not in loaded.column_names:
        raise AssayError(
            f"hf:{path}: no text field '{text_field}' (columns: {', '.join(loaded.column_names)}); pass --text-field"
        )
    return loaded
