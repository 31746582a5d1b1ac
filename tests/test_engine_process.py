"""The engine core in a process of its own (`serving.engine_process`): a request gives the same outputs, every
field of every streamed update, as through the core in this process; bad requests are refused here; aborts
free the request; a start-up error crosses with its type and message; an engine process that dies fails what
is in flight and says so."""

import asyncio
import dataclasses
import os
import signal
import threading
import time

import pytest

from m3jax.settings import Settings
from serving import RequestOutputKind, SamplingParams
from serving.core import EngineCore
from serving.engine import AsyncEngine
from serving.engine_process import EngineProcessExited, RemoteCore
from serving.structured import StructuredOutputsParams

# The embedded model (it has a tokenizer: text prompts, stop strings, grammars).
SETTINGS = dict(dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, progress=False,
                enable_prompt_logprobs=True)

CASES = [
    ("Hello there", SamplingParams(temperature=0.0, max_tokens=9, logprobs=2)),
    ("The capital of", SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=7, n=2)),
    ([5, 17, 99, 3], SamplingParams(temperature=0.0, max_tokens=12, stop=[" the"], prompt_logprobs=1)),
    ("Once upon", SamplingParams(temperature=0.0, max_tokens=8,
                                 structured_outputs=StructuredOutputsParams(regex="[a-z ]{3,12}"))),
]


def _view(out):
    """Every field a client sees of one update (timestamps differ between runs; which ones it carries does not)."""
    return dataclasses.asdict(out) | {"metrics": sorted(out.metrics)}


def _collect(core, cases):
    async def one(engine, prompt, params, rid):
        return [_view(o) async for o in engine.generate(prompt, params, rid)]

    async def main():
        engine = AsyncEngine(core)
        return [await one(engine, p, q, f"r{i}") for i, (p, q) in enumerate(cases)]

    return asyncio.run(main())


def _summary(updates):
    """Per choice: its last update whole, and its deltas joined (how updates were merged on the way is timing);
    every update's cumulative text and ids are the deltas so far."""
    by_choice = {}
    for u in updates:
        c = u["outputs"][0]
        text, ids, _ = by_choice.get(c["index"], ("", [], None))
        text, ids = text + u["delta_text"], ids + u["delta_token_ids"]
        assert (c["text"], c["token_ids"]) == (text, ids)
        # The last update's own delta is left out: how many outputs a merge joined into it is timing.
        by_choice[c["index"]] = (text, ids, {k: v for k, v in u.items() if not k.startswith("delta_")})
    return by_choice


@pytest.fixture(scope="module")
def remote():
    core = RemoteCore(Settings(**SETTINGS))
    yield core
    core.shutdown(5.0)  # also after the last test killed it


def test_outputs_equal_the_in_process_core(remote):
    local = EngineCore(Settings(**SETTINGS))
    try:
        want = _collect(local, CASES)
    finally:
        local.shutdown(5.0)
    got = _collect(remote, CASES)
    for w, g in zip(want, got, strict=True):
        assert _summary(g) == _summary(w)
    assert got[0][-1]["outputs"][0]["logprobs"] and got[2][-1]["prompt_logprobs"]
    assert got[2][-1]["outputs"][0]["finish_reason"] == "stop" or len(got[2][-1]["outputs"][0]["token_ids"]) == 12
    assert remote.facts.vocab_size == local.facts.vocab_size and remote.max_model_len == 256


def _joined(updates):
    """Per choice, a DELTA request's updates joined: text, ids, logprobs, and the prompt_logprobs each carried."""
    by_choice = {}
    for u in updates:
        c = u["outputs"][0]
        j = by_choice.setdefault(c["index"], {"text": "", "ids": [], "logprobs": None, "prompt_logprobs": []})
        assert (c["text"], c["token_ids"]) == (u["delta_text"], u["delta_token_ids"])
        j["text"] += c["text"]
        j["ids"] += c["token_ids"]
        if c["logprobs"] is not None:
            j["logprobs"] = (j["logprobs"] or []) + c["logprobs"]
        if u["prompt_logprobs"] is not None:
            j["prompt_logprobs"].append(u["prompt_logprobs"])
        j["finish_reason"] = c["finish_reason"]
    return by_choice


