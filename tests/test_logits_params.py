"""Penalties, logit bias and structured output in the engine, against a reference that applies the same rule
to the logits of Hugging Face's own forward pass, one token at a time: for a mixed batch (the base model and
adapters; constrained, penalized and plain requests side by side) every request gets exactly the greedy
tokens the reference gives it alone."""

import copy
import json
import re

import pytest
import torch

from helpers import LOGITS_SCHEMA as SCHEMA, logits_reference as reference, logits_world
from lorakit.engine import LLM, SamplingParams
from lorakit.engine.structured import StructuredOutput


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(base model, tokenizer, adapter "a"): helpers.logits_world, a context of 256."""
    return logits_world(tmp_path_factory.mktemp("logits"))


CASES = {  # name: (adapter, params)
    "plain": (False, dict()),
    "presence": (True, dict(presence_penalty=1.5)),
    "frequency": (False, dict(frequency_penalty=0.7)),
    "repetition": (True, dict(repetition_penalty=1.8)),
    "all-penalties": (False, dict(repetition_penalty=0.7, presence_penalty=-0.5, frequency_penalty=0.3)),
    "bias": (True, dict(logit_bias={5: 3.0, 17: -100.0, 40: 2.5})),
    "json": (True, dict(structured_output=StructuredOutput.json_schema(SCHEMA))),
    "json-object": (False, dict(structured_output=StructuredOutput.json_schema(True), max_tokens=30)),
    "regex": (False, dict(structured_output=StructuredOutput(regex=r"[a-z]{2,5} [0-9]{1,3}\."))),
    "choice": (True, dict(structured_output=StructuredOutput(choice=("yes", "no", "maybe")))),
    "penalized-json": (False, dict(structured_output=StructuredOutput.json_schema(SCHEMA), presence_penalty=2.0)),
}


def test_mixed_batch_equals_reference_alone(world):
    base, tokenizer, saved = world
    llm = LLM(copy.deepcopy(base), tokenizer, max_loras=1, adapters={"a": saved.path}, max_num_seqs=16, block_size=4)
    prompt = tokenizer.encode("What is the capital of France?")
    params = {name: SamplingParams(**{"max_tokens": 40, "temperature": 0.0, **kw}) for name, (_, kw) in CASES.items()}
    names = list(CASES)
    outs = llm.generate([prompt] * len(names), [params[n] for n in names],
                        adapters=["a" if CASES[n][0] else None for n in names])
    for name, out in zip(names, outs):
        assert out.token_ids == reference(world, prompt, CASES[name][0], params[name]), name
    text = {name: out.text for name, out in zip(names, outs)}
    assert text["plain"] != text["repetition"] and text["plain"] != text["frequency"]
    value = json.loads(text["json"])
    assert set(value) == {"name", "ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 99
    if outs[names.index("json-object")].finish_reason == "stop":  # a random model may write one long string
        assert isinstance(json.loads(text["json-object"]), dict)
    assert text["json-object"].startswith("{")
    assert re.fullmatch(r"[a-z]{2,5} [0-9]{1,3}\.", text["regex"]), (text["regex"], outs[names.index("regex")])
    assert text["choice"] in ("yes", "no", "maybe")
    assert {o.finish_reason for n, o in zip(names, outs) if n in ("json", "regex", "choice")} == {"stop"}


def test_logit_bias_forces_a_token_also_when_sampling(world):
    base, tokenizer, _ = world
    llm = LLM(copy.deepcopy(base), tokenizer, max_loras=1, block_size=4)
    forced = SamplingParams(max_tokens=8, temperature=1.0, seed=3, logit_bias={7: 100.0}, ignore_eos=True)
    assert llm.generate([[1, 2, 3]], forced)[0].token_ids == [7] * 8


def test_bad_values_are_refused_by_name(world):
    base, tokenizer, _ = world
    for kw, what in ((dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")),
                     "frequency_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
                     (dict(logit_bias={3: 101}), "logit_bias"), (dict(logit_bias={-1: 1}), "logit_bias")):
        with pytest.raises(ValueError, match=what):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(structured_output=StructuredOutput(regex="a+"), ignore_eos=True)
    for kw in (dict(choice=()), dict(regex="a", lark="x"), dict(regex=5)):  # the shape: checked when made
        with pytest.raises(ValueError):
            StructuredOutput(**kw)
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutput.json_schema("{bad")
    llm = LLM(copy.deepcopy(base), tokenizer, max_loras=1, block_size=4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.engine.add_request([1, 2], SamplingParams(logit_bias={len(tokenizer) + 5: 1.0}))
    for kw, what in ((dict(regex="(a"), "unclosed group"), (dict(json='{"type": "nonsense"}'), "nonsense")):
        with pytest.raises(ValueError, match=what):  # the grammar: checked when compiled, before it is queued
            llm.engine.add_request([1, 2], SamplingParams(structured_output=StructuredOutput(**kw)))
    assert not llm.engine.has_unfinished()


@pytest.mark.gpu
def test_processing_and_masks_on_cuda_equal_the_cpu(world):
    """The same batch (grammar masks, biases, penalties, random logits) sampled on CUDA and on the CPU."""
    from lorakit.engine.sampling import SamplingBatch, process_logits, sample
    from lorakit.engine.structured import Grammars

    _, tokenizer, _ = world
    gen = torch.Generator().manual_seed(0)
    vocab = len(tokenizer) + 7  # an adapter's added ids past the tokenizer: never allowed on constrained rows
    params = [SamplingParams(**{"temperature": t, **kw}) for t, (_, kw) in zip([0.0, 0.7] * 8, CASES.values())]
    histories = [(torch.randint(0, vocab, (9,), generator=gen).tolist(),
                  torch.randint(0, vocab, (i,), generator=gen).tolist()) for i in range(len(params))]
    grammars = Grammars(tokenizer.eos_token_id)
    constraints = [grammars.constraint(p.structured_output, tokenizer, len(tokenizer)) if p.structured_output
                   else None for p in params]
    logits = torch.randn(len(params), vocab, generator=gen) * 4
    got = {}
    for device in ("cpu", "cuda"):
        mask = grammars.masks(constraints, vocab, pin=device == "cuda")
        batch = SamplingBatch.build(params, list(range(len(params))), [3] * len(params), device,
                                    histories=histories, vocab_size=vocab, token_mask=mask)
        got[device] = (process_logits(logits.to(device), batch).cpu(), sample(logits.to(device), batch).token_ids.cpu())
    assert torch.equal(got["cpu"][0].isinf(), got["cuda"][0].isinf())
    finite = got["cpu"][0].isfinite()
    torch.testing.assert_close(got["cuda"][0][finite], got["cpu"][0][finite], rtol=1e-6, atol=1e-6)
    assert torch.equal(got["cpu"][1], got["cuda"][1])
    assert got["cpu"][0][:, len(tokenizer):][[c is not None for c in constraints]].isinf().all()


def test_a_failing_grammar_ends_its_request_alone(world):
    base, tokenizer, _ = world
    llm = LLM(copy.deepcopy(base), tokenizer, max_loras=1, block_size=4)
    engine = llm.engine
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    other = engine.add_request([1, 2, 3], plain)
    broken = engine.add_request([1, 2, 3], SamplingParams(max_tokens=6, temperature=0.0,
                                                          structured_output=StructuredOutput(regex="[a-z]+")))

    class Failing:  # a matcher that gives up after its first token, as llguidance does past its parser limits
        def __init__(self, real):
            self.real, self.calls = real, 0

        def unsafe_compute_mask_ptr(self, ptr, size):
            return self.real.unsafe_compute_mask_ptr(ptr, size)

        def is_error(self):
            return self.calls > 1

        def consume_token(self, token):
            self.calls += 1
            return self.calls == 1 and self.real.consume_token(token)

        def get_error(self):
            return "Parser Error: too complex"

    constraint = engine._requests[broken].state.constraint
    constraint._matcher = Failing(constraint._matcher)
    got = {other: [], broken: []}
    reasons = {}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.token_ids
            if out.finished:
                reasons[out.request_id] = (out.finish_reason, out.error)
    assert reasons[broken] == ("error", "structured output failed: Parser Error: too complex")
    assert len(got[broken]) == 1 and reasons[other] == ("length", None)
    assert got[other] == llm.generate([[1, 2, 3]], plain)[0].token_ids
    assert engine.blocks.num_free == engine.blocks.num_blocks
