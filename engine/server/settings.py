"""The server's own settings (the engine's, cross-replica KV reuse included, are in EngineConfig)."""

from dataclasses import dataclass, field

from engine.server.images import ImageSettings


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None  # None: no authentication
    max_waiting_requests: int | None = None  # None: unbounded waiting queue
    drain_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGTERM
    # /health fails when the engine process (which reports every second, and after every step) has been
    # silent this long: a wedged process gets restarted; a single step longer than this is the cost
    engine_silence_timeout: float = 10.0
    max_body_bytes: int = 32 << 20  # a request body beyond this is a 413 (a 1M-token prompt is ~4-8 MB)
    images: ImageSettings = field(default_factory=ImageSettings)  # image content parts (vision models)
