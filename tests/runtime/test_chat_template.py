"""A chat template renders, and its prompt tokenizes, exactly as transformers' `apply_chat_template(...,
add_generation_prompt=True)` does: for templates in the styles the Llama family ships (ChatML as in
SmolLM2 and Qwen2, Llama 3's headers with the BOS written by the template, Llama 2's [INST] with
`raise_exception`), saved by transformers as it saves them (chat_template.jinja or tokenizer_config.json)."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from service.runtime.chat_template import ChatTemplate, ChatTemplateError  # noqa: E402
from service.runtime.tokenizer import Tokenizer  # noqa: E402
from tests.runtime.test_tokenizers import byte_level, sentencepiece_style  # noqa: E402

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for message in messages %}"
          "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim "
          "+ '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
          "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
          "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
          "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if loop.index0 == 0 and system_message != false %}"
          "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
          "{% else %}{% set content = message['content'] %}{% endif %}"
          "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content | trim + ' [/INST]' }}"
          "{% elif message['role'] == 'assistant' %}{{ ' ' + content | trim + ' ' + eos_token }}{% endif %}"
          "{% endfor %}")
TOJSON = "{% for m in messages %}{{ m | tojson }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
TEMPLATES = {"chatml": (CHATML, byte_level), "llama3": (LLAMA3, byte_level), "llama2": (LLAMA2, sentencepiece_style),
             "tojson": (TOJSON, byte_level)}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello! What is 2 + 2?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "naïve café, 東京 😀"},
     {"role": "assistant", "content": "  Bonjour.  "}, {"role": "user", "content": "Encore"}],
]


@pytest.fixture(scope="module", params=list(TEMPLATES))
def saved(request, tmp_path_factory):
    """A tokenizer with a chat template, saved by transformers; (our template, our tokenizer, transformers')."""
    source, build = TEMPLATES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    bos, eos = ("<s>", "</s>") if build is sentencepiece_style else ("<|begin_of_text|>", "<|end_of_text|>")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=build(path), bos_token=bos, eos_token=eos)
    fast.chat_template = source
    fast.save_pretrained(path)
    auto = transformers.AutoTokenizer.from_pretrained(path)
    return ChatTemplate.from_bundle(path), Tokenizer.from_file(path / "tokenizer.json", eos_id=auto.eos_token_id), auto


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_the_prompt_tokenizes_as_transformers_apply_chat_template(saved, conversation):
    template, tokenizer, auto = saved
    messages = CONVERSATIONS[conversation]
    text = template.render(messages, add_generation_prompt=True)
    assert text == auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tokenizer.encode(text, add_special_tokens=False) == list(expected)


def test_the_template_in_tokenizer_config_is_read_too(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "default", "template": LLAMA3}, {"name": "tool_use", "template": "x"}],
         "bos_token": {"content": "<|begin_of_text|>", "special": True}}))
    text = ChatTemplate.from_bundle(tmp_path).render([{"role": "user", "content": "hi"}])
    assert text.startswith("<|begin_of_text|><|start_header_id|>user") and text.endswith("assistant<|end_header_id|>\n\n")


def test_no_template_is_none_and_a_refusal_is_an_error(tmp_path):
    assert ChatTemplate.from_bundle(tmp_path) is None
    template = ChatTemplate(LLAMA2, {"bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        template.render([{"role": "assistant", "content": "first"}])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for %}")


def test_the_sandbox_keeps_python_internals_out():
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])
