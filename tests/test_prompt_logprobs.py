"""Prompt logprobs (``SamplingParams.prompt_logprobs``; ``/v1/completions`` with ``echo`` and ``logprobs``, and vLLM's
``prompt_logprobs``): every prompt token's logprob equal to the model's own log-softmax at the position before it
(HF forward + PEFT), for the base model and two adapters in one batch, over chunked prefills and with a prefix the
cache already holds (its blocks are recomputed: a cached block has no logits); and the request lm-evaluation-harness's
``local-completions`` sends for a loglikelihood task, answered as it parses it."""

import copy

import pytest
import torch
from peft import PeftModel

from _serve_helpers import run_state
from lorakit.engine import Engine, SamplingParams
from lorakit.serve import ServeConfig, openai
from lorakit.serve.protocol import ApiError, ChatBody, CompletionBody
from lorakit.serve.state import ServerState

TOLERANCE = {torch.float32: 1e-4}  # relative error of a logprob, by the model's dtype
PROMPTS = ["What is the capital of France? " * 3, "hello there world, says the", "SELECT name FROM users"]


def reference_logprobs(world, ids, adapter):
    """log_softmax of HF + PEFT's logits, float64, [positions, vocab]."""
    base, _, _, paths = world
    model = copy.deepcopy(base) if adapter is None else PeftModel.from_pretrained(copy.deepcopy(base), paths[adapter])
    with torch.no_grad():
        return model.eval()(torch.tensor([ids])).logits[0].double().log_softmax(-1)


def run(engine, jobs):
    """jobs: (prompt ids, params, adapter); each request's outputs, in order of the jobs."""
    rids = [engine.add_request(ids, params, adapter) for ids, params, adapter in jobs]
    outs = {rid: [] for rid in rids}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    return [outs[rid] for rid in rids]


def check(world, ids, adapter, prompt_logprobs, k):
    ref = reference_logprobs(world, ids, adapter)
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for p in range(1, len(ids)):
        lp = prompt_logprobs[p]
        want = ref[p - 1, ids[p]].item()
        assert lp.token_id == ids[p] and abs(lp.logprob - want) <= TOLERANCE[torch.float32] * abs(want), (p, lp)
        assert abs(lp.rank - (int((ref[p - 1] > want).sum()) + 1)) <= 1, (p, lp.rank)  # float32 ties may swap
        top = torch.topk(ref[p - 1], k)
        assert len(lp.top) == k and sorted(lp.top) == sorted(top.indices.tolist()), (p, lp.top)


@pytest.mark.parametrize("budget", [512, 8], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_peft_per_position_in_a_mixed_batch(world, budget):
    base, tokenizer, _, paths = world
    engine = Engine(copy.deepcopy(base), tokenizer, max_loras=2, adapters={n: paths[n] for n in ("sql", "v2")},
                    block_size=4, max_num_batched_tokens=budget)
    ids = [tokenizer.encode(p) for p in PROMPTS]
    adapters = [None, "sql", "v2"]
    jobs = [(i, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2), a) for i, a in zip(ids, adapters)]
    jobs.append((ids[0], SamplingParams(max_tokens=3, temperature=0), "sql"))  # a request that asks for none
    results = run(engine, jobs)
    for (prompt, _, adapter), outs in zip(jobs[:3], results[:3]):
        assert [o.prompt_logprobs is not None for o in outs] == [True] + [False] * (len(outs) - 1)
        check(world, prompt, adapter, outs[0].prompt_logprobs, 2)
    assert all(o.prompt_logprobs is None for o in results[3])


def test_a_cached_prefix_still_gets_its_logprobs(world):
    """The prompt computed once (its blocks in the prefix cache), then asked again with prompt_logprobs: every
    position is computed again and right; the request after it is served from the cache as before."""
    base, tokenizer, _, paths = world
    engine = Engine(copy.deepcopy(base), tokenizer, max_loras=2, adapters={"sql": paths["sql"]}, block_size=4)
    ids = tokenizer.encode(PROMPTS[0])
    greedy = SamplingParams(max_tokens=2, temperature=0)
    (first,) = run(engine, [(ids, greedy, "sql")])
    (scored,) = run(engine, [(ids, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0), "sql")])
    assert scored[0].num_cached_tokens == 0
    check(world, ids, "sql", scored[0].prompt_logprobs, 0)
    (again,) = run(engine, [(ids, greedy, "sql")])
    assert again[0].num_cached_tokens > 0 and [o.token_ids for o in again] == [o.token_ids for o in first]


