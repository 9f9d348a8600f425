"""SGLang's HTTP API over an EngineCore: the same paths, bodies and status codes as `sglang.launch_server`.

Refusals take the shape SGLang gives them on each route. /generate: a body of the wrong form (malformed JSON, a
top-level field of the wrong type) answers 400 `{"object": "error", "message", "type": "Bad Request", "param",
"code": 400}`, as FastAPI's validation does there; a bad value in `sampling_params`, no prompt, and any request
the engine cannot run (prompt over the context, bad token ids) answer `{"error": {"message", ...}}` through
rlfleet's shared error handlers, as SGLang's handler answers its ValueErrors (`body_errors`). The OpenAI routes:
a body of the wrong form is the same 400 `{"object": "error", ...}`; a request they refuse past that (a sampling
value out of range, a prompt over the context) is the same object with `"type": "BadRequestError"`, as SGLang's
OpenAI handlers answer it. Weight loads answer `{"success", "message"}` (and `num_paused_requests` from a load, as
SGLang does): 200, or the failure's own status (400 bad input, 503 a group that could not be joined or broke, 504 a
load that timed out).

`/get_model_info` and `/get_server_info` add one field to SGLang's: `weights_partial`, true while the engine
holds part of a weight version sent in buckets (`EngineCore.weights_partial`), so its weight_version does not
describe its weights; so does `/update_weights_from_distributed`'s answer.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from rlfleet.client_gone import ClientGone, unless_client_leaves
from rlfleet.errors import InvalidInput, RlfleetError
from rlfleet.http_errors import error_response, install_error_handlers, whole_body_problem
from rlfleet_engine.body_errors import describe, refused_past_validation
from rlfleet_engine.openai_api import OpenAIServer
from rlfleet_engine.openai_schemas import ChatCompletionRequest, CompletionRequest
from rlfleet_engine.schemas import (
    AbortRequest,
    DestroyWeightsUpdateGroupRequest,
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    PauseGenerationRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
)

if TYPE_CHECKING:  # the sim backend serves this app without importing torch
    from rlfleet_engine.distributed_weights import WeightReceiver
    from rlfleet_engine.engine_core import EngineCore

# The `type` of SGLang's OpenAI refusals past validation (its serving handlers' create_error_response).
_OPENAI_REFUSAL_TYPE = "BadRequestError"


def create_app(
    core: EngineCore, registry: CollectorRegistry, chat_defaults: Mapping[str, float] | None = None
) -> FastAPI:
    """`chat_defaults`: the sampling values a chat request leaves unset takes (the model's generation_config.json)."""
    # strict_content_type=False: a body without a Content-Type is read as JSON, as SGLang's server reads it.
    app = FastAPI(title="rlfleet-engine", version="0.1.0", strict_content_type=False)
    install_error_handlers(app)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        whole = whole_body_problem(exc, request.headers.get("content-type"), missing_reads_as_json=True)
        message = whole or describe(exc.errors())
        if request.url.path == "/generate" and whole is None and refused_past_validation(exc.body, exc.errors()):
            return error_response(InvalidInput(message))
        return _openai_error(message, HTTPStatus.BAD_REQUEST, HTTPStatus.BAD_REQUEST.phrase)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if core.scheduler.alive() else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        return Response(status_code=200 if await core.health_generate() else 503)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return {**core.model_info(), "weights_partial": core.weights_partial}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return {**core.server_info(), "weights_partial": core.weights_partial}

    @app.get("/get_weight_version")
    async def weight_version() -> dict[str, Any]:
        return {"weight_version": core.weight_version}

    def model_card() -> dict[str, Any]:
        name = core.config.served_model_name
        return {
            "id": name,
            "object": "model",
            "created": int(time.time()),  # OpenAI's Model requires it; SGLang's card stamps the answer's time too
            "owned_by": "rlfleet",
            "root": name,
            "max_model_len": core.backend.context_length,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    # `:path`, as SGLang's: a served name is often a Hugging Face id or a directory, with slashes.
    @app.get("/v1/models/{model:path}", response_model=None)
    async def retrieve_model(model: str) -> dict[str, Any] | JSONResponse:
        card = model_card()
        if model != card["id"]:
            # OpenAI's answer for a model it does not have, as SGLang gives it.
            error = {
                "message": f"The model '{model}' does not exist; this engine serves '{card['id']}'",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
            return JSONResponse({"error": error}, status_code=HTTPStatus.NOT_FOUND)
        return card

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it; the work was cancelled

    @app.api_route("/generate", methods=["POST", "PUT"], response_model=None)
    async def generate(req: GenerateRequest, request: Request) -> Any:
        if not req.stream:
            return JSONResponse(await unless_client_leaves(request, core.generate(req)))
        chunks = core.generate_stream(req)
        return StreamingResponse(_server_sent_events(chunks), media_type="text/event-stream")

    openai = OpenAIServer(core, chat_defaults or {})

    async def openai_answer(req: CompletionRequest | ChatCompletionRequest, request: Request) -> Any:
        try:
            if req.stream:
                return StreamingResponse(openai.stream(req), media_type="text/event-stream")
            return JSONResponse(await unless_client_leaves(request, openai.complete(req)))
        except RlfleetError as exc:
            if exc.http_status >= 500:
                raise  # logged and answered by the shared handlers
            # A refused request in the OpenAI error shape, as SGLang's OpenAI handlers answer it; statuses other than
            # 400 are this engine's own limits (413), named by their phrase.
            status = HTTPStatus(exc.http_status)
            return _openai_error(str(exc), status, _OPENAI_REFUSAL_TYPE if status == 400 else status.phrase)

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> Any:
        return await openai_answer(req, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        return await openai_answer(req, request)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if not core.flush_cache():
            running, waiting = core.scheduler.counts()
            # SGLang's answer: 400, the cache kept (its blocks are in use).
            message = f"Cache not flushed: there are pending requests ({running} running, {waiting} waiting).\n"
            return PlainTextResponse(message, status_code=HTTPStatus.BAD_REQUEST)
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: UpdateWeightsFromDiskRequest) -> JSONResponse:
        try:
            result = await core.update_weights_from_disk(req)
        except RlfleetError as exc:
            failed = {"success": False, "message": f"Failed to update weights: {exc}", "num_paused_requests": 0}
            return JSONResponse(failed, status_code=exc.http_status)
        return JSONResponse(result)

    async def receiver() -> WeightReceiver:
        """The core's weight receiver, made off the event loop: the sim backend makes it on first use, importing
        torch, seconds in which the engine answered nothing (a router asking /end_weight_update before a disk load
        saw /model_info time out, and took the engine out of routing)."""
        return await asyncio.to_thread(lambda: core.weight_receiver)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(req: InitWeightsUpdateGroupRequest) -> JSONResponse:
        try:
            message = await (await receiver()).init_group(req)
        except RlfleetError as exc:
            return _weight_failure(exc, "Failed to initialize custom process group")
        return JSONResponse({"success": True, "message": message})

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(req: UpdateWeightsFromDistributedRequest) -> JSONResponse:
        try:
            update = await (await receiver()).update(req)
        except RlfleetError as exc:
            return _weight_failure(exc, "Failed to update parameter online")
        answer = {
            "success": True,
            "message": update.message,
            "num_paused_requests": update.num_paused_requests,
            "weights_partial": update.weights_partial,
        }
        return JSONResponse(answer)

    @app.post("/begin_weight_update")
    async def begin_weight_update() -> JSONResponse:
        try:
            message = (await receiver()).begin_session()
        except RlfleetError as exc:
            return _weight_failure(exc, "Failed to begin the weight update")
        return JSONResponse({"success": True, "message": message})

    @app.post("/end_weight_update")
    async def end_weight_update() -> JSONResponse:
        try:
            message = (await receiver()).end_session()
        except RlfleetError as exc:
            return _weight_failure(exc, "Failed to end the weight update")
        return JSONResponse({"success": True, "message": message})

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(req: DestroyWeightsUpdateGroupRequest) -> JSONResponse:
        try:
            message = (await receiver()).destroy_group(req)
        except RlfleetError as exc:
            return _weight_failure(exc, "Failed to destroy custom process group")
        return JSONResponse({"success": True, "message": message})

    @app.post("/pause_generation")
    async def pause_generation(req: PauseGenerationRequest | None = None) -> dict[str, str]:
        await core.pause((req or PauseGenerationRequest()).mode)  # no body (FastAPI reads `null` as none): abort
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation() -> dict[str, str]:
        core.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/abort_request")
    async def abort_request(req: AbortRequest) -> Response:
        core.abort(req.rid, req.abort_all)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _openai_error(message: str, status: HTTPStatus, kind: str) -> JSONResponse:
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status.value}
    return JSONResponse(body, status_code=status)


def _weight_failure(exc: RlfleetError, what: str) -> JSONResponse:
    return JSONResponse({"success": False, "message": f"{what}: {exc}"}, status_code=exc.http_status)


async def _server_sent_events(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"
