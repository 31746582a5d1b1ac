"""What a chat reply goes through on its way to a client (serving/server.py `OutputPlan`, `MessageParser`), without
a server: the plan a request's fields make (and the server settings that turn the parsers off), how the rendered
prompt completes it (reasoning phase, gate, tool-call grammar, special tokens kept for the parsers), and the
parser that splits each choice's text, streamed or whole."""

import types

import pytest

from m3jax.api import embedded_model_path
from m3jax.settings import Settings
from serving.outputs import SamplingParams
from serving.reasoning import ReasoningPhase
from serving.server import MessageParser, OutputPlan, RequestError, ServingCore, _Stripper
from serving.structured import Grammars, StructuredOutputsParams
from serving.tokenizer import M3Tokenizer
from serving.tool_calls import INVOKE_END, NS, render_tool_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def tok():
    return M3Tokenizer.from_dir(embedded_model_path())


def _core(tok, **settings) -> ServingCore:
    grammars = Grammars(tok.backend.to_str(), 2048, [2039])
    engine = types.SimpleNamespace(tokenizer=tok, stats={}, max_model_len=256,
                                   num_speculative_tokens=0,
                                   compile_grammar=lambda p: grammars.compile(p.structured_outputs))
    core = ServingCore(engine, None, "m", "p", **settings)
    core.executor.shutdown()
    return core


def _prompt(tok, tail: str) -> list[int]:
    return tok.encode("]~!b[]~b]system\nThink in <mm:think> blocks.[e~[\n]~b]user\nhi[e~[\n]~b]ai\n" + tail)