def test_prompt_logprobs_are_checked():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def served(world, body_of):
    base, tokenizer, _, paths = world
    engine = Engine(copy.deepcopy(base), tokenizer, max_loras=2, adapters={n: paths[n] for n in ("sql", "v2")},
                    block_size=4)
    state = ServerState(engine, ServeConfig(model_name="tiny"))

    return run_state(state, body_of)


def test_the_request_lm_evaluation_harness_sends_is_answered_as_it_parses_it(world):
    """local-completions, loglikelihood: a list of token-id prompts (context + continuation), echo, logprobs=1,
    temperature 0, max_tokens 1 (or 0). It reads choice i's logprobs: the continuation's tokens' token_logprobs summed,
    and whether each continuation token is the top one (is_greedy)."""
    _, tokenizer, _, _ = world
    context, continuation = tokenizer.encode("The capital of France is"), tokenizer.encode(" Paris, of course")
    prompt = context + continuation

    async def body_of(state):
        answers = {}
        for model in ("tiny", "sql", "v2"):
            for max_tokens in (0, 1):
                body = CompletionBody(model=model, prompt=[prompt, context], echo=True, logprobs=1, temperature=0,
                                      max_tokens=max_tokens, seed=1234)
                answers[model, max_tokens] = await (await openai.completions(body, state)).body
        vllm = await (await openai.completions(CompletionBody(model="v2", prompt=prompt, max_tokens=1,
                                                              prompt_logprobs=3), state)).body
        chat = await (await openai.chat(ChatBody(model="sql", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=1, prompt_logprobs=0), state)).body
        return answers, vllm, chat

    answers, vllm, chat = served(world, body_of)
    scored = chat["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == chat["usage"]["prompt_tokens"] and all(len(e) == 1 for e in scored[1:])
    for (model, max_tokens), answer in answers.items():
        ref = reference_logprobs(world, prompt, None if model == "tiny" else model)
        choice = answer["choices"][0]
        block = choice["logprobs"]
        assert block["token_logprobs"][0] is None and block["top_logprobs"][0] is None
        assert len(block["tokens"]) == len(prompt) + (max_tokens == 1)
        if max_tokens == 0:
            text = tokenizer.decode(prompt)
            assert choice["text"] == text and answer["usage"]["completion_tokens"] == 0
        got = sum(block["token_logprobs"][len(context): len(prompt)])
        want = sum(ref[p - 1, prompt[p]].item() for p in range(len(context), len(prompt)))
        assert abs(got - want) <= 1e-4 * abs(want), (model, got, want)
        for p in range(len(context), len(prompt)):  # is_greedy, as the harness computes it
            top_token = max(block["top_logprobs"][p].items(), key=lambda kv: kv[1])[0]
            assert (top_token == block["tokens"][p]) == (ref[p - 1].argmax().item() == prompt[p])
        assert len(answer["choices"][1]["logprobs"]["tokens"]) == len(context) + (max_tokens == 1)
    entries = vllm["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    ref = reference_logprobs(world, prompt, "v2")
    for p in range(1, len(prompt)):
        mine = entries[p][prompt[p]]
        assert abs(mine["logprob"] - ref[p - 1, prompt[p]].item()) <= 1e-4 * abs(mine["logprob"])
        assert len(entries[p]) in (3, 4) and mine["decoded_token"] == tokenizer.decode([prompt[p]])


def test_max_tokens_zero_needs_echo(world):
    async def body_of(state):
        with pytest.raises(ApiError, match="0 only with echo"):
            await openai.completions(CompletionBody(model="tiny", prompt="hi", max_tokens=0), state)
    served(world, body_of)
