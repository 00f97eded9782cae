"""Chat templates for the tiny checkpoints that carry each family's tool-calling format, so
tool calls can be tested offline. Written for this project after the formats the real
checkpoints document (not copies of their templates):

* LFM2 / LFM2-MoE / LFM3: the tool list goes into the system turn as `List of tools:
  <|tool_list_start|>[{json}, ...]<|tool_list_end|>`; the model calls tools with a Python-style
  list, `<|tool_call_start|>[name(arg="v", n=3)]<|tool_call_end|>`; a result comes back in a
  `tool` turn wrapped in `<|tool_response_start|>...<|tool_response_end|>`. All six markers are
  special tokens.
* ZAYA1: a Qwen-style `# Tools` system section with the signatures in `<tools></tools>`; calls are
  `<zyphra_tool_call>` blocks holding `<function=name>` with one `<parameter=key>` per argument;
  results come back in a user turn inside `<zyphra_tool_response>`. The four tags are special
  tokens.

An assistant turn's `tool_calls` (OpenAI history) are written back in the family's call format.
"""

from __future__ import annotations

LFM2_TOOL_TOKENS: tuple[str, ...] = (
    "<|tool_list_start|>",
    "<|tool_list_end|>",
    "<|tool_call_start|>",
    "<|tool_call_end|>",
    "<|tool_response_start|>",
    "<|tool_response_end|>",
)
ZAYA_TOOL_TOKENS: tuple[str, ...] = (
    "<zyphra_tool_call>",
    "</zyphra_tool_call>",
    "<zyphra_tool_response>",
    "</zyphra_tool_response>",
)

# Shared head: split off a leading system message; `fn(tool)` is the function object of an
# OpenAI tool entry ({"type": "function", "function": {...}}) or the entry itself.
_HEAD = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(system='', tools=[]) -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.system = messages[0]['content'] or '' -%}"
    "{%- set messages = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for tool in (tools or []) -%}"
    "{%- set ns.tools = ns.tools + [(tool['function'] if tool['function'] is defined else tool)"
    " | tojson] -%}"
    "{%- endfor -%}"
)
_TAIL = "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"

LFM2_CHAT_TEMPLATE = (
    _HEAD + "{%- if ns.tools -%}"
    "{%- set ns.system = (ns.system + '\\n' if ns.system else '') + 'List of tools: "
    "<|tool_list_start|>[' + ns.tools | join(', ') + ']<|tool_list_end|>' -%}"
    "{%- endif -%}"
    "{%- if ns.system -%}{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<|tool_response_start|>' + (message['content'] or '') + '<|tool_response_end|>' -}}"
    "{%- else -%}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{{- '<|tool_call_start|>[' -}}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set f = call['function'] if call['function'] is defined else call -%}"
    "{{- f['name'] + '(' -}}"
    "{%- for key, value in f['arguments'].items() -%}"
    "{{- key + '=' + (value | tojson) -}}{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{{- ')' -}}{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{{- ']<|tool_call_end|>' -}}"
    "{%- endif -%}"
    "{{- message['content'] or '' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}" + _TAIL
)

ZAYA_CHAT_TEMPLATE = (
    _HEAD + "{%- if ns.tools -%}"
    "{%- set ns.system = (ns.system + '\\n\\n' if ns.system else '') + '# Tools\\n\\n"
    "You may call the functions whose signatures are listed in <tools></tools>:\\n<tools>\\n'"
    " + ns.tools | join('\\n') + '\\n</tools>\\n\\nTo call one, write:\\n<zyphra_tool_call>\\n"
    "<function=NAME>\\n<parameter=ARGUMENT>\\nVALUE\\n</parameter>\\n</function>\\n"
    "</zyphra_tool_call>' -%}"
    "{%- endif -%}"
    "{%- if ns.system -%}{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<zyphra_tool_response>\\n' + (message['content'] or '')"
    " + '\\n</zyphra_tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') -}}"
    "{%- for call in (message['tool_calls'] or []) if message['tool_calls'] is defined -%}"
    "{%- set f = call['function'] if call['function'] is defined else call -%}"
    "{{- '<zyphra_tool_call>\\n<function=' + f['name'] + '>\\n' -}}"
    "{%- for key, value in f['arguments'].items() -%}"
    "{{- '<parameter=' + key + '>\\n' + (value if value is string else value | tojson)"
    " + '\\n</parameter>\\n' -}}"
    "{%- endfor -%}"
    "{{- '</function>\\n</zyphra_tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}" + _TAIL
)

# LFM2-VL: ChatML whose content is a string or a list of parts; an image part is the
# processor's `<image>` marker, which it expands into the image's placeholder tokens.
LFM2_VL_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<image>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}" + _TAIL
)

# LFM3-VL: the same, an image part written as the Qwen2-VL processor's placeholder between
# vision start/end markers (the processor expands `<|image_pad|>` into the image's tokens).
LFM3_VL_CHAT_TEMPLATE = LFM2_VL_CHAT_TEMPLATE.replace(
    "'<image>'", "'<|vision_start|><|image_pad|><|vision_end|>'"
)

# arch -> (chat template, its special tool tokens)
TEMPLATES: dict[str, tuple[str, tuple[str, ...]]] = {
    "lfm2": (LFM2_CHAT_TEMPLATE, LFM2_TOOL_TOKENS),
    "lfm2_moe": (LFM2_CHAT_TEMPLATE, LFM2_TOOL_TOKENS),
    "lfm3": (LFM2_CHAT_TEMPLATE, LFM2_TOOL_TOKENS),
    "zaya1": (ZAYA_CHAT_TEMPLATE, ZAYA_TOOL_TOKENS),
}
