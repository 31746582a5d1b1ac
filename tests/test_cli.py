"""`m3jax` command line: help shows every default, --version, flags checked (with one-line errors naming the
user's flag) before anything loads, and `generate` with sampling flags. In-process: `cli.main(argv)`."""

import argparse
import socket
import time

import pytest
from serving_helpers import ENGINE_ARGS

from m3jax import cli


def _subparsers(parser):
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_help_shows_every_default_and_the_presets(capsys):
    parser = cli.build_parser()
    for name in ("generate", "serve"):
        sub = _subparsers(parser)[name]
        for action in sub._actions:
            if action.dest in ("help",):
                continue
            assert action.help and "default" in action.help, (name, action.dest)
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    assert "m3-tiny" in capsys.readouterr().out


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("m3jax ")


def _error_line(capsys, argv, code=2):
    t0 = time.monotonic()
    assert cli.main(argv) == code
    assert time.monotonic() - t0 < 10, "flags are checked before anything heavy starts"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("argv, message", [
    (["--http-port", "99999"], "error: --http-port must be a port in 0..65535 (or -1 for none), got 99999"),
    (["--grpc-port", "-1", "--http-port", "-1"], "error: --grpc-port -1 and --http-port -1: at least one server "
     "must run"),
    (["--grpc-port", "8123", "--http-port", "8123"], "error: --grpc-port and --http-port are both 8123"),
    (["--max-model-len", "100000"], "error: --max-model-len 100000 is above this model's limit of"),
    (["--throughput-log-interval", "-1"], "error: --throughput-log-interval must be >= 0"),
    (["--model", "/no/such/dir"], "error: model '/no/such/dir' is neither a checkpoint directory nor a preset"),
])
def test_serve_refuses_bad_flags_before_loading(capsys, argv, message):
    assert _error_line(capsys, ["serve", *argv]).startswith(message)


def test_serve_refuses_a_port_in_use_before_loading(capsys):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        line = _error_line(capsys, ["serve", "--grpc-port", str(port), "--http-port", "0"], code=1)
    assert line == f"error: cannot use 127.0.0.1:{port} for the gRPC server (--grpc-port): Address already in use"
    # 192.0.2.1 (TEST-NET-1) is nobody's address.
    line = _error_line(capsys, ["serve", "--host", "192.0.2.1", "--grpc-port", "0", "--http-port", "0"], code=1)
    assert line.startswith("error: --host '192.0.2.1': not an address of this machine")


def test_generate_flag_errors_name_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--prompt-ids", "1,x"])
    assert e.value.code == 2
    assert "argument --prompt-ids: 'x' is not a token id (comma-separated integers" in capsys.readouterr().err
    assert _error_line(capsys, ["generate", "--max-tokens", "0"]) == \
        "error: --max-tokens: must be a positive integer, got 0"
    assert _error_line(capsys, ["generate", "--temperature", "-1"]).startswith("error: --temperature must be")


def test_generate_samples_and_refuses_what_does_not_fit(capsys, tmp_path):
    engine = [*ENGINE_ARGS, "--seed", "7"]
    # Over the model length once tokenised: a line of its own, naming --max-tokens, and no prompt echoed.
    assert cli.main(["generate", "--prompt-ids", "1,2,3", "--max-tokens", "300", *engine]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.strip().splitlines()[-1] == (
        "error: --max-tokens 300 is too large: the prompt has 3 tokens and the model length is 256 "
        "(300 > 256 - 3) (see --max-model-len)")
    # Sampling flags reach the engine: seeded sampling is reproducible, a stop string ends the output before it.
    argv = ["generate", "--prompt-ids", "5,6,7", "--max-tokens", "8", "--temperature", "0.9", "--top-k", "20",
            "--top-p", "0.9", "--ignore-eos", *engine]
    runs = []
    for _ in range(2):
        assert cli.main(argv) == 0
        runs.append(capsys.readouterr())
    text = runs[0].out.removesuffix("\n")
    assert runs[1].out == runs[0].out and "8 tokens" in runs[0].err and "finish reason: length" in runs[0].err
    stop = text.strip()[1:3]
    assert len(stop) == 2, text
    assert cli.main([*argv, "--stop", stop]) == 0
    stopped = capsys.readouterr()
    assert stopped.out == text[:text.index(stop)] + "\n" and "finish reason: stop" in stopped.err
