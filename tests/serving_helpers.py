"""`m3jax serve` as a real subprocess on loopback, for the server tests.

Every server test module starts one server (module-scoped fixture) with the same small engine settings, so that
the shapes compiled by the first start are reused by the next ones from the persistent compilation cache
(M3JAX_COMPILATION_CACHE, a shared temp directory unless already set).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Small enough to compile quickly on 2 CPU cores; the same in every module so the compiled shapes are shared.
ENGINE_ARGS = ["--dtype", "float32", "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "256"]
START_TIMEOUT = float(os.environ.get("M3JAX_TEST_SERVER_START_TIMEOUT", "900"))  # a cold compile on a slow CI box


def model_args(base_temp: Path) -> list[str]:
    """No --model (the embedded checkpoint) when it is there; else a synthetic tiny checkpoint, made once."""
    from m3jax.api import embedded_model_path

    if (embedded_model_path() / "config.json").is_file():
        return []
    path = base_temp / "tiny-checkpoint"
    if not (path / "config.json").is_file():
        from checkpoints import make_tiny_checkpoint

        make_tiny_checkpoint(path)
    return ["--model", str(path)]


def checkpoint_copy(base_temp: Path, name: str, chat_template: str | None = None,
                    special_tokens: dict[int, str] | None = None) -> Path:
    """A copy of the test checkpoint (the embedded one, else the synthetic one of `model_args`) with its own
    chat template and, optionally, some of its special tokens renamed (id -> new text), made once per session."""
    import json
    import shutil

    from m3jax.api import embedded_model_path

    source = embedded_model_path()
    if not (source / "config.json").is_file():
        model_args(base_temp)
        source = base_temp / "tiny-checkpoint"
    path = base_temp / name
    if (path / "config.json").is_file():
        return path
    tmp = base_temp / (name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    if chat_template is not None:
        (tmp / "chat_template.jinja").write_text(chat_template)
    if special_tokens:
        tokenizer = json.loads((tmp / "tokenizer.json").read_text())
        for entry in tokenizer["added_tokens"]:
            if entry["id"] in special_tokens:
                assert entry["special"], entry
                entry["content"] = special_tokens[entry["id"]]
        (tmp / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
        config_path = tmp / "tokenizer_config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text())
            for key, entry in config.get("added_tokens_decoder", {}).items():
                if int(key) in special_tokens:
                    entry["content"] = special_tokens[int(key)]
            config_path.write_text(json.dumps(config, ensure_ascii=False, indent=2))
    tmp.rename(path)
    return path


def serve_command(extra_args: list[str], ports: tuple[str, str] = ("0", "0")) -> list[str]:
    return [sys.executable, "-m", "m3jax", "serve", "--grpc-port", ports[0], "--http-port", ports[1], *ENGINE_ARGS,
            *extra_args]


def serve_env(env: dict[str, str] | None = None) -> dict[str, str]:
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    full_env.setdefault("JAX_PLATFORMS", "cpu")
    full_env.setdefault("M3JAX_NO_PROGRESS", "1")
    full_env.setdefault("M3JAX_COMPILATION_CACHE", str(Path(tempfile.gettempdir()) / "m3jax-test-xla-cache"))
    return full_env


def wait_for_log(proc: subprocess.Popen, log_path: Path, pattern: str, timeout: float = START_TIMEOUT) -> str:
    """Poll the log file until a line matches `pattern` (a regex); returns that line. RuntimeError if the process
    ends or the time runs out first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            if re.search(pattern, line):
                return line
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before {pattern!r}:\n{log_path.read_text()}")
        time.sleep(0.005)
    raise RuntimeError(f"no {pattern!r} in the server log within {timeout}s:\n{log_path.read_text()[-4000:]}")


class ServerProcess:
    def __init__(self, extra_args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.log_path = log_path
        # stdout is a pipe and stderr a file: neither is a terminal, as under systemd or docker.
        self._log = open(log_path, "w")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(serve_command(extra_args), cwd=REPO, env=serve_env(env), stdout=subprocess.PIPE,
                                     stderr=self._log, text=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        self.grpc_port, self.http_port, self.model = self._wait_ready()
        self.grpc_target = f"127.0.0.1:{self.grpc_port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}"

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _wait_ready(self) -> tuple[int, int, str]:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                break
            m = re.search(r"ready: grpc=\S+:(\d+) http=http://\S+:(\d+) model=(\S+)", line)
            if m:
                return int(m.group(1)), int(m.group(2)), m.group(3)
        self.kill()
        raise RuntimeError(f"the server did not start; its log ends:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()[-n:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def scrape(http_url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """/metrics as {name{labels}: value}."""
    req = urllib.request.Request(http_url + "/metrics", headers=headers or {})
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def wait_idle(http_url: str, timeout: float = 60.0) -> dict[str, float]:
    """Poll /metrics until nothing is queued, running, admitted or holding pages; returns the last scrape."""
    keys = ("m3jax_requests_in_flight", "m3jax_num_requests_running", "m3jax_num_requests_waiting",
            "m3jax_kv_pages_in_use")
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(http_url)
        if all(m[k] == 0 for k in keys) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


# M3's chat format as its checkpoint's chat_template.jinja renders it, for tests whose checkpoint must speak it
# (the embedded tiny template renders neither tool calls nor thinking): the XML of tool-call arguments, the
# messages, and a header and generation prompt of the test's own (Jinja text, `ns` = M3's tool namespace).
_M3_LIKE_HEAD = r"""
{%- macro to_xml(val, ns) -%}
{%- if val is mapping -%}
{%- for k, v in val.items() if v is not none -%}{{ ns }}<{{ k }}>{{ to_xml(v, ns) }}{{ ns }}</{{ k }}>{%- endfor -%}
{%- elif val is iterable and val is not string -%}
{%- for item in val -%}{{ ns }}<item>{{ to_xml(item, ns) }}{{ ns }}</item>{%- endfor -%}
{%- elif val is none -%}
{%- elif val is boolean -%}{{ val | tojson }}
{%- else -%}{{ val }}
{%- endif -%}
{%- endmacro -%}
{%- set ns = ']<]minimax[>[' -%}
"""
_M3_LIKE_MESSAGES = r"""{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
{{- ']~b]ai\n' -}}
{%- if message.reasoning_content -%}{{- '<mm:think>' ~ message.reasoning_content ~ '</mm:think>' -}}
{%- else -%}{{- '</mm:think>' -}}{%- endif -%}
{{- message.content or '' -}}
{%- if message.tool_calls -%}
{{- ns ~ '<tool_call>\n' -}}
{%- for call in message.tool_calls -%}
{{- ns ~ '<invoke name="' ~ call.function.name ~ '">' -}}
{%- for k, v in call.function.arguments.items() if v is not none -%}
{{- ns ~ '<' ~ k ~ '>' ~ to_xml(v, ns) ~ ns ~ '</' ~ k ~ '>' -}}
{%- endfor -%}
{{- ns ~ '</invoke>\n' -}}
{%- endfor -%}
{{- ns ~ '</tool_call>' -}}
{%- endif -%}
{{- '[e~[\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- ']~b]tool' -}}{%- endif -%}
{{- '\n<response>' ~ message.content ~ '</response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '[e~[\n' -}}{%- endif -%}
{%- else -%}
{{- ']~b]' ~ message.role ~ '\n' ~ message.content ~ '[e~[\n' -}}
{%- endif -%}
{%- endfor -%}
"""


def m3_like_template(header: str, generation_prompt: str) -> str:
    return _M3_LIKE_HEAD + header + _M3_LIKE_MESSAGES + generation_prompt
