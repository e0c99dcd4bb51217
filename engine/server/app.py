"""The FastAPI application: thin routes over the serving classes; state lives on `app.state`."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from engine.server.async_engine import AsyncEngine
from engine.server.auth import require_api_key
from engine.server.disconnect import ClientDisconnected
from engine.server.errors import ServiceUnavailable, install_error_handlers, parse_body
from engine.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from engine.server.serving_chat import ChatServing
from engine.server.serving_completion import CompletionServing
from engine.server.settings import ServerSettings


def _body(model: type) -> dict:
    """The route's request body in the OpenAPI document (routes parse it themselves: size limit, errors)."""
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _with_request_schemas(app: FastAPI, models: list[type]) -> None:
    """Adds the request models (and what they reference) to the OpenAPI document's components."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = generate()
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi


def create_app(settings: ServerSettings, engine: AsyncEngine) -> FastAPI:
    """The server for one engine; the engine loop starts with the app and stops with it."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()  # builds the model in the background: /health answers while it loads
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title="deepseek-engine", lifespan=lifespan)
    _with_request_schemas(app, [ChatCompletionRequest, CompletionRequest])
    app.state.settings = settings
    app.state.engine = engine
    app.state.chat = ChatServing(engine, settings.served_model_name, settings.images)
    app.state.completions = CompletionServing(engine, settings.served_model_name)
    install_error_handlers(app)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    async def accepting() -> None:
        if engine.draining:
            raise ServiceUnavailable("The server is draining and accepts no new requests.")
        if not engine.is_ready:
            raise ServiceUnavailable("The model is not loaded yet." if engine.is_alive else "The engine failed.")

    v1 = [Depends(require_api_key)]

    @app.post("/v1/chat/completions", dependencies=[*v1, Depends(accepting)], openapi_extra=_body(ChatCompletionRequest))
    async def chat_completions(raw: Request) -> Response:
        return await app.state.chat.create(await parse_body(raw, ChatCompletionRequest, settings.max_body_bytes), raw)

    @app.post("/v1/completions", dependencies=[*v1, Depends(accepting)], openapi_extra=_body(CompletionRequest))
    async def completions(raw: Request) -> Response:
        return await app.state.completions.create(await parse_body(raw, CompletionRequest, settings.max_body_bytes), raw)

    @app.get("/v1/models", dependencies=v1)
    async def models() -> ModelList:
        max_model_len = engine.max_model_len if engine.is_ready else 0
        return ModelList(data=[ModelCard(id=settings.served_model_name, max_model_len=max_model_len)])

    @app.get("/health")
    async def health() -> JSONResponse:
        # Alive while the model loads; dead (restart me) once the engine loop has failed, or while it has
        # been silent longer than its heartbeat allows (a wedged or stopped engine process)
        if engine.error is not None:
            return JSONResponse({"status": "failed"}, status_code=503)  # why: in the log
        if engine.silent_for() > settings.engine_silence_timeout:
            return JSONResponse({"status": "unresponsive", "error": f"the engine has not reported for "
                                 f"{engine.silent_for():.0f} s"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not engine.is_ready:
            return JSONResponse({"status": "loading" if engine.error is None else "failed"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
