"""Helpers of the agent tests: tool-aware chat templates in the style of the three fixture families, a scripted
rollout engine (both the batch and the streaming interface) and tools with controllable behaviour."""
from __future__ import annotations

import random
import time
from collections import deque

from rlhf_mcore.rollout.base import GenerationOutput, RolloutEngine, Sample

# Qwen2.5 style: tools listed in the system turn, tool results grouped into one user turn of <tool_response>s.
QWEN25_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}"
    "{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call functions. Signatures:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nReturn each call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>."
    "<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# Qwen3 style: as above, and assistant turns before the last user query lose their <think> block.
QWEN3_TOOLS = QWEN25_TOOLS.replace(
    "{%- for message in messages %}",
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}{%- for message in messages %}").replace(
    "{%- elif not (loop.first and message['role'] == 'system') %}",
    "{%- elif message['role'] == 'assistant' and loop.index0 < ns.last_query and '</think>' in message['content'] %}"
    "{{- '<|im_start|>assistant\\n' + message['content'].split('</think>')[-1].lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- elif not (loop.first and message['role'] == 'system') %}")

# Llama-3 style: header tokens, <|eot_id|> ends a turn, tool results in the ipython role, no newline between turns.
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_TOOLS = (
    "{{- '<|begin_of_text|>' }}"
    "{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nYou can call these functions:\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson + '\\n' }}{%- endfor %}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


def fixture_tokenizer(model_dir, arch: str):
    """The fixture model's tokenizer with its family's tool-aware template; (tokenizer, end-of-turn id)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if arch == "llama":
        tok.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIALS})
        tok.chat_template = LLAMA3_TOOLS
        return tok, tok.convert_tokens_to_ids("<|eot_id|>")
    tok.chat_template = QWEN3_TOOLS if arch == "qwen3" else QWEN25_TOOLS
    return tok, tok.convert_tokens_to_ids("<|im_end|>")


class ScriptedEngine(RolloutEngine):
    """Answers with `policy(request_id, prompt_ids) -> text`, tokenized, plus the end token; log-probs are seeded
    random numbers. Streaming: each `step()` emits one token of every running request (after `step_s` seconds)."""

    supports_streaming = True

    def __init__(self, tokenizer, end_id: int, policy, step_s: float = 0.0, streaming: bool = True,
                 max_running: int = 1 << 30):
        self.tok, self.end_id, self.policy, self.step_s = tokenizer, end_id, policy, step_s
        self.supports_streaming = streaming
        self.max_running = max_running
        self.generated: dict[int, Sample] = {}  # request id -> the sample returned
        self.max_concurrent = 0

    @property
    def default_stop_token_ids(self):
        return (self.end_id,)

    def _sample(self, request_id: int, prompt: list[int], max_new: int) -> Sample:
        ids = self.tok(self.policy(request_id, prompt), add_special_tokens=False)["input_ids"] + [self.end_id]
        rng = random.Random(request_id)
        reason = "stop"
        if len(ids) > max_new:
            ids, reason = ids[:max_new], "length"
        s = Sample(list(ids), [-rng.random() for _ in ids], reason)
        self.generated[request_id] = s
        return s

    def generate(self, prompts, params, request_ids=None):
        return [GenerationOutput(list(p), [self._sample(r, list(p), params.max_new_tokens)])
                for p, r in zip(prompts, request_ids)]

    # the streaming API (rlhf_mcore.rollout.base: open_stream / submit / step / num_pending / close_stream)
    def open_stream(self, params):
        self.waiting, self.running = deque(), []

    def submit(self, requests):
        self.waiting.extend(requests)

    def step(self):
        from rlhf_mcore.rollout.base import Finished

        while self.waiting and len(self.running) < self.max_running:
            r = self.waiting.popleft()
            self.running.append([r, self._sample(r.request_id, r.prompt_ids, r.max_new_tokens), 0])
        self.max_concurrent = max(self.max_concurrent, len(self.running))
        if self.step_s:
            time.sleep(self.step_s)
        done = []
        for item in self.running:
            item[2] += 1
            if item[2] >= len(item[1].token_ids):
                done.append(item)
        self.running = [x for x in self.running if x not in done]
        return [Finished(request=r, sample=s) for r, s, _ in done]

    @property
    def num_pending(self):
        return len(self.waiting) + len(self.running)

    def close_stream(self):
        self.waiting, self.running = deque(), []

    def update_weights(self, named_tensors):
        pass

    def sleep(self, level=1):
        return 0

    def wake(self):
        pass