def test_delta_outputs_join_to_the_cumulative_ones(remote):
    """RequestOutputKind.DELTA (what the servers ask for): each update holds only what it added, prompt_logprobs
    come once per choice, and joined they are the cumulative outputs' last state, in this process's core and
    through the engine process."""
    delta_cases = [(p, dataclasses.replace(q, output_kind=RequestOutputKind.DELTA)) for p, q in CASES]
    local = EngineCore(Settings(**SETTINGS))
    try:
        local_deltas = _collect(local, delta_cases)
    finally:
        local.shutdown(5.0)
    cumulative, deltas = _collect(remote, CASES), _collect(remote, delta_cases)
    for c, d, ld in zip(cumulative, deltas, local_deltas, strict=True):
        joined = _joined(d)
        assert joined == _joined(ld)
        for index, (text, ids, last) in _summary(c).items():
            j = joined[index]
            out = last["outputs"][0]
            assert (j["text"], j["ids"], j["logprobs"], j["finish_reason"]) == (
                text, ids, out["logprobs"], out["finish_reason"])
            assert j["prompt_logprobs"] == ([last["prompt_logprobs"]] if last["prompt_logprobs"] else [])
    assert _joined(deltas[0])[0]["logprobs"] and _joined(deltas[2])[0]["prompt_logprobs"]
    finals = _collect(remote, [(p, dataclasses.replace(q, output_kind=RequestOutputKind.FINAL_ONLY))
                               for p, q in CASES])
    for c, f in zip(cumulative, finals, strict=True):  # FINAL_ONLY: each choice's last cumulative output alone
        assert sorted(u["outputs"][0]["index"] for u in f) == sorted(_summary(c))
        for u in f:
            last = _summary(c)[u["outputs"][0]["index"]][2]
            assert u["finished"] and u["outputs"][0] == last["outputs"][0]
            assert u["prompt_logprobs"] == last["prompt_logprobs"]


def test_bad_requests_are_refused_before_they_are_sent(remote):
    for prompt, params, match in (
            ([1] * 300, SamplingParams(max_tokens=1), "model length is 256"),
            ([10**6], SamplingParams(max_tokens=1), "outside the vocabulary"),
            ([1, True], SamplingParams(max_tokens=1), "list of integers"),
            ([1, 2.0], SamplingParams(max_tokens=1), "list of integers"),
            ("x", SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="(ab")),
             "regex")):
        with pytest.raises(ValueError, match=match):
            remote.prepare_group(prompt, params)


def test_abort_frees_the_request_and_the_load_figures_follow(remote):
    async def main():
        engine = AsyncEngine(remote)
        stream = engine.generate([4, 5, 6], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True), "ab")
        first = await stream.__anext__()
        assert not first.finished
        await stream.aclose()  # the client went away: the request is aborted

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while (remote.num_running or remote.pages_in_use) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (remote.num_running, remote.pages_in_use) == (0, 0)
    assert remote.stats["finished_abort"] >= 1 and remote.stats["steps"] > 0


def test_a_start_up_error_keeps_its_type_and_message(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a checkpoint directory nor a preset"):
        RemoteCore(Settings(**{**SETTINGS, "model": str(tmp_path / "nowhere")}))


def test_a_dead_engine_process_fails_what_is_in_flight(remote):
    """(Last in this module: it kills the module's engine process.)"""
    exited = threading.Event()
    remote.on_exit = exited.set

    async def main():
        engine = AsyncEngine(remote)
        stream = engine.generate([4, 5, 6], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        await stream.__anext__()
        os.kill(remote._proc.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="engine process exited"):
            async for _ in stream:
                pass

    asyncio.run(main())
    assert exited.wait(10) and not remote.alive
    with pytest.raises(EngineProcessExited):
        remote.submit(*remote.prepare_group([1, 2])[0])
