"""Which parallel dimensions are on, checked against the world size, and the mesh built from them.

Mesh dimension names are fixed (torchtitan's): ``pp``, ``dp_replicate``, ``dp_shard``,
``cp``, ``tp``, outermost first, so that the innermost (tensor parallel) ranks are
neighbours: on one machine they share memory bandwidth, across machines they share a node.
Dimensions of size 1 are left out of the mesh. ``dp`` is the flattened
``dp_replicate × dp_shard`` mesh that batches are split over.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from assay.errors import AssayError

__all__ = ["IMPLEMENTED", "ParallelDims"]

#: Dimensions this trainer can apply today. The others are refused with a clear error
#: rather than silently run as data parallel.
IMPLEMENTED = (
    "dp_replicate",
    "dp_shard",
    "cp",
    "ep",
    "pp",
    "tp",
)

_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1  # -1: whatever the world size leaves over
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    world_size: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "pp", "cp", "ep", "world_size"):
            if getattr(self, name) < 1:
                raise AssayError(f"parallel: {name} must be >= 1, not {getattr(self, name)}")
        if self.dp_shard == -1:
            rest = self.dp_replicate * self.tp * self.pp * self.cp
            if self.world_size % rest:
                raise AssayError(f"parallel: world size {self.world_size} is not a multiple of "
                                 f"dp_replicate×tp×pp×cp = {rest}")
            object.__setattr__(self, "dp_shard", self.world_size // rest)
        if self.dp_shard < 1:
            raise AssayError(f"parallel: dp_shard must be >= 1 or -1, not {self.dp_shard}")
        product = self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp
        if product != self.world_size:
            raise AssayError(
                f"parallel: dp_replicate×dp_shard×tp×pp×cp = {self.dp_replicate}×{self.dp_shard}×{self.tp}"
                f"×{self.pp}×{self.cp} = {product}, but the world size is {self.world_size}")
        if self.ep > 1 and (self.dp_shard * self.cp) % self.ep:
            raise AssayError(f"parallel: ep={self.ep} must divide dp_shard×cp = {self.dp_shard * self.cp} "
                             "(experts are sharded over the data-parallel ranks)")
        if self.ep > 1 and (self.tp > 1 or self.cp > 1):
            raise AssayError(f"parallel: expert parallel combines with data parallel and pp only today, not with "
                             f"tp or cp (got tp={self.tp}, cp={self.cp})")
        if self.cp > 1 and self.tp > 1:
            raise AssayError(f"parallel: context parallel combines with data parallel and pp only today, not with tp "
                             f"(got cp={self.cp}, tp={self.tp})")
        missing = [n for n in ("tp", "pp", "cp", "ep") if getattr(self, n) > 1 and n not in IMPLEMENTED]
        if missing:
            raise AssayError(f"parallel: {', '.join(missing)} > 1 is not implemented yet; "
                             f"available today: {', '.join(IMPLEMENTED)} (DDP, ZeRO-1, FSDP2)")

    @property
    def dp(self) -> int:
        """Ranks a step's batch is split over."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        return self.dp_shard > 1

    @property
    def ddp(self) -> bool:
        return self.dp_replicate > 1

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in _ORDER}

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The world mesh with every enabled dimension named, plus the flattened ``dp``."""
        names = [n for n in _ORDER if getattr(self, n) > 1] or ["dp_shard"]
        shape = [getattr(self, n) for n in names]
        mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
        dp_names = tuple(n for n in ("dp_replicate", "dp_shard") if n in names)
        if len(dp_names) > 1:
            mesh[dp_names]._flatten("dp")
        return mesh

    def ep_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """A new 2-D mesh over this rank's data-parallel ranks: ``ep`` (a group of ranks that together
        hold every expert once) inside ``ep_replicate`` (the ranks holding the same experts, dp / ep).

        ep is not a dimension of the world mesh: experts live on data-parallel ranks (torchtitan
        style), so this splits the dp ranks; under pp, those of each pipeline stage (pp is the
        world mesh's outermost dimension). Creating it is collective: call it once."""
        if self.ep == 1 or self.tp > 1 or self.cp > 1:
            raise AssayError("parallel: the expert mesh needs ep > 1 on data-parallel ranks only")
        if self.pp == 1:  # the dp ranks are the world's, row-major
            return init_device_mesh(mesh.device_type, (self.dp // self.ep, self.ep),
                                    mesh_dim_names=("ep_replicate", "ep"))
        ranks = mesh.mesh.reshape(self.pp, self.dp // self.ep, self.ep)
        stages = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=("pp", "ep_replicate", "ep"))
        return stages["ep_replicate", "ep"]

    def dp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        if self.ddp and self.fsdp:
            return mesh["dp"]
        return mesh["dp_replicate"] if self.ddp else mesh["dp_shard"]