def test_the_plan_of_a_chat_request(tok):
    core = _core(tok)
    assert core.reasoning_parser and core.tool_call_parser
    plan = core.chat_plan(TOOLS, None)
    assert plan.reasoning and plan.tools is not None and plan.tool_choice == "auto" and not plan.forced
    assert core.chat_plan(TOOLS, "none").tools is None
    named = core.chat_plan(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, False)
    assert named.forced and named.function == "get_weather" and not named.parallel_tool_calls
    for args, param in (((TOOLS, "sometimes"), "tool_choice"), ((None, "auto"), "tool_choice"),
                        (([{"type": "function", "function": {"name": 'a"b'}}], None), "tools"),
                        ((TOOLS * 2, None), "tools"),
                        (([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None),
                         "tools")):
        with pytest.raises(RequestError) as e:
            core.chat_plan(*args)
        assert e.value.param == param, args
    with pytest.raises(RequestError, match="both constrain") as e:
        core.chat_plan(TOOLS, "required", structured_param="guided_json")
    assert e.value.param == "guided_json"


def test_server_settings_turn_the_parsers_off(tok):
    assert Settings().reasoning_parser == Settings().tool_call_parser == "minimax_m3"
    core = _core(tok, reasoning_parser="none", tool_call_parser="none")
    plan = core.chat_plan(None, None)
    assert not plan.reasoning and not plan.parses
    assert core.chat_plan(TOOLS, "none").tools is None  # tools still go to the template
    with pytest.raises(RequestError, match="--tool-call-parser none") as e:
        core.chat_plan(TOOLS, None)
    assert e.value.param == "tool_choice"
    ids, params = core.fit(_prompt(tok, "<mm:think>"), SamplingParams(max_tokens=5), None, plan)
    assert params.skip_special_tokens and plan.phase is None and plan.strip == ()


def test_the_rendered_prompt_completes_the_plan(tok):
    core = _core(tok)
    think_end = tok.token_to_id("</mm:think>")
    schema = StructuredOutputsParams(json={"type": "object"})
    # thinking_mode enabled: the prompt opened the block, so any grammar starts after `</mm:think>`.
    plan = core.chat_plan(None, None, structured_param="response_format")
    _, params = core.fit(_prompt(tok, "<mm:think>"), SamplingParams(structured_outputs=schema), None, plan)
    assert plan.phase is ReasoningPhase.REASONING and params.structured_outputs.start_after_token == think_end
    assert not params.skip_special_tokens and "<mm:think>" in plan.strip
    # disabled: no gate; adaptive: a forced call may start with a thinking block.
    plan = core.chat_plan(TOOLS, "required")
    _, params = core.fit(_prompt(tok, "</mm:think>"), SamplingParams(), None, plan)
    assert plan.phase is ReasoningPhase.CONTENT and params.structured_outputs.start_after_token is None
    assert "THINKING" not in params.structured_outputs.grammar
    # (The system prompt's `<mm:think>`, a special token here, is not where the reply starts: only the tail is.)
    plan = core.chat_plan(TOOLS, "required")
    _, params = core.fit(_prompt(tok, ""), SamplingParams(), None, plan)
    assert plan.phase is ReasoningPhase.UNDECIDED and "THINKING" in params.structured_outputs.grammar
    # The client's skip_special_tokens=false: special tokens stay in its text.
    plan = core.chat_plan(None, None, keep_special=True)
    _, params = core.fit(_prompt(tok, ""), SamplingParams(skip_special_tokens=False), None, plan)
    assert plan.strip == () and not params.skip_special_tokens
    # parallel_tool_calls false in auto mode: generation stops where the first invoke closes.
    plan = core.chat_plan(TOOLS, "auto", parallel_tool_calls=False)
    _, params = core.fit(_prompt(tok, ""), SamplingParams(stop=["x"]), None, plan)
    assert params.stops == ["x", INVOKE_END] and plan.internal_stop == INVOKE_END
    # An invalid grammar is refused naming the field that asked for it.
    with pytest.raises(RequestError) as e:
        core.fit(_prompt(tok, ""), SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")), None,
                 core.chat_plan(None, None, structured_param="guided_regex"))
    assert e.value.param == "guided_regex"


def _feed(plan: OutputPlan, text: str, cuts: list[int]) -> tuple[MessageParser, str, str, list[dict]]:
    parser = MessageParser(plan)
    reasoning, content, calls = [], [], []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        d = parser.push(text[a:b])
        reasoning.append(d.reasoning)
        content.append(d.content)
        calls += d.tool_calls
    d = parser.finish()
    return parser, "".join(reasoning) + d.reasoning, "".join(content) + d.content, calls + d.tool_calls


def test_message_parser_streams_as_it_parses_whole(tok):
    core = _core(tok)
    plan = core.chat_plan(TOOLS, None)
    core.fit(_prompt(tok, ""), SamplingParams(), None, plan)
    call = render_tool_calls([{"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}])
    text = "<mm:think>Weather ]~b]first.</mm:think>Checking]!p~[." + call
    whole, reasoning, content, _ = _feed(plan, text, [])
    assert (whole.reasoning, whole.content) == ("Weather first.", "Checking.")  # specials left over are removed
    assert [c["function"]["arguments"] for c in whole.tool_calls] == ['{"city": "Paris", "days": 2}']
    assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == "length"
    for cut in range(1, len(text)):
        for cuts in ([cut], list(range(cut, len(text), 7))):
            parser, r, c, deltas = _feed(plan, text, cuts)
            assert (r, c) == ("Weather first.", "Checking."), cuts
            assert parser.tool_calls[0]["function"] == whole.tool_calls[0]["function"]
            assert "".join(d["function"].get("arguments", "") for d in deltas) == '{"city": "Paris", "days": 2}'
    plan.internal_stop = INVOKE_END
    assert whole.stop_reason(INVOKE_END) is None and whole.stop_reason("x") == "x"


def test_stripper_holds_back_what_may_become_a_special_token():
    s = _Stripper(("]~b]", "]<]minimax[>["))
    out = [s.push(t, False) for t in ("a]", "~b]b ]<]mini", "max[>[c", "]")]
    assert "".join(out) + s.push("", True) == "ab c]"
    assert NS not in "".join(out)


def test_token_id_prompts_with_no_grammar_are_fitted_on_the_event_loop(tok):
    """A worker thread is two hand-overs on the way to the first token: a token-id prompt with a bare or parsing
    plan never takes one (this core's executor is shut, so one would raise); a grammar to compile still does."""
    import asyncio

    core = _core(tok)
    ids = _prompt(tok, "")
    for plan in (OutputPlan(), core.chat_plan(TOOLS, None)):
        got, params = asyncio.run(core.prepare(ids, SamplingParams(max_tokens=8), "max_tokens", plan))
        assert got == ids and params.max_tokens == 8
    forced = core.chat_plan(TOOLS, "required")
    with pytest.raises(RuntimeError, match="shutdown"):
        asyncio.run(core.prepare(ids, SamplingParams(max_tokens=8), "max_tokens", forced))
