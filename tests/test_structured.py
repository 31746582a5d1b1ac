"""Structured output, logit_bias and n > 1 through the engine on the embedded model (it has a tokenizer): the
output follows the grammar, batched equals alone, and a bad grammar is refused before anything runs."""

import json
import re

import pytest

from serving import LLM, SamplingParams
from serving.structured import StructuredOutputsParams as S

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n", "tags"],
          "properties": {"name": {"type": "string", "enum": ["alpha", "beta"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 9},
                         "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "enum": ["x", "y"]}}}}


@pytest.fixture(scope="module")
def llm():
    with LLM(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, progress=False) as llm:
        yield llm


def _text(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**{"max_tokens": 80, **kw}), use_tqdm=False)[0].outputs[0]


def test_outputs_follow_their_grammar(llm):
    for temperature in (0.0, 1.0):
        out = _text(llm, "def main():", temperature=temperature, seed=3, structured_outputs=S(json=SCHEMA))
        obj = json.loads(out.text)
        assert out.finish_reason == "stop" and set(obj) == {"name", "n", "tags"}
        assert obj["name"] in ("alpha", "beta") and 0 <= obj["n"] <= 9 and set(obj["tags"]) <= {"x", "y"}
        assert _text(llm, "x = ", temperature=temperature, seed=4,
                     structured_outputs=S(choice=["yes", "no", "maybe"])).text in ("yes", "no", "maybe")
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", _text(llm, "import os", temperature=temperature, seed=5,
                                                        structured_outputs=S(regex=r"[0-9]{3}-[a-z]{2}")).text)
        assert isinstance(json.loads(_text(llm, "{", temperature=temperature, seed=6,
                                           structured_outputs=S(json_object=True)).text), dict)


def test_constrained_requests_are_batch_invariant(llm):
    prompts = ["def main():", "class A:", "import sys\n", "# note"]
    kinds = [S(json=SCHEMA), S(choice=["left", "right"]), None, S(regex=r"[a-c]{4}")]
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=k) for k in kinds]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], q, use_tqdm=False)[0].outputs[0].token_ids
             for p, q in zip(prompts, params, strict=True)]
    assert batched == alone
    assert llm.core.stats["grammar_mask_us"] > 0


def test_bad_grammar_and_bad_bias_are_refused(llm):
    with pytest.raises(ValueError, match="structured outputs"):
        llm.generate(["x"], SamplingParams(structured_outputs=S(regex="(unclosed")), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs=S(regex="a", choice=["b"]))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: 1000.0})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(["x"], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    assert llm.core.pages_in_use == 0


def test_logit_bias_and_n(llm):
    tok = llm.tokenizer.encode(" fish")[0]
    out = llm.generate(["def main():"], SamplingParams(temperature=0.0, max_tokens=4, logit_bias={tok: 100.0}),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [tok] * 4
    banned = _text(llm, "def main():", temperature=0.0, max_tokens=8).token_ids[0]
    assert _text(llm, "def main():", temperature=0.0, max_tokens=8, logit_bias={banned: -100.0}).token_ids[0] != banned
    many = llm.generate(["def f(x):"], SamplingParams(temperature=1.0, n=4, seed=11, max_tokens=10), use_tqdm=False)[0]
    assert [c.index for c in many.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in many.outputs}) > 1  # independent draws
    again = llm.generate(["def f(x):"], SamplingParams(temperature=1.0, n=4, seed=11, max_tokens=10),
                         use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in many.outputs]
    streamed = {}
    for update in llm.stream("def f(x):", SamplingParams(temperature=1.0, n=4, seed=11, max_tokens=10)):
        streamed.setdefault(update.outputs[0].index, []).extend(update.delta_token_ids)
    assert [streamed[i] for i in range(4)] == [c.token_ids for c in many.outputs]
    assert llm.core.pages_in_use == 0
