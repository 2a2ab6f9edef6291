"""Parallelisms as functions over a plain model and a named DeviceMesh (torchtitan's shape).

``dims`` says which dimensions are on and builds the mesh; ``distributed`` starts the
process group; ``data_parallel`` applies DDP, ZeRO-1 and FSDP2 (ZeRO-3); ``batches``
splits a step's batch across data-parallel ranks without splitting a document;
``launch`` turns ``assay train --nproc N`` into a torchrun command. The model file
(training/model.py) knows nothing of any of this.
"""
