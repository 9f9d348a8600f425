"""The router's HTTP endpoints of the distributed weight path: a thin layer over `DistributedWeights`.

`/init_weights_update_group`, `/update_weights_from_distributed` and `/destroy_weights_update_group`
keep SGLang's paths and bodies, for the whole fleet (the answer lists each engine's outcome: 200 if
all succeeded, else 502; a bucket that could not be sent in time, 503). `GET /weights_update_groups/{name}`
shows a group's members and whether they are still the healthy engines; `GET /weights_update_world_size` the
world_size a group opened now needs (the trainer and every rank of the healthy engines: an engine with tensor
parallelism takes tp_size ranks) and each engine's rank_offset; `POST /weight_version/disk_copy`
registers where engines that rejoin load the current version from.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from rlfleet_router.api_models import (
    DestroyWeightsGroupRequest,
    DiskCopyRequest,
    DistributedUpdateRequest,
    InitWeightsGroupRequest,
)

if TYPE_CHECKING:
    from rlfleet_router.fleet import Fleet


def weight_group_routes(fleet: Fleet) -> APIRouter:
    routes = APIRouter()
    groups = fleet.distributed_weights

    @routes.post("/init_weights_update_group")
    async def init_weights_update_group(req: InitWeightsGroupRequest) -> JSONResponse:
        result, group = await groups.init_group(
            req.master_address, req.master_port, req.world_size, req.group_name, req.backend
        )
        ranks = {m.worker.id: (m.rank_offset, m.ranks) for m in group.members}
        engines = [
            {**r.describe(), "rank_offset": ranks[r.worker_id][0], "ranks": ranks[r.worker_id][1]}
            for r in result.engines
        ]
        body = {**result.describe(), "group_name": group.name, "world_size": group.world_size, "engines": engines}
        return JSONResponse(body, status_code=200 if result.success else 502)

    @routes.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(req: DistributedUpdateRequest, request: Request) -> JSONResponse:
        # Re-encoded so a numeric weight_version reaches the engines as text; unknown fields pass through.
        body = json.dumps(req.model_dump()).encode()
        result = await groups.update(req.group_name, req.weight_version, body, request.is_disconnected)
        return JSONResponse(result.describe(), status_code=200 if result.success else 502)

    @routes.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(req: DestroyWeightsGroupRequest) -> JSONResponse:
        result = await groups.destroy(req.group_name, json.dumps(req.model_dump()).encode())
        return JSONResponse(result.describe(), status_code=200 if result.success else 502)

    @routes.get("/weights_update_world_size")
    async def get_weights_update_world_size() -> dict[str, object]:
        members = await groups.world()
        return {
            "world_size": 1 + sum(m.ranks for m in members),
            "engines": [{"url": m.worker.url, "rank_offset": m.rank_offset, "ranks": m.ranks} for m in members],
        }

    @routes.get("/weights_update_groups/{group_name}")
    async def get_weights_update_group(group_name: str) -> dict[str, object]:
        return groups.group(group_name).describe(fleet.workers.healthy())

    @routes.post("/weight_version/disk_copy")
    async def register_disk_copy(req: DiskCopyRequest) -> dict[str, object]:
        body = json.dumps({"model_path": req.model_path, "weight_version": req.weight_version}).encode()
        fleet.weights.register_disk_copy(req.weight_version, req.model_path, body)
        return {"weight_version": req.weight_version, "model_path": req.model_path}

    return routes
