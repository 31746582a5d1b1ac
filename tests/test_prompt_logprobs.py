"""Prompt logprobs (`SamplingParams.prompt_logprobs`, `--enable-prompt-logprobs`): each prompt token's
log-probability, rank and top tokens equal the full causal forward's log-softmax, whatever the batching, prefill
chunking and preemption; the extra executables are made at start-up and none after; refused without the flag
and with speculation."""

import numpy as np
import pytest

from m3jax.settings import Settings
from serving import LLM, SamplingParams
from serving.core import EngineCore
from tests.test_engine import SETTINGS, _prompts, _wait_idle, count_compiles


@pytest.fixture(scope="module")
def llm():
    with LLM(**SETTINGS, enable_prompt_logprobs=True) as llm:
        yield llm


def _reference(llm, prompt):
    """log_softmax of the full causal forward over the prompt: row p predicts token p + 1."""
    logits = llm.core.model.logits([prompt])[0].astype(np.float64)
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)


def _check(llm, prompt, entries, k):
    assert len(entries) == len(prompt) and entries[0] is None
    ref = _reference(llm, prompt)
    for p in range(1, len(prompt)):
        e, row = entries[p], ref[p - 1]
        assert e.token_id == prompt[p]
        np.testing.assert_allclose(e.logprob, row[prompt[p]], rtol=1e-4, atol=1e-4)
        assert e.rank == 1 + int(np.sum(row > row[prompt[p]] + 1e-5)) or e.rank == 1 + int(
            np.sum(row > row[prompt[p]] - 1e-5))  # ties within float noise either way
        top = sorted(e.top.items(), key=lambda kv: -kv[1])
        assert len(top) == k
        np.testing.assert_allclose([lp for _, lp in top], np.sort(row)[::-1][:k], rtol=1e-4, atol=1e-4)


def test_prompt_logprobs_equal_the_full_forward_under_batching_chunking_and_preemption(llm):
    core = llm.core
    assert ("forward_plp", 32) in core.runner.shapes()
    made = core.num_executables
    prompts = _prompts(16, seed=5)  # up to 70 tokens: chunked over 32-token steps; 16 requests force preemption
    ks = [0, 1, 3, 5] * 4
    params = [SamplingParams(temperature=0.0, max_tokens=20, prompt_logprobs=k) for k in ks]
    params[3] = SamplingParams(temperature=0.0, max_tokens=20)  # a neighbour that asks for none
    preempted = core.stats["preemptions"]
    with count_compiles() as compiles:
        outs = llm.generate(prompts, params, use_tqdm=False)
        _wait_idle(core)
    assert compiles == [] and core.num_executables == made
    assert core.stats["preemptions"] > preempted
    assert outs[3].prompt_logprobs is None
    for i, out in enumerate(outs):
        if i != 3:
            _check(llm, prompts[i], out.prompt_logprobs, ks[i])
    # The tokens generated are the ones a request without prompt logprobs gets.
    plain = llm.generate(prompts[:4], [SamplingParams(temperature=0.0, max_tokens=20)] * 4, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:4]] == [o.outputs[0].token_ids for o in plain]


def test_streamed_outputs_carry_them_from_the_first_token(llm):
    prompt = _prompts(1, seed=9)[0]
    outs = list(llm.stream(prompt, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2)))
    assert all(o.prompt_logprobs is not None for o in outs)
    _check(llm, prompt, outs[0].prompt_logprobs, 2)


def test_refused_without_the_flag_and_with_speculation():
    core = EngineCore(Settings(**SETTINGS, warmup=False))
    with pytest.raises(ValueError, match="prompt_logprobs.*--enable-prompt-logprobs"):
        core.prepare([1, 2, 3], SamplingParams(prompt_logprobs=1))
    assert ("forward_plp", 32) not in core.runner.shapes()
    spec = EngineCore(Settings(**{**SETTINGS, "model": None}, warmup=False, enable_prompt_logprobs=True,
                               speculative_config={"method": "eagle3", "num_speculative_tokens": 2}))
    with pytest.raises(ValueError, match="prompt_logprobs.*speculative"):
        spec.prepare([1, 2, 3], SamplingParams(prompt_logprobs=1))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1).validate()


def test_prompt_logprobs_under_tensor_parallelism(llm):
    """Under TP4 the lm_head is split over the vocabulary: the log-softmax and top-k over its shards give the
    values of one device."""
    import jax

    if len(jax.devices()) < 4:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=4")
    prompt = _prompts(1, seed=13)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=3)
    one = llm.generate([prompt], params, use_tqdm=False)[0]
    with LLM(**SETTINGS, enable_prompt_logprobs=True, tensor_parallel_size=4, warmup=False) as tp4:
        four = tp4.generate([prompt], params, use_tqdm=False)[0]
    assert four.outputs[0].token_ids == one.outputs[0].token_ids
    np.testing.assert_allclose([e.logprob for e in four.prompt_logprobs[1:]],
                               [e.logprob for e in one.prompt_logprobs[1:]], rtol=1e-5, atol=1e-5)
    assert [e.rank for e in four.prompt_logprobs[1:]] == [e.rank for e in one.prompt_logprobs[1:]]
    assert [list(e.top) for e in four.prompt_logprobs[1:]] == [list(e.top) for e in one.prompt_logprobs[1:]]
