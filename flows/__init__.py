"""Prefect flows: one module per stage. Flows orchestrate; the logic they call lives in assay/ and filters/."""
