"""`Settings`: the one configuration object of m3jax. Every knob of model loading, the engine, the kernels and the
servers is declared here once, with its type, default and help text.

Everything else derives from it:
- `m3jax serve` and `m3jax generate` get their flags from `add_arguments` (a flag per field, named after it);
- `serving.LLM(**kwargs)` takes the same names (`Settings.from_kwargs` refuses an unknown one by name);
- the engine, the model loader, the kernel dispatch and the servers read the fields they need.

Environment variables only set defaults, read once when a `Settings` is built: M3JAX_ATTENTION_IMPL and
M3JAX_MOE_IMPL (kernel choice), M3JAX_COMPILATION_CACHE (cache directory), M3JAX_API_KEY, M3JAX_LOG_FORMAT,
M3JAX_NO_PROGRESS.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import sys
from pathlib import Path
from typing import Any

from pallas_kernels.choice import CHOICES as KERNEL_CHOICES
from pallas_kernels.choice import SPARSE_PREFILL, KernelChoice

MODEL, ENGINE, KERNELS, SERVER = "model", "engine", "kernels", "server"
GROUP_TITLES = {MODEL: "model", ENGINE: "engine", KERNELS: "kernels", SERVER: "server"}


def _env(name: str, default: Any = None) -> Any:
    value = os.environ.get(name, "").strip()
    return value if value else default


def knob(default: Any, help: str, group: str, *, choices: tuple[Any, ...] | None = None,  # noqa: A002
         env: str | None = None, metavar: str | None = None) -> Any:
    """A field of Settings: its default (from `env` when set), help text, CLI group and allowed values."""
    meta = {"help": help, "group": group, "choices": choices, "env": env, "metavar": metavar}
    if env is not None:
        return dataclasses.field(default_factory=lambda: _env(env, default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class Settings:
    # ---- model ----
    model: str | None = knob(None, "checkpoint directory (Hugging Face layout) or preset name (random weights: "
                             "m3-full, m3-slice, m3-tiny); default: the embedded tiny model", MODEL, metavar="DIR")
    dtype: str = knob("auto", "compute dtype of weights and activations (auto: bfloat16 on a GPU, float32 on the "
                      "CPU)", MODEL, choices=("auto", "bfloat16", "float32"))
    tensor_parallel_size: int = knob(1, "devices to shard the model over (tensor parallelism)", MODEL)
    expert_parallel: bool = knob(False, "split the routed experts over the devices instead of their width", MODEL)
    moe_weight_format: str = knob("bf16", "how the MoE kernels hold expert weights on the device (mxfp8 / mxfp4: "
                                  "8 / 4 bits, widened inside the kernel)", MODEL, choices=("bf16", "mxfp8", "mxfp4"))
    seed: int = knob(0, "seed of preset models' random weights and of unseeded requests' sampling seeds", MODEL)
    gpu_memory_fraction: float = knob(0.92, "fraction of each GPU's memory the process may take (weights, KV cache, "
                                      "activations); applied when the engine is the first to start JAX",
                                      MODEL, env="XLA_PYTHON_CLIENT_MEM_FRACTION")
    # ---- engine ----
    max_model_len: int | None = knob(None, "longest request, prompt plus output, in tokens (default: the "
                                     "checkpoint's limit, at most 4096)", ENGINE)
    max_num_seqs: int = knob(16, "requests running at once (rows of a step)", ENGINE)
    max_num_batched_tokens: int = knob(256, "tokens per step (prefill chunks plus decodes)", ENGINE)
    kv_cache_pages: int | None = knob(None, "KV cache pages of one MSA block each (default: every running request "
                                      "at the full model length, or --kv-cache-memory-gb)", ENGINE)
    kv_cache_memory_gb: float | None = knob(None, "KV cache size in GiB (instead of --kv-cache-pages)", ENGINE)
    compilation_cache_dir: str | None = knob(
        str(Path.home() / ".cache" / "m3jax"), "where compiled steps are kept between runs (serialized "
        "executables and XLA's cache), so a restart neither traces nor compiles", ENGINE,
        env="M3JAX_COMPILATION_CACHE", metavar="DIR")
    enable_compilation_cache: bool = knob(True, "keep compiled steps on disk (see --compilation-cache-dir)", ENGINE)
    enable_prefix_caching: bool = knob(True, "reuse the K/V and index-K pages of prompt prefixes already computed "
                                       "(full pages, shared without copies, evicted least recently used)", ENGINE)
    async_scheduling: bool = knob(True, "prepare step N+1 on the host while the device runs step N", ENGINE)
    speculative_config: str | None = knob(
        None, 'speculative decoding, as vLLM\'s JSON: {"method": "eagle3", "model": DRAFT_DIR, '
        '"num_speculative_tokens": K}; without "model", the EAGLE-3 draft shipped for the embedded tiny model',
        ENGINE, metavar="JSON")
    warmup: bool = knob(True, "compile every step shape at start-up, so serving never compiles", ENGINE)
    enable_prompt_logprobs: bool = knob(False, "serve requests that ask for prompt_logprobs (and echo with "
                                        "logprobs): one more step executable per token bucket, compiled at "
                                        "start-up; without it such requests are refused", ENGINE)
    progress: bool | None = knob(None, "progress bars for loading and compiling (default: when stderr is a "
                                 "terminal and M3JAX_NO_PROGRESS is not 1)", ENGINE)
    # ---- kernels ----
    attention_kernels: str = knob("auto", "attention, MSA index + top-k, block-sparse attention and KV writes "
                                  "(auto: Pallas on a GPU, jnp references elsewhere; interpret: the Pallas "
                                  "kernels in the interpreter)", KERNELS, choices=KERNEL_CHOICES,
                                  env="M3JAX_ATTENTION_IMPL")
    moe_kernels: str = knob("auto", "the MoE grouped GEMMs and dense MLPs (auto: Pallas on GPUs, on any number of "
                            "them, jnp references elsewhere)", KERNELS, choices=KERNEL_CHOICES, env="M3JAX_MOE_IMPL")
    batch_invariant: bool = knob(False, "greedy tokens that do not depend on the batch, chunking or preemption: "
                                 "every kernel runs tiles that give a row the same arithmetic whatever the step "
                                 "holds (the linears, router and norms' sums through the Pallas linear kernel); "
                                 "shown on H100 and H200; its cost, measured per GPU, is in docs/benchmarks.md",
                                 KERNELS)
    sparse_prefill_kernel: str = knob("block_major", "MSA block-sparse attention at prefill: block_major (each "
                                      "selected page read once for the query tiles that chose it; best where "
                                      "neighbouring tokens choose different pages, as with random weights) or union "
                                      "(each 4-token tile over the union of its pages; about a fifth faster where "
                                      "neighbouring tokens' selections overlap; docs/benchmarks.md)", KERNELS,
                                      choices=SPARSE_PREFILL)
    # ---- server ----
    host: str = knob("127.0.0.1", "address both servers bind (127.0.0.1: this machine only; 0.0.0.0: every "
                     "interface)", SERVER)
    grpc_port: int = knob(50051, "gRPC port (0: any free port; -1: no gRPC server)", SERVER)
    http_port: int = knob(8000, "OpenAI-compatible HTTP port (0: any free port; -1: no HTTP server)", SERVER)
    served_model_name: str | None = knob(None, "the name clients pass as `model` (unset: --model as given, or "
                                         "m3jax/tiny for the embedded model)", SERVER, metavar="NAME")
    max_queue: int = knob(256, "requests admitted and not finished, across both servers; past it: HTTP 429 / "
                          "RESOURCE_EXHAUSTED", SERVER, metavar="N")
    api_key: str | None = knob(None, "require `Authorization: Bearer KEY` on /v1/* and as gRPC metadata", SERVER,
                               env="M3JAX_API_KEY", metavar="KEY")
    shutdown_timeout: float = knob(30.0, "seconds in-flight requests get to finish on SIGINT / SIGTERM before "
                                   "they are aborted (a second signal aborts them at once)", SERVER,
                                   metavar="SECONDS")
    max_request_body_mb: float | None = knob(
        None, "largest HTTP request body in MiB; a larger one is refused (413) before it is read (unset: 1 MiB "
        "plus 32 bytes per token of the model length)", SERVER, metavar="MIB")
    log_level: str = knob("INFO", "logging level", SERVER, choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    log_format: str = knob("text", "log lines as text or as one JSON object per line (for log collectors)",
                           SERVER, choices=("text", "json"), env="M3JAX_LOG_FORMAT")
    reasoning_parser: str = knob("minimax_m3", "split M3's thinking (<mm:think> ... </mm:think>) out of chat replies "
                                 "into reasoning_content, when the tokenizer has those markers (none: the text "
                                 "as generated)", SERVER, choices=("minimax_m3", "none"))
    tool_call_parser: str = knob("minimax_m3", "parse M3's tool-call blocks in chat replies into tool_calls (none: "
                                 "`tools` are only rendered into the prompt, and a tool_choice other than none "
                                 "is refused)", SERVER, choices=("minimax_m3", "none"))
    engine_process: bool = knob(True, "run the engine core in a process of its own, as vLLM does: the servers' "
                                "event loop and the engine's step thread then hold a GIL each (at high "
                                "concurrency, sharing one made the host set the pace of a step)", SERVER)
    throughput_log_interval: float = knob(10.0, "seconds between throughput log lines while serving (tokens/s, "
                                          "running and waiting requests, KV cache use; 0: none)", SERVER,
                                          metavar="SECONDS")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            choices = f.metadata["choices"]
            if choices is not None and value not in choices:
                raise ValueError(f"{flag(f.name)}: {value!r} is not one of {', '.join(map(str, choices))}")
        positive = ("tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens", "max_queue")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{flag(name)} must be at least 1, got {getattr(self, name)}")
        for name in ("max_model_len", "kv_cache_pages"):
            if getattr(self, name) is not None and getattr(self, name) < 2:
                raise ValueError(f"{flag(name)} must be at least 2, got {getattr(self, name)}")
        if not 0 < float(self.gpu_memory_fraction) <= 1:
            raise ValueError(f"{flag('gpu_memory_fraction')} must be in (0, 1], got {self.gpu_memory_fraction}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"{flag('kv_cache_memory_gb')} must be positive, got {self.kv_cache_memory_gb}")
        if self.kv_cache_pages is not None and self.kv_cache_memory_gb is not None:
            raise ValueError(f"give {flag('kv_cache_pages')} or {flag('kv_cache_memory_gb')}, not both")
        for name in ("grpc_port", "http_port"):
            if not -1 <= getattr(self, name) <= 65535:
                raise ValueError(f"{flag(name)} must be a port in 0..65535 (or -1 for none), got "
                                 f"{getattr(self, name)}")
        if self.grpc_port == self.http_port == -1:
            raise ValueError(f"{flag('grpc_port')} -1 and {flag('http_port')} -1: at least one server must run")
        if self.grpc_port == self.http_port and self.grpc_port > 0:
            raise ValueError(f"{flag('grpc_port')} and {flag('http_port')} are both {self.grpc_port}: the two "
                             "servers need two ports")
        for name in ("shutdown_timeout", "throughput_log_interval"):
            if getattr(self, name) < 0:
                raise ValueError(f"{flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.max_request_body_mb is not None and self.max_request_body_mb <= 0:
            raise ValueError(f"{flag('max_request_body_mb')} must be positive, got {self.max_request_body_mb}")
        if isinstance(self.speculative_config, dict):  # LLM(speculative_config={...})
            object.__setattr__(self, "speculative_config", json.dumps(self.speculative_config))
        self.speculative()  # a malformed one is refused here, before anything loads

    # ---- derived values ---------------------------------------------------------------------------------------
    def compute_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        import jax

        return "bfloat16" if jax.default_backend() == "gpu" else "float32"

    def apply_memory_fraction(self) -> None:
        """JAX reads its GPU memory fraction once, when its first backend starts: set it before that (a no-op
        once JAX is running, e.g. in a notebook that used it already)."""
        from jax._src import xla_bridge

        if not xla_bridge.backends_are_initialized():
            os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(self.gpu_memory_fraction)

    def kernel_choice(self) -> KernelChoice:
        """The static kernel choice of the forward, resolved for this backend and device count."""
        return KernelChoice(self.attention_kernels, self.moe_kernels, batch_invariant=self.batch_invariant,
                            sparse_prefill=self.sparse_prefill_kernel).resolve(self.tensor_parallel_size)

    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    def show_progress(self) -> bool:
        if self.progress is not None:
            return self.progress
        return os.environ.get("M3JAX_NO_PROGRESS") != "1" and sys.stderr.isatty()

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    # ---- building one ---------------------------------------------------------------------------------------------
    @classmethod
    def field_names(cls, groups: tuple[str, ...] | None = None) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if groups is None or f.metadata["group"] in groups]

    @classmethod
    def from_kwargs(cls, groups: tuple[str, ...] | None = None, **kwargs: Any) -> Settings:
        """Settings from keyword arguments (LLM's); an unknown name is a TypeError that suggests the nearest."""
        known = cls.field_names(groups)
        for name in kwargs:
            if name not in known:
                near = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise TypeError(f"unknown setting {name!r}{hint}; the settings are: {', '.join(known)}")
        return cls(**kwargs)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        """Settings from parsed flags (`add_arguments`); fields without a flag keep their defaults."""
        return cls(**{n: getattr(args, n) for n in cls.field_names() if hasattr(args, n)})


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config` parsed: the draft method, its directory and k, the draft tokens per step."""

    method: str
    model: str | None  # the draft's directory; None: the draft shipped for the embedded model
    num_speculative_tokens: int

    METHODS = ("eagle3",)

    @classmethod
    def parse(cls, raw: str | None) -> SpeculativeConfig | None:
        """From the JSON text of the flag; ValueError naming what is wrong."""
        if raw is None or raw == "":
            return None
        name = flag("speculative_config")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{name}: must be a JSON object")
        unknown = set(value) - {"method", "model", "num_speculative_tokens"}
        if unknown:
            raise ValueError(f"{name}: unknown keys {sorted(unknown)} (known: method, model, "
                             "num_speculative_tokens)")
        method = value.get("method")
        if method not in cls.METHODS:
            raise ValueError(f"{name}: method {method!r} is not supported (supported: {', '.join(cls.METHODS)})")
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 8:
            raise ValueError(f"{name}: num_speculative_tokens must be an integer in [1, 8], got {k!r}")
        model = value.get("model")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"{name}: model must be the draft checkpoint's directory")
        return cls(method, model, k)

    def draft_path(self, target: str | None) -> Path:
        """The draft's directory; the shipped draft only goes with the embedded model (`target` None)."""
        if self.model is not None:
            return Path(self.model)
        if target is not None:
            raise ValueError(f'{flag("speculative_config")}: give the draft\'s directory as "model" (the shipped '
                             "draft is for the embedded tiny model only)")
        import checkpoints

        return Path(checkpoints.__file__).parent / "tiny_eagle3"


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, groups: tuple[str, ...] = (MODEL, ENGINE, KERNELS, SERVER)
                  ) -> None:
    """One flag per Settings field of `groups`, with its help text and default shown."""
    defaults = Settings()
    for group in groups:
        g = parser.add_argument_group(GROUP_TITLES[group])
        for f in dataclasses.fields(Settings):
            if f.metadata["group"] != group:
                continue
            default = getattr(defaults, f.name)
            shown = f"{default}" if default is not None else "unset"
            env = f.metadata["env"]
            help_text = f"{f.metadata['help']} (default: {shown}{f'; env {env}' if env else ''})"
            if f.type in ("bool", bool):
                g.add_argument(flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                               help=help_text)
            elif f.type in ("bool | None",):
                g.add_argument(flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
            else:
                g.add_argument(flag(f.name), dest=f.name, type=_parser_type(f.type), default=default,
                               choices=f.metadata["choices"], metavar=f.metadata["metavar"], help=help_text)


def _parser_type(annotation: Any) -> Any:
    text = str(annotation)
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str
