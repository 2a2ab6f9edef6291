"""Training: the decoder LM, its parallelisms and telemetry (imports assay schema/IO only)."""
