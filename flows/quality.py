"""The `quality-head` flow: train and evaluate tier 1's confidence head."""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from assay.config import load_params
from assay.errors import AssayError
from assay.output_lock import exclusive_output
from assay.quality.head import WEIGHTS
from assay.quality.train import labelled_examples, reference_examples, train_head
from assay.staging import require_model_out


@flow(name="quality-head", log_prints=True)
def quality_train_flow(
    data: str | None, out: str, labels: str | None = None, finetune: bool = False, params_file: str | None = None
) -> dict:
    """Train the head on DATA's reference recipe, or on a LABELS file; save it under OUT."""
    params = load_params(params_file)
    with exclusive_output(out):  # two trainings into OUT would save over each other
        # The head is saved into OUT: refuse, before training, an OUT that is not an earlier head.
        require_model_out(Path(out), [i for i in (data, labels) if i], "a quality head",
                          lambda folder: (folder / WEIGHTS).is_file())
        if labels:
            examples, recipe = labelled_examples(labels, data), f"labels:{labels}"
        else:
            if data is None:
                raise AssayError("give --data DIR (the reference recipe) or --labels FILE")
            recipe = "reference:" + ",".join(params.quality.reference_sources)
            examples = reference_examples(data, params)
        print(f"{len(examples.texts)} examples ({int(examples.labels.sum())} positive), recipe {recipe}")
        return train_head(examples, params, out, recipe=recipe, finetune=finetune)
