"""The APIs the router serves, one place each (routes.py: which route is which API, and its errors' shape).

chat and completions share one body (openai_body.py); a completion's prompt_embeds are keyed as vLLM keys them
(completions/). The agents' APIs, Responses (responses/) and Anthropic Messages (messages/), are each read
as the chat vLLM renders for them (chat.py), with what the router keeps of them: stored responses' ids,
owners and conversations. What every API's reading gives the conductor's receive stage is read.py's.
"""
