"""Chat templates in the shapes real models use, each with the content format vLLM 0.32 detects for it.

The shapes: Qwen2-VL / Gemma 3 (a loop over each message's content), Llama 3.2 Vision (a filtered loop),
Mistral (messages set from a slice first), a macro given the content, a top-level ``content`` variable,
and templates that only print content or loop over something else.
"""

from __future__ import annotations

_END = "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"

PARTS_LOOP = (
    "{% for message in messages %}<|{{ message.role }}|>\n"
    "{% if message.content is string %}{{ message.content }}"
    "{% else %}{% for part in message.content %}{% if part.type == 'text' %}{{ part.text }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}" + _END
)

TEMPLATES: dict[str, tuple[str, str]] = {
    "prints content": (
        "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
        + _END,
        "string",
    ),
    "loops over parts": (PARTS_LOOP, "openai"),
    "loops over filtered parts": (
        "{% for message in messages %}<|{{ message['role'] }}|>\n"
        "{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}{{ part['text'] }}"
        "{% endfor %}\n{% endfor %}" + _END,
        "openai",
    ),
    "loops over a slice of messages": (
        "{% set loop_messages = messages[1:] %}{{ messages[0]['content'] }}\n"
        "{% for message in loop_messages %}[{{ message.role }}] "
        "{% for block in message.content %}{{ block.text }}|{% endfor %}\n{% endfor %}",
        "openai",
    ),
    "a macro given the content": (
        "{% macro render(items) %}{% for item in items %}{{ item.text }}{% endfor %}{% endmacro %}"
        "{% for message in messages %}<|{{ message.role }}|>\n"
        "{% if message.content is string %}{{ message.content }}{% else %}{{ render(message.content) }}{% endif %}"
        "\n{% endfor %}" + _END,
        "openai",
    ),
    "a content variable": (
        "{% for message in messages %}{% set content = message.content %}<|{{ message.role }}|>\n"
        "{% if content is string %}{{ content }}{% else %}{% for c in content %}{{ c.text }}{% endfor %}"
        "{% endif %}\n{% endfor %}" + _END,
        "openai",
    ),
    "loops over tool calls only": (
        "{% for message in messages %}<|{{ message.role }}|>\n{{ message.content }}"
        "{% for call in message.tool_calls or [] %}<call>{{ call.function.name }}</call>{% endfor %}\n"
        "{% endfor %}" + _END,
        "string",
    ),
    "loops over the first message's content": (
        "{% for part in messages[0]['content'] %}{{ part }}{% endfor %}"
        "{% for message in messages[1:] %}{{ message['content'] }}{% endfor %}",
        "string",
    ),
    "a tuple loop over messages": (
        "{% for i, message in messages | batch(1) %}{% endfor %}"
        "{% for message in messages %}{% for p in message.content %}{{ p.text }}{% endfor %}{% endfor %}",
        "string",
    ),
}
