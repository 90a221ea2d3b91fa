"""The tool-call formats of chat model families, one stream class each: `feed(text)` a piece of a model's
output, `finish()` at its end, each giving the `ParsedMessage` (content, calls) of what it can tell so far.

    base.py      ToolCall, ParsedMessage, and reading one call out of a JSON value
    hermes.py    <tool_call>{json}</tool_call> blocks after any text (Hermes, Qwen2.5, Qwen3, SmolLM3)
    whole.py     calls that are the whole output: llama3_json (Llama 3.x), phi4_json (Phi-4-mini)
    pythonic.py  [get_weather(city="Paris")] as the whole output (Gemma 3, Llama 3.2's pythonic template)
"""
