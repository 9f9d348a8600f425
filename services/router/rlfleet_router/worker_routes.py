"""The router's membership endpoints: sglang-router's worker API, a thin layer over `Fleet.add_worker` and
`Fleet.remove_worker`.

Both generations of sglang-router's API are served, one implementation behind each pair of names, so launchers
written for either register engines here unchanged:
- `POST /workers` (sglang-router's `WorkerConfigRequest` as JSON), `GET /workers`, and `GET`/`DELETE
  /workers/{key}`, the key a worker's id or its URL (percent-encoded or not), as sglang-router before 0.3 named
  workers;
- the older API: `POST /add_worker?url=` and `POST /remove_worker?url=` (the URL in the query, as sglang-router
  takes it, or in a JSON body `{"url": ...}`, as slime's router also takes it) and `GET /list_workers`
  (`{"urls": [...]}`).

Adding a URL already in the fleet changes nothing and answers 200 (sglang-router refuses it, 400): an engine
that restarted registers again, and the router already knows it. A new engine takes traffic once a probe
passed and it serves the fleet's weight version, not when the answer comes: `POST /workers` answers 202, as
sglang-router from 0.3 does; `/add_worker` 200, as sglang-router's always did.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from rlfleet.errors import InvalidInput
from rlfleet.http_errors import describe_validation_error
from rlfleet_router.api_models import AddWorkerRequest
from rlfleet_router.fleet import parse_json_object

if TYPE_CHECKING:
    from rlfleet_router.fleet import Fleet
    from rlfleet_router.workers import Worker

MISSING_URL = (
    "url: required, in the query (POST /add_worker?url=http://host:port, as sglang-router takes it) "
    'or in a JSON body {"url": "http://host:port"}'
)


def worker_routes(fleet: Fleet) -> APIRouter:
    routes = APIRouter()

    def added(worker: Worker, created: bool, status_if_new: int) -> JSONResponse:
        location = f"/workers/{worker.id}"
        body = {
            "status": "accepted" if created else "exists",
            "worker_id": worker.id,
            "url": worker.url,
            "location": location,
            "message": "worker added; it takes traffic once healthy and on the fleet's weight version"
            if created
            else "worker already in the fleet",
        }
        return JSONResponse(body, status_code=status_if_new if created else 200, headers={"location": location})

    def removed(key: str) -> dict[str, object]:
        worker = fleet.remove_worker(key)
        return {"status": "removed", "worker_id": worker.id, "url": worker.url}

    @routes.get("/workers")
    async def list_workers() -> dict[str, object]:
        workers = [w.describe() for w in fleet.workers.all()]
        return {"workers": workers, "total": len(workers)}

    @routes.get("/list_workers")
    async def list_worker_urls() -> dict[str, list[str]]:
        return {"urls": [w.url for w in fleet.workers.all()]}

    @routes.post("/workers")
    async def add_worker(add: AddWorkerRequest) -> JSONResponse:
        worker, created = fleet.add_worker(add.url)
        return added(worker, created, status_if_new=202)

    @routes.post("/add_worker")
    async def add_worker_by_query(request: Request) -> JSONResponse:
        fields = await query_or_body(request)
        try:
            add = AddWorkerRequest.model_validate(fields)
        except ValidationError as exc:
            raise InvalidInput(describe_validation_error(RequestValidationError(exc.errors()))) from exc
        worker, created = fleet.add_worker(add.url)
        return added(worker, created, status_if_new=200)

    @routes.post("/remove_worker")
    async def remove_worker_by_query(request: Request) -> dict[str, object]:
        return removed(str((await query_or_body(request))["url"]))

    @routes.get("/workers/{worker_key:path}")
    async def get_worker(worker_key: str) -> dict[str, object]:
        return fleet.workers.get(worker_key).describe()

    @routes.delete("/workers/{worker_key:path}")
    async def remove_worker(worker_key: str) -> dict[str, object]:
        return removed(worker_key)

    return routes


async def query_or_body(request: Request) -> dict[str, object]:
    """The fields of an `/add_worker` or `/remove_worker` request: its query's and its JSON body's, which must
    hold a string `url` between them and not disagree about any field."""
    fields: dict[str, object] = dict(request.query_params)
    body = await request.body()
    if body.strip():
        given = parse_json_object(body)
        for name in fields.keys() & given.keys():
            if given[name] != fields[name]:
                raise InvalidInput(
                    f"{name}: given twice, {fields[name]!r} in the query and {given[name]!r} in the body"
                )
        fields = {**given, **fields}
    url = fields.get("url")
    if url is None:
        raise InvalidInput(MISSING_URL)
    if not isinstance(url, str):
        raise InvalidInput(f"url: must be a string like http://127.0.0.1:30001, got {url!r}")
    return fields
