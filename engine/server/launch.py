"""`deepseek-engine serve`: its flags, and running uvicorn with a drain on SIGTERM."""

import argparse
import asyncio
import logging
import os
import signal
import socket
from typing import Any

import uvicorn

from engine.metrics import EngineMetrics
from engine.server.app import create_app
from engine.server.async_engine import AsyncEngine
from engine.server.engine_process import build_llm_engine
from engine.multimodal import ImageLimits
from engine.server.errors import ServiceUnavailable
from engine.server.images import ImageSettings
from engine.server.settings import ServerSettings
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

ENV_PREFIX = "DEEPSEEK_ENGINE_"
DEFAULT_MODEL = "deepseek-tiny"


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The serve flags; each also reads DEEPSEEK_ENGINE_<FLAG> (flag on the command line wins)."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory, or the embedded deepseek-tiny")
    model.add_argument("--served-model-name", help="name clients send as `model` (default: --model)")
    model.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    model.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8"],
                       help="the MLA latent cache: auto = the activations' dtype; fp8 = e4m3 with a scale per token "
                            "(57 %% of bf16's bytes, V3-family models only)")
    model.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                       help="dummy: random weights instead of the checkpoint's (its config.json and tokenizer "
                            "only), to measure a model's shapes")
    model.add_argument("--max-model-len", type=_positive_int, help="context length (default: the model's)")
    model.add_argument("--max-num-seqs", type=_positive_int, help="most requests decoded together")
    model.add_argument("--max-num-batched-tokens", type=_positive_int, help="token budget of one step (default 2048)")
    model.add_argument(
        "--async-scheduling", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
        help="launch each decode step before the host reads the last one's tokens (auto: on a GPU)",
    )  # fmt: skip
    model.add_argument("--block-size", type=int, choices=[16, 32, 64, 128],
                       help="tokens a KV page (vLLM's flag; default 16; DeepSeek-V4 rounds it up to whole compression "
                            "windows): the unit of prefix caching and cross-replica reuse, and at 64 or more each "
                            "decode attention tile lies in one page; every replica of a fleet must agree")
    model.add_argument("--prefill-graph-tokens", type=_non_negative_int,
                       help="steps of up to this many tokens replay CUDA graphs (a fresh prompt whole, others in "
                            "pieces around attention; V3-family models on a GPU; default 2048; 0: eager)")
    model.add_argument("--engram-tables", default="device", choices=["device", "host"],
                       help="where DeepSeek-V4.1's Engram tables live: host keeps them in pinned host memory "
                            "(~200 GB a replica in the release) and copies each step's rows over")
    model.add_argument(
        "--speculative-config", type=_speculative_config,
        help="""speculative decoding, as JSON (vLLM's flag): '{"method": "mtp", "num_speculative_tokens": 2}' """
             "drafts 2 tokens a step with the checkpoint's MTP layer; \"disable_by_batch_size\": N drafts only "
             "while at most N requests run (unset: on a GPU, up to the batch size where drafting measured "
             "faster at start)",
    )  # fmt: skip
    par = parser.add_argument_group("parallelism and memory")
    par.add_argument("--tensor-parallel-size", type=_positive_int, default=1,
                     help="ranks one replica runs on (GPUs; over all its nodes), one process each")
    par.add_argument("--enable-expert-parallel", action="store_true",
                     help="partition the routed experts over the ranks instead of splitting each one")
    par.add_argument("--nnodes", type=_positive_int, default=1, help="nodes one replica spans")
    par.add_argument("--node-rank", type=_non_negative_int, default=0,
                     help="this node's index; nodes other than 0 run their ranks only (no HTTP server)")
    par.add_argument("--dist-init-addr", help="host:port where node 0 meets the other nodes' ranks")
    par.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9,
                     help="fraction of each GPU the engine may take; the KV cache gets what the rest leaves")
    par.add_argument("--kv-cache-memory", type=_bytes,
                     help="KV cache size per rank, e.g. 4GiB (instead of --gpu-memory-utilization; CPU default 1GiB)")
    par.add_argument("--num-gpu-blocks-override", type=_positive_int, help="KV cache blocks per rank (tests)")
    par.add_argument("--num-window-pages", type=_non_negative_int,
                     help="pages of a sliding-window cache (V4) apart from the blocks (default: sized from "
                          "--max-num-seqs and --max-num-batched-tokens; 0: a page per block)")
    http = parser.add_argument_group("server")
    http.add_argument("--host", default="0.0.0.0")
    http.add_argument("--port", type=_port, default=8000)
    http.add_argument("--api-key-file", help="file holding the API key clients must send as a Bearer token")
    http.add_argument(
        "--max-waiting-requests", type=_positive_int, help="answer 429 beyond this queue depth (default: unbounded)"
    )
    http.add_argument(
        "--drain-timeout", type=_non_negative_float, default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    http.add_argument(
        "--max-request-body-size", type=_bytes, default=32 << 20,
        help="larger request bodies get a 413 (default 32MiB; units as for --kv-cache-memory)",
    )
    http.add_argument(
        "--engine-heartbeat-timeout", type=_positive_float, default=10.0,
        help="/health fails once the engine process has been silent this long (it reports every second)",
    )
    images = parser.add_argument_group("image input (models with a vision tower)")
    images.add_argument("--enable-image-urls", action="store_true",
                        help="fetch http(s) image URLs of image_url parts (off: only inline data: URLs are taken)")
    images.add_argument("--image-fetch-timeout", type=_positive_float, default=10.0,
                        help="seconds a fetch of an image URL may take")
    images.add_argument("--max-image-size", type=_bytes, default=20 << 20,
                        help="larger images (encoded) get a 400 (default 20MiB; units as for --kv-cache-memory)")
    images.add_argument("--max-image-pixels", type=_positive_int, default=50_000_000,
                        help="images of more pixels (width x height, decoded) get a 400")
    images.add_argument("--max-images-per-request", type=_positive_int, default=16)
    fleet = parser.add_argument_group("fleet (set by the operator)")
    fleet.add_argument("--replica-id", help="this replica's name in the KV directory (the pod name)")
    fleet.add_argument("--advertise-host", help="address peers pull KV blocks from (the pod IP; default 127.0.0.1)")
    fleet.add_argument("--kv-directory", help="redis URL of the KV-cache directory (absent: local prefix cache only)")
    fleet.add_argument("--kv-transport", default="auto", choices=["auto", "tcp", "rdma"])
    fleet.add_argument("--kv-transfer-port", type=_port_or_any, default=8100, help="0: any free port")
    fleet.add_argument(
        "--kv-transfer-streams", type=_positive_int,
        help="TCP connections one large KV pull is striped over (default: min(4, usable cores))",
    )  # fmt: skip
    fleet.add_argument(
        "--kv-min-prefix-tokens", type=_non_negative_int, default=64,
        help="shorter missing prefixes are recomputed without asking the directory",
    )  # fmt: skip
    fleet.add_argument("--kv-pull-policy", default="auto", choices=["auto", "always", "never"])
    fleet.add_argument(
        "--kv-secret-file",
        help="file holding the fleet's KV secret: peers authenticate with it and sign their directory entries",
    )  # fmt: skip
    parser.epilog = f"Every flag also reads {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}MAX_MODEL_LEN=8192)."
    apply_env_defaults(parser)


def apply_env_defaults(parser: argparse.ArgumentParser) -> None:
    """Makes DEEPSEEK_ENGINE_<FLAG_IN_CAPS> the default of each --flag (parsed and checked like the flag)."""
    for action in parser._actions:  # argparse offers no public iterator over a parser's arguments
        flags = [s for s in action.option_strings if s.startswith("--")]
        if not flags or action.dest == "help":
            continue
        name = ENV_PREFIX + flags[0][2:].replace("-", "_").upper()
        value = os.environ.get(name)
        if value is None:
            continue
        try:
            if action.nargs == 0:  # a switch (store_true): the variable says yes or no
                converted = _switch(value)
            else:
                converted = action.type(value) if action.type else value
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            parser.error(f"environment variable {name}={value!r}: {exc}")
        if action.choices is not None and converted not in action.choices:
            parser.error(f"environment variable {name}={value!r}: choose from {', '.join(map(str, action.choices))}")
        action.default = converted


def _speculative_config(value: str):
    from engine.config import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(
        served_model_name=args.served_model_name or args.model,
        host=args.host,
        port=args.port,
        api_key=read_api_key(args.api_key_file) if args.api_key_file else None,
        max_waiting_requests=args.max_waiting_requests,
        drain_timeout=args.drain_timeout,
        engine_silence_timeout=args.engine_heartbeat_timeout,
        max_body_bytes=args.max_request_body_size,
        images=ImageSettings(
            fetch_urls=args.enable_image_urls,
            fetch_timeout=args.image_fetch_timeout,
            limits=ImageLimits(max_bytes=args.max_image_size, max_pixels=args.max_image_pixels,
                               max_images=args.max_images_per_request),
        ),
    )


def read_api_key(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except OSError as exc:
        raise SystemExit(f"error: cannot read --api-key-file {path}: {exc.strerror}") from None
    if not key:
        raise SystemExit(f"error: --api-key-file {path} is empty")
    return key


def engine_config(args: argparse.Namespace) -> Any:
    """The EngineConfig the flags describe; bad flags fail here, at once, not in the engine process."""
    from engine.config import EngineConfig, resolve_model_path

    kwargs = {
        "model": args.model, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype, "load_format": args.load_format, "max_model_len": args.max_model_len,
        "kv_directory": args.kv_directory, "replica_id": args.replica_id, "kv_transport": args.kv_transport,
        "kv_transfer_port": args.kv_transfer_port, "kv_min_prefix_tokens": args.kv_min_prefix_tokens,
        "kv_pull_policy": args.kv_pull_policy, "async_scheduling": args.async_scheduling,
        "tensor_parallel_size": args.tensor_parallel_size, "enable_expert_parallel": args.enable_expert_parallel,
        "nnodes": args.nnodes, "node_rank": args.node_rank, "dist_init_addr": args.dist_init_addr,
        "gpu_memory_utilization": args.gpu_memory_utilization, "kv_cache_memory": args.kv_cache_memory,
        "num_kv_blocks": args.num_gpu_blocks_override, "num_window_pages": args.num_window_pages, "speculative_config": args.speculative_config,
        "kv_secret": read_kv_secret(args.kv_secret_file) if args.kv_secret_file else None,
        "engram_tables": args.engram_tables,
    }  # fmt: skip
    # Unset: the engine's own defaults.
    for name in ("max_num_seqs", "max_num_batched_tokens", "advertise_host", "kv_transfer_streams",
                 "prefill_graph_tokens", "block_size"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    try:
        resolve_model_path(args.model)
        return EngineConfig(**kwargs)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None


def read_kv_secret(path: str) -> bytes:
    from engine.kv.auth import read_secret

    try:
        return read_secret(path)
    except OSError as exc:
        raise SystemExit(f"error: cannot read --kv-secret-file {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise SystemExit(f"error: --kv-secret-file: {exc}") from None


class DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM drains: /ready and new requests answer 503, the requests in flight
    finish (up to the drain timeout), then the process exits 0. A failed engine exits 1."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self.exit_code = 0
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        watchdog = asyncio.create_task(self._exit_on_engine_failure())
        try:
            await super().serve(sockets)
        finally:
            watchdog.cancel()

    def handle_exit(self, sig: int, frame: Any) -> None:
        if sig == signal.SIGTERM and not self.should_exit:
            # Not handed to uvicorn: it would stop listening at once and re-raise SIGTERM on exit.
            if not self._draining and self._loop is not None:
                self._draining = True
                self._loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)
        if self._loop is not None:  # Ctrl-C: do not wait for streams to run out
            self._loop.call_soon_threadsafe(self.engine.abort_all, ServiceUnavailable("The server is shutting down."))

    def _start_drain(self) -> None:
        task = asyncio.create_task(self._drain())
        self._tasks.add(task)

    async def _drain(self) -> None:
        logger.info("SIGTERM: draining %d request(s), up to %.0f s", self.engine.num_active, self.drain_timeout)
        if not await self.engine.drain(self.drain_timeout):
            logger.warning("drain timeout reached: the remaining requests were aborted")
        self.should_exit = True

    async def _exit_on_engine_failure(self) -> None:
        await self.engine.failed.wait()
        self.exit_code = 1
        self.should_exit = True


def run(args: argparse.Namespace) -> int:
    """Serves until SIGTERM (drained, exit 0) or SIGINT; exit 1 when the engine fails."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_from_args(args)
    config = engine_config(args)
    if config.node_rank > 0:
        return run_node_ranks(config)
    engine = AsyncEngine(
        build_llm_engine, (config,), EngineMetrics(kv_reuse=config.kv_directory is not None),
        load_tokenizer=Tokenizer, max_waiting_requests=settings.max_waiting_requests,
    )  # fmt: skip
    app = create_app(settings, engine)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,  # keep the logging set up above
        timeout_graceful_shutdown=5,  # after the drain: time for the last bytes to reach clients
    )
    server = DrainingServer(config, engine, settings.drain_timeout)
    server.run()
    return server.exit_code


def run_node_ranks(config: Any) -> int:
    """A node other than 0 of a multi-node replica: its ranks only, until one exits (then the pod restarts)."""
    from engine.config import ModelConfig, resolve_model_path
    from engine.executor import run_node

    path = resolve_model_path(config.model)
    model_config = ModelConfig.from_dir(path)
    logger.info("node %d of %d: starting ranks %d..%d, rank 0 at %s", config.node_rank, config.nnodes,
                config.node_rank * config.ranks_per_node, (config.node_rank + 1) * config.ranks_per_node - 1,
                config.dist_init_addr)
    return run_node(config, model_config, path, config.max_model_len or model_config.max_position_embeddings)


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def _bytes(text: str) -> int:
    """A size: bytes, or with a unit (4GiB, 512MiB, 2GB)."""
    number = text.strip().rstrip("bBiIkKmMgGtT")
    unit = text.strip()[len(number):].lower()
    if unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"unknown size unit in {text!r}; use e.g. 4GiB, 512MiB or a byte count")
    try:
        value = int(float(number) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def _switch(text: str) -> bool:
    words = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
    if text.strip().lower() not in words:
        raise argparse.ArgumentTypeError("use true or false")
    return words[text.strip().lower()]


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be a port number 1..65535, got {value}")
    return value


def _port_or_any(text: str) -> int:
    return 0 if int(text) == 0 else _port(text)


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value
